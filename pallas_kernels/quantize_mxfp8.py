"""MXFP8 quantize kernel (Mosaic GPU, Hopper): rowwise 1×32 and columnwise 32×1 blocks.

Reads a bf16 / f32 (M, K) array once and writes, in the same pass, any of
  rowwise:    codes (M, K) E4M3/E5M2, E8M0 scale bytes (M, K/32) uint8;
  columnwise: codes (K, M) (the rowwise quantization of xᵀ), scale bytes (K, M/32) uint8.
The E8M0 byte is TransformerEngine's round-up rule ("RCEIL", numerics.md §3), computed with
integer operations (Hopper cannot emit e8m0), exactly as jax_qtrain/formats/mxfp8.py does:

  v = fp32(amax / fp8_max); NaN → 0xFF; Inf → 0xFE; subnormal v → 0 or 1 (by amax thresholds)
  e = biased exponent of v, +1 if v has mantissa bits (not for e = 0xFE)
  q = sat_RNE(x · 2^(127 − e))   (2^-127 applied as 2^-63 · 2^-64; NaN block → NaN codes)

See quantize_common.py for the tile / register layout.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import quantize_common as qc

BLOCK = 32


@dataclasses.dataclass(frozen=True)
class MXFP8QuantizeConfig(qc.TileConfig):
    """Tuning knobs of the MXFP8 quantize kernel (see `qc.TileConfig`)."""

    def __post_init__(self):
        super().__post_init__()


class MXFP8Quantized(NamedTuple):
    """Outputs of `quantize_mxfp8`; a copy that was not requested is None."""

    rowwise_data: jax.Array | None
    rowwise_scale: jax.Array | None
    columnwise_data: jax.Array | None
    columnwise_scale: jax.Array | None


@functools.cache
def subnormal_amax_thresholds(fp8_max: float) -> tuple[int, int]:
    """amax bit patterns below which v = fp32(amax / fp8_max) is subnormal (`normal_from`) and
    above which a subnormal v exceeds 2^-127 and rounds up to byte 1 (`byte_one_from`).

    Bisection over the amax bits with numpy (which keeps subnormals): v is monotone in amax.
    Deciding the subnormal cases on amax bits gives TransformerEngine's byte even where
    XLA:CPU would flush v to zero.
    """
    divisor = np.float32(fp8_max)

    def first_bits_where(predicate) -> int:
        low, high = 0, qc.F32_INF_BITS
        while low < high:
            middle = (low + high) // 2
            with np.errstate(under="ignore"):
                v = np.uint32(middle).view(np.float32) / divisor
            if predicate(v):
                high = middle
            else:
                low = middle + 1
        return low

    normal_from = first_bits_where(lambda v: v >= np.float32(2.0**-126))
    byte_one_from = first_bits_where(lambda v: v > np.float32(2.0**-127))
    return normal_from, byte_one_from


def e8m0_scale_byte(amax_bits: jax.Array, fp8_max: float) -> jax.Array:
    """TransformerEngine's E8M0 byte (as uint32 0..255) from block amaxes given as uint32 bits."""
    normal_from, byte_one_from = subnormal_amax_thresholds(fp8_max)
    amax = qc.f32_from_bits(amax_bits)
    v_bits = lax.bitcast_convert_type(amax / jnp.float32(fp8_max), jnp.uint32)
    exponent = (v_bits >> 23) & jnp.uint32(0xFF)
    mantissa = v_bits & jnp.uint32(0x7FFFFF)
    keeps_exponent = (exponent == 0xFE) | ((exponent == 0) & (mantissa <= 0x400000))
    # Selects, not bool casts / logical_not: Mosaic cannot convert 1-element i1 vectors.
    round_up = jnp.where(mantissa > 0, jnp.uint32(1), jnp.uint32(0))
    byte = exponent + jnp.where(keeps_exponent, jnp.uint32(0), round_up)
    subnormal_byte = jnp.where(amax_bits >= jnp.uint32(byte_one_from), jnp.uint32(1), jnp.uint32(0))
    byte = jnp.where(amax_bits < jnp.uint32(normal_from), subnormal_byte, byte)
    byte = jnp.where(qc.is_inf_bits(amax_bits), jnp.uint32(0xFE), byte)
    return jnp.where(qc.is_nan_bits(amax_bits), jnp.uint32(0xFF), byte)


def multipliers(byte: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two float32 factors with x·f1·f2 = x·2^(127−byte) exactly (f2 = 1 except for byte 254,
    whose 2^-127 is split as 2^-63·2^-64 so no factor is subnormal), NaN for byte 255."""
    exponent = jnp.int32(127) - byte.astype(jnp.int32)
    clamped = jnp.clip(exponent, -126, 127)
    direct = lax.bitcast_convert_type((clamped + 127) << 23, jnp.float32)
    is_inf_block = exponent == -127
    is_nan_block = byte == 0xFF
    first = jnp.where(is_inf_block, jnp.float32(2.0**-63), direct)
    first = jnp.where(is_nan_block, jnp.float32(jnp.nan), first)
    second = jnp.where(is_inf_block, jnp.float32(2.0**-64), jnp.float32(1.0))
    return first, second


def quantize_lines(v: jax.Array, layout, fp8_dtype) -> tuple[jax.Array, jax.Array]:
    """MXFP8 of each row of a (R, 32) float32 array held row-per-thread in `layout`.

    Returns (codes (R, 32) fp8_dtype, scale bytes (R,) uint8)."""
    fp8_dtype = jnp.dtype(fp8_dtype)
    byte = e8m0_scale_byte(qc.row_amax_bits(v), qc.FP8_MAX[fp8_dtype])
    first, second = multipliers(byte)
    scaled = (v * qc.broadcast_rows(first, v.shape, layout)) * qc.broadcast_rows(
        second, v.shape, layout
    )
    codes = qc.saturating_fp8(scaled, fp8_dtype)
    # A NaN block's codes are all the canonical NaN byte (the interpreter's XLA cast would keep
    # a NaN's sign or give E5M2 0x7E); bitwise AND / OR are the 8-bit pointwise ops Mosaic has.
    nan_code = qc.CANONICAL_FP8_NAN
    is_nan_block = byte == 0xFF
    keep = jnp.where(is_nan_block, jnp.uint32(0), jnp.uint32(0xFF)).astype(jnp.uint8)
    fix = jnp.where(is_nan_block, jnp.uint32(nan_code), jnp.uint32(0)).astype(jnp.uint8)
    bits = lax.bitcast_convert_type(codes, jnp.uint8) & qc.broadcast_rows(keep, v.shape, layout)
    bits = bits | qc.broadcast_rows(fix, v.shape, layout)
    codes = lax.bitcast_convert_type(bits, fp8_dtype)
    return codes, byte.astype(jnp.uint8)


def _kernel(x_gmem, *refs, config, cols, fp8_dtype, rowwise, columnwise, in_dtype):
    data_outputs = qc.data_outputs(rowwise, columnwise)
    outs, scratch = qc.split_refs(refs, config, cols, data_outputs)
    data_gmems, scale_gmems = outs[0::2], outs[1::2]
    body = functools.partial(
        _tile,
        scale_gmems=scale_gmems,
        config=config,
        fp8_dtype=fp8_dtype,
        copies=[o.columnwise for o in data_outputs],
        in_dtype=in_dtype,
    )
    qc.for_each_tile(
        x_gmem, scratch, config, cols, body, list(zip(data_gmems, data_outputs, strict=True))
    )


def _tile(x_smem, m0, k0, dests, *, scale_gmems, config, fp8_dtype, copies, in_dtype):
    tm, tk = config.tile_m, config.tile_k
    for columnwise, dest, scale_gmem in zip(copies, dests, scale_gmems, strict=True):
        scale_bytes = []
        if not columnwise:
            for j in range(tk // BLOCK):
                v = qc.load_rows(x_smem.at[:, pl.ds(j * BLOCK, BLOCK)], in_dtype)
                codes, byte = quantize_lines(v, qc.rows_layout(in_dtype), fp8_dtype)
                qc.store_line_bytes(dest.cols(j * BLOCK, BLOCK), qc.as_bytes(codes))
                scale_bytes.append(qc.column(byte))
            scale_view = scale_gmem.at[pl.ds(m0, tm), pl.ds(k0 // BLOCK, tk // BLOCK)]
        else:
            for i in range(tm // BLOCK):
                v = qc.load_columns(x_smem.at[pl.ds(i * BLOCK, BLOCK), :])
                codes, byte = quantize_lines(v, qc.RPT1, fp8_dtype)
                qc.store_line_bytes(dest.cols(i * BLOCK, BLOCK), qc.as_bytes(codes))
                scale_bytes.append(qc.column(byte))
            scale_view = scale_gmem.at[pl.ds(k0, tk), pl.ds(m0 // BLOCK, tm // BLOCK)]
        qc.store_line_bytes(scale_view, qc.concat_columns(scale_bytes))


def quantize_mxfp8(
    x: jax.Array,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    fp8_dtype=jnp.float8_e4m3fn,
    config: MXFP8QuantizeConfig | None = None,
    interpret: bool = False,
) -> MXFP8Quantized:
    """MXFP8-quantize a 2-D bf16/f32 array: both copies in one pass over x.

    Shapes follow docs/design/layouts.md: rowwise codes (M, K32) and scales (M, K32/32), and
    columnwise codes (K, M32) and scales (K, M32/32), with K32 / M32 rounded up to 32 (zero
    padding). Inputs that are not whole 128×128 tiles are zero-padded first (one extra copy).
    """
    qc.check_input(x)
    qc.check_copies(rowwise, columnwise)
    fp8_dtype = qc.check_fp8_dtype(fp8_dtype)
    config = qc.resolve_config(config, MXFP8QuantizeConfig)
    rows, cols = x.shape
    padded_rows, padded_cols = config.padded_shape(rows, cols)
    xp = qc.pad_to(x, padded_rows, padded_cols)
    qc.check_smem(config, x.dtype, padded_cols, qc.data_outputs(rowwise, columnwise))
    out_types = []  # codes come out as bytes and are bitcast to fp8_dtype below
    if rowwise:
        out_types += [
            jax.ShapeDtypeStruct((padded_rows, padded_cols), jnp.uint8),
            jax.ShapeDtypeStruct((padded_rows, padded_cols // BLOCK), jnp.uint8),
        ]
    if columnwise:
        out_types += [
            jax.ShapeDtypeStruct((padded_cols, padded_rows), jnp.uint8),
            jax.ShapeDtypeStruct((padded_cols, padded_rows // BLOCK), jnp.uint8),
        ]
    outs = qc.run_tiles(
        _kernel,
        xp,
        out_types=out_types,
        config=config,
        outputs=qc.data_outputs(rowwise, columnwise),
        interpret=interpret,
        fp8_dtype=fp8_dtype,
        rowwise=rowwise,
        columnwise=columnwise,
    )
    rows32, cols32 = qc.round_up(rows, BLOCK), qc.round_up(cols, BLOCK)
    result = {}
    if rowwise:
        data, scale = outs[:2]
        outs = outs[2:]
        result["rowwise_data"] = qc.crop_codes(data, rows, cols32, fp8_dtype)
        result["rowwise_scale"] = qc.crop(scale, rows, cols32 // BLOCK)
    if columnwise:
        data, scale = outs[:2]
        result["columnwise_data"] = qc.crop_codes(data, cols, rows32, fp8_dtype)
        result["columnwise_scale"] = qc.crop(scale, cols, rows32 // BLOCK)
    return MXFP8Quantized(
        rowwise_data=result.get("rowwise_data"),
        rowwise_scale=result.get("rowwise_scale"),
        columnwise_data=result.get("columnwise_data"),
        columnwise_scale=result.get("columnwise_scale"),
    )
