"""jax_qtrain: TransformerEngine-style quantized training for JAX and Flax NNX."""

from jax_qtrain.formats.spec import QuantizerSpec
from jax_qtrain.quantize import QuantizedTensor, quantize
from jax_qtrain.recipes import (
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
    recipe_from_name,
)

__version__ = "0.1.0"

__all__ = [
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "QuantizedTensor",
    "QuantizerSpec",
    "Recipe",
    "quantize",
    "recipe_from_name",
]
