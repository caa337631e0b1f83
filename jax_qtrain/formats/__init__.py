"""Bit-exact jnp references of TransformerEngine's quantization formats, one module each.

These are the single source of truth for the numerics: the Pallas kernels are tested bit for
bit against them, and `jax_qtrain.quantize` falls back to them wherever no kernel applies.
"""

from jax_qtrain.formats import common, fp8_block, fp8_tensor, mxfp8, nvfp4
from jax_qtrain.formats.spec import FORMAT_NAMES, QuantizerSpec

__all__ = [
    "FORMAT_NAMES",
    "QuantizerSpec",
    "common",
    "fp8_block",
    "fp8_tensor",
    "mxfp8",
    "nvfp4",
]
