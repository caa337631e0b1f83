"""Gathering a split weight inside `jax.shard_map`: raw shards, or quantized shards.

A weight is a kernel (K, N) or a stack of expert kernels (G, K, N). Its quantized copies
(docs/design/layouts.md) are the rowwise copy, stored (K, N), and the columnwise copy, stored
transposed (N, K); experts' copies carry a leading G axis and each expert has its own scales and
per-tensor amaxes (`jax_qtrain.quantize_per_expert`). So a weight split along K (or N) has
rowwise shards split along the stored axis of K (of N) and columnwise shards along the other;
a stack split over its experts has every leaf split along G. Gathering a quantized shard is an
all-gather of each copy's codes and scales along that axis. Per-tensor values (FP8's scale,
NVFP4's global amax) are, for a split K or N, the same on every shard once each expert's amax is
max-reduced over the axis, and are not gathered; for a split over experts each shard holds its
own experts' values, gathered like the rest (and nothing is reduced: an expert's amax is local).

Quantizing shards equals quantizing the whole weight only when every quantization block lies in
one shard: the shard's length along the split dim must be a multiple of the block's length along
that dim, in each copy (`Split.check_block_aligned`; always true for a split over experts).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax import lax

from jax_qtrain.formats.spec import QuantizerSpec
from jax_qtrain.quantize import QuantizedTensor, Usage, quantize

from .config import EXPERTS, GATHER_THEN_QUANTIZE, QUANTIZE_THEN_GATHER, Strategy


@dataclasses.dataclass(frozen=True)
class Split:
    """How one weight is split: over mesh axis `axis_name`, along `kernel_dim` — 0 (K) or 1 (N)
    of each kernel, or "experts" (G) for a stack — of a (K, N) kernel or, `stacked`, a (G, K, N)
    stack of expert kernels."""

    axis_name: str
    kernel_dim: int | str
    stacked: bool = False

    @property
    def splits_experts(self) -> bool:
        return self.kernel_dim == EXPERTS

    @property
    def array_dim(self) -> int:
        """The split dim of the weight array."""
        if self.splits_experts:
            return 0
        return self.kernel_dim + (1 if self.stacked else 0)

    def stored_axis(self, usage: Usage) -> int:
        """The axis of a stored copy (leading G axis included) that the split runs along."""
        if self.splits_experts:
            return 0
        axis = self.kernel_dim if usage == "rowwise" else 1 - self.kernel_dim
        return axis + (1 if self.stacked else 0)

    def check_block_aligned(
        self,
        shard_shape: tuple[int, ...],
        spec: QuantizerSpec,
        usages,
        remedy: str = f"use strategy={GATHER_THEN_QUANTIZE!r}, or",
    ):
        """Raise ValueError unless every block of the requested copies lies within one shard
        (`remedy` starts the message's advice)."""
        if self.splits_experts:
            return
        shard_length = shard_shape[self.array_dim]
        for usage in usages:
            axis = self.kernel_dim if usage == "rowwise" else 1 - self.kernel_dim
            block = spec.padding_block[axis]
            if shard_length % block:
                raise ValueError(
                    f"kernel_shard {tuple(shard_shape)}: its kernel_dim={self.kernel_dim} length "
                    f"{shard_length} is not a multiple of the {spec.describe()} block length "
                    f"{block} of the {usage} copy, so quantizing shards would not equal "
                    f"quantizing the whole weight; {remedy} a shard length that is a multiple "
                    f"of {block}"
                )

    def gather_raw(self, shard: jax.Array) -> jax.Array:
        """The whole weight from its shards (high precision)."""
        return lax.all_gather(shard, self.axis_name, axis=self.array_dim, tiled=True)

    def quantize_whole(self, weight: jax.Array, recipe, *, rowwise: bool, columnwise: bool):
        """The whole weight's quantization (per expert for a stack)."""

        def one(kernel):
            return quantize(kernel, recipe, "weight", rowwise=rowwise, columnwise=columnwise)

        return jax.vmap(one)(weight) if self.stacked else one(weight)

    def quantize_shard(
        self, shard: jax.Array, recipe, *, rowwise: bool, columnwise: bool
    ) -> QuantizedTensor:
        """This device's shard quantized as part of the whole weight: per-tensor amaxes are
        max-reduced over the axis (each expert's separately), blocks must be aligned."""
        usages = [u for u, wanted in (("rowwise", rowwise), ("columnwise", columnwise)) if wanted]
        self.check_block_aligned(tuple(shard.shape), recipe.spec("weight"), usages)
        amax_axis_name = None if self.splits_experts else self.axis_name

        def one(kernel):
            return quantize(
                kernel,
                recipe,
                "weight",
                rowwise=rowwise,
                columnwise=columnwise,
                amax_axis_name=amax_axis_name,
            )

        return jax.vmap(one)(shard) if self.stacked else one(shard)

    def gather_quantized(self, q_shard: QuantizedTensor) -> QuantizedTensor:
        """All-gather every copy `q_shard` holds into the whole weight's quantized tensor."""
        # Shards are split along lines or blocks of the (lines, blocks) scales.
        q_shard = q_shard.with_scale_layout("lines")
        matrix_rank = 3 if self.stacked else 2
        fields = {}
        for usage in ("rowwise", "columnwise"):
            for part in ("data", "scale_inv", "amax"):
                leaf = getattr(q_shard, f"{usage}_{part}")
                # Codes and block scales are matrices; per-tensor values are gathered only
                # along a split over experts (each expert its own).
                if leaf is not None and (leaf.ndim == matrix_rank or self.splits_experts):
                    leaf = lax.all_gather(
                        leaf, self.axis_name, axis=self.stored_axis(usage), tiled=True
                    )
                fields[f"{usage}_{part}"] = leaf
        shape = list(q_shard.shape)  # one kernel's (K, N), also for a stack
        if not self.splits_experts:
            shape[self.kernel_dim] *= lax.axis_size(self.axis_name)
        return QuantizedTensor(spec=q_shard.spec, shape=tuple(shape), dtype=q_shard.dtype, **fields)

    def gather_and_quantize(
        self, shard: jax.Array, recipe, *, strategy: Strategy, rowwise: bool, columnwise: bool
    ) -> QuantizedTensor:
        """The whole weight's quantized copies, gathered with `strategy` (the same bits either
        way; test_sharding.py checks it for every recipe)."""
        if strategy == GATHER_THEN_QUANTIZE:
            return self.quantize_whole(
                self.gather_raw(shard), recipe, rowwise=rowwise, columnwise=columnwise
            )
        assert strategy == QUANTIZE_THEN_GATHER, strategy
        q_shard = self.quantize_shard(shard, recipe, rowwise=rowwise, columnwise=columnwise)
        return self.gather_quantized(q_shard)


# --- the same for one (K, N) kernel, by keyword ------------------------------------------------
def gather_raw(kernel_shard: jax.Array, *, axis_name: str, kernel_dim: int) -> jax.Array:
    """The whole kernel from its shards (high precision)."""
    return Split(axis_name, kernel_dim).gather_raw(kernel_shard)


def quantize_shard(
    kernel_shard: jax.Array,
    recipe,
    *,
    axis_name: str,
    kernel_dim: int,
    rowwise: bool,
    columnwise: bool,
) -> QuantizedTensor:
    """`Split.quantize_shard` for a (K, N) kernel."""
    return Split(axis_name, kernel_dim).quantize_shard(
        kernel_shard, recipe, rowwise=rowwise, columnwise=columnwise
    )


def gather_quantized(
    q_shard: QuantizedTensor, *, axis_name: str, kernel_dim: int
) -> QuantizedTensor:
    """`Split.gather_quantized` for a (K, N) kernel."""
    return Split(axis_name, kernel_dim).gather_quantized(q_shard)


def gather_and_quantize(
    kernel_shard: jax.Array,
    recipe,
    *,
    strategy: Strategy,
    axis_name: str,
    kernel_dim: int,
    rowwise: bool,
    columnwise: bool,
) -> QuantizedTensor:
    """`Split.gather_and_quantize` for a (K, N) kernel."""
    return Split(axis_name, kernel_dim).gather_and_quantize(
        kernel_shard, recipe, strategy=strategy, rowwise=rowwise, columnwise=columnwise
    )


# --- bytes moved, from shapes --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GatherBytes:
    """Bytes one device receives per training step for one split kernel (ring collectives: an
    all-gather or reduce-scatter of a T-byte array delivers (P-1)/P·T bytes to each device).

    forward: the gather before fprop. backward: the re-gather before dgrad.
    grad_reduce_scatter: the float32 weight gradient.
    """

    forward: int
    backward: int
    grad_reduce_scatter: int

    @property
    def total(self) -> int:
        return self.forward + self.backward + self.grad_reduce_scatter


def _received(nbytes: int, axis_size: int) -> int:
    return nbytes * (axis_size - 1) // axis_size


def _copy_nbytes(kernel: jax.ShapeDtypeStruct, recipe, usage: Usage) -> int:
    """Bytes of one quantized copy of the whole kernel, per-tensor scalars excluded (they are
    not gathered)."""
    q = jax.eval_shape(
        lambda k: quantize(
            k, recipe, "weight", rowwise=usage == "rowwise", columnwise=usage == "columnwise"
        ),
        kernel,
    )
    return sum(
        int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        for leaf in jax.tree_util.tree_leaves(q)
        if len(leaf.shape) == 2
    )


def gather_bytes(
    kernel_shape: tuple[int, int],
    kernel_dtype,
    recipe,
    *,
    strategy: Strategy,
    axis_size: int,
) -> GatherBytes:
    """Exact bytes each device receives per step for a (K, N) kernel split `axis_size` ways, as
    `jax_qtrain.sharding.dense` moves them (recipe None: unquantized).

    gather_then_quantize moves the raw kernel both ways. quantize_then_gather moves the copy
    each GEMM reads: fprop the columnwise copy; backward the rowwise copy in the default mode,
    the columnwise copy under "dequantized", the raw kernel under "high_precision".
    """
    kernel = jax.ShapeDtypeStruct(tuple(kernel_shape), kernel_dtype)
    raw = int(np.prod(kernel_shape)) * np.dtype(kernel_dtype).itemsize
    grad = _received(int(np.prod(kernel_shape)) * 4, axis_size)
    if recipe is None or strategy == GATHER_THEN_QUANTIZE:
        return GatherBytes(_received(raw, axis_size), _received(raw, axis_size), grad)
    forward = _copy_nbytes(kernel, recipe, "columnwise")
    mode = recipe.backward_override
    if mode is None:
        backward = _copy_nbytes(kernel, recipe, "rowwise")
    elif mode == "dequantized":
        backward = forward
    else:
        backward = raw
    return GatherBytes(_received(forward, axis_size), _received(backward, axis_size), grad)
