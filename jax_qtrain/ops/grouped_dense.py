"""`grouped_dense`: TransformerEngine's GroupedLinear for MoE experts, as one custom_vjp.

y[rows of g] = x[rows of g] @ kernels[g] (+ bias[g]) for x (M, K) with rows sorted by group,
kernels (G, K, N) and group_sizes (G,) int32 on the device. Every group of x (and of dy) is
quantized as a tensor of its own, in the aligned layout of ops/grouped_quantize.py; every
expert's weight is quantized separately. What backward reads follows `dense` (te_semantics §1):

  None (default)    x's columnwise copy only, (K', P) in the aligned layout (or, with
                    save_original_input, the raw x, re-quantized in backward), and the experts'
                    rowwise copies; dy is quantized per group and both backward GEMMs are
                    quantized.
  "high_precision"  forces save_original_input=True: the raw x and the raw kernels; backward
                    GEMMs in the compute dtype on the raw dy.
  "dequantized"     forces save_original_input=False: the forward-quantized operands (x's
                    rowwise copy only, the experts' columnwise copies), dequantized in backward;
                    GEMMs in the compute dtype on the raw dy.

group_sizes is saved too (GROUP_SIZES), and the stochastic-rounding key when one is given.
Zero-size groups are allowed (their weight gradient is 0); rows past sum(group_sizes) give 0 in
y and dx. Bias gradients are per-group sums of the raw dy.

Kept quantized weights (`quantized_kernels=`, docs/quantized_weights.md): the experts' copies
are read from a `QuantizedWeight` made by `jax_qtrain.quantize_weight` instead of being quantized
in the call; it must hold the copies training reads. The gradient still flows to `kernels`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jax_qtrain.formats import common
from jax_qtrain.ops import residuals as names
from jax_qtrain.ops.context import resolve_recipe
from jax_qtrain.ops.dense import (
    effective_save_original_input,
    rounded_once,
    stochastic_rounding_key,
)
from jax_qtrain.ops.grouped_gemm import (
    grouped_matmul_nt,
    grouped_matmul_wgrad,
    ragged_nn,
    ragged_nt,
    ragged_tn,
)
from jax_qtrain.ops.grouped_quantize import (
    GroupedQuantizedTensor,
    GroupLayout,
    check_group_sizes,
    clamp_group_sizes,
    group_layout,
    grouped_quantize,
    quantize_aligned,
    quantize_per_expert,
    token_alignment,
)
from jax_qtrain.quantize import QuantizedTensor
from jax_qtrain.quantized_weight import QuantizedWeight, check_kept_weight
from jax_qtrain.recipes import Recipe


@dataclasses.dataclass(frozen=True)
class _GroupedDenseConfig:
    """Static configuration of one grouped_dense call (a nondiff argument of the custom_vjp)."""

    recipe: Recipe
    save_original_input: bool  # after the override forced it
    x_dtype: np.dtype
    kernel_dtype: np.dtype
    bias_dtype: np.dtype | None
    out_dtype: np.dtype

    @property
    def mode(self) -> str | None:
        return self.recipe.backward_override

    @property
    def compute_dtype(self) -> np.dtype:
        return jnp.promote_types(self.x_dtype, self.kernel_dtype)


def group_bias_rows(bias: jax.Array, row_group: jax.Array) -> jax.Array:
    """(M, N) float32: each row's group bias, 0 for rows past the groups."""
    return jnp.take(bias.astype(jnp.float32), row_group, axis=0, mode="fill", fill_value=0)


def group_bias_grad(dy: jax.Array, row_group: jax.Array, num_groups: int, dtype) -> jax.Array:
    """(G, N): per-group sums of the raw dy (rows past the groups are dropped)."""
    sums = jax.ops.segment_sum(
        dy.astype(jnp.float32), row_group, num_segments=num_groups + 1, indices_are_sorted=True
    )
    return sums[:num_groups].astype(dtype)


# --- the stages of a grouped linear layer, shared with the fused MLP (ops/grouped_mlp.py) -----
def forward_operands(
    x_aligned: jax.Array,
    kernels: jax.Array,
    recipe: Recipe,
    layout: GroupLayout,
    *,
    save_original_input: bool,
    dtype=None,
    quantized_kernels: QuantizedTensor | None = None,
) -> tuple[GroupedQuantizedTensor, QuantizedTensor]:
    """The forward's quantized operands: x (already in the aligned layout) per group and each
    expert's weight. Mode None keeps the copies backward reads too (x's columnwise copy unless
    the raw input is saved; the experts' rowwise copies); an override only the fprop copies.
    `quantized_kernels`: the experts' kept copies (checked by the caller), used as they are."""
    mode = recipe.backward_override
    keep_x_columnwise = mode is None and not save_original_input
    qx = quantize_aligned(
        x_aligned, recipe, "input", layout, rowwise=True, columnwise=keep_x_columnwise, dtype=dtype
    )
    qw = quantized_kernels
    if qw is None:
        qw = quantize_per_expert(kernels, recipe, rowwise=mode is None, columnwise=True)
    return qx, qw


def quantized_fprop(
    qx: GroupedQuantizedTensor,
    qw: QuantizedTensor,
    layout: GroupLayout,
    *,
    token_order=False,
    out_dtype=jnp.float32,
):
    """(P, N) forward GEMM of the quantized operands in `out_dtype`, in the aligned layout;
    with `token_order`, (M, N) in the tokens' order (see `grouped_matmul_nt`)."""
    return grouped_matmul_nt(
        qx,
        "rowwise",
        qw,
        "columnwise",
        layout,
        cols=qw.shape[1],
        token_order=token_order,
        out_dtype=out_dtype,
    )


def saved_operands(x, kernels, qx, qw, recipe: Recipe, *, save_original_input: bool):
    """(saved_input, saved_kernels): what backward reads, per mode (module docstring). `x` is
    the raw input where a mode saves it (a caller that recomputes it passes None)."""
    mode = recipe.backward_override
    if mode is None:
        saved_input = x if save_original_input else qx.restrict_to("columnwise")
        return saved_input, qw.restrict_to("rowwise")
    if mode == "high_precision":
        return x, kernels
    return qx.restrict_to("rowwise"), qw.restrict_to("columnwise")  # "dequantized"


def backward_gemms(
    dy: jax.Array,
    saved_input,
    saved_kernels,
    recipe: Recipe,
    layout: GroupLayout,
    *,
    key: jax.Array | None,
    compute_dtype,
    dx_dtype=jnp.float32,
    dw_dtype=jnp.float32,
) -> tuple[jax.Array, jax.Array]:
    """(dx (M, K) in `dx_dtype`, dW (G, K, N) in `dw_dtype`) of one grouped linear layer from
    its saved operands, each accumulated in float32 and rounded once (the defaults keep the
    float32 sums, for callers that reduce them further).

    Mode None quantizes dy per group and runs both GEMMs quantized (a raw saved input is
    re-quantized, columnwise only); the overrides run them in `compute_dtype` on the raw dy.
    """
    mode = recipe.backward_override
    if mode is None:
        qdy = quantize_grad(dy, recipe, layout, key)
        qx = saved_input
        if not isinstance(qx, GroupedQuantizedTensor):  # save_original_input: re-quantize
            qx = grouped_quantize(qx, recipe, "input", layout, rowwise=False, columnwise=True)
        in_features, out_features = saved_kernels.shape
        dx = grouped_matmul_nt(
            qdy,
            "rowwise",
            saved_kernels,
            "rowwise",
            layout,
            cols=in_features,
            token_order=True,
            out_dtype=dx_dtype,
        )
        dw = grouped_matmul_wgrad(
            qx, qdy, layout, rows=in_features, cols=out_features, out_dtype=dw_dtype
        )
        return dx, dw
    if mode == "high_precision":
        x_values, kernel_values = saved_input, saved_kernels
    else:  # "dequantized"
        x_values = saved_input.dequantize("rowwise", layout, compute_dtype)
        kernel_values = jax.vmap(lambda q: q.dequantize("columnwise", compute_dtype))(saved_kernels)
    dy = dy.astype(compute_dtype)
    sizes = layout.group_sizes
    return (
        ragged_nt(dy, kernel_values, sizes, out_dtype=dx_dtype),
        ragged_tn(x_values, dy, sizes, out_dtype=dw_dtype),
    )


def quantize_grad(dy, recipe: Recipe, layout: GroupLayout, key) -> GroupedQuantizedTensor:
    """dy quantized per group, both copies; NVFP4's stochastic rounding draws from `key` (or a
    hash of dy), group g from fold_in(key, g)."""
    sr = recipe.spec("grad").stochastic_rounding
    return grouped_quantize(
        dy,
        recipe,
        "grad",
        layout,
        rowwise=True,
        columnwise=True,
        key=stochastic_rounding_key(key, dy) if sr else None,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _grouped_dense(
    x, kernels, bias, group_sizes, key, quantized_kernels, config: _GroupedDenseConfig
):
    y, _ = _grouped_dense_fwd(x, kernels, bias, group_sizes, key, quantized_kernels, config)
    return y


def _grouped_dense_fwd(
    x, kernels, bias, group_sizes, key, quantized_kernels, config: _GroupedDenseConfig
):
    """Forward. Residuals (saved_input, saved_kernels, group_sizes, key), each named:

    - saved_input (INPUT): GroupedQuantizedTensor with only the columnwise copy (mode None), the
      raw x (mode None with save_original_input, and "high_precision"), or the forward's
      GroupedQuantizedTensor with only the rowwise copy ("dequantized");
    - saved_kernels (KERNEL): the experts' QuantizedTensor with only the rowwise copies (mode
      None), the raw kernels ("high_precision"), or the forward's columnwise copies
      ("dequantized"); views of `quantized_kernels` when kept copies are given;
    - group_sizes (GROUP_SIZES): the caller's (G,) int32, from which backward rebuilds the layout;
    - key (SR_KEY): the caller's stochastic-rounding key, or None.
    """
    recipe, soi = config.recipe, config.save_original_input
    layout = group_layout(group_sizes, x.shape[0], token_alignment(recipe))
    qx, qw = forward_operands(
        layout.to_aligned(x),
        kernels,
        recipe,
        layout,
        save_original_input=soi,
        dtype=x.dtype,
        quantized_kernels=quantized_kernels,
    )
    y = rounded_once(
        lambda dtype: quantized_fprop(qx, qw, layout, token_order=True, out_dtype=dtype),
        None if bias is None else group_bias_rows(bias, layout.row_group),
        config.out_dtype,
    )
    saved_input, saved_kernels = saved_operands(x, kernels, qx, qw, recipe, save_original_input=soi)
    residuals = (
        checkpoint_name(saved_input, names.INPUT),
        checkpoint_name(saved_kernels, names.KERNEL),
        checkpoint_name(group_sizes, names.GROUP_SIZES),
        None if key is None else checkpoint_name(key, names.SR_KEY),
    )
    return y, residuals


def _grouped_dense_bwd(config: _GroupedDenseConfig, residuals, dy):
    saved_input, saved_kernels, group_sizes, key = residuals
    recipe = config.recipe
    layout = group_layout(group_sizes, dy.shape[0], token_alignment(recipe))
    dx, dw = backward_gemms(
        dy,
        saved_input,
        saved_kernels,
        recipe,
        layout,
        key=key,
        compute_dtype=config.compute_dtype,
        dx_dtype=config.x_dtype,
        dw_dtype=config.kernel_dtype,
    )
    dbias = None
    if config.bias_dtype is not None:
        dbias = group_bias_grad(dy, layout.row_group, layout.num_groups, config.bias_dtype)
    # No cotangent for group_sizes, the key and the kept copies (their gradient is the kernels').
    return dx, dw, dbias, None, None, None


_grouped_dense.defvjp(_grouped_dense_fwd, _grouped_dense_bwd)


def check_float(name: str, value) -> None:
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(value).__name__}")
    if jnp.dtype(value.dtype) not in common.SUPPORTED_INPUT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {value.dtype}")


def validate_grouped_operands(x, kernels, group_sizes, *, kernels_name: str = "kernels") -> None:
    """Trace-time checks shared by the grouped ops: x (M, K), kernels (G, K, N), group_sizes."""
    check_float("x", x)
    check_float(kernels_name, kernels)
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(
            f"x must have shape (tokens, in_features) with at least one row, rows sorted by "
            f"group, got {tuple(x.shape)}"
        )
    if kernels.ndim != 3 or kernels.shape[0] == 0:
        raise ValueError(
            f"{kernels_name} must have shape (num_groups, in_features, out_features), got "
            f"{tuple(kernels.shape)}"
        )
    if x.shape[1] != kernels.shape[1]:
        raise ValueError(
            f"x's last dim ({x.shape[1]}) must equal the in_features of {kernels_name} "
            f"({kernels.shape[1]})"
        )
    check_group_sizes(group_sizes, kernels.shape[0], num_rows=x.shape[0])


def grouped_dense(
    x: jax.Array,
    kernels: jax.Array,
    group_sizes: jax.Array,
    bias: jax.Array | None = None,
    *,
    recipe: Recipe | None = None,
    save_original_input: bool = False,
    key: jax.Array | None = None,
    quantized_kernels: QuantizedWeight | None = None,
) -> jax.Array:
    """Quantized grouped linear layer with TransformerEngine's GroupedLinear semantics.

    Args:
      x: (M, in_features), rows sorted by group.
      kernels: (G, in_features, out_features), one Flax-layout kernel per group (expert).
      group_sizes: (G,) int32 rows per group, on the device. Its values cannot be checked at
        trace time: negative sizes count as 0 and sizes past M are truncated; rows past the
        groups give zeros (and zero dx).
      bias: optional (G, out_features).
      recipe: the quantization recipe; None uses the active `autocast` recipe, and with none
        active the op is a plain `lax.ragged_dot` grouped layer.
      save_original_input: in the default mode, save the raw x and re-quantize it in backward
        instead of saving its columnwise copy (overridden by `backward_override`).
      key: jax.random key for stochastic rounding of the output gradient (NVFP4); group g uses
        fold_in(key, g). Without one, the key is a hash of the gradient itself.
      quantized_kernels: `kernels` already quantized per expert (`jax_qtrain.quantize_weight`,
        holding the copies training reads); the op then does not quantize the kernels.

    Returns: (M, out_features) in the promoted dtype of x and kernels.
    """
    validate_grouped_operands(x, kernels, group_sizes)
    num_groups, _, out_features = kernels.shape
    if bias is not None:
        check_float("bias", bias)
        if tuple(bias.shape) != (num_groups, out_features):
            raise ValueError(
                f"bias must have shape ({num_groups}, {out_features}), got {tuple(bias.shape)}"
            )
    if not isinstance(save_original_input, bool):
        raise TypeError(f"save_original_input must be a bool, got {save_original_input!r}")
    recipe = resolve_recipe(recipe)
    kept = None
    if quantized_kernels is not None:
        if recipe is None:
            raise ValueError("quantized_kernels needs the recipe it was quantized with")
        kept = check_kept_weight(quantized_kernels, kernels, recipe, argument="quantized_kernels")
    out_dtype = jnp.promote_types(x.dtype, kernels.dtype)
    if recipe is None:
        sizes = clamp_group_sizes(group_sizes, x.shape[0])
        bias_rows = None
        if bias is not None:
            bias_rows = group_bias_rows(bias, group_layout(sizes, x.shape[0], 1).row_group)
        return rounded_once(
            lambda dtype: ragged_nn(x, kernels, sizes, out_dtype=dtype), bias_rows, out_dtype
        )
    config = _GroupedDenseConfig(
        recipe=recipe,
        save_original_input=effective_save_original_input(recipe, save_original_input),
        x_dtype=jnp.dtype(x.dtype),
        kernel_dtype=jnp.dtype(kernels.dtype),
        bias_dtype=None if bias is None else jnp.dtype(bias.dtype),
        out_dtype=out_dtype,
    )
    return _grouped_dense(x, kernels, bias, group_sizes, key, kept, config)
