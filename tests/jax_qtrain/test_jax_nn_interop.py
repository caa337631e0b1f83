"""Our MXFP8 copies and jax's own MXFP8 (`jax.nn.scaled_dot_general` / `scaled_matmul`).

jax 0.11.2 quantizes MXFP8 as TransformerEngine does (block amax / 448 rounded *up* to an E8M0
power of two, codes by round-to-nearest-even): an independent implementation of the rule our
reference follows, and the reason a `QuantizedTensor`'s rowwise copy can go straight into
`jax.nn.scaled_matmul` (docs/formats.md, "MXFP8 and jax.nn"). NVFP4 has no such agreement:
jax divides by a caller-given global scale and computes the block scales in the input dtype,
where TE multiplies by its encode scale in float32 (docs/formats.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# (jax keeps its quantizer private; the version is pinned, pyproject.toml.)
from jax._src.cudnn.scaled_matmul_stablehlo import quantize as jax_mx_quantize

import jax_qtrain as jq
from jax_qtrain.formats import mxfp8
from jax_qtrain.formats.spec import QuantizerSpec

SPEC = QuantizerSpec("mxfp8", jnp.float8_e4m3fn, (1, 32))


def _blocks_with_amax(amax: np.ndarray, seed: int) -> np.ndarray:
    """One 32-element block per amax: the amax itself, then values of either sign below it."""
    rng = np.random.default_rng(seed)
    fractions = rng.uniform(-1, 1, size=(amax.size, 32)).astype(np.float32)
    blocks = fractions * amax.astype(np.float32)[:, None]
    blocks[:, 0] = amax
    return blocks


def _as_bytes(array: jax.Array) -> np.ndarray:
    return np.asarray(jax.lax.bitcast_convert_type(array, jnp.uint8))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_jax_quantizes_every_finite_block_as_we_do_but_the_subnormal_scale_range(dtype):
    # Every positive finite bf16 as a block amax (the bf16 case is exhaustive), plus random
    # float32 amaxes over the whole exponent range; then zero blocks.
    every_bf16 = np.arange(1, 0x7F80, dtype=np.uint16).view(jnp.bfloat16)
    amax = every_bf16.astype(np.float32)
    if dtype == jnp.float32:
        bits = np.random.default_rng(1).integers(1, 0x7F800000, 50_000, dtype=np.uint32)
        amax = np.concatenate([amax, bits.view(np.float32)])
    x = jnp.asarray(np.concatenate([_blocks_with_amax(amax, 0), np.zeros((8, 32), np.float32)]))
    x = x.astype(dtype)
    block_amax = np.abs(np.asarray(x.astype(jnp.float32))).max(axis=1)

    codes, scale_bytes = mxfp8.quantize(x, SPEC)
    jax_codes, jax_scales = jax.jit(
        lambda v: jax_mx_quantize(v, jax.nn.get_scaled_dot_general_config("mxfp8"))
    )(x)

    differ = (_as_bytes(codes) != _as_bytes(jax_codes)).any(axis=1) | (
        np.asarray(scale_bytes)[:, 0] != _as_bytes(jax_scales)[:, 0]
    )
    # Where they differ: amax / 448 is a subnormal float32, which XLA:CPU flushes to zero
    # (jax gives byte 0; TE and we, computing the byte from integers, give TE's 0 or 1).
    normal_from, _ = mxfp8._subnormal_v_thresholds(448.0)
    subnormal_v = (block_amax.view(np.uint32) < normal_from) & (block_amax > 0)
    assert differ.sum() > 0 and not (differ & ~subnormal_v).any()
    assert (np.asarray(scale_bytes)[differ, 0] == 1).all()


def test_a_quantized_tensor_goes_into_jax_nn_scaled_matmul():
    # x @ wᵀ by jax's MXFP8 GEMM on our copies equals jax's own quantize-and-multiply, bit for
    # bit: the E4M3 codes as they are, the scale bytes bitcast to float8_e8m0fnu.
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (64, 256), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(keys[1], (96, 256), jnp.float32) * 0.02).astype(jnp.bfloat16)
    recipe = jq.MXFP8BlockScaling()
    qx, qw = jq.quantize(x, recipe, "input"), jq.quantize(w, recipe, "weight")

    def e8m0(scale_bytes):
        return jax.lax.bitcast_convert_type(scale_bytes, jnp.float8_e8m0fnu)

    ours = jax.nn.scaled_matmul(
        qx.rowwise_data[None],
        qw.rowwise_data[None],
        e8m0(qx.rowwise_scale_inv)[None],
        e8m0(qw.rowwise_scale_inv)[None],
        preferred_element_type=jnp.float32,
    )[0]
    theirs = jax.nn.scaled_dot_general(
        x,
        w,
        (((1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32,
        configs=[jax.nn.get_scaled_dot_general_config("mxfp8")] * 3,
    )
    np.testing.assert_array_equal(ours, theirs)
    # ... and both are our dequantized product.
    dequantized = qx.dequantize(dtype=jnp.float32) @ qw.dequantize(dtype=jnp.float32).T
    np.testing.assert_allclose(ours, dequantized, rtol=1e-5, atol=1e-5)
