"""`grouped_mlp`: the MoE expert block FC1 → activation × router probs → FC2 as one custom_vjp.

Per expert g, on the rows of x (M, K) that group_sizes assigns to it (rows sorted by group):

    h = x_g @ fc1[g]                   (·, 2F) for gated activations, (·, F) for plain ones
    a = act(h) · probs_g[:, None]      float32, rounded once to h's dtype
    y = a @ fc2[g]

It computes exactly what the unfused composition computes (`unfused_grouped_mlp`: two
`grouped_dense` calls around `scaled_activation`), bit for bit, but saves only what its backward
reads (names in ops/residuals.py; "row"/"col" = the rowwise/columnwise copy):

| mode                  | FC1_INPUT | FC1_KERNEL | PRE_ACTIVATION | PROBS | FC2_INPUT | FC2_KERNEL |
|-----------------------|-----------|------------|----------------|-------|-----------|------------|
| None                  | x col     | fc1 row    | h              | probs | a col     | fc2 row    |
| None, save_orig_input | raw x     | fc1 row    | h              | probs | —         | fc2 row    |
| "high_precision"      | raw x     | raw fc1    | h              | probs | —         | raw fc2    |
| "dequantized"         | x row     | fc1 col    | h              | probs | a row     | fc2 col    |

plus GROUP_SIZES and SR_KEY. "—": a is recomputed from h and probs in backward (a raw input is
what those modes would save; recomputing it is free of memory). So no rowwise data of a saved
input survives in mode None: MXFP8 and NVFP4 keep only the columnwise copies the wgrad GEMMs read
(seed 03's pruning of NVFP4 rowwise input data). PROBS is absent without probs.

Fusion: FC1's output stays in the aligned layout (ops/grouped_quantize.py); the activation, the
probs and the rounding to h's dtype are applied there and the result is quantized per group for
FC2 directly (`quantize_aligned`), so XLA fuses activation and quantization into one pass (a
kernel would do the same) and nothing is gathered back and forth. Every activation maps 0 to 0,
so the padding slots stay zero. The activation is rounded to its dtype before its amax is taken,
as TE's fused activation-cast kernels do (numerics.md §0).

Stochastic rounding (NVFP4 gradients): FC1's dh draws from fold_in(key, 1), FC2's dy from
fold_in(key, 2); without a key each from a hash of its own gradient (as grouped_dense).

Kept quantized weights (`quantized_fc1=`, `quantized_fc2=`, docs/quantized_weights.md): the
experts' copies are read from `QuantizedWeight`s instead of being quantized in the call.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jax_qtrain.ops import residuals as names
from jax_qtrain.ops.activations import check_activation, is_gated, scaled_activation
from jax_qtrain.ops.context import resolve_recipe
from jax_qtrain.ops.dense import effective_save_original_input
from jax_qtrain.ops.grouped_dense import (
    backward_gemms,
    check_float,
    forward_operands,
    grouped_dense,
    quantized_fprop,
    saved_operands,
    validate_grouped_operands,
)
from jax_qtrain.ops.grouped_gemm import ragged_nn
from jax_qtrain.ops.grouped_quantize import clamp_group_sizes, group_layout, token_alignment
from jax_qtrain.quantized_weight import QuantizedWeight, check_kept_weight
from jax_qtrain.recipes import Recipe


@dataclasses.dataclass(frozen=True)
class _GroupedMLPConfig:
    """Static configuration of one grouped_mlp call (a nondiff argument of the custom_vjp): the
    backward always uses the recipe its own forward ran with."""

    recipe: Recipe
    activation: str
    save_original_input: bool  # after the override forced it
    x_dtype: np.dtype
    fc1_dtype: np.dtype
    fc2_dtype: np.dtype

    @property
    def hidden_dtype(self) -> np.dtype:  # h and a
        return jnp.promote_types(self.x_dtype, self.fc1_dtype)

    @property
    def out_dtype(self) -> np.dtype:
        return jnp.promote_types(self.hidden_dtype, self.fc2_dtype)


def stage_keys(key: jax.Array | None) -> tuple[jax.Array | None, jax.Array | None]:
    """The stochastic-rounding keys of FC1's and FC2's output gradients."""
    if key is None:
        return None, None
    return jax.random.fold_in(key, 1), jax.random.fold_in(key, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _grouped_mlp(x, fc1, fc2, probs, group_sizes, key, kept, config: _GroupedMLPConfig):
    y, _ = _grouped_mlp_fwd(x, fc1, fc2, probs, group_sizes, key, kept, config)
    return y


def _grouped_mlp_fwd(x, fc1, fc2, probs, group_sizes, key, kept, config: _GroupedMLPConfig):
    """Forward. Residuals (saved_x, saved_fc1, h, probs, saved_a, saved_fc2, group_sizes, key),
    named FC1_INPUT, FC1_KERNEL, PRE_ACTIVATION, PROBS, FC2_INPUT, FC2_KERNEL, GROUP_SIZES,
    SR_KEY; per mode as in the module docstring (saved_a is None where a is recomputed).
    `kept`: (fc1's, fc2's) kept quantized copies, each a QuantizedTensor or None."""
    recipe, soi, hidden = config.recipe, config.save_original_input, config.hidden_dtype
    kept_fc1, kept_fc2 = kept
    layout = group_layout(group_sizes, x.shape[0], token_alignment(recipe))
    qx, qw1 = forward_operands(
        layout.to_aligned(x),
        fc1,
        recipe,
        layout,
        save_original_input=soi,
        dtype=x.dtype,
        quantized_kernels=kept_fc1,
    )
    h_aligned = quantized_fprop(qx, qw1, layout, out_dtype=hidden)
    probs_aligned = None if probs is None else layout.to_aligned(probs)
    a_aligned = scaled_activation(h_aligned, probs_aligned, config.activation, hidden)
    qa, qw2 = forward_operands(
        a_aligned, fc2, recipe, layout, save_original_input=soi, quantized_kernels=kept_fc2
    )
    y = quantized_fprop(qa, qw2, layout, token_order=True, out_dtype=config.out_dtype)

    saved_x, saved_fc1 = saved_operands(x, fc1, qx, qw1, recipe, save_original_input=soi)
    saved_a, saved_fc2 = saved_operands(None, fc2, qa, qw2, recipe, save_original_input=soi)
    residuals = (
        checkpoint_name(saved_x, names.FC1_INPUT),
        checkpoint_name(saved_fc1, names.FC1_KERNEL),
        checkpoint_name(layout.from_aligned(h_aligned), names.PRE_ACTIVATION),
        None if probs is None else checkpoint_name(probs, names.PROBS),
        None if saved_a is None else checkpoint_name(saved_a, names.FC2_INPUT),
        checkpoint_name(saved_fc2, names.FC2_KERNEL),
        checkpoint_name(group_sizes, names.GROUP_SIZES),
        None if key is None else checkpoint_name(key, names.SR_KEY),
    )
    return y, residuals


def _grouped_mlp_bwd(config: _GroupedMLPConfig, residuals, dy):
    saved_x, saved_fc1, h, probs, saved_a, saved_fc2, group_sizes, key = residuals
    recipe, hidden = config.recipe, config.hidden_dtype
    layout = group_layout(group_sizes, dy.shape[0], token_alignment(recipe))
    fc1_key, fc2_key = stage_keys(key)

    def activation_of(h, probs):
        return scaled_activation(h, probs, config.activation, hidden)

    if saved_a is None:  # modes that read the raw FC2 input: recompute it
        saved_a = activation_of(h, probs)
    da, dfc2 = backward_gemms(
        dy,
        saved_a,
        saved_fc2,
        recipe,
        layout,
        key=fc2_key,
        compute_dtype=config.out_dtype,
        dx_dtype=hidden,
        dw_dtype=config.fc2_dtype,
    )
    _, activation_vjp = jax.vjp(activation_of, h, probs)
    dh, dprobs = activation_vjp(da)
    dx, dfc1 = backward_gemms(
        dh,
        saved_x,
        saved_fc1,
        recipe,
        layout,
        key=fc1_key,
        compute_dtype=hidden,
        dx_dtype=config.x_dtype,
        dw_dtype=config.fc1_dtype,
    )
    return (
        dx,
        dfc1,
        dfc2,
        dprobs,
        None,
        None,
        None,  # the kept copies: their gradient is fc1's and fc2's
    )


_grouped_mlp.defvjp(_grouped_mlp_fwd, _grouped_mlp_bwd)


def _validate(x, fc1, fc2, group_sizes, probs, activation) -> None:
    check_activation(activation)
    validate_grouped_operands(x, fc1, group_sizes, kernels_name="fc1")
    check_float("fc2", fc2)
    num_groups, _, fc1_out = fc1.shape
    ffn = fc1_out // 2 if is_gated(activation) else fc1_out
    if is_gated(activation) and fc1_out % 2:
        raise ValueError(f"fc1's out_features ({fc1_out}) must be even for gated {activation!r}")
    if fc2.ndim != 3 or fc2.shape[:2] != (num_groups, ffn):
        raise ValueError(
            f"fc2 must have shape ({num_groups}, {ffn}, out_features) for fc1 of shape "
            f"{tuple(fc1.shape)} and activation {activation!r}, got {tuple(fc2.shape)}"
        )
    if probs is not None:
        check_float("probs", probs)
        if tuple(probs.shape) != (x.shape[0],):
            raise ValueError(
                f"probs must have shape ({x.shape[0]},) (one per row of x), got "
                f"{tuple(probs.shape)}"
            )


def grouped_mlp(
    x: jax.Array,
    fc1: jax.Array,
    fc2: jax.Array,
    group_sizes: jax.Array,
    probs: jax.Array | None = None,
    activation: str = "swiglu",
    *,
    recipe: Recipe | None = None,
    save_original_input: bool = False,
    key: jax.Array | None = None,
    quantized_fc1: QuantizedWeight | None = None,
    quantized_fc2: QuantizedWeight | None = None,
) -> jax.Array:
    """The MoE expert block, fused: `(act(x_g @ fc1[g]) · probs_g) @ fc2[g]` per group.

    Args:
      x: (M, K) rows sorted by group (expert).
      fc1: (G, K, 2F) for gated activations (first half activated, second half linear), (G, K,
        F) for plain ones.
      fc2: (G, F, N).
      group_sizes: (G,) int32 rows per expert (clamped at run time as in grouped_dense).
      probs: optional (M,) router probabilities, multiplied in before FC2 (gradient returned).
      activation: one of ops/activations.py's ACTIVATIONS ("swiglu", "geglu", "reglu",
        "sreglu", "qgeglu", "clamped_swiglu", "gelu", "qgelu", "relu", "srelu", "silu").
      recipe: None uses the active autocast recipe; with none, plain lax.ragged_dot GEMMs.
      save_original_input: mode None saves the raw x and recomputes FC2's input instead of
        saving their columnwise copies (both re-quantized in backward).
      key: stochastic-rounding key (NVFP4 gradients); see the module docstring.
      quantized_fc1, quantized_fc2: fc1 and fc2 already quantized per expert
        (`jax_qtrain.quantize_weight`, holding the copies training reads); either may be given.

    Returns: (M, N) in the promoted dtype; rows past the groups are 0.
    """
    if not isinstance(save_original_input, bool):
        raise TypeError(f"save_original_input must be a bool, got {save_original_input!r}")
    recipe = resolve_recipe(recipe)
    kept = (None, None)
    if quantized_fc1 is not None or quantized_fc2 is not None:
        if recipe is None:
            raise ValueError("quantized_fc1/quantized_fc2 need the recipe they were quantized with")
        kept = tuple(
            None if q is None else check_kept_weight(q, w, recipe, argument=name)
            for q, w, name in (
                (quantized_fc1, fc1, "quantized_fc1"),
                (quantized_fc2, fc2, "quantized_fc2"),
            )
        )
    return grouped_mlp_reading(
        kept, x, fc1, fc2, group_sizes, probs, activation, recipe, save_original_input, key
    )


def grouped_mlp_reading(
    kept, x, fc1, fc2, group_sizes, probs, activation, recipe, save_original_input, key
) -> jax.Array:
    """`grouped_mlp` reading `kept`, the (fc1, fc2) per-expert QuantizedTensors to use instead of
    quantizing the kernels (either may be None), which the caller has checked against the
    kernels and `recipe` (resolved): `check_kept_weight` here, `check_kept_shard` for one
    device's experts under expert parallelism (sharding/expert_parallel.py)."""
    _validate(x, fc1, fc2, group_sizes, probs, activation)
    hidden = jnp.promote_types(x.dtype, fc1.dtype)
    if recipe is None:
        sizes = clamp_group_sizes(group_sizes, x.shape[0])
        h = ragged_nn(x, fc1, sizes, out_dtype=hidden)
        a = scaled_activation(h, probs, activation, hidden)
        return ragged_nn(a, fc2, sizes, out_dtype=jnp.promote_types(hidden, fc2.dtype))
    config = _GroupedMLPConfig(
        recipe=recipe,
        activation=activation,
        save_original_input=effective_save_original_input(recipe, save_original_input),
        x_dtype=jnp.dtype(x.dtype),
        fc1_dtype=jnp.dtype(fc1.dtype),
        fc2_dtype=jnp.dtype(fc2.dtype),
    )
    return _grouped_mlp(x, fc1, fc2, probs, group_sizes, key, kept, config)


def unfused_grouped_mlp(
    x: jax.Array,
    fc1: jax.Array,
    fc2: jax.Array,
    group_sizes: jax.Array,
    probs: jax.Array | None = None,
    activation: str = "swiglu",
    *,
    recipe: Recipe | None = None,
    save_original_input: bool = False,
    key: jax.Array | None = None,
) -> jax.Array:
    """The same block as two grouped_dense calls and JAX autodiff of the activation: the
    reference grouped_mlp equals, and what it saves more than (JAX keeps the activation's own
    intermediates and FC2's input in every mode)."""
    _validate(x, fc1, fc2, group_sizes, probs, activation)
    fc1_key, fc2_key = stage_keys(key)
    h = grouped_dense(
        x, fc1, group_sizes, recipe=recipe, save_original_input=save_original_input, key=fc1_key
    )
    a = scaled_activation(h, probs, activation, h.dtype)
    return grouped_dense(
        a, fc2, group_sizes, recipe=recipe, save_original_input=save_original_input, key=fc2_key
    )
