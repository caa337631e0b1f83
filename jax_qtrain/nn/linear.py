"""`jax_qtrain.nn.Linear`: a drop-in for `flax.nnx.Linear` that quantizes with a recipe."""

from __future__ import annotations

import jax
from flax import nnx

from jax_qtrain.ops.dense import dense
from jax_qtrain.recipes import Recipe


class Linear(nnx.Linear):
    """`nnx.Linear` (same arguments) plus:

    Args:
      recipe: this layer's quantization recipe. None follows `jax_qtrain.autocast` (and runs in
        high precision outside it); a recipe given here wins over autocast, so an MXFP8 layer
        stays MXFP8 inside an NVFP4 autocast.
      save_original_input: see `jax_qtrain.dense`.

    `dtype` is the compute dtype (inputs and kernel are promoted to it, as in nnx.Linear),
    `param_dtype` the dtype of the stored parameters. The layer calls `jax_qtrain.dense`, whose
    custom_vjp decides what is saved for backward.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        recipe: Recipe | None = None,
        save_original_input: bool = False,
        **kwargs,
    ):
        if recipe is not None and not isinstance(recipe, Recipe):
            raise TypeError(
                f"recipe must be a jax_qtrain recipe or None, got {type(recipe).__name__}"
            )
        if "dot_general" in kwargs and kwargs["dot_general"] is not None:
            raise ValueError(
                "jax_qtrain.nn.Linear computes with jax_qtrain.dense; drop dot_general"
            )
        super().__init__(in_features, out_features, **kwargs)
        self.recipe = recipe
        self.save_original_input = save_original_input

    def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
        del out_sharding
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        y = dense(
            inputs,
            kernel,
            bias,
            recipe=self.recipe,
            save_original_input=self.save_original_input,
        )
        if self.preferred_element_type is not None:
            y = y.astype(self.preferred_element_type)
        return y
