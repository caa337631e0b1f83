"""FP8 cast-transpose kernel (Mosaic GPU, Hopper): the codes of already-scaled values.

FP8 per-tensor current scaling (TransformerEngine `Float8CurrentScaling`) is `sat_RNE(x · s)`
with a scale `s` the caller computes from an amax: one per tensor, or one per row when each MoE
expert's group of rows is its own tensor. What is left after the multiply is an elementwise cast
and, for the columnwise copy, a transpose. XLA fuses that transpose into the quantizing loop and
chooses the operands' layouts itself; for the grouped per-tensor quantizer the columnwise pass
ran 16× slower than the rowwise one on the H200 (8.9 ms against 0.57 ms for 16384×4096 bf16 in
8 groups, 2026-11-30). This kernel fixes both layouts: it reads the scaled float32 (M, K) array
once and writes, in the same pass, any of

  rowwise:    codes (M, K)   = sat_RNE(scaled)
  columnwise: codes (K, M)   = sat_RNE(scaledᵀ)

with TransformerEngine's canonical NaN byte 0x7F, exactly as jax_qtrain/formats/common.py's
`saturating_cast` (the tile / register layout is quantize_common.py's).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import quantize_common as qc

# Elements of a line converted per step: bounds each thread's live registers to 32 values.
LINE_CHUNK = 32


@dataclasses.dataclass(frozen=True)
class CastTransposeConfig(qc.TileConfig):
    """Tuning knobs of the FP8 cast-transpose kernel (see `qc.TileConfig`)."""

    reads_columnwise_in_slabs = True  # `_tile`: the rowwise chunks, then 32-row slabs


class CastTransposed(NamedTuple):
    """Outputs of `cast_transpose_fp8`; a copy that was not requested is None."""

    rowwise_data: jax.Array | None
    columnwise_data: jax.Array | None


def fp8_codes(v: jax.Array, fp8_dtype) -> jax.Array:
    """uint8 FP8 codes of a float32 register array: RNE, saturating to ±max, every NaN as the
    byte 0x7F (the interpreter's XLA cast would keep a NaN's sign, or give E5M2 0x7E)."""
    code_bytes = qc.as_bytes(qc.saturating_fp8(v, fp8_dtype))
    is_nan = v != v
    # Selects on 32-bit values, then bitwise AND / OR: the 8-bit pointwise ops Mosaic has.
    keep = jnp.where(is_nan, jnp.uint32(0), jnp.uint32(0xFF)).astype(jnp.uint8)
    fix = jnp.where(is_nan, jnp.uint32(qc.CANONICAL_FP8_NAN), jnp.uint32(0)).astype(jnp.uint8)
    return (code_bytes & keep) | fix


def _kernel(x_gmem, *refs, config, cols, fp8_dtype, rowwise, columnwise, in_dtype):
    data_outputs = qc.data_outputs(rowwise, columnwise)
    data_gmems, scratch = qc.split_refs(refs, config, cols, data_outputs)
    body = functools.partial(
        _tile,
        config=config,
        fp8_dtype=fp8_dtype,
        copies=[o.columnwise for o in data_outputs],
        in_dtype=in_dtype,
    )
    qc.for_each_tile(
        x_gmem, scratch, config, cols, body, list(zip(data_gmems, data_outputs, strict=True))
    )


def _tile(x_smem, m0, k0, dests, *, config, fp8_dtype, copies, in_dtype):
    del m0, k0  # the destinations already point at this tile
    tm, tk = config.tile_m, config.tile_k
    for columnwise, dest in zip(copies, dests, strict=True):
        if not columnwise:
            for j in range(tk // LINE_CHUNK):
                v = qc.load_rows(x_smem.at[:, pl.ds(j * LINE_CHUNK, LINE_CHUNK)], in_dtype)
                qc.store_line_bytes(dest.cols(j * LINE_CHUNK, LINE_CHUNK), fp8_codes(v, fp8_dtype))
        else:
            for i in range(tm // LINE_CHUNK):
                v = qc.load_columns(x_smem.at[pl.ds(i * LINE_CHUNK, LINE_CHUNK), :])
                qc.store_line_bytes(dest.cols(i * LINE_CHUNK, LINE_CHUNK), fp8_codes(v, fp8_dtype))


def cast_transpose_fp8(
    scaled: jax.Array,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    fp8_dtype=jnp.float8_e4m3fn,
    config: CastTransposeConfig | None = None,
    interpret: bool = False,
) -> CastTransposed:
    """FP8 codes of a 2-D float32 / bf16 array of already-scaled values: rowwise codes (M, K)
    and / or columnwise codes (K, M) (those of scaledᵀ), both from one read of `scaled`.
    Inputs that are not whole tiles are zero-padded first (one extra copy) and the codes cropped.
    """
    qc.check_input(scaled, "scaled")
    qc.check_copies(rowwise, columnwise)
    fp8_dtype = qc.check_fp8_dtype(fp8_dtype)
    config = qc.resolve_config(config, CastTransposeConfig)
    rows, cols = scaled.shape
    padded_rows, padded_cols = config.padded_shape(rows, cols)
    data_outputs = qc.data_outputs(rowwise, columnwise)
    qc.check_smem(config, scaled.dtype, padded_cols, data_outputs)
    out_types = []  # codes come out as bytes and are bitcast to fp8_dtype below
    if rowwise:
        out_types.append(jax.ShapeDtypeStruct((padded_rows, padded_cols), jnp.uint8))
    if columnwise:
        out_types.append(jax.ShapeDtypeStruct((padded_cols, padded_rows), jnp.uint8))
    outs = qc.run_tiles(
        _kernel,
        qc.pad_to(scaled, padded_rows, padded_cols),
        out_types=out_types,
        config=config,
        outputs=data_outputs,
        interpret=interpret,
        fp8_dtype=fp8_dtype,
        rowwise=rowwise,
        columnwise=columnwise,
    )
    rowwise_data = qc.crop_codes(outs.pop(0), rows, cols, fp8_dtype) if rowwise else None
    columnwise_data = qc.crop_codes(outs.pop(0), cols, rows, fp8_dtype) if columnwise else None
    return CastTransposed(rowwise_data=rowwise_data, columnwise_data=columnwise_data)
