"""The jnp references against the independent NumPy oracle, bit for bit.

On CPU, XLA flushes float32 subnormals, so these tests draw inputs without subnormal values and
with block maxima whose scale arithmetic stays normal where the reference cannot avoid floats;
the `gpu` tests at the bottom repeat them with subnormals on the H200, where nothing is flushed.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_qtrain.formats import common, fp8_block, fp8_tensor, mxfp8, nvfp4
from jax_qtrain.formats.spec import QuantizerSpec

from . import oracle
from .adversarial import adversarial_matrix

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def as_bytes(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


def as_words(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def _mxfp8_case(x, dtype):
    spec = QuantizerSpec("mxfp8", dtype, (1, 32))
    codes, scales = jax.jit(lambda v: mxfp8.quantize(v, spec))(x)
    want_codes, want_scales = oracle.mxfp8(x, dtype)
    np.testing.assert_array_equal(as_bytes(scales), want_scales)
    np.testing.assert_array_equal(as_bytes(codes), want_codes)


def _fp8_block_case(x, dtype, block, pow2):
    spec = QuantizerSpec("fp8_block", dtype, block, power_2_scale=pow2)
    codes, scale_inv = jax.jit(lambda v: fp8_block.quantize(v, spec, input_dtype=jnp.float32))(x)
    want_codes, want_scale_inv = oracle.fp8_block(x, dtype, block, pow2=pow2)
    np.testing.assert_array_equal(as_words(scale_inv), want_scale_inv)
    np.testing.assert_array_equal(as_bytes(codes), want_codes)


def _fp8_tensor_case(x, dtype, pow2):
    spec = QuantizerSpec("fp8", dtype, power_2_scale=pow2)
    codes, scale_inv = jax.jit(lambda v: fp8_tensor.quantize(v, spec, tensor_amax=common.amax(v)))(
        x
    )
    want_codes, want_scale_inv = oracle.fp8_tensor(x, dtype, pow2=pow2)
    assert int(as_words(scale_inv)) == int(want_scale_inv)
    np.testing.assert_array_equal(as_bytes(codes), want_codes)


def _nvfp4_case(x, block, stochastic=False):
    spec = QuantizerSpec("nvfp4", jnp.float4_e2m1fn, block, stochastic_rounding=stochastic)
    gamax = np.float32(np.nanmax(np.abs(x))) if not np.isnan(x).any() else np.float32(np.nan)
    seed = jnp.uint32(12345)
    packed, scales = jax.jit(
        lambda v: nvfp4.quantize(v, spec, global_amax=common.amax(v), seed=seed)
    )(x)
    uniforms = np.asarray(nvfp4.stochastic_uniforms(x.shape, seed)) if stochastic else None
    want_codes, want_scales, _ = oracle.nvfp4(x, block, gamax, uniforms)
    np.testing.assert_array_equal(as_bytes(scales), want_scales)
    np.testing.assert_array_equal(np.asarray(nvfp4.unpack_codes(packed)), want_codes)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_mxfp8_matches_oracle(seed, dtype):
    _mxfp8_case(adversarial_matrix(24, 256, seed), dtype)


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
@pytest.mark.parametrize("pow2", [True, False])
def test_fp8_block_matches_oracle(seed, block, pow2):
    x = adversarial_matrix(128, 256, seed, block=128)
    if not pow2:  # fp32 scale_inv of a block with amax < 448·2^-126 is subnormal (flushed here)
        x = np.where(np.abs(x) < 2.0**-100, 0, x).astype(np.float32)
    _fp8_block_case(x, E4M3, block, pow2)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("pow2", [True, False])
def test_fp8_tensor_matches_oracle(seed, dtype, pow2):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((16, 48)) * 2.0 ** rng.integers(-30, 30)).astype(np.float32)
    if seed == 3:
        x[3, 5] = np.inf
    _fp8_tensor_case(x, dtype, pow2)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("block", [(1, 16), (16, 16)])
def test_nvfp4_matches_oracle(seed, block):
    x = adversarial_matrix(32, 128, seed, block=16, specials=False)
    # The global scale couples all blocks: keep the tensor's dynamic range inside what the
    # float32 scale arithmetic represents without subnormals (tiny blocks get zero scales).
    _nvfp4_case(x, block)


@pytest.mark.parametrize("seed", range(2))
def test_nvfp4_stochastic_matches_oracle_given_the_same_bits(seed):
    rng = np.random.default_rng(seed)
    _nvfp4_case(rng.standard_normal((32, 64)).astype(np.float32), (1, 16), stochastic=True)


def test_nvfp4_nan_and_inf_blocks():
    x = np.random.default_rng(0).standard_normal((2, 32)).astype(np.float32)
    x[0, 3] = np.nan
    x[1, 20] = np.inf
    spec = QuantizerSpec("nvfp4", jnp.float4_e2m1fn, (1, 16))
    for gamax in (np.float32(7.0), np.float32(np.nan), np.float32(np.inf)):
        packed, scales = nvfp4.quantize(jnp.asarray(x), spec, global_amax=jnp.float32(gamax))
        want_codes, want_scales, _ = oracle.nvfp4(x, (1, 16), gamax)
        np.testing.assert_array_equal(as_bytes(scales), want_scales)
        np.testing.assert_array_equal(np.asarray(nvfp4.unpack_codes(packed)), want_codes)


def test_e2m1_rne_matches_ml_dtypes():
    rng = np.random.default_rng(0)
    v = np.concatenate(
        [rng.uniform(-6, 6, 200_000), np.arange(-24, 25) / 4.0, np.arange(-48, 49) / 8.0]
    ).astype(np.float32)
    got = np.asarray(nvfp4.e2m1_round_nearest_even(jnp.asarray(v)))
    np.testing.assert_array_equal(got, oracle.e2m1_rne(v))
    # And the value table agrees with ml_dtypes' float4_e2m1fn.
    all_codes = np.arange(16, dtype=np.uint8)
    np.testing.assert_array_equal(
        np.asarray(nvfp4.code_values(jnp.asarray(all_codes))),
        all_codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32),
    )


def test_fp8_saturating_cast():
    v = jnp.array([464.0, 480.0, 1e6, np.inf, -np.inf, np.nan, -np.nan], jnp.float32)
    e4 = as_bytes(common.saturating_cast(v, E4M3))
    assert list(e4) == [0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F, 0x7F]  # NaN: CUDA's canonical 0x7F
    e5 = as_bytes(common.saturating_cast(v, E5M2))
    assert list(e5[2:]) == [0x7B, 0x7B, 0xFB, 0x7F, 0x7F]  # ±57344; NaN → 0x7F (not XLA's 0x7E)


# --- GPU: the same comparisons with subnormal inputs and intermediates ----------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_gpu_references_match_oracle_with_subnormals(seed):
    x = adversarial_matrix(128, 512, seed, block=32, subnormals=True)
    for dtype in (E4M3, E5M2):
        _mxfp8_case(x, dtype)
        _fp8_tensor_case(x, dtype, pow2=False)
    for block in ((1, 128), (128, 128)):
        _fp8_block_case(x, E4M3, block, pow2=True)
        _fp8_block_case(x, E4M3, block, pow2=False)
    x16 = adversarial_matrix(128, 512, seed, block=16, subnormals=True, specials=False)
    for block in ((1, 16), (16, 16)):
        _nvfp4_case(x16, block)
    _nvfp4_case(x16, (1, 16), stochastic=True)
    # NaN and Inf blocks: a NaN global amax gives S_enc = FLT_MAX and a subnormal S_dec, which
    # only the GPU keeps (XLA:CPU flushes it; docs/formats.md).
    _nvfp4_case(adversarial_matrix(128, 512, seed, block=16, subnormals=False), (1, 16))
