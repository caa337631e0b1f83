"""Cross-device sums whose float additions happen in mesh order (inside `jax.shard_map`).

`lax.psum` and `lax.psum_scatter` add the devices' values in whatever order the collective
implementation picks — XLA:CPU within a process, gloo or NCCL across processes, a ring or a tree —
so the same program on the same mesh can round differently on another process layout. The
ordered versions move the values instead (an all-gather, or an all-to-all of the chunks each
device owns: the same bytes per device as psum_scatter's ring) and add them on every device left
to right in mesh order, so the result depends on nothing but the values. An MoE router turns
last-bit differences into different top-k choices a few steps later; this keeps runs on
different layouts bit for bit equal (`WeightSharding(deterministic=True)`).
"""

from __future__ import annotations

import functools

import jax
from jax import lax


def _axes(axis_names) -> tuple[str, ...]:
    return (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)


def _sum_in_order(stacked: jax.Array) -> jax.Array:
    """stacked[0] + stacked[1] + ... , left to right."""
    total = stacked[0]
    for i in range(1, stacked.shape[0]):
        total = total + stacked[i]
    return total


def ordered_psum(x: jax.Array, axis_names) -> jax.Array:
    """`lax.psum(x, axis_names)`, summed in mesh order (the first axis outermost)."""
    axes = _axes(axis_names)
    if not axes:
        return x
    # "invarying": the sum is the same on every device, as psum's (shard_map's vma types).
    return _sum_in_order(lax.all_gather(x, axes, axis=0, to="invarying"))


def ordered_psum_scatter(x: jax.Array, axis_name: str, *, scatter_dimension: int) -> jax.Array:
    """`lax.psum_scatter(x, axis_name, scatter_dimension=..., tiled=True)`, summed in mesh
    order: every device receives the other devices' copies of its chunk (an all-to-all) and adds
    them up itself."""
    size = lax.axis_size(axis_name)
    shape = x.shape
    if shape[scatter_dimension] % size:
        raise ValueError(
            f"dim {scatter_dimension} of {tuple(shape)} is not a multiple of the {size} devices "
            f"of axis {axis_name!r}"
        )
    # (..., P, chunk, ...) → chunk p of every device lands on device p, stacked by sender.
    chunks = x.reshape(
        *shape[:scatter_dimension],
        size,
        shape[scatter_dimension] // size,
        *shape[scatter_dimension + 1 :],
    )
    chunks = jax.numpy.moveaxis(chunks, scatter_dimension, 0)
    received = lax.all_to_all(chunks, axis_name, split_axis=0, concat_axis=0, tiled=True)
    return _sum_in_order(received)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def replicated_input(x: jax.Array, axis_names: tuple[str, ...]) -> jax.Array:
    """`x`, replicated over `axis_names`, made device-varying for use with per-device values;
    its gradient (the sum of the devices' cotangents) is an `ordered_psum`, where the implicit
    conversion would `psum`."""
    return lax.pcast(x, axis_names, to="varying")


def _replicated_input_fwd(x, axis_names):
    """Forward. No residuals."""
    return replicated_input(x, axis_names), None


def _replicated_input_bwd(axis_names, residuals, cotangent):
    del residuals
    return (ordered_psum(cotangent, axis_names),)


replicated_input.defvjp(_replicated_input_fwd, _replicated_input_bwd)


def psum(x: jax.Array, axis_names, *, deterministic: bool) -> jax.Array:
    """`lax.psum`, or with `deterministic` the `ordered_psum`."""
    if deterministic:
        return ordered_psum(x, axis_names)
    return lax.psum(x, _axes(axis_names)) if _axes(axis_names) else x


def psum_scatter(
    x: jax.Array, axis_name: str, *, scatter_dimension: int, deterministic: bool
) -> jax.Array:
    """`lax.psum_scatter(tiled=True)`, or with `deterministic` the `ordered_psum_scatter`."""
    if deterministic:
        return ordered_psum_scatter(x, axis_name, scatter_dimension=scatter_dimension)
    return lax.psum_scatter(x, axis_name, scatter_dimension=scatter_dimension, tiled=True)
