"""Flax NNX layers built on jax_qtrain's quantized ops."""

from jax_qtrain.nn.dot_general import QuantizedDotGeneral, dot_general, einsum
from jax_qtrain.nn.linear import Linear

__all__ = ["Linear", "QuantizedDotGeneral", "dot_general", "einsum"]
