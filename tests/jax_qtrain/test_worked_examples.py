"""numerics.md's worked examples, asserted on bit patterns through the public API."""

import jax.numpy as jnp
import numpy as np
import pytest

import jax_qtrain as jq
from jax_qtrain.formats import common, fp8_tensor, mxfp8, nvfp4


def bits32(v) -> int:
    return int(np.asarray(v, np.float32).view(np.uint32))


def code_bytes(q, usage="rowwise") -> np.ndarray:
    return np.asarray(q.rowwise_data if usage == "rowwise" else q.columnwise_data).view(np.uint8)


# --- §1 FP8 per-tensor current scaling ----------------------------------------------------------
@pytest.mark.parametrize(
    "values, pow2, fp8_format, expected_scale_bits, expected_codes",
    [
        ([3.5, 1.0], False, "e4m3", 0x43000000, [None, 0x70]),
        ([100.0], False, "e4m3", 0x408F5C29, [0x7E]),
        ([100.0, 37.0], True, "e4m3", 0x40800000, [0x7C, 0x71]),
    ],
)
def test_fp8_current_scaling_table(values, pow2, fp8_format, expected_scale_bits, expected_codes):
    recipe = jq.Float8CurrentScaling(fp8_format=fp8_format, power_2_scale=pow2)
    q = jq.quantize(jnp.array([values], jnp.float32), recipe)
    scale = np.float32(1.0) / np.asarray(q.rowwise_scale_inv)
    assert bits32(scale) == expected_scale_bits
    for got, want in zip(code_bytes(q)[0], expected_codes, strict=False):
        if want is not None:
            assert got == want


def test_fp8_current_scaling_e5m2_gradient():
    q = jq.quantize(jnp.array([[1000.0, 300.0]], jnp.float32), jq.Float8CurrentScaling(), "grad")
    assert q.spec.dtype == jnp.float8_e5m2
    assert np.float32(1.0) / np.asarray(q.rowwise_scale_inv) == pytest.approx(57.344, rel=1e-6)
    assert code_bytes(q)[0, 1] == 0x74  # 300 → 17203.2 → 16384


@pytest.mark.parametrize("amax", [0.0, np.inf, np.nan])
def test_fp8_degenerate_amax_gives_scale_one(amax):
    q = jq.quantize(jnp.array([[amax, 0.0]], jnp.float32), jq.Float8CurrentScaling())
    assert float(q.rowwise_scale_inv) == 1.0


@pytest.mark.parametrize("pow2, expected", [(False, 0x7F7FFFFF), (True, 0x7F000000)])
def test_fp8_tiny_amax_scale_is_flt_max(pow2, expected):
    # amax 1e-45 (a subnormal): 448 / amax overflows, so the scale is FLT_MAX (pow2: 2^127).
    scale = fp8_tensor.compute_scale(
        jnp.float32(1e-45), 448.0, power_2_scale=pow2, amax_epsilon=0.0
    )
    assert bits32(scale) == expected


# --- §2 FP8 block scaling -----------------------------------------------------------------------
def test_fp8_block_pow2_example():
    x = np.zeros((1, 128), np.float32)
    x[0, :2] = [3.0, -2.9]
    q = jq.quantize(jnp.asarray(x), jq.Float8BlockScaling())
    assert float(q.rowwise_scale_inv[0, 0]) == 1 / 128
    assert list(code_bytes(q)[0, :2]) == [0x7C, 0xFC]
    assert float(q.dequantize(dtype=jnp.float32)[0, 1]) == -3.0


@pytest.mark.parametrize(
    "dtype, expected_bits", [(jnp.bfloat16, 0x7F7F0000), (jnp.float32, 0x7F7FFFFF)]
)
def test_fp8_block_overflowing_scale_is_input_dtype_max(dtype, expected_bits):
    # fp32 scales: amax 1e-37 → 448/amax overflows → the input dtype's max (bf16: 3.3895314e38).
    x = jnp.full((1, 128), 1e-37, jnp.float32).astype(dtype)
    scale = fp8_tensor.compute_scale(
        common.block_amax(x.astype(jnp.float32), 1, 128),
        448.0,
        power_2_scale=False,
        amax_epsilon=0.0,
        overflow_scale=common.input_dtype_max(dtype),
    )
    assert bits32(scale[0, 0]) == expected_bits


def test_fp8_block_pow2_overflow_scale_inv_is_exact_subnormal():
    # With power-of-2 scales the overflow scale is 2^127 and scale_inv the subnormal 2^-127,
    # built from bits so that XLA:CPU's flush-to-zero cannot lose it.
    x = jnp.full((1, 128), 1e-37, jnp.float32)
    q = jq.quantize(x, jq.Float8BlockScaling())
    assert bits32(q.rowwise_scale_inv[0, 0]) == 0x00400000


# --- §3 MXFP8 ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "amax, fp8_max, expected",
    [
        (448.0, 448.0, 0x7F),
        (449.0, 448.0, 0x80),
        (500.0, 448.0, 0x80),
        (896.0, 448.0, 0x80),
        (1.0, 448.0, 0x77),
        (2.0**-118, 448.0, 0x01),
        (2.0**-119, 448.0, 0x00),
        (0.0, 448.0, 0x00),
        (np.inf, 448.0, 0xFE),
        (np.nan, 448.0, 0xFF),
        (1000.0, 57344.0, 0x7A),
    ],
)
def test_e8m0_table(amax, fp8_max, expected):
    assert int(mxfp8.e8m0_from_amax(jnp.float32(amax), fp8_max)) == expected


@pytest.mark.parametrize(
    "block_values, expected_codes",
    [
        ([449.0], [0x76]),
        ([500.0, 100.0], [0x78, 0x64]),
        ([1.0, 0.3, -0.3], [0x78, 0x6A, 0xEA]),
    ],
)
def test_mxfp8_codes(block_values, expected_codes):
    x = np.zeros((1, 32), np.float32)
    x[0, : len(block_values)] = block_values
    q = jq.quantize(jnp.asarray(x), jq.MXFP8BlockScaling())
    assert list(code_bytes(q)[0, : len(expected_codes)]) == expected_codes


def test_mxfp8_floor_would_differ():
    # 500 dequantizes to 512 under RCEIL; the OCP FLOOR rule would give 448.
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = 500.0
    q = jq.quantize(jnp.asarray(x), jq.MXFP8BlockScaling())
    assert float(q.dequantize(dtype=jnp.float32)[0, 0]) == 512.0


# --- §4 NVFP4 ---------------------------------------------------------------------------------
NVFP4_1D = jq.QuantizerSpec("nvfp4", jnp.float4_e2m1fn, (1, 16))


@pytest.mark.parametrize(
    "gamax, block, expected_scale, expected_bytes",
    [
        (6.0, [3, 1.3, -0.7, 0.2], 0x76, [0x57, 0x1B]),
        (10.0, [10, 4, -2.5, 0.1], 0x7E, [0x47, 0x0B]),
    ],
)
def test_nvfp4_table(gamax, block, expected_scale, expected_bytes):
    x = np.zeros((1, 16), np.float32)
    x[0, :4] = block
    packed, scale = nvfp4.quantize(jnp.asarray(x), NVFP4_1D, global_amax=jnp.float32(gamax))
    assert int(np.asarray(scale).view(np.uint8)[0, 0]) == expected_scale
    assert list(np.asarray(packed)[0, :2]) == expected_bytes


def test_nvfp4_operation_order_at_e4m3_tie():
    # gamax 3, vmax 0.140625: TE's order gives 21.000002 → 22 (0x5B); the paper's order gives 20.
    x = np.zeros((1, 16), np.float32)
    x[0, 0] = 0.140625
    _, scale = nvfp4.quantize(jnp.asarray(x), NVFP4_1D, global_amax=jnp.float32(3.0))
    assert int(np.asarray(scale).view(np.uint8)[0, 0]) == 0x5B


def test_nvfp4_zero_tensor():
    x = jnp.zeros((16, 32), jnp.float32)
    q = jq.quantize(x, jq.NVFP4BlockScaling(), "input", columnwise=True)
    assert float(nvfp4.global_encode_scale(q.rowwise_amax)) == 1.0
    assert not np.asarray(q.rowwise_data).any()
    assert not np.asarray(q.rowwise_scale_inv).view(np.uint8).any()
    assert not np.asarray(q.dequantize("columnwise")).any()


def test_global_encode_scale_guards():
    f = lambda a: float(nvfp4.global_encode_scale(jnp.float32(a)))
    assert f(0.0) == 1.0
    assert f(np.inf) == 1.0
    assert bits32(f(1e-40)) == 0x7F7FFFFF
    assert bits32(f(np.nan)) == 0x7F7FFFFF  # CUDA fminf semantics


def test_hadamard_checks():
    m = nvfp4.hadamard_matrix()
    np.testing.assert_allclose(m @ m.T, np.eye(16), atol=1e-12)
    e0 = np.zeros((1, 16), np.float32)
    e0[0, 0] = 1
    np.testing.assert_array_equal(np.asarray(nvfp4.hadamard16(e0)), np.full((1, 16), 0.25))
    ones = np.ones((1, 16), np.float32)
    np.testing.assert_array_equal(
        np.asarray(nvfp4.hadamard16(ones))[0], [-1, 0, 1, 0, 1, 0, -1, 0, 1, 2, 1, 0, 1, 0, 1, -2]
    )
    mask = sum(1 << i for i, s in enumerate(nvfp4.HADAMARD_SIGNS) if s < 0)
    assert mask == 0xD7E8


def test_e2m1_threshold_table():
    inputs = [0, 0.25, 0.26, 0.74, 0.75, 1.25, 1.26, 1.74, 1.75, 2.5, 2.51, 3.49, 3.5, 5, 5.01, 6]
    expected = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]
    got = nvfp4.e2m1_round_nearest_even(jnp.array(inputs, jnp.float32))
    assert list(np.asarray(got)) == expected
    neg = nvfp4.e2m1_round_nearest_even(jnp.array([-0.25, -0.1, -0.0, np.nan, -6], jnp.float32))
    assert list(np.asarray(neg)) == [0x8, 0x8, 0x0, 0x0, 0xF]
