"""MoE expert layers whose expert kernels are split over a mesh axis (FSDP over the experts).

`fsdp_grouped_dense` and `fsdp_grouped_mlp` run inside `jax.shard_map` on one device's tokens
(rows sorted by expert, with this device's `group_sizes`) and its shard of the (G, K, N) expert
kernels — split by expert (`kernel_dim="experts"`: each device holds G/P whole experts) or along
every expert's K (0) or N (1). Per device they are `jax_qtrain.grouped_dense` /
`jax_qtrain.grouped_mlp` (ops/grouped_dense.py, ops/grouped_mlp.py: the same stages, modes and
named residuals) with the experts gathered:

  forward   gather each expert kernel's fprop copy (strategy: quantized shards, each expert with
            its own amax max-reduced over the axis, or raw shards then quantize per expert).
            Saved for backward: what the unsharded op saves for the activations, and this
            device's *shards* of the kernels (raw, or with quantize_then_gather their quantized
            copy backward gathers), never the gathered experts.
  backward  re-gather the copies backward reads; the float32 expert gradients of the local
            rows are reduce-scattered over the axis (summed over the other batch axes); bias
            gradients are summed over the batch axes.

Tokens are data-parallel: a device's rows of an expert are quantized as one group, as
TransformerEngine's data-parallel ranks quantize their own activations. So y and dx on a device
are bit for bit the unsharded op's on that device's rows with the whole kernels, and the weight
gradients are the sums over devices of the unsharded op's (up to float32 summation order).
(Dense layers, jax_qtrain.sharding.dense, instead reduce activation amaxes over the batch
axes: there every row is one tensor's, so the sharded layer can equal the unsharded one on the
whole batch; an expert's rows are spread over the devices by routing, and its token-direction
blocks could not be kept whole.)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jax_qtrain.ops import residuals as names
from jax_qtrain.ops.activations import check_activation, scaled_activation
from jax_qtrain.ops.context import resolve_recipe
from jax_qtrain.ops.dense import effective_save_original_input, rounded_once
from jax_qtrain.ops.grouped_dense import (
    backward_gemms,
    check_float,
    forward_operands,
    group_bias_grad,
    group_bias_rows,
    quantized_fprop,
)
from jax_qtrain.ops.grouped_gemm import ragged_nn, ragged_nt, ragged_tn
from jax_qtrain.ops.grouped_mlp import stage_keys
from jax_qtrain.ops.grouped_quantize import (
    check_group_sizes,
    clamp_group_sizes,
    group_layout,
    token_alignment,
)
from jax_qtrain.quantize import QuantizedTensor
from jax_qtrain.recipes import Recipe

from . import reductions
from .config import (
    DEFAULT_STRATEGY,
    GATHER_THEN_QUANTIZE,
    Strategy,
    check_kernel_dim,
    check_strategy,
    normalize_axes,
)
from .gather import Split
from .sharded_dense import check_kept_shard, saved_input_operand


@dataclasses.dataclass(frozen=True)
class _ExpertsConfig:
    """Static configuration of one call (a nondiff argument of the custom_vjps)."""

    recipe: Recipe | None  # None: unquantized
    save_original_input: bool  # after the override forced it
    strategy: Strategy
    axis_name: str
    kernel_dim: int | str
    batch_axis_names: tuple[str, ...]
    deterministic: bool  # sum cross-device float partials in mesh order (reductions.py)
    x_dtype: np.dtype
    kernel_dtype: np.dtype  # of every expert kernel (fc1 and fc2 in the MLP)
    bias_dtype: np.dtype | None = None
    activation: str | None = None  # the MLP's

    @property
    def mode(self) -> str | None:
        return None if self.recipe is None else self.recipe.backward_override

    @property
    def split(self) -> Split:
        return Split(self.axis_name, self.kernel_dim, stacked=True)

    @property
    def hidden_dtype(self) -> np.dtype:
        return jnp.promote_types(self.x_dtype, self.kernel_dtype)

    def layout(self, group_sizes: jax.Array, rows: int):
        return group_layout(group_sizes, rows, token_alignment(self.recipe))

    # --- the expert kernels: what the forward reads, what is saved, what backward reads ------
    def fprop_kernels(
        self, shard: jax.Array, kept: QuantizedTensor | None = None
    ) -> tuple[QuantizedTensor, object]:
        """(the gathered fprop copies, the kernel residual: this device's shard). `kept`: this
        device's shard of the experts' kept quantized copies (kept_weight.py), read instead of
        quantizing `shard`."""
        mode, split = self.mode, self.split
        if self.strategy == GATHER_THEN_QUANTIZE:
            whole = split.gather_raw(shard)
            qw = split.quantize_whole(whole, self.recipe, rowwise=False, columnwise=True)
            return qw, shard  # backward re-gathers and re-quantizes
        q_shard = kept
        if q_shard is None:
            q_shard = split.quantize_shard(
                shard, self.recipe, rowwise=mode is None, columnwise=True
            )
        qw = split.gather_quantized(q_shard.restrict_to("columnwise"))
        if mode is None:
            return qw, q_shard.restrict_to("rowwise")
        if mode == "dequantized":
            return qw, q_shard.restrict_to("columnwise")
        return qw, shard  # "high_precision" reads the raw kernels

    def backward_kernels(self, saved_kernel):
        """The whole kernels in the form `backward_gemms` reads: the rowwise copies (mode None),
        the columnwise copies ("dequantized"), the raw kernels ("high_precision", unquantized)."""
        mode, split = self.mode, self.split
        if mode == "high_precision" or self.recipe is None:
            return split.gather_raw(saved_kernel)
        if self.strategy == GATHER_THEN_QUANTIZE:
            usage = "rowwise" if mode is None else "columnwise"
            return split.quantize_whole(
                split.gather_raw(saved_kernel),
                self.recipe,
                rowwise=usage == "rowwise",
                columnwise=usage == "columnwise",
            )
        return split.gather_quantized(saved_kernel)

    def reduce_kernel_grad(self, partial: jax.Array) -> jax.Array:
        """float32 (G, K, N) gradient of the local rows → this device's shard of the sum."""
        grad = reductions.psum_scatter(
            partial,
            self.axis_name,
            scatter_dimension=self.split.array_dim,
            deterministic=self.deterministic,
        )
        others = tuple(a for a in self.batch_axis_names if a != self.axis_name)
        return reductions.psum(grad, others, deterministic=self.deterministic).astype(
            self.kernel_dtype
        )


# Backward of the unquantized ops: `backward_gemms` in "high_precision" mode runs the compute-dtype
# GEMMs on the raw operands and never reads the recipe's formats.
_UNQUANTIZED_BACKWARD = Recipe(backward_override="high_precision")


def _backward_recipe(config: _ExpertsConfig) -> Recipe:
    return _UNQUANTIZED_BACKWARD if config.recipe is None else config.recipe


# --- grouped dense --------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fsdp_grouped_dense(x, kernel_shard, bias, group_sizes, key, config: _ExpertsConfig):
    y, _ = _fsdp_grouped_dense_fwd(x, kernel_shard, bias, group_sizes, key, config)
    return y


def _fsdp_grouped_dense_fwd(x, kernel_shard, bias, group_sizes, key, config: _ExpertsConfig):
    """Forward. Residuals (saved_input, saved_kernel, group_sizes, key), named INPUT, KERNEL,
    GROUP_SIZES, SR_KEY: saved_input is what `grouped_dense` saves for these rows, saved_kernel
    this device's shard of the experts (raw, or its quantized copy backward gathers)."""
    if config.recipe is None:
        sizes = clamp_group_sizes(group_sizes, x.shape[0])
        kernels = config.split.gather_raw(kernel_shard)

        def gemm(dtype):
            return ragged_nn(x, kernels, sizes, out_dtype=dtype)

        row_group = group_layout(sizes, x.shape[0], 1).row_group
        saved_input, saved_kernel = x, kernel_shard
    else:
        layout = config.layout(group_sizes, x.shape[0])
        qw, saved_kernel = config.fprop_kernels(kernel_shard)
        qx, _ = forward_operands(
            layout.to_aligned(x),
            None,
            config.recipe,
            layout,
            save_original_input=config.save_original_input,
            dtype=x.dtype,
            quantized_kernels=qw,
        )

        def gemm(dtype):
            return quantized_fprop(qx, qw, layout, token_order=True, out_dtype=dtype)

        row_group = layout.row_group
        saved_input = saved_input_operand(x, qx, config.mode, config.save_original_input)
    bias_rows = None if bias is None else group_bias_rows(bias, row_group)
    y = rounded_once(gemm, bias_rows, config.hidden_dtype)
    residuals = (
        checkpoint_name(saved_input, names.INPUT),
        checkpoint_name(saved_kernel, names.KERNEL),
        checkpoint_name(group_sizes, names.GROUP_SIZES),
        None if key is None else checkpoint_name(key, names.SR_KEY),
    )
    return y, residuals


def _fsdp_grouped_dense_bwd(config: _ExpertsConfig, residuals, dy):
    saved_input, saved_kernel, group_sizes, key = residuals
    kernels = config.backward_kernels(saved_kernel)
    if config.recipe is None:
        sizes = clamp_group_sizes(group_sizes, dy.shape[0])
        row_group = group_layout(sizes, dy.shape[0], 1).row_group
        dy_c = dy.astype(config.hidden_dtype)
        dx = ragged_nt(dy_c, kernels, sizes, out_dtype=config.x_dtype)
        dw = ragged_tn(saved_input, dy_c, sizes)  # float32: reduced over devices next
    else:
        layout = config.layout(group_sizes, dy.shape[0])
        row_group = layout.row_group
        dx, dw = backward_gemms(
            dy,
            saved_input,
            kernels,
            config.recipe,
            layout,
            key=key,
            compute_dtype=config.hidden_dtype,
            dx_dtype=config.x_dtype,  # (dw stays float32: reduced over devices next)
        )
    dbias = None
    if config.bias_dtype is not None:
        num_groups = group_sizes.shape[0]
        dbias = group_bias_grad(dy, row_group, num_groups, jnp.float32)
        dbias = reductions.psum(
            dbias, config.batch_axis_names, deterministic=config.deterministic
        ).astype(config.bias_dtype)
    return dx, config.reduce_kernel_grad(dw), dbias, None, None


_fsdp_grouped_dense.defvjp(_fsdp_grouped_dense_fwd, _fsdp_grouped_dense_bwd)


# --- grouped MLP ----------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _fsdp_grouped_mlp(
    x, fc1_shard, fc2_shard, probs, group_sizes, key, kept_fc1, kept_fc2, config: _ExpertsConfig
):
    y, _ = _fsdp_grouped_mlp_fwd(
        x, fc1_shard, fc2_shard, probs, group_sizes, key, kept_fc1, kept_fc2, config
    )
    return y


def _activation(config: _ExpertsConfig):
    def activation_of(h, probs):
        return scaled_activation(h, probs, config.activation, config.hidden_dtype)

    return activation_of


def _fsdp_grouped_mlp_fwd(
    x, fc1_shard, fc2_shard, probs, group_sizes, key, kept_fc1, kept_fc2, config
):
    """Forward. Residuals (saved_x, saved_fc1, h, probs, saved_a, saved_fc2, group_sizes, key),
    named as `grouped_mlp` names them (FC1_INPUT, FC1_KERNEL, PRE_ACTIVATION, PROBS, FC2_INPUT,
    FC2_KERNEL, GROUP_SIZES, SR_KEY); the kernels' are this device's shards (views of
    `kept_fc1` / `kept_fc2`, the kept quantized shards, when given). saved_a is None where
    backward recomputes the activation (save_original_input, "high_precision", unquantized)."""
    hidden, activation_of = config.hidden_dtype, _activation(config)
    if config.recipe is None:
        sizes = clamp_group_sizes(group_sizes, x.shape[0])
        h = ragged_nn(x, config.split.gather_raw(fc1_shard), sizes, out_dtype=hidden)
        a = activation_of(h, probs)
        y = ragged_nn(a, config.split.gather_raw(fc2_shard), sizes, out_dtype=hidden)
        saved_x, saved_fc1, saved_a, saved_fc2 = x, fc1_shard, None, fc2_shard
    else:
        recipe, soi, mode = config.recipe, config.save_original_input, config.mode
        layout = config.layout(group_sizes, x.shape[0])
        qw1, saved_fc1 = config.fprop_kernels(fc1_shard, kept_fc1)
        qx, _ = forward_operands(
            layout.to_aligned(x),
            None,
            recipe,
            layout,
            save_original_input=soi,
            dtype=x.dtype,
            quantized_kernels=qw1,
        )
        h_aligned = quantized_fprop(qx, qw1, layout, out_dtype=hidden)
        probs_aligned = None if probs is None else layout.to_aligned(probs)
        a_aligned = activation_of(h_aligned, probs_aligned)
        qw2, saved_fc2 = config.fprop_kernels(fc2_shard, kept_fc2)
        qa, _ = forward_operands(
            a_aligned, None, recipe, layout, save_original_input=soi, quantized_kernels=qw2
        )
        y = quantized_fprop(qa, qw2, layout, token_order=True, out_dtype=hidden)
        h = layout.from_aligned(h_aligned)
        saved_x = saved_input_operand(x, qx, mode, soi)
        saved_a = saved_input_operand(None, qa, mode, soi)
    residuals = (
        checkpoint_name(saved_x, names.FC1_INPUT),
        checkpoint_name(saved_fc1, names.FC1_KERNEL),
        checkpoint_name(h, names.PRE_ACTIVATION),
        None if probs is None else checkpoint_name(probs, names.PROBS),
        None if saved_a is None else checkpoint_name(saved_a, names.FC2_INPUT),
        checkpoint_name(saved_fc2, names.FC2_KERNEL),
        checkpoint_name(group_sizes, names.GROUP_SIZES),
        None if key is None else checkpoint_name(key, names.SR_KEY),
    )
    return y, residuals


def _fsdp_grouped_mlp_bwd(config: _ExpertsConfig, residuals, dy):
    saved_x, saved_fc1, h, probs, saved_a, saved_fc2, group_sizes, key = residuals
    hidden, activation_of = config.hidden_dtype, _activation(config)
    recipe = _backward_recipe(config)
    align = 1 if config.recipe is None else token_alignment(recipe)
    layout = group_layout(group_sizes, dy.shape[0], align)
    fc1_key, fc2_key = stage_keys(key)
    if saved_a is None:  # modes that read the raw FC2 input: recompute it
        saved_a = activation_of(h, probs)
    da, dfc2 = backward_gemms(
        dy,
        saved_a,
        config.backward_kernels(saved_fc2),
        recipe,
        layout,
        key=fc2_key,
        compute_dtype=hidden,
        dx_dtype=hidden,  # (the weight gradients stay float32: reduced over devices next)
    )
    _, activation_vjp = jax.vjp(activation_of, h, probs)
    dh, dprobs = activation_vjp(da)
    dx, dfc1 = backward_gemms(
        dh,
        saved_x,
        config.backward_kernels(saved_fc1),
        recipe,
        layout,
        key=fc1_key,
        compute_dtype=hidden,
        dx_dtype=config.x_dtype,
    )
    return (
        dx,
        config.reduce_kernel_grad(dfc1),
        config.reduce_kernel_grad(dfc2),
        dprobs,
        None,
        None,
        None,  # the kept quantized shards are read, not differentiated
        None,
    )


_fsdp_grouped_mlp.defvjp(_fsdp_grouped_mlp_fwd, _fsdp_grouped_mlp_bwd)


# --- argument checks and the public per-device ops -----------------------------------------------
def _axis_sizes(axis_name, batch_axis_names) -> tuple[int, tuple[str, ...]]:
    if not isinstance(axis_name, str):
        raise TypeError(f"axis_name must be a mesh axis name, got {axis_name!r}")
    batch_axis_names = normalize_axes(
        axis_name if batch_axis_names is None else batch_axis_names, "batch_axis_names"
    )
    if axis_name not in batch_axis_names:
        raise ValueError(
            f"batch_axis_names {batch_axis_names} must include axis_name {axis_name!r}: the "
            "expert gradients are reduce-scattered over the axis that splits the tokens"
        )
    sizes = {}
    for argument, name in [("axis_name", axis_name)] + [
        ("batch_axis_names", n) for n in batch_axis_names
    ]:
        try:
            sizes[name] = int(lax.axis_size(name))
        except NameError:
            raise ValueError(
                f"{argument}: axis {name!r} is not bound here; call this op inside "
                "jax.shard_map over a mesh with that axis"
            ) from None
    return sizes[axis_name], batch_axis_names


def _whole_shape(shard_shape, kernel_dim, axis_size, argument: str) -> tuple[int, int, int]:
    if len(shard_shape) != 3:
        raise ValueError(
            f"{argument} must be this device's shard of the (num_experts, in_features, "
            f"out_features) kernels, got shape {tuple(shard_shape)}"
        )
    whole = list(shard_shape)
    whole[Split("", kernel_dim, stacked=True).array_dim] *= axis_size
    return tuple(whole)


def _config(
    recipe,
    save_original_input,
    strategy,
    axis_name,
    kernel_dim,
    batch_axes,
    deterministic,
    **dtypes,
):
    if not isinstance(save_original_input, bool):
        raise TypeError(f"save_original_input must be a bool, got {save_original_input!r}")
    return _ExpertsConfig(
        recipe=recipe,
        save_original_input=(
            False if recipe is None else effective_save_original_input(recipe, save_original_input)
        ),
        strategy=strategy,
        axis_name=axis_name,
        kernel_dim=kernel_dim,
        batch_axis_names=batch_axes,
        deterministic=bool(deterministic),
        **dtypes,
    )


def fsdp_grouped_dense(
    x: jax.Array,
    kernel_shard: jax.Array,
    group_sizes: jax.Array,
    bias: jax.Array | None = None,
    *,
    axis_name: str,
    kernel_dim: int | str = "experts",
    batch_axis_names: str | tuple[str, ...] | None = None,
    strategy: Strategy = DEFAULT_STRATEGY,
    recipe: Recipe | None = None,
    save_original_input: bool = False,
    key: jax.Array | None = None,
    deterministic: bool = False,
) -> jax.Array:
    """`jax_qtrain.grouped_dense` on one device, inside `jax.shard_map`, with the expert kernels
    split over `axis_name` (module docstring).

    Args:
      x: this device's rows (M, in_features), sorted by expert.
      kernel_shard: this device's shard of the (G, in_features, out_features) kernels.
      group_sizes: (G,) int32, this device's rows per expert.
      bias: the whole (G, out_features) bias, replicated.
      axis_name, batch_axis_names, strategy, deterministic: as `fsdp_dense`.
      kernel_dim: "experts" (default: G/P whole experts per device), 0 or 1 (each expert's
        in_features or out_features split).
      recipe, save_original_input, key: as `jax_qtrain.grouped_dense`.
    """
    check_kernel_dim(kernel_dim, grouped=True)
    check_strategy(strategy)
    axis_size, batch_axes = _axis_sizes(axis_name, batch_axis_names)
    check_float("x", x)
    check_float("kernel_shard", kernel_shard)
    num_groups, in_features, out_features = _whole_shape(
        kernel_shard.shape, kernel_dim, axis_size, "kernel_shard"
    )
    if x.ndim != 2 or x.shape[1] != in_features:
        raise ValueError(
            f"x must have shape (tokens, {in_features}) for kernels of whole shape "
            f"({num_groups}, {in_features}, {out_features}), got {tuple(x.shape)}"
        )
    check_group_sizes(group_sizes, num_groups, num_rows=x.shape[0])
    if bias is not None:
        check_float("bias", bias)
        if tuple(bias.shape) != (num_groups, out_features):
            raise ValueError(
                f"bias must have the whole shape ({num_groups}, {out_features}), got "
                f"{tuple(bias.shape)}"
            )
    config = _config(
        resolve_recipe(recipe),
        save_original_input,
        strategy,
        axis_name,
        kernel_dim,
        batch_axes,
        deterministic,
        x_dtype=jnp.dtype(x.dtype),
        kernel_dtype=jnp.dtype(kernel_shard.dtype),
        bias_dtype=None if bias is None else jnp.dtype(bias.dtype),
    )
    return _fsdp_grouped_dense(x, kernel_shard, bias, group_sizes, key, config)


def check_kept_expert_shards(
    recipe, strategy, fc1_shard, fc2_shard, quantized_fc1_shard, quantized_fc2_shard
) -> None:
    """The kept quantized fc1 / fc2 shards of an expert MLP (both or neither), each checked
    against its kernel shard, the recipe and the strategy (`check_kept_shard`)."""
    if (quantized_fc1_shard is None) != (quantized_fc2_shard is None):
        raise ValueError(
            "quantized_fc1_shard and quantized_fc2_shard go together: pass both kept shards "
            "or neither"
        )
    if quantized_fc1_shard is None:
        return
    for argument, kept, kernel_argument, shard in (
        ("quantized_fc1_shard", quantized_fc1_shard, "fc1_shard", fc1_shard),
        ("quantized_fc2_shard", quantized_fc2_shard, "fc2_shard", fc2_shard),
    ):
        check_kept_shard(
            kept, shard, recipe, strategy, argument=argument, kernel_argument=kernel_argument
        )


def fsdp_grouped_mlp(
    x: jax.Array,
    fc1_shard: jax.Array,
    fc2_shard: jax.Array,
    group_sizes: jax.Array,
    probs: jax.Array | None = None,
    activation: str = "swiglu",
    *,
    axis_name: str,
    kernel_dim: int | str = "experts",
    batch_axis_names: str | tuple[str, ...] | None = None,
    strategy: Strategy = DEFAULT_STRATEGY,
    recipe: Recipe | None = None,
    save_original_input: bool = False,
    key: jax.Array | None = None,
    deterministic: bool = False,
    quantized_fc1_shard: QuantizedTensor | None = None,
    quantized_fc2_shard: QuantizedTensor | None = None,
) -> jax.Array:
    """`jax_qtrain.grouped_mlp` on one device, inside `jax.shard_map`, with fc1 (G, K, 2F or F)
    and fc2 (G, F, N) split over `axis_name` along the same `kernel_dim` (module docstring).
    `quantized_fc1_shard` / `quantized_fc2_shard` (both or neither): this device's shards of the
    experts' kept quantized copies (`ShardedMoE(quantized_weight=True)`, kept_weight.py),
    gathered instead of quantizing the shards ("quantize_then_gather" only). Other arguments as
    `fsdp_grouped_dense` and `jax_qtrain.grouped_mlp`."""
    check_kernel_dim(kernel_dim, grouped=True)
    check_strategy(strategy)
    check_activation(activation)
    axis_size, batch_axes = _axis_sizes(axis_name, batch_axis_names)
    check_float("x", x)
    for name, shard in (("fc1_shard", fc1_shard), ("fc2_shard", fc2_shard)):
        check_float(name, shard)
    if jnp.dtype(fc1_shard.dtype) != jnp.dtype(fc2_shard.dtype):
        raise TypeError(
            f"fc1_shard and fc2_shard must have one dtype, got {fc1_shard.dtype} and "
            f"{fc2_shard.dtype}"
        )
    num_groups, in_features, _ = _whole_shape(fc1_shard.shape, kernel_dim, axis_size, "fc1_shard")
    fc2_groups, _, _ = _whole_shape(fc2_shard.shape, kernel_dim, axis_size, "fc2_shard")
    if fc2_groups != num_groups:
        raise ValueError(f"fc1_shard and fc2_shard hold {num_groups} and {fc2_groups} experts")
    if x.ndim != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must have shape (tokens, {in_features}), got {tuple(x.shape)}")
    check_group_sizes(group_sizes, num_groups, num_rows=x.shape[0])
    if probs is not None:
        check_float("probs", probs)
        if tuple(probs.shape) != (x.shape[0],):
            raise ValueError(f"probs must have shape ({x.shape[0]},), got {tuple(probs.shape)}")
    recipe = resolve_recipe(recipe)
    check_kept_expert_shards(
        recipe, strategy, fc1_shard, fc2_shard, quantized_fc1_shard, quantized_fc2_shard
    )
    config = _config(
        recipe,
        save_original_input,
        strategy,
        axis_name,
        kernel_dim,
        batch_axes,
        deterministic,
        x_dtype=jnp.dtype(x.dtype),
        kernel_dtype=jnp.dtype(fc1_shard.dtype),
        activation=activation,
    )
    return _fsdp_grouped_mlp(
        x,
        fc1_shard,
        fc2_shard,
        probs,
        group_sizes,
        key,
        quantized_fc1_shard,
        quantized_fc2_shard,
        config,
    )
