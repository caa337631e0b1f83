"""Mesh-axis typing of kernel outputs inside `jax.shard_map`.

Under shard_map, JAX types every value with the mesh axes it varies over, and uses the types: a
custom_vjp whose cotangent is typed differently from its primal is an error, and a value typed
invariant may leave the shard_map as replicated (out_specs without the axis), one device's copy
standing for all. `plgpu.kernel` types its outputs invariant whatever its inputs, so a kernel run
on one device's shard of x would hand back codes typed as if every device held the same ones.
Every launch here therefore types its outputs as varying over each axis any of its inputs varies
over (a type-only cast: nothing runs).
"""

from __future__ import annotations

import jax
from jax import lax


def _varying_axes(value) -> frozenset:
    manual = getattr(jax.typeof(value), "manual_axis_type", None)
    return frozenset() if manual is None else frozenset(manual.varying)


def varying_like(outputs, *inputs):
    """`outputs` (a pytree of arrays), each typed varying over the union of the mesh axes the
    array leaves of `inputs` vary over. Outside shard_map that union is empty: a no-op."""
    axes = frozenset().union(
        *(_varying_axes(x) for x in jax.tree.leaves(inputs) if isinstance(x, jax.Array))
    )
    if not axes:
        return outputs

    def cast(out):
        missing = axes - _varying_axes(out)
        return lax.pcast(out, tuple(sorted(missing)), to="varying") if missing else out

    return jax.tree.map(cast, outputs)
