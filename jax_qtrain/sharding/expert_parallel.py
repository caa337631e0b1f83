"""Expert parallelism: each device holds whole experts and the routed rows travel to them.

`expert_parallel_mlp` runs inside `jax.shard_map` over an axis of size P. Each device holds
E/P experts (its slice of the (E, K, 2F) / (E, F, N) kernels, split by expert) and its own routed
rows (one row per token and chosen expert, any order, with the global expert of each row). The
kernels never move; the rows do:

  1. sort the rows by expert (stable), so they are grouped by the device that holds their expert;
  2. all-to-all the rows (and their router probabilities and per-expert counts) to those devices;
  3. on each device, order the received rows by local expert, then by source device, then by
     their order on that device, and run the fused `jax_qtrain.grouped_mlp` on the local experts
     (same recipes, modes and named residuals as the unsharded op);
  4. all-to-all the results back and undo both sorts.

Backward is JAX's transpose of the same program: the output gradient travels the way back, the
expert gradients stay on the expert's device (no reduction, nothing gathered).

The rows of an expert reach its device in exactly the order that stably sorting all devices'
rows (concatenated in device order) by expert gives. So with recipes whose activation scales
are local to a row or to blocks inside one expert's rows (no recipe, MXFP8, FP8 block), the
result is bit for bit the unsharded `grouped_mlp` on the concatenated rows. FP8 per-tensor and
NVFP4 take an amax over the whole input tensor: here each device's received rows form that
tensor, as each TransformerEngine expert-parallel rank quantizes what it received.

Dropless: the all-to-all buffers hold every row a device could send to one device, (P, R, K)
per device for R local rows: P times the rows' bytes. A capacity factor that drops overflow
rows is not offered (it would change results silently).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_qtrain.ops.context import resolve_recipe
from jax_qtrain.ops.grouped_mlp import grouped_mlp_reading
from jax_qtrain.quantize import QuantizedTensor
from jax_qtrain.recipes import Recipe

from .config import QUANTIZE_THEN_GATHER
from .sharded_dense import bound_axis_size
from .sharded_grouped import check_kept_expert_shards


def _check(x, expert_ids, probs, fc1_shard, fc2_shard) -> None:
    if x.ndim != 2:
        raise ValueError(f"x must be (rows, K), got shape {x.shape}")
    if expert_ids.shape != (x.shape[0],) or not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise ValueError(
            f"expert_ids must be integers of shape ({x.shape[0]},) (one per row of x), got "
            f"{expert_ids.dtype}{list(expert_ids.shape)}"
        )
    if probs is not None and probs.shape != (x.shape[0],):
        raise ValueError(f"probs must have shape ({x.shape[0]},), got {probs.shape}")
    if fc1_shard.ndim != 3 or fc2_shard.ndim != 3 or fc1_shard.shape[0] != fc2_shard.shape[0]:
        raise ValueError(
            "fc1_shard and fc2_shard must be (E/P, K, 2F) and (E/P, F, N) with the same number "
            f"of local experts, got {fc1_shard.shape} and {fc2_shard.shape}"
        )
    if fc1_shard.shape[1] != x.shape[1]:
        raise ValueError(f"fc1_shard's K ({fc1_shard.shape[1]}) must equal x's ({x.shape[1]})")


def expert_parallel_mlp(
    x: jax.Array,
    expert_ids: jax.Array,
    probs: jax.Array | None,
    fc1_shard: jax.Array,
    fc2_shard: jax.Array,
    activation: str = "swiglu",
    *,
    axis_name: str,
    recipe: Recipe | None = None,
    save_original_input: bool = False,
    quantized_fc1_shard: QuantizedTensor | None = None,
    quantized_fc2_shard: QuantizedTensor | None = None,
) -> jax.Array:
    """The fused expert MLP with experts spread over `axis_name` (module docstring).

    Args:
      x: (R, K) this device's routed rows, in any order.
      expert_ids: (R,) int, the global expert of each row, in [0, E); E = P · local experts.
        Ids outside that range are not detectable at trace time: their rows come back as zeros.
      probs: optional (R,) router probability of each row (multiplied in before FC2).
      fc1_shard: (E/P, K, 2F) (gated activations) or (E/P, K, F): this device's experts
        (device d holds experts d·E/P ... (d+1)·E/P - 1).
      fc2_shard: (E/P, F, N).
      activation, recipe, save_original_input: as `jax_qtrain.grouped_mlp`.
      quantized_fc1_shard, quantized_fc2_shard: this device's experts' kept quantized copies
        (`ShardedMoE(quantized_weight=True)`; both or neither), read instead of quantizing the
        shards. Each expert is quantized on its own, so they are exactly the local experts'
        part of the whole stack's quantization; nothing about them travels.

    Returns:
      (R, N) in the order of x's rows.
    """
    _check(x, expert_ids, probs, fc1_shard, fc2_shard)
    if not isinstance(save_original_input, bool):
        raise TypeError(f"save_original_input must be a bool, got {save_original_input!r}")
    recipe = resolve_recipe(recipe)
    # Expert parallelism never gathers: the kept shards are read as they are, which is what
    # the gathering strategy's check asks of them too.
    check_kept_expert_shards(
        recipe, QUANTIZE_THEN_GATHER, fc1_shard, fc2_shard, quantized_fc1_shard, quantized_fc2_shard
    )
    devices = bound_axis_size(axis_name, "axis_name", caller="expert_parallel_mlp")
    local_experts = fc1_shard.shape[0]
    rows = x.shape[0]
    expert_ids = expert_ids.astype(jnp.int32)

    # 1. Group the rows by destination device (and by expert within it).
    order = jnp.argsort(expert_ids, stable=True)
    sorted_ids = expert_ids[order]
    valid = (sorted_ids >= 0) & (sorted_ids < devices * local_experts)
    destination = jnp.where(valid, sorted_ids // local_experts, devices)  # `devices`: dropped
    counts = jnp.zeros((devices + 1, local_experts), jnp.int32)
    counts = counts.at[destination, sorted_ids % local_experts].add(1)[:devices]
    sent_per_device = counts.sum(axis=1)
    first_row = jnp.cumsum(sent_per_device) - sent_per_device
    slot = jnp.arange(rows) - first_row[jnp.minimum(destination, devices - 1)]

    def to_buffer(values):  # (R, ...) sorted rows → (P, R, ...) per destination, zero-padded
        buffer = jnp.zeros((devices, rows, *values.shape[1:]), values.dtype)
        return buffer.at[destination, slot].set(values, mode="drop")

    def exchange(buffer):  # buffer[d] goes to device d; result[s] came from device s
        return lax.all_to_all(buffer, axis_name, split_axis=0, concat_axis=0, tiled=True)

    # 2. Rows, probabilities and per-expert counts to the experts' devices.
    received = exchange(to_buffer(x[order]))
    received_counts = exchange(counts)  # (P, E/P): rows from source s for local expert e
    received_probs = None if probs is None else exchange(to_buffer(probs[order]))

    # 3. Received row (s, j) belongs to local expert e when j falls in e's run of source s's
    # rows; padding gets the key `local_experts` and sorts last.
    ends = jnp.cumsum(received_counts, axis=1)  # (P, E/P)
    positions = jnp.arange(rows)
    local_expert = jnp.sum(positions[None, :, None] >= ends[:, None, :], axis=-1)  # (P, R)
    local_order = jnp.argsort(local_expert.reshape(-1), stable=True)
    group_sizes = received_counts.sum(axis=0)
    local_x = received.reshape(devices * rows, -1)[local_order]
    local_probs = (
        None if received_probs is None else received_probs.reshape(devices * rows)[local_order]
    )
    out = grouped_mlp_reading(
        (quantized_fc1_shard, quantized_fc2_shard),
        local_x,
        fc1_shard,
        fc2_shard,
        group_sizes,
        local_probs,
        activation,
        recipe,
        save_original_input,
        None,  # no stochastic-rounding key: as grouped_mlp's default
    )

    # 4. Back to the source devices, then to the rows' own order.
    out = jnp.zeros_like(out).at[local_order].set(out).reshape(devices, rows, -1)
    returned = exchange(out)  # returned[d]: the results of the rows this device sent to d
    y_sorted = returned[jnp.minimum(destination, devices - 1), slot]
    y_sorted = jnp.where(valid[:, None], y_sorted, jnp.zeros_like(y_sorted))
    return jnp.zeros_like(y_sorted).at[order].set(y_sorted)
