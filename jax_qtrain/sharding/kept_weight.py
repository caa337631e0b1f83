"""Kept quantized weights with a split kernel: `SplitKernelLayout`.

`ShardedLinear(quantized_weight=True)` keeps its kernel's quantized copies (a `QuantizedWeight`,
docs/quantized_weights.md) split the way the kernel is: each device holds the codes and block
scales of its own shard of each copy, and the per-tensor values (FP8's scale, NVFP4's global
amax) replicated. The copies are made by quantizing each shard as part of the whole kernel
(`Split.quantize_shard`: per-tensor amaxes max-reduced over the axis, every block inside one
shard), so as global arrays they are bit for bit the whole kernel's quantization. A forward then
gathers the fprop copy's bytes, as strategy "quantize_then_gather" does, without quantizing.

The layout travels with the `QuantizedWeight` (its static metadata), so every refresh after an
optimizer update quantizes the shards again and the kept copies stay split.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import PartitionSpec

from jax_qtrain.quantize import QuantizedTensor, quantize
from jax_qtrain.recipes import Recipe

from .config import QUANTIZE_THEN_GATHER, WeightSharding, check_kernel_dim, laid_out
from .gather import Split


@dataclasses.dataclass(frozen=True)
class SplitKernelLayout:
    """A (K, N) kernel's quantized copies split as `sharding` splits the kernel (a
    `jax_qtrain.WeightLayout`: pass it to `quantize_weight(..., layout=...)`)."""

    sharding: WeightSharding

    def __post_init__(self):
        if not isinstance(self.sharding, WeightSharding):
            raise TypeError(
                f"sharding must be a WeightSharding, got {type(self.sharding).__name__}"
            )
        check_kernel_dim(self.sharding.kernel_dim)  # one (K, N) kernel, not a stack of experts
        if self.sharding.strategy != QUANTIZE_THEN_GATHER:
            raise ValueError(
                f"a kept quantized weight is kept as quantized shards, which the forward gathers: "
                f"it needs strategy={QUANTIZE_THEN_GATHER!r}, got {self.sharding.strategy!r}"
            )

    @property
    def split(self) -> Split:
        return Split(self.sharding.axis, self.sharding.kernel_dim)

    def describe(self) -> str:
        return (
            f"split over mesh axis {self.sharding.axis!r} along kernel dim "
            f"{self.sharding.kernel_dim}"
        )

    def leaf_specs(self, tensor: QuantizedTensor) -> dict[str, PartitionSpec]:
        """The PartitionSpec of each leaf `tensor` holds: codes and block scales split along
        their copy's stored axis of the split dim, per-tensor values replicated."""
        specs = {}
        for name in QuantizedTensor._LEAF_FIELDS:
            leaf = getattr(tensor, name)
            if leaf is None:
                continue
            parts: list[str | None] = [None] * len(leaf.shape)
            if len(leaf.shape) == 2:
                usage = "rowwise" if name.startswith("rowwise") else "columnwise"
                parts[self.split.stored_axis(usage)] = self.sharding.axis
            specs[name] = PartitionSpec(*parts)
        return specs

    def shard_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """One device's shard of a (K, N) kernel of `shape`."""
        dim, size = self.sharding.kernel_dim, self.sharding.axis_size
        if len(shape) != 2 or shape[dim] % size:
            raise ValueError(
                f"the kernel {tuple(shape)} must be (in_features, out_features) with dim {dim} a "
                f"multiple of {size}, the size of mesh axis {self.sharding.axis!r}"
            )
        shard = list(shape)
        shard[dim] //= size
        return tuple(shard)

    def quantize_copies(
        self, weight: jax.Array, recipe: Recipe, *, rowwise: bool, columnwise: bool
    ) -> QuantizedTensor:
        """`quantize(weight, recipe, "weight", ...)` computed shard by shard on the mesh, its
        codes and scales left split (module docstring)."""
        usages = [u for u, wanted in (("rowwise", rowwise), ("columnwise", columnwise)) if wanted]
        self.split.check_block_aligned(
            self.shard_shape(tuple(weight.shape)),
            recipe.spec("weight"),
            usages,
            remedy="a kept quantized weight is kept as quantized shards, so it needs",
        )
        whole = jax.eval_shape(
            lambda w: quantize(w, recipe, "weight", rowwise=rowwise, columnwise=columnwise),
            jax.ShapeDtypeStruct(weight.shape, weight.dtype),
        )
        specs = self.leaf_specs(whole)

        def per_device(kernel_shard):
            q = self.split.quantize_shard(
                kernel_shard, recipe, rowwise=rowwise, columnwise=columnwise
            )
            return {name: getattr(q, name) for name in specs}

        sharding = self.sharding
        fields = jax.shard_map(
            per_device, mesh=sharding.mesh, in_specs=sharding.kernel_spec(), out_specs=specs
        )(laid_out(weight, sharding.kernel_spec(), sharding.mesh))
        return QuantizedTensor(
            spec=recipe.spec("weight"), shape=tuple(weight.shape), dtype=weight.dtype, **fields
        )

    def operands(self, tensor: QuantizedTensor) -> tuple[dict, dict]:
        """(leaves, PartitionSpecs) of a kept tensor, for a shard_map's operands."""
        specs = self.leaf_specs(tensor)
        return {name: getattr(tensor, name) for name in specs}, specs

    def local(self, tensor: QuantizedTensor, leaves: dict) -> QuantizedTensor:
        """Inside the shard_map: this device's shard of `tensor`, from its local `leaves`."""
        return QuantizedTensor(
            spec=tensor.spec, shape=self.shard_shape(tensor.shape), dtype=tensor.dtype, **leaves
        )
