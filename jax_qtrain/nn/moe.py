"""`MoE`: a dropless mixture-of-experts feed-forward block on the fused `GroupedMLP`.

For tokens x (T, H) (leading dims flattened):

1. Router (float32, never quantized): probs = softmax(x · W_router), (T, E); each token's top-k
   experts and their probabilities, renormalized to sum to 1 when `normalize_top_k` (Mixtral;
   Switch with k = 1 keeps the raw probability).
2. Permutation: the T·k (token, expert) assignments sorted by expert (stably, so tokens keep
   their order inside an expert); group_sizes = assignments per expert.
3. Experts: `GroupedMLP(x_sorted, group_sizes, probs_sorted)`: each row is scaled by its router
   probability before FC2 (as TE's fused grouped MLP), so the router learns through it.
4. Un-permutation: each assignment's output back at its (token, slot), summed over the k
   slots in float32.

Load balancing (Switch Transformer eq. 4, GShard): aux = coef · E · Σ_e f_e · P_e, with f_e the
fraction of the T·k assignments routed to expert e (no gradient) and P_e the mean router
probability of e over the tokens. It equals coef when routing is perfectly uniform. The block
sows it as `nnx.Intermediate` "aux_loss" (and the per-expert counts as "tokens_per_expert"),
each holding the latest call's value; `return_aux_loss=True` returns it too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jax_qtrain.nn.grouped import GroupedMLP, default_expert_kernel_init
from jax_qtrain.nn.linear import check_positive_sizes
from jax_qtrain.recipes import Recipe

default_router_init = nnx.initializers.normal(0.02)


def route_top_k(
    logits: jax.Array, top_k: int, *, normalize_top_k: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(router probs (T, E), top-k probabilities (T, k), top-k expert ids (T, k) int32)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top_probs, top_experts = lax.top_k(probs, top_k)
    if normalize_top_k:
        top_probs = top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)
    return probs, top_probs, top_experts.astype(jnp.int32)


def expert_counts(top_experts: jax.Array, num_experts: int) -> jax.Array:
    """(E,) int32: how many of the assignments `top_experts` (any shape) chose each expert.

    `jnp.bincount`'s counts, as a compare-and-sum (one fused reduction) instead of its
    scatter-add, whose atomics on the GPU all land on E addresses."""
    flat = top_experts.reshape(-1, 1)
    chosen = flat == jnp.arange(num_experts, dtype=flat.dtype)
    return jnp.sum(chosen, axis=0, dtype=jnp.int32)


def load_balancing_loss(probs: jax.Array, top_experts: jax.Array) -> jax.Array:
    """E · Σ_e f_e · P_e (Switch / GShard), f_e from the top-k assignments, P_e = mean probs."""
    num_experts = probs.shape[-1]
    counts = expert_counts(top_experts, num_experts)
    fraction = lax.stop_gradient(counts / top_experts.size)
    return num_experts * jnp.sum(fraction * jnp.mean(probs, axis=0))


def permute_by_expert(
    top_experts: jax.Array, num_experts: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(order: assignment index of each sorted row, inverse: sorted row of each assignment,
    group_sizes (E,) int32) for the T·k assignments in row-major (token, slot) order."""
    flat = top_experts.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    # `order` is a permutation: each slot written once (no atomics needed).
    inverse = (
        jnp.zeros_like(order)
        .at[order]
        .set(jnp.arange(order.size, dtype=jnp.int32), unique_indices=True)
    )
    group_sizes = expert_counts(flat, num_experts)
    return order, inverse, group_sizes


def dispatch_tokens(tokens: jax.Array, order: jax.Array, inverse: jax.Array, top_k: int):
    """tokens[order // top_k]: each token's row once per chosen expert, in expert order.

    `tokens` (T, H); `order` and `inverse` (T·k,) int, `permute_by_expert`'s. Same values as
    `jnp.take`, but its transpose sums each token's k row gradients in slot order, in float32
    (a gather by `inverse`, then a sum over k), where `jnp.take`'s would scatter-add them: on
    GPU XLA picks that order per program (not index order), so two programs computing one dx
    differed by up to 128 ulps on the H200 (docs/layers.md, "Deterministic un-permutation").
    """
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be (tokens, features), got shape {tuple(tokens.shape)}")
    assignments = (tokens.shape[0] * top_k,)
    for name, indices in (("order", order), ("inverse", inverse)):
        if tuple(indices.shape) != assignments or not jnp.issubdtype(indices.dtype, jnp.integer):
            raise ValueError(
                f"{name} must be an int array of shape {assignments} (tokens × top_k), got "
                f"{indices.dtype}{list(indices.shape)}"
            )
    return _dispatch_tokens(tokens, order, inverse, top_k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dispatch_tokens(tokens, order, inverse, top_k):
    return jnp.take(tokens, order // top_k, axis=0)


def _dispatch_tokens_fwd(tokens, order, inverse, top_k):
    # Residuals: (inverse (T·k,) int,).
    return jnp.take(tokens, order // top_k, axis=0), (inverse,)


def _dispatch_tokens_bwd(top_k, residuals, row_grads):
    (inverse,) = residuals
    per_slot = jnp.take(row_grads, inverse, axis=0).astype(jnp.float32)
    per_slot = per_slot.reshape(-1, top_k, row_grads.shape[-1])
    # A left fold of elementwise adds, not jnp.sum: XLA's GPU reduction picks its own order
    # (1 ulp off the slot order for k = 3 on the H200), and adds are never reassociated.
    total = per_slot[:, 0]
    for slot in range(1, top_k):
        total = total + per_slot[:, slot]
    return total.astype(row_grads.dtype), None, None


_dispatch_tokens.defvjp(_dispatch_tokens_fwd, _dispatch_tokens_bwd)


def permute_rows(rows: jax.Array, index: jax.Array, inverse: jax.Array) -> jax.Array:
    """rows[index] for a permutation `index` of rows' first axis, `inverse` its inverse.

    Same values as `jnp.take(rows, index, axis=0)`, but the transpose is the gather
    `grads[inverse]` instead of `jnp.take`'s scatter-add: a permutation puts exactly one row
    gradient in each row, so nothing is summed, and on the GPU XLA's scatter-add of 16-bit
    rows is an atomic loop (the h200 preset's MoE combine spent 0.9 ms a layer in it; stop 22,
    docs/benchmarks.md). `permute_by_expert`'s `order` and `inverse` are such a pair.
    """
    if rows.ndim < 1 or index.shape != (rows.shape[0],) or inverse.shape != index.shape:
        raise ValueError(
            f"index and inverse must both have shape ({rows.shape[0] if rows.ndim else '?'},) "
            f"(rows' first axis), got {tuple(index.shape)} and {tuple(inverse.shape)} for rows "
            f"of shape {tuple(rows.shape)}"
        )
    for name, indices in (("index", index), ("inverse", inverse)):
        if not jnp.issubdtype(indices.dtype, jnp.integer):
            raise ValueError(f"{name} must be an int array, got {indices.dtype}")
    return _permute_rows(rows, index, inverse)


@jax.custom_vjp
def _permute_rows(rows, index, inverse):
    return jnp.take(rows, index, axis=0)


def _permute_rows_fwd(rows, index, inverse):
    # Residuals: (inverse (R,) int,).
    return jnp.take(rows, index, axis=0), (inverse,)


def _permute_rows_bwd(residuals, grads):
    (inverse,) = residuals
    return jnp.take(grads, inverse, axis=0), None, None


_permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def combine_slots(expert_out: jax.Array, order: jax.Array, inverse: jax.Array, top_k: int):
    """(T, H): each token's k expert rows (`expert_out` (T·k, H) in expert order, already scaled
    by the router probabilities) summed in float32 in slot order, in expert_out's dtype."""
    per_slot = permute_rows(expert_out, inverse, order)
    per_slot = per_slot.reshape(-1, top_k, expert_out.shape[-1]).astype(jnp.float32)
    return jnp.sum(per_slot, axis=1).astype(expert_out.dtype)


def _latest(previous, new):
    del previous
    return new


def _nothing():
    return None


class MoE(nnx.Module):
    """Top-k routed, dropless MoE block (module docstring).

    Args:
      in_features: hidden size H (also the output size).
      ffn_features: each expert's FFN size F.
      num_experts: E.
      top_k: experts per token (default 2).
      activation: the experts' activation (default "swiglu").
      normalize_top_k: renormalize the top-k probabilities to sum to 1 (default True).
      aux_loss_coef: scale of the load-balancing loss (default 0.01).
      recipe: the experts' recipe (static; None follows autocast). The router is not quantized.
      save_original_input: see `jax_qtrain.grouped_mlp`.
      quantized_weight: keep the experts' quantized copies (`experts.quantized_fc1_kernel`,
        `experts.quantized_fc2_kernel`; needs `recipe`), refreshed by `jax_qtrain.nn.Optimizer`
        (docs/quantized_weights.md).
      dtype: the experts' compute dtype; param_dtype: stored parameters' dtype.
      kernel_init: the experts' initializer; router_init: the router's.
      rngs: the parameter RNG stream.
    """

    def __init__(
        self,
        in_features: int,
        ffn_features: int,
        num_experts: int,
        *,
        top_k: int = 2,
        activation: str = "swiglu",
        normalize_top_k: bool = True,
        aux_loss_coef: float = 1e-2,
        recipe: Recipe | None = None,
        save_original_input: bool = False,
        quantized_weight: bool = False,
        dtype=None,
        param_dtype=jnp.float32,
        kernel_init=default_expert_kernel_init,
        router_init=default_router_init,
        rngs: nnx.Rngs,
    ):
        check_positive_sizes(top_k=top_k, num_experts=num_experts)
        if top_k > num_experts:
            raise ValueError(f"top_k ({top_k}) must be at most num_experts ({num_experts})")
        self.router = nnx.Linear(
            in_features,
            num_experts,
            use_bias=False,
            dtype=jnp.float32,
            param_dtype=param_dtype,
            kernel_init=router_init,
            rngs=rngs,
        )
        self.experts = GroupedMLP(
            num_experts,
            in_features,
            ffn_features,
            activation=activation,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=kernel_init,
            recipe=recipe,
            save_original_input=save_original_input,
            quantized_weight=quantized_weight,
            rngs=rngs,
        )
        self.in_features, self.ffn_features, self.num_experts = (
            in_features,
            ffn_features,
            num_experts,
        )
        self.top_k = top_k
        self.normalize_top_k = normalize_top_k
        self.aux_loss_coef = aux_loss_coef
        # Created here so that sowing into them does not change the module's structure (which
        # would retrace a jitted train step once).
        self.aux_loss = nnx.Intermediate(jnp.zeros((), jnp.float32))
        self.tokens_per_expert = nnx.Intermediate(jnp.zeros((num_experts,), jnp.int32))

    def __call__(self, x: jax.Array, *, return_aux_loss: bool = False):
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x's last dim must be {self.in_features}, got {x.shape[-1]}")
        tokens = x.reshape(-1, self.in_features)
        probs, top_probs, top_experts = route_top_k(
            self.router(tokens.astype(jnp.float32)),
            self.top_k,
            normalize_top_k=self.normalize_top_k,
        )
        order, inverse, group_sizes = permute_by_expert(top_experts, self.num_experts)
        expert_out = self.experts(
            dispatch_tokens(tokens, order, inverse, self.top_k),
            group_sizes,
            permute_rows(top_probs.reshape(-1), order, inverse),
        )
        y = combine_slots(expert_out, order, inverse, self.top_k)

        aux_loss = self.aux_loss_coef * load_balancing_loss(probs, top_experts)
        # The latest call's values (flax's default appends to a tuple: a growing structure).
        for name, value in (("aux_loss", aux_loss), ("tokens_per_expert", group_sizes)):
            self.sow(nnx.Intermediate, name, value, reduce_fn=_latest, init_fn=_nothing)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return (y, aux_loss) if return_aux_loss else y
