"""Gathering a split weight inside `jax.shard_map`: raw shards, or quantized shards.

A kernel (K, N) split along `kernel_dim` has shards (K/P, N) or (K, N/P). Its quantized copies
(docs/design/layouts.md) are the rowwise copy, stored (K, N), and the columnwise copy, stored
transposed (N, K). So a shard's rowwise copy is split along the stored axis `kernel_dim`, its
columnwise copy along `1 - kernel_dim`, and gathering a quantized shard is an all-gather of each
copy's codes and scales along that axis. Per-tensor values (FP8's scale, NVFP4's global amax)
are the same on every shard once the amax is max-reduced over the axis; they are not gathered.

Quantizing shards equals quantizing the whole weight only when every quantization block lies in
one shard: the shard's length along the split dim must be a multiple of the block's length along
that dim, in each copy (`check_block_aligned`).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax import lax

from jax_qtrain.formats.spec import QuantizerSpec
from jax_qtrain.quantize import QuantizedTensor, Usage, quantize

from .config import GATHER_THEN_QUANTIZE, QUANTIZE_THEN_GATHER, Strategy


def stored_split_axis(usage: Usage, kernel_dim: int) -> int:
    """The axis of a stored copy along which a kernel split along `kernel_dim` is split."""
    return kernel_dim if usage == "rowwise" else 1 - kernel_dim


def block_length(spec: QuantizerSpec, usage: Usage, kernel_dim: int) -> int:
    """Length of one quantization block along the kernel's split dim, in this copy."""
    return spec.padding_block[stored_split_axis(usage, kernel_dim)]


def check_block_aligned(
    shard_shape: tuple[int, ...], spec: QuantizerSpec, usages, kernel_dim: int
) -> None:
    """Raise ValueError unless every block of the requested copies lies within one shard."""
    shard_length = shard_shape[kernel_dim]
    for usage in usages:
        block = block_length(spec, usage, kernel_dim)
        if shard_length % block:
            raise ValueError(
                f"kernel_shard {tuple(shard_shape)}: its kernel_dim={kernel_dim} length "
                f"{shard_length} is not a multiple of the {spec.describe()} block length {block} "
                f"of the {usage} copy, so quantizing shards would not equal quantizing the whole "
                f"weight; use strategy={GATHER_THEN_QUANTIZE!r}, or a shard length that is a "
                f"multiple of {block}"
            )


def gather_raw(kernel_shard: jax.Array, *, axis_name: str, kernel_dim: int) -> jax.Array:
    """The whole kernel from its shards (high precision)."""
    return lax.all_gather(kernel_shard, axis_name, axis=kernel_dim, tiled=True)


def quantize_shard(
    kernel_shard: jax.Array,
    recipe,
    *,
    axis_name: str,
    kernel_dim: int,
    rowwise: bool,
    columnwise: bool,
) -> QuantizedTensor:
    """Quantize this device's shard as part of the whole kernel: per-tensor amaxes are
    max-reduced over `axis_name` (quantize's `amax_axis_name`), blocks must be aligned."""
    spec = recipe.spec("weight")
    usages = [u for u, wanted in (("rowwise", rowwise), ("columnwise", columnwise)) if wanted]
    check_block_aligned(tuple(kernel_shard.shape), spec, usages, kernel_dim)
    return quantize(
        kernel_shard,
        recipe,
        "weight",
        rowwise=rowwise,
        columnwise=columnwise,
        amax_axis_name=axis_name,
    )


def gather_quantized(
    q_shard: QuantizedTensor, *, axis_name: str, kernel_dim: int
) -> QuantizedTensor:
    """All-gather every copy `q_shard` holds into the whole kernel's quantized tensor."""
    fields = {}
    for usage in ("rowwise", "columnwise"):
        axis = stored_split_axis(usage, kernel_dim)
        for part in ("data", "scale_inv", "amax"):
            leaf = getattr(q_shard, f"{usage}_{part}")
            if leaf is not None and leaf.ndim == 2:  # codes and block scales; not per-tensor
                leaf = lax.all_gather(leaf, axis_name, axis=axis, tiled=True)
            fields[f"{usage}_{part}"] = leaf
    shape = list(q_shard.shape)
    shape[kernel_dim] *= lax.axis_size(axis_name)
    return QuantizedTensor(spec=q_shard.spec, shape=tuple(shape), dtype=q_shard.dtype, **fields)


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
    """The whole kernel's quantized copies, gathered with `strategy`. Both strategies give the
    same bits (tests/jax_qtrain/test_sharding.py checks it for every recipe)."""
    if strategy == GATHER_THEN_QUANTIZE:
        kernel = gather_raw(kernel_shard, axis_name=axis_name, kernel_dim=kernel_dim)
        return quantize(kernel, recipe, "weight", rowwise=rowwise, columnwise=columnwise)
    assert strategy == QUANTIZE_THEN_GATHER, strategy
    q_shard = quantize_shard(
        kernel_shard,
        recipe,
        axis_name=axis_name,
        kernel_dim=kernel_dim,
        rowwise=rowwise,
        columnwise=columnwise,
    )
    return gather_quantized(q_shard, axis_name=axis_name, kernel_dim=kernel_dim)


# --- bytes moved, from shapes --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GatherBytes:
    """Bytes one device receives per training step for one split kernel (ring collectives: an
    all-gather or reduce-scatter of a T-byte array delivers (P-1)/P·T bytes to each device).

    forward: the gather before fprop. backward: the re-gather before dgrad (0 when backward
    reads no kernel copy, i.e. never here). grad_reduce_scatter: the float32 weight gradient.
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
