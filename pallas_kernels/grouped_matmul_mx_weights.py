"""MXFP8 and NVFP4 weights dequantized in registers as the wgmma's A operand (issue 5).

On an H100 in stop 47: correct, but 0.64-0.79x of XLA's dense bf16 GEMM at G8, slower than
dequantizing to bf16 first (docs/benchmarks.md), so the library keeps that path. NVFP4
(`grouped_matmul_nvfp4_weights`, stop 47) contracts in an even/odd order of K, explained in its
docstring; the rest of this text is about MXFP8, and the kernel body
(`_weights_in_registers_gemm`) is the two formats' own.

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
stays in flight across steps (`wgmma_in_flight=0`). Twice measured on the H200: stop 19's
kernel and stop 48's try here (the next step converting into fresh values while the step's
last wgmma ran, the stages released a step later) gave wrong outputs, and the latter was no
faster (1-3%; with the decode ablated, 655 vs 654 TFLOP/s), so it is refused. Mosaic GPU's
interpreter has no register-operand wgmma: there the converted weights go through a bfloat16
SMEM tile and an SMEM-operand wgmma (the same values, so the CPU tests check the conversion,
the tiling and the transposed epilogue; the `gpu` tests the RS path).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import grouped_matmul_common as common
from pallas_kernels import grouped_matmul_driver as driver
from pallas_kernels import quantize_common
from pallas_kernels.dequantize import e2m1_half_bits
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

NVFP4_BLOCK = 16  # elements per E4M3 scale along K
_E4M3_ONE = 0x38  # E4M3 byte of 1.0: pads K
LHS_ORDERS = ("natural", "even_odd")

# 256 tokens x 64 weight rows per consumer: one m64n256 accumulator (128 registers a thread).
# Both formats' default.
DEFAULT_MXFP8_WEIGHTS_CONFIG = GroupedMatmulConfig(
    tile_m=256, tile_n=64, tile_k=STEP_K, max_concurrent_steps=4, epi_tile_n=64, epilogue_buffers=1
)
# Two K steps a stage (opt-in, stop 48): a 256 x 128 token stage is 64 KB, so two stages are
# what shared memory holds with bf16 outputs (`_check_smem` refuses three).
TWO_STEPS_WEIGHTS_CONFIG = dataclasses.replace(
    DEFAULT_MXFP8_WEIGHTS_CONFIG, tile_k=2 * STEP_K, max_concurrent_steps=2
)


def _stage_bytes(config: GroupedMatmulConfig, values_per_byte: int, block: int) -> int:
    """One pipeline stage: tile_m bf16 token rows by tile_k, and 2 x tile_n weight rows of
    codes (values_per_byte to a byte) with one scale byte per `block` values."""
    k = config.tile_k
    return config.tile_m * k * 2 + 2 * config.tile_n * (k // values_per_byte + k // block)


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
    wgmma_k: int = STEP_K,
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
        m64 wgmma per consumer), tile_k = 64 or 128 (one or two K steps a stage: see
        `_weights_in_registers_gemm`), no wgmma in flight, consumers splitting the weight
        rows, no clusters, no stream-K; None: `DEFAULT_MXFP8_WEIGHTS_CONFIG` (with two
        stages for float32 outputs, whose epilogue takes twice the bytes).
      wgmma_k: K per wgmma call: 32 (one MX block: its weights scaled by one scale each;
        the SMEM tiles 32 wide) or 64 (the whole step: the two blocks' scales side by side;
        64-wide tiles with the 16-bit kernel's 128-byte swizzle; the default). The
        same k16 instructions in the same order either way, so the same bits; 64 ran 6-8%
        faster at G8 balanced with bf16 outputs (H100, stop 47: 494 vs 463 TFLOP/s; H200,
        stop 48: 497 vs 466).
      interpret: run the Pallas interpreter (CPU) instead of compiling for the GPU.

    Returns:
      (M, N) array of out_dtype: ``lhs[rows of g] @ bf16(rhs[g] · 2^(rhs_scale[g] − 127))ᵀ``
      ((out_rows, N) for a packed output); rows past the groups are zero. A finite code in a
      block whose scale byte is 0xFF gives NaN, as the reference; an FP8 NaN or Inf code (which
      the quantizer writes only for NaN or Inf inputs) reads as a large finite value.
    """
    num_groups, num_cols, k = _check_operands(
        lhs,
        rhs,
        rhs_scale,
        common.FP8_DTYPES,
        (jnp.dtype(jnp.uint8),),
        values_per_byte=1,
        block=MX_BLOCK,
    )
    out_dtype = _check_out_dtype(out_dtype)
    config = _checked_config(
        config,
        out_dtype,
        group_sizes,
        num_groups,
        group_starts,
        out_rows,
        "grouped_matmul_mxfp8_weights",
    )
    if wgmma_k not in (MX_BLOCK, STEP_K) or isinstance(wgmma_k, bool):
        raise ValueError(f"wgmma_k must be {MX_BLOCK} or {STEP_K}, got {wgmma_k!r}")
    _check_smem(config, out_dtype, _stage_bytes(config, values_per_byte=1, block=MX_BLOCK))

    # Zero padding to whole TMA tiles: weight rows to whole CTA tiles, K to whole stages (zero
    # codes and tokens; identity scales, since a zero code times a NaN-marking 0xFF is NaN).
    cols_p = config.padded_cols(num_cols, out_dtype, 16)
    k_p = common.round_up(k, config.tile_k)
    rhs_p, rhs_scale_t = padded_rhs(rhs, rhs_scale, cols_p, k_p)

    def weight_parts(codes_smem, scales_smem, ctx):
        """This consumer's weights of the step as (bf16 values in the wgmma register layout,
        first token column) pairs, each converted when its wgmma is issued: one per MX block
        (wgmma_k = 32) or one for the whole step."""
        rows = ctx.col_slice
        if wgmma_k == MX_BLOCK:
            return [
                (
                    functools.partial(
                        dequantize_block,
                        codes_smem.at[rows, pl.ds(block * MX_BLOCK, MX_BLOCK)],
                        scales_smem.at[block, rows],
                        rhs.dtype,
                        "bfloat16",
                        "wgmma",
                    ),
                    block * MX_BLOCK,
                )
                for block in range(STEP_K // MX_BLOCK)
            ]
        # Both MX blocks at once: their scales side by side (whole 64 x 8 tiles of the WGMMA
        # layout, so the concatenation only places registers).
        layout = plgpu.Layout.WGMMA

        def both_blocks():
            codes = lax.bitcast_convert_type(
                plgpu.load(codes_smem.at[rows], layout=layout), rhs.dtype
            )
            scale = jnp.concatenate(
                [
                    _spread(
                        e8m0_to_bf16(_row_bytes(scales_smem, block, rows)),
                        (codes.shape[0], MX_BLOCK),
                    )
                    for block in range(STEP_K // MX_BLOCK)
                ],
                axis=1,
            )
            return fp8_codes_as_bf16(codes) * scale

        return [(both_blocks, 0)]

    return _weights_in_registers_gemm(
        lhs,
        rhs_p,
        rhs_scale_t,
        group_sizes,
        codes_width=STEP_K,
        codes_dtype=rhs.dtype,
        wgmma_k=wgmma_k,
        weight_parts=weight_parts,
        num_cols=num_cols,
        padded_cols=cols_p,
        padded_k=k_p,
        out_dtype=out_dtype,
        group_starts=group_starts,
        out_rows=out_rows,
        config=config,
        name="grouped_matmul_mxfp8_weights",
        interpret=interpret,
    )


def grouped_matmul_nvfp4_weights(
    lhs: jax.Array,
    rhs: jax.Array,
    rhs_scale: jax.Array,
    group_sizes: jax.Array,
    *,
    lhs_order: str = "natural",
    e2m1_decode: str = "byte_permute",
    out_dtype: jnp.dtype = jnp.bfloat16,
    group_starts: jax.Array | None = None,
    out_rows: int | None = None,
    config: GroupedMatmulConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Ragged-row GEMM of bf16 tokens and NVFP4 weights, the weights dequantized in registers.

    The weights' global (per-tensor) decode scale is not applied: the result is what the
    16-bit GEMM on exactly dequantized bfloat16 operands gives, for the caller to scale.

    Args:
      lhs: (M, K) bfloat16 tokens, rows sorted by group, in the order `lhs_order` says.
      rhs: (G, N, K/2) uint8, two E2M1 codes a byte (element 2i in the low nibble), K-major.
      rhs_scale: (G, N, K/16) float8_e4m3fn (or its uint8 bytes), one per 1x16 block of rhs
        (a 16x16 block's scale repeated on its 16 rows); K a multiple of 16.
      group_sizes: (G,) int32 rows per group (device values; rows past the sum are zero).
      lhs_order: "natural" (the wrapper reorders lhs's columns into "even_odd" with one XLA
        pass) or "even_odd": within each 64 columns, the 32 even-indexed ones, then the 32
        odd ones (`even_odd_columns`; what `dequantize_nvfp4(..., column_order="even_odd")`
        writes); K a multiple of 64 then.
      e2m1_decode: how the codes become bf16 in registers (the same values either way, bit
        for bit on the GPU): "byte_permute", bf16 bytes looked up by PTX `prmt` (the default:
        1.011 against 1.149 ms at G8 with bf16 outputs, 1.189 against 1.210 with f32, on an
        H100 in alternation, 2026-12-05), or "float32", the dequantize kernel's arithmetic
        (float16 bits, widened, times s · 2^14).
      out_dtype, group_starts, out_rows, config, interpret: as `grouped_matmul_mxfp8_weights`
        (the same default config).

    Returns:
      (M, N) array of out_dtype: ``lhs[rows of g] @ bf16(e2m1(rhs[g]) · rhs_scale[g])ᵀ`` ((out_rows,
      N) packed); rows past the groups are zero.

    Why the even/odd order (docs/kernels_grouped_matmul.md, stop 47). A wgmma A fragment
    holds each row's columns 2q, 2q + 1, 8 + 2q, 9 + 2q of a k16 slab (q = lane % 4); loaded
    in that layout, a thread's packed bytes are columns 2q, 2q + 1, ... of the *byte* array,
    and their low nibbles are then exactly the A fragment of the even-indexed values, their
    high nibbles that of the odd ones. So each step's 64 values are two k32 wgmmas, one on the
    low nibbles against the step's even token columns and one on the high nibbles against its
    odd columns: the same products, the contraction visited in another order (so the f32 sums
    may differ from the natural-order GEMM's in the last bits, not in value).
    """
    if lhs_order not in LHS_ORDERS:
        raise ValueError(f"lhs_order must be one of {LHS_ORDERS}, got {lhs_order!r}")
    if e2m1_decode not in E2M1_DECODES:
        raise ValueError(f"e2m1_decode must be one of {E2M1_DECODES}, got {e2m1_decode!r}")
    scale_dtypes = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.uint8))
    num_groups, num_cols, k = _check_operands(
        lhs,
        rhs,
        rhs_scale,
        (jnp.dtype(jnp.uint8),),
        scale_dtypes,
        values_per_byte=2,
        block=NVFP4_BLOCK,
    )
    if lhs_order == "even_odd" and k % STEP_K:
        raise ValueError(
            f"lhs: K={k} must be a multiple of {STEP_K} for lhs_order='even_odd' (its columns "
            "are reordered within each 64)"
        )
    out_dtype = _check_out_dtype(out_dtype)
    config = _checked_config(
        config,
        out_dtype,
        group_sizes,
        num_groups,
        group_starts,
        out_rows,
        "grouped_matmul_nvfp4_weights",
    )
    _check_smem(config, out_dtype, _stage_bytes(config, values_per_byte=2, block=NVFP4_BLOCK))

    cols_p = config.padded_cols(num_cols, out_dtype, 16)
    k_p = common.round_up(k, config.tile_k)
    interpreting = quantize_common.interpreting(interpret)
    if lhs_order == "natural":
        lhs = even_odd_columns(common.pad_axis(lhs, 1, k_p))
    rhs_p = common.pad_axis(common.pad_axis(rhs, 1, cols_p), 2, k_p // 2)
    # (G, k_p/16, cols_p): a step's four scale bytes per weight row are four TMA rows; 1.0
    # pads K (zero codes times any finite scale are zero).
    scale_bytes = lax.bitcast_convert_type(rhs_scale, jnp.uint8)
    rhs_scale_t = common.pad_axis(
        common.pad_axis(scale_bytes, 2, k_p // NVFP4_BLOCK, _E4M3_ONE), 1, cols_p
    ).transpose(0, 2, 1)

    def weight_parts(codes_smem, scales_smem, ctx):
        """This consumer's weights of the step: the low nibbles (even columns) and the high
        nibbles (odd columns) of its (64, 32) packed bytes, in bf16 in the wgmma register
        layout, each against its half of the token tile."""
        rows = ctx.col_slice
        layout = plgpu.Layout.WGMMA
        packed = plgpu.load(codes_smem.at[rows], layout=layout)
        # Byte c holds values 2c and 2c + 1, both in the 1x16 block c // 8: the scales of the
        # four blocks side by side, 8 columns each (whole 64 x 8 tiles of the WGMMA layout, so
        # the concatenation only places registers).
        scale_of = _e4m3_as_bf16 if e2m1_decode == "byte_permute" else _e4m3_times_2_to_14
        rows_count, block_bytes = packed.shape[0], NVFP4_BLOCK // 2
        scale = jnp.concatenate(
            [
                _spread(scale_of(_row_bytes(scales_smem, block, rows)), (rows_count, block_bytes))
                for block in range(STEP_K // NVFP4_BLOCK)
            ],
            axis=1,
        )
        if e2m1_decode == "byte_permute":

            def nibbles(nibble: int):
                # e2m1 and s exact in bf16, and so is their product.
                return _e2m1_as_bf16_by_permutes(packed, nibble, interpreting) * scale

        else:
            packed_words = packed.astype(jnp.uint32)

            def nibbles(nibble: int):
                # The dequantize kernel's arithmetic (exact): the code as float16 e2m1 · 2^-14,
                # widened to float32, times s · 2^14, rounded to bf16 (e2m1 · s is exact).
                codes = e2m1_half_bits(packed_words, nibble)
                halves = lax.bitcast_convert_type(codes, jnp.float16)
                return (halves.astype(jnp.float32) * scale).astype(jnp.bfloat16)

        return [(functools.partial(nibbles, nibble), nibble * (STEP_K // 2)) for nibble in (0, 1)]

    return _weights_in_registers_gemm(
        lhs,
        rhs_p,
        rhs_scale_t,
        group_sizes,
        codes_width=STEP_K // 2,
        codes_dtype=jnp.dtype(jnp.uint8),
        wgmma_k=STEP_K // 2,
        weight_parts=weight_parts,
        num_cols=num_cols,
        padded_cols=cols_p,
        padded_k=k_p,
        out_dtype=out_dtype,
        group_starts=group_starts,
        out_rows=out_rows,
        config=config,
        name="grouped_matmul_nvfp4_weights",
        interpret=interpret,
    )


def even_odd_columns(x: jax.Array) -> jax.Array:
    """x (..., K) with each 64 columns reordered: its 32 even-indexed columns, then its 32 odd
    ones (K a multiple of 64): the token order `grouped_matmul_nvfp4_weights` contracts in."""
    k = x.shape[-1]
    if k % STEP_K:
        raise ValueError(f"x: the last axis ({k}) must be a multiple of {STEP_K}")
    pairs = x.reshape(*x.shape[:-1], k // STEP_K, STEP_K // 2, 2)
    return jnp.swapaxes(pairs, -1, -2).reshape(x.shape)


def _e4m3_times_2_to_14(scale_bytes: jax.Array) -> jax.Array:
    """float32 s · 2^14 for E4M3 scale bytes s (exact; NaN bytes stay NaN): the factor that
    turns `e2m1_half_bits`' e2m1 · 2^-14 into e2m1 · s, as the dequantize kernel scales."""
    scale = lax.bitcast_convert_type(scale_bytes, jnp.float8_e4m3fn).astype(jnp.float32)
    return scale * jnp.float32(2.0**14)


def _e4m3_as_bf16(scale_bytes: jax.Array) -> jax.Array:
    """bfloat16 s for E4M3 scale bytes s (exact: 4 significant bits; NaN stays NaN)."""
    scale = lax.bitcast_convert_type(scale_bytes, jnp.float8_e4m3fn).astype(jnp.float32)
    return scale.astype(jnp.bfloat16)


def _row_bytes(scales_smem, block: int, rows) -> jax.Array:
    """One scale byte per weight row of this consumer, in the wgmma layout's row vector."""
    return plgpu.load(scales_smem.at[block, rows], layout=plgpu.Layout.WGMMA.reduce(1))


def _spread(row_values: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return lax.broadcast_in_dim(row_values, shape, (0,))


def _check_operands(lhs, rhs, rhs_scale, code_dtypes, scale_dtypes, *, values_per_byte, block):
    """(G, N, K) of bf16 tokens and (G, N, K / values_per_byte) weights with (G, N, K / block)
    scales, or a TypeError / ValueError naming the argument."""
    common.check_rank("lhs", lhs, 2)
    common.check_rank("rhs", rhs, 3)
    common.check_rank("rhs_scale", rhs_scale, 3)
    common.check_dtype("lhs", lhs, (jnp.dtype(jnp.bfloat16),))
    common.check_dtype("rhs", rhs, code_dtypes)
    common.check_dtype("rhs_scale", rhs_scale, scale_dtypes)
    k = lhs.shape[1]
    num_groups, num_cols, rhs_bytes = rhs.shape
    if rhs_bytes * values_per_byte != k:
        raise ValueError(
            f"rhs contraction size {rhs_bytes * values_per_byte} ({rhs_bytes} bytes of "
            f"{values_per_byte} values) does not match lhs K={k}"
            if values_per_byte > 1
            else f"rhs contraction size {rhs_bytes} does not match lhs K={k}"
        )
    if k % block:
        raise ValueError(f"lhs: K={k} must be a multiple of {block} (1x{block} blocks)")
    common.check_shape("rhs_scale", rhs_scale, (num_groups, num_cols, k // block))
    return num_groups, num_cols, k


def _check_out_dtype(out_dtype) -> jnp.dtype:
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in common.OUT_DTYPES:
        raise TypeError(f"out_dtype must be bfloat16 or float32, got {out_dtype.name}")
    return out_dtype


def _checked_config(config, out_dtype, group_sizes, num_groups, group_starts, out_rows, name):
    """The group sizes and packed-output arguments checked, and the config (the default for
    None: two stages for float32 outputs, whose epilogue chunks are twice the bytes)."""
    common.check_group_sizes(group_sizes, num_groups)
    check_packed_output(group_starts, out_rows, num_groups)
    if config is None:
        config = DEFAULT_MXFP8_WEIGHTS_CONFIG
        if out_dtype == jnp.float32:
            # (H100, 2026-12-05, in alternation: 256 tokens with 2 stages ran 1.28 / 1.21 ms
            # at G8 (MXFP8 / NVFP4) against 1.77 / 1.61 with 128 tokens and 4 stages: each
            # step converts the same weights for half the MMAs at 128 tokens.)
            config = dataclasses.replace(config, max_concurrent_steps=2)
    if not isinstance(config, GroupedMatmulConfig):
        raise TypeError(f"config must be a GroupedMatmulConfig, got {type(config).__name__}")
    _check_config(config, out_dtype, name)
    return config


def _weights_in_registers_gemm(
    lhs,
    rhs_p,
    rhs_scale_t,
    group_sizes,
    *,
    codes_width: int,
    codes_dtype,
    wgmma_k: int,
    weight_parts,
    num_cols: int,
    padded_cols: int,
    padded_k: int,
    out_dtype,
    group_starts,
    out_rows,
    config: GroupedMatmulConfig,
    name: str,
    interpret: bool,
) -> jax.Array:
    """The kernel both formats share: each pipeline stage brings tile_k / 64 K steps' tile_m
    x 64 bf16 tokens, 2 x tile_n weight rows of codes (codes_width bytes a row and step) and
    their scale bytes (rhs_scale_t (G, k_p / block, cols_p): one TMA row per block); for each
    step, each consumer turns its weight rows into register operands (`weight_parts(
    codes_smem, scales_smem, ctx)` on that step's codes and scale rows: a list of (thunk,
    first token column)) and runs one wgmma per part against wgmma_k token columns.

    tile_k = 128 (two steps a stage, stop 48) keeps the parts of both steps in one
    straight-line body, so the second step's first part converts while the first step's
    wgmmas run (as a step's second part already does), with one wait per stage: the
    overlap a wgmma in flight across stages would give, without one."""
    num_rows = lhs.shape[0]
    num_groups = rhs_p.shape[0]
    tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
    steps_per_stage = tile_k // STEP_K
    # Token rows padded to at least one tile and to multiples of 16; K to whole stages.
    rows_p = common.round_up(max(num_rows, tile_m), 16)
    lhs_p = common.pad_axis(common.pad_axis(lhs, 0, rows_p), 1, padded_k)
    scale_rows = rhs_scale_t.shape[1] // (padded_k // STEP_K)  # scale bytes a row and step

    # The tokens in wgmma_k-wide tiles (32: 64-byte swizzled rows, so that each part's columns
    # are whole tiles; 64: 128-byte rows, as the 16-bit kernel's tiles).
    in_specs = (
        plgpu.BlockSpec(
            (tile_m, tile_k),
            lambda kk: (0, kk),
            transforms=common.smem_transforms(wgmma_k, jnp.bfloat16),
        ),
        plgpu.BlockSpec(
            (2 * tile_n, codes_width * steps_per_stage),
            lambda kk: (0, kk),
            transforms=common.smem_transforms(min(wgmma_k, codes_width), codes_dtype),
        ),
        plgpu.BlockSpec((scale_rows * steps_per_stage, 2 * tile_n), lambda kk: (kk, 0)),
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

    def step(refs, ctx, smem_refs, acc_ref):
        lhs_smem, codes_smem, scales_smem = smem_refs
        for k_step in range(steps_per_stage):
            step_codes = codes_smem.at[:, pl.ds(k_step * codes_width, codes_width)]
            step_scales = scales_smem.at[pl.ds(k_step * scale_rows, scale_rows)]
            for convert, first_column in weight_parts(step_codes, step_scales, ctx):
                weights = convert()
                column = k_step * STEP_K + first_column
                tokens = lhs_smem.at[:, pl.ds(column, wgmma_k)].transpose((1, 0))
                if interpreting:
                    weights_tile = ctx.scratch[0].at[ctx.consumer]
                    weights_tile[...] = weights
                    plgpu.commit_smem()
                    plgpu.wgmma(acc_ref, weights_tile, tokens)
                else:
                    plgpu.wgmma(acc_ref, weights, tokens)
        # The A registers must not change under a wgmma still running: no wgmma stays in
        # flight into the next stage.
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
        num_k_steps=padded_k // tile_k,
        scratch=scratch,
        values_transposed=True,
    )
    return run_row_kernel(
        parts,
        group_sizes,
        [lhs_p, rhs_p, rhs_scale_t],
        config=config,
        name=name,
        num_groups=num_groups,
        num_rows=num_rows,
        num_cols=num_cols,
        padded_rows=rows_p,
        padded_cols=padded_cols,
        out_dtype=out_dtype,
        interpret=interpret,
        group_starts=group_starts,
        out_rows=out_rows,
    )


def _check_config(config: GroupedMatmulConfig, out_dtype: jnp.dtype, name: str) -> None:
    """What this kernel's steps and epilogue are written for; refused by name otherwise."""
    if config.tile_k not in (STEP_K, 2 * STEP_K):
        raise ValueError(
            f"config: {name} needs tile_k={STEP_K} or {2 * STEP_K} (one or two K steps a "
            f"stage), got tile_k={config.tile_k}"
        )
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
            "rewritten by the next step; wrong outputs on the H200 in stops 19 and 48): "
            "wgmma_in_flight must be 0"
        )
    if config.cluster_n > 1 or config.cluster_m > 1:
        raise ValueError(f"config: {name} runs without clusters")
    if config.stream_k:
        raise ValueError(f"config: {name} does not support stream_k")
    config.check_out_dtype(out_dtype)
    config.check_not_block_fp8_only()
    config.check_consumers_split_columns(name)
    if config.num_consumers != driver.NUM_CONSUMERS:
        raise ValueError(f"config: num_consumers must be {driver.NUM_CONSUMERS}")


def _check_smem(config: GroupedMatmulConfig, out_dtype: jnp.dtype, stage_bytes: int) -> None:
    total = (
        config.max_concurrent_steps * stage_bytes
        + driver.NUM_CONSUMERS
        * config.epilogue_buffers
        * config.tile_m
        * config.epi_tile_n
        * out_dtype.itemsize
    )
    if total > SMEM_BYTES:
        raise ValueError(
            f"config needs {total} bytes of shared memory ({config.max_concurrent_steps} "
            f"stages x {stage_bytes} and the epilogue), more than {SMEM_BYTES}; "
            "lower max_concurrent_steps, tile_m, epi_tile_n or epilogue_buffers"
        )


# ----------------------------------------------------------------------------------------------
# E2M1 decode by byte permutes (`e2m1_decode="byte_permute"`).
#
# A register of the packed bytes in the WGMMA layout holds two bytes, w = b0 | b1 << 8, and the
# bf16 pair it becomes holds their low nibbles (even columns) or their high nibbles (odd
# columns). PTX's `prmt.b32 d, a, b, c` writes byte i of d from byte c_i & 7 of {b, a} (a's
# bytes are 0..3), c_i the i-th nibble of c. With the eight magnitudes' bf16 bytes as {b, a}
# and each code's magnitude as a selector nibble, one permute writes both values' high bytes
# and one more their low bytes (entry 0, magnitude 0's bytes, is zero: the selector nibbles in
# between pick it); a third moves the two sign bits into place. About five instructions a
# value (masks, shifts, three permutes and two ors a register) against the float32 decode's
# nine; not yet measured.
E2M1_DECODES = ("float32", "byte_permute")
# bf16 bytes of E2M1's magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (0x0000, 0x3F00, 0x3F80, 0x3FC0,
# 0x4000, 0x4040, 0x4080, 0x40C0), entries 0..3 in the first word, 4..7 in the second.
_E2M1_BF16_HIGH_BYTES = (0x3F3F3F00, 0x40404040)
_E2M1_BF16_LOW_BYTES = (0xC0800000, 0xC0804000)
_SIGNS_TO_BITS_15_AND_31 = 0x1202  # byte 0 → byte 1, byte 1 → byte 3, zeros from byte 2


@dataclasses.dataclass(frozen=True)
class _WordOps:
    """The 32-bit integer operations of the byte-permute decode: on jnp arrays (the
    interpreter, the tests) or on MLIR values (the kernel)."""

    shift_left: Callable
    shift_right: Callable
    mask: Callable
    either: Callable  # bitwise or
    const: Callable
    permute: Callable  # PTX prmt.b32 (a, b, selectors)


def _e2m1_pair_bits(words, nibble: int, ops: _WordOps):
    """bf16 bits of E2M1 nibble `nibble` (0: bits 3..0, 1: bits 7..4) of b0 (low half) and of b1
    (high half) of words = b0 | b1 << 8."""
    if nibble not in (0, 1):
        raise ValueError(f"nibble must be 0 (bits 3..0) or 1 (bits 7..4), got {nibble!r}")
    if nibble == 0:  # magnitudes at bits 2..0 and 10..8, signs at 3 and 11
        shifted = ops.shift_left(words, 4)
        high_selectors, low_selectors = ops.mask(shifted, 0x7070), ops.mask(words, 0x0707)
        sign_bytes = ops.mask(shifted, 0x8080)
    else:  # magnitudes at bits 6..4 and 14..12, signs at 7 and 15
        high_selectors = ops.mask(words, 0x7070)
        low_selectors = ops.mask(ops.shift_right(words, 4), 0x0707)
        sign_bytes = ops.mask(words, 0x8080)
    high = ops.permute(*map(ops.const, _E2M1_BF16_HIGH_BYTES), high_selectors)
    low = ops.permute(*map(ops.const, _E2M1_BF16_LOW_BYTES), low_selectors)
    signs = ops.permute(sign_bytes, sign_bytes, ops.const(_SIGNS_TO_BITS_15_AND_31))
    return ops.either(ops.either(high, low), signs)


def byte_permute(a, b, selectors):
    """PTX `prmt.b32`'s default mode on uint32 jnp arrays: byte i of the result is byte
    (selector nibble i) & 7 of {b, a} (a's bytes 0..3), or that byte's sign bit replicated
    when the nibble's bit 3 is set. (The interpreter's and the tests' model of the
    instruction.)"""
    a, b, selectors = (jnp.asarray(v, jnp.uint32) for v in (a, b, selectors))
    result = jnp.zeros_like(selectors)
    for i in range(4):
        nibble = (selectors >> (4 * i)) & 0xF
        index = nibble & 7
        byte = (jnp.where(index < 4, a, b) >> (8 * (index & 3))) & 0xFF
        byte = jnp.where((nibble & 8) != 0, jnp.where((byte & 0x80) != 0, 0xFF, 0), byte)
        result = result | (byte.astype(jnp.uint32) << (8 * i))
    return result


_JNP_WORD_OPS = _WordOps(
    shift_left=lambda v, n: v << n,
    shift_right=lambda v, n: v >> n,
    mask=lambda v, m: v & m,
    either=lambda x, y: x | y,
    const=jnp.uint32,
    permute=byte_permute,
)


def e2m1_word_as_bf16_bits(words: jax.Array, nibble: int) -> jax.Array:
    """The byte-permute decode on uint32 words b0 | b1 << 8 (jnp: the interpreter's path and
    the tests'): the bf16 bits of E2M1 nibble `nibble` of b0 (low half) and of b1 (high)."""
    return _e2m1_pair_bits(jnp.asarray(words, jnp.uint32), nibble, _JNP_WORD_OPS)


def _e2m1_as_bf16_by_permutes(packed: jax.Array, nibble: int, interpreting: bool) -> jax.Array:
    """bf16 e2m1 values of nibble `nibble` of each byte of a (rows, cols) uint8 array held in
    the WGMMA layout (pairs of neighbouring bytes a register)."""
    if interpreting:  # the same integer steps on the array's column pairs
        rows, cols = packed.shape
        pairs = packed.reshape(rows, cols // 2, 2).astype(jnp.uint32)
        bits = e2m1_word_as_bf16_bits(pairs[..., 0] | (pairs[..., 1] << 8), nibble)
        halves = jnp.stack([bits & 0xFFFF, bits >> 16], axis=-1).astype(jnp.uint16)
        return lax.bitcast_convert_type(halves.reshape(rows, cols), jnp.bfloat16)
    layout = plgpu.Layout.WGMMA

    @plgpu.inline_mgpu(
        arg_types=(layout,),
        return_type=plgpu.ShapeDtypeStruct(packed.shape, jnp.bfloat16, layout=layout),
    )
    def decode(_, fragments):
        i16, i32 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32)
        pair_type = ir.VectorType.get((2,), ir.BF16Type.get())

        def const(value):
            return arith.constant(i32, value)

        ops = _WordOps(
            shift_left=lambda v, n: arith.shli(v, const(n)),
            shift_right=lambda v, n: arith.shrui(v, const(n)),
            mask=lambda v, m: arith.andi(v, const(m)),
            either=arith.ori,
            const=const,
            permute=lambda a, b, selectors: llvm.inline_asm(
                i32, [a, b, selectors], "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r"
            ),
        )
        registers = np.empty_like(fragments.registers)
        for index in np.ndindex(registers.shape):
            # (Vector element 0 is the low half: NVPTX is little-endian.)
            words = arith.extui(i32, llvm.bitcast(i16, fragments.registers[index]))
            registers[index] = llvm.bitcast(pair_type, _e2m1_pair_bits(words, nibble, ops))
        return mgpu.FragmentedArray(_registers=registers, _layout=fragments.layout, _is_signed=None)

    return decode(packed)
