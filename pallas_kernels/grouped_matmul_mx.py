"""MXFP8 ragged-row grouped GEMM with the operands dequantized tile by tile inside the kernel.

Hopper has no MX tensor cores, so each K step's FP8 codes arrive in shared memory by TMA
(with their E8M0 scale bytes), the consumers turn them into bfloat16 values in registers and
write those to bfloat16 shared-memory tiles, and a 16-bit wgmma multiplies the tiles:

    out[r, c] = Σ_k bf16(lhs[r, k] · 2^(lhs_scale[r, k/32] − 127))
                    · bf16(rhs[g, c, k] · 2^(rhs_scale[g, c, k/32] − 127))     (f32 accumulation)

for the group g of row r. The operands never exist as bfloat16 arrays in global memory: the
kernel reads one byte per element (plus one scale byte per 32) instead of the two that the
dequantize-then-GEMM path writes and reads back.

Exponent range. An E4M3 / E5M2 code has at most 4 significant bits and 2^k is a power of two,
so the product is exact in bfloat16 (8 significant bits) wherever it lies in bfloat16's normal
range, which is float32's (2^-126 … 3.4e38). Each value is computed exactly as the reference
dequantizes (``jax_qtrain`` MXFP8: float32 code · 2^(byte − 127), 2^-127 applied as 2^-63 · 2^-64
so that no factor is subnormal, byte 0xFF → NaN) and rounded to bfloat16 once, so the operands
are the reference's bit for bit: exact for every block whose scale is at least 2^-120 (block
amax ≳ 3e-34), rounded like the reference below that. A quantizer keeps code · 2^k ≤ the
block's amax, so copies of finite data never overflow; scales no quantizer would pick give
Inf, as in the reference.

Work split per K step (64 = two MX blocks): each consumer dequantizes the whole lhs tile
(tile_m x 64) and its own tile_n rhs rows into private bf16 tiles and runs its wgmma on them, so
the two consumers never wait for each other (sharing the lhs tile would halve its conversion
work but put a barrier between the consumers at every step). With ``wgmma_in_flight=1`` the
private tiles are double-buffered by step parity and a step's wgmma runs while the consumer
dequantizes the next step (buffer s % 2 is rewritten at step s, after the wait that ends step
s - 1 has retired the wgmma of step s - 2). With ``lhs_in_registers`` the lhs values go straight
into the wgmma's register operand instead of a bf16 tile.

Status (H200, 2026-11-30, docs/benchmarks.md): bit-identical to dequantize-then-GEMM, but at
most 234 TFLOP/s against that path's 560 (G = 8, 16384 x 4096 x 4096), so jax_qtrain does not
use it; the ablation there shows the SMEM loads of the codes and the bf16 tile writes dominate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import grouped_matmul_common as common
from pallas_kernels import grouped_matmul_driver as driver
from pallas_kernels.grouped_matmul_fwd import (
    SMEM_BYTES,
    GroupedMatmulConfig,
    fit_default_config,
    run_row_kernel,
)

MX_BLOCK = 32  # elements per E8M0 scale along K
STEP_K = 2 * MX_BLOCK  # K per pipeline step: two MX blocks per row
_SCALE_IDENTITY = 127  # E8M0 byte of 2^0: pads K without turning zero codes into NaN

DEFAULT_MXFP8_CONFIG = GroupedMatmulConfig(
    tile_m=128, tile_n=128, tile_k=STEP_K, max_concurrent_steps=3, epi_tile_n=64
)


def _stage_bytes(config: GroupedMatmulConfig) -> int:
    """One pipeline stage: the FP8 codes of both operands and their scale bytes."""
    rows = config.tile_m + 2 * config.tile_n
    return rows * STEP_K + rows * (STEP_K // MX_BLOCK)


def _num_buffers(config: GroupedMatmulConfig) -> int:
    """bf16 tiles per consumer and operand: two when a wgmma stays in flight."""
    return 1 + config.wgmma_in_flight


def _bf16_tile_bytes(config: GroupedMatmulConfig, lhs_in_registers: bool = False) -> int:
    """The dequantized bf16 tiles: each consumer's lhs tile (unless it stays in registers) and
    rhs rows."""
    rows_per_consumer = (0 if lhs_in_registers else config.tile_m) + config.tile_n
    return driver.NUM_CONSUMERS * _num_buffers(config) * rows_per_consumer * STEP_K * 2


def _smem_bytes(
    config: GroupedMatmulConfig, out_dtype: jnp.dtype, lhs_in_registers: bool = False
) -> int:
    epilogue = 2 * config.epilogue_buffers * config.tile_m * config.epi_tile_n
    epilogue *= jnp.dtype(out_dtype).itemsize
    tiles = _bf16_tile_bytes(config, lhs_in_registers)
    return config.max_concurrent_steps * _stage_bytes(config) + tiles + epilogue


def _e8m0_factors(scale_bytes: jax.Array):
    """(first, second, is_nan) with 2^(byte − 127) = first · second, both normal float32:
    2^-127 is applied as 2^-63 · 2^-64 (as the reference does), byte 0xFF marks a NaN block."""
    exponent = scale_bytes.astype(jnp.int32) - 127
    direct = lax.bitcast_convert_type((jnp.clip(exponent, -126, 127) + 127) << 23, jnp.float32)
    first = jnp.where(exponent == -127, jnp.float32(2.0**-63), direct)
    second = jnp.where(exponent == -127, jnp.float32(2.0**-64), jnp.float32(1.0))
    return first, second, exponent == 128


def e8m0_to_bf16(scale_bytes: jax.Array) -> jax.Array:
    """2^(byte − 127) as bfloat16, exactly: byte << 7 for bytes 1..254, the subnormal 2^-127
    (0x0040) for byte 0, and NaN for 0xFF (so that the whole block's products are NaN)."""
    byte = scale_bytes.astype(jnp.int32)
    bits = jnp.where(byte == 0, jnp.int32(0x0040), byte << 7)
    bits = jnp.where(byte == 255, jnp.int32(0x7FC0), bits)
    return lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


def padded_rhs(rhs: jax.Array, rhs_scale: jax.Array, cols_p: int, k_p: int):
    """MXFP8 rhs codes (G, N, K) zero-padded to (G, cols_p, k_p), and their E8M0 bytes padded
    with identity scales (a zero code times a NaN-marking 0xFF would be NaN) and transposed to
    (G, k_p/32, cols_p): a K step's two bytes per rhs row are two TMA rows."""
    rhs_p = common.pad_axis(common.pad_axis(rhs, 1, cols_p), 2, k_p)
    rhs_scale_t = common.pad_axis(
        common.pad_axis(rhs_scale, 2, k_p // MX_BLOCK, _SCALE_IDENTITY), 1, cols_p
    ).transpose(0, 2, 1)
    return rhs_p, rhs_scale_t


def fp8_codes_as_bf16(codes: jax.Array) -> jax.Array:
    """The exact bfloat16 values of finite FP8 codes (in registers, any layout; a NaN or Inf
    code reads as a large finite value).

    Hopper converts FP8 to float16 only (cvt.rn.f16x2.e4m3x2 / e5m2x2: exact, two at a time).
    Shifting a float16's exponent and mantissa right by 3 reads its bits as the bfloat16 of
    value · 2^-112 (zero and subnormals included: FP8 values have ≤ 3 mantissa bits); times
    2^112 is exact again."""
    half_bits = lax.bitcast_convert_type(codes.astype(jnp.float16), jnp.uint16)
    shifted = (half_bits & jnp.uint16(0x8000)) | ((half_bits & jnp.uint16(0x7FF8)) >> 3)
    return lax.bitcast_convert_type(shifted, jnp.bfloat16) * jnp.bfloat16(2.0**112)


DEQUANT_ARITHMETIC = ("float32", "bfloat16")
DEQUANT_LAYOUTS = {"wgmma": plgpu.Layout.WGMMA, "wgmma_8bit": plgpu.Layout.WGMMA_8BIT}


def dequantize_block(codes_ref, scale_ref, fp8_dtype, arithmetic: str, layout_name: str):
    """bf16 values of a (rows, 32) block of codes whose row scales are scale_ref (rows,).

    "float32": the reference's own arithmetic (float32 products, 2^-127 as 2^-63 · 2^-64, NaN
    by a select), rounded to bfloat16. "bfloat16": code (exact in bfloat16) times the scale as
    bfloat16, one packed bf16x2 multiply per pair. Both give the same bits: the exact product
    rounded once to bfloat16 (the float32 product is exact, 4 significant bits at ≥ 2^-136).
    """
    layout = DEQUANT_LAYOUTS[layout_name]
    codes = lax.bitcast_convert_type(plgpu.load(codes_ref, layout=layout), fp8_dtype)
    scale_bytes = plgpu.load(scale_ref, layout=layout.reduce(1))

    def spread(row_values):
        return lax.broadcast_in_dim(row_values, codes.shape, (0,))

    if arithmetic == "bfloat16":
        # Times the scale rounds once (the code is exact in bfloat16).
        return fp8_codes_as_bf16(codes) * spread(e8m0_to_bf16(scale_bytes))
    values = codes.astype(jnp.float32)
    first, second, is_nan = _e8m0_factors(scale_bytes)
    values = (values * spread(first)) * spread(second)
    values = jnp.where(spread(is_nan), jnp.float32(jnp.nan), values)
    return values.astype(jnp.bfloat16)


def grouped_matmul_mxfp8(
    lhs: jax.Array,
    lhs_scale: jax.Array,
    rhs: jax.Array,
    rhs_scale: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype: jnp.dtype = jnp.bfloat16,
    config: GroupedMatmulConfig | None = None,
    dequant_arithmetic: str = "float32",
    dequant_layout: str = "wgmma",
    lhs_in_registers: bool = False,
    interpret: bool = False,
) -> jax.Array:
    """MXFP8 ragged-row GEMM ``out[rows of g] = deq(lhs)[rows of g] @ deq(rhs[g])ᵀ``.

    Args:
      lhs: (M, K) float8_e4m3fn or float8_e5m2 codes, rows sorted by group; K a multiple of 32.
      lhs_scale: (M, K/32) uint8 E8M0 bytes, one per 1x32 block of lhs.
      rhs: (G, N, K) FP8 codes, K-major (the weight copy scaled along K).
      rhs_scale: (G, N, K/32) uint8 E8M0 bytes.
      group_sizes: (G,) int32 rows per group (device values; rows past the sum are zero).
      out_dtype: bfloat16 or float32 (the accumulator is always f32).
      config: tiling (tile_k must be 64); None picks a default that fits shared memory.
      dequant_arithmetic: "float32" (the reference's arithmetic) or "bfloat16" (one packed
        multiply per pair of values); the same bits (see `dequantize_block`).
      dequant_layout: register layout of the conversion: "wgmma" (pairs of codes per load) or
        "wgmma_8bit" (four codes per 32-bit load).
      lhs_in_registers: convert the lhs tile straight into the wgmma's register operand (no
        bf16 lhs tile in shared memory; always the "wgmma" layout; needs wgmma_in_flight=0).
        Hardware only: Mosaic GPU's interpreter has no register-operand wgmma.
      interpret: run the Pallas interpreter (CPU) instead of compiling for the GPU.

    Returns:
      (M, N) array of out_dtype.
    """
    out_dtype, num_rows, k, num_groups, num_cols = common.check_block_scaled_operands(
        lhs, lhs_scale, rhs, rhs_scale, jnp.uint8, out_dtype
    )
    if k % MX_BLOCK:
        raise ValueError(f"lhs: K={k} must be a multiple of {MX_BLOCK} (1x32 MX blocks)")
    common.check_group_sizes(group_sizes, num_groups)
    common.check_shape("lhs_scale", lhs_scale, (num_rows, k // MX_BLOCK))
    common.check_shape("rhs_scale", rhs_scale, (num_groups, num_cols, k // MX_BLOCK))
    if config is None:
        config = fit_default_config(
            DEFAULT_MXFP8_CONFIG,
            _stage_bytes(DEFAULT_MXFP8_CONFIG),
            out_dtype,
            _bf16_tile_bytes(DEFAULT_MXFP8_CONFIG, lhs_in_registers),
        )
    if not isinstance(config, GroupedMatmulConfig):
        raise TypeError(f"config must be a GroupedMatmulConfig, got {type(config).__name__}")
    if dequant_arithmetic not in DEQUANT_ARITHMETIC:
        raise ValueError(
            f"dequant_arithmetic must be one of {DEQUANT_ARITHMETIC}, got {dequant_arithmetic!r}"
        )
    if dequant_layout not in DEQUANT_LAYOUTS:
        raise ValueError(
            f"dequant_layout must be one of {tuple(DEQUANT_LAYOUTS)}, got {dequant_layout!r}"
        )
    if config.tile_k != STEP_K:
        raise ValueError(f"config: MXFP8 needs tile_k={STEP_K}, got tile_k={config.tile_k}")
    config.check_out_dtype(out_dtype)
    config.check_not_block_fp8_only()
    config.check_consumers_split_columns("grouped_matmul_mxfp8")
    if not isinstance(lhs_in_registers, bool):
        raise TypeError(f"lhs_in_registers must be a bool, got {lhs_in_registers!r}")
    if lhs_in_registers and config.wgmma_in_flight:
        # Measured on the H200 (2026-11-30): wrong outputs (max error ~1e27 relative) with a
        # register-operand wgmma kept in flight into the next step; cause not isolated.
        raise ValueError("config: lhs_in_registers=True needs wgmma_in_flight=0")
    total = _smem_bytes(config, out_dtype, lhs_in_registers)
    if total > SMEM_BYTES:
        tile_bytes = _bf16_tile_bytes(config, lhs_in_registers)
        raise ValueError(
            f"config needs {total} bytes of shared memory ({config.max_concurrent_steps} stages x "
            f"{_stage_bytes(config)}, {tile_bytes} of bf16 tiles and the epilogue), "
            f"more than {SMEM_BYTES}; lower max_concurrent_steps, tile sizes or epi_tile_n"
        )
    tile_m, tile_n = config.tile_m, config.tile_n

    # Zero padding to whole TMA tiles: rows and columns to multiples of 16 (the transposed
    # scale rows must span multiples of 16 bytes) and at least one tile, K to whole steps
    # (zero codes; identity scales, since a zero code times a NaN-marking 0xFF would be NaN).
    rows_p = common.round_up(max(num_rows, tile_m), 16)
    cols_p = config.padded_cols(num_cols, out_dtype, 16)
    k_p = common.round_up(k, STEP_K)
    blocks_p = k_p // MX_BLOCK

    lhs_p = common.pad_axis(common.pad_axis(lhs, 0, rows_p), 1, k_p)
    rhs_p, rhs_scale_t = padded_rhs(rhs, rhs_scale, cols_p, k_p)
    # Scales transposed to (K/32, rows): a step's two bytes per row become two TMA rows.
    lhs_scale_t = common.pad_axis(
        common.pad_axis(lhs_scale, 1, blocks_p, _SCALE_IDENTITY), 0, rows_p
    ).T

    codes_transforms = common.smem_transforms(MX_BLOCK, lhs.dtype)  # whole 32-wide blocks
    bf16_transforms = common.smem_transforms(MX_BLOCK, jnp.bfloat16)
    in_specs = (
        plgpu.BlockSpec((tile_m, STEP_K), lambda kk: (0, kk), transforms=codes_transforms),
        plgpu.BlockSpec((2 * tile_n, STEP_K), lambda kk: (0, kk), transforms=codes_transforms),
        plgpu.BlockSpec((STEP_K // MX_BLOCK, tile_m), lambda kk: (kk, 0)),
        plgpu.BlockSpec((STEP_K // MX_BLOCK, 2 * tile_n), lambda kk: (kk, 0)),
    )

    def pipeline_refs(refs, ctx: driver.TileContext):
        lhs_ref, rhs_ref, lhs_scale_ref, rhs_scale_ref = refs
        rows = pl.ds(ctx.row_tile.block_start, tile_m)
        cols = pl.ds(ctx.col_tile * (2 * tile_n), 2 * tile_n)
        group = ctx.row_tile.group
        return (
            lhs_ref.at[rows],
            rhs_ref.at[group].at[cols],
            lhs_scale_ref.at[:, rows],
            rhs_scale_ref.at[group].at[:, cols],
        )

    def allocation_refs(refs):
        return (refs[0], refs[1].at[0], refs[2], refs[3].at[0])

    dequant = (dequant_arithmetic, dequant_layout)
    num_buffers = _num_buffers(config)
    in_flight = config.wgmma_in_flight
    lhs_rows_in_smem = 8 if lhs_in_registers else tile_m  # (a token tile when unused)
    scratch = (
        plgpu.SMEM(
            (driver.NUM_CONSUMERS, num_buffers, lhs_rows_in_smem, STEP_K),
            jnp.bfloat16,
            transforms=bf16_transforms,
        ),
        plgpu.SMEM(
            (driver.NUM_CONSUMERS, num_buffers, tile_n, STEP_K),
            jnp.bfloat16,
            transforms=bf16_transforms,
        ),
    )

    def step(refs, ctx, smem_refs, acc_ref):
        lhs_codes, rhs_codes, lhs_scales, rhs_scales = smem_refs
        lhs_tiles, rhs_tiles = ctx.scratch
        slot = lax.rem(ctx.k_step, num_buffers) if num_buffers > 1 else 0
        lhs_tile = lhs_tiles.at[ctx.consumer, slot]
        rhs_tile = rhs_tiles.at[ctx.consumer, slot]
        my_rows = pl.ds(ctx.consumer * tile_n, tile_n)
        blocks = [pl.ds(block * MX_BLOCK, MX_BLOCK) for block in range(STEP_K // MX_BLOCK)]
        for block, cols in enumerate(blocks):
            if not lhs_in_registers:
                lhs_tile.at[:, cols][...] = dequantize_block(
                    lhs_codes.at[:, cols], lhs_scales.at[block], lhs.dtype, *dequant
                )
            rhs_tile.at[:, cols][...] = dequantize_block(
                rhs_codes.at[my_rows, cols], rhs_scales.at[block, my_rows], rhs.dtype, *dequant
            )
        plgpu.commit_smem()
        if lhs_in_registers:
            # One 32-wide MX block at a time: its values are the register A operand.
            for block, cols in enumerate(blocks):
                lhs_values = dequantize_block(
                    lhs_codes.at[:, cols],
                    lhs_scales.at[block],
                    lhs.dtype,
                    dequant_arithmetic,
                    "wgmma",
                )
                plgpu.wgmma(acc_ref, lhs_values, rhs_tile.at[:, cols].transpose((1, 0)))
        else:
            plgpu.wgmma(acc_ref, lhs_tile, rhs_tile.transpose((1, 0)))
        # The codes' pipeline stage is free once converted: only the bf16 tiles stay read.
        plgpu.wgmma_wait(in_flight)
        return acc_ref

    def run_tile(refs, ctx, run_pipeline):
        def with_acc(acc_ref):
            run_pipeline(acc_ref)
            plgpu.wgmma_wait(0)
            return acc_ref[...]

        return pl.run_scoped(with_acc, plgpu.ACC((tile_m, tile_n), jnp.float32))

    parts = driver.RowKernelParts(
        in_specs=in_specs,
        pipeline_refs=pipeline_refs,
        allocation_refs=allocation_refs,
        run_tile=run_tile,
        step=step,
        num_k_steps=k_p // STEP_K,
        scratch=scratch,
    )
    return run_row_kernel(
        parts,
        group_sizes,
        [lhs_p, rhs_p, lhs_scale_t, rhs_scale_t],
        config=config,
        name="grouped_matmul_mxfp8",
        num_groups=num_groups,
        num_rows=num_rows,
        num_cols=num_cols,
        padded_rows=rows_p,
        padded_cols=cols_p,
        out_dtype=out_dtype,
        interpret=interpret,
    )
