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
A NaN element keeps its sign in the code (0x7F/0xFF E4M3, 0x7E/0xFE E5M2), like XLA's cast; that
fix-up only runs in tiles that contain a NaN.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import quantize_common as qc
from pallas_kernels.float32_division import divide

BLOCK = 128
CHUNK = 32  # columns (rows, for the columnwise copy) per shared-memory read
BLOCK_SHAPES = ((1, 128), (128, 128))


@dataclasses.dataclass(frozen=True)
class FP8BlockQuantizeConfig(qc.TileConfig):
    """Tuning knobs of the FP8 block kernel (see `qc.TileConfig`)."""

    def __post_init__(self):
        super().__post_init__()


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


def scale_from_amax_bits(amax_bits, *, fp8_max, power_2_scale, amax_epsilon, overflow_scale):
    """(scale, scale_inv) float32 from amaxes given as uint32 bits (TE's rule, per block)."""
    amax = qc.f32_from_bits(amax_bits)
    if amax_epsilon > 0:
        amax = jnp.maximum(amax, jnp.float32(amax_epsilon))
    bits = qc.abs_bits(amax)
    scale = divide(jnp.float32(fp8_max), amax)
    scale = jnp.where(qc.is_inf_bits(qc.abs_bits(scale)), jnp.float32(overflow_scale), scale)
    degenerate = (bits == 0) | (bits >= jnp.uint32(qc.F32_INF_BITS))  # 0, Inf or NaN
    scale = jnp.where(degenerate, jnp.float32(1.0), scale)
    if not power_2_scale:
        return scale, divide(jnp.float32(1.0), scale)
    scale_bits = lax.bitcast_convert_type(scale, jnp.uint32) & jnp.uint32(0xFF800000)
    scale = qc.f32_from_bits(scale_bits)
    reciprocal_exponent = jnp.int32(254) - (scale_bits >> 23).astype(jnp.int32)
    normal = lax.bitcast_convert_type(jnp.maximum(reciprocal_exponent, 1) << 23, jnp.float32)
    scale_inv = jnp.where(
        reciprocal_exponent >= 1, normal, qc.f32_from_bits(jnp.uint32(0x00400000))
    )
    return scale, scale_inv


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


def _kernel(x_gmem, *refs, config, cols, rowwise, columnwise, **options):
    data_outputs = qc.data_outputs(rowwise, columnwise)
    outs, scratch = qc.split_refs(refs, config, cols, data_outputs)
    data_gmems, scale_gmems = outs[0::2], outs[1::2]
    body = functools.partial(
        _tile,
        scale_gmems=scale_gmems,
        copies=[o.columnwise for o in data_outputs],
        config=config,
        **options,
    )
    qc.for_each_tile(
        x_gmem, scratch, config, cols, body, list(zip(data_gmems, data_outputs, strict=True))
    )


def _tile(
    x_smem, m0, k0, dests, *, scale_gmems, copies, config, in_dtype, fp8_dtype, two_d, scale_rule
):
    tm, tk = config.tile_m, config.tile_k

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
        i, j = m0 // BLOCK, k0 // BLOCK
        for columnwise, dest, scale_gmem in zip(copies, dests, scale_gmems, strict=True):
            load = column_chunk if columnwise else row_chunk
            for c in range((tm if columnwise else tk) // CHUNK):
                _store_codes(load(c), scale, fp8_dtype, tile_has_nan, dest.cols(c * CHUNK, CHUNK))
            if columnwise:
                scale_gmem[j, i] = scale_inv
            else:
                scale_gmem[i, j] = scale_inv
        return

    per_block = BLOCK // CHUNK
    for columnwise, dest, scale_gmem in zip(copies, dests, scale_gmems, strict=True):
        if columnwise:
            load, layout, lines, line0, col0 = column_chunk, qc.RPT1, tk, k0, m0
        else:
            load, layout, lines, line0, col0 = row_chunk, qc.rows_layout(in_dtype), tm, m0, k0
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
        qc.store_line_bytes(
            scale_gmem.at[pl.ds(line0, lines), pl.ds(col0 // BLOCK, n_blocks)],
            qc.concat_columns(scale_invs),
        )


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
) -> FP8BlockQuantized:
    """FP8-block-quantize a 2-D bf16/f32 array: both copies in one pass over x.

    `input_dtype` (default x.dtype) picks the scale that replaces an overflowing one. Shapes:
    rowwise data (M, K') and columnwise (K, M') with K', M' padded to 128 for 1×128 blocks
    (both dims padded for 128×128); scale_inv as in the module docstring.
    """
    qc.check_input(x)
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
    if two_d and (config.tile_m, config.tile_k) != (BLOCK, BLOCK):
        raise ValueError("config: 128×128 blocks need tile_m = tile_k = 128")
    input_dtype = jnp.dtype(x.dtype if input_dtype is None else input_dtype)
    scale_rule = functools.partial(
        scale_from_amax_bits,
        fp8_max=qc.FP8_MAX[fp8_dtype],
        power_2_scale=power_2_scale,
        amax_epsilon=float(amax_epsilon),
        overflow_scale=input_dtype_max(input_dtype),
    )
    rows, cols = x.shape
    pr, pc = config.padded_shape(rows, cols)
    xp = qc.pad_to(x, pr, pc)
    qc.check_smem(config, x.dtype, pc, qc.data_outputs(rowwise, columnwise))
    out_types = []
    if rowwise:
        scale_shape = (pr // BLOCK, pc // BLOCK) if two_d else (pr, pc // BLOCK)
        out_types += [
            jax.ShapeDtypeStruct((pr, pc), jnp.uint8),  # codes as bytes, bitcast below
            jax.ShapeDtypeStruct(scale_shape, jnp.float32),
        ]
    if columnwise:
        scale_shape = (pc // BLOCK, pr // BLOCK) if two_d else (pc, pr // BLOCK)
        out_types += [
            jax.ShapeDtypeStruct((pc, pr), jnp.uint8),
            jax.ShapeDtypeStruct(scale_shape, jnp.float32),
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
    )
    # Block-padded extents of each copy (layouts.md).
    r_rows = qc.round_up(rows, BLOCK) if two_d else rows
    c_rows = qc.round_up(cols, BLOCK) if two_d else cols
    r_cols, c_cols = qc.round_up(cols, BLOCK), qc.round_up(rows, BLOCK)
    result = {}
    for copy, wanted, lines, width in (
        ("rowwise", rowwise, r_rows, r_cols),
        ("columnwise", columnwise, c_rows, c_cols),
    ):
        if not wanted:
            continue
        data, scale = outs[:2]
        outs = outs[2:]
        result[f"{copy}_data"] = qc.crop_codes(data, lines, width, fp8_dtype)
        scale_lines = lines // BLOCK if two_d else lines
        result[f"{copy}_scale_inv"] = qc.crop(scale, scale_lines, width // BLOCK)
    return FP8BlockQuantized(
        rowwise_data=result.get("rowwise_data"),
        rowwise_scale_inv=result.get("rowwise_scale_inv"),
        columnwise_data=result.get("columnwise_data"),
        columnwise_scale_inv=result.get("columnwise_scale_inv"),
    )
