"""Numeric building blocks shared by every format: constants, bit views, saturating casts.

Everything here is plain jnp and runs the same under jit on CPU and GPU, with one documented
exception: XLA:CPU executes with flush-to-zero / denormals-are-zero, so an arithmetic operation
whose *operand or result* is a float32 subnormal (|v| < 2^-126) gives 0 there, while the GPU
(and TransformerEngine) keep the subnormal. Where a TransformerEngine rule can be evaluated with
integer operations instead (amax, zero tests, E8M0 exponents, power-of-2 reciprocals) we do so,
so scales are identical on both platforms; only codes of values below 2^-126 can differ.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import float32_division

FLT_MAX = float(np.finfo(np.float32).max)
BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)  # 3.3895314e38
FP16_MAX = 65504.0
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
E2M1_MAX = 6.0

FLOAT8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
SUPPORTED_INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def fp8_max(dtype: jnp.dtype) -> float:
    """Largest finite value of an FP8 code dtype (E4M3: 448, E5M2: 57344)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float8_e4m3fn:
        return E4M3_MAX
    if dtype == jnp.float8_e5m2:
        return E5M2_MAX
    raise ValueError(f"not an FP8 code dtype: {dtype}")


def input_dtype_max(dtype: jnp.dtype) -> float:
    """Largest finite value of a high-precision input dtype (FP8-block's overflowing scale)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bfloat16:
        return BF16_MAX
    if dtype == jnp.float16:
        return FP16_MAX
    return FLT_MAX


def f32_bits(x: jax.Array) -> jax.Array:
    """The uint32 bit pattern of a float32 array."""
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def f32_from_bits(bits: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)


def abs_bits(x: jax.Array) -> jax.Array:
    """|x| as uint32 bits. For non-negative floats the integer order is the float order and every
    NaN sorts above +Inf, so a max over these bits is an amax that propagates NaN and is immune
    to flush-to-zero."""
    return f32_bits(x) & jnp.uint32(0x7FFFFFFF)


def amax(x: jax.Array, axis=None, keepdims: bool = False) -> jax.Array:
    """max|x| in float32 (NaN if any element is NaN), computed on bit patterns."""
    return f32_from_bits(jnp.max(abs_bits(x), axis=axis, keepdims=keepdims))


def is_zero(v: jax.Array) -> jax.Array:
    """v == 0 for a non-negative float32, without flush-to-zero calling a subnormal zero."""
    return (f32_bits(v) & jnp.uint32(0x7FFFFFFF)) == 0


def round_down_to_pow2(v: jax.Array) -> jax.Array:
    """TransformerEngine's power-of-2 scale: clear the mantissa bits (bits &= 0xFF800000)."""
    return f32_from_bits(f32_bits(v) & jnp.uint32(0xFF800000))


def pow2_reciprocal(v: jax.Array) -> jax.Array:
    """Exact 1/v for a positive normal power of two, built from bits (2^127 → the subnormal
    2^-127, which float division would flush to zero on XLA:CPU)."""
    biased_exponent = (f32_bits(v) >> 23).astype(jnp.int32)
    reciprocal_exponent = 254 - biased_exponent
    normal = f32_from_bits(jnp.maximum(reciprocal_exponent, 1).astype(jnp.uint32) << 23)
    subnormal = f32_from_bits(jnp.uint32(0x00400000))  # 2^-127, only for v = 2^127
    return jnp.where(reciprocal_exponent >= 1, normal, subnormal)


CANONICAL_FP8_NAN = 0x7F  # what CUDA's __nv_cvt_float_to_fp8 (and Hopper's cvt.satfinite) give NaN


# IEEE float32 division (XLA:GPU's `/` is approximate, XLA:CPU's flushes subnormal quotients):
# one implementation, shared with the kernels, which must give the same bits.
def divide(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """IEEE float32 numerator / denominator (`pallas_kernels.float32_division`), for per-block
    and per-tensor scales, computed once: its ~55 integer operations are cheap elementwise ops
    to XLA, which fused them into every consumer of the broadcast scale and so ran them once
    per element (NVFP4 training on the CPU: 283 ms a step instead of 89). An optimization
    barrier makes the consumers read the stored quotients; the bits are the same."""
    return lax.optimization_barrier(float32_division.divide(numerator, denominator))


def saturating_cast(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Round-to-nearest-even cast of float32 `x` to an FP8 dtype, saturating to ±max.

    JAX's own float8 casts do not saturate (E4M3: 480 → NaN; E5M2 overflows to Inf), so clip
    first. NaN becomes the canonical NaN byte 0x7F, as TransformerEngine's CUDA cast gives; XLA's
    own NaN bytes differ by backend (XLA:CPU keeps the sign and gives E5M2 0x7E).
    """
    limit = fp8_max(dtype)
    codes = jnp.clip(x, -limit, limit).astype(dtype)
    code_bits = lax.bitcast_convert_type(codes, jnp.uint8)
    code_bits = jnp.where(jnp.isnan(x), jnp.uint8(CANONICAL_FP8_NAN), code_bits)
    return lax.bitcast_convert_type(code_bits, dtype)


def materialize(x: jax.Array) -> jax.Array:
    """Keep a narrow-dtype array as a real array inside jit.

    XLA:GPU treats `f32 -> fp8 -> f32` convert pairs as removable (allow-excess-precision), which
    silently turns fake quantization into the identity. An optimization barrier on the narrow
    array makes every consumer read the rounded values.
    """
    return lax.optimization_barrier(x)


def rounded_input(x: jax.Array) -> jax.Array:
    """`x` as its own dtype says, for a quantizer that computes in float32.

    A bfloat16 or float16 input is often the caller's float32 value cast in the same jit (a
    layer's `dtype`, an activation). XLA:GPU drops `f32 → bf16 → f32` convert pairs
    (allow-excess-precision), so the quantizer would see the unrounded float32 values: a
    different amax, so different scales and codes than for the bf16 tensor itself (seen on the
    H200: a cached weight's FP8 codes differed from a fresh quantization of the same bf16
    weight). A barrier on the narrow array keeps the rounding."""
    return materialize(x) if jnp.dtype(x.dtype).itemsize < 4 else x


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_to_blocks(x2d: jax.Array, block_rows: int, block_cols: int) -> jax.Array:
    """Zero-pad a 2-D array so both dims are block multiples (zeros never raise a block amax)."""
    rows, cols = x2d.shape
    pad_rows = round_up(rows, block_rows) - rows
    pad_cols = round_up(cols, block_cols) - cols
    if pad_rows == 0 and pad_cols == 0:
        return x2d
    return jnp.pad(x2d, ((0, pad_rows), (0, pad_cols)))


def split_blocks(x2d: jax.Array, block_rows: int, block_cols: int) -> jax.Array:
    """(R, C) → (R/br, br, C/bc, bc): block (i, j) is [i, :, j, :]. Dims must be multiples."""
    rows, cols = x2d.shape
    return x2d.reshape(rows // block_rows, block_rows, cols // block_cols, block_cols)


def block_amax(x2d: jax.Array, block_rows: int, block_cols: int) -> jax.Array:
    """Per-block amax, shape (R/br, C/bc); NaN-propagating, flush-immune."""
    return amax(split_blocks(x2d, block_rows, block_cols), axis=(1, 3))


def broadcast_block_scale(scale: jax.Array, block_rows: int, block_cols: int) -> jax.Array:
    """(R/br, C/bc) → (R, C): each block's scale repeated over its elements."""
    return jnp.repeat(jnp.repeat(scale, block_rows, axis=0), block_cols, axis=1)


# --- Scale layouts ------------------------------------------------------------------------------
# A copy's per-line block scales, (lines, blocks), are the formats' layout ("lines"). The
# "tiles" layout (docs/design/layouts.md, "GEMM-ready scales") groups them by 128-wide tile of
# the copy: (blocks / blocks_per_tile, lines, blocks_per_tile), each tile's scales contiguous
# for its lines. It is what the MXFP8 and FP8 block 1×128 quantize kernels write and what the
# block-FP8 GEMM reads (a K step's scales for consecutive rows in one row), so a tensor
# quantized for a GEMM skips rearranging them twice.
SCALE_TILE = 128  # elements of a line per tile


def scale_blocks_per_tile(block_cols: int) -> int:
    """Blocks of a line in one 128-wide tile: 4 for MXFP8's 1×32, 1 for FP8 block 1×128."""
    return SCALE_TILE // block_cols


def tile_scales(line_scales: jax.Array, blocks_per_tile: int) -> jax.Array:
    """(..., lines, blocks) → the "tiles" layout (..., blocks / blocks_per_tile, lines,
    blocks_per_tile); leading dims (a stack of experts) are kept."""
    *lead, lines, blocks = line_scales.shape
    if blocks % blocks_per_tile:
        raise ValueError(
            f"line_scales: {blocks} blocks per line is not a whole number of "
            f"{blocks_per_tile}-block tiles"
        )
    split = line_scales.reshape(*lead, lines, blocks // blocks_per_tile, blocks_per_tile)
    return jnp.swapaxes(split, -3, -2)


def untile_scales(tiled_scales: jax.Array) -> jax.Array:
    """The "tiles" layout (..., tiles, lines, blocks_per_tile) → (..., lines, blocks)."""
    *lead, tiles, lines, blocks_per_tile = tiled_scales.shape
    return jnp.swapaxes(tiled_scales, -3, -2).reshape(*lead, lines, tiles * blocks_per_tile)
