"""Dequantize kernels (Mosaic GPU, Hopper) for MXFP8, NVFP4 and FP8 block copies.

Each takes one stored copy exactly as the quantize kernels (and jax_qtrain) lay it out —
2-D, block-padded, a columnwise copy still transposed — and returns its float32 values (or
bf16, rounded from float32), bit-identical to `QuantizedTensor.dequantize_stored`:
  MXFP8:      q · 2^(byte − 127)   (2^-127 applied as 2^-63·2^-64; byte 0xFF → NaN)
  NVFP4:      (e2m1(q) · fp32(s_b)) · S_dec,  S_dec = fp32(1 / S_enc(global amax))
  FP8 block:  q · scale_inv[block]
Every thread owns one row of a 128×128 tile (quantize_common.py): it reads its row's codes and
scales with vector loads straight from global memory and writes 16-byte vectors of results.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import quantize_common as qc
from pallas_kernels.float32_division import divide
from pallas_kernels.manual_axes import varying_like
from pallas_kernels.quantize_nvfp4 import global_encode_scale

OUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
CHUNK = 32  # columns dequantized at a time per thread


@dataclasses.dataclass(frozen=True)
class DequantizeConfig(qc.TileConfig):
    """Tile of the *stored copy* handled per CTA (see `qc.TileConfig`; one tile per CTA and
    TMA in and out: steps_per_cta and steps_per_cta_m must stay 1 and stage_outputs True).

    Attributes (besides `TileConfig`'s):
      scaled_e2m1_decode: NVFP4 only: read each E2M1 code as float16 bits, its sign at bit
        15 and its three magnitude bits at bits 11..9 (`e2m1_half_bits`: the code's value
        times 2^-14, E2M1's 0.5 a float16 subnormal), convert to float32 (exact) and take the
        2^14 into the block scale, s_b · 2^14 (exact): (q·2^-14)·(s_b·2^14) is q·s_b exactly,
        then · S_dec as the reference. Two shifts and two masks per code instead of
        `e2m1_value_bits`' ~13 integer operations, compares and selects. The same bits
        (every byte against `e2m1_value_bits`, and the kernel against the reference in the
        interpreter, and on the H200 by `test_gpu_dequantize_bit_exact`). The default since
        stop 36: on the H200 (2026-12-02, CUPTI) 8192² to bf16 64.7 -> 56.4 µs (2.66 -> 3.05
        TB/s); the integer decode (False) took as long as MXFP8's kernel while reading half
        the code bytes, its integer work, not memory, bounding it.
    """

    scaled_e2m1_decode: bool = True

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.scaled_e2m1_decode, bool):
            raise TypeError(f"scaled_e2m1_decode must be a bool, got {self.scaled_e2m1_decode!r}")
        for name in ("steps_per_cta", "steps_per_cta_m"):
            if getattr(self, name) != 1:
                raise ValueError(f"{name} must be 1 for dequantize, got {getattr(self, name)}")
        if not self.stage_outputs:
            raise ValueError("stage_outputs must be True for dequantize (tiles always go by TMA)")
        if self.reuse_input_tile:
            raise ValueError(
                "reuse_input_tile must be False for dequantize (its staged output is larger "
                "than its input tile)"
            )


def _check_out_dtype(out_dtype) -> jnp.dtype:
    dtype = jnp.dtype(out_dtype)
    if dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be float32 or bfloat16, got {dtype}")
    return dtype


def _check_config(config):
    if config is None:
        return DequantizeConfig()
    if not isinstance(config, DequantizeConfig):
        raise TypeError(f"config must be a DequantizeConfig, got {type(config).__name__}")
    return config


def _check_2d(a, name: str, dtypes) -> None:
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise TypeError(f"{name} must be a jax array, got {type(a).__name__}")
    if a.ndim != 2:
        raise ValueError(f"{name} must be 2-D, got shape {a.shape}")
    if jnp.dtype(a.dtype) not in tuple(jnp.dtype(d) for d in dtypes):
        raise TypeError(
            f"{name} must have dtype in {[str(jnp.dtype(d)) for d in dtypes]}, got {a.dtype}"
        )


def _load(ref, dtype) -> jax.Array:
    """Row-per-thread load of a (128·n, c) global-memory slice, widest vectors that fit."""
    vector = max(1, min(ref.shape[1], 16 // jnp.dtype(dtype).itemsize))
    # (Global-memory loads have no bank-conflict-free "optimized" plan; plain vector loads.)
    return plgpu.load(ref, layout=qc.row_per_thread(vector), optimized=False)


def _run(body, out_shape, out_dtype, codes, operands, code_cols, config, interpret):
    """One 128×128 tile of the copy per CTA: its codes (a uint8 array, `code_cols` bytes per
    tile row) arrive in shared memory by TMA, `body(codes_smem, out_smem, *operand_refs, m0=,
    k0=)` writes the values into a shared-memory tile, and TMA copies that out (whole lines in
    both directions; scales are read directly, they are small)."""
    rows, cols = out_shape
    tm, tk = config.tile_m, config.tile_k

    def kernel(codes_gmem, *refs):
        *operand_refs, out_gmem, codes_smem, out_smem, barrier = refs
        i, j = qc.cta_position(config, rows, cols)
        m0, k0 = i * tm, j * tk
        plgpu.copy_gmem_to_smem(
            codes_gmem.at[pl.ds(m0, tm), pl.ds(j * code_cols, code_cols)], codes_smem, barrier
        )
        plgpu.barrier_wait(barrier)
        body(codes_smem, out_smem, *operand_refs, m0=m0, k0=k0)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[pl.ds(m0, tm), pl.ds(k0, tk)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    launch = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        # "dequantize_mxfp8" etc. in profiler traces (the nested function is just "kernel").
        kernel_name="dequantize" + body.func.__name__.removesuffix("_body"),
        scratch_types=(
            plgpu.SMEM((tm, code_cols), jnp.uint8, transforms=qc.OUT_TRANSFORMS),
            plgpu.SMEM((tm, tk), out_dtype, transforms=qc.tile_transforms(out_dtype)),
            plgpu.Barrier(),
        ),
        interpret=qc.interpret_params(interpret),
        compiler_params=qc.compiler_params(),
        **qc.tile_grid(rows, cols, config),
    )
    return varying_like(launch(codes, *operands), codes, *operands)


def _codes(codes_smem, start: int, width: int) -> jax.Array:
    """(tile rows, width) code bytes from shared memory, row-per-thread in 16-byte vectors."""
    return plgpu.load(codes_smem.at[:, pl.ds(start, width)], layout=qc.row_per_thread(16))


def _store(out_smem, start: int, values: jax.Array, out_dtype) -> None:
    qc.store_line_bytes(out_smem.at[:, pl.ds(start, values.shape[1])], values.astype(out_dtype))


def _padded(a, rows, cols):
    return qc.pad_to(a, rows, cols)


# ----------------------------------------------------------------------------------------------
# MXFP8


def _per_row(values: jax.Array, j: int) -> jax.Array:
    """Column j of a (R, c) RPT1 array as an (R,) array (a one-element in-thread reduction)."""
    return jnp.max(values[:, j : j + 1], axis=1)


def _mxfp8_body(codes_smem, out_smem, scale_gmem, *, m0, k0, config, fp8_dtype, out_dtype):
    tm, tk = config.tile_m, config.tile_k
    scale_bytes = _load(scale_gmem.at[pl.ds(m0, tm), pl.ds(k0 // 32, tk // 32)], jnp.uint8)
    scale_bytes = plgpu.layout_cast(scale_bytes.astype(jnp.int32), qc.RPT1)
    layout = qc.row_per_thread(16)
    for j in range(tk // CHUNK):
        codes = lax.bitcast_convert_type(_codes(codes_smem, j * CHUNK, CHUNK), fp8_dtype)
        q = codes.astype(jnp.float32)
        exponent = _per_row(scale_bytes, j) - 127
        # x · 2^exponent as the reference does it: 2^-127 split in two normal factors, and a
        # NaN block (byte 255) replaced by NaN (a select, so the NaN is the reference's).
        direct = lax.bitcast_convert_type((jnp.clip(exponent, -126, 127) + 127) << 23, jnp.float32)
        first = jnp.where(exponent == -127, jnp.float32(2.0**-63), direct)
        second = jnp.where(exponent == -127, jnp.float32(2.0**-64), jnp.float32(1.0))
        values = (q * qc.broadcast_rows(first, q.shape, layout)) * qc.broadcast_rows(
            second, q.shape, layout
        )
        nan_block = qc.broadcast_rows(exponent == 128, q.shape, layout)
        _store(out_smem, j * CHUNK, jnp.where(nan_block, jnp.float32(jnp.nan), values), out_dtype)


def dequantize_mxfp8(
    data: jax.Array,
    scale: jax.Array,
    *,
    out_dtype=jnp.float32,
    config: DequantizeConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Values of an MXFP8 copy: data (R, C) E4M3/E5M2, scale (R, C/32) E8M0 bytes (uint8)."""
    _check_2d(data, "data", qc.FP8_DTYPES)
    _check_2d(scale, "scale", (jnp.uint8,))
    rows, cols = data.shape
    if cols % 32 or scale.shape != (rows, cols // 32):
        raise ValueError(
            f"scale must have shape (R, C/32) = ({rows}, {cols // 32}) for data of shape "
            f"{data.shape} (C a multiple of 32), got {scale.shape}"
        )
    out_dtype = _check_out_dtype(out_dtype)
    config = _check_config(config)
    pr, pc = config.padded_shape(rows, cols)
    out = _run(
        functools.partial(_mxfp8_body, config=config, fp8_dtype=data.dtype, out_dtype=out_dtype),
        (pr, pc),
        out_dtype,
        _padded(lax.bitcast_convert_type(data, jnp.uint8), pr, pc),
        (_padded(scale, pr, pc // 32),),
        config.tile_k,
        config,
        interpret,
    )
    return qc.crop(out, rows, cols)


# ----------------------------------------------------------------------------------------------
# NVFP4


def e2m1_value_bits(codes: jax.Array) -> jax.Array:
    """float32 bit pattern of each E2M1 code (uint32 0..15): exponent field E = (c >> 1) & 3,
    mantissa bit m = c & 1; E = 0 is 0 or 0.5, else 2^(E-1)·(1 + m/2); bit 3 is the sign."""
    exponent = (codes >> 1) & jnp.uint32(3)
    mantissa = codes & jnp.uint32(1)
    normal = ((exponent + jnp.uint32(126)) << 23) | (mantissa << 22)
    subnormal = jnp.where(mantissa != 0, jnp.uint32(0x3F000000), jnp.uint32(0))
    magnitude = jnp.where(exponent == 0, subnormal, normal)
    return magnitude | ((codes & jnp.uint32(8)) << 28)


def e2m1_half_bits(byte: jax.Array, nibble: int) -> jax.Array:
    """float16 bits (uint16) of e2m1(c) · 2^-14 for the code c in nibble `nibble` (0: bits
    3..0, 1: bits 7..4) of each uint32 `byte`. E2M1's exponent field E and mantissa bit m
    become float16's exponent field and top mantissa bit (bits 11..9), its sign bit 15:
    2^(E−15)·(1 + m/2) for E ≥ 1 and, for E = 0, the float16 subnormal m·2^-15: E2M1's
    values times 2^-14. Two shifts and two masks; the conversion to float32 is exact,
    subnormals included (the hardware's and XLA:CPU's, which flushes float32 subnormals)."""
    if nibble not in (0, 1):
        raise ValueError(f"nibble must be 0 (bits 3..0) or 1 (bits 7..4), got {nibble!r}")
    offset = 4 * nibble
    magnitude = (byte << (9 - offset)) & jnp.uint32(0x0E00)
    sign = (byte << (12 - offset)) & jnp.uint32(0x8000)
    return (magnitude | sign).astype(jnp.uint16)


def _nvfp4_block_values(packed, block_scales, s_dec, block: int, nibbles, config):
    """Values of the given nibbles (0: element 2i, 1: element 2i + 1 of byte i) of the 16-value
    block whose bytes are `packed`'s columns 8·(block % 4) + [0, 8), byte by byte, and
    whose scale is `block_scales`' column `block`."""
    codes = []
    first_byte = 8 * (block % 4)
    for i in range(first_byte, first_byte + 8):
        byte = packed[:, i : i + 1]
        for nibble in nibbles:
            if config.scaled_e2m1_decode:
                codes.append(e2m1_half_bits(byte, nibble))
            else:
                codes.append(byte & jnp.uint32(0xF) if nibble == 0 else byte >> 4)
    block_scale = _per_row(block_scales, block)
    if config.scaled_e2m1_decode:
        halves = lax.bitcast_convert_type(qc.concat_columns(codes), jnp.float16)
        q = halves.astype(jnp.float32)  # e2m1 · 2^-14
        block_scale = block_scale * jnp.float32(2.0**14)  # exact
    else:
        q = qc.f32_from_bits(e2m1_value_bits(qc.concat_columns(codes)))
    scale = qc.broadcast_rows(block_scale, q.shape, qc.RPT1)
    return (q * scale) * s_dec


def _nvfp4_body(
    codes_smem, out_smem, scale_gmem, s_dec_gmem, *, m0, k0, config, out_dtype, column_order
):
    tm, tk = config.tile_m, config.tile_k
    s_dec = s_dec_gmem[0]
    block_scales = _load(scale_gmem.at[pl.ds(m0, tm), pl.ds(k0 // 16, tk // 16)], jnp.uint8)
    block_scales = lax.bitcast_convert_type(block_scales, jnp.float8_e4m3fn).astype(jnp.float32)
    block_scales = plgpu.layout_cast(block_scales, qc.RPT1)
    for g in range(tk // 64):  # 64 values = 32 packed bytes at a time
        packed = plgpu.layout_cast(_codes(codes_smem, 32 * g, 32).astype(jnp.uint32), qc.RPT1)
        if column_order == "natural":
            for pair in range(2):  # two 16-value blocks per 32-column store
                values = [
                    _nvfp4_block_values(packed, block_scales, s_dec, 4 * g + b, (0, 1), config)
                    for b in (2 * pair, 2 * pair + 1)
                ]
                _store(out_smem, 64 * g + 32 * pair, jnp.concatenate(values, axis=1), out_dtype)
        else:  # "even_odd": the low nibbles of the 32 bytes, then their high nibbles
            for nibble in (0, 1):
                values = [
                    _nvfp4_block_values(packed, block_scales, s_dec, 4 * g + b, (nibble,), config)
                    for b in range(4)
                ]
                _store(out_smem, 64 * g + 32 * nibble, jnp.concatenate(values, axis=1), out_dtype)


COLUMN_ORDERS = ("natural", "even_odd")


def dequantize_nvfp4(
    data: jax.Array,
    scale: jax.Array,
    global_amax: jax.Array | None,
    *,
    out_dtype=jnp.float32,
    column_order: str = "natural",
    config: DequantizeConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Values of an NVFP4 copy with 1×16 blocks: data (R, C/2) packed uint8, scale (R, C/16)
    float8_e4m3fn, and the copy's float32 global amax. Returns (R, C).

    ``global_amax=None`` leaves out the per-tensor factor S_dec (the values are then
    e2m1 · e4m3 products, exact in bfloat16): what a GEMM that applies S_dec to its output reads.
    ``column_order="even_odd"`` writes each 64 columns' 32 even-indexed values, then its 32 odd
    ones (C a multiple of 64): the token order `grouped_matmul_nvfp4_weights` contracts in,
    at no cost here (each byte's two nibbles go to two stores instead of one).
    """
    if column_order not in COLUMN_ORDERS:
        raise ValueError(f"column_order must be one of {COLUMN_ORDERS}, got {column_order!r}")
    _check_2d(data, "data", (jnp.uint8,))
    _check_2d(scale, "scale", (jnp.float8_e4m3fn,))
    rows, half_cols = data.shape
    cols = 2 * half_cols
    if cols % 16 or scale.shape != (rows, cols // 16):
        raise ValueError(
            f"scale must have shape (R, C/16) = ({rows}, {cols // 16}) for packed data of "
            f"shape {data.shape} (C = {cols} a multiple of 16), got {scale.shape}"
        )
    if column_order == "even_odd" and cols % 64:
        raise ValueError(
            f"data: column_order='even_odd' reorders whole 64-column runs, but the copy has "
            f"C = {cols} columns"
        )
    if global_amax is None:
        s_dec = jnp.ones((1,), jnp.float32)
    else:
        global_amax = jnp.asarray(global_amax)
        if global_amax.shape != () or not jnp.issubdtype(global_amax.dtype, jnp.floating):
            raise TypeError(
                f"global_amax must be a float scalar or None, got {global_amax.dtype}"
                f"{list(global_amax.shape)}"
            )
        s_dec = divide(jnp.float32(1.0), global_encode_scale(global_amax)).reshape(1)
    out_dtype = _check_out_dtype(out_dtype)
    config = _check_config(config)
    pr, pc = config.padded_shape(rows, cols)
    scale_bytes = lax.bitcast_convert_type(scale, jnp.uint8)
    out = _run(
        functools.partial(
            _nvfp4_body, config=config, out_dtype=out_dtype, column_order=column_order
        ),
        (pr, pc),
        out_dtype,
        _padded(data, pr, pc // 2),
        (_padded(scale_bytes, pr, pc // 16), s_dec),
        config.tile_k // 2,
        config,
        interpret,
    )
    return qc.crop(out, rows, cols)


# ----------------------------------------------------------------------------------------------
# FP8 block


def _fp8_block_body(
    codes_smem, out_smem, scale_gmem, *, m0, k0, config, fp8_dtype, out_dtype, two_d
):
    tm, tk = config.tile_m, config.tile_k
    layout = qc.row_per_thread(16)
    if two_d:
        tile_scale = scale_gmem[m0 // 128, k0 // 128]
    else:
        scales = _load(scale_gmem.at[pl.ds(m0, tm), pl.ds(k0 // 128, tk // 128)], jnp.float32)
        scales = plgpu.layout_cast(scales, qc.RPT1)
    for j in range(tk // CHUNK):
        codes = lax.bitcast_convert_type(_codes(codes_smem, j * CHUNK, CHUNK), fp8_dtype)
        q = codes.astype(jnp.float32)
        if two_d:
            values = q * tile_scale
        else:
            block = (j * CHUNK) // 128
            values = q * qc.broadcast_rows(_per_row(scales, block), q.shape, layout)
        _store(out_smem, j * CHUNK, values, out_dtype)


def dequantize_fp8_block(
    data: jax.Array,
    scale_inv: jax.Array,
    *,
    block_shape: tuple[int, int] = (1, 128),
    out_dtype=jnp.float32,
    config: DequantizeConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Values of an FP8 block copy: data (R, C) E4M3/E5M2 (C a multiple of 128; R too for
    128×128 blocks) and float32 scale_inv (R, C/128) or (R/128, C/128)."""
    _check_2d(data, "data", qc.FP8_DTYPES)
    _check_2d(scale_inv, "scale_inv", (jnp.float32,))
    if tuple(block_shape) not in ((1, 128), (128, 128)):
        raise ValueError(f"block_shape must be (1, 128) or (128, 128), got {block_shape!r}")
    two_d = tuple(block_shape) == (128, 128)
    rows, cols = data.shape
    want = (rows // 128 if two_d else rows, cols // 128)
    if cols % 128 or (two_d and rows % 128) or scale_inv.shape != want:
        raise ValueError(
            f"scale_inv must have shape {want} for data of shape {data.shape} and blocks "
            f"{block_shape} (data dims must be block multiples), got {scale_inv.shape}"
        )
    out_dtype = _check_out_dtype(out_dtype)
    config = _check_config(config)
    if two_d and (config.tile_m, config.tile_k) != (128, 128):
        raise ValueError("config: 128×128 blocks need tile_m = tile_k = 128")
    pr, pc = config.padded_shape(rows, cols)
    scale_pad = (pr // 128, pc // 128) if two_d else (pr, pc // 128)
    out = _run(
        functools.partial(
            _fp8_block_body, config=config, fp8_dtype=data.dtype, out_dtype=out_dtype, two_d=two_d
        ),
        (pr, pc),
        out_dtype,
        _padded(lax.bitcast_convert_type(data, jnp.uint8), pr, pc),
        (_padded(scale_inv, *scale_pad),),
        config.tile_k,
        config,
        interpret,
    )
    return qc.crop(out, rows, cols)
