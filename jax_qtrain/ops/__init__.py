"""Differentiable quantized ops (custom_vjp) and the autocast context."""

from jax_qtrain.ops.context import autocast, current_recipe
from jax_qtrain.ops.dense import dense
from jax_qtrain.ops.residuals import INPUT, KERNEL, SR_KEY, Residual, saved_residuals

__all__ = [
    "INPUT",
    "KERNEL",
    "SR_KEY",
    "Residual",
    "autocast",
    "current_recipe",
    "dense",
    "saved_residuals",
]
