"""`WeightSharding`: how a layer's weight is split over a mesh axis, and how it is gathered.

FSDP (ZeRO-3) keeps each weight split over a mesh axis; a layer gathers the whole weight just
before its GEMM and drops it right after. The batch is split over the same axis (and possibly
others), so the weight gradient, a sum over the batch, is reduce-scattered back to the shards.

Two ways to gather a weight that is about to be quantized:

  "quantize_then_gather"  quantize each shard (per-tensor amaxes max-reduced over the axis, so the
                          result equals quantizing the whole weight), then all-gather the codes
                          and scales: 1 byte per element for the FP8 formats, ~0.5 for NVFP4.
                          The shard must be a whole number of quantization blocks along the split
                          dim. The default (docs/distributed.md has the comparison).
  "gather_then_quantize"  all-gather the high-precision shards (2 bytes per element in bf16, 4 in
                          float32), then quantize the whole weight. Works for any shard size.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Strategy = Literal["quantize_then_gather", "gather_then_quantize"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)
QUANTIZE_THEN_GATHER, GATHER_THEN_QUANTIZE = STRATEGIES
DEFAULT_STRATEGY: Strategy = QUANTIZE_THEN_GATHER


def check_strategy(strategy) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {list(STRATEGIES)}, got {strategy!r}")


EXPERTS = "experts"  # kernel_dim of a stack of expert kernels (G, K, N) split by expert


def check_kernel_dim(kernel_dim, *, grouped: bool = False) -> None:
    allowed = (0, 1, EXPERTS) if grouped else (0, 1)
    if isinstance(kernel_dim, bool) or kernel_dim not in allowed:
        raise ValueError(
            "kernel_dim must be 0 (split in_features) or 1 (split out_features)"
            + (' or "experts" (split the experts)' if grouped else "")
            + f", got {kernel_dim!r}"
        )


def normalize_axes(axes, argument: str) -> tuple[str, ...]:
    """A mesh axis name or a sequence of them → a non-empty tuple of names."""
    if isinstance(axes, str):
        return (axes,)
    if isinstance(axes, tuple | list) and axes and all(isinstance(a, str) for a in axes):
        return tuple(axes)
    raise TypeError(f"{argument} must be a mesh axis name or a sequence of them, got {axes!r}")


@dataclasses.dataclass(frozen=True)
class WeightSharding:
    """A layer's kernel split over one mesh axis (FSDP), its input batch split over `batch_axes`.

    Attributes:
      mesh: the `jax.sharding.Mesh` the layer runs on.
      axis: the mesh axis the kernel is split over.
      kernel_dim: which kernel dim is split: 0 (in_features, the default) or 1 (out_features);
        for expert kernels (G, in, out) also "experts" (each device holds G/P whole experts).
      batch_axes: the mesh axes that split the input's leading (batch) dim, in order; None means
        `(axis,)`. Must include `axis`: the kernel gradient is reduce-scattered over `axis` and
        summed over the other batch axes.
      strategy: "quantize_then_gather" (default) or "gather_then_quantize" (module docstring).
      deterministic: add the devices' float32 gradient partial sums (and, in ShardedMoE, the
        router gradient and load-balancing statistics) in mesh order on every device
        (reductions.py), so results do not depend on the collective implementation or the
        process layout. The same bytes move (an all-to-all instead of a reduce-scatter).

    Hashable and compared by value, so it can be a static attribute of a Flax module.
    """

    mesh: Mesh
    axis: str
    kernel_dim: int = 0
    batch_axes: tuple[str, ...] | None = None
    strategy: Strategy = DEFAULT_STRATEGY
    deterministic: bool = False

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(self.mesh).__name__}")
        names = tuple(self.mesh.axis_names)
        if not isinstance(self.axis, str) or self.axis not in names:
            raise ValueError(f"axis {self.axis!r} is not an axis of the mesh (axes: {names})")
        check_kernel_dim(self.kernel_dim, grouped=True)
        batch_axes = (
            (self.axis,)
            if self.batch_axes is None
            else normalize_axes(self.batch_axes, "batch_axes")
        )
        for name in batch_axes:
            if name not in names:
                raise ValueError(f"batch_axes: {name!r} is not an axis of the mesh (axes: {names})")
        if len(set(batch_axes)) != len(batch_axes):
            raise ValueError(f"batch_axes must not repeat an axis, got {batch_axes}")
        if self.axis not in batch_axes:
            raise ValueError(
                f"batch_axes {batch_axes} must include the kernel's axis {self.axis!r}: FSDP "
                "splits the batch over the axis it splits the weights over"
            )
        object.__setattr__(self, "batch_axes", batch_axes)
        check_strategy(self.strategy)
        if not isinstance(self.deterministic, bool):
            raise TypeError(f"deterministic must be a bool, got {self.deterministic!r}")

    @property
    def axis_size(self) -> int:
        """How many shards the kernel is split into."""
        return int(self.mesh.shape[self.axis])

    @property
    def batch_size_divisor(self) -> int:
        """The input's batch dim must be a multiple of this (the product of the batch axes)."""
        size = 1
        for name in self.batch_axes:
            size *= int(self.mesh.shape[name])
        return size

    def kernel_spec(self, ndim: int = 2) -> PartitionSpec:
        """The kernel's PartitionSpec, for a (K, N) kernel (ndim 2) or a (G, K, N) stack of
        expert kernels (ndim 3): `kernel_dim` over `axis`."""
        if ndim not in (2, 3) or (ndim == 2 and self.kernel_dim == EXPERTS):
            raise ValueError(
                f"kernel_spec: kernel_dim={self.kernel_dim!r} does not split a rank-{ndim} kernel"
            )
        parts: list[str | None] = [None] * ndim
        parts[0 if self.kernel_dim == EXPERTS else ndim - 2 + self.kernel_dim] = self.axis
        return PartitionSpec(*parts)

    def batch_spec(self) -> PartitionSpec:
        """The input's PartitionSpec: its leading dim over `batch_axes`."""
        axes = self.batch_axes
        return PartitionSpec(axes[0] if len(axes) == 1 else axes)

    def shard_kernel(self, kernel: jax.Array) -> jax.Array:
        """`kernel` placed on the mesh, split as `kernel_spec` says."""
        return jax.device_put(kernel, NamedSharding(self.mesh, self.kernel_spec(kernel.ndim)))

    def shard_batch(self, x: jax.Array) -> jax.Array:
        """`x` placed on the mesh, its leading dim split over `batch_axes`."""
        return jax.device_put(x, NamedSharding(self.mesh, self.batch_spec()))


def laid_out(array: jax.Array, spec, mesh) -> jax.Array:
    """`array` resharded to `spec` on an Explicit mesh (where shard_map requires its inputs to be
    laid out already); on an Auto mesh shard_map reshards by itself."""
    explicit = jax.sharding.AxisType.Explicit
    if any(axis_type == explicit for axis_type in mesh.axis_types):
        return jax.reshard(array, NamedSharding(mesh, spec))
    return array
