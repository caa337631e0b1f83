"""jax_qtrain: TransformerEngine-style quantized training for JAX and Flax NNX."""

from jax_qtrain import nn, sharding
from jax_qtrain.formats.spec import QuantizerSpec
from jax_qtrain.nn.dot_general import dot_general, einsum
from jax_qtrain.ops import autocast, current_recipe, dense, saved_residuals
from jax_qtrain.ops.grouped_dense import grouped_dense
from jax_qtrain.ops.grouped_gemm import grouped_matmul
from jax_qtrain.ops.grouped_mlp import grouped_mlp
from jax_qtrain.ops.grouped_quantize import (
    GroupedQuantizedTensor,
    group_layout,
    grouped_quantize,
    quantize_per_expert,
)
from jax_qtrain.quantize import QuantizedTensor, quantize
from jax_qtrain.quantized_weight import (
    QuantizedWeight,
    WeightLayout,
    needed_weight_usages,
    quantize_weight,
)
from jax_qtrain.recipes import (
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
    recipe_from_name,
)
from jax_qtrain.sharding import WeightSharding

__version__ = "0.1.0"

__all__ = [
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "GroupedQuantizedTensor",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "QuantizedTensor",
    "QuantizedWeight",
    "QuantizerSpec",
    "Recipe",
    "WeightLayout",
    "WeightSharding",
    "autocast",
    "current_recipe",
    "dense",
    "dot_general",
    "einsum",
    "group_layout",
    "grouped_dense",
    "grouped_matmul",
    "grouped_mlp",
    "grouped_quantize",
    "needed_weight_usages",
    "nn",
    "quantize",
    "quantize_per_expert",
    "quantize_weight",
    "recipe_from_name",
    "saved_residuals",
    "sharding",
]
