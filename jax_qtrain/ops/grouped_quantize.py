"""Per-group quantization of MoE activations, in the *aligned layout*.

TransformerEngine's GroupedLinear splits x (M, K) by `m_splits` and quantizes every group as a
tensor of its own (`split_quantize`): FP8 per-tensor scaling takes one amax per group, NVFP4 one
global amax per group and copy, and the columnwise (token-direction) blocks of MXFP8, NVFP4 and
FP8 block scaling never straddle two groups. Here `group_sizes` is a device array, so the groups
cannot be sliced statically. Instead the rows of group g move to row

    aligned_start[g] = Σ_{j<g} round_up(size_j, align)

of a buffer with a static number of rows P = round_up(M + G·(align − 1), align), with zero rows
in between. Every group then starts on a block boundary, so a plain quantization of the buffer
never lets a block (or a 16-row Hadamard group) straddle two groups, and the zero rows are the
padding each group's own tensor would get. Per-tensor quantities are per-group segment maxima.
Group g's codes and scales are bit for bit those of `jax_qtrain.quantize(x_g)` (with NVFP4
stochastic rounding: given the key `fold_in(key, g)`), tested in test_grouped_quantize.py.

`align` (`token_alignment`) is the largest token-direction block of a recipe's input and
gradient quantizers: 1 for FP8 per-tensor scaling (the layout is then the identity), 16 for NVFP4
(1×16 blocks and the Hadamard groups), 32 for MXFP8, 128 for FP8 block scaling. One layout serves
every activation of a grouped op (x and dy; in the MLP also the activation and its gradient),
because the wgrad GEMM contracts two columnwise copies over the same token positions. The cost
is up to G·(align − 1) extra rows per stored copy (G=64 experts with FP8 blocks: 8128 rows).

Group sizes given as a numpy array are checked on the host (no negative size, a sum of at most
the rows: `check_group_sizes`). A jax array's values are not read, which would copy them from
the device and wait for it, and under `jit` they are not known: they are clamped as the Pallas
grouped matmul kernels do: a negative size counts as 0, and once the running sum reaches M the
remaining groups are truncated (they get the rows that are left, possibly none). Rows past the
clamped sum belong to no group: they are not quantized, and every grouped op returns zeros for
them.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_qtrain import kernels
from jax_qtrain.formats import common, fp8_block, fp8_tensor, mxfp8, nvfp4
from jax_qtrain.formats.spec import QuantizerSpec
from jax_qtrain.quantize import (
    USAGES,
    Backend,
    QuantizedTensor,
    Usage,
    _check_key,
    _copy_seed,
    columnwise_source,
    quantize,
)
from jax_qtrain.recipes import Recipe, Role


def token_block(spec: QuantizerSpec) -> int:
    """Rows of x that one block of `spec` may span (in either copy): 1 for per-tensor FP8."""
    return 1 if spec.block_shape is None else max(spec.block_shape)


def token_alignment(recipe: Recipe) -> int:
    """The aligned layout's row alignment for a recipe's activations (inputs and gradients)."""
    return max(token_block(recipe.spec("input")), token_block(recipe.spec("grad")))


def _static(**kwargs):
    return dataclasses.field(metadata=dict(static=True), **kwargs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """Where each row of a grouped activation (M, ·) lives in the aligned buffer (P, ·).

    Built by `group_layout` from `group_sizes`; every array is int32. "Slot" = a buffer row.
    """

    group_sizes: jax.Array  # (G,) rows per group after clamping
    group_starts: jax.Array  # (G,) first row of each group in x
    aligned_starts: jax.Array  # (G,) first slot of each group
    aligned_sizes: jax.Array  # (G,) round_up(size, align)
    row_group: jax.Array  # (M,) group of each row of x; G for rows past the last group
    row_slot: jax.Array  # (M,) slot of each row of x; P (none) for rows past the last group
    slot_group: jax.Array  # (P,) group of each slot; G for the tail after the last group
    slot_source: jax.Array  # (P,) row of x copied into each slot; M (none) for padding slots
    num_rows: int = _static()
    align: int = _static()

    @property
    def num_groups(self) -> int:
        return self.group_sizes.shape[0]

    @property
    def padded_rows(self) -> int:
        return self.slot_group.shape[0]

    def to_aligned(self, x: jax.Array) -> jax.Array:
        """(M, ...) rows sorted by group → (P, ...) aligned buffer, zeros in the padding slots."""
        if self.align == 1:
            return self._zero_rows_past_groups(x)
        return jnp.take(x, self.slot_source, axis=0, mode="fill", fill_value=0)

    def from_aligned(self, values: jax.Array) -> jax.Array:
        """(P, ...) → (M, ...): each row read back from its slot; rows past the groups are 0."""
        if self.align == 1:
            return self._zero_rows_past_groups(values)
        return jnp.take(values, self.row_slot, axis=0, mode="fill", fill_value=0)

    def _zero_rows_past_groups(self, x: jax.Array) -> jax.Array:
        """With align 1 (FP8 per-tensor scaling) slot s holds row s, and P = M: the gathers
        above reduce to zeroing the rows past the groups, a mask XLA fuses into its consumer."""
        in_groups = jnp.arange(x.shape[0]) < jnp.sum(self.group_sizes)
        return jnp.where(in_groups.reshape(-1, *(1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))

    def per_slot(self, group_values: jax.Array) -> jax.Array:
        """(G,) per-group values → (P,) one per slot (the tail slots get group G−1's value:
        they hold zeros, so any finite value will do)."""
        return group_values[jnp.minimum(self.slot_group, self.num_groups - 1)]

    def per_row(self, group_values: jax.Array) -> jax.Array:
        """(G,) per-group values → (M,) one per row of x, the token order (rows past the
        groups get group G−1's value: they hold zeros)."""
        return group_values[jnp.minimum(self.row_group, self.num_groups - 1)]

    def group_amax(self, source: jax.Array, token_axis: int) -> jax.Array:
        """(G,) float32 amax of each group's slots of `source` (P along `token_axis`), taken on
        bit patterns like `formats.common.amax` (NaN propagates; empty groups give 0)."""
        return self.group_max_of_slots(jnp.max(common.abs_bits(source), axis=1 - token_axis))

    def group_max_of_slots(self, slot_bits: jax.Array, slots_per_entry: int = 1) -> jax.Array:
        """(G,) float32 amax of each group from amax bit patterns (uint32) per slot, or per run
        of `slots_per_entry` slots that never straddles two groups (e.g. NVFP4's 16-token
        blocks, `pallas_kernels.nvfp4_line_amax_bits`): the largest pattern of the group's
        entries. The same bits as `group_amax` of the values they came from."""
        group_bits = jax.ops.segment_max(
            slot_bits,
            self.slot_group[::slots_per_entry],
            num_segments=self.num_groups + 1,
            indices_are_sorted=True,
        )
        return common.f32_from_bits(group_bits[: self.num_groups])


def check_group_sizes(
    group_sizes, num_groups: int | None, name: str = "group_sizes", *, num_rows: int | None = None
) -> None:
    """Checks of a group_sizes argument: its type, dtype and shape always, and its values where
    the host already holds them (a numpy array): no negative size, and a sum of at most
    `num_rows` when given. A jax array's values are not read (that would copy them from the
    device and wait for it); they are clamped at run time (module docstring)."""
    if not hasattr(group_sizes, "shape") or not hasattr(group_sizes, "dtype"):
        hint = (
            f" (e.g. jnp.array({list(group_sizes)!r}, jnp.int32))"
            if isinstance(group_sizes, list | tuple)
            else ""
        )
        raise TypeError(
            f"{name} must be an int32 array of shape (G,), got {type(group_sizes).__name__}{hint}"
        )
    if jnp.dtype(group_sizes.dtype) != jnp.int32:
        raise TypeError(f"{name} must have dtype int32, got {group_sizes.dtype}")
    if group_sizes.ndim != 1 or num_groups not in (None, group_sizes.shape[0]):
        raise ValueError(
            f"{name} must have shape ({'G' if num_groups is None else num_groups},) (one size "
            f"per group), got {tuple(group_sizes.shape)}"
        )
    if isinstance(group_sizes, np.ndarray):
        if (group_sizes < 0).any():
            raise ValueError(f"{name} must not be negative, got {group_sizes.tolist()}")
        total = int(group_sizes.sum(dtype=np.int64))
        if num_rows is not None and total > num_rows:
            raise ValueError(
                f"{name} sum to {total}, more than the {num_rows} rows they split: "
                f"{group_sizes.tolist()}"
            )


def clamp_group_sizes(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """Negative sizes count as 0; once the running sum reaches num_rows, later groups get the
    rows that are left (possibly none). The result sums to at most num_rows."""
    ends = jnp.minimum(jnp.cumsum(jnp.clip(group_sizes.astype(jnp.int32), 0, num_rows)), num_rows)
    return jnp.diff(ends, prepend=0)


def group_layout(group_sizes: jax.Array, num_rows: int, align: int) -> GroupLayout:
    """The aligned layout of `num_rows` rows sorted into groups of `group_sizes` (checked on the
    host if numpy, else clamped: module docstring)."""
    if align < 1 or align & (align - 1):
        raise ValueError(f"align must be a power of two, got {align}")
    check_group_sizes(group_sizes, None, num_rows=num_rows)
    num_groups = group_sizes.shape[0]
    padded_rows = common.round_up(num_rows + num_groups * (align - 1), align)
    sizes = clamp_group_sizes(group_sizes, num_rows)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    aligned_sizes = (sizes + (align - 1)) // align * align
    aligned_ends = jnp.cumsum(aligned_sizes)
    aligned_starts = aligned_ends - aligned_sizes

    def lookup(bounds, index):
        """The group whose [start, end) holds each index (G past the last end): how many of
        the sorted ends are at or below it, in one compare-and-sum fusion. (jnp.searchsorted,
        used before, runs a while loop by default; in stop 25's profile of the h200-preset
        step its loop's carry copies were among the step's 236 device-to-device copies.)"""
        return jnp.sum(bounds[None, :] <= index[:, None], axis=1, dtype=jnp.int32)

    rows = jnp.arange(num_rows, dtype=jnp.int32)
    row_group = lookup(ends, rows)
    in_group = row_group < num_groups
    safe_row_group = jnp.minimum(row_group, num_groups - 1)
    row_slot = jnp.where(
        in_group, aligned_starts[safe_row_group] + rows - starts[safe_row_group], padded_rows
    )

    slots = jnp.arange(padded_rows, dtype=jnp.int32)
    slot_group = lookup(aligned_ends, slots)
    safe_slot_group = jnp.minimum(slot_group, num_groups - 1)
    slot_position = slots - aligned_starts[safe_slot_group]
    holds_row = (slot_group < num_groups) & (slot_position < sizes[safe_slot_group])
    slot_source = jnp.where(holds_row, starts[safe_slot_group] + slot_position, num_rows)
    return GroupLayout(
        group_sizes=sizes,
        group_starts=starts,
        aligned_starts=aligned_starts,
        aligned_sizes=aligned_sizes,
        row_group=row_group,
        row_slot=row_slot,
        slot_group=slot_group,
        slot_source=slot_source,
        num_rows=num_rows,
        align=align,
    )


@jax.tree_util.register_pytree_node_class
class GroupedQuantizedTensor:
    """A grouped activation (M, K), each group quantized as its own tensor, in the aligned layout.

    The fields mirror QuantizedTensor's, over the aligned buffer (P, K): the rowwise copy is
    stored (P, K'), the columnwise copy transposed, (K', P). The per-tensor fields hold one value
    per group, shape (G,): FP8's `*_scale_inv` (FP8 has no block scales) and NVFP4's global
    `*_amax`. Block formats have no per-group field. Static metadata: `spec`, the original
    `shape` (M, K) and `dtype`, and the layout's `align`; the layout's arrays are not stored:
    pass the `GroupLayout` of the same group_sizes to the methods that need it.
    """

    _LEAF_FIELDS = QuantizedTensor._LEAF_FIELDS

    def __init__(self, *, spec: QuantizerSpec, shape: tuple[int, int], dtype, align: int, **fields):
        self.spec = spec
        self.shape = tuple(shape)
        self.dtype = jnp.dtype(dtype)
        self.align = int(align)
        for name in self._LEAF_FIELDS:
            setattr(self, name, fields.pop(name, None))
        if fields:
            raise TypeError(f"unknown fields {sorted(fields)}")

    def tree_flatten(self):
        children = tuple(getattr(self, name) for name in self._LEAF_FIELDS)
        return children, (self.spec, self.shape, self.dtype, self.align)

    @classmethod
    def tree_unflatten(cls, aux, children):
        spec, shape, dtype, align = aux
        fields = dict(zip(cls._LEAF_FIELDS, children, strict=True))
        return cls(spec=spec, shape=shape, dtype=dtype, align=align, **fields)

    @property
    def usages(self) -> tuple[str, ...]:
        return tuple(u for u in USAGES if getattr(self, f"{u}_data") is not None)

    @property
    def nbytes(self) -> int:
        return sum(
            math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
            for leaf in jax.tree_util.tree_leaves(self)
        )

    def copy(self, usage: Usage) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
        """(data, scale_inv, amax) of one copy; raises if it was not kept."""
        if usage not in self.usages:
            raise ValueError(f"usage={usage!r}: this tensor holds only {list(self.usages)}")
        return tuple(getattr(self, f"{usage}_{part}") for part in ("data", "scale_inv", "amax"))

    def restrict_to(self, *usages: Usage) -> GroupedQuantizedTensor:
        """The same tensor keeping only the named copies."""
        for usage in usages:
            self.copy(usage)
        fields = {
            name: getattr(self, name) for name in self._LEAF_FIELDS if name.split("_")[0] in usages
        }
        return GroupedQuantizedTensor(
            spec=self.spec, shape=self.shape, dtype=self.dtype, align=self.align, **fields
        )

    def dequantize_stored(self, usage: Usage, layout: GroupLayout) -> jax.Array:
        """float32 values of one copy as stored: aligned, padded, columnwise transposed (and
        still Hadamard-rotated)."""
        data, scale_inv, amax = self.copy(usage)
        token_axis = 0 if usage == "rowwise" else 1

        def per_token(group_values):  # (G,) → broadcastable along the token axis
            values = layout.per_slot(group_values)
            return values[:, None] if token_axis == 0 else values[None, :]

        fmt = self.spec.format
        if fmt == "fp8":
            return fp8_tensor.dequantize(data, per_token(scale_inv))
        if fmt == "fp8_block":
            return fp8_block.dequantize(data, scale_inv, self.spec)
        if fmt == "mxfp8":
            return mxfp8.dequantize(data, scale_inv)
        return nvfp4.dequantize(data, scale_inv, self.spec, global_amax=per_token(amax))

    def dequantize(self, usage: Usage, layout: GroupLayout, dtype=None) -> jax.Array:
        """(M, K) values of one copy in x's row order (rows past the groups are 0), as `dtype`
        (default: the original dtype); a rotated NVFP4 columnwise copy is rotated back."""
        values = self.dequantize_stored(usage, layout)
        rows, cols = layout.padded_rows, self.shape[1]
        if usage == "columnwise":
            if self.spec.hadamard_columnwise:
                values = nvfp4.inverse_hadamard16(values)
            values = values[:cols, :rows].T
        else:
            values = values[:rows, :cols]
        return layout.from_aligned(values).astype(self.dtype if dtype is None else dtype)

    def __repr__(self) -> str:
        copies = ", ".join(
            f"{u}: {jnp.dtype(getattr(self, f'{u}_data').dtype).name}"
            f"{list(getattr(self, f'{u}_data').shape)}"
            for u in self.usages
        )
        return (
            f"GroupedQuantizedTensor({self.spec.describe()}, shape={self.shape}, "
            f"{copies or 'no copies'}, nbytes={self.nbytes:,})"
        )


def _group_seeds(key: jax.Array, num_groups: int, usage: str) -> jax.Array:
    """(G,) uint32: the seed jax_qtrain.quantize would use for this copy given fold_in(key, g)."""
    return jax.vmap(lambda g: _copy_seed(jax.random.fold_in(key, g), usage))(
        jnp.arange(num_groups, dtype=jnp.uint32)
    )


def _quantize_fp8_groups(
    aligned: jax.Array,
    spec: QuantizerSpec,
    layout: GroupLayout,
    usages: list[str],
    backend: Backend,
) -> dict:
    """FP8 per-tensor scaling of every group: group g's rows times its scale, cast to FP8; the
    columnwise codes are the rowwise ones transposed (a group's amax, hence its scale, is the
    same for xᵀ, and the cast is elementwise).

    On the GPU the cast and the transpose run in the cast-transpose kernel, which writes both
    layouts from one read of the scaled values. Left to XLA, the transposed copy fused into the
    quantizing loop ran 16× slower than the rowwise one on the H200 (8.9 vs 0.57 ms for
    16384×4096 bf16 in 8 groups, 2026-11-29/30), and it is most of what the FP8 MoE backward
    lost there."""
    group_amax = layout.group_amax(aligned, token_axis=0)
    scale = fp8_tensor.compute_scale(
        group_amax,
        common.fp8_max(spec.dtype),
        power_2_scale=spec.power_2_scale,
        amax_epsilon=spec.amax_epsilon,
    )
    scale_inv = fp8_tensor.reciprocal_scale(scale, power_2_scale=spec.power_2_scale)
    scaled = fp8_tensor.scaled_values(aligned, layout.per_slot(scale)[:, None])
    if backend == "pallas" or (backend == "auto" and kernels.on_gpu() and scaled.size):
        codes = kernels.fp8_cast_transpose(scaled, spec.dtype, usages)
    else:
        rowwise_codes = common.materialize(common.saturating_cast(scaled, spec.dtype))
        codes = {"rowwise": rowwise_codes, "columnwise": rowwise_codes.T}
    fields = {}
    for usage in usages:
        fields |= {f"{usage}_data": codes[usage], f"{usage}_scale_inv": scale_inv}
    return fields


def _quantize_nvfp4_group_copy(
    source: jax.Array, spec: QuantizerSpec, usage: str, layout: GroupLayout, key
) -> dict:
    """One NVFP4 copy of every group: the reference quantizer, fed per-group global amaxes (and
    seeds and positions) that broadcast along the token axis."""
    token_axis = 0 if usage == "rowwise" else 1
    group_amax = layout.group_amax(source, token_axis)

    def along_tokens(per_slot):  # (P,) → (P, 1) or (1, P)
        return per_slot[:, None] if token_axis == 0 else per_slot[None, :]

    # The global amax broadcasts against the per-block arrays: per row for the rowwise
    # copy, per 16-token block column for the columnwise one (groups start on block boundaries).
    slot_amax = layout.per_slot(group_amax)
    block_amax = slot_amax[:, None] if token_axis == 0 else slot_amax[None, :: nvfp4.BLOCK_SIZE]
    seed = origin = None
    if spec.stochastic_rounding:
        # Group g draws the bits of its own tensor: its seed, and positions relative to the
        # group's first slot.
        seed = along_tokens(layout.per_slot(_group_seeds(key, layout.num_groups, usage)))
        group_start = along_tokens(layout.per_slot(layout.aligned_starts))
        no_offset = jnp.zeros((), jnp.int32)
        origin = (group_start, no_offset) if token_axis == 0 else (no_offset, group_start)
    data, block_scale = nvfp4.quantize(
        source, spec, global_amax=block_amax, seed=seed, origin=origin
    )
    return {
        f"{usage}_data": data,
        f"{usage}_scale_inv": common.materialize(block_scale),
        f"{usage}_amax": group_amax,
    }


def _quantize_nvfp4_groups_on_kernel(
    aligned: jax.Array,
    spec: QuantizerSpec,
    layout: GroupLayout,
    usages: list[str],
    key,
) -> dict:
    """NVFP4 copies of every group from one pass of the quantize kernel, the same bits as
    `_quantize_nvfp4_group_copy`: the rowwise copy gets per-line (per-slot) global amaxes,
    seeds and hashed rows (slot − the group's first slot), the columnwise copy the same per 16
    tokens (one group each: groups start on multiples of the alignment), the hashed column of
    a block's first token being its slot − the group's first slot.

    The per-group amaxes come from one more pass of a kernel (`nvfp4_line_amax_bits`: each
    token's and each 16-token block's amax bits, maxed per group): jnp reductions took ~500 µs
    where it takes 47 (16384×4096 bf16 in 8 groups, H200; XLA materialized the rotated xᵀ for
    the columnwise one)."""
    slots = jnp.arange(layout.padded_rows, dtype=jnp.uint32)
    slot_position = slots - layout.per_slot(layout.aligned_starts).astype(jnp.uint32)
    token_amax_bits, block_amax_bits = kernels.nvfp4_line_amax_bits(aligned, spec)
    per_group, fields = {}, {}
    for usage in usages:
        if usage == "rowwise":
            group_amax = layout.group_max_of_slots(token_amax_bits)
            prefix, every = "rowwise_line", slice(None)
        else:
            group_amax = layout.group_max_of_slots(block_amax_bits, nvfp4.BLOCK_SIZE)
            prefix, every = "columnwise_block", slice(None, None, nvfp4.BLOCK_SIZE)
        fields[f"{usage}_amax"] = group_amax
        per_group[f"{prefix}_amax"] = layout.per_slot(group_amax)[every]
        if spec.stochastic_rounding:
            seeds = layout.per_slot(_group_seeds(key, layout.num_groups, usage))
            per_group[f"{prefix}_seed"] = seeds[every]
            per_group[f"{prefix}_position"] = slot_position[every]
    copies = kernels.grouped_nvfp4_quantize(aligned, spec, usages, **per_group)
    for usage, (data, block_scale) in copies.items():
        fields[f"{usage}_data"] = data
        fields[f"{usage}_scale_inv"] = common.materialize(block_scale)
    return fields


def grouped_quantize(
    x: jax.Array,
    recipe: Recipe | QuantizerSpec,
    role: Role,
    layout: GroupLayout,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    key: jax.Array | None = None,
    backend: Backend = "auto",
) -> GroupedQuantizedTensor:
    """Quantize the groups of `x` (M, K) (rows sorted by group, as `layout` says) each as its own
    tensor, like TransformerEngine's split_quantize.

    `key` (NVFP4 gradients) gives group g the key `fold_in(key, g)`. `backend` picks the Pallas
    kernels or the jnp reference for the block formats (MXFP8, FP8 block: `jax_qtrain.quantize`
    of the aligned buffer) and for FP8's cast and transpose after the per-group scaling. NVFP4
    runs on the quantize kernel with per-group global scales, seeds and positions (GPU, or
    backend="pallas"; bit for bit the reference, on the H200 since 2026-12-01).
    """
    if x.ndim != 2 or x.shape[0] != layout.num_rows:
        raise ValueError(f"x must have shape ({layout.num_rows}, K), got {tuple(x.shape)}")
    return quantize_aligned(
        layout.to_aligned(x),
        recipe,
        role,
        layout,
        rowwise=rowwise,
        columnwise=columnwise,
        key=key,
        backend=backend,
        dtype=x.dtype,
    )


def quantize_aligned(
    aligned: jax.Array,
    recipe: Recipe | QuantizerSpec,
    role: Role,
    layout: GroupLayout,
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    key: jax.Array | None = None,
    backend: Backend = "auto",
    dtype=None,
) -> GroupedQuantizedTensor:
    """`grouped_quantize` of a tensor already in the aligned layout (P, K), zeros in the padding
    slots: what a producer that writes the aligned layout directly (the MLP's activation) uses.
    `dtype` is the original dtype recorded in the result (default: aligned's)."""
    spec = recipe if isinstance(recipe, QuantizerSpec) else recipe.spec(role)
    if aligned.ndim != 2 or aligned.shape[0] != layout.padded_rows:
        raise ValueError(
            f"aligned must have shape ({layout.padded_rows}, K), got {tuple(aligned.shape)}"
        )
    if layout.align % token_block(spec):
        raise ValueError(
            f"the layout's align ({layout.align}) must be a multiple of {spec.describe()}'s "
            f"token block ({token_block(spec)})"
        )
    if not (rowwise or columnwise):
        raise ValueError("rowwise and columnwise are both False: ask for at least one copy")
    _check_key(key, spec)
    if spec.format in ("mxfp8", "fp8_block"):
        # No per-tensor quantity, and blocks never straddle groups: quantize the buffer.
        q = quantize(aligned, spec, rowwise=rowwise, columnwise=columnwise, backend=backend)
        fields = {n: getattr(q, n) for n in QuantizedTensor._LEAF_FIELDS}
    elif spec.format == "fp8":
        usages = [u for u, wanted in (("rowwise", rowwise), ("columnwise", columnwise)) if wanted]
        fields = _quantize_fp8_groups(common.rounded_input(aligned), spec, layout, usages, backend)
    elif backend == "pallas" or (
        backend == "auto"
        and aligned.size
        and kernels.grouped_nvfp4_kernel_applies(spec, aligned.dtype)
    ):
        # NVFP4 on the quantize kernel: both copies from one read of the aligned buffer.
        usages = [u for u, wanted in (("rowwise", rowwise), ("columnwise", columnwise)) if wanted]
        aligned = common.rounded_input(aligned)
        fields = _quantize_nvfp4_groups_on_kernel(aligned, spec, layout, usages, key)
    else:
        aligned = common.rounded_input(aligned)
        fields = {}
        if rowwise:
            fields |= _quantize_nvfp4_group_copy(aligned, spec, "rowwise", layout, key)
        if columnwise:
            # The transposed read fused into the quantizer was what made the FP8 columnwise
            # pass 16× slower on the H200 (_quantize_fp8_groups); NVFP4's blocks run along the
            # tokens, so it transposes x in a pass of its own instead (1.95 ms for 16384×4096
            # in 8 groups on the H200, 2.1× quantizing that copy of the whole tensor).
            source = columnwise_source(aligned, spec, separate_transpose=True)
            fields |= _quantize_nvfp4_group_copy(source, spec, "columnwise", layout, key)
    return GroupedQuantizedTensor(
        spec=spec,
        shape=(layout.num_rows, aligned.shape[1]),
        dtype=aligned.dtype if dtype is None else dtype,
        align=layout.align,
        **fields,
    )


def quantize_per_expert(
    kernels: jax.Array,
    recipe: Recipe,
    *,
    rowwise: bool,
    columnwise: bool,
    backend: Backend = "auto",
) -> QuantizedTensor:
    """Each expert's weight (G, K, N) quantized separately (its own scales and amaxes): a
    QuantizedTensor of one (K, N) weight whose leaves carry a leading G axis."""
    return jax.vmap(
        lambda w: quantize(
            w, recipe, "weight", rowwise=rowwise, columnwise=columnwise, backend=backend
        )
    )(kernels)


__all__ = [
    "GroupLayout",
    "GroupedQuantizedTensor",
    "check_group_sizes",
    "clamp_group_sizes",
    "group_layout",
    "grouped_quantize",
    "quantize_aligned",
    "quantize_per_expert",
    "token_alignment",
    "token_block",
]
