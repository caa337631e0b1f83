"""MXFP8 weights dequantized in registers as the wgmma's A operand (issue 5; not yet timed).

``out[rows of g] = lhs[rows of g] @ deq(rhs[g])ᵀ`` for bfloat16 activations ``lhs`` and MXFP8
weights ``rhs`` (FP8 codes with one E8M0 byte per 1x32 block along K). The weights never
exist in bfloat16 in global memory: each consumer warpgroup loads its 64 weight rows of a K
step as FP8 codes from shared memory, scales them into bfloat16 registers, and hands those to
a register-operand (RS) wgmma whose shared-memory operand is the step's bfloat16 token tile:

    accᵀ (64 weight rows x tile_m tokens) += deq(W) (64 x 32) · lhsᵀ (32 x tile_m)

once per MX block (two per 64-wide K step). The accumulator is the consumer's part of the
output tile transposed, and the epilogue stores it through transposed SMEM views
(`RowKernelParts.values_transposed`).

Why this orientation (docs/kernels_grouped_matmul.md, stop 46). The library's MXFP8 / NVFP4
grouped GEMMs dequantize both operands to bfloat16 in global memory first (0.77x of XLA's dense
bf16 GEMM at G = 8, 16384 x 4096 x 4096, where the expert weights are 134 M elements against
67 M of tokens). Converting the weights in registers removes the larger of the two passes; the
consumer's conversion is 32 codes per thread and K step (16 two-byte loads, 16 packed
conversions, the scale multiplies), against stop 19's in-kernel design, whose consumers
converted a whole 128-row lhs tile and their rhs rows (96 codes per thread) and wrote them back
to bfloat16 SMEM tiles behind a fence every step. Shared-memory traffic per 64-wide K step of a
256 x (2 x 64) CTA tile: 8 KB of codes and 32 KB of tokens written by TMA, 8 KB of codes read by
the consumers, 2 x 32 KB of tokens read by the wgmmas: 112 KB per 1024 tensor-core cycles, less
than the 16-bit kernel's 128-144 KB.

The values are those of the dequantize-then-GEMM path bit for bit: each weight is
``bf16(code · 2^(byte − 127))`` exactly as `grouped_matmul_mx.dequantize_block` computes it
(packed bfloat16 arithmetic; byte 0xFF → NaN) and the products accumulate in f32.

A register-operand wgmma must not see its A registers change before it completes, so no wgmma
stays in flight across steps (`wgmma_in_flight=0`; stop 19 saw wrong outputs on the H200
otherwise). Mosaic GPU's interpreter has no register-operand wgmma: there the converted
weights go through a bfloat16 SMEM tile and an SMEM-operand wgmma (the same values, so the CPU
tests check the conversion, the tiling and the transposed epilogue; the `gpu` tests the RS
path).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import grouped_matmul_common as common
from pallas_kernels import grouped_matmul_driver as driver
from pallas_kernels import quantize_common
from pallas_kernels.grouped_matmul_fwd import (
    SMEM_BYTES,
    GroupedMatmulConfig,
    check_packed_output,
    run_row_kernel,
)
from pallas_kernels.grouped_matmul_mx import (
    MX_BLOCK,
    STEP_K,
    dequantize_block,
    e8m0_to_bf16,
    fp8_codes_as_bf16,
    padded_rhs,
)

# 256 tokens x 64 weight rows per consumer: one m64n256 accumulator (128 registers a thread).
DEFAULT_MXFP8_WEIGHTS_CONFIG = GroupedMatmulConfig(
    tile_m=256, tile_n=64, tile_k=STEP_K, max_concurrent_steps=4, epi_tile_n=64, epilogue_buffers=1
)


def _stage_bytes(config: GroupedMatmulConfig) -> int:
    """One pipeline stage: tile_m bf16 token rows, 2 x tile_n rows of weight codes and their
    scale bytes."""
    return config.tile_m * STEP_K * 2 + 2 * config.tile_n * (STEP_K + STEP_K // MX_BLOCK)


def grouped_matmul_mxfp8_weights(
    lhs: jax.Array,
    rhs: jax.Array,
    rhs_scale: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype: jnp.dtype = jnp.bfloat16,
    group_starts: jax.Array | None = None,
    out_rows: int | None = None,
    config: GroupedMatmulConfig | None = None,
    wgmma_k: int = MX_BLOCK,
    interpret: bool = False,
) -> jax.Array:
    """Ragged-row GEMM of bf16 tokens and MXFP8 weights, the weights dequantized in registers.

    Args:
      lhs: (M, K) bfloat16 tokens, rows sorted by group.
      rhs: (G, N, K) float8_e4m3fn or float8_e5m2 codes, K-major (the weight copy scaled
        along K).
      rhs_scale: (G, N, K/32) uint8 E8M0 bytes, one per 1x32 block of rhs; K a multiple of 32.
      group_sizes: (G,) int32 rows per group (device values; rows past the sum are zero).
      out_dtype: bfloat16 or float32 (the accumulator is always f32).
      group_starts, out_rows: a packed (out_rows, N) output, as `grouped_matmul`'s: group g
        reads lhs rows from ``group_starts[g]`` and writes its rows after the previous groups'.
      config: tiling: tile_m tokens by 2 x tile_n weight rows per CTA (tile_n = 64: one
        m64 wgmma per consumer), tile_k = 64, no wgmma in flight, consumers splitting the
        weight rows, no clusters, no stream-K; None: `DEFAULT_MXFP8_WEIGHTS_CONFIG` (with
        128-token tiles for float32 outputs).
      wgmma_k: K per wgmma call: 32 (one MX block: its weights scaled by one scale each;
        the SMEM tiles 32 wide) or 64 (the whole step: each column picks its block's scale,
        one select per value; 64-wide tiles with the 16-bit kernel's 128-byte swizzle). The
        same k16 instructions in the same order either way (stop 46: which is faster is for
        the H200 to say).
      interpret: run the Pallas interpreter (CPU) instead of compiling for the GPU.

    Returns:
      (M, N) array of out_dtype: ``lhs[rows of g] @ bf16(rhs[g] · 2^(rhs_scale[g] − 127))ᵀ``
      ((out_rows, N) for a packed output); rows past the groups are zero.
    """
    common.check_rank("lhs", lhs, 2)
    common.check_rank("rhs", rhs, 3)
    common.check_rank("rhs_scale", rhs_scale, 3)
    common.check_dtype("lhs", lhs, (jnp.dtype(jnp.bfloat16),))
    common.check_dtype("rhs", rhs, common.FP8_DTYPES)
    common.check_dtype("rhs_scale", rhs_scale, (jnp.dtype(jnp.uint8),))
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in common.OUT_DTYPES:
        raise TypeError(f"out_dtype must be bfloat16 or float32, got {out_dtype.name}")
    num_rows, k = lhs.shape
    num_groups, num_cols, k_rhs = rhs.shape
    if k_rhs != k:
        raise ValueError(f"rhs contraction size {k_rhs} does not match lhs K={k}")
    if k % MX_BLOCK:
        raise ValueError(f"lhs: K={k} must be a multiple of {MX_BLOCK} (1x32 MX blocks)")
    common.check_group_sizes(group_sizes, num_groups)
    common.check_shape("rhs_scale", rhs_scale, (num_groups, num_cols, k // MX_BLOCK))
    check_packed_output(group_starts, out_rows, num_groups)
    if config is None:
        config = DEFAULT_MXFP8_WEIGHTS_CONFIG
        if out_dtype == jnp.float32:
            # f32 epilogue chunks are twice the bytes: 128-token tiles keep four stages.
            config = dataclasses.replace(config, tile_m=128)
    if not isinstance(config, GroupedMatmulConfig):
        raise TypeError(f"config must be a GroupedMatmulConfig, got {type(config).__name__}")
    _check_config(config, out_dtype)
    if wgmma_k not in (MX_BLOCK, STEP_K) or isinstance(wgmma_k, bool):
        raise ValueError(f"wgmma_k must be {MX_BLOCK} or {STEP_K}, got {wgmma_k!r}")
    tile_m, tile_n = config.tile_m, config.tile_n

    # Zero padding to whole TMA tiles: token rows to at least one tile and multiples of 16,
    # weight rows to whole CTA tiles, K to whole steps (zero codes and tokens; identity scales,
    # since a zero code times a NaN-marking 0xFF would be NaN).
    rows_p = common.round_up(max(num_rows, tile_m), 16)
    cols_p = config.padded_cols(num_cols, out_dtype, 16)
    k_p = common.round_up(k, STEP_K)
    lhs_p = common.pad_axis(common.pad_axis(lhs, 0, rows_p), 1, k_p)
    rhs_p, rhs_scale_t = padded_rhs(rhs, rhs_scale, cols_p, k_p)

    # wgmma_k = 32: 32-wide tiles, so that each MX block's columns are a whole tile of both
    # operands (the tokens in 64-byte swizzled rows); 64: the step's whole width (128-byte
    # rows, as the 16-bit kernel's tiles).
    in_specs = (
        plgpu.BlockSpec(
            (tile_m, STEP_K),
            lambda kk: (0, kk),
            transforms=common.smem_transforms(wgmma_k, jnp.bfloat16),
        ),
        plgpu.BlockSpec(
            (2 * tile_n, STEP_K),
            lambda kk: (0, kk),
            transforms=common.smem_transforms(wgmma_k, rhs.dtype),
        ),
        plgpu.BlockSpec((STEP_K // MX_BLOCK, 2 * tile_n), lambda kk: (kk, 0)),
    )

    def pipeline_refs(refs, ctx: driver.TileContext):
        lhs_ref, rhs_ref, rhs_scale_ref = refs
        rows = pl.ds(ctx.row_tile.block_start, tile_m)
        cols = pl.ds(ctx.col_tile * (2 * tile_n), 2 * tile_n)
        group = ctx.row_tile.group
        return (lhs_ref.at[rows], rhs_ref.at[group].at[cols], rhs_scale_ref.at[group].at[:, cols])

    def allocation_refs(refs):
        return (refs[0], refs[1].at[0], refs[2].at[0])

    interpreting = quantize_common.interpreting(interpret)
    scratch = ()
    if interpreting:  # (SMEM is not budgeted for it: the interpreter has no limit)
        scratch = (
            plgpu.SMEM(
                (driver.NUM_CONSUMERS, tile_n, wgmma_k),
                jnp.bfloat16,
                transforms=common.smem_transforms(wgmma_k, jnp.bfloat16),
            ),
        )

    def weights_of(codes_smem, scales_smem, ctx, first_block: int):
        """This consumer's weight rows of the step's columns [32 first_block, + wgmma_k), in
        bf16 (the wgmma register layout)."""
        rows = ctx.col_slice
        if wgmma_k == MX_BLOCK:
            cols = pl.ds(first_block * MX_BLOCK, MX_BLOCK)
            return dequantize_block(
                codes_smem.at[rows, cols],
                scales_smem.at[first_block, rows],
                rhs.dtype,
                "bfloat16",
                "wgmma",
            )
        # Both MX blocks at once: each column picks its block's scale.
        layout = plgpu.Layout.WGMMA
        codes = lax.bitcast_convert_type(plgpu.load(codes_smem.at[rows], layout=layout), rhs.dtype)
        block_scales = [
            lax.broadcast_in_dim(
                e8m0_to_bf16(plgpu.load(scales_smem.at[block, rows], layout=layout.reduce(1))),
                codes.shape,
                (0,),
            )
            for block in range(STEP_K // MX_BLOCK)
        ]
        column = lax.broadcasted_iota(jnp.int32, codes.shape, 1)
        scale = jnp.where(column < MX_BLOCK, block_scales[0], block_scales[1])
        return fp8_codes_as_bf16(codes) * scale

    def step(refs, ctx, smem_refs, acc_ref):
        lhs_smem, codes_smem, scales_smem = smem_refs
        for wgmma_index in range(STEP_K // wgmma_k):
            cols = pl.ds(wgmma_index * wgmma_k, wgmma_k)
            weights = weights_of(codes_smem, scales_smem, ctx, wgmma_index)
            tokens = lhs_smem.at[:, cols].transpose((1, 0))
            if interpreting:
                weights_tile = ctx.scratch[0].at[ctx.consumer]
                weights_tile[...] = weights
                plgpu.commit_smem()
                plgpu.wgmma(acc_ref, weights_tile, tokens)
            else:
                plgpu.wgmma(acc_ref, weights, tokens)
        # The A registers must not change under a wgmma still running: no wgmma in flight.
        plgpu.wgmma_wait(0)
        return acc_ref

    def run_tile(refs, ctx, run_pipeline):
        def with_acc(acc_ref):
            run_pipeline(acc_ref)
            return acc_ref[...]

        return pl.run_scoped(with_acc, plgpu.ACC((tile_n, tile_m), jnp.float32))

    parts = driver.RowKernelParts(
        in_specs=in_specs,
        pipeline_refs=pipeline_refs,
        allocation_refs=allocation_refs,
        run_tile=run_tile,
        step=step,
        num_k_steps=k_p // STEP_K,
        scratch=scratch,
        values_transposed=True,
    )
    return run_row_kernel(
        parts,
        group_sizes,
        [lhs_p, rhs_p, rhs_scale_t],
        config=config,
        name="grouped_matmul_mxfp8_weights",
        num_groups=num_groups,
        num_rows=num_rows,
        num_cols=num_cols,
        padded_rows=rows_p,
        padded_cols=cols_p,
        out_dtype=out_dtype,
        interpret=interpret,
        group_starts=group_starts,
        out_rows=out_rows,
    )


def _check_config(config: GroupedMatmulConfig, out_dtype: jnp.dtype) -> None:
    """What this kernel's steps and epilogue are written for; refused by name otherwise."""
    if config.tile_k != STEP_K:
        raise ValueError(f"config: MXFP8 needs tile_k={STEP_K}, got tile_k={config.tile_k}")
    if config.tile_n != 64:
        raise ValueError(
            f"config: tile_n must be 64 (one m64 wgmma of weight rows per consumer), "
            f"got {config.tile_n}"
        )
    if config.epi_tile_n % 64:
        # The transposed part's epilogue chunks are row slices of a wgmma accumulator, whose
        # layout comes in 64-row tiles.
        raise ValueError(f"config: epi_tile_n must be a multiple of 64, got {config.epi_tile_n}")
    if config.wgmma_in_flight:
        raise ValueError(
            "config: a register-operand wgmma cannot stay in flight (its A registers are "
            "rewritten by the next step): wgmma_in_flight must be 0"
        )
    if config.cluster_n > 1 or config.cluster_m > 1:
        raise ValueError("config: grouped_matmul_mxfp8_weights runs without clusters")
    if config.stream_k:
        raise ValueError("config: grouped_matmul_mxfp8_weights does not support stream_k")
    config.check_out_dtype(out_dtype)
    config.check_not_block_fp8_only()
    config.check_consumers_split_columns("grouped_matmul_mxfp8_weights")
    if config.num_consumers != driver.NUM_CONSUMERS:
        raise ValueError(f"config: num_consumers must be {driver.NUM_CONSUMERS}")
    total = (
        config.max_concurrent_steps * _stage_bytes(config)
        + driver.NUM_CONSUMERS
        * config.epilogue_buffers
        * config.tile_m
        * config.epi_tile_n
        * out_dtype.itemsize
    )
    if total > SMEM_BYTES:
        raise ValueError(
            f"config needs {total} bytes of shared memory ({config.max_concurrent_steps} "
            f"stages x {_stage_bytes(config)} and the epilogue), more than {SMEM_BYTES}; "
            "lower max_concurrent_steps, tile_m, epi_tile_n or epilogue_buffers"
        )
