"""Kept quantized weights with a split kernel: `SplitKernelLayout`.

`ShardedLinear(quantized_weight=True)` keeps its kernel's quantized copies (a `QuantizedWeight`,
docs/quantized_weights.md) split the way the kernel is: each device holds the codes and block
scales of its own shard of each copy, and the per-tensor values (FP8's scale, NVFP4's global
amax) replicated. `ShardedMoE(quantized_weight=True)` does the same for its (G, K, N) expert
stacks (`stacked=True`, each expert with its own scales): split along every expert's K or N, or
over the experts, when each device's experts' per-expert values are split with them too.

The copies are made by quantizing each shard as part of the whole kernel (`Split.quantize_shard`:
per-tensor amaxes max-reduced over the axis, every block inside one shard), so as global arrays
they are bit for bit the whole kernel's quantization (per expert for a stack). A forward then
gathers the fprop copy's bytes, as strategy "quantize_then_gather" does, without quantizing.

The layout travels with the `QuantizedWeight` (its static metadata), so every refresh after an
optimizer update quantizes the shards again and the kept copies stay split.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import PartitionSpec

from jax_qtrain.quantize import QuantizedTensor
from jax_qtrain.recipes import Recipe

from .config import QUANTIZE_THEN_GATHER, WeightSharding, check_kernel_dim, laid_out
from .gather import Split


@dataclasses.dataclass(frozen=True)
class SplitKernelLayout:
    """A (K, N) kernel's — or with `stacked`, a (G, K, N) stack of expert kernels' — quantized
    copies split as `sharding` splits the kernel (a `jax_qtrain.WeightLayout`: pass it to
    `quantize_weight(..., layout=...)`)."""

    sharding: WeightSharding
    stacked: bool = False

    def __post_init__(self):
        if not isinstance(self.sharding, WeightSharding):
            raise TypeError(
                f"sharding must be a WeightSharding, got {type(self.sharding).__name__}"
            )
        if not isinstance(self.stacked, bool):
            raise TypeError(f"stacked must be a bool, got {self.stacked!r}")
        # "experts" splits a stack only.
        check_kernel_dim(self.sharding.kernel_dim, grouped=self.stacked)
        if self.sharding.strategy != QUANTIZE_THEN_GATHER:
            raise ValueError(
                f"a kept quantized weight is kept as quantized shards, which the forward gathers: "
                f"it needs strategy={QUANTIZE_THEN_GATHER!r}, got {self.sharding.strategy!r}"
            )

    @property
    def split(self) -> Split:
        return Split(self.sharding.axis, self.sharding.kernel_dim, stacked=self.stacked)

    @property
    def weight_rank(self) -> int:
        return 3 if self.stacked else 2

    def describe(self) -> str:
        where = (
            "over the experts"
            if self.split.splits_experts
            else f"along {'every expert kernel' if self.stacked else 'kernel'} dim "
            f"{self.sharding.kernel_dim}"
        )
        return f"split over mesh axis {self.sharding.axis!r} {where}"

    def leaf_specs(self, tensor: QuantizedTensor) -> dict[str, PartitionSpec]:
        """The PartitionSpec of each leaf `tensor` holds: codes and block scales split along
        their copy's stored axis of the split dim; per-tensor values replicated, or for a split
        over the experts split with their experts."""
        specs = {}
        for name in QuantizedTensor._LEAF_FIELDS:
            leaf = getattr(tensor, name)
            if leaf is None:
                continue
            parts: list[str | None] = [None] * len(leaf.shape)
            if len(leaf.shape) == self.weight_rank or (leaf.shape and self.split.splits_experts):
                usage = "rowwise" if name.startswith("rowwise") else "columnwise"
                parts[self.split.stored_axis(usage)] = self.sharding.axis
            specs[name] = PartitionSpec(*parts)
        return specs

    def shard_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """One device's shard of a weight of `shape` ((K, N), or (G, K, N) when stacked)."""
        dim, size = self.split.array_dim, self.sharding.axis_size
        if len(shape) != self.weight_rank or shape[dim] % size:
            what = (
                "(num_experts, in_features, out_features)"
                if self.stacked
                else ("(in_features, out_features)")
            )
            raise ValueError(
                f"the kernel {tuple(shape)} must be {what} with dim {dim} a multiple of {size}, "
                f"the size of mesh axis {self.sharding.axis!r}"
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
            lambda w: self.split.quantize_whole(w, recipe, rowwise=rowwise, columnwise=columnwise),
            jax.ShapeDtypeStruct(weight.shape, weight.dtype),
        )
        specs = self.leaf_specs(whole)

        def per_device(kernel_shard):
            q = self.split.quantize_shard(
                kernel_shard, recipe, rowwise=rowwise, columnwise=columnwise
            )
            return {name: getattr(q, name) for name in specs}

        sharding = self.sharding
        kernel_spec = sharding.kernel_spec(self.weight_rank)
        fields = jax.shard_map(
            per_device, mesh=sharding.mesh, in_specs=kernel_spec, out_specs=specs
        )(laid_out(weight, kernel_spec, sharding.mesh))
        return QuantizedTensor(spec=whole.spec, shape=whole.shape, dtype=weight.dtype, **fields)

    def operands(self, tensor: QuantizedTensor) -> tuple[dict, dict]:
        """(leaves, PartitionSpecs) of a kept tensor, for a shard_map's operands."""
        specs = self.leaf_specs(tensor)
        return {name: getattr(tensor, name) for name in specs}, specs

    def local(self, tensor: QuantizedTensor, leaves: dict) -> QuantizedTensor:
        """Inside the shard_map: this device's shard of `tensor`, from its local `leaves`. (A
        stack's tensor has one expert kernel's (K, N) shape, as `quantize_per_expert` gives.)"""
        shape = list(tensor.shape)
        if not self.split.splits_experts:
            shape[self.sharding.kernel_dim] //= self.sharding.axis_size
        return QuantizedTensor(spec=tensor.spec, shape=tuple(shape), dtype=tensor.dtype, **leaves)
