"""`jax_qtrain.nn.Linear`: a drop-in for `flax.nnx.Linear` that quantizes with a recipe."""

from __future__ import annotations

import numbers
from collections.abc import Iterable

import jax
import jax.numpy as jnp
from flax import nnx

from jax_qtrain.nn.quantized_weights import QuantizedKernel
from jax_qtrain.ops.dense import dense
from jax_qtrain.quantize import Usage
from jax_qtrain.recipes import Recipe, check_recipe


def check_positive_sizes(**sizes) -> None:
    """Each keyword's value must be a positive integer (a layer's feature or group counts):
    Python or numpy ints, not bools or floats."""
    for name, value in sizes.items():
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


class Linear(nnx.Linear):
    """`nnx.Linear` (same arguments) plus:

    Args:
      recipe: this layer's quantization recipe. None follows `jax_qtrain.autocast` (and runs in
        high precision outside it); a recipe given here wins over autocast, so an MXFP8 layer
        stays MXFP8 inside an NVFP4 autocast.
      save_original_input: see `jax_qtrain.dense`.
      quantized_weight: keep the kernel's quantized form in `self.quantized_kernel` (a
        `QuantizedKernel` variable, docs/quantized_weights.md) and compute with it instead of
        quantizing the kernel in every call. Needs `recipe`. The quantized form is made from the
        kernel cast to `dtype` (`param_dtype` when `dtype` is None) and must be rebuilt after
        every optimizer update: use `jax_qtrain.nn.Optimizer`, or call
        `jax_qtrain.nn.refresh_quantized_weights(model)` after `nnx.Optimizer.update`.
      keep_master_weight: with `quantized_weight`, keep the high-precision `kernel` param (the
        default: it is trained and the quantized form follows it). False drops it after
        quantizing: `kernel` is None, the weight is frozen (no gradient) and the layer holds
        only the quantized copies; inputs still get gradients.
      quantized_weight_usages: the copies to keep (default: what training with `recipe` reads,
        `jax_qtrain.needed_weight_usages`). ("columnwise",) is enough for inference; usages are
        only ever added later (`refresh_quantized_weight(add_usages=...)`, which needs the
        master).

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
        quantized_weight: bool = False,
        keep_master_weight: bool = True,
        quantized_weight_usages: Iterable[Usage] | None = None,
        **kwargs,
    ):
        check_positive_sizes(in_features=in_features, out_features=out_features)
        check_recipe(recipe)
        if "dot_general" in kwargs and kwargs["dot_general"] is not None:
            raise ValueError(
                "jax_qtrain.nn.Linear computes with jax_qtrain.dense; drop dot_general"
            )
        _check_quantized_weight_options(
            recipe, quantized_weight, keep_master_weight, quantized_weight_usages
        )
        super().__init__(in_features, out_features, **kwargs)
        self.recipe = recipe
        self.save_original_input = save_original_input
        quantized_kernel = None
        if quantized_weight:
            weight_dtype = self.dtype if self.dtype is not None else self.param_dtype
            quantized_kernel = QuantizedKernel.of(
                self.kernel[...].astype(weight_dtype),
                recipe,
                quantized_weight_usages,
                layout=self._kept_weight_layout(),
            )
            if not keep_master_weight:
                self.kernel = None
        self.quantized_kernel = quantized_kernel

    def _kept_weight_layout(self):
        """Where the kept quantized kernel lives (None: wherever XLA puts it); a layer whose
        kernel is split over devices keeps its quantized copies split alike."""
        return None

    def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
        del out_sharding
        if self.quantized_kernel is not None:
            y = self._call_quantized_kernel(inputs)
        else:
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

    def _call_quantized_kernel(self, inputs: jax.Array) -> jax.Array:
        """The forward on the kept quantized weight; the gradient flows to `kernel` if kept."""
        inputs, kernel, bias, quantized = self._kept_weight_operands(inputs)
        return dense(
            inputs,
            kernel,
            bias,
            recipe=self.recipe,
            save_original_input=self.save_original_input,
            quantized_kernel=quantized,
        )

    def _kept_weight_operands(self, inputs: jax.Array):
        """(inputs, kernel or None, bias, kept QuantizedWeight) for a call on the kept weight.

        Inputs and bias are promoted as nnx.Linear promotes them; the kernel is passed in the
        dtype its quantized form was made from.
        """
        quantized = self.quantized_kernel.get_value()
        bias = self.bias[...] if self.bias is not None else None
        compute_dtype = self.dtype
        if compute_dtype is None:
            compute_dtype = jnp.result_type(
                inputs, quantized.dtype, *(() if bias is None else (bias,))
            )
        inputs, bias = self.promote_dtype((inputs, bias), dtype=compute_dtype)
        kernel = None if self.kernel is None else self.kernel[...].astype(quantized.dtype)
        return inputs, kernel, bias, quantized

    def refresh_quantized_weight(self, add_usages: Iterable[Usage] = ()) -> None:
        """Rebuild the quantized kernel from `kernel` for every usage it holds plus
        `add_usages` (`QuantizedWeight.refresh`). Without a master the weight is frozen: nothing
        to rebuild, and adding a usage it does not hold is a ValueError."""
        if self.quantized_kernel is None:
            return
        quantized = self.quantized_kernel.get_value()
        add_usages = (add_usages,) if isinstance(add_usages, str) else tuple(add_usages)
        if self.kernel is None:
            missing = [u for u in add_usages if not quantized.has_usage(u)]
            if missing:
                raise ValueError(
                    f"add_usages={missing}: this layer keeps no master weight "
                    "(keep_master_weight=False) to quantize a new copy from; a copy derived "
                    "from another quantized copy would not be the weight's"
                )
            return
        self.quantized_kernel.refresh(self.kernel[...], add_usages=add_usages)


def _check_quantized_weight_options(
    recipe: Recipe | None,
    quantized_weight: bool,
    keep_master_weight: bool,
    quantized_weight_usages: Iterable[Usage] | None,
) -> None:
    for name, flag in (
        ("quantized_weight", quantized_weight),
        ("keep_master_weight", keep_master_weight),
    ):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    if not quantized_weight:
        if not keep_master_weight or quantized_weight_usages is not None:
            raise ValueError(
                "keep_master_weight and quantized_weight_usages apply only with "
                "quantized_weight=True"
            )
        return
    if recipe is None:
        raise ValueError(
            "quantized_weight=True needs recipe=: the weight is quantized once, ahead of the "
            "calls, so it cannot follow jax_qtrain.autocast"
        )  # (checked before nnx.Linear draws the kernel)
    if not keep_master_weight and recipe.backward_override == "high_precision":
        raise ValueError(
            'keep_master_weight=False with backward_override="high_precision": that backward '
            "reads the high-precision kernel, which would not be kept"
        )
