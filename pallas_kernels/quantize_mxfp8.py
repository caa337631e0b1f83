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
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import quantize_common as qc
from pallas_kernels import untile_scales

BLOCK = 32


@dataclasses.dataclass(frozen=True)
class MXFP8QuantizeConfig(qc.LineScaleConfig):
    """Tuning knobs of the MXFP8 quantize kernel (see `qc.TileConfig`). Every setting gives the
    same bits (tested in the interpreter and on the H200); the defaults are the fastest
    measured (docs/benchmarks.md, 2026-11-30: lean_arithmetic ~4% faster, split_copies ~7%
    slower with it off and no faster with it on; 2026-12-02: tile-major scales 9% faster).

    Attributes (besides `qc.LineScaleConfig`'s and `qc.TileConfig`'s):
      split_copies: when both copies are requested, a CTA of two warpgroups (256 threads):
        warpgroup 0 quantizes the rowwise copy and warpgroup 1 the columnwise copy of the same
        shared-memory tile, concurrently, each storing its own output. Halves the per-tile
        latency and doubles the warps that hide memory latency. One-tile CTAs only
        (steps_per_cta = 1); ignored when only one copy is requested.
      lean_arithmetic (default True): about half the ALU operations per element (counted in
        the lowered module: ~11 → ~5 for row+col bf16): the E8M0 byte from amax's exponent and
        mantissa instead of a float32 division; the rowwise amax of bf16 input on the bf16 bit
        patterns (16-bit integers, two per register); columnwise codes converted to FP8 two at
        a time. On the hardware (not in the interpreter) it also leaves saturation and NaN
        codes to cvt.rn.satfinite (no clip, no NaN-block fix-up) and scales with one multiply
        (2^-127 as a subnormal factor).
    """

    split_copies: bool = False
    lean_arithmetic: bool = True

    reads_columnwise_in_slabs = True  # `_tile`: the rowwise blocks, then 32-row slabs

    def __post_init__(self):
        super().__post_init__()
        for name in ("split_copies", "lean_arithmetic"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {value!r}")
        if self.split_copies and self.pipelined:
            raise ValueError(
                "split_copies needs one-tile CTAs (steps_per_cta=steps_per_cta_m=1), got "
                f"steps_per_cta={self.steps_per_cta}, steps_per_cta_m={self.steps_per_cta_m}"
            )
        for other in ("reuse_input_tile", "stage_columnwise_in_input"):
            if self.split_copies and getattr(self, other):
                raise ValueError(
                    f"split_copies and {other} cannot be combined: each warpgroup would "
                    "overwrite the tile the other is still reading"
                )


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


# Both FP8 maxima are 1.75 · 2^E (E4M3 448 = 1.75·2^8, E5M2 57344 = 1.75·2^15): the mantissa
# bits of 1.75, which `e8m0_scale_byte_without_division` relies on.
FP8_MAX_MANTISSA_BITS = 0x600000


def e8m0_scale_byte_without_division(amax_bits: jax.Array, fp8_max: float) -> jax.Array:
    """`e8m0_scale_byte` from amax's exponent and mantissa bits, without the division.

    For a normal v = fp32(amax / fp8_max) and any k, v > 2^k exactly when amax > fp8_max·2^k:
    a float above 1.75·2^e is at least 2^-23 / 1.75 = 2^-23.8 above it relatively, more than
    half an ulp of v (2^-24), so v never rounds back down to 2^k (nor up to it from below). So
    v's rounded-up exponent is E(amax) − E(fp8_max) + 127, plus one when amax's mantissa is
    above 1.75's. Subnormal v, Inf and NaN are decided on the amax bits, as there."""
    max_bits = int(np.float32(fp8_max).view(np.uint32))
    if max_bits & 0x7FFFFF != FP8_MAX_MANTISSA_BITS:
        raise ValueError(f"fp8_max must be 1.75 · 2^E, got {fp8_max}")
    normal_from, byte_one_from = subnormal_amax_thresholds(fp8_max)
    exponent = amax_bits >> 23  # the sign bit is clear
    round_up = jnp.where(
        (amax_bits & jnp.uint32(0x7FFFFF)) > jnp.uint32(FP8_MAX_MANTISSA_BITS),
        jnp.uint32(1),
        jnp.uint32(0),
    )
    # Wraps around for amax < normal_from only, which the select below replaces.
    byte = exponent + round_up - jnp.uint32((max_bits >> 23) - 127)
    subnormal_byte = jnp.where(amax_bits >= jnp.uint32(byte_one_from), jnp.uint32(1), jnp.uint32(0))
    byte = jnp.where(amax_bits < jnp.uint32(normal_from), subnormal_byte, byte)
    byte = jnp.where(qc.is_inf_bits(amax_bits), jnp.uint32(0xFE), byte)
    return jnp.where(qc.is_nan_bits(amax_bits), jnp.uint32(0xFF), byte)


def single_multiplier(byte: jax.Array) -> jax.Array:
    """2^(127−byte) as one float32 factor: 2^-127 (subnormal) for byte 254, NaN for 255.

    Hardware only: Hopper's mul.f32 keeps subnormal operands, and a finite x·2^-127 is either
    exact (normal result) or below every FP8 subnormal's rounding threshold, so its code is ±0
    whichever way it rounds. XLA:CPU (the interpreter) flushes the factor to zero."""
    exponent = jnp.int32(127) - byte.astype(jnp.int32)
    direct = lax.bitcast_convert_type((jnp.clip(exponent, -126, 127) + 127) << 23, jnp.float32)
    factor = jnp.where(exponent == -127, jnp.float32(2.0**-127), direct)
    return jnp.where(byte == 0xFF, jnp.float32(jnp.nan), factor)


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


def quantize_lines(
    v: jax.Array,
    layout,
    fp8_dtype,
    *,
    amax_bits: jax.Array | None = None,
    lean: bool = False,
    on_hardware: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """MXFP8 of each row of a (R, 32) float32 array held row-per-thread in `layout`.

    `amax_bits`: the rows' amaxes as uint32 bits, when the caller already has them. `lean` and
    `on_hardware`: see `MXFP8QuantizeConfig.lean_arithmetic` (the hardware shortcuts need
    both). Returns (codes (R, 32) fp8_dtype, scale bytes (R,) uint8)."""
    fp8_dtype = jnp.dtype(fp8_dtype)
    fp8_max = qc.FP8_MAX[fp8_dtype]
    if amax_bits is None:
        amax_bits = qc.row_amax_bits(v)
    if lean:
        byte = e8m0_scale_byte_without_division(amax_bits, fp8_max)
        # Pairs of elements per register vector: cvt.rn.satfinite converts two at a time (a
        # one-element vector wastes half of each conversion). A register regrouping only.
        if layout == qc.RPT1:
            layout = qc.row_per_thread(4)
            v = plgpu.layout_cast(v, layout)
    else:
        byte = e8m0_scale_byte(amax_bits, fp8_max)
    if lean and on_hardware:
        # cvt.rn.satfinite saturates (±Inf and overflow to ±max) and turns NaN into 0x7F, the
        # canonical NaN code: the clip and the NaN-block fix-up below are the interpreter's.
        scaled = v * qc.broadcast_rows(single_multiplier(byte), v.shape, layout)
        return scaled.astype(fp8_dtype), byte.astype(jnp.uint8)
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


def load_rows_and_amax_bits(ref, dtype) -> tuple[jax.Array, jax.Array]:
    """A (R, 32) slice loaded row-per-thread as float32, and its rows' amaxes as uint32 bits.

    For bf16 the amax is taken on the bf16 bit patterns as 16-bit integers (two per 32-bit
    register: one AND and one max per pair of elements instead of per element) and widened
    once per row; bf16 bits << 16 are the float32 bits, so the order and the NaN / Inf tests
    are the same."""
    raw = plgpu.load(ref, layout=qc.rows_layout(dtype))
    return raw.astype(jnp.float32), qc.line_amax_bits(qc.abs_patterns(raw))


def _kernel(
    x_gmem,
    *refs,
    config,
    cols,
    fp8_dtype,
    rowwise,
    columnwise,
    scales,
    in_dtype,
    split_copies,
    on_hardware,
):
    data_outputs = qc.data_outputs(rowwise, columnwise)
    refs, stages = qc.split_scale_stages(refs, scales)
    outs, scratch = qc.split_refs(refs, config, cols, data_outputs)
    data_gmems, scale_gmems = outs[0::2], outs[1::2]
    position = qc.cta_position(config, x_gmem.shape[0], cols)
    scale_dests = [
        qc.LineScaleDest.for_cta(*dest, position)
        for dest in zip(scales, scale_gmems, stages, strict=True)
    ]
    body = functools.partial(
        _tile,
        scale_dests=scale_dests,
        config=config,
        fp8_dtype=fp8_dtype,
        copies=[o.columnwise for o in data_outputs],
        in_dtype=in_dtype,
        on_hardware=on_hardware,
    )
    qc.for_each_tile(
        x_gmem,
        scratch,
        config,
        cols,
        body,
        list(zip(data_gmems, data_outputs, strict=True)),
        warpgroup_per_output=split_copies,
    )
    qc.write_staged_scales(scale_dests)


def _tile(x_smem, m0, k0, dests, *, scale_dests, config, fp8_dtype, copies, in_dtype, on_hardware):
    """Quantize the copies of one tile whose `dests` are given (None: another warpgroup's)."""
    tm, tk = config.tile_m, config.tile_k
    lean = config.lean_arithmetic
    quantize = functools.partial(quantize_lines, lean=lean, on_hardware=on_hardware)
    for columnwise, dest, scale_dest in zip(copies, dests, scale_dests, strict=True):
        if dest is None:
            continue
        scale_bytes = []
        if not columnwise:
            for j in range(tk // BLOCK):
                block_ref = x_smem.at[:, pl.ds(j * BLOCK, BLOCK)]
                if lean:
                    v, amax_bits = load_rows_and_amax_bits(block_ref, in_dtype)
                else:
                    v, amax_bits = qc.load_rows(block_ref, in_dtype), None
                codes, byte = quantize(v, qc.rows_layout(in_dtype), fp8_dtype, amax_bits=amax_bits)
                qc.store_line_bytes(dest.cols(j * BLOCK, BLOCK), qc.as_bytes(codes))
                scale_bytes.append(qc.column(byte))
            scales_at = (m0, tm, k0 // BLOCK)  # first line, lines, first block
        else:
            for i in range(tm // BLOCK):
                v = qc.load_columns(x_smem.at[pl.ds(i * BLOCK, BLOCK), :])
                codes, byte = quantize(v, qc.RPT1, fp8_dtype)
                qc.store_line_bytes(dest.cols(i * BLOCK, BLOCK), qc.as_bytes(codes))
                scale_bytes.append(qc.column(byte))
            scales_at = (k0, tk, m0 // BLOCK)
        scale_dest.store(*scales_at, qc.concat_columns(scale_bytes))


def quantize_mxfp8(
    x: jax.Array,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    fp8_dtype=jnp.float8_e4m3fn,
    config: MXFP8QuantizeConfig | None = None,
    interpret: bool = False,
    scale_layout: str = "lines",
) -> MXFP8Quantized:
    """MXFP8-quantize a 2-D bf16/f32 array: both copies in one pass over x.

    Shapes follow docs/design/layouts.md: rowwise codes (M, K32) and scales (M, K32/32), and
    columnwise codes (K, M32) and scales (K, M32/32), with K32 / M32 rounded up to 32 (zero
    padding). Inputs that are not whole 128×128 tiles are zero-padded first (one extra copy).
    `scale_layout="tiles"` (x of whole 128×128 tiles) returns each copy's scales as
    (blocks / 4, lines, 4), the kernel's tile-major output as written, instead of rearranging
    them into (lines, blocks) (`untile_scales.py`; docs/design/layouts.md).
    """
    qc.check_input(x)
    untile_scales.check_scale_layout(scale_layout, x.shape)
    qc.check_copies(rowwise, columnwise)
    fp8_dtype = qc.check_fp8_dtype(fp8_dtype)
    config = qc.resolve_config(config, MXFP8QuantizeConfig)
    rows, cols = x.shape
    padded_rows, padded_cols = config.padded_shape(rows, cols)
    xp = qc.pad_to(x, padded_rows, padded_cols)
    scales = [
        qc.line_scales(config, (padded_rows, padded_cols), c, BLOCK, jnp.uint8)
        for c, wanted in ((False, rowwise), (True, columnwise))
        if wanted
    ]
    qc.check_smem(
        config,
        x.dtype,
        padded_cols,
        qc.data_outputs(rowwise, columnwise),
        extra_bytes=sum(s.stage_bytes for s in scales),
    )
    out_types = []  # codes come out as bytes and are bitcast to fp8_dtype below
    for copy_scales in scales:
        lines, width = (padded_cols, padded_rows) if copy_scales.columnwise else xp.shape
        out_types += [jax.ShapeDtypeStruct((lines, width), jnp.uint8), copy_scales.out_type()]
    split_copies = config.split_copies and rowwise and columnwise
    outs = qc.run_tiles(
        _kernel,
        xp,
        out_types=out_types,
        config=config,
        outputs=qc.data_outputs(rowwise, columnwise),
        interpret=interpret,
        warpgroups=2 if split_copies else 1,
        fp8_dtype=fp8_dtype,
        rowwise=rowwise,
        columnwise=columnwise,
        split_copies=split_copies,
        scales=scales,
        extra_scratch=tuple(qc.scale_stages(scales)),
        on_hardware=not qc.interpreting(interpret),
    )
    rows32, cols32 = qc.round_up(rows, BLOCK), qc.round_up(cols, BLOCK)
    codes = iter(outs[0::2])
    if scale_layout == "tiles":
        scale_outs = iter(outs[1::2])
        finish = functools.partial(untile_scales.tiled_line_scales, block=BLOCK)
    else:
        scale_outs = iter(
            untile_scales.untile_line_scales_all(
                outs[1::2], kernel=config.untile_kernel, interpret=interpret
            )
        )
        finish = qc.crop
    result = {}
    if rowwise:
        result["rowwise_data"] = qc.crop_codes(next(codes), rows, cols32, fp8_dtype)
        result["rowwise_scale"] = finish(next(scale_outs), rows, cols32 // BLOCK)
    if columnwise:
        result["columnwise_data"] = qc.crop_codes(next(codes), cols, rows32, fp8_dtype)
        result["columnwise_scale"] = finish(next(scale_outs), cols, rows32 // BLOCK)
    return MXFP8Quantized(
        rowwise_data=result.get("rowwise_data"),
        rowwise_scale=result.get("rowwise_scale"),
        columnwise_data=result.get("columnwise_data"),
        columnwise_scale=result.get("columnwise_scale"),
    )
