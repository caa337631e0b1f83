"""Grouped-matmul kernels (issue 5): CPU interpret mode, CUDA cross-lowering, bad inputs.

Interpret mode runs the Mosaic GPU kernels numerically on the CPU with NaN-initialized
outputs, so a missing write shows up as NaN and fails the element-wise comparison.
It does not enforce Hopper's rules (K-major FP8 operands, 8-bit arithmetic, layouts);
the cross-lowering tests do, by lowering each kernel for an H200 without a GPU.
Tolerances: the interpreter accumulates in f32 on exactly representable products,
so f32 outputs must match a float64 reference to ~1e-5 relative to max |ref|;
bf16 outputs to bf16 rounding (2^-8 relative).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.h200_lowering import export_for_h200, mosaic_modules
from pallas_kernels import grouped_matmul_common as common
from pallas_kernels import grouped_matmul_driver as driver
from pallas_kernels.grouped_matmul_dense import (
    dense_matmul,
    dense_matmul_fp8_block,
    dense_matmul_fp8_block_wgrad,
)
from pallas_kernels.grouped_matmul_fwd import (
    DEFAULT_BF16_CONFIG,
    DEFAULT_FP8_CONFIG,
    GroupedMatmulConfig,
    fp8_block_default_config,
    grouped_matmul,
    grouped_matmul_fp8_block,
)
from pallas_kernels.grouped_matmul_wgrad import (
    DEEP_FP8_WGRAD_CONFIG,
    DEFAULT_BF16_WGRAD_CONFIG,
    DEFAULT_FP8_BLOCK_WGRAD_CONFIG,
    DEFAULT_FP8_WGRAD_CONFIG,
    DENSE_FP8_BLOCK_WGRAD_CONFIG,
    GroupedWgradConfig,
    fit_to_shared_memory,
    grouped_matmul_wgrad,
)
from tests.pallas_kernels import gpu_cases

# (The package's `grouped_matmul_wgrad` attribute is the function: the module by name.)
grouped_matmul_wgrad_module = importlib.import_module("pallas_kernels.grouped_matmul_wgrad")

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
BF16 = jnp.bfloat16

# Small tiles and two "SMs" keep interpreted grids to a handful of tiles. Epilogue
# rows span 128 bytes (32 f32 or 64 bf16 outputs).
TINY_FWD = GroupedMatmulConfig(
    tile_m=64,
    tile_n=64,
    tile_k=64,
    max_concurrent_steps=2,
    epi_tile_n=32,
    num_sms=2,
    grid_tile_width=1,
)
TINY_FWD_BF16_OUT = dataclasses.replace(TINY_FWD, epi_tile_n=64)
TINY_FWD_FP8 = dataclasses.replace(TINY_FWD, tile_k=128)
TINY_BLOCK = GroupedMatmulConfig(
    tile_m=64,
    tile_n=128,
    tile_k=128,
    max_concurrent_steps=2,
    epi_tile_n=64,
    num_sms=2,
    grid_tile_width=1,
)


def tiny_wgrad(tile_t: int) -> GroupedWgradConfig:
    return GroupedWgradConfig(
        tile_m=128,
        tile_n=64,
        tile_t=tile_t,
        max_concurrent_steps=2,
        epi_tile_n=32,
        num_sms=2,
        grid_tile_width=1,
    )


# ------------------------------------------------------------------ references (numpy, f64)


def clamped_bounds(group_sizes, num_rows: int) -> list[tuple[int, int]]:
    """The kernels' documented run-time rule: negative sizes are 0, the sum stops at M."""
    bounds, end = [], 0
    for size in np.asarray(group_sizes).tolist():
        start = end
        end = min(start + max(size, 0), num_rows)
        bounds.append((start, end))
    return bounds


def ref_ragged_rows(lhs, rhs_nk, group_sizes) -> np.ndarray:
    """out[rows of g] = lhs[rows of g] @ rhs[g]ᵀ in float64; rows of no group are 0."""
    lhs = np.asarray(lhs, np.float64)
    rhs_nk = np.asarray(rhs_nk, np.float64)
    out = np.zeros((lhs.shape[0], rhs_nk.shape[1]))
    for g, (start, end) in enumerate(clamped_bounds(group_sizes, lhs.shape[0])):
        out[start:end] = lhs[start:end] @ rhs_nk[g].T
    return out


def ref_ragged_contraction(lhs_km, rhs_nm, group_sizes) -> np.ndarray:
    """out[g] = lhs[:, tokens of g] @ rhs[:, tokens of g]ᵀ in float64."""
    lhs_km = np.asarray(lhs_km, np.float64)
    rhs_nm = np.asarray(rhs_nm, np.float64)
    bounds = clamped_bounds(group_sizes, lhs_km.shape[1])
    return np.stack([lhs_km[:, s:e] @ rhs_nm[:, s:e].T for s, e in bounds])


def f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def dequant_fp8_block(q, scale, block_rows: int, block_cols: int) -> np.ndarray:
    """FP8 block dequantization of layouts.md: q * scale_inv[i // rows, j // cols]."""
    scale = np.asarray(scale, np.float64)
    expanded = np.repeat(np.repeat(scale, block_rows, axis=-2), block_cols, axis=-1)
    rows, cols = q.shape[-2:]
    return f64(q) * expanded[..., :rows, :cols]


def assert_close(out, ref, *, rel: float) -> None:
    out = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    assert out.shape == ref.shape
    scale = max(float(np.abs(ref).max()), 1e-30)
    np.testing.assert_allclose(out, ref, rtol=0, atol=rel * scale)


def random_fp8(key, shape, dtype) -> jax.Array:
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def keys(n: int, seed: int = 0):
    return jax.random.split(jax.random.key(seed), n)


# Group splits over M = 160 rows (tile_m = 64): empty groups, a group inside one
# tile, groups straddling tiles, and a tail of rows that belong to no group.
SPLITS = {
    "uneven_with_tail": [37, 0, 90],
    "single": [160],
    "all_empty": [0, 0, 0],
    "empty_first_and_last": [0, 150, 0],
    "many_small": [1, 2, 3, 64, 65],
}


# ------------------------------------------------------------------------ forward / dgrad


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_bf16_forward_matches_reference(split):
    sizes = jnp.asarray(SPLITS[split], jnp.int32)
    num_groups = sizes.shape[0]
    k_lhs, k_rhs = keys(2)
    lhs = jax.random.normal(k_lhs, (160, 128), jnp.float32).astype(BF16)
    rhs = jax.random.normal(k_rhs, (num_groups, 64, 128), jnp.float32).astype(BF16)
    out = grouped_matmul(lhs, rhs, sizes, out_dtype=jnp.float32, config=TINY_FWD, interpret=True)
    assert out.dtype == jnp.float32
    assert_close(out, ref_ragged_rows(f64(lhs), f64(rhs), sizes), rel=1e-5)


def test_bf16_forward_kn_layout_bf16_out_partial_tiles():
    # K = 96 is not a multiple of tile_k = 64 and N = 48 not a multiple of 2 * tile_n:
    # TMA zero-fills the missing K columns and clips the stores.
    sizes = jnp.asarray([50, 70], jnp.int32)
    k_lhs, k_rhs = keys(2, seed=1)
    lhs = jax.random.normal(k_lhs, (130, 96), jnp.float32).astype(BF16)
    rhs_kn = jax.random.normal(k_rhs, (2, 96, 48), jnp.float32).astype(BF16)
    out = grouped_matmul(
        lhs,
        rhs_kn,
        sizes,
        rhs_layout="kn",
        out_dtype=BF16,
        config=TINY_FWD_BF16_OUT,
        interpret=True,
    )
    assert out.dtype == BF16 and out.shape == (130, 48)
    ref = ref_ragged_rows(f64(lhs), np.swapaxes(f64(rhs_kn), 1, 2), sizes)
    assert_close(out, ref, rel=2**-7)


def test_fp8_mixed_forward_with_row_and_column_scales():
    sizes = jnp.asarray([37, 0, 90], jnp.int32)
    k = keys(4, seed=2)
    lhs = random_fp8(k[0], (160, 256), E4M3)
    rhs = random_fp8(k[1], (3, 64, 256), E5M2)
    lhs_scale = jax.random.uniform(k[2], (160,), jnp.float32, 0.25, 4.0)
    rhs_scale = jax.random.uniform(k[3], (3, 64), jnp.float32, 0.25, 4.0)
    out = grouped_matmul(
        lhs,
        rhs,
        sizes,
        lhs_scale=lhs_scale,
        rhs_scale=rhs_scale,
        out_dtype=jnp.float32,
        config=TINY_FWD_FP8,
        interpret=True,
    )
    ref = ref_ragged_rows(
        f64(lhs) * f64(lhs_scale)[:, None],
        f64(rhs) * f64(rhs_scale)[:, :, None],
        sizes,
    )
    assert_close(out, ref, rel=1e-5)


def test_fp8_forward_with_tensor_and_group_scales_bf16_out():
    sizes = jnp.asarray([100, 60], jnp.int32)
    k = keys(3, seed=3)
    lhs = random_fp8(k[0], (160, 128), E4M3)
    rhs = random_fp8(k[1], (2, 64, 128), E4M3)
    lhs_scale = jnp.float32(0.75)
    rhs_scale = jnp.asarray([1.5, 0.125], jnp.float32)
    out = grouped_matmul(
        lhs,
        rhs,
        sizes,
        lhs_scale=lhs_scale,
        rhs_scale=rhs_scale,
        out_dtype=BF16,
        config=dataclasses.replace(TINY_FWD_FP8, epi_tile_n=64),
        interpret=True,
    )
    ref = ref_ragged_rows(f64(lhs) * 0.75, f64(rhs) * f64(rhs_scale)[:, None, None], sizes)
    assert_close(out, ref, rel=2**-7)


@pytest.mark.parametrize(
    "wgmma_in_flight, early_block_scales, stagger_consumers",
    [(0, True, False), (0, False, False), (1, True, False), (0, True, True), (0, False, True)],
)
def test_fp8_block_forward_matches_dequantized_reference(
    wgmma_in_flight, early_block_scales, stagger_consumers
):
    # wgmma_in_flight=1 promotes each K block's partial product during the next wgmma;
    # early_block_scales=False loads the scales after waiting for it (stops <= 34);
    # stagger_consumers holds the second consumer's first wgmma of a tile behind the first's
    # (a barrier per tile: the tiles here are several per CTA, so its phases are exercised).
    config = dataclasses.replace(
        TINY_BLOCK,
        wgmma_in_flight=wgmma_in_flight,
        early_block_scales=early_block_scales,
        stagger_consumers=stagger_consumers,
    )
    sizes = jnp.asarray([37, 0, 100], jnp.int32)
    k = keys(4, seed=4)
    lhs = random_fp8(k[0], (160, 256), E4M3)
    rhs = random_fp8(k[1], (3, 256, 256), E4M3)
    lhs_scale = jax.random.uniform(k[2], (160, 2), jnp.float32, 2.0**-4, 2.0**4)
    rhs_scale = jax.random.uniform(k[3], (3, 2, 2), jnp.float32, 2.0**-4, 2.0**4)
    out = grouped_matmul_fp8_block(
        lhs,
        lhs_scale,
        rhs,
        rhs_scale,
        sizes,
        out_dtype=jnp.float32,
        config=config,
        interpret=True,
    )
    ref = ref_ragged_rows(
        dequant_fp8_block(lhs, lhs_scale, 1, 128),
        dequant_fp8_block(rhs, rhs_scale, 128, 128),
        sizes,
    )
    assert_close(out, ref, rel=1e-5)


# Consumers that split the CTA tile's rows: each owns 64 rows and the tile's 128 columns
# (one rhs scale block), two of them in 128-row tiles or three in 192-row tiles. 300 rows in
# 192-row tiles give visits whose rows lie in one, two or all three consumers' parts, and
# parts with no rows of the visit (which store nothing).
TWO_CONSUMER_ROWS_BLOCK = dataclasses.replace(TINY_BLOCK, tile_m=128, tile_n=64, consumer_split="m")
THREE_CONSUMER_BLOCK = dataclasses.replace(TWO_CONSUMER_ROWS_BLOCK, tile_m=192, num_consumers=3)
ROWS_SPLIT_BLOCK_CASES = {
    "two consumers": TWO_CONSUMER_ROWS_BLOCK,
    "three consumers": THREE_CONSUMER_BLOCK,
    "three consumers, persistent, late scale loads": dataclasses.replace(
        THREE_CONSUMER_BLOCK, persistent_pipeline=True, early_block_scales=False
    ),
    # The lhs scales streamed with the K steps: each consumer reads its rows of the stage's
    # (1, tile_m) scales (consumers splitting rows), or all of them (splitting columns).
    "three consumers, streamed scales, persistent": dataclasses.replace(
        THREE_CONSUMER_BLOCK, persistent_pipeline=True, stream_lhs_scales=True
    ),
    "two consumers splitting columns, streamed scales": dataclasses.replace(
        TINY_BLOCK, stream_lhs_scales=True
    ),
}


def ragged_block_fp8_case(
    config, seed: int, *, powers_of_two_lhs_scales: bool, rhs_block_rows: int = 128
):
    """The block-FP8 kernel in the interpreter and its dequantized reference: 300 rows in 4
    groups (37, 0, 150, 60: shared tiles, an empty group, tail rows), N = 320 (ending in half
    an rhs scale block). rhs scales are powers of two far apart per block (per rhs row with
    ``rhs_block_rows=1``), so a consumer that reads its neighbour's scales fails; lhs scales
    too, or uniform in [2^-4, 2^4]."""
    sizes = jnp.asarray([37, 0, 150, 60], jnp.int32)
    k = keys(4, seed=seed)
    lhs = random_fp8(k[0], (300, 256), E4M3)
    rhs = random_fp8(k[1], (4, 320, 256), E4M3)
    if powers_of_two_lhs_scales:
        lhs_scale = 2.0 ** jax.random.randint(k[2], (300, 2), -6, 7).astype(jnp.float32)
    else:
        lhs_scale = jax.random.uniform(k[2], (300, 2), jnp.float32, 2.0**-4, 2.0**4)
    rhs_scale_rows = -(-320 // rhs_block_rows)
    rhs_scale = 2.0 ** jax.random.randint(k[3], (4, rhs_scale_rows, 2), -6, 7).astype(jnp.float32)
    out = grouped_matmul_fp8_block(
        lhs,
        lhs_scale,
        rhs,
        rhs_scale,
        sizes,
        out_dtype=jnp.float32,
        config=config,
        interpret=True,
        rhs_block_rows=rhs_block_rows,
    )
    ref = ref_ragged_rows(
        dequant_fp8_block(lhs, lhs_scale, 1, 128),
        dequant_fp8_block(rhs, rhs_scale, rhs_block_rows, 128),
        sizes,
    )
    return out, ref


def dense_block_fp8_case(config, seed: int, out_dtype):
    """`dense_matmul_fp8_block` in the interpreter and its dequantized reference: 200 x 256 @
    (192 x 256)ᵀ, so row tiles of 64, 128 or 192 end in a partial one."""
    k = keys(4, seed=seed)
    lhs8 = random_fp8(k[0], (200, 256), E4M3)
    rhs8 = random_fp8(k[1], (192, 256), E4M3)
    lhs_scale = jax.random.uniform(k[2], (200, 2), jnp.float32, 0.5, 2.0)
    rhs_scale = 2.0 ** jax.random.randint(k[3], (2, 2), -6, 7).astype(jnp.float32)
    out = dense_matmul_fp8_block(
        lhs8, lhs_scale, rhs8, rhs_scale, out_dtype=out_dtype, config=config, interpret=True
    )
    ref = (
        dequant_fp8_block(lhs8, lhs_scale, 1, 128) @ dequant_fp8_block(rhs8, rhs_scale, 128, 128).T
    )
    return out, ref


@pytest.mark.parametrize("case", list(ROWS_SPLIT_BLOCK_CASES))
def test_fp8_block_consumers_splitting_rows_match_dequantized_reference(case):
    config = ROWS_SPLIT_BLOCK_CASES[case]
    out, ref = ragged_block_fp8_case(config, seed=43, powers_of_two_lhs_scales=True)
    assert_close(out, ref, rel=1e-5)


@pytest.mark.parametrize(
    "case",
    [
        "three consumers, persistent, late scale loads",
        "three consumers, streamed scales, persistent",
    ],
)
def test_fp8_block_scales_before_the_mma_give_the_same_bits(case):
    # block_scales_before_mma moves each K step's scale loads (from the prefetched table, which
    # is waited for first, or from the streamed stage) ahead of the wgmma: the same bits.
    config = ROWS_SPLIT_BLOCK_CASES[case]
    out, ref = ragged_block_fp8_case(config, seed=45, powers_of_two_lhs_scales=True)
    early = dataclasses.replace(config, early_block_scales=True, block_scales_before_mma=True)
    out_early, _ = ragged_block_fp8_case(early, seed=45, powers_of_two_lhs_scales=True)
    np.testing.assert_array_equal(np.asarray(out_early), np.asarray(out))
    assert_close(out, ref, rel=1e-5)


def test_fp8_block_dense_three_consumers():
    # 192-row tiles: 200 rows are one whole tile and a tail tile.
    out, ref = dense_block_fp8_case(THREE_CONSUMER_BLOCK, seed=44, out_dtype=BF16)
    assert_close(out, ref, rel=2**-8)


# 128-row tiles, 64 columns per consumer: both consumers of a CTA share one 128-column rhs
# scale block; N = 320 ends in a half block (cols 256..319) and a padded consumer.
TALL_BLOCK = dataclasses.replace(TINY_BLOCK, tile_m=128, tile_n=64)


# 1x128 rhs blocks (a wgrad's token-direction copies): every K step's scales of the tile's rhs
# rows come through the pipeline and multiply the chunk's columns; each consumer must read its
# own columns of the stage (splitting columns) or all of them (splitting rows).
RHS_ROWWISE_BLOCK_CASES = {
    "two consumers splitting columns": TINY_BLOCK,
    "two consumers splitting rows": TWO_CONSUMER_ROWS_BLOCK,
    "three consumers, streamed lhs scales, persistent": dataclasses.replace(
        THREE_CONSUMER_BLOCK, persistent_pipeline=True, stream_lhs_scales=True
    ),
    "tall tiles, late scale loads": dataclasses.replace(TALL_BLOCK, early_block_scales=False),
    "stream-K": dataclasses.replace(TINY_BLOCK, stream_k=True, num_sms=5),
}


@pytest.mark.parametrize("case", list(RHS_ROWWISE_BLOCK_CASES))
def test_fp8_block_with_1x128_rhs_blocks_matches_dequantized_reference(case):
    config = RHS_ROWWISE_BLOCK_CASES[case]
    out, ref = ragged_block_fp8_case(
        config, seed=45, powers_of_two_lhs_scales=True, rhs_block_rows=1
    )
    assert_close(out, ref, rel=1e-5)


def dense_wgrad_operands():
    """A wgrad's two 1x128-block copies, 200 x 256 and 192 x 256 FP8 (256 tokens: two scale
    blocks, a partial row tile), with power-of-two scales (200, 2) and (192, 2).

    The codes are integers in [-16, 16], so each 128-token chunk's sum is exact in float32
    whatever order the interpreter's dot (XLA:CPU's, which varies with tile shape and CPU)
    adds it in: two kernels that promote the same chunks in the same order then give the
    same bits on any CPU. (The promotions' roundings, across chunks, stay in the test.)"""
    k = keys(4, seed=46)
    lhs8 = jax.random.randint(k[0], (200, 256), -16, 17).astype(E4M3)
    rhs8 = jax.random.randint(k[1], (192, 256), -16, 17).astype(E4M3)
    lhs_scale = 2.0 ** jax.random.randint(k[2], (200, 2), -6, 7).astype(jnp.float32)
    rhs_scale = 2.0 ** jax.random.randint(k[3], (192, 2), -6, 7).astype(jnp.float32)
    return lhs8, lhs_scale, rhs8, rhs_scale


def test_fp8_block_dense_with_1x128_rhs_blocks_and_its_refusals():
    # The dense entry point (the layers' wgrad dyᵀ x), with its default config fitted to the
    # rhs scale stages, in the interpreter on 200 x 256 @ (192 x 256)ᵀ.
    lhs8, lhs_line_scale, rhs8, rhs_scale = dense_wgrad_operands()
    lhs_scale = lhs_line_scale.T  # K-major, (2, 200)
    out = dense_matmul_fp8_block(
        lhs8,
        lhs_scale,
        rhs8,
        rhs_scale,
        out_dtype=jnp.float32,
        config=THREE_CONSUMER_BLOCK,
        interpret=True,
        lhs_scale_k_major=True,
        rhs_block_rows=1,
    )
    lhs_dq = dequant_fp8_block(lhs8, lhs_scale.T, 1, 128)
    ref = lhs_dq @ dequant_fp8_block(rhs8, rhs_scale, 1, 128).T
    assert_close(out, ref, rel=1e-5)
    with pytest.raises(ValueError, match=r"rhs_scale must have shape \(1, 192, 2\)"):
        dense_matmul_fp8_block(
            lhs8, lhs_scale.T, rhs8, jnp.ones((2, 2), jnp.float32), rhs_block_rows=1
        )
    for bad in (64, True):
        with pytest.raises(ValueError, match=r"rhs_block_rows must be 128 .* or 1"):
            dense_matmul_fp8_block(lhs8, lhs_scale.T, rhs8, rhs_scale, rhs_block_rows=bad)
    with pytest.raises(ValueError, match="rhs_block_rows=1 needs wgmma_in_flight=0"):
        dense_matmul_fp8_block(
            lhs8,
            lhs_scale.T,
            rhs8,
            rhs_scale,
            config=dataclasses.replace(TALL_BLOCK, wgmma_in_flight=1),
            rhs_block_rows=1,
        )


@pytest.mark.parametrize(
    "default, sizes, block_scaled, stages, buffers",
    [
        (DEFAULT_BF16_WGRAD_CONFIG, (2, 2, 4), False, 4, 1),
        (DEFAULT_FP8_WGRAD_CONFIG, (1, 1, 4), False, 3, 1),
        (DEEP_FP8_WGRAD_CONFIG, (1, 1, 4), False, 4, 1),
        (DEFAULT_FP8_BLOCK_WGRAD_CONFIG, (1, 1, 4), True, 4, 2),
        (DENSE_FP8_BLOCK_WGRAD_CONFIG, (1, 1, 4), True, 4, 1),
    ],
    ids=["bf16", "fp8", "fp8_deep", "fp8_block", "dense_fp8_block"],
)
def test_wgrad_defaults_run_as_timed_with_a_float32_output(
    default, sizes, block_scaled, stages, buffers
):
    # The layers ask for a float32 wgrad; the entry points fit their default to the shared
    # memory for it. Stop 59's sweeps timed these depths and epilogue buffers, so the fit must
    # leave them as they are (4 bf16 stages fill 229376 of 231424 bytes with one buffer).
    assert fit_to_shared_memory(default, sizes, block_scaled) == default
    assert (default.max_concurrent_steps, default.epilogue_buffers) == (stages, buffers)
    assert default.persistent_pipeline


def test_fp8_wgrad_default_is_one_stage_deeper_from_1024_tokens_a_group(monkeypatch):
    # Stop 60's sweep: 4 stages won from 1024 tokens a group on average (8 steps a tile) and
    # lost or tied below; the other kinds keep one default whatever the shape.
    pick = grouped_matmul_wgrad_module.default_wgrad_config
    assert pick(True, False, 16384, 16) is DEEP_FP8_WGRAD_CONFIG
    assert pick(True, False, 16383, 16) is DEFAULT_FP8_WGRAD_CONFIG
    assert pick(True, False, 32768, 64) is DEFAULT_FP8_WGRAD_CONFIG  # G64 small experts
    for tokens, groups in ((16384, 8), (256, 64)):
        assert pick(False, False, tokens, groups) is DEFAULT_BF16_WGRAD_CONFIG
        assert pick(True, True, tokens, groups) is DEFAULT_FP8_BLOCK_WGRAD_CONFIG
    with pytest.raises(ValueError, match="num_groups >= 1, got 1024 and 0"):
        pick(True, False, 1024, 0)
    with pytest.raises(ValueError, match=r"num_tokens must be >= 0 .* got -1 and 8"):
        pick(True, False, -1, 8)
    # The entry point asks it with the operands' token and group counts, and runs what it
    # gets: one group of 1024 tokens (8 steps of 128) at 4 stages, the sums of 3 stages.
    # The spy hands back the picked config on the tiny tiles the explicit runs use: in the
    # interpreter each step's sum is XLA:CPU's dot, whose summation order may change with
    # the tile's shape on another CPU (it did on an AMD EPYC, 2026-12-07), so only runs on
    # the same tiles can be compared bit for bit.
    tiny = dict(tile_n=64, num_sms=2)
    asked = []

    def spy(*args):
        asked.append((args, pick(*args)))
        return dataclasses.replace(asked[-1][1], **tiny)

    monkeypatch.setattr(grouped_matmul_wgrad_module, "default_wgrad_config", spy)
    keys = jax.random.split(jax.random.key(3), 2)
    x = jax.random.normal(keys[0], (128, 1024), F32).astype(jnp.float8_e4m3fn)
    dy = jax.random.normal(keys[1], (128, 1024), F32).astype(jnp.float8_e5m2)
    sizes = jnp.asarray([1024], jnp.int32)
    deep = grouped_matmul_wgrad(
        x, dy, sizes, config=dataclasses.replace(DEEP_FP8_WGRAD_CONFIG, **tiny), interpret=True
    )
    assert asked == []  # (a config given: no default asked for)
    shallow = grouped_matmul_wgrad(
        x, dy, sizes, config=dataclasses.replace(DEFAULT_FP8_WGRAD_CONFIG, **tiny), interpret=True
    )
    np.testing.assert_array_equal(
        np.asarray(deep).view(np.uint32), np.asarray(shallow).view(np.uint32)
    )
    ref = x.astype(F32) @ dy.astype(F32).T
    assert_close(deep[0], ref, rel=1e-5)
    default = grouped_matmul_wgrad(x, dy, sizes, interpret=True)
    assert asked == [((True, False, 1024, 1), DEEP_FP8_WGRAD_CONFIG)]
    np.testing.assert_array_equal(
        np.asarray(default).view(np.uint32), np.asarray(deep).view(np.uint32)
    )


def test_fp8_block_dense_wgrad_on_the_wgrad_kernel_and_its_refusals():
    # The layers' wgrad on the wgrad kernel with one group: the same chunks promoted in the
    # same order as the FP8 kernel's 1x128-rhs path, so the same bits, here on 200 x 256 @
    # (192 x 256)ᵀ with 256 tokens (two scale blocks) and a partial row tile.
    lhs8, lhs_scale, rhs8, rhs_scale = dense_wgrad_operands()
    tiny = GroupedWgradConfig(
        tile_m=128, tile_n=64, tile_t=128, max_concurrent_steps=2, epi_tile_n=32, num_sms=2
    )
    out = dense_matmul_fp8_block_wgrad(
        lhs8, lhs_scale, rhs8, rhs_scale, out_dtype=F32, config=tiny, interpret=True
    )
    on_fp8_kernel = dense_matmul_fp8_block(
        lhs8,
        lhs_scale,
        rhs8,
        rhs_scale,
        out_dtype=F32,
        config=THREE_CONSUMER_BLOCK,
        interpret=True,
        rhs_block_rows=1,
    )
    assert out.shape == (200, 192)
    np.testing.assert_array_equal(
        np.asarray(out).view(np.uint32), np.asarray(on_fp8_kernel).view(np.uint32)
    )
    ref = dequant_fp8_block(lhs8, lhs_scale, 1, 128) @ dequant_fp8_block(rhs8, rhs_scale, 1, 128).T
    assert_close(out, ref, rel=1e-5)
    # Its own default (4 stages, two epilogue buffers, which fit beside a float32 output as
    # they are): the same bits.
    assert fit_to_shared_memory(DENSE_FP8_BLOCK_WGRAD_CONFIG, (1, 1, 4), True) == (
        DENSE_FP8_BLOCK_WGRAD_CONFIG
    )
    on_its_default = dense_matmul_fp8_block_wgrad(
        lhs8, lhs_scale, rhs8, rhs_scale, out_dtype=F32, interpret=True
    )
    np.testing.assert_array_equal(
        np.asarray(on_its_default).view(np.uint32), np.asarray(out).view(np.uint32)
    )
    with pytest.raises(TypeError, match=r"config must be a GroupedWgradConfig, got dict"):
        fit_to_shared_memory({}, (1, 1, 4), True)
    with pytest.raises(ValueError, match=r"sizes must be the \(lhs, rhs, out\) itemsizes"):
        fit_to_shared_memory(DENSE_FP8_BLOCK_WGRAD_CONFIG, (1, 4), True)
    with pytest.raises(ValueError, match=r"lhs must have rank 2"):
        dense_matmul_fp8_block_wgrad(lhs8[0], lhs_scale, rhs8, rhs_scale)
    with pytest.raises(ValueError, match=r"rhs token count 128 does not match lhs token count 256"):
        dense_matmul_fp8_block_wgrad(lhs8, lhs_scale, rhs8[:, :128], rhs_scale)
    with pytest.raises(ValueError, match=r"rhs_scale must have shape \(192, 2\), got \(2, 192\)"):
        dense_matmul_fp8_block_wgrad(lhs8, lhs_scale, rhs8, rhs_scale.T)
    with pytest.raises(TypeError, match=r"lhs_scale must have dtype in \(float32\)"):
        dense_matmul_fp8_block_wgrad(lhs8, lhs_scale.astype(BF16), rhs8, rhs_scale)
    with pytest.raises(TypeError, match=r"1x128 block scales need FP8"):
        dense_matmul_fp8_block_wgrad(lhs8.astype(BF16), lhs_scale, rhs8.astype(BF16), rhs_scale)


@pytest.mark.parametrize("wgmma_in_flight", [0, 1])
def test_fp8_block_tall_tiles_match_dequantized_reference(wgmma_in_flight):
    config = dataclasses.replace(TALL_BLOCK, wgmma_in_flight=wgmma_in_flight)
    out, ref = ragged_block_fp8_case(config, seed=41, powers_of_two_lhs_scales=False)
    assert_close(out, ref, rel=1e-5)


def test_fp8_block_dense_tall_tiles_and_bad_tile_n():
    config = dataclasses.replace(TALL_BLOCK, persistent_pipeline=True)
    out, ref = dense_block_fp8_case(config, seed=42, out_dtype=jnp.float32)
    assert_close(out, ref, rel=1e-5)
    lhs8, rhs8 = jnp.zeros((200, 256), E4M3), jnp.zeros((192, 256), E4M3)
    lhs_scale, rhs_scale = jnp.ones((200, 2), jnp.float32), jnp.ones((2, 2), jnp.float32)
    wide = dataclasses.replace(TINY_BLOCK, tile_n=256)
    with pytest.raises(ValueError, match="tile_n=128 or 64, got tile_k=128, tile_n=256"):
        dense_matmul_fp8_block(lhs8, lhs_scale, rhs8, rhs_scale, config=wide, interpret=True)


@pytest.mark.parametrize(
    ("wgmma_in_flight", "epilogue_buffers", "swizzled_epilogue"),
    [(1, 1, True), (1, 2, True), (0, 1, True), (0, 2, False)],
)
def test_pipeline_variants_match_reference(wgmma_in_flight, epilogue_buffers, swizzled_epilogue):
    # Row tile 1 (rows 64..127) is whole inside group 2, the others are shared or partial:
    # both epilogue staging paths run unless swizzled_epilogue=False sends all to the plain one.
    config = dataclasses.replace(
        TINY_FWD,
        max_concurrent_steps=3,
        wgmma_in_flight=wgmma_in_flight,
        epilogue_buffers=epilogue_buffers,
        swizzled_epilogue=swizzled_epilogue,
    )
    sizes = jnp.asarray([37, 0, 90], jnp.int32)
    k_lhs, k_rhs = keys(2, seed=9)
    lhs = jax.random.normal(k_lhs, (160, 256), jnp.float32).astype(BF16)
    rhs = jax.random.normal(k_rhs, (3, 64, 256), jnp.float32).astype(BF16)
    out = grouped_matmul(lhs, rhs, sizes, out_dtype=jnp.float32, config=config, interpret=True)
    assert_close(out, ref_ragged_rows(f64(lhs), f64(rhs), sizes), rel=1e-5)


def ref_packed_rows(lhs, rhs_nk, group_sizes, group_starts, out_rows) -> np.ndarray:
    """The packed output in float64: group g reads lhs rows from group_starts[g], and its
    output rows follow the previous groups'; rows past the groups are 0."""
    lhs, rhs_nk = np.asarray(lhs, np.float64), np.asarray(rhs_nk, np.float64)
    out = np.zeros((out_rows, rhs_nk.shape[1]))
    for g, (start, end) in enumerate(clamped_bounds(group_sizes, out_rows)):
        first = int(group_starts[g])
        out[start:end] = lhs[first : first + end - start] @ rhs_nk[g].T
    return out


# (group sizes, their lhs starts, lhs rows, output rows): groups padded to multiples of 32 as
# the aligned layout stores them (first), then arbitrary gaps, an output whose first rows of a
# group are not multiples of 8, whole tiles at rows that are (64 + 64) or are not (5 + 64),
# sizes clamped at the output's end, and an output with fewer rows than a tile.
PACKED_CASES = {
    "aligned_layout": ([37, 0, 90, 1], [0, 64, 64, 160], 192, 140),
    "gaps_and_whole_tiles": ([64, 5, 64, 20], [0, 70, 80, 200], 260, 170),
    "clamped_at_the_output_end": ([50, 80, 30], [0, 64, 160], 192, 100),
    "output_shorter_than_a_tile": ([7, 0, 20], [0, 32, 32], 64, 40),
}


def gapped_lhs(key, rows: int, k: int, sizes, starts) -> jax.Array:
    """Random bf16 (rows, k) lhs whose rows in the gaps between the groups (rows
    [starts[g], starts[g] + sizes[g]) are theirs) are huge: any read of them shows."""
    lhs = jax.random.normal(key, (rows, k), jnp.float32)
    in_groups = np.zeros(rows, bool)
    for start, size in zip(starts, sizes, strict=True):
        in_groups[start : start + size] = True
    return jnp.where(jnp.asarray(in_groups)[:, None], lhs, 1e30).astype(BF16)


def packed_case_output(case: str, config: GroupedMatmulConfig, seed: int):
    """(kernel output, float64 reference) of a PACKED_CASES case in the interpreter."""
    sizes, starts, rows, out_rows = PACKED_CASES[case]
    k_lhs, k_rhs = keys(2, seed=seed)
    lhs = gapped_lhs(k_lhs, rows, 128, sizes, starts)
    rhs = jax.random.normal(k_rhs, (len(sizes), 64, 128), jnp.float32).astype(BF16)
    out = grouped_matmul(
        lhs,
        rhs,
        jnp.asarray(sizes, jnp.int32),
        group_starts=jnp.asarray(starts, jnp.int32),
        out_rows=out_rows,
        out_dtype=jnp.float32,
        config=config,
        interpret=True,
    )
    return out, ref_packed_rows(f64(lhs), f64(rhs), sizes, starts, out_rows)


@pytest.mark.parametrize("swizzled_epilogue", [True, False])
@pytest.mark.parametrize("case", sorted(PACKED_CASES))
def test_packed_output_reads_groups_with_gaps(case, swizzled_epilogue):
    config = dataclasses.replace(TINY_FWD, swizzled_epilogue=swizzled_epilogue)
    out, ref = packed_case_output(case, config, seed=23)
    assert out.shape == (PACKED_CASES[case][3], 64)
    assert_close(out, ref, rel=1e-5)


def test_packed_output_with_fp8_row_and_group_scales():
    # The row scales are lhs rows' (read in lhs rows), the group scales per group.
    sizes, starts, rows, out_rows = [37, 0, 90], [0, 64, 64], 160, 130
    k = keys(4, seed=24)
    lhs = random_fp8(k[0], (rows, 128), E4M3)
    rhs = random_fp8(k[1], (3, 64, 128), E4M3)
    lhs_scale = jax.random.uniform(k[2], (rows,), jnp.float32, 0.5, 2.0)
    rhs_scale = jax.random.uniform(k[3], (3,), jnp.float32, 0.5, 2.0)
    out = grouped_matmul(
        lhs,
        rhs,
        jnp.asarray(sizes, jnp.int32),
        lhs_scale=lhs_scale,
        rhs_scale=rhs_scale,
        group_starts=jnp.asarray(starts, jnp.int32),
        out_rows=out_rows,
        out_dtype=jnp.float32,
        config=TINY_FWD_FP8,
        interpret=True,
    )
    ref = ref_packed_rows(
        f64(lhs) * f64(lhs_scale)[:, None],
        f64(rhs) * f64(rhs_scale)[:, None, None],
        sizes,
        starts,
        out_rows,
    )
    assert_close(out, ref, rel=1e-5)


def test_packed_output_of_the_block_fp8_kernel():
    # Groups padded to 128 rows apart (the FP8-block recipe's token block); lhs_scale per lhs row.
    sizes, starts, rows, out_rows = [37, 0, 90, 64], [0, 128, 128, 256], 384, 200
    k = keys(4, seed=25)
    lhs = random_fp8(k[0], (rows, 256), E4M3)
    lhs_scale = jax.random.uniform(k[1], (rows, 2), jnp.float32, 0.5, 2.0)
    rhs = random_fp8(k[2], (4, 200, 256), E4M3)
    rhs_scale = jax.random.uniform(k[3], (4, 2, 2), jnp.float32, 0.5, 2.0)
    out = grouped_matmul_fp8_block(
        lhs,
        lhs_scale,
        rhs,
        rhs_scale,
        jnp.asarray(sizes, jnp.int32),
        group_starts=jnp.asarray(starts, jnp.int32),
        out_rows=out_rows,
        out_dtype=jnp.float32,
        config=TINY_BLOCK,
        interpret=True,
    )
    lhs_dq = dequant_fp8_block(lhs, lhs_scale, 1, 128)
    rhs_dq = dequant_fp8_block(rhs, rhs_scale, 128, 128)
    assert_close(out, ref_packed_rows(lhs_dq, rhs_dq, sizes, starts, out_rows), rel=1e-5)


SCHEDULES = {
    "persistent": dict(persistent_pipeline=True),
    "cluster": dict(cluster_n=2),
    "cluster_persistent": dict(cluster_n=2, persistent_pipeline=True),
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize(
    ("rows", "num_cols", "sizes"),
    [
        # 3 column tiles of 128: clusters pad to 4; 5 row visits + the tail over 2 "SMs".
        (160, 300, [37, 0, 90]),
        # One item in all: one CTA runs a single pipeline (started, never stopped).
        (64, 100, [64]),
    ],
)
def test_schedules_match_reference(schedule, rows, num_cols, sizes):
    config = dataclasses.replace(TINY_FWD_FP8, **SCHEDULES[schedule])
    sizes = jnp.asarray(sizes, jnp.int32)
    k = keys(4, seed=19)
    lhs = random_fp8(k[0], (rows, 256), E4M3)
    rhs = random_fp8(k[1], (sizes.shape[0], num_cols, 256), E5M2)
    lhs_scale = jax.random.uniform(k[2], (rows,), jnp.float32, 0.5, 2.0)
    rhs_scale = jax.random.uniform(k[3], (sizes.shape[0], num_cols), jnp.float32, 0.5, 2.0)
    out = grouped_matmul(
        lhs,
        rhs,
        sizes,
        lhs_scale=lhs_scale,
        rhs_scale=rhs_scale,
        out_dtype=jnp.float32,
        config=config,
        interpret=True,
    )
    ref = ref_ragged_rows(
        f64(lhs) * f64(lhs_scale)[:, None], f64(rhs) * f64(rhs_scale)[..., None], sizes
    )
    assert_close(out, ref, rel=1e-5)


@pytest.mark.parametrize("schedule", ["persistent", "cluster_persistent"])
def test_block_fp8_schedules_match_reference(schedule):
    config = dataclasses.replace(TINY_BLOCK, wgmma_in_flight=1, **SCHEDULES[schedule])
    sizes = jnp.asarray([37, 0, 90], jnp.int32)
    k = keys(4, seed=20)
    lhs = random_fp8(k[0], (160, 256), E4M3)
    lhs_scale = jax.random.uniform(k[1], (160, 2), jnp.float32, 0.5, 2.0)
    rhs = random_fp8(k[2], (3, 200, 256), E4M3)
    rhs_scale = jax.random.uniform(k[3], (3, 2, 2), jnp.float32, 0.5, 2.0)
    out = grouped_matmul_fp8_block(
        lhs, lhs_scale, rhs, rhs_scale, sizes, out_dtype=jnp.float32, config=config, interpret=True
    )
    lhs_dq = dequant_fp8_block(lhs, lhs_scale, 1, 128)
    ref = ref_ragged_rows(lhs_dq, dequant_fp8_block(rhs, rhs_scale, 128, 128), sizes)
    assert_close(out, ref, rel=1e-5)


# cluster_m=2 (one group): a cluster's two CTAs take consecutive row tiles and share each
# rhs tile by multicast. The cases give an even and an odd number of the group's row tiles
# (the last cluster's second CTA repeats its partner's tile and stores nothing), a tail of
# rows past the group (zeros, split over the cluster's CTAs), and the persistent pipeline.
CLUSTER_M_CASES = {
    "bf16_even_tiles": dict(operands="bf16", rows=256, size=256),
    "bf16_odd_tiles_and_tail": dict(operands="bf16", rows=320, size=150),
    "fp8_rowwise_odd_tiles": dict(operands="fp8", rows=192, size=192),
    "fp8_block_odd_tiles_and_tail": dict(operands="fp8_block", rows=320, size=150),
    "fp8_block_persistent": dict(
        operands="fp8_block", rows=256, size=256, schedule=dict(persistent_pipeline=True)
    ),
}


@pytest.mark.parametrize("case", sorted(CLUSTER_M_CASES))
def test_clusters_along_m_match_reference(case):
    spec = CLUSTER_M_CASES[case]
    rows, num_cols, sizes = spec["rows"], 200, jnp.asarray([spec["size"]], jnp.int32)
    k = keys(4, seed=41)
    schedule = dict(cluster_m=2, **spec.get("schedule", {}))
    if spec["operands"] == "fp8_block":
        lhs = random_fp8(k[0], (rows, 256), E4M3)
        lhs_scale = jax.random.uniform(k[1], (rows, 2), jnp.float32, 0.5, 2.0)
        rhs = random_fp8(k[2], (1, num_cols, 256), E4M3)
        rhs_scale = jax.random.uniform(k[3], (1, 2, 2), jnp.float32, 0.5, 2.0)
        out = grouped_matmul_fp8_block(
            lhs,
            lhs_scale,
            rhs,
            rhs_scale,
            sizes,
            out_dtype=jnp.float32,
            config=dataclasses.replace(TINY_BLOCK, **schedule),
            interpret=True,
        )
        lhs_ref = dequant_fp8_block(lhs, lhs_scale, 1, 128)
        rhs_ref = dequant_fp8_block(rhs, rhs_scale, 128, 128)
    elif spec["operands"] == "fp8":
        lhs = random_fp8(k[0], (rows, 256), E4M3)
        rhs = random_fp8(k[1], (1, num_cols, 256), E5M2)
        lhs_scale = jax.random.uniform(k[2], (rows,), jnp.float32, 0.5, 2.0)
        rhs_scale = jax.random.uniform(k[3], (1, num_cols), jnp.float32, 0.5, 2.0)
        out = grouped_matmul(
            lhs,
            rhs,
            sizes,
            lhs_scale=lhs_scale,
            rhs_scale=rhs_scale,
            out_dtype=jnp.float32,
            config=dataclasses.replace(TINY_FWD_FP8, **schedule),
            interpret=True,
        )
        lhs_ref = f64(lhs) * f64(lhs_scale)[:, None]
        rhs_ref = f64(rhs) * f64(rhs_scale)[..., None]
    else:
        lhs = jax.random.normal(k[0], (rows, 128), jnp.float32).astype(BF16)
        rhs = jax.random.normal(k[1], (1, num_cols, 128), jnp.float32).astype(BF16)
        out = grouped_matmul(
            lhs,
            rhs,
            sizes,
            out_dtype=jnp.float32,
            config=dataclasses.replace(TINY_FWD, **schedule),
            interpret=True,
        )
        lhs_ref, rhs_ref = f64(lhs), f64(rhs)
    assert_close(out, ref_ragged_rows(lhs_ref, rhs_ref, sizes), rel=1e-5)


def test_clusters_along_m_reject_several_groups():
    lhs = jnp.zeros((128, 128), BF16)
    rhs = jnp.zeros((2, 128, 128), BF16)
    with pytest.raises(ValueError, match="cluster_m=2 needs a single group"):
        grouped_matmul(
            lhs,
            rhs,
            jnp.asarray([64, 64], jnp.int32),
            out_dtype=jnp.float32,
            config=dataclasses.replace(TINY_FWD, cluster_m=2),
            interpret=True,
        )


# consumer_split="m": each consumer owns 64 of the tile's 128 rows and all 2 x 64 columns.
# Over 160 rows the visits cover rows of one consumer only (37 rows of group 0: consumer 0),
# of both, and of neither (the tail), so every branch of the per-consumer row store runs.
TINY_ROWS_SPLIT = dataclasses.replace(TINY_FWD, tile_m=128, consumer_split="m")
ROWS_SPLIT_CASES = {
    "bf16_uneven_with_tail": dict(sizes=[37, 0, 90]),
    "bf16_many_small": dict(sizes=[1, 2, 3, 64, 65]),
    "bf16_kn_bf16_out": dict(sizes=[37, 0, 90], rhs_layout="kn", out_dtype=BF16),
    "fp8_row_and_column_scales": dict(sizes=[37, 0, 90], fp8=True),
    "fp8_persistent_cluster": dict(
        sizes=[37, 0, 90], fp8=True, schedule=dict(persistent_pipeline=True, cluster_n=2)
    ),
    # Three consumers of 64 rows each in 192-row tiles: 160 rows are one tile, whose third
    # part holds rows of group 2 only or none.
    "bf16_three_consumers": dict(sizes=[37, 0, 90], schedule=dict(tile_m=192, num_consumers=3)),
    "fp8_three_consumers_persistent": dict(
        sizes=[37, 0, 123],
        fp8=True,
        schedule=dict(tile_m=192, num_consumers=3, persistent_pipeline=True),
    ),
    # 64 x 256 parts (tile_n=128): each consumer issues two 128-column wgmmas per K slice
    # into two accumulators (a single m64n256 does not compile with four warpgroups).
    "bf16_three_consumers_wide": dict(
        sizes=[37, 0, 90], schedule=dict(tile_m=192, tile_n=128, num_consumers=3)
    ),
    "bf16_kn_three_consumers_wide": dict(
        sizes=[37, 0, 90],
        rhs_layout="kn",
        out_dtype=BF16,
        schedule=dict(tile_m=192, tile_n=128, num_consumers=3),
    ),
    "fp8_three_consumers_wide_in_flight": dict(
        sizes=[37, 0, 123],
        fp8=True,
        schedule=dict(tile_m=192, tile_n=128, num_consumers=3, wgmma_in_flight=1),
    ),
    "bf16_three_consumers_wide_persistent_cluster": dict(
        sizes=[37, 0, 90],
        schedule=dict(
            tile_m=192, tile_n=128, num_consumers=3, persistent_pipeline=True, cluster_n=2
        ),
    ),
}


@pytest.mark.parametrize("case", sorted(ROWS_SPLIT_CASES))
def test_consumers_splitting_rows_match_reference(case):
    spec = ROWS_SPLIT_CASES[case]
    sizes = jnp.asarray(spec["sizes"], jnp.int32)
    out_dtype = spec.get("out_dtype", jnp.float32)
    config = dataclasses.replace(
        TINY_ROWS_SPLIT,
        epi_tile_n=64 if out_dtype == BF16 else 32,
        tile_k=128 if spec.get("fp8") else 64,
        **spec.get("schedule", {}),
    )
    k = keys(4, seed=31)
    num_cols = 200
    if spec.get("fp8"):
        lhs = random_fp8(k[0], (160, 256), E4M3)
        rhs = random_fp8(k[1], (sizes.shape[0], num_cols, 256), E5M2)
        lhs_scale = jax.random.uniform(k[2], (160,), jnp.float32, 0.5, 2.0)
        rhs_scale = jax.random.uniform(k[3], (sizes.shape[0], num_cols), jnp.float32, 0.5, 2.0)
        out = grouped_matmul(
            lhs,
            rhs,
            sizes,
            lhs_scale=lhs_scale,
            rhs_scale=rhs_scale,
            out_dtype=out_dtype,
            config=config,
            interpret=True,
        )
        ref = ref_ragged_rows(
            f64(lhs) * f64(lhs_scale)[:, None], f64(rhs) * f64(rhs_scale)[..., None], sizes
        )
    else:
        lhs = jax.random.normal(k[0], (160, 128), jnp.float32).astype(BF16)
        rhs_nk = jax.random.normal(k[1], (sizes.shape[0], num_cols, 128), jnp.float32)
        rhs_nk = rhs_nk.astype(BF16)
        layout = spec.get("rhs_layout", "nk")
        rhs = rhs_nk if layout == "nk" else jnp.swapaxes(rhs_nk, 1, 2)
        out = grouped_matmul(
            lhs, rhs, sizes, rhs_layout=layout, out_dtype=out_dtype, config=config, interpret=True
        )
        ref = ref_ragged_rows(f64(lhs), f64(rhs_nk), sizes)
    assert_close(out, ref, rel=2**-8 if out_dtype == BF16 else 1e-5)


@pytest.mark.parametrize("consumers", ["two", "three_wide"])
@pytest.mark.parametrize("case", ["aligned_layout", "gaps_and_whole_tiles"])
def test_consumers_splitting_rows_write_a_packed_output(case, consumers):
    # Output rows of a visit that start in the second consumer's half, or are not multiples
    # of 8 there, take the plain staging path; whole halves the swizzled one. three_wide:
    # three consumers of 64 x 256 (two 128-column wgmmas each) in 192-row tiles.
    config = TINY_ROWS_SPLIT
    if consumers == "three_wide":
        config = dataclasses.replace(config, tile_m=192, tile_n=128, num_consumers=3)
    out, ref = packed_case_output(case, config, seed=32)
    assert_close(out, ref, rel=1e-5)


def test_block_fp8_consumers_splitting_rows_need_one_scale_block_of_columns():
    k = keys(4, seed=33)
    lhs = random_fp8(k[0], (128, 128), E4M3)
    rhs = random_fp8(k[1], (1, 256, 128), E4M3)
    refused = [
        # Each consumer would own 2 x 128 columns: two rhs scale blocks.
        (
            dataclasses.replace(TINY_BLOCK, tile_m=128, tile_n=128, consumer_split="m"),
            "consumer_split='m' needs tile_n=64",
        ),
        # Three consumers hold 160 registers a thread: no room for a third live 64 x 128 tile.
        (
            dataclasses.replace(THREE_CONSUMER_BLOCK, wgmma_in_flight=1),
            r"with 3 consumers \(3 f32 tiles of it",
        ),
    ]
    for config, needle in refused:
        with pytest.raises(ValueError, match=needle):
            grouped_matmul_fp8_block(
                lhs,
                jnp.ones((128, 1), jnp.float32),
                rhs,
                jnp.ones((1, 2, 1), jnp.float32),
                jnp.asarray([128], jnp.int32),
                config=config,
                interpret=True,
            )


def test_persistent_pipeline_needs_whole_rounds_of_stages_and_no_wgmma_in_flight():
    lhs = jnp.zeros((64, 192), BF16)  # 3 K steps of 64
    rhs = jnp.zeros((1, 128, 192), BF16)
    sizes = jnp.asarray([64], jnp.int32)
    config = dataclasses.replace(TINY_FWD, persistent_pipeline=True)
    with pytest.raises(ValueError, match="max_concurrent_steps"):
        grouped_matmul(lhs, rhs, sizes, out_dtype=jnp.float32, config=config, interpret=True)
    config = dataclasses.replace(
        TINY_FWD, max_concurrent_steps=3, wgmma_in_flight=1, persistent_pipeline=True
    )
    with pytest.raises(ValueError, match="wgmma_in_flight"):
        grouped_matmul(lhs, rhs, sizes, out_dtype=jnp.float32, config=config, interpret=True)


# cluster_m=2 runs the dense entry points in 2-CTA clusters along M; 192 rows are 3 row tiles
# of 64, so the last cluster's second CTA repeats its partner's tile.
@pytest.mark.parametrize("schedule", [{}, dict(cluster_m=2)], ids=["default", "cluster_m"])
def test_dense_entry_points(schedule):
    k = keys(6, seed=5)
    rows = 192 if schedule else 96
    lhs = jax.random.normal(k[0], (rows, 128), jnp.float32).astype(BF16)
    rhs = jax.random.normal(k[1], (64, 128), jnp.float32).astype(BF16)
    config = dataclasses.replace(TINY_FWD, **schedule)
    out = dense_matmul(lhs, rhs, out_dtype=jnp.float32, config=config, interpret=True)
    assert_close(out, f64(lhs) @ f64(rhs).T, rel=1e-5)

    lhs8 = random_fp8(k[2], (rows, 256), E4M3)
    rhs8 = random_fp8(k[3], (256, 256), E4M3)
    lhs_scale = jax.random.uniform(k[4], (rows, 2), jnp.float32, 0.5, 2.0)
    rhs_scale = jax.random.uniform(k[5], (2, 2), jnp.float32, 0.5, 2.0)
    out = dense_matmul_fp8_block(
        lhs8,
        lhs_scale,
        rhs8,
        rhs_scale,
        out_dtype=jnp.float32,
        config=dataclasses.replace(TINY_BLOCK, **schedule),
        interpret=True,
    )
    lhs_dq = dequant_fp8_block(lhs8, lhs_scale, 1, 128)
    ref = lhs_dq @ dequant_fp8_block(rhs8, rhs_scale, 128, 128).T
    assert_close(out, ref, rel=1e-5)


def test_run_time_group_sizes_are_clamped():
    # Device values cannot be checked at trace time. Documented rule: a negative size
    # counts as 0 and the running sum stops at M (later groups get what is left).
    sizes = jnp.asarray([-5, 100, 200, 7], jnp.int32)
    k_lhs, k_rhs = keys(2, seed=6)
    lhs = jax.random.normal(k_lhs, (160, 64), jnp.float32).astype(BF16)
    rhs = jax.random.normal(k_rhs, (4, 64, 64), jnp.float32).astype(BF16)
    out = grouped_matmul(lhs, rhs, sizes, out_dtype=jnp.float32, config=TINY_FWD, interpret=True)
    assert clamped_bounds(sizes, 160) == [(0, 0), (0, 100), (100, 160), (160, 160)]
    assert_close(out, ref_ragged_rows(f64(lhs), f64(rhs), sizes), rel=1e-5)


def python_visits(group_sizes, num_rows: int, tile_m: int) -> list[tuple[int, int, int, int]]:
    """The schedule of grouped_matmul_common's docstring, visit by visit, in plain Python:
    (group, tile index, row_begin, num_rows); the tail pseudo-group is group G."""
    bounds = clamped_bounds(group_sizes, num_rows)
    bounds.append((bounds[-1][1], num_rows))
    visits = []
    for group, (start, end) in enumerate(bounds):
        if end <= start:
            continue
        for block in range(start // tile_m, -(-end // tile_m)):
            lo, hi = max(start, block * tile_m), min(end, (block + 1) * tile_m)
            visits.append((group, block, lo - block * tile_m, hi - lo))
    return visits


@pytest.mark.parametrize(
    "sizes, num_rows, tile_m",
    [
        ([2048] * 8, 16384, 128),  # balanced, whole tiles
        ([16384, 0, 0, 0], 16384, 128),  # one group, empty ones after it
        ([100, 0, 28, 300, 1], 512, 64),  # boundaries inside tiles, a tail
        ([-5, 100, 200, 7], 160, 64),  # negative, then the sum runs past M
        ([0, 0, 0], 200, 64),  # only the tail
        ([2**31 - 1, 2**31 - 1], 1000, 128),  # sizes whose plain sum overflows int32
        ([1] * 70, 96, 64),  # more groups than rows: most start past M
    ],
)
def test_visit_table_is_the_documented_schedule(sizes, num_rows, tile_m):
    table = np.asarray(
        common.visit_table(jnp.asarray(sizes, jnp.int32), len(sizes), num_rows, tile_m)
    )
    expected = python_visits(sizes, num_rows, tile_m)
    group_visits = sum(1 for v in expected if v[0] < len(sizes))
    assert table.shape == (1 + common.max_visits(num_rows, len(sizes), tile_m), 4)
    assert table[0].tolist() == [group_visits, len(expected) - group_visits, 0, 0]
    assert [tuple(row) for row in table[1 : 1 + len(expected)].tolist()] == expected
    assert not table[1 + len(expected) :].any()


def python_packed_visits(group_sizes, group_starts, num_out_rows: int, tile_m: int):
    """A packed output's schedule in plain Python: (group, tile index, row_begin, num_rows,
    output row of the first row); groups' tiles in lhs rows, the tail's in output rows."""
    bounds = clamped_bounds(group_sizes, num_out_rows)
    pairs = zip(group_starts, bounds, strict=True)
    ranges = [(first, first + end - start, start) for first, (start, end) in pairs]
    total = bounds[-1][1]
    ranges.append((total, num_out_rows, total))
    visits = []
    for group, (start, end, out_start) in enumerate(ranges):
        if end <= start:
            continue
        for block in range(start // tile_m, -(-end // tile_m)):
            lo, hi = max(start, block * tile_m), min(end, (block + 1) * tile_m)
            visits.append((group, block, lo - block * tile_m, hi - lo, lo - start + out_start))
    return visits


@pytest.mark.parametrize(
    "sizes, starts, num_rows, num_out_rows, tile_m",
    [
        ([37, 0, 90, 1], [0, 64, 64, 160], 192, 140, 64),  # the aligned layout, a tail
        ([2048] * 8, [2048 * g for g in range(8)], 16384, 16384, 128),  # no gaps, no tail
        ([50, 80, 30], [0, 64, 160], 192, 100, 64),  # clamped at the output's end
        ([-3, 0, 0], [0, 0, 0], 64, 70, 64),  # only the tail
    ],
)
def test_visit_table_of_a_packed_output(sizes, starts, num_rows, num_out_rows, tile_m):
    table = np.asarray(
        common.visit_table(
            jnp.asarray(sizes, jnp.int32),
            len(sizes),
            num_rows,
            tile_m,
            group_starts=jnp.asarray(starts, jnp.int32),
            num_out_rows=num_out_rows,
        )
    )
    expected = python_packed_visits(sizes, starts, num_out_rows, tile_m)
    group_visits = sum(1 for v in expected if v[0] < len(sizes))
    max_visits = common.max_visits(num_rows, len(sizes), tile_m, num_out_rows)
    assert table.shape == (1 + max_visits, 5)
    assert table[0].tolist() == [group_visits, len(expected) - group_visits, 0, 0, 0]
    assert [tuple(row) for row in table[1 : 1 + len(expected)].tolist()] == expected
    assert not table[1 + len(expected) :].any()


# ------------------------------------------------------------------------------- wgrad


@pytest.mark.parametrize("token_major", [False, True])
@pytest.mark.parametrize("sizes", [[50, 0, 77, 40], [0, 0, 0, 0], [208, 0, 0, 0]])
def test_bf16_wgrad_matches_reference_and_ignores_foreign_nans(sizes, token_major):
    sizes = jnp.asarray(sizes, jnp.int32)
    k_lhs, k_rhs = keys(2, seed=7)
    lhs = jax.random.normal(k_lhs, (128, 208), jnp.float32).astype(BF16)
    rhs = jax.random.normal(k_rhs, (128, 208), jnp.float32).astype(BF16)
    used = clamped_bounds(sizes, 208)[-1][1]
    # Tokens past sum(group_sizes) hold garbage; it must not leak into any group.
    lhs = lhs.at[:, used + 3 :].set(jnp.nan)
    rhs = rhs.at[:, used + 1 :].set(jnp.inf)
    # token_major: x (M, K) and dy (M, N) as the forward pass stores them.
    operands = (lhs.T, rhs.T) if token_major else (lhs, rhs)
    out = grouped_matmul_wgrad(
        *operands, sizes, token_major=token_major, config=tiny_wgrad(64), interpret=True
    )
    assert out.shape == (4, 128, 128) and out.dtype == jnp.float32
    assert_close(out, ref_ragged_contraction(f64(lhs), f64(rhs), sizes), rel=1e-5)


def test_token_major_wgrad_pads_odd_shapes():
    # 200 tokens, K = 72 and N = 136 (neither a whole tile nor whole swizzle atoms), one group
    # straddling the 64-token chunk boundaries on both sides.
    sizes = jnp.asarray([30, 101, 0, 60], jnp.int32)
    k = keys(2, seed=17)
    x = jax.random.normal(k[0], (200, 72), jnp.float32).astype(BF16)
    dy = jax.random.normal(k[1], (200, 136), jnp.float32).astype(BF16)
    out = grouped_matmul_wgrad(
        x, dy, sizes, token_major=True, out_dtype=BF16, config=tiny_wgrad(64), interpret=True
    )
    assert out.shape == (4, 72, 136) and out.dtype == BF16
    assert_close(out, ref_ragged_contraction(f64(x.T), f64(dy.T), sizes), rel=2**-7)


def test_token_major_wgrad_refuses_fp8_non_bool_and_mismatched_tokens():
    lhs = jnp.zeros((256, 128), E4M3)
    with pytest.raises(TypeError, match="token_major operands must be 16-bit"):
        grouped_matmul_wgrad(lhs, lhs, jnp.asarray([256], jnp.int32), token_major=True)
    x = jnp.zeros((256, 128), BF16)
    with pytest.raises(TypeError, match="token_major must be a bool"):
        grouped_matmul_wgrad(x, x, jnp.asarray([256], jnp.int32), token_major=1)
    # Tokens are the first axis of both operands when token_major: (256, K) against (200, N).
    with pytest.raises(ValueError, match="rhs token count 200 does not match lhs token count 256"):
        grouped_matmul_wgrad(x, x[:200], jnp.asarray([256], jnp.int32), token_major=True)


def test_fp8_mixed_wgrad_with_scales_bf16_out():
    sizes = jnp.asarray([50, 0, 77, 40], jnp.int32)
    k = keys(3, seed=8)
    lhs = random_fp8(k[0], (128, 208), E4M3)
    rhs = random_fp8(k[1], (192, 208), E5M2)
    lhs_scale = jax.random.uniform(k[2], (128,), jnp.float32, 0.25, 4.0)
    out = grouped_matmul_wgrad(
        lhs,
        rhs,
        sizes,
        lhs_scale=lhs_scale,
        rhs_scale=jnp.float32(0.5),
        out_dtype=BF16,
        config=tiny_wgrad(128),
        interpret=True,
    )
    assert out.shape == (4, 128, 192) and out.dtype == BF16
    ref = ref_ragged_contraction(f64(lhs) * f64(lhs_scale)[:, None], f64(rhs) * 0.5, sizes)
    assert_close(out, ref, rel=2**-7)


@pytest.mark.parametrize("num_factors", [1, 2])
@pytest.mark.parametrize("out_dtype", [jnp.float32, BF16], ids=["float32", "bfloat16"])
def test_fp8_wgrad_group_scales_are_applied_last_then_rounded_once(out_dtype, num_factors):
    # The per-group factors (jax_qtrain passes per-tensor FP8's two scales as their product,
    # NVFP4's two global decode scales as two factors) are the epilogue's last, after the
    # per-row and per-tensor scales and one after another, and the output is rounded once
    # after them: the same bits as the float32 output scaled and rounded by XLA, the order of
    # jax_qtrain's reference. Factors far apart, so a wrong group's shows.
    sizes = jnp.asarray([50, 0, 77, 40], jnp.int32)
    k = keys(4, seed=9)
    lhs = random_fp8(k[0], (128, 208), E4M3)
    rhs = random_fp8(k[1], (192, 208), E5M2)
    lhs_scale = jax.random.uniform(k[2], (128,), jnp.float32, 0.25, 4.0)
    factors = 2.0 ** jax.random.uniform(k[3], (num_factors, 4), jnp.float32, -12.0, 12.0)
    run = functools.partial(
        grouped_matmul_wgrad,
        lhs,
        rhs,
        sizes,
        lhs_scale=lhs_scale,
        rhs_scale=jnp.float32(0.5),
        # Both pipelines (one per tile, and the defaults' one from tile to tile).
        config=dataclasses.replace(tiny_wgrad(128), persistent_pipeline=num_factors == 2),
        interpret=True,
    )
    want = run()
    for factor in factors:
        want = want * factor[:, None, None]
    want = want.astype(out_dtype)
    got = run(group_scale=factors[0] if num_factors == 1 else factors, out_dtype=out_dtype)
    assert got.shape == (4, 128, 192) and got.dtype == out_dtype
    bits = np.uint32 if out_dtype == jnp.float32 else np.uint16
    np.testing.assert_array_equal(np.asarray(got).view(bits), np.asarray(want).view(bits))
    assert not np.asarray(got[1]).any()  # the empty group


def test_wgrad_group_scale_refusals():
    lhs, rhs = jnp.zeros((128, 256), E4M3), jnp.zeros((64, 256), E4M3)
    sizes = jnp.asarray([100, 156], jnp.int32)
    for shape in ((3,), (2, 3), (1, 2, 2), ()):
        with pytest.raises(ValueError, match=r"group_scale must have shape \(2,\) or \(F, 2\)"):
            grouped_matmul_wgrad(lhs, rhs, sizes, group_scale=jnp.ones(shape, jnp.float32))
    with pytest.raises(TypeError, match=r"group_scale must have dtype in \(float32\)"):
        grouped_matmul_wgrad(lhs, rhs, sizes, group_scale=jnp.ones((2,), BF16))
    block_scale = jnp.ones((128, 2), jnp.float32)
    with pytest.raises(ValueError, match="group_scale do not combine with 1x128 block scales"):
        grouped_matmul_wgrad(
            lhs,
            rhs,
            sizes,
            group_scale=jnp.ones((2,), jnp.float32),
            lhs_block_scale=block_scale,
            rhs_block_scale=block_scale[:64],
        )


def block_scaled_wgrad_operands(seed: int):
    """A block-FP8 wgrad's two columnwise copies over 384 tokens (three 1x128 scale blocks):
    lhs (128, 384) and rhs (192, 384) E4M3, with power-of-two scales far apart, (128, 3) and
    (192, 3), so that reading another row's, column's or chunk's scale shows."""
    k = keys(4, seed=seed)
    lhs, rhs = random_fp8(k[0], (128, 384), E4M3), random_fp8(k[1], (192, 384), E4M3)
    lhs_scale = 2.0 ** jax.random.randint(k[2], (128, 3), -6, 7).astype(jnp.float32)
    rhs_scale = 2.0 ** jax.random.randint(k[3], (192, 3), -6, 7).astype(jnp.float32)
    return lhs, rhs, lhs_scale, rhs_scale


@pytest.mark.parametrize("sizes", [[50, 0, 177, 100], [384, 0, 0, 0], [0, 0, 0, 0]])
def test_fp8_wgrad_with_1x128_block_scales_matches_dequantized_reference(sizes):
    # Block FP8's wgrad: both columnwise copies in 1x128 blocks along the 384 tokens. Groups
    # share 128-token chunks (whose foreign tokens are zeroed before the wgmma), and every
    # row's and column's scales are powers of two far apart, so a consumer reading another
    # row's, column's or chunk's scale fails; NaN codes past the groups must not leak.
    sizes = jnp.asarray(sizes, jnp.int32)
    lhs, rhs, lhs_scale, rhs_scale = block_scaled_wgrad_operands(seed=9)
    used = clamped_bounds(sizes, 384)[-1][1]
    nan = jnp.asarray(jnp.nan, E4M3)
    lhs, rhs = lhs.at[:, used + 2 :].set(nan), rhs.at[:, used + 5 :].set(nan)
    out = grouped_matmul_wgrad(
        lhs,
        rhs,
        sizes,
        lhs_block_scale=lhs_scale,
        rhs_block_scale=rhs_scale,
        config=tiny_wgrad(128),
        interpret=True,
    )
    assert out.shape == (4, 128, 192) and out.dtype == jnp.float32
    ref = ref_ragged_contraction(
        f64(lhs) * np.repeat(f64(lhs_scale), 128, axis=1),
        f64(rhs) * np.repeat(f64(rhs_scale), 128, axis=1),
        sizes,
    )
    assert_close(out, ref, rel=1e-5)


def test_fp8_wgrad_block_scales_before_the_mma_give_the_same_bits():
    # `block_scales_before_mma` only moves the scale loads ahead of the wgmma (for ptxas's
    # scheduling): the products, their promotion and so the bits are the default's. Another
    # chunk's or row's scale read by mistake would change them (the scales are far apart).
    sizes = jnp.asarray([50, 0, 177, 100], jnp.int32)
    lhs, rhs, lhs_scale, rhs_scale = block_scaled_wgrad_operands(seed=21)

    def wgrad(config):
        return grouped_matmul_wgrad(
            lhs,
            rhs,
            sizes,
            lhs_block_scale=lhs_scale,
            rhs_block_scale=rhs_scale,
            config=config,
            interpret=True,
        )

    late = wgrad(tiny_wgrad(128))
    early = wgrad(dataclasses.replace(tiny_wgrad(128), block_scales_before_mma=True))
    np.testing.assert_array_equal(np.asarray(early), np.asarray(late))
    assert np.asarray(late).any()


def test_wgrad_block_scales_before_mma_is_a_bool_for_block_scales_only():
    with pytest.raises(TypeError, match="block_scales_before_mma must be a bool, got 1"):
        GroupedWgradConfig(block_scales_before_mma=1)
    config = dataclasses.replace(tiny_wgrad(64), block_scales_before_mma=True)
    with pytest.raises(ValueError, match="applies to 1x128 block scales only"):
        grouped_matmul_wgrad(
            _bf16((128, 128)), _bf16((64, 128)), jnp.asarray([128], jnp.int32), config=config
        )


def _wgrad_operand_kinds(kind: str, seed: int):
    """(operands, kwargs) of a wgrad call over 384 tokens by operand kind: bf16 columnwise
    copies, bf16 token-major, FP8 with per-row and per-tensor scales, block FP8."""
    k = keys(4, seed=seed)
    if kind == "block FP8":
        lhs, rhs, lhs_scale, rhs_scale = block_scaled_wgrad_operands(seed)
        return (lhs, rhs), dict(lhs_block_scale=lhs_scale, rhs_block_scale=rhs_scale)
    if kind == "FP8, scaled":
        lhs, rhs = random_fp8(k[0], (128, 384), E4M3), random_fp8(k[1], (192, 384), E5M2)
        lhs_scale = jax.random.uniform(k[2], (128,), jnp.float32, 0.25, 4.0)
        return (lhs, rhs), dict(lhs_scale=lhs_scale, rhs_scale=jnp.float32(0.5))
    lhs = jax.random.normal(k[0], (128, 384), jnp.float32).astype(BF16)
    rhs = jax.random.normal(k[1], (192, 384), jnp.float32).astype(BF16)
    if kind == "bf16, token-major":
        return (lhs.T, rhs.T), dict(token_major=True)
    return (lhs, rhs), {}


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("kind", ["bf16", "bf16, token-major", "FP8, scaled", "block FP8"])
def test_wgrad_persistent_pipeline_gives_the_same_bits(kind, stages):
    # One pipeline from tile to tile (`persistent_pipeline`): each step's stage follows from
    # the CTA's running step count, not from the tile's own. Two CTAs take four tiles each
    # (4 groups x 2 column tiles), of 0 to 2 token steps (the empty group in between, groups
    # sharing boundary chunks), so stages are reused across tiles at both depths. Any stage
    # or barrier phase taken out of turn gives other products, or hangs.
    sizes = jnp.asarray([50, 0, 177, 100], jnp.int32)
    operands, kwargs = _wgrad_operand_kinds(kind, seed=23)
    tile_t = 128 if kind in ("FP8, scaled", "block FP8") else 64
    config = dataclasses.replace(tiny_wgrad(tile_t), max_concurrent_steps=stages)

    def wgrad(persistent: bool):
        return grouped_matmul_wgrad(
            *operands,
            sizes,
            **kwargs,
            config=dataclasses.replace(config, persistent_pipeline=persistent),
            interpret=True,
        )

    per_tile, persistent = np.asarray(wgrad(False)), np.asarray(wgrad(True))
    np.testing.assert_array_equal(persistent, per_tile)
    assert not persistent[1].any() and persistent[0].any() and persistent[3].any()


def test_wgrad_persistent_pipeline_is_a_bool():
    with pytest.raises(TypeError, match="persistent_pipeline must be a bool, got 1"):
        GroupedWgradConfig(persistent_pipeline=1)


def test_fp8_wgrad_block_scales_refusals():
    lhs, rhs, sizes = jnp.zeros((128, 256), E4M3), jnp.zeros((64, 256), E4M3), jnp.asarray([256])
    lhs_scale, rhs_scale = jnp.ones((128, 2), jnp.float32), jnp.ones((64, 2), jnp.float32)
    sizes = sizes.astype(jnp.int32)
    with pytest.raises(ValueError, match="go together: got only one"):
        grouped_matmul_wgrad(lhs, rhs, sizes, lhs_block_scale=lhs_scale)
    with pytest.raises(ValueError, match="do not combine with 1x128 block scales"):
        grouped_matmul_wgrad(
            lhs,
            rhs,
            sizes,
            lhs_scale=jnp.float32(1),
            lhs_block_scale=lhs_scale,
            rhs_block_scale=rhs_scale,
        )
    with pytest.raises(TypeError, match="need FP8 token-contiguous operands"):
        grouped_matmul_wgrad(
            lhs.astype(BF16),
            rhs.astype(BF16),
            sizes,
            lhs_block_scale=lhs_scale,
            rhs_block_scale=rhs_scale,
        )
    with pytest.raises(ValueError, match=r"rhs_block_scale must have shape \(64, 2\)"):
        grouped_matmul_wgrad(
            lhs, rhs, sizes, lhs_block_scale=lhs_scale, rhs_block_scale=rhs_scale[:, :1]
        )
    with pytest.raises(TypeError, match=r"lhs_block_scale must have dtype in \(float32\)"):
        grouped_matmul_wgrad(
            lhs, rhs, sizes, lhs_block_scale=lhs_scale.astype(BF16), rhs_block_scale=rhs_scale
        )
    with pytest.raises(ValueError, match="1x128 block scales need tile_t=128"):
        grouped_matmul_wgrad(
            lhs,
            rhs,
            sizes,
            lhs_block_scale=lhs_scale,
            rhs_block_scale=rhs_scale,
            config=tiny_wgrad(64),
        )
    with pytest.raises(ValueError, match="a main and a chunk accumulator"):
        grouped_matmul_wgrad(
            lhs,
            rhs,
            sizes,
            lhs_block_scale=lhs_scale,
            rhs_block_scale=rhs_scale,
            config=dataclasses.replace(tiny_wgrad(128), tile_n=128),
        )


# ---------------------------------------------------------------------------- bad inputs


def _bf16(shape):
    return jnp.zeros(shape, BF16)


_SIZES2 = jnp.zeros((2,), jnp.int32)


@pytest.mark.parametrize(
    ("call", "error", "needle"),
    [
        (
            lambda: grouped_matmul(_bf16((8, 16)), _bf16((2, 16, 16)), jnp.zeros((3,), jnp.int32)),
            ValueError,
            "group_sizes",
        ),
        # A packed output needs both group_starts and out_rows, well-formed.
        (
            lambda: grouped_matmul(_bf16((8, 16)), _bf16((2, 16, 16)), _SIZES2, out_rows=8),
            ValueError,
            "group_starts and out_rows go together",
        ),
        (
            lambda: grouped_matmul(
                _bf16((8, 16)), _bf16((2, 16, 16)), _SIZES2, group_starts=_SIZES2, out_rows=0
            ),
            ValueError,
            "out_rows must be a positive int",
        ),
        (
            lambda: grouped_matmul(
                _bf16((8, 16)),
                _bf16((2, 16, 16)),
                _SIZES2,
                group_starts=jnp.zeros((3,), jnp.int32),
                out_rows=8,
            ),
            ValueError,
            "group_starts must have length 2",
        ),
        (
            lambda: grouped_matmul(
                _bf16((8, 16)),
                _bf16((2, 16, 16)),
                _SIZES2,
                group_starts=jnp.zeros((2,), jnp.float32),
                out_rows=8,
            ),
            TypeError,
            "group_starts must be int32",
        ),
        (
            lambda: grouped_matmul(_bf16((8, 16)), _bf16((2, 16, 16)), jnp.zeros((2,), jnp.int16)),
            TypeError,
            "group_sizes",
        ),
        (
            lambda: grouped_matmul(
                _bf16((8, 16)), _bf16((2, 16, 16)), jnp.zeros((2, 1), jnp.int32)
            ),
            ValueError,
            "group_sizes",
        ),
        (
            lambda: grouped_matmul(_bf16((8, 16)), _bf16((2, 16, 24)), jnp.zeros((2,), jnp.int32)),
            ValueError,
            "contraction",
        ),
        (
            lambda: grouped_matmul(
                _bf16((8, 16, 1)), _bf16((2, 16, 16)), jnp.zeros((2,), jnp.int32)
            ),
            ValueError,
            "lhs",
        ),
        (
            lambda: grouped_matmul(_bf16((8, 16)), _bf16((16, 16)), jnp.zeros((2,), jnp.int32)),
            ValueError,
            "rhs",
        ),
        (
            lambda: grouped_matmul(
                jnp.zeros((8, 16), jnp.float32), _bf16((2, 16, 16)), jnp.zeros((2,), jnp.int32)
            ),
            TypeError,
            "lhs",
        ),
        (
            lambda: grouped_matmul(
                _bf16((8, 16)), jnp.zeros((2, 16, 16), E4M3), jnp.zeros((2,), jnp.int32)
            ),
            TypeError,
            "dtypes",
        ),
        (
            lambda: grouped_matmul(
                jnp.zeros((8, 16), E4M3),
                jnp.zeros((2, 16, 16), E4M3),
                jnp.zeros((2,), jnp.int32),
                rhs_layout="kn",
            ),
            ValueError,
            "rhs_layout",
        ),
        (
            lambda: grouped_matmul(
                _bf16((8, 16)),
                _bf16((2, 16, 16)),
                jnp.zeros((2,), jnp.int32),
                out_dtype=jnp.float16,
            ),
            TypeError,
            "out_dtype",
        ),
        (
            lambda: grouped_matmul(
                jnp.zeros((8, 16), E4M3),
                jnp.zeros((2, 16, 16), E4M3),
                jnp.zeros((2,), jnp.int32),
                lhs_scale=jnp.ones((7,)),
            ),
            ValueError,
            "lhs_scale",
        ),
        (
            lambda: grouped_matmul(
                jnp.zeros((8, 16), E4M3),
                jnp.zeros((2, 16, 16), E4M3),
                jnp.zeros((2,), jnp.int32),
                rhs_scale=jnp.ones((2, 3)),
            ),
            ValueError,
            "rhs_scale",
        ),
        (
            lambda: grouped_matmul_fp8_block(
                jnp.zeros((8, 256), E4M3),
                jnp.ones((8, 3)),
                jnp.zeros((2, 128, 256), E4M3),
                jnp.ones((2, 1, 2)),
                jnp.zeros((2,), jnp.int32),
            ),
            ValueError,
            "lhs_scale",
        ),
        (
            lambda: grouped_matmul_fp8_block(
                jnp.zeros((8, 200), E4M3),
                jnp.ones((8, 2)),
                jnp.zeros((2, 128, 200), E4M3),
                jnp.ones((2, 1, 2)),
                jnp.zeros((2,), jnp.int32),
            ),
            ValueError,
            "multiple of 128",
        ),
        (
            lambda: grouped_matmul_fp8_block(
                _bf16((8, 256)),
                jnp.ones((8, 2)),
                jnp.zeros((2, 128, 256), E4M3),
                jnp.ones((2, 1, 2)),
                jnp.zeros((2,), jnp.int32),
            ),
            TypeError,
            "lhs",
        ),
        (
            lambda: grouped_matmul_wgrad(
                _bf16((16, 64)), _bf16((16, 72)), jnp.zeros((2,), jnp.int32)
            ),
            ValueError,
            "token",
        ),
        (
            lambda: grouped_matmul_wgrad(
                _bf16((16, 64)), _bf16((16, 64)), jnp.zeros((2,), jnp.float32)
            ),
            TypeError,
            "group_sizes",
        ),
        (
            lambda: grouped_matmul_wgrad(
                _bf16((16, 64)),
                _bf16((16, 64)),
                jnp.zeros((2,), jnp.int32),
                lhs_scale=jnp.ones((15,)),
            ),
            ValueError,
            "lhs_scale",
        ),
    ],
)
def test_bad_inputs_raise_naming_the_argument(call, error, needle):
    with pytest.raises(error, match=needle):
        call()


@pytest.mark.parametrize(
    ("factory", "needle"),
    [
        (lambda: GroupedMatmulConfig(tile_m=96), "tile_m"),
        (lambda: GroupedMatmulConfig(tile_n=88), "tile_n"),
        (lambda: GroupedMatmulConfig(tile_k=48), "tile_k"),
        (lambda: GroupedMatmulConfig(max_concurrent_steps=0), "max_concurrent_steps"),
        (lambda: GroupedMatmulConfig(tile_n=128, epi_tile_n=48), "epi_tile_n"),
        (lambda: GroupedMatmulConfig(tile_m=256, tile_n=128), "register"),
        (lambda: GroupedWgradConfig(tile_m=64), "tile_m"),
        (lambda: GroupedWgradConfig(tile_t=48), "tile_t"),
        (lambda: GroupedMatmulConfig(wgmma_in_flight=2), "wgmma_in_flight"),
        (
            lambda: GroupedMatmulConfig(max_concurrent_steps=1, wgmma_in_flight=1),
            "max_concurrent_steps",
        ),
        (lambda: GroupedMatmulConfig(epilogue_buffers=3), "epilogue_buffers"),
        (lambda: GroupedMatmulConfig(cluster_n=4), "cluster_n"),
        (lambda: GroupedMatmulConfig(profile_dir=""), "profile_dir"),
        (lambda: GroupedMatmulConfig(cluster_n=2, num_sms=131), "num_sms"),
        (lambda: GroupedMatmulConfig(cluster_m=3), "cluster_m must be 1 or 2"),
        (lambda: GroupedMatmulConfig(cluster_m=2, cluster_n=2), "cannot be combined"),
        (lambda: GroupedMatmulConfig(cluster_m=2, num_sms=131), "num_sms"),
        (
            lambda: GroupedMatmulConfig(stagger_consumers=True, wgmma_in_flight=1),
            "stagger_consumers needs wgmma_in_flight=0",
        ),
        (lambda: GroupedMatmulConfig(consumer_split="k"), "consumer_split must be 'n' or 'm'"),
        (
            lambda: GroupedMatmulConfig(tile_m=64, consumer_split="m"),
            "consumer_split='m' needs tile_m to be a multiple of 128",
        ),
        (
            lambda: GroupedMatmulConfig(tile_m=128, tile_n=192, consumer_split="m"),
            "at most 256",
        ),
        (lambda: GroupedMatmulConfig(num_consumers=4), "num_consumers must be 2 or 3, got 4"),
        (lambda: GroupedMatmulConfig(num_consumers=3), "num_consumers=3 needs consumer_split='m'"),
        (
            lambda: GroupedMatmulConfig(
                tile_m=192, tile_n=64, consumer_split="m", num_consumers=3, stagger_consumers=True
            ),
            "stagger_consumers needs num_consumers=2",
        ),
        (
            lambda: GroupedMatmulConfig(stream_lhs_scales=True, wgmma_in_flight=1),
            "stream_lhs_scales needs wgmma_in_flight=0",
        ),
        (
            lambda: GroupedMatmulConfig(block_scales_before_mma=True, wgmma_in_flight=1),
            "block_scales_before_mma needs wgmma_in_flight=0",
        ),
        (
            lambda: GroupedMatmulConfig(tile_m=128, tile_n=64, consumer_split="m", num_consumers=3),
            "multiple of 192",
        ),
    ],
)
def test_bad_configs_raise(factory, needle):
    with pytest.raises(ValueError, match=needle):
        factory()


def test_early_block_scales_must_be_a_bool():
    with pytest.raises(TypeError, match="early_block_scales must be a bool, got 1"):
        GroupedMatmulConfig(early_block_scales=1)


@pytest.mark.parametrize(
    "option", ["stream_lhs_scales", "stagger_consumers", "block_scales_before_mma"]
)
def test_block_fp8_options_are_bools_for_block_fp8_only(option):
    with pytest.raises(TypeError, match=f"{option} must be a bool, got 1"):
        GroupedMatmulConfig(**{option: 1})
    config = dataclasses.replace(TINY_FWD_BF16_OUT, **{option: True})
    with pytest.raises(ValueError, match=f"{option} applies to the block-FP8 kernel"):
        grouped_matmul(
            _bf16((128, 64)),
            _bf16((2, 256, 64)),
            jnp.zeros((2,), jnp.int32),
            out_dtype=BF16,
            config=config,
            interpret=True,
        )


def test_persistent_pipeline_must_be_a_bool():
    with pytest.raises(TypeError, match="persistent_pipeline"):
        GroupedMatmulConfig(persistent_pipeline=1)


def test_swizzled_epilogue_must_be_a_bool():
    with pytest.raises(TypeError, match="swizzled_epilogue"):
        GroupedMatmulConfig(swizzled_epilogue=1)


def test_epilogue_rows_must_span_128_bytes():
    config = GroupedMatmulConfig(
        tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=2, epi_tile_n=32
    )
    with pytest.raises(ValueError, match="128 bytes"):
        grouped_matmul(
            _bf16((256, 256)),
            _bf16((2, 256, 256)),
            jnp.zeros((2,), jnp.int32),
            out_dtype=BF16,
            config=config,
        )


def test_config_that_overflows_shared_memory_is_rejected():
    config = GroupedMatmulConfig(tile_m=128, tile_n=128, tile_k=128, max_concurrent_steps=8)
    with pytest.raises(ValueError, match="shared memory"):
        grouped_matmul(
            _bf16((256, 256)), _bf16((2, 256, 256)), jnp.zeros((2,), jnp.int32), config=config
        )


# ------------------------------------------------------------------------------- stream-K


@pytest.mark.parametrize(
    ("num_items", "num_ctas", "num_k_steps"),
    [
        (9, 5, 4),  # one full round + 4: every item split
        (2048, 132, 64),  # issue 5's G8 balanced at 128 x (2 x 128)
        (2160, 132, 64),  # G8 skewed
        (1456, 132, 32),  # the 192-row tile on G8
        (133, 132, 1),  # one K step: pieces are whole items
        (264, 132, 64),  # whole rounds: nothing split
        (131, 132, 64),  # fewer items than CTAs: nothing split
    ],
)
def test_stream_k_share_splits_each_item_between_two_neighbouring_ctas(
    num_items, num_ctas, num_k_steps
):
    pieces = {}  # item -> [(cta, piece index, k_begin, k_end)]
    work, num_pieces = [], []
    for cta in range(num_ctas):
        share = driver.stream_k_share(jnp.int32(num_items), jnp.int32(cta), num_ctas, num_k_steps)
        dp_items = int(share.dp_items)
        assert 0 <= dp_items <= num_items
        n = int(share.num_pieces)
        num_pieces.append(n)
        work.append(dp_items // num_ctas * num_k_steps + int(share.unit_end - share.unit_begin))
        for index in range(n):
            item, k_begin, k_end = (int(v) for v in share.piece(jnp.int32(index)))
            assert 0 <= k_begin < k_end <= num_k_steps
            pieces.setdefault(dp_items + item, []).append((cta, index, k_begin, k_end))
    # The stream-K items are the last ones, each covered once, in at most two pieces.
    assert sorted(pieces) == list(range(dp_items, num_items))
    for item_pieces in pieces.values():
        covered = sorted((k_begin, k_end) for _, _, k_begin, k_end in item_pieces)
        assert covered[0][0] == 0 and covered[-1][1] == num_k_steps
        assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))
        assert len(item_pieces) <= 2
        if len(item_pieces) == 2:
            (writer, writer_index, _, _), (reader, reader_index, _, _) = sorted(
                item_pieces, key=lambda piece: piece[2]
            )
            # The first K steps on the previous CTA, run first there; the last, run last.
            assert reader == writer + 1
            assert writer_index == 0 and reader_index == num_pieces[reader] - 1
    assert max(num_pieces) <= 3
    if num_items % num_ctas == 0 or num_items < num_ctas:
        assert not pieces and dp_items == num_items
    else:  # whole data-parallel rounds, then every CTA ends together to one K step
        assert dp_items % num_ctas == 0
        assert max(work) - min(work) <= 1


STREAM_K_CASES = {
    # 3 visits x 3 column tiles on 5 "SMs": one round + 4 items, every item split.
    "bf16_f32_out": dict(config=dict(num_sms=5), sizes=[37, 0, 90], k=256),
    "bf16_persistent_data_parallel_rounds": dict(
        config=dict(num_sms=4, persistent_pipeline=True), sizes=[160], k=256, cols=600
    ),
    "bf16_consumers_split_rows": dict(
        config=dict(num_sms=5, tile_m=128, consumer_split="m"), sizes=[37, 0, 90], k=192
    ),
    "fp8_rowwise_scales": dict(config=dict(num_sms=5, tile_k=128), sizes=[37, 0, 90], k=384),
    "fp8_rowwise_packed_output": dict(
        config=dict(num_sms=3, tile_k=128), sizes=[37, 0, 90], k=256, starts=[0, 64, 64]
    ),
}


@pytest.mark.parametrize("case", sorted(STREAM_K_CASES))
def test_stream_k_matches_reference(case):
    spec = STREAM_K_CASES[case]
    config = dataclasses.replace(TINY_FWD, stream_k=True, **spec["config"])
    sizes = jnp.asarray(spec["sizes"], jnp.int32)
    rows, k_dim, cols = 160, spec["k"], spec.get("cols", 300)
    key = keys(4, seed=31)
    fp8 = case.startswith("fp8")
    if fp8:
        lhs = random_fp8(key[0], (rows, k_dim), E4M3)
        rhs = random_fp8(key[1], (sizes.shape[0], cols, k_dim), E5M2)
        lhs_scale = jax.random.uniform(key[2], (rows,), jnp.float32, 0.5, 2.0)
        rhs_scale = jax.random.uniform(key[3], (sizes.shape[0], cols), jnp.float32, 0.5, 2.0)
        scales = dict(lhs_scale=lhs_scale, rhs_scale=rhs_scale)
        lhs_ref = f64(lhs) * f64(lhs_scale)[:, None]
        rhs_ref = f64(rhs) * f64(rhs_scale)[..., None]
    else:
        lhs = jax.random.normal(key[0], (rows, k_dim), jnp.float32).astype(BF16)
        rhs = jax.random.normal(key[1], (sizes.shape[0], cols, k_dim), jnp.float32).astype(BF16)
        scales, lhs_ref, rhs_ref = {}, f64(lhs), f64(rhs)
    packed = {}
    if "starts" in spec:
        out_rows = int(sum(spec["sizes"]))
        packed = dict(group_starts=jnp.asarray(spec["starts"], jnp.int32), out_rows=out_rows)
        ref = ref_packed_rows(lhs_ref, rhs_ref, spec["sizes"], spec["starts"], out_rows)
    else:
        ref = ref_ragged_rows(lhs_ref, rhs_ref, sizes)
    out = grouped_matmul(
        lhs, rhs, sizes, out_dtype=jnp.float32, config=config, interpret=True, **scales, **packed
    )
    assert_close(out, ref, rel=1e-5)


BLOCK_STREAM_K_CASES = {
    # 64 x (2 x 128) tiles on 5 "SMs", scales prefetched per tile (waited on at each piece's
    # first K block), then streamed with the K steps, and staggered consumers.
    "grouped": dict(num_sms=5),
    "grouped_streamed_scales_persistent": dict(
        num_sms=5, stream_lhs_scales=True, persistent_pipeline=True
    ),
    "grouped_staggered": dict(num_sms=5, stagger_consumers=True),
    "dense_three_consumers": dict(
        num_sms=2, tile_m=192, tile_n=64, consumer_split="m", num_consumers=3
    ),
}


@pytest.mark.parametrize("case", sorted(BLOCK_STREAM_K_CASES))
def test_block_fp8_stream_k_matches_dequantized_reference(case):
    # The split items' promotions use the K blocks' own scales (the piece's K steps count
    # from the tile's first).
    config = dataclasses.replace(TINY_BLOCK, stream_k=True, **BLOCK_STREAM_K_CASES[case])
    rows, k_dim, cols = 160, 512, 300
    sizes = jnp.asarray([37, 0, 90], jnp.int32)
    dense = case.startswith("dense")
    groups = () if dense else (3,)
    key = keys(4, seed=32)
    lhs = random_fp8(key[0], (rows, k_dim), E4M3)
    lhs_scale = 2.0 ** jax.random.randint(key[1], (rows, k_dim // 128), -3, 4).astype(jnp.float32)
    rhs = random_fp8(key[2], (*groups, cols, k_dim), E4M3)
    rhs_scale = 2.0 ** jax.random.randint(key[3], (*groups, 3, k_dim // 128), -3, 4).astype(
        jnp.float32
    )
    lhs_dq = dequant_fp8_block(lhs, lhs_scale, 1, 128)
    rhs_dq = dequant_fp8_block(rhs, rhs_scale, 128, 128)
    if dense:
        out = dense_matmul_fp8_block(
            lhs, lhs_scale, rhs, rhs_scale, out_dtype=jnp.float32, config=config, interpret=True
        )
        ref = lhs_dq @ rhs_dq.T
    else:
        out = grouped_matmul_fp8_block(
            lhs,
            lhs_scale,
            rhs,
            rhs_scale,
            sizes,
            out_dtype=jnp.float32,
            config=config,
            interpret=True,
        )
        ref = ref_ragged_rows(lhs_dq, rhs_dq, sizes)
    assert_close(out, ref, rel=1e-5)


@pytest.mark.parametrize("out_dtype", [BF16, jnp.float32])
def test_grouped_default_is_stream_k_over_the_persistent_pipeline_where_k_allows(out_dtype):
    from pallas_kernels import grouped_matmul_fwd as fwd

    vectors = fwd._vector_bytes(fwd.DEFAULT_BF16_CONFIG)
    for k in (4096, 2048, 1000, 256):  # whole rounds of 4 stages (1000 pads to 1024)
        config = fwd.grouped_default_config(False, k, out_dtype, vector_bytes=vectors)
        assert config.stream_k and config.persistent_pipeline and config.wgmma_in_flight == 0
        assert config.max_concurrent_steps == 4 and config.epilogue_buffers == 1
        stage = config.tile_k * (config.tile_m + 2 * config.tile_n) * 2
        assert fwd._smem_bytes(config, stage, out_dtype, vectors) <= fwd.SMEM_BYTES
    # 1408 = 22 K steps of 64: not whole rounds, the whole-item default.
    config = fwd.grouped_default_config(False, 1408, out_dtype, vector_bytes=vectors)
    assert not config.stream_k and not config.persistent_pipeline
    assert config.max_concurrent_steps == fwd.DEFAULT_BF16_CONFIG.max_concurrent_steps
    # FP8 rowwise keeps its whole-item default with a wgmma in flight (stop 45's timings
    # disagreed); stream-K is STREAM_K_FP8_CONFIG, opt-in.
    for k in (4096, 1408):
        config = fwd.grouped_default_config(True, k, out_dtype, vector_bytes=vectors)
        assert not config.stream_k and config.wgmma_in_flight == 1
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="k must be a positive int"):
            fwd.grouped_default_config(False, bad, out_dtype)
    with pytest.raises(TypeError, match="fp8 must be a bool, got 1"):
        fwd.grouped_default_config(1, 4096, out_dtype)
    with pytest.raises(ValueError, match="out_dtype must be bfloat16 or float32, got float16"):
        fwd.grouped_default_config(False, 4096, jnp.float16)
    with pytest.raises(ValueError, match="vector_bytes must be an int >= 0, got -4"):
        fwd.grouped_default_config(False, 4096, out_dtype, vector_bytes=-4)


def test_empty_contraction_is_refused_by_name():
    with pytest.raises(ValueError, match="contraction size K >= 1, got K=0"):
        grouped_matmul(
            jnp.zeros((64, 0), BF16), jnp.zeros((2, 64, 0), BF16), jnp.zeros((2,), jnp.int32)
        )


def test_stream_k_share_names_bad_sizes():
    for arg, bad in (("num_ctas", 0), ("num_k_steps", 2.0)):
        sizes = {"num_ctas": 132, "num_k_steps": 64} | {arg: bad}
        with pytest.raises(ValueError, match=f"{arg} must be a positive int, got {bad!r}"):
            driver.stream_k_share(jnp.int32(2048), jnp.int32(0), **sizes)


def test_stream_k_bad_configs_and_kernels_raise():
    with pytest.raises(TypeError, match="stream_k must be a bool, got 1"):
        GroupedMatmulConfig(stream_k=1)
    with pytest.raises(ValueError, match="stream_k needs cluster_n=1"):
        GroupedMatmulConfig(stream_k=True, cluster_n=2)
    with pytest.raises(ValueError, match="stream_k needs wgmma_in_flight=0"):
        GroupedMatmulConfig(stream_k=True, wgmma_in_flight=1)


# ---------------------------------------------------------------- cross-lowering for the H200


def _lower_for_h200(fn, *avals) -> str:
    return export_for_h200(fn, *avals).mlir_module()


S = jax.ShapeDtypeStruct
G, M, K, N = 8, 16384, 4096, 4096
SIZES = S((G,), jnp.int32)
F32 = jnp.float32


H200_BF16 = GroupedMatmulConfig(
    tile_m=128,
    tile_n=128,
    tile_k=64,
    max_concurrent_steps=4,
    epi_tile_n=64,
    wgmma_in_flight=1,
    epilogue_buffers=1,
)
H200_BLOCK = GroupedMatmulConfig(
    tile_m=64, tile_n=128, tile_k=128, max_concurrent_steps=4, epi_tile_n=64, wgmma_in_flight=1
)
# Three consumers of 64 x 256 (two 128-column wgmmas each) in 192 x (2 x 128) CTA tiles; with
# tile_n=64, of 64 x 128 in 192 x (2 x 64).
THREE_CONSUMER_BF16 = dataclasses.replace(
    DEFAULT_BF16_CONFIG, tile_m=192, consumer_split="m", num_consumers=3, epilogue_buffers=1
)
THREE_CONSUMER_FP8 = dataclasses.replace(
    DEFAULT_FP8_CONFIG, tile_m=192, consumer_split="m", num_consumers=3, max_concurrent_steps=3
)
THREE_CONSUMER_H200_BLOCK = dataclasses.replace(
    H200_BLOCK, tile_m=192, tile_n=64, consumer_split="m", num_consumers=3, wgmma_in_flight=0
)
STREAM_K_BF16 = dataclasses.replace(DEFAULT_BF16_CONFIG, stream_k=True)
STREAM_K_FP8_PERSISTENT = dataclasses.replace(
    DEFAULT_FP8_CONFIG, wgmma_in_flight=0, persistent_pipeline=True, stream_k=True
)
BLOCK_AVALS = (
    S((M, K), E4M3),
    S((M, K // 128), F32),
    S((G, N, K), E4M3),
    S((G, N // 128, K // 128), F32),
    SIZES,
)


def _block_case(config: GroupedMatmulConfig, **changes) -> tuple:
    """A grouped block-FP8 cross-lowering case at BLOCK_AVALS with `config` (+ `changes`)."""
    return (
        functools.partial(grouped_matmul_fp8_block, config=dataclasses.replace(config, **changes)),
        BLOCK_AVALS,
    )


CROSS_LOWERING_CASES = {
    "bf16_fwd_nk": (
        lambda a, b, g: grouped_matmul(a, b, g, config=H200_BF16),
        (S((M, K), BF16), S((G, N, K), BF16), SIZES),
    ),
    "bf16_fwd_kn_f32_out": (
        lambda a, b, g: grouped_matmul(a, b, g, rhs_layout="kn", out_dtype=F32),
        (S((M, K), BF16), S((G, K, N), BF16), SIZES),
    ),
    "fp8_fwd_e4m3_rowwise": (
        lambda a, b, g, sa, sb: grouped_matmul(a, b, g, lhs_scale=sa, rhs_scale=sb),
        (S((M, K), E4M3), S((G, N, K), E4M3), SIZES, S((M,), F32), S((G, N), F32)),
    ),
    "bf16_fwd_stream_k": (
        lambda a, b, g: grouped_matmul(a, b, g, config=STREAM_K_BF16),
        (S((M, K), BF16), S((G, N, K), BF16), SIZES),
    ),
    "fp8_fwd_rowwise_stream_k_persistent": (
        lambda a, b, g, sa, sb: grouped_matmul(
            a, b, g, lhs_scale=sa, rhs_scale=sb, config=STREAM_K_FP8_PERSISTENT
        ),
        (S((M, K), E4M3), S((G, N, K), E4M3), SIZES, S((M,), F32), S((G, N), F32)),
    ),
    "fp8_dgrad_e5m2_x_e4m3_tensor": (
        lambda a, b, g, sa, sb: grouped_matmul(a, b, g, lhs_scale=sa, rhs_scale=sb, out_dtype=F32),
        (S((M, N), E5M2), S((G, K, N), E4M3), SIZES, S((), F32), S((G,), F32)),
    ),
    "fp8_block_fwd": _block_case(H200_BLOCK),
    "fp8_block_dense": (
        lambda a, sa, b, sb: dense_matmul_fp8_block(a, sa, b, sb),
        (S((8192, 8192), E4M3), S((8192, 64), F32), S((8192, 8192), E4M3), S((64, 64), F32)),
    ),
    # 1x128 rhs blocks (the layers' block-FP8 wgrad): the dense default (three consumers,
    # streamed lhs scales, persistent) and the grouped three-consumer tile with stream-K.
    "fp8_block_dense_1x128_rhs": (
        lambda a, sa, b, sb: dense_matmul_fp8_block(
            a, sa, b, sb, lhs_scale_k_major=True, rhs_block_rows=1
        ),
        (S((4096, 8192), E4M3), S((64, 4096), F32), S((2048, 8192), E4M3), S((2048, 64), F32)),
    ),
    "fp8_block_fwd_1x128_rhs_stream_k": (
        lambda a, sa, b, sb, g: grouped_matmul_fp8_block(
            a,
            sa,
            b,
            sb,
            g,
            rhs_block_rows=1,
            config=dataclasses.replace(
                fp8_block_default_config(K, BF16, rhs_block_rows=1), stream_k=True
            ),
        ),
        (
            S((M, K), E4M3),
            S((M, K // 128), F32),
            S((G, N, K), E4M3),
            S((G, N, K // 128), F32),
            SIZES,
        ),
    ),
    "bf16_dense": (
        lambda a, b: dense_matmul(a, b),
        (S((8192, 8192), BF16), S((8192, 8192), BF16)),
    ),
    # Clusters along M (rhs multicast): the dense entry points only.
    "fp8_block_dense_cluster_m": (
        lambda a, sa, b, sb: dense_matmul_fp8_block(
            a, sa, b, sb, config=dataclasses.replace(H200_BLOCK, wgmma_in_flight=0, cluster_m=2)
        ),
        (S((8192, 8192), E4M3), S((8192, 64), F32), S((8192, 8192), E4M3), S((64, 64), F32)),
    ),
    "bf16_dense_cluster_m": (
        lambda a, b: dense_matmul(a, b, config=dataclasses.replace(H200_BF16, cluster_m=2)),
        (S((8192, 8192), BF16), S((8192, 8192), BF16)),
    ),
    "bf16_wgrad": (
        lambda a, b, g: grouped_matmul_wgrad(a, b, g),
        (S((K, M), BF16), S((N, M), BF16), SIZES),
    ),
    # Per-tensor FP8's wgrad: the per-group scales' product in the epilogue, bf16 out.
    "fp8_wgrad_group_scales": (
        lambda a, b, g, s: grouped_matmul_wgrad(a, b, g, group_scale=s, out_dtype=BF16),
        (S((K, M), E4M3), S((N, M), E5M2), SIZES, S((G,), F32)),
    ),
    # NVFP4's wgrad on the 16-bit kernel: its two global decode scales in turn, bf16 out.
    "bf16_wgrad_two_group_factors": (
        lambda a, b, g, s: grouped_matmul_wgrad(a, b, g, group_scale=s, out_dtype=BF16),
        (S((K, M), BF16), S((N, M), BF16), SIZES, S((2, G), F32)),
    ),
    # Block FP8's wgrad: 1x128 token blocks on both copies, the scales streamed per chunk.
    "fp8_wgrad_1x128_block_scales": (
        lambda a, b, g, sa, sb: grouped_matmul_wgrad(
            a, b, g, lhs_block_scale=sa, rhs_block_scale=sb
        ),
        (S((K, M), E4M3), S((N, M), E4M3), SIZES, S((K, M // 128), F32), S((N, M // 128), F32)),
    ),
    # One TMA pipeline from tile to tile (stop 57's persistent_pipeline), the MoE default's
    # block FP8 and the token-major bf16 wgrad.
    "fp8_wgrad_1x128_block_scales_persistent": (
        lambda a, b, g, sa, sb: grouped_matmul_wgrad(
            a,
            b,
            g,
            lhs_block_scale=sa,
            rhs_block_scale=sb,
            out_dtype=BF16,
            config=dataclasses.replace(DEFAULT_FP8_BLOCK_WGRAD_CONFIG, persistent_pipeline=True),
        ),
        (S((K, M), E4M3), S((N, M), E4M3), SIZES, S((K, M // 128), F32), S((N, M // 128), F32)),
    ),
    "bf16_wgrad_token_major_persistent": (
        lambda a, b, g: grouped_matmul_wgrad(
            a,
            b,
            g,
            token_major=True,
            config=dataclasses.replace(DEFAULT_BF16_WGRAD_CONFIG, persistent_pipeline=True),
        ),
        (S((M, K), BF16), S((M, N), BF16), SIZES),
    ),
    "fp8_wgrad_e4m3_x_e5m2_scaled": (
        lambda a, b, g, sa, sb: grouped_matmul_wgrad(
            a, b, g, lhs_scale=sa, rhs_scale=sb, out_dtype=BF16
        ),
        (S((K, M), E4M3), S((N, M), E5M2), SIZES, S((K,), F32), S((), F32)),
    ),
    # Shapes that are not whole tiles (M, N not multiples of 8, K / tokens not whole
    # swizzle atoms) are zero-padded by the wrappers; without that Mosaic GPU refuses
    # the TMA descriptors (seen on the H200 for 1008 tokens, 2026-11-29).
    "odd_shapes_bf16_fwd": (
        lambda a, b, g: grouped_matmul(a, b, g),
        (S((1001, 96), BF16), S((5, 380, 96), BF16), S((5,), jnp.int32)),
    ),
    # A packed output (the quantized activations' aligned layout: groups padded to 32 rows):
    # whole tiles from output rows that are multiples of 8 through the swizzled epilogue.
    "bf16_fwd_packed_output": (
        lambda a, b, g, starts: grouped_matmul(a, b, g, group_starts=starts, out_rows=M),
        (S((M + G * 32, K), BF16), S((G, N, K), BF16), SIZES, SIZES),
    ),
    "fp8_block_fwd_packed_output": (
        lambda a, sa, b, sb, g, starts: grouped_matmul_fp8_block(
            a, sa, b, sb, g, group_starts=starts, out_rows=M, config=H200_BLOCK
        ),
        (*BLOCK_AVALS, SIZES),
    ),
    "odd_shapes_bf16_fwd_kn": (
        lambda a, b, g: grouped_matmul(a, b, g, rhs_layout="kn"),
        (S((1001, 96), BF16), S((5, 96, 380), BF16), S((5,), jnp.int32)),
    ),
    "odd_shapes_fp8_fwd": (
        lambda a, b, g, sa, sb: grouped_matmul(a, b, g, lhs_scale=sa, rhs_scale=sb),
        (
            S((1001, 200), E4M3),
            S((5, 380, 200), E5M2),
            S((5,), jnp.int32),
            S((1001,), F32),
            S((5, 380), F32),
        ),
    ),
    "odd_shapes_fp8_block": (
        lambda a, sa, b, sb, g: grouped_matmul_fp8_block(a, sa, b, sb, g),
        (
            S((1001, 256), E4M3),
            S((1001, 2), F32),
            S((5, 380, 256), E4M3),
            S((5, 3, 2), F32),
            S((5,), jnp.int32),
        ),
    ),
    "odd_shapes_bf16_wgrad": (
        lambda a, b, g: grouped_matmul_wgrad(a, b, g),
        (S((500, 1008), BF16), S((380, 1008), BF16), S((5,), jnp.int32)),
    ),
    "odd_shapes_bf16_wgrad_token_major": (
        lambda a, b, g: grouped_matmul_wgrad(a, b, g, token_major=True),
        (S((1008, 500), BF16), S((1008, 380), BF16), S((5,), jnp.int32)),
    ),
    "bf16_wgrad_token_major_moe_step": (
        lambda a, b, g: grouped_matmul_wgrad(a, b, g, token_major=True),
        (S((65536, 512), BF16), S((65536, 2048), BF16), S((8,), jnp.int32)),
    ),
    "odd_shapes_fp8_wgrad": (
        lambda a, b, g: grouped_matmul_wgrad(a, b, g),
        (S((500, 1000), E4M3), S((380, 1000), E5M2), S((5,), jnp.int32)),
    ),
    "bf16_fwd_cluster_persistent": (
        lambda a, b, g: grouped_matmul(
            a,
            b,
            g,
            config=dataclasses.replace(
                H200_BF16, wgmma_in_flight=0, persistent_pipeline=True, cluster_n=2
            ),
        ),
        (S((M, K), BF16), S((G, N, K), BF16), SIZES),
    ),
    "fp8_block_fwd_cluster_persistent": _block_case(
        H200_BLOCK, persistent_pipeline=True, cluster_n=2
    ),
    # 128 x (2 x 64) CTA tiles (stop 26's block_tiles A/B), a wgmma in flight: 3 f32 tiles.
    "fp8_block_fwd_tall_tiles": _block_case(H200_BLOCK, tile_m=128, tile_n=64),
    # Consumers that split the rows (one m64n256 wgmma each per K slice), with the defaults'
    # other settings, a packed output and the lhs multicast to a cluster.
    "bf16_fwd_consumers_split_rows": (
        lambda a, b, g: grouped_matmul(
            a, b, g, config=dataclasses.replace(DEFAULT_BF16_CONFIG, consumer_split="m")
        ),
        (S((M, K), BF16), S((G, N, K), BF16), SIZES),
    ),
    "fp8_fwd_rowwise_consumers_split_rows": (
        lambda a, b, g, sa, sb: grouped_matmul(
            a,
            b,
            g,
            lhs_scale=sa,
            rhs_scale=sb,
            config=dataclasses.replace(DEFAULT_FP8_CONFIG, consumer_split="m"),
        ),
        (S((M, K), E4M3), S((G, N, K), E4M3), SIZES, S((M,), F32), S((G, N), F32)),
    ),
    "bf16_fwd_consumers_split_rows_packed_cluster": (
        lambda a, b, g, starts: grouped_matmul(
            a,
            b,
            g,
            group_starts=starts,
            out_rows=M,
            config=dataclasses.replace(DEFAULT_BF16_CONFIG, consumer_split="m", cluster_n=2),
        ),
        (S((M + G * 32, K), BF16), S((G, N, K), BF16), SIZES, SIZES),
    ),
    # Three consumers of 64 rows each (192 x (2 x 64) CTA tiles): block FP8's main + chunk
    # 64 x 128 accumulators, and one 64 x 128 accumulator for bf16 and FP8 rowwise.
    "fp8_block_fwd_three_consumers_persistent": _block_case(
        THREE_CONSUMER_H200_BLOCK, epilogue_buffers=1, persistent_pipeline=True
    ),
    "fp8_block_fwd_three_consumers_streamed_scales_persistent": _block_case(
        THREE_CONSUMER_H200_BLOCK,
        persistent_pipeline=True,
        stream_lhs_scales=True,
        grid_minor_dim=1,
    ),
    "fp8_block_fwd_streamed_scales_cluster": _block_case(
        H200_BLOCK, wgmma_in_flight=0, stream_lhs_scales=True, cluster_n=2
    ),
    "bf16_fwd_three_consumers": (
        lambda a, b, g: grouped_matmul(
            a, b, g, config=dataclasses.replace(THREE_CONSUMER_BF16, tile_n=64)
        ),
        (S((M, K), BF16), S((G, N, K), BF16), SIZES),
    ),
    "fp8_fwd_rowwise_three_consumers": (
        lambda a, b, g, sa, sb: grouped_matmul(
            a,
            b,
            g,
            lhs_scale=sa,
            rhs_scale=sb,
            config=dataclasses.replace(THREE_CONSUMER_FP8, tile_n=64),
        ),
        (S((M, K), E4M3), S((G, N, K), E4M3), SIZES, S((M,), F32), S((G, N), F32)),
    ),
    "bf16_fwd_three_consumers_wide": (
        lambda a, b, g: grouped_matmul(a, b, g, config=THREE_CONSUMER_BF16),
        (S((M, K), BF16), S((G, N, K), BF16), SIZES),
    ),
    "fp8_fwd_rowwise_three_consumers_wide": (
        lambda a, b, g, sa, sb: grouped_matmul(
            a, b, g, lhs_scale=sa, rhs_scale=sb, config=THREE_CONSUMER_FP8
        ),
        (S((M, K), E4M3), S((G, N, K), E4M3), SIZES, S((M,), F32), S((G, N), F32)),
    ),
    "small_experts_fwd": (
        lambda a, b, g: grouped_matmul(
            a,
            b,
            g,
            config=GroupedMatmulConfig(
                tile_m=128,
                tile_n=64,
                tile_k=64,
                max_concurrent_steps=5,
                epi_tile_n=64,
                wgmma_in_flight=1,
            ),
        ),
        (S((32768, 2048), BF16), S((64, 1408, 2048), BF16), S((64,), jnp.int32)),
    ),
}


@pytest.mark.parametrize("name", sorted(CROSS_LOWERING_CASES))
def test_cross_lowers_for_h200(name):
    fn, avals = CROSS_LOWERING_CASES[name]
    module = _lower_for_h200(fn, *avals)
    assert "mosaic_gpu" in module


_WGMMA_SHAPE = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k\d+")


@pytest.mark.parametrize(
    "name", ["bf16_fwd_three_consumers_wide", "fp8_fwd_rowwise_three_consumers_wide"]
)
def test_three_consumer_wide_parts_issue_no_wgmma_ptxas_refuses(name):
    # With four warpgroups ptxas checks each instruction against 128 registers a thread: one
    # m64n256 (128 accumulator registers) is refused, so 64 x 256 parts are issued as
    # 128-column wgmmas (benchmarks/ptxas_wgmma_budget.py has the rule).
    fn, avals = CROSS_LOWERING_CASES[name]
    (module,) = mosaic_modules(fn, *avals)
    widths = {int(n) for n in _WGMMA_SHAPE.findall(module)}
    assert widths == {128}


@pytest.mark.parametrize(
    ("kernel", "num_cols", "out_dtype"),
    [
        ("grouped_nk", 1312, BF16),  # not a multiple of 64: the bf16 epilogue's swizzle atom
        ("grouped_kn", 1300, F32),  # not a multiple of 32: the f32 one's
        ("block", 1300, F32),
    ],
)
def test_output_columns_off_the_epilogue_swizzle_atom_lower_for_h200(kernel, num_cols, out_dtype):
    # The epilogue's TMA stores go through the output's tiled view, whose minor extent must be
    # a multiple of the swizzle atom: the wrappers pad the output columns to it (stop 45's
    # H200 run failed at lowering for 1312 bf16 columns before they did).
    g, m, k = 2, 512, 256
    if kernel == "block":
        avals = (S((m, k), E4M3), S((m, k // 128), F32), S((g, num_cols, k), E4M3))
        avals += (S((g, -(-num_cols // 128), k // 128), F32), S((g,), jnp.int32))
        fn = functools.partial(grouped_matmul_fp8_block, out_dtype=out_dtype)
    else:
        layout = kernel.removeprefix("grouped_")
        rhs = (g, num_cols, k) if layout == "nk" else (g, k, num_cols)
        avals = (S((m, k), BF16), S(rhs, BF16), S((g,), jnp.int32))
        fn = functools.partial(grouped_matmul, rhs_layout=layout, out_dtype=out_dtype)
    exported = export_for_h200(fn, *avals)
    assert exported.out_avals[0].shape == (m, num_cols)


def _scale_loads_around_the_wgmmas(module: str, loaded: str, window: int = 500):
    """How many shared-memory loads of `loaded` values (e.g. "vector<2xf32>") the module has
    within `window` lines before its first wgmma instruction, and within `window` after its
    last: where a K step's (or chunk's) scale loads sit in the kernel handed to ptxas."""
    lines = module.splitlines()
    mmas = [i for i, line in enumerate(lines) if "wgmma.mma_async" in line]
    assert mmas, "no wgmma in the module"
    loads = [i for i, line in enumerate(lines) if f"ptr<3> -> {loaded}" in line]
    before = sum(min(mmas) - window <= i < min(mmas) for i in loads)
    after = sum(max(mmas) < i <= max(mmas) + window for i in loads)
    return before, after


@pytest.mark.parametrize("scales_first", [False, True])
def test_wgrad_block_scale_loads_sit_where_the_config_puts_them(scales_first):
    # What we control of stop 56's finding (ptxas may still reorder): in the kernel handed to
    # ptxas, each chunk's column-scale loads from shared memory (vector<2xf32>, 8 pairs a
    # thread) come after the chunk's wgmma instructions without block_scales_before_mma (stop
    # 53's order), and before them with it (the MoE default since stop 57).
    tokens, k, n = 1024, 512, 512
    avals = (S((k, tokens), E4M3), S((n, tokens), E4M3), S((2,), jnp.int32))
    avals += (S((k, tokens // 128), F32), S((n, tokens // 128), F32))
    config = dataclasses.replace(
        DEFAULT_FP8_BLOCK_WGRAD_CONFIG, block_scales_before_mma=scales_first
    )
    (module,) = mosaic_modules(
        lambda a, b, g, sa, sb: grouped_matmul_wgrad(
            a, b, g, lhs_block_scale=sa, rhs_block_scale=sb, config=config
        ),
        *avals,
    )
    before, after = _scale_loads_around_the_wgmmas(module, "vector<2xf32>")
    assert (before, after) == ((8, 0) if scales_first else (0, 8))


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "prefetched table"])
@pytest.mark.parametrize("scales_first", [False, True])
def test_fp8_block_forward_scale_loads_sit_where_the_config_puts_them(streamed, scales_first):
    # The same for the dense block-FP8 forward's row scales (three consumers of 64 rows: two
    # f32 a thread), from the streamed stage or from the tile's prefetched table.
    m = k = n = 1024
    avals = (S((m, k), E4M3), S((k // 128, m), F32), S((n, k), E4M3))
    avals += (S((n // 128, k // 128), F32),)
    config = fp8_block_default_config(k, BF16, persistent_pipeline=True, stream_lhs_scales=streamed)
    config = dataclasses.replace(config, block_scales_before_mma=scales_first)
    (module,) = mosaic_modules(
        lambda a, sa, b, sb: dense_matmul_fp8_block(
            a, sa, b, sb, lhs_scale_k_major=True, config=config
        ),
        *avals,
    )
    before, after = _scale_loads_around_the_wgmmas(module, "vector<1xf32>")
    assert (before, after) == ((2, 0) if scales_first else (0, 2))


def test_stream_k_lowers_with_global_semaphores_and_leaves_the_default_alone():
    # The split items' partials are handed over through a release / acquire pair at GPU
    # scope; the default kernel has no semaphore at all.
    fn, avals = CROSS_LOWERING_CASES["bf16_fwd_stream_k"]
    (module,) = mosaic_modules(fn, *avals)
    assert "red.release.gpu.global.add.u32" in module
    assert "fence.acquire.gpu" in module
    (default_module,) = mosaic_modules(
        lambda a, b, g: grouped_matmul(a, b, g, config=DEFAULT_BF16_CONFIG), *avals
    )
    assert "red.release" not in default_module


@pytest.mark.parametrize("case", sorted(gpu_cases.THREE_CONSUMER_CASES))
def test_three_consumer_gpu_cases_lower_for_h200(case):
    # Each gpu case's two configs pass validation and the shared-memory check and lower for
    # the H200 at the gpu test's shapes, so that a config error costs no device time (stop 43's
    # first streamed-scale run failed on its own test config).
    rows, k, n, g = gpu_cases.ROWS, gpu_cases.K_DIM, gpu_cases.N_DIM, gpu_cases.NUM_GROUPS
    operands = gpu_cases.THREE_CONSUMER_CASES[case]["operands"]
    for config in gpu_cases.three_consumer_configs(case):
        assert "mosaic_gpu" in _lower_for_h200(*_gpu_case_call(operands, config, rows, k, n, g))


@pytest.mark.parametrize("case", sorted(gpu_cases.STREAM_K_CASES))
def test_stream_k_gpu_cases_lower_for_h200(case):
    rows, n = gpu_cases.STREAM_K_ROWS, gpu_cases.STREAM_K_N
    g = gpu_cases.STREAM_K_SIZES.shape[0]
    operands = gpu_cases.STREAM_K_CASES[case]["operands"]
    k = gpu_cases.STREAM_K_BLOCK_K if operands == "fp8_block" else gpu_cases.STREAM_K_K
    for config in gpu_cases.stream_k_configs(case):
        assert "mosaic_gpu" in _lower_for_h200(*_gpu_case_call(operands, config, rows, k, n, g))


def _gpu_case_call(operands: str, config, rows: int, k: int, n: int, g: int) -> tuple:
    """(kernel call, its avals) of a gpu case's operand kind at its shapes, f32 output."""
    if operands == "fp8_block_dense":
        avals = (S((rows, k), E4M3), S((rows, k // 128), F32))
        avals += (S((n, k), E4M3), S((-(-n // 128), k // 128), F32))
        return functools.partial(dense_matmul_fp8_block, out_dtype=F32, config=config), *avals
    if operands == "fp8_block":
        avals = (S((rows, k), E4M3), S((rows, k // 128), F32), S((g, n, k), E4M3))
        avals += (S((g, -(-n // 128), k // 128), F32), S((g,), jnp.int32))
        return functools.partial(grouped_matmul_fp8_block, out_dtype=F32, config=config), *avals
    if operands == "fp8":
        avals = (S((rows, k), E4M3), S((g, n, k), E5M2), S((g,), jnp.int32))
        avals += (S((rows,), F32), S((g, n), F32))

        def fn(a, b, sizes, sa, sb):
            return grouped_matmul(
                a, b, sizes, lhs_scale=sa, rhs_scale=sb, out_dtype=F32, config=config
            )

        return fn, *avals
    avals = (S((rows, k), BF16), S((g, n, k), BF16), S((g,), jnp.int32))
    return functools.partial(grouped_matmul, out_dtype=F32, config=config), *avals


def test_fp8_operand_that_is_not_k_major_is_refused():
    # Hopper's fp8 wgmma reads K-major operands only; the wrapper refuses (G, K, N).
    with pytest.raises(ValueError, match="K-major"):
        grouped_matmul(
            jnp.zeros((64, 128), E4M3),
            jnp.zeros((2, 128, 64), E4M3),
            jnp.zeros((2,), jnp.int32),
            rhs_layout="kn",
        )


def test_block_fp8_default_config_is_persistent_only_where_asked_and_possible():
    # 32 K steps (4 stages: whole rounds) for the dense entry point; never for grouped calls.
    assert fp8_block_default_config(4096, BF16, persistent_pipeline=True).persistent_pipeline
    assert not fp8_block_default_config(4096, BF16).persistent_pipeline
    # Three consumers' lhs scales leave 3 stages at K = 8192: 64 K steps are not whole rounds.
    # Two consumers keep 4 stages there.
    assert not fp8_block_default_config(8192, BF16, persistent_pipeline=True).persistent_pipeline
    two = fp8_block_default_config(8192, BF16, persistent_pipeline=True, num_consumers=2)
    assert (two.tile_m, two.num_consumers, two.persistent_pipeline) == (64, 2, True)
    # 5 K steps are not whole rounds of 4 stages; 3 steps shrink the pipeline to 3 stages.
    assert not fp8_block_default_config(640, BF16, persistent_pipeline=True).persistent_pipeline
    assert fp8_block_default_config(384, BF16, persistent_pipeline=True).persistent_pipeline
    for bad_k in (0, 200, 256.0):
        with pytest.raises(ValueError, match="k must be a positive multiple of 128"):
            fp8_block_default_config(bad_k, BF16)
    with pytest.raises(ValueError, match="num_consumers must be 2 or 3, got 4"):
        fp8_block_default_config(4096, BF16, num_consumers=4)


@pytest.mark.parametrize("stream", [False, True])
def test_block_fp8_default_config_with_streamed_scales_keeps_three_consumers(stream):
    from pallas_kernels.grouped_matmul_fwd import fp8_block_default_config

    # Streamed lhs scales take no per-tile table: three consumers and four stages at any K,
    # persistent where the K steps are whole rounds of them. Prefetched, K = 16384 falls back
    # to two consumers.
    for k, persistent in ((4096, True), (16384, True), (640, False)):
        config = fp8_block_default_config(
            k, BF16, persistent_pipeline=True, stream_lhs_scales=stream
        )
        assert config.stream_lhs_scales == stream
        if stream:
            assert (config.num_consumers, config.max_concurrent_steps) == (3, 4), k
            assert config.persistent_pipeline == persistent, k
    assert fp8_block_default_config(16384, BF16).num_consumers == 2
    with pytest.raises(TypeError, match="stream_lhs_scales must be a bool, got 1"):
        fp8_block_default_config(4096, BF16, stream_lhs_scales=1)


def test_block_fp8_default_keeps_two_consumers_for_small_groups(monkeypatch):
    from pallas_kernels import grouped_matmul_fwd
    from pallas_kernels.grouped_matmul_fwd import (
        MIN_ROWS_PER_GROUP_THREE_CONSUMERS,
        fp8_block_default_config,
    )

    # Taller tiles waste more rows where groups start: three consumers from 1024 rows a group.
    assert MIN_ROWS_PER_GROUP_THREE_CONSUMERS == 1024
    for rows_per_group, consumers in ((None, 3), (2048, 3), (1024, 3), (1023.5, 2), (512, 2)):
        config = fp8_block_default_config(4096, BF16, rows_per_group=rows_per_group)
        assert config.num_consumers == consumers, rows_per_group
    for bad, error in ((-1, ValueError), ("many", TypeError), (True, TypeError)):
        with pytest.raises(error, match="rows_per_group must be"):
            fp8_block_default_config(4096, BF16, rows_per_group=bad)

    # The grouped wrapper passes its lhs rows over its groups (one group: the dense rule).
    seen = []

    def record(group_sizes, operands, *, schedule, **kwargs):
        seen.append(schedule.num_consumers)
        return jnp.zeros((kwargs["num_rows"], kwargs["num_cols"]), kwargs["out_dtype"])

    monkeypatch.setattr(grouped_matmul_fwd.driver, "ragged_rows_call", record)
    for groups, rows in ((64, 32768), (8, 16384), (1, 512)):
        lhs = jnp.zeros((rows, 256), E4M3)
        grouped_matmul_fp8_block(
            lhs,
            jnp.ones((rows, 2), F32),
            jnp.zeros((groups, 128, 256), E4M3),
            jnp.ones((groups, 1, 2), F32),
            jnp.full((groups,), rows // groups, jnp.int32),
        )
    assert seen == [2, 3, 3]


@pytest.mark.parametrize("out_dtype", [BF16, F32])
def test_block_fp8_default_is_three_consumers_while_three_stages_fit(out_dtype):
    from pallas_kernels.grouped_matmul_fwd import fp8_block_default_config

    # Per-consumer lhs scales grow with K (3 x 4 B x K/128 x 64 rows): up to 12 K three
    # stages fit beside them, past that the two-consumer tile takes over (two stages of
    # three consumers ran slower than it on the H200, stop 43).
    for k, consumers, rows in ((128, 3, 192), (4096, 3, 192), (12288, 3, 192), (16384, 2, 64)):
        config = fp8_block_default_config(k, out_dtype)
        assert (config.num_consumers, config.tile_m) == (consumers, rows), k
        assert config.max_concurrent_steps >= 3, k


def test_fit_fp8_block_config_shrinks_to_shared_memory_and_rejects_bad_inputs():
    from pallas_kernels.grouped_matmul_fwd import fit_fp8_block_config

    tall = dataclasses.replace(H200_BLOCK, tile_m=128, tile_n=64, epilogue_buffers=2)
    # f32 epilogue rows of 128 rows: the epilogue narrows to 128-byte rows first.
    fitted = fit_fp8_block_config(tall, 4096, F32)
    assert (fitted.epi_tile_n, fitted.max_concurrent_steps) == (32, 4)
    assert fit_fp8_block_config(H200_BLOCK, 4096, BF16) == H200_BLOCK  # fits already
    for bad_k in (0, 200, 256.0, True):
        with pytest.raises(ValueError, match="k must be a positive multiple of 128"):
            fit_fp8_block_config(H200_BLOCK, bad_k, BF16)
    with pytest.raises(TypeError, match="config must be a GroupedMatmulConfig"):
        fit_fp8_block_config({"tile_m": 64}, 4096, BF16)
    with pytest.raises(ValueError, match="out_dtype must be bfloat16 or float32"):
        fit_fp8_block_config(H200_BLOCK, 4096, jnp.float16)


def test_interpreter_refuses_four_warpgroups_with_too_few_host_devices():
    # Three consumers + the producer hang in the interpreter with fewer than four host CPU
    # devices (stop 46); the wrapper names the remedy instead. A subprocess: this process
    # already has conftest's eight devices. Its timeout turns a hang back into a failure.
    import os
    import subprocess
    import sys

    script = (
        "import jax.numpy as jnp\n"
        "from pallas_kernels.grouped_matmul_fwd import grouped_matmul_fp8_block\n"
        "from tests.pallas_kernels.test_grouped_matmul import THREE_CONSUMER_BLOCK\n"
        "lhs = jnp.ones((300, 256), jnp.float8_e4m3fn)\n"
        "rhs = jnp.ones((1, 128, 256), jnp.float8_e4m3fn)\n"
        "grouped_matmul_fp8_block(lhs, jnp.ones((300, 2)), rhs, jnp.ones((1, 1, 2)),\n"
        "    jnp.asarray([300], jnp.int32), config=THREE_CONSUMER_BLOCK, interpret=True)\n"
    )
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode != 0
    assert "runs 4 warpgroups per CTA" in result.stderr
    assert "xla_force_host_platform_device_count=4" in result.stderr
