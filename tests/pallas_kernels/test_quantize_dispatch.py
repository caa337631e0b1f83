"""`jax_qtrain.quantize` routes to the Pallas kernels (jax_qtrain/kernels.py) and gets the
reference's bits: on CPU through Mosaic GPU's interpreter with backend="pallas", on the H200
with backend="auto"."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import jax_qtrain as jq
from jax_qtrain import kernels

from ..jax_qtrain.adversarial import adversarial_matrix

ON_GPU = any(d.platform == "gpu" for d in jax.devices())

CASES = [
    (jq.MXFP8BlockScaling(), "input"),
    (jq.MXFP8BlockScaling(fp8_format="hybrid"), "grad"),
    (jq.NVFP4BlockScaling(), "input"),  # Hadamard on the columnwise copy
    (jq.NVFP4BlockScaling(), "grad"),  # Hadamard + stochastic rounding
    (jq.NVFP4BlockScaling(), "weight"),  # 16×16 blocks
    (jq.Float8BlockScaling(), "input"),  # 1×128
    (jq.Float8BlockScaling(power_2_scale=False), "weight"),  # 128×128, fp32 scales
]


def leaf_bits(q) -> list[np.ndarray]:
    return [np.atleast_1d(np.asarray(leaf)).view(np.uint8) for leaf in jax.tree.leaves(q)]


def assert_same(got, want) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(leaf_bits(got), leaf_bits(want), strict=True):
        np.testing.assert_array_equal(g, w)


@functools.cache
def _adversarial(shape, seed):
    return adversarial_matrix(*shape, seed, block=16)


def sample(shape, dtype, seed):
    return jnp.asarray(_adversarial(shape, seed)).astype(dtype)


def test_kernels_cover_the_block_formats():
    x_shape = (256, 256)
    on = kernels.on_gpu()
    for recipe, role in CASES:
        spec = recipe.spec(role)
        assert kernels.quantize_kernel_applies(spec, x_shape, jnp.bfloat16) == on
        assert not kernels.quantize_kernel_applies(spec, x_shape, jnp.float16)
    # No kernel: 16×16 NVFP4 blocks with a Hadamard transform (no recipe asks for that),
    # per-tensor FP8 (quantized by XLA; only its grouped form uses the cast-transpose kernel).
    rotated_weight = dataclasses.replace(
        jq.NVFP4BlockScaling().spec("weight"), hadamard_columnwise=True
    )
    assert not kernels.quantize_kernel_applies(rotated_weight, x_shape, jnp.bfloat16)
    assert not kernels.quantize_kernel_applies(
        jq.Float8CurrentScaling().spec("input"), x_shape, jnp.bfloat16
    )


def test_pallas_backend_refuses_what_it_cannot_do():
    x = jnp.ones((128, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="does not cover"):
        jq.quantize(x.astype(jnp.float16), jq.NVFP4BlockScaling(), "weight", backend="pallas")
    with pytest.raises(NotImplementedError, match="no Pallas quantize kernel"):
        jq.quantize(x, jq.Float8CurrentScaling(), backend="pallas")


@pytest.mark.skipif(ON_GPU, reason="the interpreter path is the CPU's")
@pytest.mark.parametrize("recipe, role", CASES, ids=lambda c: getattr(c, "name", c))
def test_pallas_backend_matches_reference_in_interpreter(recipe, role):
    x = sample((144, 256), jnp.bfloat16, 3)  # padded to 256×256 inside the kernels
    key = jax.random.key(7)
    want = jq.quantize(x, recipe, role, columnwise=True, key=key, backend="reference")
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        got = jq.quantize(x, recipe, role, columnwise=True, key=key, backend="pallas")
    assert_same(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe, role", CASES, ids=lambda c: getattr(c, "name", c))
def test_auto_backend_uses_kernels_on_gpu_and_matches_reference(recipe, role):
    dtype = jnp.bfloat16
    # A kernel path not yet verified on the GPU runs under "pallas" here; "auto" skips it.
    awaiting = kernels.awaiting_gpu_verification(recipe.spec(role))
    assert kernels.quantize_kernel_applies(recipe.spec(role), (1024, 1536), dtype) != awaiting
    x = sample((1024, 1536), dtype, 4)
    key = jax.random.key(8)
    want = jq.quantize(x, recipe, role, columnwise=True, key=key, backend="reference")
    backend = "pallas" if awaiting else "auto"
    got = jq.quantize(x, recipe, role, columnwise=True, key=key, backend=backend)
    assert_same(got, want)


# NVFP4 weights 129 / 263 blocks of 16 wide: the block amax kernel gives the quantize kernel its
# 16×16 block amaxes and the global amax (jax_qtrain/kernels.py::weight_block_amax_bits).
WIDE_WEIGHT = {"cpu": (32, 2064), "gpu": (520, 4200)}


def _nvfp4_weight(shape, backend):
    x = sample(shape, jnp.bfloat16, 6)
    return jq.quantize(x, jq.NVFP4BlockScaling(), "weight", columnwise=True, backend=backend)


@pytest.mark.skipif(ON_GPU, reason="the interpreter path is the CPU's")
def test_nvfp4_weight_on_the_block_amax_kernel_matches_reference_in_interpreter():
    want = _nvfp4_weight(WIDE_WEIGHT["cpu"], "reference")
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        got = _nvfp4_weight(WIDE_WEIGHT["cpu"], "pallas")
    assert_same(got, want)


@pytest.mark.gpu
def test_nvfp4_weight_on_the_block_amax_kernel_matches_reference_on_gpu():
    assert_same(
        _nvfp4_weight(WIDE_WEIGHT["gpu"], "auto"), _nvfp4_weight(WIDE_WEIGHT["gpu"], "reference")
    )


def test_block_amaxes_are_passed_for_nvfp4_weights_only():
    x = jnp.ones((32, 64), jnp.float32)
    weight = jq.NVFP4BlockScaling().spec("weight")
    bits = kernels.weight_block_amax_bits(x, weight)
    assert bits.shape == (2, 4) and bits.dtype == jnp.uint32
    amaxes = kernels.tensor_amaxes(x, weight, ["rowwise", "columnwise"], block_amax_bits=bits)
    assert float(amaxes["rowwise"]) == float(amaxes["columnwise"]) == 1.0
    activation = jq.NVFP4BlockScaling().spec("input")
    assert kernels.weight_block_amax_bits(x, activation) is None
    with pytest.raises(ValueError, match="block_amax_bits: NVFP4 16×16 blocks only"):
        kernels.quantize(
            x,
            activation,
            input_dtype=x.dtype,
            amaxes={"rowwise": None},
            seeds={},
            block_amax_bits=bits,
        )


# --- stochastic rounding of a shard (position_offset) ------------------------------------------
# A shard 4096 rows and 256 columns into a larger gradient: its random bits must be those of its
# elements' places in the whole tensor, on the kernel as on the reference.
SHARD_OFFSET = (4096, 256)


def _positioned(backend):
    x = sample((144, 256), jnp.float32, 5)
    return jq.quantize(
        x,
        jq.NVFP4BlockScaling(),
        "grad",
        columnwise=True,
        key=jax.random.key(9),
        backend=backend,
        position_offset=SHARD_OFFSET,
    )


@pytest.mark.skipif(ON_GPU, reason="the interpreter path is the CPU's")
def test_pallas_backend_rounds_a_shard_like_the_reference_in_interpreter():
    want = _positioned("reference")
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        got = _positioned("pallas")
    assert_same(got, want)


def test_only_nvfp4_kernel_takes_a_position_offset():
    assert kernels.kernel_takes_position_offset(jq.NVFP4BlockScaling().spec("grad"))
    assert not kernels.kernel_takes_position_offset(jq.MXFP8BlockScaling().spec("grad"))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["pallas", "auto"])
def test_kernel_rounds_a_shard_like_the_reference_on_gpu(backend):
    assert_same(_positioned(backend), _positioned("reference"))
