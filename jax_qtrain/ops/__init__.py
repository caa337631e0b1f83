"""Differentiable quantized ops (custom_vjp) and the autocast context."""

from jax_qtrain.ops.context import autocast, current_recipe
from jax_qtrain.ops.dense import dense
from jax_qtrain.ops.residuals import (
    FC1_INPUT,
    FC1_KERNEL,
    FC2_INPUT,
    FC2_KERNEL,
    GROUP_SIZES,
    INPUT,
    KERNEL,
    PRE_ACTIVATION,
    PROBS,
    SR_KEY,
    Residual,
    saved_residuals,
)

__all__ = [
    "FC1_INPUT",
    "FC1_KERNEL",
    "FC2_INPUT",
    "FC2_KERNEL",
    "GROUP_SIZES",
    "INPUT",
    "KERNEL",
    "PRE_ACTIVATION",
    "PROBS",
    "SR_KEY",
    "Residual",
    "autocast",
    "current_recipe",
    "dense",
    "saved_residuals",
]
