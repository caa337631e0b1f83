"""Grouped-matmul kernels (issue 5) on the H200, against float64 references.

Skipped without a GPU (tests/conftest.py). Shapes are chosen so that tiles are
partial in every direction (M, N, K not multiples of the tiles), groups are empty,
tiny, straddle tiles, and rows/tokens past sum(group_sizes) exist. Every element is
compared, tail rows included (they must be exactly zero).

Error bounds, as max |out - ref| / max |ref| with ref in float64 on the same
(dequantized) operands:
  bf16 operands, f32 out ............. 1e-5 (exact products, f32 sums)
  any operands, bf16 out ............. 2^-8 (one bf16 rounding)
  FP8 per-tensor / row scales ........ 2e-3 (fp8 wgmma sums in reduced precision
                                        inside the tensor core, ~2^-13 per add)
  FP8 block (promotion every 128 K) .. 1e-3
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.grouped_matmul_dense import dense_matmul, dense_matmul_fp8_block
from pallas_kernels.grouped_matmul_fwd import (
    GroupedMatmulConfig,
    fit_fp8_block_config,
    fp8_block_default_config,
    grouped_matmul,
    grouped_matmul_fp8_block,
)
from pallas_kernels.grouped_matmul_wgrad import (
    DEFAULT_BF16_WGRAD_CONFIG,
    DEFAULT_FP8_BLOCK_WGRAD_CONFIG,
    DEFAULT_FP8_WGRAD_CONFIG,
    default_wgrad_config,
    grouped_matmul_wgrad,
)
from tests.pallas_kernels.gpu_cases import (
    K_DIM,
    N_DIM,
    NUM_GROUPS,
    ROWS,
    SIZES,
    STREAM_K_BLOCK_K,
    STREAM_K_CASES,
    STREAM_K_K,
    STREAM_K_N,
    STREAM_K_ROWS,
    STREAM_K_SIZES,
    THREE_CONSUMER_CASES,
    stream_k_configs,
    three_consumer_configs,
)
from tests.pallas_kernels.test_grouped_matmul import (
    BF16,
    E4M3,
    E5M2,
    assert_close,
    dequant_fp8_block,
    f64,
    keys,
    random_fp8,
    ref_ragged_contraction,
    ref_ragged_rows,
)

pytestmark = pytest.mark.gpu
F32 = jnp.float32


@pytest.mark.parametrize("out_dtype", [jnp.float32, BF16])
@pytest.mark.parametrize("rhs_layout", ["nk", "kn"])
def test_gpu_bf16_forward(out_dtype, rhs_layout):
    k_lhs, k_rhs = keys(2, seed=10)
    lhs = jax.random.normal(k_lhs, (ROWS, K_DIM), jnp.float32).astype(BF16)
    rhs = jax.random.normal(k_rhs, (NUM_GROUPS, N_DIM, K_DIM), jnp.float32).astype(BF16)
    rhs_arg = rhs if rhs_layout == "nk" else jnp.swapaxes(rhs, 1, 2)
    out = jax.jit(grouped_matmul, static_argnames=("out_dtype", "rhs_layout"))(
        lhs, rhs_arg, SIZES, out_dtype=out_dtype, rhs_layout=rhs_layout
    )
    rel = 1e-5 if out_dtype == jnp.float32 else 2**-8
    assert_close(out, ref_ragged_rows(f64(lhs), f64(rhs), SIZES), rel=rel)


@pytest.mark.parametrize("scales", ["row_col", "tensor_group"])
def test_gpu_fp8_forward_mixed(scales):
    k = keys(4, seed=11)
    lhs = random_fp8(k[0], (ROWS, K_DIM), E5M2)
    rhs = random_fp8(k[1], (NUM_GROUPS, N_DIM, K_DIM), E4M3)
    if scales == "row_col":
        lhs_scale = jax.random.uniform(k[2], (ROWS,), jnp.float32, 0.25, 4.0)
        rhs_scale = jax.random.uniform(k[3], (NUM_GROUPS, N_DIM), jnp.float32, 0.25, 4.0)
        lhs_ref = f64(lhs) * f64(lhs_scale)[:, None]
        rhs_ref = f64(rhs) * f64(rhs_scale)[:, :, None]
    else:
        lhs_scale = jnp.float32(0.375)
        rhs_scale = jax.random.uniform(k[3], (NUM_GROUPS,), jnp.float32, 0.25, 4.0)
        lhs_ref = f64(lhs) * 0.375
        rhs_ref = f64(rhs) * f64(rhs_scale)[:, None, None]
    out = jax.jit(grouped_matmul, static_argnames=("out_dtype",))(
        lhs, rhs, SIZES, lhs_scale=lhs_scale, rhs_scale=rhs_scale, out_dtype=jnp.float32
    )
    assert_close(out, ref_ragged_rows(lhs_ref, rhs_ref, SIZES), rel=2e-3)


def test_gpu_fp8_block_forward():
    k = keys(4, seed=12)
    lhs = random_fp8(k[0], (ROWS, K_DIM), E4M3)
    rhs = random_fp8(k[1], (NUM_GROUPS, N_DIM, K_DIM), E4M3)
    lhs_scale = jax.random.uniform(k[2], (ROWS, K_DIM // 128), jnp.float32, 2.0**-6, 2.0**6)
    rhs_scale = jax.random.uniform(
        k[3], (NUM_GROUPS, N_DIM // 128, K_DIM // 128), jnp.float32, 2.0**-6, 2.0**6
    )
    out = jax.jit(grouped_matmul_fp8_block, static_argnames=("out_dtype",))(
        lhs, lhs_scale, rhs, rhs_scale, SIZES, out_dtype=jnp.float32
    )
    ref = ref_ragged_rows(
        dequant_fp8_block(lhs, lhs_scale, 1, 128),
        dequant_fp8_block(rhs, rhs_scale, 128, 128),
        SIZES,
    )
    assert_close(out, ref, rel=1e-3)
    overlapped = GroupedMatmulConfig(
        tile_m=64,
        tile_n=128,
        tile_k=128,
        max_concurrent_steps=4,
        epi_tile_n=64,
        wgmma_in_flight=1,
    )
    # 128 x (2 x 64) CTA tiles: both consumers of a CTA read one 128-column rhs scale block.
    # (Fitted: 128-row f32 epilogue buffers leave room for fewer stages.)
    tall = dataclasses.replace(overlapped, tile_m=128, tile_n=64)
    tall_no_overlap = dataclasses.replace(tall, wgmma_in_flight=0)
    tall_configs = [fit_fp8_block_config(c, K_DIM, jnp.float32) for c in (tall, tall_no_overlap)]
    for config in (overlapped, *tall_configs):
        out = jax.jit(grouped_matmul_fp8_block, static_argnames=("out_dtype", "config"))(
            lhs, lhs_scale, rhs, rhs_scale, SIZES, out_dtype=jnp.float32, config=config
        )
        assert_close(out, ref, rel=1e-3)
    # The scales loaded after the wgmma wait (early_block_scales=False, stops <= 34; the
    # default loads them before it): the same operations in another order, the same bits.
    default = jax.jit(grouped_matmul_fp8_block, static_argnames=("out_dtype",))(
        lhs, lhs_scale, rhs, rhs_scale, SIZES, out_dtype=jnp.float32
    )
    late = fp8_block_default_config(K_DIM, jnp.float32)
    late = dataclasses.replace(late, early_block_scales=False)
    out = jax.jit(grouped_matmul_fp8_block, static_argnames=("out_dtype", "config"))(
        lhs, lhs_scale, rhs, rhs_scale, SIZES, out_dtype=jnp.float32, config=late
    )
    np.testing.assert_array_equal(np.asarray(out), np.asarray(default))
    # The second consumer's first wgmma of each tile held behind the first's (with early and
    # late scale loads, and with the persistent pipeline): an order only, the same bits.
    staggered = dataclasses.replace(
        fp8_block_default_config(K_DIM, jnp.float32, num_consumers=2), stagger_consumers=True
    )
    for config in (
        staggered,
        dataclasses.replace(staggered, early_block_scales=False),
        dataclasses.replace(staggered, persistent_pipeline=True),
    ):
        out = jax.jit(grouped_matmul_fp8_block, static_argnames=("out_dtype", "config"))(
            lhs, lhs_scale, rhs, rhs_scale, SIZES, out_dtype=jnp.float32, config=config
        )
        np.testing.assert_array_equal(np.asarray(out), np.asarray(default))


@pytest.mark.parametrize("epilogue_buffers", [1, 2])
def test_gpu_one_wgmma_in_flight(epilogue_buffers):
    config = GroupedMatmulConfig(
        tile_m=128,
        tile_n=128,
        tile_k=64,
        max_concurrent_steps=3,
        epi_tile_n=64,
        wgmma_in_flight=1,
        epilogue_buffers=epilogue_buffers,
    )
    k_lhs, k_rhs = keys(2, seed=16)
    lhs = jax.random.normal(k_lhs, (ROWS, K_DIM), jnp.float32).astype(BF16)
    rhs = jax.random.normal(k_rhs, (NUM_GROUPS, N_DIM, K_DIM), jnp.float32).astype(BF16)
    out = jax.jit(grouped_matmul, static_argnames=("out_dtype", "config"))(
        lhs, rhs, SIZES, out_dtype=BF16, config=config
    )
    assert_close(out, ref_ragged_rows(f64(lhs), f64(rhs), SIZES), rel=2**-8)


@pytest.mark.parametrize("operands", ["bf16", "bf16_token_major", "fp8"])
def test_gpu_wgrad(operands):
    tokens = 1008
    sizes = jnp.asarray([0, 300, 1, 0, 550], jnp.int32)  # 157 unused tokens
    k = keys(3, seed=13)
    token_major = operands == "bf16_token_major"
    if operands.startswith("bf16"):
        lhs = jax.random.normal(k[0], (K_DIM, tokens), jnp.float32).astype(BF16)
        rhs = jax.random.normal(k[1], (N_DIM, tokens), jnp.float32).astype(BF16)
        lhs = lhs.at[:, 900:].set(jnp.nan)  # garbage past sum(group_sizes)
        kwargs, lhs_ref, rhs_ref, rel = {}, f64(lhs), f64(rhs), 1e-5
    else:
        lhs = random_fp8(k[0], (K_DIM, tokens), E4M3)
        rhs = random_fp8(k[1], (N_DIM, tokens), E5M2)
        lhs_scale = jax.random.uniform(k[2], (K_DIM,), jnp.float32, 0.25, 4.0)
        kwargs = {"lhs_scale": lhs_scale, "rhs_scale": jnp.float32(2.0)}
        lhs_ref, rhs_ref, rel = f64(lhs) * f64(lhs_scale)[:, None], f64(rhs) * 2.0, 2e-3
    if token_major:  # x (M, K) and dy (M, N), read MN-major by wgmma
        kwargs["token_major"] = True
        lhs, rhs = lhs.T, rhs.T
    out = jax.jit(grouped_matmul_wgrad, static_argnames="token_major")(lhs, rhs, sizes, **kwargs)
    assert out.shape == (NUM_GROUPS, K_DIM, N_DIM)
    assert_close(out, ref_ragged_contraction(lhs_ref, rhs_ref, sizes), rel=rel)


@pytest.mark.parametrize("out_dtype", [F32, BF16], ids=["float32", "bfloat16"])
def test_gpu_fp8_wgrad_group_scale_is_applied_last_then_rounded_once(out_dtype):
    # A grouped per-tensor FP8 wgrad's per-group scales in the epilogue (what jax_qtrain asks
    # since stop 69): the same bits as the kernel's float32 output scaled and rounded by XLA
    # afterwards (which the layer did before), with the defaults of both output dtypes on G8
    # with skewed and empty groups.
    tokens = 8192
    sizes = jnp.asarray([2800, 0, 128, 1, 0, 3000, 2000, 263], jnp.int32)
    k = keys(3, seed=37)
    lhs = random_fp8(k[0], (1024, tokens), E4M3)
    rhs = random_fp8(k[1], (1024, tokens), E5M2)
    group_scale = 2.0 ** jax.random.uniform(k[2], (8,), F32, -12.0, 12.0)
    unscaled = jax.jit(grouped_matmul_wgrad)(lhs, rhs, sizes)
    want = jax.jit(lambda out, s: (out * s[:, None, None]).astype(out_dtype))(unscaled, group_scale)
    got = jax.jit(
        lambda a, b, g, s: grouped_matmul_wgrad(a, b, g, group_scale=s, out_dtype=out_dtype)
    )(lhs, rhs, sizes, group_scale)
    bits = np.uint32 if out_dtype == F32 else np.uint16
    np.testing.assert_array_equal(np.asarray(got).view(bits), np.asarray(want).view(bits))


@pytest.mark.parametrize("num_sms", [None, 8])
@pytest.mark.parametrize(
    "operands", ["bf16", "bf16_token_major", "fp8", "fp8_3_stages", "block_fp8"]
)
def test_gpu_wgrad_persistent_pipeline_gives_the_same_bits(operands, num_sms):
    # One TMA pipeline from tile to tile (stop 57's `persistent_pipeline`): the same bits as
    # the per-tile pipeline of the same config, on G8 with skewed and empty groups (tiles of
    # 0 to 22 token steps) and every SM (about 4 tiles a CTA) or 8 of them (64 a CTA), so
    # each CTA's stages are reused across tiles with the pipeline running on. What the
    # interpreter cannot show: Hopper's barriers, TMA and the consumers' register raise.
    tokens, k_dim, n_dim = 8192, 1024, 1024
    sizes = jnp.asarray([2800, 0, 128, 1, 0, 3000, 2000, 263], jnp.int32)
    k = keys(4, seed=31)
    kwargs, token_major = {}, operands == "bf16_token_major"
    if operands.startswith("bf16"):
        lhs = jax.random.normal(k[0], (k_dim, tokens), jnp.float32).astype(BF16)
        rhs = jax.random.normal(k[1], (n_dim, tokens), jnp.float32).astype(BF16)
        default = DEFAULT_BF16_WGRAD_CONFIG
        if token_major:
            lhs, rhs, kwargs = lhs.T, rhs.T, dict(token_major=True)
    else:
        lhs, rhs = random_fp8(k[0], (k_dim, tokens), E4M3), random_fp8(k[1], (n_dim, tokens), E4M3)
        # (1024 tokens a group on average: the entry point's pick is 4 stages since stop 60.)
        default = default_wgrad_config(True, False, tokens, 8)
        if operands == "fp8_3_stages":
            default = DEFAULT_FP8_WGRAD_CONFIG
        kwargs = dict(lhs_scale=jax.random.uniform(k[2], (k_dim,), F32, 0.25, 4.0))
        if operands == "block_fp8":
            default = DEFAULT_FP8_BLOCK_WGRAD_CONFIG
            kwargs = dict(
                lhs_block_scale=2.0 ** jax.random.randint(k[2], (k_dim, 64), -6, 7).astype(F32),
                rhs_block_scale=2.0 ** jax.random.randint(k[3], (n_dim, 64), -6, 7).astype(F32),
                out_dtype=BF16,
            )
    config = dataclasses.replace(default, num_sms=num_sms)

    def wgrad(persistent: bool):
        c = dataclasses.replace(config, persistent_pipeline=persistent)
        return np.asarray(
            jax.jit(lambda a, b, g: grouped_matmul_wgrad(a, b, g, config=c, **kwargs))(
                lhs, rhs, sizes
            )
        )

    per_tile, persistent = wgrad(False), wgrad(True)
    np.testing.assert_array_equal(persistent.view(np.uint8), per_tile.view(np.uint8))
    assert not persistent[1].any() and persistent[0].any() and persistent[7].any()


def test_gpu_dense_entry_points():
    k = keys(6, seed=14)
    lhs = jax.random.normal(k[0], (ROWS, K_DIM), jnp.float32).astype(BF16)
    rhs = jax.random.normal(k[1], (N_DIM, K_DIM), jnp.float32).astype(BF16)
    out = jax.jit(dense_matmul, static_argnames=("out_dtype",))(lhs, rhs, out_dtype=jnp.float32)
    assert_close(out, f64(lhs) @ f64(rhs).T, rel=1e-5)
    lhs8 = random_fp8(k[2], (ROWS, K_DIM), E4M3)
    rhs8 = random_fp8(k[3], (N_DIM, K_DIM), E4M3)
    lhs_scale = jax.random.uniform(k[4], (ROWS, K_DIM // 128), jnp.float32, 0.5, 2.0)
    rhs_scale = jax.random.uniform(k[5], (N_DIM // 128, K_DIM // 128), jnp.float32, 0.5, 2.0)
    out = jax.jit(dense_matmul_fp8_block, static_argnames=("out_dtype",))(
        lhs8, lhs_scale, rhs8, rhs_scale, out_dtype=jnp.float32
    )
    ref = (
        dequant_fp8_block(lhs8, lhs_scale, 1, 128) @ dequant_fp8_block(rhs8, rhs_scale, 128, 128).T
    )
    assert_close(out, ref, rel=1e-3)


def test_gpu_fp8_error_is_real_not_elided():
    # numerics.md §6: XLA can elide fake-quant round trips on the GPU. The kernel
    # consumes real fp8 bytes, so an e4m3 GEMM on N(0,1) data must show e4m3-sized
    # error against the unquantized product (~3.8e-2), not bf16-sized (~3e-4).
    k_lhs, k_rhs = keys(2, seed=15)
    lhs32 = jax.random.normal(k_lhs, (ROWS, K_DIM), jnp.float32)
    rhs32 = jax.random.normal(k_rhs, (1, N_DIM, K_DIM), jnp.float32)
    sizes = jnp.asarray([ROWS], jnp.int32)
    out = jax.jit(grouped_matmul, static_argnames=("out_dtype",))(
        lhs32.astype(E4M3), rhs32.astype(E4M3), sizes, out_dtype=jnp.float32
    )
    exact = np.asarray(lhs32, np.float64) @ np.asarray(rhs32[0], np.float64).T
    rel = np.linalg.norm(np.asarray(out) - exact) / np.linalg.norm(exact)
    assert 1e-2 < rel < 1e-1, rel


@pytest.mark.parametrize("out_dtype", [jnp.float32, BF16])
def test_gpu_swizzled_and_plain_epilogues_store_the_same_bits(out_dtype):
    # Whole row tiles leave through the swizzled staging view by default; the plain view
    # (swizzled_epilogue=False, and every tile shared by two groups) must give identical bits.
    k_lhs, k_rhs = keys(2, seed=17)
    lhs = jax.random.normal(k_lhs, (ROWS, K_DIM), jnp.float32).astype(BF16)
    rhs = jax.random.normal(k_rhs, (NUM_GROUPS, N_DIM, K_DIM), jnp.float32).astype(BF16)
    run = jax.jit(grouped_matmul, static_argnames=("out_dtype", "config"))
    epi_tile_n = 128 // jnp.dtype(out_dtype).itemsize  # 128-byte epilogue rows
    outs = [
        run(
            lhs,
            rhs,
            SIZES,
            out_dtype=out_dtype,
            config=GroupedMatmulConfig(
                max_concurrent_steps=3, epi_tile_n=epi_tile_n, swizzled_epilogue=swizzled
            ),
        )
        for swizzled in (True, False)
    ]
    np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(outs[1]))
    assert_close(
        outs[0],
        ref_ragged_rows(f64(lhs), f64(rhs), SIZES),
        rel=1e-5 if out_dtype == jnp.float32 else 2**-8,
    )


# Packed outputs: groups of this split padded apart as the aligned layout stores them.
PACKED_SIZES = np.array([1000, 0, 1717, 3, 1200, 64])


def padded_groups(align: int) -> tuple[np.ndarray, np.ndarray]:
    """(aligned sizes, group starts) of PACKED_SIZES padded to multiples of `align` rows."""
    aligned = -(-PACKED_SIZES // align) * align
    return aligned, np.concatenate([[0], np.cumsum(aligned)[:-1]])


def gathered_in_token_order(aligned_out, starts, out_rows: int) -> np.ndarray:
    """The kernel's aligned output, each group's rows gathered in token order, zeros after."""
    token_rows = np.concatenate(
        [np.arange(st, st + sz) for st, sz in zip(starts, PACKED_SIZES, strict=True)]
    )
    want = np.zeros((out_rows, aligned_out.shape[1]), np.float32)
    want[: len(token_rows)] = np.asarray(aligned_out, np.float32)[token_rows]
    return want


@pytest.mark.parametrize("out_dtype", [jnp.float32, BF16])
@pytest.mark.parametrize("operands", ["bf16", "fp8"])
def test_gpu_packed_output_equals_the_aligned_output_gathered(operands, out_dtype):
    # Groups padded to multiples of 32 rows (the aligned layout) written in token order:
    # whole tiles from rows that are multiples of 8 (swizzled TMA) and from rows that are not
    # (plain path), partial tiles, an empty group, a tail. Same bits as the kernel's aligned
    # output gathered row by row, and the gap rows (huge) must reach no output.
    sizes = PACKED_SIZES
    aligned, starts = padded_groups(32)
    rows, out_rows = int(aligned.sum()) + 64, int(sizes.sum()) + 50
    k_lhs, k_rhs = keys(2, seed=29)
    lhs = jax.random.normal(k_lhs, (rows, K_DIM), jnp.float32)
    in_groups = np.zeros(rows, bool)
    for start, size in zip(starts, sizes, strict=True):
        in_groups[start : start + size] = True
    lhs = jnp.where(jnp.asarray(in_groups)[:, None], lhs, 1e4)
    rhs = jax.random.normal(k_rhs, (len(sizes), N_DIM, K_DIM), jnp.float32)
    dtype = BF16 if operands == "bf16" else E4M3
    lhs, rhs = lhs.astype(dtype), rhs.astype(dtype)
    run = jax.jit(grouped_matmul, static_argnames=("out_dtype", "out_rows"))
    packed = run(
        lhs,
        rhs,
        jnp.asarray(sizes, jnp.int32),
        group_starts=jnp.asarray(starts, jnp.int32),
        out_rows=out_rows,
        out_dtype=out_dtype,
    )
    aligned_out = run(lhs, rhs, jnp.asarray(aligned, jnp.int32), out_dtype=out_dtype)
    want = gathered_in_token_order(aligned_out, starts, out_rows)
    np.testing.assert_array_equal(np.asarray(packed, np.float32), want)


def test_gpu_block_fp8_packed_output_equals_the_aligned_output_gathered():
    # The FP8-block recipe's layout: groups padded to 128 rows; lhs_scale per lhs row.
    sizes = PACKED_SIZES
    aligned, starts = padded_groups(128)
    rows, out_rows = int(aligned.sum()), int(sizes.sum()) + 50
    k = keys(4, seed=30)
    lhs = random_fp8(k[0], (rows, K_DIM), E4M3)
    lhs_scale = jax.random.uniform(k[1], (rows, K_DIM // 128), jnp.float32, 0.5, 2.0)
    rhs = random_fp8(k[2], (len(sizes), N_DIM, K_DIM), E4M3)
    rhs_scale = jax.random.uniform(
        k[3], (len(sizes), -(-N_DIM // 128), K_DIM // 128), jnp.float32, 0.5, 2.0
    )
    run = jax.jit(grouped_matmul_fp8_block, static_argnames=("out_dtype", "out_rows"))
    packed = run(
        lhs,
        lhs_scale,
        rhs,
        rhs_scale,
        jnp.asarray(sizes, jnp.int32),
        group_starts=jnp.asarray(starts, jnp.int32),
        out_rows=out_rows,
        out_dtype=jnp.float32,
    )
    aligned_out = run(
        lhs, lhs_scale, rhs, rhs_scale, jnp.asarray(aligned, jnp.int32), out_dtype=jnp.float32
    )
    want = gathered_in_token_order(aligned_out, starts, out_rows)
    np.testing.assert_array_equal(np.asarray(packed), want)


SCHEDULES = {
    "persistent": dict(persistent_pipeline=True),
    "cluster": dict(cluster_n=2),
    "cluster_persistent": dict(cluster_n=2, persistent_pipeline=True),
    # Few CTAs, so that each runs several tiles: START, STEADY and STOP pipelines.
    "persistent_4_sms": dict(persistent_pipeline=True, num_sms=4),
    "cluster_persistent_4_sms": dict(cluster_n=2, persistent_pipeline=True, num_sms=4),
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("operands", ["bf16", "fp8", "fp8_block"])
def test_gpu_schedules_give_the_same_bits(schedule, operands):
    # The persistent pipeline and 2-CTA clusters (lhs multicast) change when and how tiles are
    # loaded, never the arithmetic: outputs must equal the default schedule's bit for bit.
    # K = 512 gives 8 bf16 / 4 FP8 K steps (whole rounds of 4 stages); N = 384 gives 2 CTA
    # column tiles of 256 for 128-wide consumers, and the 64-row block tiles leave many CTAs
    # with a single tile (its pipeline is started and never stopped).
    k = keys(4, seed=18)
    # 4 stages and one 32-column f32 epilogue buffer fill the 227 KiB of shared memory.
    base = dict(tile_m=128, tile_n=128, max_concurrent_steps=4, epi_tile_n=32, epilogue_buffers=1)
    if operands == "bf16":
        lhs = jax.random.normal(k[0], (ROWS, K_DIM), jnp.float32).astype(BF16)
        rhs = jax.random.normal(k[1], (NUM_GROUPS, N_DIM, K_DIM), jnp.float32).astype(BF16)
        args, kwargs, run = (lhs, rhs, SIZES), {}, grouped_matmul
        base["tile_k"] = 64
        ref, rel = ref_ragged_rows(f64(lhs), f64(rhs), SIZES), 1e-5
    elif operands == "fp8":
        lhs = random_fp8(k[0], (ROWS, K_DIM), E4M3)
        rhs = random_fp8(k[1], (NUM_GROUPS, N_DIM, K_DIM), E4M3)
        lhs_scale = jax.random.uniform(k[2], (ROWS,), jnp.float32, 0.25, 4.0)
        rhs_scale = jax.random.uniform(k[3], (NUM_GROUPS, N_DIM), jnp.float32, 0.25, 4.0)
        args, run = (lhs, rhs, SIZES), grouped_matmul
        kwargs = {"lhs_scale": lhs_scale, "rhs_scale": rhs_scale}
        base["tile_k"] = 128
        ref = ref_ragged_rows(
            f64(lhs) * f64(lhs_scale)[:, None], f64(rhs) * f64(rhs_scale)[:, :, None], SIZES
        )
        rel = 2e-3
    else:
        lhs = random_fp8(k[0], (ROWS, K_DIM), E4M3)
        rhs = random_fp8(k[1], (NUM_GROUPS, N_DIM, K_DIM), E4M3)
        lhs_scale = jax.random.uniform(k[2], (ROWS, K_DIM // 128), jnp.float32, 0.5, 2.0)
        rhs_scale = jax.random.uniform(
            k[3], (NUM_GROUPS, N_DIM // 128, K_DIM // 128), jnp.float32, 0.5, 2.0
        )
        args, kwargs, run = (lhs, lhs_scale, rhs, rhs_scale, SIZES), {}, grouped_matmul_fp8_block
        base.update(tile_m=64, tile_k=128, wgmma_in_flight=1)
        ref = ref_ragged_rows(
            dequant_fp8_block(lhs, lhs_scale, 1, 128),
            dequant_fp8_block(rhs, rhs_scale, 128, 128),
            SIZES,
        )
        rel = 1e-3
    call = jax.jit(run, static_argnames=("out_dtype", "config"))
    default = call(*args, **kwargs, out_dtype=jnp.float32, config=GroupedMatmulConfig(**base))
    config = GroupedMatmulConfig(**base, **SCHEDULES[schedule])
    out = call(*args, **kwargs, out_dtype=jnp.float32, config=config)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(default))
    assert_close(out, ref, rel=rel)


# cluster_m=2 on the dense entry points: a cluster's CTAs take consecutive row tiles and
# share each rhs tile by TMA multicast. Loads only: the bits must equal the default's. 1088
# rows are 17 tiles of 64 (block FP8) and 9 of 128 (bf16 / FP8 rowwise), so the last
# cluster's second CTA repeats its partner's tile without storing it; 4 SMs make every CTA
# run several tiles (with the persistent pipeline: START, STEADY and STOP).
CLUSTER_M_ROWS = 1088
CLUSTER_M_CASES = {
    "bf16": dict(operands="bf16"),
    "bf16_persistent_4_sms": dict(
        operands="bf16",
        schedule=dict(persistent_pipeline=True, max_concurrent_steps=4, num_sms=4),
    ),
    "fp8_rowwise": dict(operands="fp8"),
    "fp8_block": dict(operands="fp8_block"),
    "fp8_block_not_persistent_4_sms": dict(
        operands="fp8_block", schedule=dict(persistent_pipeline=False, num_sms=4)
    ),
}


@pytest.mark.parametrize("case", sorted(CLUSTER_M_CASES))
def test_gpu_clusters_along_m_give_the_default_bits(case):
    from pallas_kernels.grouped_matmul_fwd import DEFAULT_BF16_CONFIG, DEFAULT_FP8_CONFIG

    spec = CLUSTER_M_CASES[case]
    k = keys(4, seed=43)
    rows = CLUSTER_M_ROWS
    if spec["operands"] == "fp8_block":
        lhs = random_fp8(k[0], (rows, K_DIM), E4M3)
        rhs = random_fp8(k[1], (N_DIM, K_DIM), E4M3)
        lhs_scale = jax.random.uniform(k[2], (rows, K_DIM // 128), jnp.float32, 0.5, 2.0)
        rhs_scale = jax.random.uniform(k[3], (N_DIM // 128, K_DIM // 128), jnp.float32, 0.5, 2.0)
        args, run = (lhs, lhs_scale, rhs, rhs_scale), dense_matmul_fp8_block
        base = fp8_block_default_config(
            K_DIM, jnp.float32, persistent_pipeline=True, num_consumers=2
        )
        ref = (
            dequant_fp8_block(lhs, lhs_scale, 1, 128)
            @ dequant_fp8_block(rhs, rhs_scale, 128, 128).T
        )
        rel = 1e-3
    elif spec["operands"] == "fp8":
        lhs = random_fp8(k[0], (rows, K_DIM), E4M3)
        rhs = random_fp8(k[1], (N_DIM, K_DIM), E4M3)
        args, run = (lhs, rhs), dense_matmul
        base = dataclasses.replace(DEFAULT_FP8_CONFIG, max_concurrent_steps=3)
        ref, rel = f64(lhs) @ f64(rhs).T, 2e-3
    else:
        lhs = jax.random.normal(k[0], (rows, K_DIM), jnp.float32).astype(BF16)
        rhs = jax.random.normal(k[1], (N_DIM, K_DIM), jnp.float32).astype(BF16)
        args, run = (lhs, rhs), dense_matmul
        base = dataclasses.replace(DEFAULT_BF16_CONFIG, epi_tile_n=32, epilogue_buffers=1)
        ref, rel = f64(lhs) @ f64(rhs).T, 1e-5
    base = dataclasses.replace(base, **spec.get("schedule", {}))
    call = jax.jit(run, static_argnames=("out_dtype", "config"))
    default = call(*args, out_dtype=jnp.float32, config=base)
    out = call(*args, out_dtype=jnp.float32, config=dataclasses.replace(base, cluster_m=2))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(default))
    assert_close(out, ref, rel=rel)


# consumer_split="m" (each consumer owns 64 of the tile's 128 rows and all 256 columns, one
# m64n256 wgmma per K slice): every output element sums the same products in the same K
# order as the default split of the columns, so the bits must match the default's.
ROWS_SPLIT_CASES = {
    "bf16_nk": dict(operands="bf16"),
    "bf16_kn_bf16_out": dict(operands="bf16", rhs_layout="kn", out_dtype=BF16),
    "bf16_persistent_cluster": dict(
        operands="bf16",
        schedule=dict(
            persistent_pipeline=True, cluster_n=2, max_concurrent_steps=4, epilogue_buffers=1
        ),
    ),
    "fp8_row_col": dict(operands="fp8"),
    "fp8_persistent_4_sms": dict(
        operands="fp8",
        schedule=dict(persistent_pipeline=True, wgmma_in_flight=0, num_sms=4),
    ),
}


@pytest.mark.parametrize("case", sorted(ROWS_SPLIT_CASES))
def test_gpu_consumers_splitting_rows_give_the_default_bits(case):
    from pallas_kernels.grouped_matmul_fwd import DEFAULT_BF16_CONFIG, DEFAULT_FP8_CONFIG

    spec = ROWS_SPLIT_CASES[case]
    out_dtype = spec.get("out_dtype", jnp.float32)
    k = keys(4, seed=34)
    kwargs = {}
    if spec["operands"] == "bf16":
        lhs = jax.random.normal(k[0], (ROWS, K_DIM), jnp.float32).astype(BF16)
        rhs = jax.random.normal(k[1], (NUM_GROUPS, N_DIM, K_DIM), jnp.float32).astype(BF16)
        ref, base = ref_ragged_rows(f64(lhs), f64(rhs), SIZES), DEFAULT_BF16_CONFIG
        rel = 1e-5
    else:
        lhs = random_fp8(k[0], (ROWS, K_DIM), E4M3)
        rhs = random_fp8(k[1], (NUM_GROUPS, N_DIM, K_DIM), E5M2)
        kwargs["lhs_scale"] = jax.random.uniform(k[2], (ROWS,), jnp.float32, 0.25, 4.0)
        kwargs["rhs_scale"] = jax.random.uniform(k[3], (NUM_GROUPS, N_DIM), jnp.float32, 0.25, 4.0)
        ref = ref_ragged_rows(
            f64(lhs) * f64(kwargs["lhs_scale"])[:, None],
            f64(rhs) * f64(kwargs["rhs_scale"])[:, :, None],
            SIZES,
        )
        base, rel = DEFAULT_FP8_CONFIG, 2e-3
    if out_dtype == BF16:
        rel = 2**-8
    layout = spec.get("rhs_layout", "nk")
    rhs_arg = rhs if layout == "nk" else jnp.swapaxes(rhs, 1, 2)
    # The defaults' epilogue is sized for bf16 output: 128-byte rows of float32 halve it.
    epi_tile_n = 128 // jnp.dtype(out_dtype).itemsize
    base = dataclasses.replace(base, epi_tile_n=epi_tile_n, **spec.get("schedule", {}))
    call = jax.jit(grouped_matmul, static_argnames=("out_dtype", "config", "rhs_layout"))
    outs = [
        call(
            lhs,
            rhs_arg,
            SIZES,
            **kwargs,
            rhs_layout=layout,
            out_dtype=out_dtype,
            config=dataclasses.replace(base, consumer_split=split),
        )
        for split in ("n", "m")
    ]
    assert_close(outs[1], ref, rel=rel)
    np.testing.assert_array_equal(np.asarray(outs[1]), np.asarray(outs[0]))


@pytest.mark.parametrize("case", sorted(THREE_CONSUMER_CASES))
def test_gpu_three_consumers_give_the_default_bits(case):
    spec = THREE_CONSUMER_CASES[case]
    base, three = three_consumer_configs(case)
    k = keys(4, seed=45)
    operands = spec["operands"]
    if operands.startswith("fp8_block"):
        dense = operands == "fp8_block_dense"
        groups = () if dense else (NUM_GROUPS,)
        lhs = random_fp8(k[0], (ROWS, K_DIM), E4M3)
        rhs = random_fp8(k[1], (*groups, N_DIM, K_DIM), E4M3)
        lhs_scale = 2.0 ** jax.random.randint(k[2], (ROWS, K_DIM // 128), -6, 7).astype(F32)
        rhs_scale = 2.0 ** jax.random.randint(
            k[3], (*groups, N_DIM // 128, K_DIM // 128), -6, 7
        ).astype(F32)
        lhs_dq = dequant_fp8_block(lhs, lhs_scale, 1, 128)
        rhs_dq = dequant_fp8_block(rhs, rhs_scale, 128, 128)
        if dense:
            args, run = (lhs, lhs_scale, rhs, rhs_scale), dense_matmul_fp8_block
            ref = lhs_dq @ rhs_dq.T
        else:
            args, run = (lhs, lhs_scale, rhs, rhs_scale, SIZES), grouped_matmul_fp8_block
            ref = ref_ragged_rows(lhs_dq, rhs_dq, SIZES)
        rel = 1e-3
    elif operands == "fp8":
        lhs = random_fp8(k[0], (ROWS, K_DIM), E4M3)
        rhs = random_fp8(k[1], (NUM_GROUPS, N_DIM, K_DIM), E5M2)
        lhs_scale = jax.random.uniform(k[2], (ROWS,), F32, 0.25, 4.0)
        rhs_scale = jax.random.uniform(k[3], (NUM_GROUPS, N_DIM), F32, 0.25, 4.0)
        run = _grouped_matmul_with_scales
        args = (lhs, rhs, SIZES, lhs_scale, rhs_scale)
        ref = ref_ragged_rows(
            f64(lhs) * f64(lhs_scale)[:, None], f64(rhs) * f64(rhs_scale)[:, :, None], SIZES
        )
        rel = 2e-3
    else:
        lhs = jax.random.normal(k[0], (ROWS, K_DIM), F32).astype(BF16)
        rhs = jax.random.normal(k[1], (NUM_GROUPS, N_DIM, K_DIM), F32).astype(BF16)
        args, run = (lhs, rhs, SIZES), grouped_matmul
        ref = ref_ragged_rows(f64(lhs), f64(rhs), SIZES)
        rel = 1e-5
    call = jax.jit(run, static_argnames=("out_dtype", "config"))
    default = call(*args, out_dtype=F32, config=base)
    out = call(*args, out_dtype=F32, config=three)
    assert_close(out, ref, rel=rel)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(default))


def _grouped_matmul_with_scales(lhs, rhs, sizes, lhs_scale, rhs_scale, **kwargs):
    """FP8 rowwise `grouped_matmul` with its scales as positional arguments (for jit)."""
    return grouped_matmul(lhs, rhs, sizes, lhs_scale=lhs_scale, rhs_scale=rhs_scale, **kwargs)


def stream_k_operands(operands: str, seed: int, exact: bool):
    """(kernel, its arguments, float64 lhs and rhs it multiplies) of a STREAM_K_CASES
    operand kind. `exact`: small integers and power-of-two scales, so that every f32 sum is
    exact (|sums| <= 1000 codes for FP8, inside the tensor core's reduced-precision adds;
    <= 9000 for bf16); else random values."""
    rows, n_dim, sizes = STREAM_K_ROWS, STREAM_K_N, STREAM_K_SIZES
    num_groups = sizes.shape[0]
    k = keys(4, seed=seed)

    def codes(key, shape, dtype, bound):
        if exact:
            return jax.random.randint(key, shape, -bound, bound + 1).astype(F32).astype(dtype)
        if dtype == BF16:
            return jax.random.normal(key, shape, F32).astype(BF16)
        return random_fp8(key, shape, dtype)

    def scales(key, shape):
        if exact:
            return 2.0 ** jax.random.randint(key, shape, -2, 3).astype(F32)
        return jax.random.uniform(key, shape, F32, 0.25, 4.0)

    if operands == "fp8_block":
        k_dim, k_blocks = STREAM_K_BLOCK_K, STREAM_K_BLOCK_K // 128
        lhs = codes(k[0], (rows, k_dim), E4M3, 1)
        rhs = codes(k[1], (num_groups, n_dim, k_dim), E4M3, 1)
        lhs_scale = scales(k[2], (rows, k_blocks))
        rhs_scale = scales(k[3], (num_groups, pl.cdiv(n_dim, 128), k_blocks))
        lhs_ref = dequant_fp8_block(lhs, lhs_scale, 1, 128)
        rhs_ref = dequant_fp8_block(rhs, rhs_scale, 128, 128)
        return grouped_matmul_fp8_block, (lhs, lhs_scale, rhs, rhs_scale, sizes), lhs_ref, rhs_ref
    if operands == "fp8":
        lhs = codes(k[0], (rows, STREAM_K_K), E4M3, 1)
        rhs = codes(k[1], (num_groups, n_dim, STREAM_K_K), E5M2, 1)
        lhs_scale = scales(k[2], (rows,))
        rhs_scale = scales(k[3], (num_groups, n_dim))
        lhs_ref = f64(lhs) * f64(lhs_scale)[:, None]
        rhs_ref = f64(rhs) * f64(rhs_scale)[:, :, None]
        args = (lhs, rhs, sizes, lhs_scale, rhs_scale)
        return _grouped_matmul_with_scales, args, lhs_ref, rhs_ref
    lhs = codes(k[0], (rows, STREAM_K_K), BF16, 3)
    rhs = codes(k[1], (num_groups, n_dim, STREAM_K_K), BF16, 3)
    return grouped_matmul, (lhs, rhs, sizes), f64(lhs), f64(rhs)


@pytest.mark.parametrize("case", sorted(STREAM_K_CASES))
def test_gpu_stream_k_gives_the_default_bits_on_exact_sums(case):
    base, split = stream_k_configs(case)
    for seed in (46, 47):
        run, args, lhs_ref, rhs_ref = stream_k_operands(
            STREAM_K_CASES[case]["operands"], seed, exact=True
        )
        call = jax.jit(run, static_argnames=("out_dtype", "config"))
        ref = ref_ragged_rows(lhs_ref, rhs_ref, STREAM_K_SIZES)
        default = call(*args, out_dtype=F32, config=base)
        out = call(*args, out_dtype=F32, config=split)
        np.testing.assert_array_equal(np.asarray(out, np.float64), ref)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(default))


@pytest.mark.parametrize("case", sorted(STREAM_K_CASES))
def test_gpu_stream_k_gives_the_whole_item_bits_on_random_operands(case):
    # A split item's second CTA starts its accumulator from the first one's (Mosaic GPU's
    # preinitialized wgmma accumulators; block FP8's promoted sum): the same sums in the same
    # order as the whole item, so the same bits on any operands.
    base, split = stream_k_configs(case)
    run, args, _, _ = stream_k_operands(STREAM_K_CASES[case]["operands"], 48, exact=False)
    call = jax.jit(run, static_argnames=("out_dtype", "config"))
    whole = call(*args, out_dtype=F32, config=base)
    first = call(*args, out_dtype=F32, config=split)
    again = call(*args, out_dtype=F32, config=split)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(whole))
    np.testing.assert_array_equal(np.asarray(again), np.asarray(first))


# MXFP8 with in-kernel dequantization: the operands (bf16 of code · 2^k) are exact, the products
# exact in f32, so the bound is f32 summation (f32 out) or one bf16 rounding (bf16 out).
@pytest.mark.parametrize("wgmma_in_flight, lhs_in_registers", [(0, False), (1, False), (0, True)])
@pytest.mark.parametrize("out_dtype", [jnp.float32, BF16])
def test_gpu_mxfp8_forward(wgmma_in_flight, out_dtype, lhs_in_registers):
    import dataclasses

    from pallas_kernels.grouped_matmul_mx import DEFAULT_MXFP8_CONFIG, grouped_matmul_mxfp8
    from tests.pallas_kernels.test_grouped_matmul_mx import dequant_mxfp8_bf16, random_mxfp8

    k_lhs, k_rhs = keys(2, seed=40)
    lhs, lhs_scale = random_mxfp8(k_lhs, (ROWS, K_DIM), E4M3, 100, 150)
    rhs, rhs_scale = random_mxfp8(k_rhs, (NUM_GROUPS, N_DIM, K_DIM), E5M2, 100, 150)
    # Scale byte 0 (2^-127) blocks: their values fall below bf16's normal range and round.
    lhs_scale = lhs_scale.at[5, 3].set(0)
    config = None
    if wgmma_in_flight:
        config = dataclasses.replace(
            DEFAULT_MXFP8_CONFIG,
            wgmma_in_flight=1,
            max_concurrent_steps=2,
            epi_tile_n=128 // jnp.dtype(out_dtype).itemsize,
            epilogue_buffers=1,
        )
    out = jax.jit(
        grouped_matmul_mxfp8, static_argnames=("out_dtype", "config", "lhs_in_registers")
    )(
        lhs,
        lhs_scale,
        rhs,
        rhs_scale,
        SIZES,
        out_dtype=out_dtype,
        config=config,
        lhs_in_registers=lhs_in_registers,
    )
    want = ref_ragged_rows(
        dequant_mxfp8_bf16(lhs, lhs_scale), dequant_mxfp8_bf16(rhs, rhs_scale), SIZES
    )
    assert_close(out, want, rel=1e-5 if out_dtype == jnp.float32 else 2**-8)


def test_gpu_mxfp8_dequant_variants_give_the_same_bits():
    # The bf16 arithmetic (float16 conversion, packed bf16 multiplies) must give the float32
    # arithmetic's bits on the hardware too, subnormal results (scale bytes 0..8) and NaN
    # blocks included; so must both register layouts.
    from pallas_kernels.grouped_matmul_mx import grouped_matmul_mxfp8
    from tests.pallas_kernels.test_grouped_matmul_mx import random_mxfp8

    k_lhs, k_rhs = keys(2, seed=41)
    lhs, lhs_scale = random_mxfp8(k_lhs, (ROWS, K_DIM), E4M3, 0, 150)
    rhs, rhs_scale = random_mxfp8(k_rhs, (NUM_GROUPS, N_DIM, K_DIM), E5M2, 0, 150)
    lhs_scale = lhs_scale.at[7, 2].set(255)
    run = jax.jit(
        grouped_matmul_mxfp8,
        static_argnames=("out_dtype", "dequant_arithmetic", "dequant_layout", "lhs_in_registers"),
    )
    outs = {
        (arithmetic, layout): np.asarray(
            run(
                lhs,
                lhs_scale,
                rhs,
                rhs_scale,
                SIZES,
                out_dtype=jnp.float32,
                dequant_arithmetic=arithmetic,
                dequant_layout=layout,
            )
        )
        for arithmetic in ("float32", "bfloat16")
        for layout in ("wgmma", "wgmma_8bit")
    }
    for arithmetic in ("float32", "bfloat16"):
        outs[(arithmetic, "lhs in registers")] = np.asarray(
            run(
                lhs,
                lhs_scale,
                rhs,
                rhs_scale,
                SIZES,
                out_dtype=jnp.float32,
                dequant_arithmetic=arithmetic,
                lhs_in_registers=True,
            )
        )
    first = outs[("float32", "wgmma")]
    assert np.isnan(first[7]).all() and np.isfinite(np.delete(first, 7, axis=0)).all()
    for key, out in outs.items():
        np.testing.assert_array_equal(out.view(np.uint32), first.view(np.uint32), err_msg=str(key))


# bf16 tokens x MXFP8 weights dequantized in registers (stop 46, register-operand wgmma; the
# interpreter stages the weights through SMEM instead, so only the GPU runs this path).
# tile_k = 128 (stop 48): two K steps a stage, the second's parts converted under the first's
# wgmmas (two stages of 256 tokens fit with bf16 outputs, three of 128 with f32).
@pytest.mark.parametrize(
    "tile_m, out_dtype, wgmma_k, tile_k",
    [
        (256, BF16, 32, 64),
        (128, BF16, 32, 64),
        (128, F32, 32, 64),
        (256, BF16, 64, 64),
        (256, F32, 64, 64),
        (256, BF16, 64, 128),
        (128, F32, 64, 128),
    ],
)
def test_gpu_mxfp8_weights_in_registers(tile_m, out_dtype, wgmma_k, tile_k):
    from pallas_kernels.grouped_matmul_mx_weights import (
        DEFAULT_MXFP8_WEIGHTS_CONFIG,
        grouped_matmul_mxfp8_weights,
    )
    from tests.pallas_kernels.test_grouped_matmul_mx import dequant_mxfp8_bf16, random_mxfp8

    k_lhs, k_rhs = keys(2, seed=42)
    lhs = jax.random.normal(k_lhs, (ROWS, K_DIM), jnp.float32).astype(BF16)
    # Scale bytes from 0 (2^-127: subnormal weights) up, and a NaN-marking block.
    rhs, rhs_scale = random_mxfp8(k_rhs, (NUM_GROUPS, N_DIM, K_DIM), E4M3, 0, 140)
    rhs_scale = rhs_scale.at[4, 9, 3].set(255)
    # (float32 on 256-token tiles: two stages, the kernel's f32 default and the library's.)
    stages = 2 if out_dtype == F32 and tile_m == 256 else 4
    if tile_k == 128:
        stages = 2 if tile_m == 256 else 3
    config = dataclasses.replace(
        DEFAULT_MXFP8_WEIGHTS_CONFIG, tile_m=tile_m, max_concurrent_steps=stages, tile_k=tile_k
    )
    out = jax.jit(grouped_matmul_mxfp8_weights, static_argnames=("config", "out_dtype", "wgmma_k"))(
        lhs, rhs, rhs_scale, SIZES, config=config, out_dtype=out_dtype, wgmma_k=wgmma_k
    )
    out = np.asarray(out.astype(F32))
    want = ref_ragged_rows(f64(lhs), dequant_mxfp8_bf16(rhs, rhs_scale), SIZES)
    group4 = slice(301, 851)  # rows of group 4 (sizes 0, 300, 1, 0, 550)
    assert np.isnan(out[group4, 9]).all()
    finite = np.ones(out.shape, bool)
    finite[group4, 9] = False
    assert not np.isnan(out[finite]).any()
    rel = 2**-8 if out_dtype == BF16 else 1e-5
    assert_close(np.where(finite, out, 0), np.where(finite, want, 0), rel=rel)
    assert np.all(out[851:] == 0)
    # The dequantize-then-GEMM path, the library's today: the same k16 products summed in the
    # same order, so the same bits are expected.
    dequantized = jnp.asarray(dequant_mxfp8_bf16(rhs, rhs_scale), F32).astype(BF16)
    path = jax.jit(grouped_matmul, static_argnames=("out_dtype",))(
        lhs, dequantized, SIZES, out_dtype=out_dtype
    )
    path = np.asarray(path.astype(F32))
    assert np.isnan(path[group4, 9]).all()
    np.testing.assert_array_equal(out[finite].view(np.uint32), path[finite].view(np.uint32))


# bf16 tokens x NVFP4 weights dequantized in registers (stop 47, register-operand wgmma, the
# contraction in the even/odd order; the interpreter stages the weights through SMEM instead).
@pytest.mark.parametrize("tile_m, out_dtype", [(256, BF16), (128, F32)])
def test_gpu_nvfp4_weights_in_registers(tile_m, out_dtype):
    from pallas_kernels.dequantize import dequantize_nvfp4
    from pallas_kernels.grouped_matmul_mx_weights import (
        DEFAULT_MXFP8_WEIGHTS_CONFIG,
        even_odd_columns,
        grouped_matmul_nvfp4_weights,
    )
    from tests.pallas_kernels.test_grouped_matmul_mx_weights import dequant_nvfp4, nvfp4_weights

    k_lhs, k_rhs, k_exact = keys(3, seed=47)
    lhs = jax.random.normal(k_lhs, (ROWS, K_DIM), jnp.float32).astype(BF16)
    # Scales over E4M3's range, its subnormals included, and a NaN scale.
    scales = (2.0**-9, 2.0**-7 * 1.625, 0.0, 0.375, 1.0, 13.0, 448.0)
    rhs, rhs_scale = nvfp4_weights(k_rhs, NUM_GROUPS, N_DIM, K_DIM, scales)
    scale_bytes = jax.lax.bitcast_convert_type(rhs_scale, jnp.uint8).at[4, 9, 3].set(0x7F)
    config = dataclasses.replace(DEFAULT_MXFP8_WEIGHTS_CONFIG, tile_m=tile_m)
    run = jax.jit(
        grouped_matmul_nvfp4_weights,
        static_argnames=("config", "out_dtype", "lhs_order", "e2m1_decode"),
    )
    out = run(lhs, rhs, scale_bytes, SIZES, config=config, out_dtype=out_dtype)
    out = np.asarray(out.astype(F32))
    weights = dequant_nvfp4(rhs, jax.lax.bitcast_convert_type(scale_bytes, E4M3))
    want = ref_ragged_rows(f64(lhs), weights, SIZES)
    group4 = slice(301, 851)  # rows of group 4 (sizes 0, 300, 1, 0, 550)
    assert np.isnan(out[group4, 9]).all()
    finite = np.ones(out.shape, bool)
    finite[group4, 9] = False
    assert not np.isnan(out[finite]).any()
    rel = 2**-8 if out_dtype == BF16 else 1e-5
    assert_close(np.where(finite, out, 0), np.where(finite, want, 0), rel=rel)
    assert np.all(out[851:] == 0)
    # Tokens already in the even/odd order (what the dequantize kernel writes): the same call.
    reordered = run(
        even_odd_columns(lhs),
        rhs,
        scale_bytes,
        SIZES,
        config=config,
        out_dtype=out_dtype,
        lhs_order="even_odd",
    )
    reordered = np.asarray(reordered.astype(F32))
    np.testing.assert_array_equal(out[finite].view(np.uint32), reordered[finite].view(np.uint32))
    # The byte-permute decode (PTX prmt): the same A values, so the same bits.
    permuted = run(
        lhs, rhs, scale_bytes, SIZES, config=config, out_dtype=out_dtype, e2m1_decode="byte_permute"
    )
    permuted = np.asarray(permuted.astype(F32))
    assert np.isnan(permuted[group4, 9]).all()
    np.testing.assert_array_equal(out[finite].view(np.uint32), permuted[finite].view(np.uint32))
    # Two K steps a stage (stop 48): the same wgmmas in the same order, so the same bits.
    two_steps = dataclasses.replace(
        config, tile_k=128, max_concurrent_steps=2 if tile_m == 256 else 3
    )
    two = run(lhs, rhs, scale_bytes, SIZES, config=two_steps, out_dtype=out_dtype)
    two = np.asarray(two.astype(F32))
    assert np.isnan(two[group4, 9]).all()
    np.testing.assert_array_equal(out[finite].view(np.uint32), two[finite].view(np.uint32))
    # Exact sums (tokens -1, 0, 1, scales 0.5 .. 2: multiples of 1/4, |sum| ≤ 12 · 512 and
    # typically ~100): the reference's bits, whatever order the tensor cores add in.
    exact_lhs = jax.random.randint(k_exact, (ROWS, K_DIM), -1, 2).astype(BF16)
    exact_rhs, exact_scale = nvfp4_weights(k_rhs, NUM_GROUPS, N_DIM, K_DIM, (0.5, 1.0, 2.0))
    exact = run(exact_lhs, exact_rhs, exact_scale, SIZES, config=config, out_dtype=out_dtype)
    exact_want = ref_ragged_rows(f64(exact_lhs), dequant_nvfp4(exact_rhs, exact_scale), SIZES)
    np.testing.assert_array_equal(
        np.asarray(exact.astype(F32)), exact_want.astype(np.float32).astype(out_dtype).astype(F32)
    )
    # The dequantize-then-GEMM path (the library's default): the same values, the contraction
    # in another order, so f32 rounding apart.
    values = jax.vmap(lambda d, s: dequantize_nvfp4(d, s, None, out_dtype=BF16))(
        rhs, jax.lax.bitcast_convert_type(scale_bytes, E4M3)
    )
    path = jax.jit(grouped_matmul, static_argnames=("out_dtype",))(
        lhs, values, SIZES, out_dtype=out_dtype
    )
    path = np.asarray(path.astype(F32))
    assert_close(np.where(finite, out, 0), np.where(finite, path, 0), rel=rel)
