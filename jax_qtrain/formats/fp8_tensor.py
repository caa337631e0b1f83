"""FP8 per-tensor current scaling (TransformerEngine `Float8CurrentScaling`), numerics.md §1.

One float32 scale for the whole tensor, from its amax:
  amax = max(amax, eps); scale = fp8_max / amax (1 if amax is 0, Inf or NaN; FLT_MAX if the
  division overflows); optionally rounded down to a power of two; q = sat_RNE(x * scale);
  scale_inv = fp32(1 / scale); dequantized value = q * scale_inv.
The columnwise copy is the transposed codes with the same scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_qtrain.formats import common
from jax_qtrain.formats.spec import QuantizerSpec


def compute_scale(
    amax: jax.Array,
    fp8_max: float,
    *,
    power_2_scale: bool,
    amax_epsilon: float,
    overflow_scale: float = common.FLT_MAX,
) -> jax.Array:
    """TransformerEngine's `compute_scale_from_amax`, elementwise over `amax` (float32).

    `overflow_scale` replaces a scale that overflowed to Inf: FLT_MAX for per-tensor scaling,
    the input dtype's max for FP8 block scaling (`compute_scale_from_types`).
    """
    amax = amax.astype(jnp.float32)
    if amax_epsilon > 0:
        amax = jnp.maximum(amax, jnp.float32(amax_epsilon))
    scale = common.divide(jnp.float32(fp8_max), amax)
    scale = jnp.where(jnp.isinf(scale), jnp.float32(overflow_scale), scale)
    degenerate = common.is_zero(amax) | jnp.isinf(amax) | jnp.isnan(amax)
    scale = jnp.where(degenerate, jnp.float32(1.0), scale)
    if power_2_scale:
        scale = common.round_down_to_pow2(scale)
    return scale


def reciprocal_scale(scale: jax.Array, *, power_2_scale: bool) -> jax.Array:
    """scale_inv = fp32(1/scale); exact from bits when the scale is a power of two."""
    if power_2_scale:
        return common.pow2_reciprocal(scale)
    return common.divide(jnp.float32(1.0), scale)


def quantize(
    x2d: jax.Array, spec: QuantizerSpec, *, tensor_amax: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Quantize a 2-D array with one scale. Returns (codes (R, C) spec.dtype, scale_inv () f32).

    `tensor_amax` is passed in (not recomputed) so a sharded caller can reduce it across devices
    first; `jax_qtrain.quantize` computes it as `common.amax(x)`.
    """
    scale = compute_scale(
        tensor_amax,
        common.fp8_max(spec.dtype),
        power_2_scale=spec.power_2_scale,
        amax_epsilon=spec.amax_epsilon,
    )
    codes = common.saturating_cast(scaled_values(x2d, scale), spec.dtype)
    return codes, reciprocal_scale(scale, power_2_scale=spec.power_2_scale)


def scaled_values(x2d: jax.Array, scale: jax.Array) -> jax.Array:
    """float32 x · scale, the values the saturating cast rounds to codes (the cast-transpose
    kernel takes them from here)."""
    return x2d.astype(jnp.float32) * scale


def dequantize(codes: jax.Array, scale_inv: jax.Array) -> jax.Array:
    """float32 values of a per-tensor FP8 copy."""
    return codes.astype(jnp.float32) * scale_inv
