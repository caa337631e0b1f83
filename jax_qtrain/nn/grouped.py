"""`GroupedLinear` and `GroupedMLP`: Flax NNX layers for MoE experts on jax_qtrain's grouped ops.

Both take activations whose rows are sorted by expert plus `group_sizes` (G,) int32 (see
`jax_qtrain.nn.MoE` for the routing that produces them). A layer's `recipe` is static config: a
layer built with `MXFP8BlockScaling()` stays MXFP8 inside an NVFP4 `autocast`, and its backward
uses the recipe of its own forward (it is a nondiff argument of the op's custom_vjp).

With `quantized_weight=True` a layer keeps its experts' quantized copies (per expert) in
`QuantizedKernel` variables next to the kernels and computes with them; they are rebuilt by
`jax_qtrain.nn.Optimizer.update` / `refresh_quantized_weights` (docs/quantized_weights.md).
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from jax_qtrain.nn.linear import check_positive_sizes
from jax_qtrain.nn.quantized_weights import QuantizedKernel
from jax_qtrain.ops.activations import check_activation, is_gated
from jax_qtrain.ops.grouped_dense import grouped_dense
from jax_qtrain.ops.grouped_mlp import grouped_mlp
from jax_qtrain.quantize import Usage
from jax_qtrain.quantized_weight import WeightLayout
from jax_qtrain.recipes import Recipe, check_recipe

# lecun_normal per expert: fan-in is the expert's in_features, not G·in_features.
default_expert_kernel_init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=0)
default_bias_init = nnx.initializers.zeros_init()


def keep_quantized(
    kernel: jax.Array,
    recipe: Recipe | None,
    dtype,
    quantized_weight: bool,
    layout: WeightLayout | None = None,
):
    """The kept QuantizedKernel of a (G, in, out) kernel (cast to the compute dtype), or None.
    `layout`: how the copies are split over devices (jax_qtrain.sharding.ShardedMoE)."""
    if not isinstance(quantized_weight, bool):
        raise TypeError(f"quantized_weight must be a bool, got {quantized_weight!r}")
    if not quantized_weight:
        return None
    kernel = kernel if dtype is None else kernel.astype(dtype)
    return QuantizedKernel.of(kernel, recipe, layout=layout)


def refresh_mlp_kernels(mlp: nnx.Module, add_usages: Iterable[Usage] = ()) -> None:
    """Rebuild an expert MLP's kept `quantized_fc{1,2}_kernel` from `fc{1,2}_kernel`."""
    for name in ("fc1", "fc2"):
        variable = getattr(mlp, f"quantized_{name}_kernel")
        if variable is not None:
            variable.refresh(getattr(mlp, f"{name}_kernel")[...], add_usages=add_usages)


def _kept_value(variable: QuantizedKernel | None, kernel: jax.Array):
    """(kernel in the kept copies' dtype, the kept QuantizedWeight) or (kernel, None)."""
    if variable is None:
        return kernel, None
    quantized = variable.get_value()
    return kernel.astype(quantized.dtype), quantized


class GroupedLinear(nnx.Module):
    """G linear layers applied to the row groups of one input (TE's `GroupedLinear`).

    Args:
      num_groups, in_features, out_features: kernel (G, in, out), bias (G, out).
      use_bias: add a per-group bias (default True, as TE).
      dtype: compute dtype (inputs and parameters are promoted to it); None promotes.
      param_dtype: dtype of the stored parameters.
      kernel_init, bias_init: initializers of the (G, in, out) kernel and (G, out) bias.
      recipe: this layer's recipe; None follows `jax_qtrain.autocast`.
      save_original_input: see `jax_qtrain.grouped_dense`.
      quantized_weight: keep the experts' quantized copies in `self.quantized_kernel` (needs
        `recipe`; docs/quantized_weights.md).
      rngs: the parameter RNG stream.

    Call: `layer(x, group_sizes, key=None)` with x (M, in_features) sorted by group.
    """

    def __init__(
        self,
        num_groups: int,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        dtype=None,
        param_dtype=jnp.float32,
        kernel_init=default_expert_kernel_init,
        bias_init=default_bias_init,
        recipe: Recipe | None = None,
        save_original_input: bool = False,
        quantized_weight: bool = False,
        rngs: nnx.Rngs,
    ):
        check_positive_sizes(
            num_groups=num_groups, in_features=in_features, out_features=out_features
        )
        check_recipe(recipe)
        self.kernel = nnx.Param(
            kernel_init(rngs.params(), (num_groups, in_features, out_features), param_dtype)
        )
        self.bias: nnx.Param | None
        if use_bias:
            self.bias = nnx.Param(bias_init(rngs.params(), (num_groups, out_features), param_dtype))
        else:
            self.bias = nnx.data(None)
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.recipe = recipe
        self.save_original_input = save_original_input
        self.quantized_kernel = keep_quantized(self.kernel[...], recipe, dtype, quantized_weight)

    def __call__(
        self, x: jax.Array, group_sizes: jax.Array, *, key: jax.Array | None = None
    ) -> jax.Array:
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        x, kernel, bias = dtypes.promote_dtype((x, kernel, bias), dtype=self.dtype)
        kernel, quantized = _kept_value(self.quantized_kernel, kernel)
        return grouped_dense(
            x,
            kernel,
            group_sizes,
            bias,
            recipe=self.recipe,
            save_original_input=self.save_original_input,
            key=key,
            quantized_kernels=quantized,
        )

    def refresh_quantized_weight(self, add_usages: Iterable[Usage] = ()) -> None:
        """Rebuild the kept quantized copies from `kernel` (jax_qtrain.nn.QuantizedWeightLayer)."""
        if self.quantized_kernel is not None:
            self.quantized_kernel.refresh(self.kernel[...], add_usages=add_usages)


class GroupedMLP(nnx.Module):
    """The MoE expert block as one fused op (`jax_qtrain.grouped_mlp`): per expert
    FC1 → activation × router probabilities → FC2, no biases.

    Args:
      num_experts, in_features, ffn_features: fc1_kernel (G, in, 2·ffn) for gated activations
        ((G, in, ffn) for plain ones), fc2_kernel (G, ffn, out).
      out_features: default in_features.
      activation: see `jax_qtrain.grouped_mlp` (default "swiglu").
      dtype, param_dtype, kernel_init, recipe, save_original_input, quantized_weight, rngs: as
        GroupedLinear (the kept copies: `quantized_fc1_kernel`, `quantized_fc2_kernel`).

    Call: `mlp(x, group_sizes, probs=None, key=None)`; probs (M,) scale each row before FC2.
    """

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        ffn_features: int,
        *,
        out_features: int | None = None,
        activation: str = "swiglu",
        dtype=None,
        param_dtype=jnp.float32,
        kernel_init=default_expert_kernel_init,
        recipe: Recipe | None = None,
        save_original_input: bool = False,
        quantized_weight: bool = False,
        rngs: nnx.Rngs,
    ):
        out_features = in_features if out_features is None else out_features
        check_positive_sizes(
            num_experts=num_experts,
            in_features=in_features,
            ffn_features=ffn_features,
            out_features=out_features,
        )
        check_activation(activation)
        check_recipe(recipe)
        fc1_out = 2 * ffn_features if is_gated(activation) else ffn_features
        self.fc1_kernel = nnx.Param(
            kernel_init(rngs.params(), (num_experts, in_features, fc1_out), param_dtype)
        )
        self.fc2_kernel = nnx.Param(
            kernel_init(rngs.params(), (num_experts, ffn_features, out_features), param_dtype)
        )
        self.num_experts, self.in_features = num_experts, in_features
        self.ffn_features, self.out_features = ffn_features, out_features
        self.activation = activation
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.recipe = recipe
        self.save_original_input = save_original_input
        fc1, fc2 = self.fc1_kernel[...], self.fc2_kernel[...]
        self.quantized_fc1_kernel = keep_quantized(fc1, recipe, dtype, quantized_weight)
        self.quantized_fc2_kernel = keep_quantized(fc2, recipe, dtype, quantized_weight)

    def __call__(
        self,
        x: jax.Array,
        group_sizes: jax.Array,
        probs: jax.Array | None = None,
        *,
        key: jax.Array | None = None,
    ) -> jax.Array:
        x, fc1, fc2 = dtypes.promote_dtype(
            (x, self.fc1_kernel[...], self.fc2_kernel[...]), dtype=self.dtype
        )
        fc1, quantized_fc1 = _kept_value(self.quantized_fc1_kernel, fc1)
        fc2, quantized_fc2 = _kept_value(self.quantized_fc2_kernel, fc2)
        return grouped_mlp(
            x,
            fc1,
            fc2,
            group_sizes,
            probs,
            self.activation,
            recipe=self.recipe,
            save_original_input=self.save_original_input,
            key=key,
            quantized_fc1=quantized_fc1,
            quantized_fc2=quantized_fc2,
        )

    def refresh_quantized_weight(self, add_usages: Iterable[Usage] = ()) -> None:
        """Rebuild the kept quantized copies from fc1 and fc2 (nn.QuantizedWeightLayer)."""
        refresh_mlp_kernels(self, add_usages)
