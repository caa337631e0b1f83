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


def _unpack_finite(x_bits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(significand in [2^23, 2^24), exponent e) with |x| = significand · 2^(e - 150), for a
    finite nonzero float32 given as bits; subnormals are normalized with a leading-zero count."""
    field = ((x_bits >> 23) & 0xFF).astype(jnp.int32)
    fraction = x_bits & jnp.uint32(0x7FFFFF)
    shift = jnp.where(field == 0, lax.clz(fraction).astype(jnp.int32) - 8, 0)
    significand = jnp.where(
        field == 0, fraction << shift.astype(jnp.uint32), fraction | jnp.uint32(0x800000)
    )
    return significand, jnp.where(field == 0, 1 - shift, field)


def _round_right_shift(value: jax.Array, sticky: jax.Array, shift: jax.Array) -> jax.Array:
    """Round-to-nearest-even of value / 2^shift (uint32), `sticky` marking nonzero bits already
    below value's last bit; shift in [1, 31]."""
    shift_u = shift.astype(jnp.uint32)
    kept = value >> shift_u
    dropped = value & ((jnp.uint32(1) << shift_u) - 1)
    half = jnp.uint32(1) << (shift_u - 1)
    round_up = (dropped > half) | ((dropped == half) & (sticky | ((kept & 1) == 1)))
    return kept + round_up.astype(jnp.uint32)


def divide(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """IEEE float32 division (round to nearest even, subnormals kept) from integer operations.

    XLA:GPU compiles float32 `/` to an approximate division (up to 3 ulp off, measured on the
    H200 with jax 0.11.2) and XLA:CPU flushes subnormal results, while TransformerEngine's
    scale rules are IEEE divisions. The quotient of the significands is found by 27 steps of
    restoring long division on uint32, then rounded once, so every platform gives the same bits.
    Used for per-block and per-tensor scales (never per element).
    """
    a, b = jnp.broadcast_arrays(
        jnp.asarray(numerator, jnp.float32), jnp.asarray(denominator, jnp.float32)
    )
    a_bits, b_bits = f32_bits(a), f32_bits(b)
    sign = (a_bits ^ b_bits) & jnp.uint32(0x80000000)
    a_abs, b_abs = a_bits & jnp.uint32(0x7FFFFFFF), b_bits & jnp.uint32(0x7FFFFFFF)
    safe = lambda bits: jnp.where((bits == 0) | (bits >= 0x7F800000), jnp.uint32(0x3F800000), bits)
    a_sig, a_exp = _unpack_finite(safe(a_abs))
    b_sig, b_exp = _unpack_finite(safe(b_abs))

    def long_division_step(_, state):
        quotient, remainder = state
        bit = remainder >= b_sig
        remainder = jnp.where(bit, remainder - b_sig, remainder) << 1
        return (quotient << 1) | bit.astype(jnp.uint32), remainder

    # quotient = floor(a_sig / b_sig · 2^26): 26 or 27 bits. A loop, not 27 unrolled steps, to
    # keep the compiled program small.
    quotient, remainder = lax.fori_loop(0, 27, long_division_step, (jnp.zeros_like(a_sig), a_sig))
    sticky = remainder != 0
    wide = quotient >= (jnp.uint32(1) << 26)  # a_sig >= b_sig: the ratio is in [1, 2)
    shift = jnp.where(wide, 3, 2)
    biased_exponent = a_exp - b_exp + 127 - jnp.where(wide, 0, 1)
    # Subnormal results shift further right before the single rounding.
    total_shift = jnp.clip(shift + jnp.maximum(0, 1 - biased_exponent), 1, 31)
    rounded = _round_right_shift(quotient, sticky, total_shift)
    normal_bits = ((jnp.maximum(biased_exponent, 1) - 1).astype(jnp.uint32) << 23) + rounded
    magnitude = jnp.where(biased_exponent >= 1, normal_bits, rounded)
    magnitude = jnp.where(
        (biased_exponent >= 255) | (magnitude >= 0x7F800000), jnp.uint32(0x7F800000), magnitude
    )

    a_nan, b_nan = a_abs > 0x7F800000, b_abs > 0x7F800000
    a_inf, b_inf = a_abs == 0x7F800000, b_abs == 0x7F800000
    a_zero, b_zero = a_abs == 0, b_abs == 0
    magnitude = jnp.where(a_zero | b_inf, jnp.uint32(0), magnitude)
    magnitude = jnp.where(a_inf | b_zero, jnp.uint32(0x7F800000), magnitude)
    nan = a_nan | b_nan | (a_zero & b_zero) | (a_inf & b_inf)
    out = jnp.where(nan, jnp.uint32(0x7FC00000), sign | magnitude)
    return f32_from_bits(out)


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
