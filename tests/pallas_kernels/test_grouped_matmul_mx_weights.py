"""bf16 tokens x MXFP8 (stop 46) and NVFP4 (stop 47) weights dequantized in registers
(issue 5): interpreter, cross-lowering, bad inputs. The GPU tests (the register-operand wgmma,
which the interpreter does not have) are in test_grouped_matmul_gpu.py.

The interpreter runs the kernel with the converted weights staged through a bf16 SMEM tile
(module docstring): the tiling, the conversion and the transposed epilogue are what these
tests check. Exact sums (small integer tokens, power-of-two weights) make the f32 accumulation
order irrelevant, so those outputs must equal the float64 reference rounded to bf16 bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.h200_lowering import mosaic_modules
from pallas_kernels.dequantize import dequantize_nvfp4
from pallas_kernels.grouped_matmul_mx_weights import (
    DEFAULT_MXFP8_WEIGHTS_CONFIG,
    TWO_STEPS_WEIGHTS_CONFIG,
    byte_permute,
    e2m1_word_as_bf16_bits,
    even_odd_columns,
    grouped_matmul_mxfp8_weights,
    grouped_matmul_nvfp4_weights,
)
from tests.pallas_kernels.test_grouped_matmul import (
    BF16,
    E4M3,
    E5M2,
    F32,
    PACKED_CASES,
    assert_close,
    f64,
    gapped_lhs,
    keys,
    ref_packed_rows,
    ref_ragged_rows,
)
from tests.pallas_kernels.test_grouped_matmul_mx import dequant_mxfp8_bf16, random_mxfp8

# 64-token tiles, two SMs: small interpreted grids.
TINY = dataclasses.replace(
    DEFAULT_MXFP8_WEIGHTS_CONFIG, tile_m=64, max_concurrent_steps=2, num_sms=2, grid_tile_width=1
)


def run(lhs, rhs, rhs_scale, sizes, config=TINY):
    return grouped_matmul_mxfp8_weights(
        lhs, rhs, rhs_scale, jnp.asarray(sizes, jnp.int32), config=config, interpret=True
    )


def exact_operands(seed: int, rows: int, k: int, groups: int, cols: int, fp8_dtype):
    """Integer tokens in [-3, 3] and codes in {0, ±0.5, ±1, ±2} with scale bytes 126..128: every
    product and partial sum is exact in f32 (|sum| ≤ 3 · 8 · K)."""
    k_lhs, k_codes, k_scale = keys(3, seed=seed)
    lhs = jax.random.randint(k_lhs, (rows, k), -3, 4).astype(BF16)
    choices = jnp.asarray([0.0, 0.5, -0.5, 1.0, -1.0, 2.0, -2.0], jnp.float32)
    codes = choices[jax.random.randint(k_codes, (groups, cols, k), 0, 7)].astype(fp8_dtype)
    scale = jax.random.randint(k_scale, (groups, cols, k // 32), 126, 129).astype(jnp.uint8)
    return lhs, codes, scale


def reference(lhs, rhs, rhs_scale, sizes) -> np.ndarray:
    return ref_ragged_rows(
        np.asarray(lhs.astype(jnp.float32), np.float64), dequant_mxfp8_bf16(rhs, rhs_scale), sizes
    )


def bf16_bits(values) -> np.ndarray:
    return np.asarray(jnp.asarray(values, jnp.float32).astype(BF16)).view(np.uint16)


@pytest.mark.parametrize(
    "sizes, rows, k, cols, fp8_dtype",
    [
        # An empty group, tiles shared by two groups, 33 tail rows; E4M3.
        ([37, 0, 90], 160, 128, 128, E4M3),
        # K = 3 MX blocks (a padded step), a partial CTA tile of weight rows, 128-token tiles.
        ([0, 100, 0], 100, 96, 72, E5M2),
        # K = 4 steps: two stages of two steps (tile_k = 128).
        ([37, 0, 90], 160, 256, 128, E4M3),
    ],
)
# tile_k = 128: two K steps a stage (stop 48; K = 96 and 128 are one stage, half of it padding
# for K = 96), with the default 64-wide wgmmas (CI time: the interpreter runs each case whole).
@pytest.mark.parametrize("wgmma_k, tile_k", [(32, 64), (64, 64), (64, 128)])
def test_exact_sums_equal_the_reference_bit_for_bit(
    sizes, rows, k, cols, fp8_dtype, wgmma_k, tile_k
):
    lhs, rhs, rhs_scale = exact_operands(50, rows, k, len(sizes), cols, fp8_dtype)
    config = dataclasses.replace(TINY, tile_m=64 if k != 96 else 128, tile_k=tile_k)
    out = grouped_matmul_mxfp8_weights(
        lhs,
        rhs,
        rhs_scale,
        jnp.asarray(sizes, jnp.int32),
        config=config,
        wgmma_k=wgmma_k,
        interpret=True,
    )
    out = np.asarray(out)
    want = reference(lhs, rhs, rhs_scale, sizes)
    np.testing.assert_array_equal(out.view(np.uint16), bf16_bits(want))
    assert np.all(out[sum(sizes) :] == 0)


@pytest.mark.parametrize(
    "changes",
    [
        dict(persistent_pipeline=True),  # the pipeline kept running across tiles
        dict(swizzled_epilogue=False),  # every tile through the plain transposed view
        dict(tile_m=192, grid_minor_dim=1),  # 192-token tiles, weight-row tiles walked first
    ],
    ids=["persistent", "plain epilogue", "192 tokens, columns minor"],
)
def test_schedules_give_the_exact_sums(changes):
    sizes = [70, 0, 130, 1]
    lhs, rhs, rhs_scale = exact_operands(54, 240, 256, len(sizes), 256, E4M3)
    out = np.asarray(run(lhs, rhs, rhs_scale, sizes, config=dataclasses.replace(TINY, **changes)))
    want = reference(lhs, rhs, rhs_scale, sizes)
    np.testing.assert_array_equal(out.view(np.uint16), bf16_bits(want))
    assert np.all(out[sum(sizes) :] == 0)


def test_random_operands_and_the_default_tile():
    # Random codes over 20 binades of scales, 256-token tiles (the default) on a grid of
    # shared tiles: one bf16 rounding of an f32 sum.
    k_lhs, k_rhs = keys(2, seed=51)
    sizes = [300, 0, 150, 62]
    lhs = jax.random.normal(k_lhs, (600, 128), jnp.float32).astype(BF16)
    rhs, rhs_scale = random_mxfp8(k_rhs, (4, 128, 128), E4M3)
    config = dataclasses.replace(DEFAULT_MXFP8_WEIGHTS_CONFIG, num_sms=2, grid_tile_width=1)
    out = run(lhs, rhs, rhs_scale, sizes, config=config)
    assert_close(out, reference(lhs, rhs, rhs_scale, sizes), rel=2**-8)
    assert np.all(np.asarray(out)[sum(sizes) :] == 0)


@pytest.mark.parametrize("case", list(PACKED_CASES))
@pytest.mark.parametrize("swizzled_epilogue", [True, False])
def test_packed_output_reads_groups_with_gaps(case, swizzled_epilogue):
    # The library's token-order output: group g reads lhs rows from group_starts[g] and its
    # output rows follow the previous groups'; rows in the gaps are huge, so a read shows.
    sizes, starts, rows, out_rows = PACKED_CASES[case]
    k_lhs, k_rhs = keys(2, seed=56)
    lhs = gapped_lhs(k_lhs, rows, 128, sizes, starts)
    rhs, rhs_scale = random_mxfp8(k_rhs, (len(sizes), 128, 128), E4M3)
    out = grouped_matmul_mxfp8_weights(
        lhs,
        rhs,
        rhs_scale,
        jnp.asarray(sizes, jnp.int32),
        group_starts=jnp.asarray(starts, jnp.int32),
        out_rows=out_rows,
        out_dtype=jnp.float32,
        config=dataclasses.replace(TINY, swizzled_epilogue=swizzled_epilogue),
        interpret=True,
    )
    want = ref_packed_rows(f64(lhs), dequant_mxfp8_bf16(rhs, rhs_scale), sizes, starts, out_rows)
    assert out.shape == (out_rows, 128)
    assert_close(out, want, rel=1e-5)


@pytest.mark.parametrize("wgmma_k", [32, 64])
def test_edge_scale_bytes(wgmma_k):
    # Scale byte 0 (2^-127), 254 (2^127) next to a tiny code, and a NaN-marking 0xFF block:
    # its weight row's output column is NaN for the group's tokens and nowhere else.
    lhs, rhs, rhs_scale = exact_operands(52, 64, 64, 1, 128, E4M3)
    rhs_scale = rhs_scale.at[0, 3, 0].set(0).at[0, 5, 1].set(254).at[0, 9, 1].set(255)
    rhs = rhs.at[0, 5, 32:].set(jnp.asarray(2.0**-9, E4M3))
    lhs = lhs.at[:, 32:].set(jnp.clip(lhs[:, 32:], -1, 1))  # 2^118-scale sums stay finite
    out = grouped_matmul_mxfp8_weights(
        lhs,
        rhs,
        rhs_scale,
        jnp.asarray([64], jnp.int32),
        config=TINY,
        wgmma_k=wgmma_k,
        interpret=True,
    )
    out = np.asarray(out.astype(jnp.float32))
    want = reference(lhs, rhs, rhs_scale, [64])
    assert np.isnan(out[:, 9]).all() and not np.isnan(np.delete(out, 9, axis=1)).any()
    finite = np.delete(np.arange(128), 9)
    assert_close(out[:, finite], want[:, finite], rel=2**-8)


S = jax.ShapeDtypeStruct


@pytest.mark.parametrize(
    "out_dtype, packed, wgmma_k",
    [
        (BF16, False, 32),
        (BF16, True, 32),
        (jnp.float32, False, 32),
        (jnp.float32, True, 32),
        (BF16, True, 64),
        (jnp.float32, False, 64),
    ],
)
def test_cross_lowers_for_h200_with_a_register_operand_wgmma(out_dtype, packed, wgmma_k):
    # The default config on issue 5's G8 shape: each consumer's wgmma is m64nNk16 with its
    # A operand in four registers (the RS form), and the epilogue's transposed stores lower,
    # into the aligned or the packed (token-order) output.
    g, m, k, n = 8, 16384, 4096, 4096

    def call(a, b, s, sizes, starts):
        rows = dict(group_starts=starts, out_rows=m - 100) if packed else {}
        return grouped_matmul_mxfp8_weights(
            a, b, s, sizes, out_dtype=out_dtype, wgmma_k=wgmma_k, **rows
        )

    (module,) = mosaic_modules(
        call,
        S((m, k), BF16),
        S((g, n, k), E4M3),
        S((g, n, k // 32), jnp.uint8),
        S((g,), jnp.int32),
        S((g,), jnp.int32),
    )
    wgmmas = [line for line in module.splitlines() if "wgmma.mma_async" in line]
    # The default tiles: 256 tokens for both output dtypes (f32 with two stages).
    assert wgmmas and all("m64n256k16.f32.bf16.bf16" in line for line in wgmmas)
    # After the accumulator's registers: A as four registers (the RS form; an SMEM A operand
    # would be a descriptor, like B's), then B's descriptor and the scale-d predicate.
    register_a = re.compile(r"\}, \{\$\d+,\$\d+,\$\d+,\$\d+\}, \$\d+, p,")
    assert all(register_a.search(line) for line in wgmmas)


def _operands():
    lhs, rhs, rhs_scale = exact_operands(53, 64, 64, 2, 128, E4M3)
    return lhs, rhs, rhs_scale, jnp.asarray([32, 32], jnp.int32)


@pytest.mark.parametrize(
    "change, error, needle",
    [
        (lambda a: a | {"lhs": a["lhs"].astype(E4M3)}, TypeError, "lhs must have dtype"),
        (lambda a: a | {"rhs": a["rhs"].astype(BF16)}, TypeError, "rhs must have dtype"),
        (lambda a: a | {"rhs_scale": a["rhs_scale"].astype(jnp.int32)}, TypeError, "rhs_scale"),
        (lambda a: a | {"rhs_scale": a["rhs_scale"][:, :, :1]}, ValueError, "rhs_scale"),
        (lambda a: a | {"lhs": a["lhs"][:, :32]}, ValueError, "rhs contraction"),
        (lambda a: a | {"sizes": jnp.asarray([1, 2, 3], jnp.int32)}, ValueError, "group_sizes"),
        (lambda a: a | {"lhs": a["lhs"][0]}, ValueError, "lhs"),  # rank 1
        (lambda a: a | {"rhs": a["rhs"][0]}, ValueError, "rhs"),  # rank 2
        (  # K = 48: not whole 1x32 MX blocks
            lambda a: (
                a
                | {"lhs": a["lhs"][:, :48], "rhs": a["rhs"][:, :, :48], "rhs_scale": a["rhs_scale"]}
            ),
            ValueError,
            "K=48 must be a multiple of 32",
        ),
    ],
)
def test_bad_inputs_raise_naming_the_argument(change, error, needle):
    names = ("lhs", "rhs", "rhs_scale", "sizes")
    args = change(dict(zip(names, _operands(), strict=True)))
    with pytest.raises(error, match=needle):
        run(*(args[name] for name in names))


def test_float32_output_matches_the_reference():
    # f32 parts are stored through the WGMMA_TRANSPOSED layout (grouped_matmul_common.
    # store_transposed); both epilogue views, and f32's default tile (256 tokens, 2 stages).
    k_lhs, k_rhs = keys(2, seed=55)
    sizes = [37, 0, 150, 60]
    lhs = jax.random.normal(k_lhs, (300, 128), jnp.float32).astype(BF16)
    rhs, rhs_scale = random_mxfp8(k_rhs, (4, 128, 128), E5M2)
    want = reference(lhs, rhs, rhs_scale, sizes)
    for config in (TINY, dataclasses.replace(TINY, swizzled_epilogue=False), None):
        if config is None:
            config = dataclasses.replace(
                DEFAULT_MXFP8_WEIGHTS_CONFIG, max_concurrent_steps=2, num_sms=2
            )
        out = grouped_matmul_mxfp8_weights(
            lhs,
            rhs,
            rhs_scale,
            jnp.asarray(sizes, jnp.int32),
            out_dtype=jnp.float32,
            config=config,
            interpret=True,
        )
        assert out.dtype == jnp.float32
        assert_close(out, want, rel=1e-5)
        assert np.all(np.asarray(out)[sum(sizes) :] == 0)


@pytest.mark.parametrize("wgmma_k", [16, 128, True])
def test_wgmma_k_must_be_32_or_64(wgmma_k):
    with pytest.raises(ValueError, match="wgmma_k must be 32 or 64"):
        grouped_matmul_mxfp8_weights(*_operands(), wgmma_k=wgmma_k, interpret=True)


def test_packed_output_needs_group_starts_and_out_rows_together():
    lhs, rhs, rhs_scale, sizes = _operands()
    with pytest.raises(ValueError, match="group_starts and out_rows go together"):
        grouped_matmul_mxfp8_weights(lhs, rhs, rhs_scale, sizes, out_rows=64, interpret=True)
    with pytest.raises(ValueError, match="out_rows must be a positive int"):
        grouped_matmul_mxfp8_weights(
            lhs,
            rhs,
            rhs_scale,
            sizes,
            group_starts=jnp.zeros(2, jnp.int32),
            out_rows=0,
            interpret=True,
        )


def test_out_dtype_must_be_bfloat16_or_float32():
    with pytest.raises(TypeError, match="out_dtype must be bfloat16 or float32, got float16"):
        grouped_matmul_mxfp8_weights(*_operands(), out_dtype=jnp.float16, interpret=True)


@pytest.mark.parametrize(
    "changes, needle",
    [
        (dict(wgmma_in_flight=1), "wgmma_in_flight must be 0"),
        (dict(tile_m=64, tile_n=128), "tile_n must be 64"),
        (dict(epi_tile_n=32), "epi_tile_n must be a multiple of 64, got 32"),
        (dict(cluster_n=2), "without clusters"),
        (dict(stream_k=True), "does not support stream_k"),
        (dict(tile_k=256), "tile_k=64 or 128"),
        (dict(max_concurrent_steps=8), "shared memory"),
    ],
)
def test_bad_configs_raise(changes, needle):
    config = dataclasses.replace(DEFAULT_MXFP8_WEIGHTS_CONFIG, **changes)
    with pytest.raises(ValueError, match=needle):
        grouped_matmul_mxfp8_weights(*_operands(), config=config, interpret=True)


# ----------------------------------------------------------------------------------------------
# NVFP4 weights: packed E2M1 codes (element 2i in byte i's low nibble) and E4M3 block scales.

E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def dequant_nvfp4(packed, scale) -> np.ndarray:
    """float64 e2m1 · s of (G, N, K/2) packed bytes and (G, N, K/16) E4M3 scales (exact)."""
    packed = np.asarray(packed)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    scale = np.asarray(jnp.asarray(scale).astype(jnp.float32), np.float64)
    return E2M1_VALUES[codes] * np.repeat(scale, 16, axis=-1)


def nvfp4_weights(key, groups: int, cols: int, k: int, scales=(0.25, 0.5, 1.0, 2.0)):
    """Random bytes (every E2M1 code) and scales drawn from `scales`."""
    k_codes, k_scale = jax.random.split(key)
    packed = jax.random.randint(k_codes, (groups, cols, k // 2), 0, 256).astype(jnp.uint8)
    choice = jax.random.randint(k_scale, (groups, cols, k // 16), 0, len(scales))
    scale = jnp.asarray(scales, jnp.float32)[choice].astype(E4M3)
    return packed, scale


def run_nvfp4(lhs, rhs, rhs_scale, sizes, config=TINY, **kwargs):
    return grouped_matmul_nvfp4_weights(
        lhs, rhs, rhs_scale, jnp.asarray(sizes, jnp.int32), config=config, interpret=True, **kwargs
    )


def nvfp4_reference(lhs, rhs, rhs_scale, sizes) -> np.ndarray:
    return ref_ragged_rows(f64(lhs), dequant_nvfp4(rhs, rhs_scale), sizes)


@pytest.mark.parametrize(
    "sizes, rows, k, cols, lhs_order",
    [
        ([37, 0, 90], 160, 128, 128, "natural"),  # an empty group, shared tiles, 33 tail rows
        ([37, 0, 90], 160, 128, 128, "even_odd"),
        ([0, 100, 0], 100, 96, 72, "natural"),  # K = 96 (a padded step), a partial weight tile
        ([70, 0, 130, 1], 240, 256, 256, "even_odd"),  # four steps
    ],
)
# tile_k = 128: two K steps a stage (stop 48; K = 96 pads half its one stage, K = 256 is two),
# with the default byte-permute decode.
@pytest.mark.parametrize(
    "e2m1_decode, tile_k", [("float32", 64), ("byte_permute", 64), ("byte_permute", 128)]
)
def test_nvfp4_exact_sums_equal_the_reference_bit_for_bit(
    sizes, rows, k, cols, lhs_order, e2m1_decode, tile_k
):
    # Integer tokens in [-3, 3], every E2M1 code, scales 0.25 .. 2: exact f32 sums, whatever
    # order the kernel visits the contraction in.
    k_lhs, k_rhs = keys(2, seed=61)
    lhs = jax.random.randint(k_lhs, (rows, k), -3, 4).astype(BF16)
    rhs, rhs_scale = nvfp4_weights(k_rhs, len(sizes), cols, k)
    given = even_odd_columns(lhs) if lhs_order == "even_odd" else lhs
    config = dataclasses.replace(TINY, tile_k=tile_k)
    out = run_nvfp4(
        given, rhs, rhs_scale, sizes, config=config, lhs_order=lhs_order, e2m1_decode=e2m1_decode
    )
    out = np.asarray(out)
    want = nvfp4_reference(lhs, rhs, rhs_scale, sizes)
    np.testing.assert_array_equal(out.view(np.uint16), bf16_bits(want))
    assert np.all(out[sum(sizes) :] == 0)


def test_nvfp4_random_operands_float32_and_schedules():
    # Random tokens and scales over E4M3's range (subnormal 2^-9 to 448): f32 sums in the
    # kernel's order, within f32 rounding of the float64 reference; f32 and bf16 outputs, both
    # epilogue views, the persistent pipeline, scale bytes as uint8.
    k_lhs, k_rhs = keys(2, seed=62)
    sizes = [37, 0, 150, 60]
    lhs = jax.random.normal(k_lhs, (300, 128), jnp.float32).astype(BF16)
    rhs, rhs_scale = nvfp4_weights(k_rhs, 4, 128, 128, scales=(2.0**-9, 0.375, 1.0, 448.0))
    want = nvfp4_reference(lhs, rhs, rhs_scale, sizes)
    for changes in ({}, dict(swizzled_epilogue=False), dict(persistent_pipeline=True)):
        out = run_nvfp4(
            lhs,
            rhs,
            rhs_scale,
            sizes,
            config=dataclasses.replace(TINY, **changes),
            out_dtype=jnp.float32,
        )
        assert out.dtype == jnp.float32
        assert_close(out, want, rel=1e-5)
        assert np.all(np.asarray(out)[sum(sizes) :] == 0)
    scale_bytes = jax.lax.bitcast_convert_type(rhs_scale, jnp.uint8)
    out = run_nvfp4(lhs, rhs, scale_bytes, sizes)
    assert out.dtype == BF16
    assert_close(out, want, rel=2**-8)


@pytest.mark.parametrize("case", list(PACKED_CASES))
def test_nvfp4_packed_output_reads_groups_with_gaps(case):
    sizes, starts, rows, out_rows = PACKED_CASES[case]
    k_lhs, k_rhs = keys(2, seed=63)
    lhs = gapped_lhs(k_lhs, rows, 128, sizes, starts)
    rhs, rhs_scale = nvfp4_weights(k_rhs, len(sizes), 128, 128)
    out = run_nvfp4(
        even_odd_columns(lhs),
        rhs,
        rhs_scale,
        sizes,
        lhs_order="even_odd",
        group_starts=jnp.asarray(starts, jnp.int32),
        out_rows=out_rows,
        out_dtype=jnp.float32,
    )
    want = ref_packed_rows(f64(lhs), dequant_nvfp4(rhs, rhs_scale), sizes, starts, out_rows)
    assert out.shape == (out_rows, 128)
    assert_close(out, want, rel=1e-5)


def test_nvfp4_edge_scales():
    # Scale 0, E4M3's smallest subnormal (2^-9) and largest value (448), and a NaN scale
    # (byte 0x7F): NaN in its weight row's output column only.
    k_lhs, k_rhs = keys(2, seed=64)
    lhs = jax.random.randint(k_lhs, (64, 64), -3, 4).astype(BF16)
    rhs, rhs_scale = nvfp4_weights(k_rhs, 1, 128, 64)
    scale_bytes = jax.lax.bitcast_convert_type(rhs_scale, jnp.uint8)
    scale_bytes = scale_bytes.at[0, 3, 0].set(0).at[0, 4, 1].set(0x01).at[0, 5, 2].set(0x7E)
    scale_bytes = scale_bytes.at[0, 9, 3].set(0x7F)
    out = np.asarray(run_nvfp4(lhs, rhs, scale_bytes, [64], out_dtype=jnp.float32))
    want = nvfp4_reference(lhs, rhs, jax.lax.bitcast_convert_type(scale_bytes, E4M3), [64])
    assert np.isnan(out[:, 9]).all() and not np.isnan(np.delete(out, 9, axis=1)).any()
    finite = np.delete(np.arange(128), 9)
    np.testing.assert_array_equal(out[:, finite], want[:, finite].astype(np.float32))


def test_byte_permute_model_follows_ptx_prmt():
    # PTX ISA, prmt.b32 default mode: {b, a} numbered 7..0 (a's bytes 0..3); bit 3 of a
    # selector nibble replicates the selected byte's sign bit.
    a, b = 0x83828180, 0x07060504
    assert int(byte_permute(a, b, 0x3210)) == a
    assert int(byte_permute(a, b, 0x7654)) == b
    assert int(byte_permute(a, b, 0x4073)) == 0x04800783
    assert int(byte_permute(a, b, 0x8C00)) == 0xFF008080  # sign of 0x80 / of 0x04


@pytest.mark.parametrize("nibble", [0, 1])
def test_byte_permute_decode_of_every_byte_pair(nibble):
    # All 65536 pairs (b0, b1): each half is the bf16 of E2M1 nibble `nibble` of its byte.
    words = np.arange(1 << 16, dtype=np.uint32)
    bits = np.asarray(e2m1_word_as_bf16_bits(words, nibble))
    for half, byte in ((bits & 0xFFFF, words & 0xFF), (bits >> 16, words >> 8)):
        code = (byte >> (4 * nibble)) & 0xF
        want = np.asarray(jnp.asarray(E2M1_VALUES[code], jnp.float32).astype(BF16))
        np.testing.assert_array_equal(half.astype(np.uint16), want.view(np.uint16))


def test_byte_permute_decode_refuses_a_nibble_other_than_0_or_1():
    with pytest.raises(ValueError, match=r"nibble must be 0 \(bits 3\.\.0\) or 1"):
        e2m1_word_as_bf16_bits(np.arange(4, dtype=np.uint32), 2)


def test_even_odd_columns_and_the_dequantize_kernel_agree():
    # The reordering the kernel contracts in, and the dequantize kernel writing it directly:
    # the same bits as the natural order reordered.
    x = jnp.arange(2 * 128).reshape(2, 128)
    moved = np.asarray(even_odd_columns(x))
    np.testing.assert_array_equal(moved[0, :32], np.arange(0, 64, 2))
    np.testing.assert_array_equal(moved[0, 32:64], np.arange(1, 64, 2))
    np.testing.assert_array_equal(moved[1, 64:96], np.arange(128 + 64, 256, 2))
    packed, scale = nvfp4_weights(jax.random.key(65), 1, 128, 256, (2.0**-9, 1.0, 448.0))
    natural = dequantize_nvfp4(packed[0], scale[0], None, out_dtype=BF16, interpret=True)
    reordered = dequantize_nvfp4(
        packed[0], scale[0], None, out_dtype=BF16, column_order="even_odd", interpret=True
    )
    np.testing.assert_array_equal(
        np.asarray(reordered).view(np.uint16), np.asarray(even_odd_columns(natural)).view(np.uint16)
    )
    with pytest.raises(ValueError, match="must be a multiple of 64"):
        even_odd_columns(x[:, :96])
    with pytest.raises(ValueError, match="column_order must be one of"):
        dequantize_nvfp4(packed[0], scale[0], None, column_order="odd_even", interpret=True)
    with pytest.raises(ValueError, match="C = 96 columns"):
        dequantize_nvfp4(
            packed[0, :, :48], scale[0, :, :6], None, column_order="even_odd", interpret=True
        )


@pytest.mark.parametrize(
    "out_dtype, packed, e2m1_decode",
    [(BF16, False, "float32"), (jnp.float32, True, "float32"), (BF16, True, "byte_permute")],
)
def test_nvfp4_cross_lowers_for_h200_with_a_register_operand_wgmma(out_dtype, packed, e2m1_decode):
    # Issue 5's G8 shape on the default config: m64nNk16 wgmmas whose A operand is four
    # registers (the RS form), two k32 calls per step (the low and the high nibbles).
    g, m, k, n = 8, 16384, 4096, 4096

    def call(a, b, s, sizes, starts):
        rows = dict(group_starts=starts, out_rows=m - 100) if packed else {}
        return grouped_matmul_nvfp4_weights(
            a,
            b,
            s,
            sizes,
            lhs_order="even_odd",
            e2m1_decode=e2m1_decode,
            out_dtype=out_dtype,
            **rows,
        )

    (module,) = mosaic_modules(
        call,
        S((m, k), BF16),
        S((g, n, k // 2), jnp.uint8),
        S((g, n, k // 16), E4M3),
        S((g,), jnp.int32),
        S((g,), jnp.int32),
    )
    wgmmas = [line for line in module.splitlines() if "wgmma.mma_async" in line]
    # The default tiles: 256 tokens for both output dtypes (f32 with two stages).
    assert wgmmas and all("m64n256k16.f32.bf16.bf16" in line for line in wgmmas)
    register_a = re.compile(r"\}, \{\$\d+,\$\d+,\$\d+,\$\d+\}, \$\d+, p,")
    assert all(register_a.search(line) for line in wgmmas)
    # byte_permute: three permutes per register of packed bytes and nibble (8 registers of
    # the (64, 32) bytes a thread, two nibbles).
    assert module.count("prmt.b32") == (48 if e2m1_decode == "byte_permute" else 0)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_two_k_steps_a_stage_cross_lower_for_h200_with_twice_the_wgmmas_a_stage(fmt):
    # Issue 5's G8 shape, bf16 out, 256-token tiles in two stages of 128 K (what fits in
    # shared memory): the loop body issues both steps' register-operand wgmmas, twice the
    # one-step stage's, and still waits for all of them once a stage.
    g, m, k, n = 8, 16384, 4096, 4096
    if fmt == "mxfp8":
        kernel = grouped_matmul_mxfp8_weights
        weights = (S((g, n, k), E4M3), S((g, n, k // 32), jnp.uint8))
    else:
        kernel = functools.partial(grouped_matmul_nvfp4_weights, lhs_order="even_odd")
        weights = (S((g, n, k // 2), jnp.uint8), S((g, n, k // 16), E4M3))

    def wgmma_lines(config):
        (module,) = mosaic_modules(
            functools.partial(kernel, config=config), S((m, k), BF16), *weights, S((g,), jnp.int32)
        )
        waits = set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", module))
        assert waits == {"0"}
        return [line for line in module.splitlines() if "wgmma.mma_async" in line]

    one_step = wgmma_lines(DEFAULT_MXFP8_WEIGHTS_CONFIG)
    two_steps = wgmma_lines(TWO_STEPS_WEIGHTS_CONFIG)
    assert len(two_steps) == 2 * len(one_step)
    register_a = re.compile(r"\}, \{\$\d+,\$\d+,\$\d+,\$\d+\}, \$\d+, p,")
    assert all(register_a.search(line) for line in two_steps)
    # Three such stages do not fit in shared memory: refused by name.
    small = {
        "mxfp8": (jnp.zeros((1, 64, 128), E4M3), jnp.zeros((1, 64, 4), jnp.uint8)),
        "nvfp4": (jnp.zeros((1, 64, 64), jnp.uint8), jnp.zeros((1, 64, 8), E4M3)),
    }[fmt]
    three_stages = dataclasses.replace(TWO_STEPS_WEIGHTS_CONFIG, max_concurrent_steps=3)
    with pytest.raises(ValueError, match="shared memory"):
        kernel(
            jnp.zeros((64, 128), BF16),
            *small,
            jnp.asarray([64], jnp.int32),
            config=three_stages,
            interpret=True,
        )


def _nvfp4_operands():
    k_lhs, k_rhs = keys(2, seed=66)
    lhs = jax.random.randint(k_lhs, (64, 64), -3, 4).astype(BF16)
    rhs, rhs_scale = nvfp4_weights(k_rhs, 2, 128, 64)
    return dict(lhs=lhs, rhs=rhs, rhs_scale=rhs_scale, config=TINY)


def _depth(a, k: int):
    """The operands cut to contraction depth k."""
    return a | dict(
        lhs=a["lhs"][:, :k], rhs=a["rhs"][..., : k // 2], rhs_scale=a["rhs_scale"][..., : k // 16]
    )


@pytest.mark.parametrize(
    "change, error, needle",
    [
        (lambda a: a | dict(lhs_order="odd_even"), ValueError, "lhs_order must be one of"),
        (lambda a: a | dict(e2m1_decode="lut"), ValueError, "e2m1_decode must be one of"),
        (lambda a: a | dict(rhs=a["rhs"].astype(E4M3)), TypeError, "rhs must have dtype"),
        (lambda a: a | dict(rhs_scale=a["rhs_scale"].astype(F32)), TypeError, "rhs_scale must"),
        (lambda a: a | dict(rhs_scale=a["rhs_scale"][..., :3]), ValueError, "rhs_scale"),
        (lambda a: a | dict(rhs=a["rhs"][..., :16]), ValueError, "size 32 .16 bytes of 2 values"),
        (
            lambda a: _depth(a, 48) | dict(lhs_order="even_odd"),
            ValueError,
            "K=48 must be a multiple of 64 for lhs_order='even_odd'",
        ),
        (lambda a: _depth(a, 24), ValueError, "K=24 must be a multiple of 16"),
        (
            lambda a: a | dict(config=dataclasses.replace(TINY, tile_k=256)),
            ValueError,
            "grouped_matmul_nvfp4_weights needs tile_k=64 or 128",
        ),
        (
            lambda a: (
                a | dict(config=dataclasses.replace(TINY, tile_m=256, max_concurrent_steps=8))
            ),
            ValueError,
            "shared memory",
        ),
    ],
)
def test_nvfp4_bad_inputs_raise_naming_the_argument(change, error, needle):
    args = change(_nvfp4_operands())
    lhs, rhs, rhs_scale = args.pop("lhs"), args.pop("rhs"), args.pop("rhs_scale")
    sizes = jnp.asarray([32, 32], jnp.int32)
    with pytest.raises(error, match=needle):
        grouped_matmul_nvfp4_weights(lhs, rhs, rhs_scale, sizes, interpret=True, **args)
