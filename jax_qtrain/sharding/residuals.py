"""What each device saves for backward inside `jax.shard_map`, and where.

`jax_qtrain.saved_residuals` on a function that calls `jax.shard_map` sees the shard_map's
residuals as its unnamed outputs, stacked over devices. `per_device_saved_residuals` lists them
as the per-device body saves them: with their checkpoint names, each device's shapes, and the
memory they live in (a `save_and_offload_only_these_names` policy moves some to the host; JAX
then reports those as outputs of the device_put that moved them, without their names).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jax._src import ad_checkpoint as _ad_checkpoint  # pinned jax==0.11.2
from jax._src import core as _core  # pinned jax==0.11.2: binds mesh axes for tracing
from jax.sharding import Mesh

from jax_qtrain.ops.residuals import Residual, saved_residuals


@dataclasses.dataclass(frozen=True)
class DeviceResidual(Residual):
    """A `Residual` of one device, with the memory it is kept in: "device" or "host"."""

    memory: str = "device"


def per_device_saved_residuals(fn: Callable, mesh: Mesh, *args, **kwargs) -> list[DeviceResidual]:
    """`jax_qtrain.saved_residuals(fn, *args)` for `fn`, the body of a `jax.shard_map` over
    `mesh`, called on one device's arguments (arrays or `jax.ShapeDtypeStruct`s of the local
    shapes). The mesh axes are bound, so collectives in `fn` trace."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    with _core.extend_axis_env_nd(tuple(mesh.shape.items())):
        listed = saved_residuals(fn, *args, **kwargs)
        avals = [aval for aval, _ in _ad_checkpoint.saved_residuals(fn, *args, **kwargs)]
    return [
        DeviceResidual(
            **dataclasses.asdict(residual),
            memory="host" if "host" in str(getattr(aval, "memory_space", "")).lower() else "device",
        )
        for residual, aval in zip(listed, avals, strict=True)
    ]
