"""FP8 block scaling (TransformerEngine `Float8BlockScaling`, DeepSeek-V3 style), numerics.md §2.

Blocks of 1×128 (activations, gradients) or 128×128 (weights); per block, the per-tensor rule of
§1 (`fp8_tensor.compute_scale`) with one difference: a scale that overflows becomes the *input
dtype's* max (bf16 3.3895314e38, fp32 FLT_MAX), i.e. 2^127 with power-of-2 scales, which are the
default. scale_inv is stored as float32, one per block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_qtrain.formats import common, fp8_tensor
from jax_qtrain.formats.spec import QuantizerSpec


def quantize(
    x2d: jax.Array, spec: QuantizerSpec, *, input_dtype: jnp.dtype
) -> tuple[jax.Array, jax.Array]:
    """Rowwise copy of a 2-D array. Returns (codes (R', C') spec.dtype, scale_inv (R'/br, C'/bc)
    float32), with R', C' the block-padded dims."""
    block_rows, block_cols = spec.block_shape
    padded = common.pad_to_blocks(x2d.astype(jnp.float32), block_rows, block_cols)
    scale = fp8_tensor.compute_scale(
        common.block_amax(padded, block_rows, block_cols),
        common.fp8_max(spec.dtype),
        power_2_scale=spec.power_2_scale,
        amax_epsilon=spec.amax_epsilon,
        overflow_scale=common.input_dtype_max(input_dtype),
    )
    blocks = common.split_blocks(padded, block_rows, block_cols)
    scaled = (blocks * scale[:, None, :, None]).reshape(padded.shape)
    codes = common.saturating_cast(scaled, spec.dtype)
    return codes, fp8_tensor.reciprocal_scale(scale, power_2_scale=spec.power_2_scale)


def dequantize(codes: jax.Array, scale_inv: jax.Array, spec: QuantizerSpec) -> jax.Array:
    """float32 values of a block-scaled copy (padded shape)."""
    block_rows, block_cols = spec.block_shape
    blocks = common.split_blocks(codes.astype(jnp.float32), block_rows, block_cols)
    return (blocks * scale_inv[:, None, :, None]).reshape(codes.shape)
