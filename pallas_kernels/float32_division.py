"""IEEE float32 division from integer operations, for the scale rules of every format.

TransformerEngine computes its scales with CUDA's IEEE division (round to nearest even,
subnormals kept). Neither of our two compilers gives that for float32 `/`: XLA:GPU emits an
approximate division (up to 3 ulp off, measured on the H200 with jax 0.11.2) and XLA:CPU, which
also runs the Pallas interpreter, flushes subnormal results to zero. So the quotient of the
significands is found by long division on uint32 and rounded once; every platform then gives the
same bits.

The long division takes 8 quotient bits per step with uint32 integer division (four steps, no
loop). (Earlier versions, measured on the H200 and the CPU on 2026-11-29: one bit per step in a
27-step `fori_loop` made the per-tensor FP8 dense forward 2.3 ms instead of 0.6 ms, since XLA runs
such a loop one iteration at a time, and the NVFP4 quantize kernel 2-4x slower; unrolled, its 27
dependent steps took XLA:CPU minutes to compile; digits estimated with a float division and
corrected in uint32 compiled 1.5x slower than the loop.)

The code uses only elementwise jnp/lax operations, which both XLA and Mosaic GPU lower (shifts,
unsigned compares and divisions, selects, clz), so the jnp references (jax_qtrain.formats) and
the kernels in this package call this one function. It costs four uint32 divisions and about 50
other operations per quotient: use it for per-block and per-tensor scales, never per element.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_SIGN = 0x80000000
_ABS = 0x7FFFFFFF
_INF = 0x7F800000
_QUIET_NAN = 0x7FC00000
_ONE = 0x3F800000


def _bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.uint32)


def _unpack_finite(x_bits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(significand in [2^23, 2^24), exponent e) with |x| = significand · 2^(e - 150), for a
    finite nonzero float32 given as bits; subnormals are normalized with a leading-zero count."""
    field = (x_bits >> 23).astype(jnp.int32) & 0xFF
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


# After the leading bit, the 26 fractional bits of the significand quotient, in digits of these
# widths: a remainder below 2^24 shifted by at most 8 bits still fits a uint32.
_DIGIT_BITS = (8, 8, 8, 2)


def _significand_quotient(a_sig: jax.Array, b_sig: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(floor(a_sig · 2^26 / b_sig), whether a nonzero remainder was dropped) for significands
    in [2^23, 2^24): the 27 bits restoring long division would give one at a time, here 8 at a
    time with uint32 integer division, which every platform computes exactly."""
    leading = a_sig >= b_sig  # the ratio is in (1/2, 2)
    remainder = jnp.where(leading, a_sig - b_sig, a_sig)
    quotient = leading.astype(jnp.uint32)
    for bits in _DIGIT_BITS:
        shifted = remainder << bits
        digit = lax.div(shifted, b_sig)
        remainder = shifted - digit * b_sig
        quotient = (quotient << bits) | digit
    return quotient, remainder != 0


def divide(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """numerator / denominator in float32, correctly rounded (IEEE 754, subnormals kept).

    Operands broadcast through the elementwise operations (no explicit broadcast, which some
    kernel layouts cannot take), so a scalar constant over an array of scales is fine.
    """
    numerator = jnp.asarray(numerator, jnp.float32)
    denominator = jnp.asarray(denominator, jnp.float32)
    a_bits, b_bits = _bits(numerator), _bits(denominator)
    sign = (a_bits ^ b_bits) & jnp.uint32(_SIGN)
    a_abs, b_abs = a_bits & jnp.uint32(_ABS), b_bits & jnp.uint32(_ABS)

    def finite_nonzero(bits):  # zero, Inf and NaN are resolved at the end
        return jnp.where((bits == 0) | (bits >= jnp.uint32(_INF)), jnp.uint32(_ONE), bits)

    a_sig, a_exp = _unpack_finite(finite_nonzero(a_abs))
    b_sig, b_exp = _unpack_finite(finite_nonzero(b_abs))

    quotient, sticky = _significand_quotient(a_sig, b_sig)
    wide = quotient >= jnp.uint32(1 << 26)  # a_sig >= b_sig: the ratio is in [1, 2)
    shift = jnp.where(wide, 3, 2)
    biased_exponent = a_exp - b_exp + 127 - jnp.where(wide, 0, 1)
    # Subnormal results shift further right before the single rounding.
    total_shift = jnp.clip(shift + jnp.maximum(0, 1 - biased_exponent), 1, 31)
    rounded = _round_right_shift(quotient, sticky, total_shift)
    normal_bits = ((jnp.maximum(biased_exponent, 1) - 1).astype(jnp.uint32) << 23) + rounded
    magnitude = jnp.where(biased_exponent >= 1, normal_bits, rounded)
    overflow = (biased_exponent >= 255) | (magnitude >= jnp.uint32(_INF))
    magnitude = jnp.where(overflow, jnp.uint32(_INF), magnitude)

    a_nan, b_nan = a_abs > jnp.uint32(_INF), b_abs > jnp.uint32(_INF)
    a_inf, b_inf = a_abs == jnp.uint32(_INF), b_abs == jnp.uint32(_INF)
    a_zero, b_zero = a_abs == 0, b_abs == 0
    magnitude = jnp.where(a_zero | b_inf, jnp.uint32(0), magnitude)
    magnitude = jnp.where(a_inf | b_zero, jnp.uint32(_INF), magnitude)
    nan = a_nan | b_nan | (a_zero & b_zero) | (a_inf & b_inf)
    out = jnp.where(nan, jnp.uint32(_QUIET_NAN), sign | magnitude)
    return lax.bitcast_convert_type(out, jnp.float32)
