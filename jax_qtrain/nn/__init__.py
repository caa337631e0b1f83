"""Flax NNX layers built on jax_qtrain's quantized ops."""

from jax_qtrain.nn.dot_general import QuantizedDotGeneral, dot_general, einsum
from jax_qtrain.nn.grouped import GroupedLinear, GroupedMLP
from jax_qtrain.nn.linear import Linear
from jax_qtrain.nn.moe import MoE
from jax_qtrain.nn.quantized_weights import (
    Optimizer,
    QuantizedKernel,
    QuantizedWeightLayer,
    refresh_quantized_weights,
)

__all__ = [
    "GroupedLinear",
    "GroupedMLP",
    "Linear",
    "MoE",
    "Optimizer",
    "QuantizedDotGeneral",
    "QuantizedKernel",
    "QuantizedWeightLayer",
    "dot_general",
    "einsum",
    "refresh_quantized_weights",
]
