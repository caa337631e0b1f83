"""MXFP8 (TransformerEngine `MXFP8BlockScaling`), numerics.md §3.

Blocks of 32 along the contraction dim; one E8M0 scale byte per block, rounded *up*
("RCEIL", TE's `float_to_e8m0`):
  v = fp32(amax / fp8_max); NaN → 0xFF, Inf → 0xFE, 0 → 0x00
  e = biased exponent of v; if v has mantissa bits, e != 0xFE and not (e == 0 and m <= 2^22): e += 1
  q = sat_RNE(x * 2^(127 - e)); dequantized value = q * 2^(e - 127)
The E8M0 byte is computed with integer operations and stored as uint8 (E8M0 has no zero and
its jnp cast rounds to nearest, numerics.md §6.3; Hopper kernels cannot emit it either).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_qtrain.formats import common
from jax_qtrain.formats.spec import QuantizerSpec

BLOCK_SIZE = 32
_TWO_POW_M63 = np.float32(2.0**-63)
_TWO_POW_M64 = np.float32(2.0**-64)


@functools.cache
def _subnormal_v_thresholds(fp8_max: float) -> tuple[int, int]:
    """Bit patterns of two amax thresholds, found with numpy (which keeps subnormals):

    - `normal_from`: the smallest amax whose v = fp32(amax / fp8_max) is a normal float;
    - `byte_one_from`: the smallest amax whose (subnormal) v exceeds 2^-127, the only case in
      which a subnormal v rounds up to byte 1.

    Below `normal_from`, v is subnormal and XLA:CPU would flush it; comparing amax bits against
    these thresholds gives TransformerEngine's byte (0 or 1) on every platform.
    """
    divisor = np.float32(fp8_max)

    def first_bits_where(predicate) -> int:
        # v = amax / fp8_max is monotone in amax, and so in amax's bits: bisect over them.
        low, high = 0, 0x7F800000
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


def e8m0_from_amax(block_amax: jax.Array, fp8_max: float) -> jax.Array:
    """TransformerEngine's E8M0 scale byte (uint8) for each block amax (float32, >= 0 or NaN)."""
    amax_bits = common.f32_bits(block_amax)
    normal_from, byte_one_from = _subnormal_v_thresholds(fp8_max)
    v_bits = common.f32_bits(common.divide(block_amax, jnp.float32(fp8_max)))
    exponent = (v_bits >> 23) & 0xFF
    mantissa = v_bits & 0x7FFFFF
    round_up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    byte = exponent + round_up.astype(jnp.uint32)
    subnormal_byte = (amax_bits >= byte_one_from).astype(jnp.uint32)
    byte = jnp.where(amax_bits < normal_from, subnormal_byte, byte)
    byte = jnp.where(jnp.isinf(block_amax), jnp.uint32(0xFE), byte)
    byte = jnp.where(jnp.isnan(block_amax), jnp.uint32(0xFF), byte)
    return byte.astype(jnp.uint8)


def _times_pow2(x: jax.Array, exponent: jax.Array) -> jax.Array:
    """x * 2^exponent for integer exponents in [-127, 127]; exponent 128 marks a NaN scale.

    2^-127 is subnormal (flushed to zero by XLA:CPU), so it is applied as 2^-64 then 2^-63.
    Both factors are per-block arrays, not constants, so XLA cannot fold them back into one.
    """
    first = common.f32_from_bits((jnp.clip(exponent, -126, 127) + 127).astype(jnp.uint32) << 23)
    first = jnp.where(exponent == -127, _TWO_POW_M64, first)
    second = jnp.where(exponent == -127, _TWO_POW_M63, jnp.float32(1.0))
    out = (x * first) * second
    return jnp.where(exponent == 128, jnp.float32(jnp.nan), out)


def quantize(x2d: jax.Array, spec: QuantizerSpec) -> tuple[jax.Array, jax.Array]:
    """Rowwise copy of a 2-D array. Returns (codes (R, C') spec.dtype, E8M0 bytes (R, C'/32)
    uint8), C' = C padded to a multiple of 32."""
    padded = common.pad_to_blocks(x2d.astype(jnp.float32), 1, BLOCK_SIZE)
    scale_bytes = e8m0_from_amax(
        common.block_amax(padded, 1, BLOCK_SIZE), common.fp8_max(spec.dtype)
    )
    # Multiplier 2^(127 - e); byte 0xFF (NaN amax) gives NaN codes.
    exponent = 127 - scale_bytes.astype(jnp.int32)
    exponent = jnp.where(scale_bytes == 0xFF, 128, exponent)
    blocks = common.split_blocks(padded, 1, BLOCK_SIZE)
    scaled = _times_pow2(blocks, exponent[:, None, :, None]).reshape(padded.shape)
    return common.saturating_cast(scaled, spec.dtype), scale_bytes


def dequantize(codes: jax.Array, scale_bytes: jax.Array) -> jax.Array:
    """float32 values q * 2^(e - 127) of an MXFP8 copy (padded shape); byte 0xFF gives NaN."""
    exponent = scale_bytes.astype(jnp.int32) - 127
    exponent = jnp.where(scale_bytes == 0xFF, 128, exponent)
    blocks = common.split_blocks(codes.astype(jnp.float32), 1, BLOCK_SIZE)
    return _times_pow2(blocks, exponent[:, None, :, None]).reshape(codes.shape)
