"""FP8 block-scaling quantize kernel (Mosaic GPU, Hopper): 1×128 and 128×128 blocks.

DeepSeek-V3 / TransformerEngine `Float8BlockScaling` (numerics.md §2). Reads a bf16 / f32 (M, K)
array once and writes, in the same pass,
  rowwise:    codes (M, K) E4M3/E5M2 and float32 scale_inv (M, K/128) [1×128] or
              (M/128, K/128) [128×128];
  columnwise: codes (K, M) and scale_inv (K, M/128) [the 1×128 rowwise quantization of xᵀ, i.e.
              128×1 blocks of x] or (K/128, M/128) [128×128: the transpose, same scales].
Per block, TransformerEngine's `compute_scale_from_amax` as in jax_qtrain/formats/fp8_tensor.py:
  amax = max(amax, eps); scale = fp8_max / amax; Inf → the input dtype's max;
  amax 0 / Inf / NaN → 1; power-of-2: bits &= 0xFF800000; q = sat_RNE(x · scale);
  scale_inv = 1 / scale (exact from bits for powers of two: 2^127 → 2^-127).
A NaN element gets the canonical NaN code 0x7F whatever its sign, like the reference's
`saturating_cast`; that fix-up only runs in tiles that contain a NaN.
`FP8BlockQuantizeConfig.lean_arithmetic` (the default since 2026-11-30) does the same with fewer
operations (see there); `lean_arithmetic=False` keeps the first kernel's exact arithmetic.
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
from pallas_kernels.float32_division import divide

BLOCK = 128
CHUNK = 32  # columns (rows, for the columnwise copy) per shared-memory read
BLOCK_SHAPES = ((1, 128), (128, 128))


@dataclasses.dataclass(frozen=True)
class FP8BlockQuantizeConfig(qc.LineScaleConfig):
    """Tuning knobs of the FP8 block kernel (see `qc.TileConfig`; `tile_major_scales` and
    `stage_scales` of `qc.LineScaleConfig` apply to 1×128 blocks: a 128×128 tile has one
    scale).

    Attributes (besides `qc.LineScaleConfig`'s and `qc.TileConfig`'s):
      lean_arithmetic (default True; measured on the H200 2026-11-30, bit-identical to the
        exact arithmetic and 1.25x / 1.10x faster for 1x128 / 128x128 row+col bf16,
        docs/benchmarks.md): the same bits with fewer operations per element (counted in
        the lowered module; docs/kernels_quantize.md):
        power-of-2 scales from amax's exponent and mantissa bits without the float32 division
        (`pow2_scale_bits_without_division`; non-power-of-2 scales keep the exact division);
        amaxes of bf16 input on the bf16 bit patterns (16-bit integers, two per register), and
        no float conversion in the amax pass; columnwise codes converted to FP8 two at a time;
        for bf16 input, the 1×128 columnwise copy reads shared memory once, keeping a line's
        128 values in registers as packed bf16 pairs (64 registers) between the amax and the
        quantization (float32 input keeps the two reads: 128 registers would spill). On the
        hardware (not in the interpreter) it also leaves saturation and NaN codes to
        cvt.rn.satfinite (no clip, no NaN fix-up, no per-tile NaN branch).
    """

    lean_arithmetic: bool = True

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.lean_arithmetic, bool):
            raise TypeError(f"lean_arithmetic must be a bool, got {self.lean_arithmetic!r}")
        if self.reuse_input_tile and not self.lean_arithmetic:
            # The exact path stores its codes under a per-tile NaN branch (`pl.when`), and
            # held stores cannot leave a branch.
            raise ValueError("reuse_input_tile needs lean_arithmetic=True")


class FP8BlockQuantized(NamedTuple):
    """Outputs of `quantize_fp8_block`; a copy that was not requested is None."""

    rowwise_data: jax.Array | None
    rowwise_scale_inv: jax.Array | None
    columnwise_data: jax.Array | None
    columnwise_scale_inv: jax.Array | None


def input_dtype_max(dtype) -> float:
    """The scale that replaces an overflowing one: the input dtype's largest finite value."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bfloat16:
        return qc.BF16_MAX
    if dtype == jnp.float16:
        return 65504.0
    return qc.FLT_MAX


# Both FP8 maxima are 1.75 · 2^E (E4M3 448 = 1.75·2^8, E5M2 57344 = 1.75·2^15).
FP8_MAX_MANTISSA_BITS = 0x600000


def pow2_scale_bits_without_division(amax_bits, *, fp8_max, overflow_scale):
    """TE's power-of-2 scale, bits(fp8_max / amax) & 0xFF800000 with the rule's special cases,
    as uint32 bits, from amax's exponent and mantissa without the division.

    amax = m·2^e (m in [1, 2)) and fp8_max = 1.75·2^E give the exact quotient (1.75/m)·2^(E−e):
    in [1, 1.75]·2^(E−e) when m <= 1.75, else in (0.875, 1)·2^(E−e). Rounding to float32 never
    crosses a power of two: 1.75/m is at most 1.75 (far below 2 − 2^-24), and for m > 1.75 it
    is at most 1 − 2^-23/1.75 = 1 − 2^-23.8, below 1 − 2^-25 (half an ulp under 1). So the
    quotient's biased exponent is E + 254 − e_biased − [m > 1.75], and it overflowed to Inf
    exactly when that is >= 255 (subnormal amaxes included: their exponent field is 0). An
    overflow gives the rounded-down `overflow_scale`; amax 0, Inf, NaN give 1. Checked against
    the division for every non-negative float32 amax (E4M3 and E5M2, bf16 / fp32 / fp16
    overflow scales), see tests/pallas_kernels/test_quantize.py."""
    max_bits = int(np.float32(fp8_max).view(np.uint32))
    if max_bits & 0x7FFFFF != FP8_MAX_MANTISSA_BITS:
        raise ValueError(f"fp8_max must be 1.75 · 2^E, got {fp8_max}")
    overflow_bits = int(np.float32(overflow_scale).view(np.uint32)) & 0xFF800000
    exponent = (amax_bits >> 23).astype(jnp.int32)  # the sign bit is clear
    round_down = jnp.where(
        (amax_bits & jnp.uint32(0x7FFFFF)) > jnp.uint32(FP8_MAX_MANTISSA_BITS),
        jnp.int32(1),
        jnp.int32(0),
    )
    scale_exponent = jnp.int32((max_bits >> 23) + 127) - exponent - round_down
    scale_bits = jnp.where(
        scale_exponent >= 255,
        jnp.uint32(overflow_bits),
        scale_exponent.astype(jnp.uint32) << 23,  # >= E − 2 > 0 for every amax
    )
    degenerate = (amax_bits == 0) | (amax_bits >= jnp.uint32(qc.F32_INF_BITS))
    return jnp.where(degenerate, jnp.uint32(0x3F800000), scale_bits)


def scale_from_amax_bits(
    amax_bits, *, fp8_max, power_2_scale, amax_epsilon, overflow_scale, lean=False
):
    """(scale, scale_inv) float32 from amaxes given as uint32 bits (TE's rule, per block).
    `lean`: power-of-2 scales without the division (same bits)."""
    amax = qc.f32_from_bits(amax_bits)
    if amax_epsilon > 0:
        amax = jnp.maximum(amax, jnp.float32(amax_epsilon))
    bits = qc.abs_bits(amax)
    if lean and power_2_scale:
        scale_bits = pow2_scale_bits_without_division(
            bits, fp8_max=fp8_max, overflow_scale=overflow_scale
        )
        return qc.f32_from_bits(scale_bits), _pow2_reciprocal(scale_bits)
    scale = divide(jnp.float32(fp8_max), amax)
    scale = jnp.where(qc.is_inf_bits(qc.abs_bits(scale)), jnp.float32(overflow_scale), scale)
    degenerate = (bits == 0) | (bits >= jnp.uint32(qc.F32_INF_BITS))  # 0, Inf or NaN
    scale = jnp.where(degenerate, jnp.float32(1.0), scale)
    if not power_2_scale:
        return scale, divide(jnp.float32(1.0), scale)
    scale_bits = lax.bitcast_convert_type(scale, jnp.uint32) & jnp.uint32(0xFF800000)
    return qc.f32_from_bits(scale_bits), _pow2_reciprocal(scale_bits)


def _pow2_reciprocal(scale_bits):
    """Exact 1/scale for a positive normal power of two given as bits (2^127 → 2^-127)."""
    reciprocal_exponent = jnp.int32(254) - (scale_bits >> 23).astype(jnp.int32)
    normal = lax.bitcast_convert_type(jnp.maximum(reciprocal_exponent, 1) << 23, jnp.float32)
    return jnp.where(reciprocal_exponent >= 1, normal, qc.f32_from_bits(jnp.uint32(0x00400000)))


def _codes(v, scale_b, fp8_dtype, fix_nan: bool):
    codes = qc.saturating_fp8(v * scale_b, fp8_dtype)
    if not fix_nan:
        return codes
    # A NaN element gets the canonical NaN byte whatever its sign (the interpreter's XLA cast
    # keeps the sign and gives E5M2 0x7E).
    v_bits = lax.bitcast_convert_type(v, jnp.uint32)
    is_nan = qc.is_nan_bits(v_bits & jnp.uint32(qc.ABS_MASK))
    keep = jnp.where(is_nan, jnp.uint32(0), jnp.uint32(0xFF)).astype(jnp.uint8)
    fix = jnp.where(is_nan, jnp.uint32(qc.CANONICAL_FP8_NAN), jnp.uint32(0)).astype(jnp.uint8)
    bits = (lax.bitcast_convert_type(codes, jnp.uint8) & keep) | fix
    return lax.bitcast_convert_type(bits, fp8_dtype)


def _store_codes(v, scale_b, fp8_dtype, tile_has_nan, dst_ref):
    """Quantize with and without the NaN fix-up under a tile-uniform predicate; store bytes."""

    @pl.when(tile_has_nan)
    def _():
        qc.store_line_bytes(dst_ref, qc.as_bytes(_codes(v, scale_b, fp8_dtype, True)))

    @pl.when(jnp.logical_not(tile_has_nan))
    def _():
        qc.store_line_bytes(dst_ref, qc.as_bytes(_codes(v, scale_b, fp8_dtype, False)))


def _kernel(x_gmem, *refs, config, cols, rowwise, columnwise, on_hardware, scales, **options):
    """`scales`: the copies' `qc.LineScales` (1×128 blocks), or None (128×128: the body stores
    each tile's one scale into the (blocks, blocks) outputs itself)."""
    data_outputs = qc.data_outputs(rowwise, columnwise)
    refs, stages = qc.split_scale_stages(refs, scales or [])
    outs, scratch = qc.split_refs(refs, config, cols, data_outputs)
    data_gmems, scale_dests = outs[0::2], outs[1::2]
    if scales is not None:
        position = qc.cta_position(config, x_gmem.shape[0], cols)
        scale_dests = [
            qc.LineScaleDest.for_cta(*dest, position)
            for dest in zip(scales, scale_dests, stages, strict=True)
        ]
    if config.lean_arithmetic:
        options["on_hardware"] = on_hardware
    body = functools.partial(
        _lean_tile if config.lean_arithmetic else _tile,
        scale_dests=scale_dests,
        copies=[o.columnwise for o in data_outputs],
        config=config,
        **options,
    )
    qc.for_each_tile(
        x_gmem, scratch, config, cols, body, list(zip(data_gmems, data_outputs, strict=True))
    )
    if scales is not None:
        qc.write_staged_scales(scale_dests)


def _store_tile_scale(scale_gmem, columnwise: bool, m0, k0, scale_inv) -> None:
    """The scale_inv of a 128×128 block (the whole tile) into either copy's (blocks, blocks)."""
    i, j = m0 // BLOCK, k0 // BLOCK
    if columnwise:
        scale_gmem[j, i] = scale_inv
    else:
        scale_gmem[i, j] = scale_inv


def _store_line_scales(scale_dest, columnwise: bool, config, m0, k0, scale_invs) -> None:
    """One tile's 1×128 scale_invs (a column per block of each line) into the copy's scales
    (a `qc.LineScaleDest`): the rowwise copy's lines are x's rows, the columnwise copy's are
    x's columns."""
    lines, line0, col0 = (config.tile_k, k0, m0) if columnwise else (config.tile_m, m0, k0)
    scale_dest.store(line0, lines, col0 // BLOCK, qc.concat_columns(scale_invs))


def _tile(
    x_smem, m0, k0, dests, *, scale_dests, copies, config, in_dtype, fp8_dtype, two_d, scale_rule
):
    tm, tk = config.tile_m, config.tile_k
    row_layout = qc.rows_layout(in_dtype)

    def row_chunk(c):  # (tm, 32) rowwise slice
        return qc.load_rows(x_smem.at[:, pl.ds(c * CHUNK, CHUNK)], in_dtype)

    def column_chunk(c):  # (tk, 32) slice of the transposed tile
        return qc.load_columns(x_smem.at[pl.ds(c * CHUNK, CHUNK), :])

    def chunked_amax(load, chunks):
        amax = None
        for c in chunks:
            m = qc.row_amax_bits(load(c))
            amax = m if amax is None else jnp.maximum(amax, m)
        return amax

    if two_d:
        # One 128×128 block per tile: one scale for both copies (the columnwise copy is the
        # transpose of the rowwise one).
        tile_amax = jnp.max(chunked_amax(row_chunk, range(tk // CHUNK)))
        tile_has_nan = qc.is_nan_bits(tile_amax)
        scale, scale_inv = scale_rule(tile_amax)
        for columnwise, dest, scale_dest in zip(copies, dests, scale_dests, strict=True):
            load = column_chunk if columnwise else row_chunk
            for c in range((tm if columnwise else tk) // CHUNK):
                _store_codes(load(c), scale, fp8_dtype, tile_has_nan, dest.cols(c * CHUNK, CHUNK))
            _store_tile_scale(scale_dest, columnwise, m0, k0, scale_inv)
        return

    per_block = BLOCK // CHUNK
    for columnwise, dest, scale_dest in zip(copies, dests, scale_dests, strict=True):
        load, layout = (column_chunk, qc.RPT1) if columnwise else (row_chunk, row_layout)
        n_blocks = (tm if columnwise else tk) // BLOCK
        scale_invs = []
        for b in range(n_blocks):
            chunks = range(b * per_block, (b + 1) * per_block)
            amax = chunked_amax(load, chunks)  # first pass: the block amax per line
            tile_has_nan = qc.is_nan_bits(jnp.max(amax))
            scale, scale_inv = scale_rule(amax)
            for c in chunks:  # second pass: re-read shared memory and quantize
                v = load(c)
                scale_b = qc.broadcast_rows(scale, v.shape, layout)
                _store_codes(v, scale_b, fp8_dtype, tile_has_nan, dest.cols(c * CHUNK, CHUNK))
            scale_invs.append(qc.column(scale_inv))
        _store_line_scales(scale_dest, columnwise, config, m0, k0, scale_invs)


def _lean_codes(v, scale_b, fp8_dtype, on_hardware: bool):
    """FP8 codes of v · scale. On the hardware the cast is cvt.rn.satfinite, which saturates
    (±Inf and overflow to ±max: the reference's clip) and turns NaN of either sign into 0x7F
    (the reference's NaN code), so nothing else is needed. The interpreter's XLA cast neither
    saturates nor gives 0x7F: there, the exact path's clip and NaN fix-up (every tile)."""
    if on_hardware:
        return (v * scale_b).astype(fp8_dtype)
    return _codes(v, scale_b, fp8_dtype, True)


def _lean_tile(
    x_smem,
    m0,
    k0,
    dests,
    *,
    scale_dests,
    copies,
    config,
    in_dtype,
    fp8_dtype,
    two_d,
    scale_rule,
    on_hardware,
):
    """`_tile` with `FP8BlockQuantizeConfig.lean_arithmetic`: the same bits, fewer operations."""
    tm, tk = config.tile_m, config.tile_k
    bf16 = jnp.dtype(in_dtype) == jnp.bfloat16
    row_layout = qc.rows_layout(in_dtype)
    # Columnwise values two per register vector: a bf16 pair is one 32-bit register, and
    # cvt.rn.satfinite converts two values at a time (a register regrouping only).
    pair_layout = qc.row_per_thread(2)

    def raw_rows(c):  # (tm, 32) rowwise slice, x's dtype
        return plgpu.load(x_smem.at[:, pl.ds(c * CHUNK, CHUNK)], layout=row_layout)

    def raw_columns(c):  # (tk, 32) slice of the transposed tile, x's dtype, in pairs
        column = plgpu.load(x_smem.at[pl.ds(c * CHUNK, CHUNK), :].T, layout=qc.RPT1)
        return plgpu.layout_cast(column, pair_layout)

    def line_amax_bits(load, chunks):
        """Per-line amax (uint32 float32 bits) over the chunks: elementwise max of the |x|
        patterns in x's width, then one in-thread reduction; bf16 bits << 16 are the float32
        bits, so the order and the NaN / Inf tests are the same."""
        patterns = None
        for c in chunks:
            p = qc.abs_patterns(load(c))
            patterns = p if patterns is None else jnp.maximum(patterns, p)
        return qc.line_amax_bits(patterns)

    def store_codes(raw, scale, layout, dest_ref):
        v = raw.astype(jnp.float32)
        scale_b = scale if scale.ndim == 0 else qc.broadcast_rows(scale, v.shape, layout)
        qc.store_line_bytes(dest_ref, qc.as_bytes(_lean_codes(v, scale_b, fp8_dtype, on_hardware)))

    if two_d:
        tile_amax = jnp.max(line_amax_bits(raw_rows, range(tk // CHUNK)))
        scale, scale_inv = scale_rule(tile_amax)
        for columnwise, dest, scale_dest in zip(copies, dests, scale_dests, strict=True):
            load, layout = (raw_columns, pair_layout) if columnwise else (raw_rows, row_layout)
            for c in range((tm if columnwise else tk) // CHUNK):
                store_codes(load(c), scale, layout, dest.cols(c * CHUNK, CHUNK))
            _store_tile_scale(scale_dest, columnwise, m0, k0, scale_inv)
        return

    per_block = BLOCK // CHUNK
    for columnwise, dest, scale_dest in zip(copies, dests, scale_dests, strict=True):
        load, layout = (raw_columns, pair_layout) if columnwise else (raw_rows, row_layout)
        n_blocks = (tm if columnwise else tk) // BLOCK
        scale_invs = []
        for b in range(n_blocks):
            chunks = range(b * per_block, (b + 1) * per_block)
            if columnwise and bf16:
                # One shared-memory read: the line's 128 values stay in registers as packed
                # bf16 pairs (64 registers) from the amax to the codes. (Rows are re-read: 16
                # vector loads per line; float32 columns too: 128 registers would spill.)
                values = {c: load(c) for c in chunks}
                get = values.__getitem__
            else:
                get = load
            scale, scale_inv = scale_rule(line_amax_bits(get, chunks))
            for c in chunks:
                store_codes(get(c), scale, layout, dest.cols(c * CHUNK, CHUNK))
            scale_invs.append(qc.column(scale_inv))
        _store_line_scales(scale_dest, columnwise, config, m0, k0, scale_invs)


def quantize_fp8_block(
    x: jax.Array,
    *,
    block_shape: tuple[int, int] = (1, 128),
    rowwise: bool = True,
    columnwise: bool = False,
    fp8_dtype=jnp.float8_e4m3fn,
    power_2_scale: bool = True,
    amax_epsilon: float = 0.0,
    input_dtype=None,
    config: FP8BlockQuantizeConfig | None = None,
    interpret: bool = False,
    scale_layout: str = "lines",
) -> FP8BlockQuantized:
    """FP8-block-quantize a 2-D bf16/f32 array: both copies in one pass over x.

    `input_dtype` (default x.dtype) picks the scale that replaces an overflowing one. Shapes:
    rowwise data (M, K') and columnwise (K, M') with K', M' padded to 128 for 1×128 blocks
    (both dims padded for 128×128); scale_inv as in the module docstring. `scale_layout=
    "tiles"` (1×128 blocks, x of whole 128×128 tiles) returns each copy's scale_inv as
    (blocks, lines, 1), the kernel's tile-major output as written: the (K/128, M) order the
    block-FP8 GEMM reads (docs/design/layouts.md).
    """
    qc.check_input(x)
    untile_scales.check_scale_layout(scale_layout, x.shape)
    qc.check_copies(rowwise, columnwise)
    fp8_dtype = qc.check_fp8_dtype(fp8_dtype)
    if tuple(block_shape) not in BLOCK_SHAPES:
        raise ValueError(f"block_shape must be one of {BLOCK_SHAPES}, got {block_shape!r}")
    if not isinstance(power_2_scale, bool):
        raise TypeError(f"power_2_scale must be a bool, got {power_2_scale!r}")
    if not isinstance(amax_epsilon, int | float) or amax_epsilon < 0:
        raise ValueError(f"amax_epsilon must be a float >= 0, got {amax_epsilon!r}")
    config = qc.resolve_config(config, FP8BlockQuantizeConfig)
    two_d = tuple(block_shape) == (128, 128)
    if two_d and scale_layout != "lines":
        raise ValueError("scale_layout='tiles' is for 1×128 blocks (128×128 have one per tile)")
    if two_d and (config.tile_m, config.tile_k) != (BLOCK, BLOCK):
        raise ValueError("config: 128×128 blocks need tile_m = tile_k = 128")
    input_dtype = jnp.dtype(x.dtype if input_dtype is None else input_dtype)
    scale_rule = functools.partial(
        scale_from_amax_bits,
        fp8_max=qc.FP8_MAX[fp8_dtype],
        power_2_scale=power_2_scale,
        amax_epsilon=float(amax_epsilon),
        overflow_scale=input_dtype_max(input_dtype),
        lean=config.lean_arithmetic,
    )
    rows, cols = x.shape
    pr, pc = config.padded_shape(rows, cols)
    xp = qc.pad_to(x, pr, pc)
    copies = [c for c, wanted in ((False, rowwise), (True, columnwise)) if wanted]
    scales = (
        None if two_d else [qc.line_scales(config, (pr, pc), c, BLOCK, jnp.float32) for c in copies]
    )
    qc.check_smem(
        config,
        x.dtype,
        pc,
        qc.data_outputs(rowwise, columnwise),
        extra_bytes=sum(s.stage_bytes for s in scales or []),
    )
    out_types = []
    for index, columnwise_copy in enumerate(copies):
        lines, width = (pc, pr) if columnwise_copy else (pr, pc)
        out_types += [
            jax.ShapeDtypeStruct((lines, width), jnp.uint8),  # codes as bytes, bitcast below
            jax.ShapeDtypeStruct((lines // BLOCK, width // BLOCK), jnp.float32)
            if two_d
            else scales[index].out_type(),
        ]
    outs = qc.run_tiles(
        _kernel,
        xp,
        out_types=out_types,
        config=config,
        outputs=qc.data_outputs(rowwise, columnwise),
        interpret=interpret,
        fp8_dtype=fp8_dtype,
        two_d=two_d,
        rowwise=rowwise,
        columnwise=columnwise,
        scale_rule=scale_rule,
        scales=scales,
        extra_scratch=tuple(qc.scale_stages(scales or [])),
        on_hardware=not qc.interpreting(interpret),
    )
    # Block-padded extents of each copy (layouts.md).
    r_rows = qc.round_up(rows, BLOCK) if two_d else rows
    c_rows = qc.round_up(cols, BLOCK) if two_d else cols
    r_cols, c_cols = qc.round_up(cols, BLOCK), qc.round_up(rows, BLOCK)
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
    for copy, wanted, lines, width in (
        ("rowwise", rowwise, r_rows, r_cols),
        ("columnwise", columnwise, c_rows, c_cols),
    ):
        if not wanted:
            continue
        result[f"{copy}_data"] = qc.crop_codes(next(codes), lines, width, fp8_dtype)
        scale_lines = lines // BLOCK if two_d else lines
        result[f"{copy}_scale_inv"] = finish(next(scale_outs), scale_lines, width // BLOCK)
    return FP8BlockQuantized(
        rowwise_data=result.get("rowwise_data"),
        rowwise_scale_inv=result.get("rowwise_scale_inv"),
        columnwise_data=result.get("columnwise_data"),
        columnwise_scale_inv=result.get("columnwise_scale_inv"),
    )
