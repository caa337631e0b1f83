"""Shared pieces of the Hopper (sm_90) grouped-matmul kernels.

Everything here runs inside a Mosaic GPU kernel body traced with warpgroup
lowering semantics (one Pallas thread = one warpgroup), except the small host-side
validation helpers at the bottom.

Row-tile schedule of the grouped ("ragged rows") GEMMs
------------------------------------------------------
The rows of ``lhs`` are sorted by group. Group ``i`` owns rows
``[start_i, end_i)``; ``start_0 = 0``, ``end_i = min(start_i + max(size_i, 0), M)``
(negative sizes count as empty, rows past ``M`` are dropped). The rows past the last
group, ``[end_{G-1}, M)``, form one extra *tail* pseudo-group whose output rows are
zero-filled, like ``lax.ragged_dot``.

Each (pseudo-)group is cut into row tiles of ``tile_m`` rows aligned to multiples of
``tile_m`` in the global row index; a tile that straddles a group boundary is visited
once per group and each visit stores only its own rows. A group with rows touches
``cdiv(end, tile_m) - start // tile_m`` tiles, so the ``G + 1`` (pseudo-)groups need
at most ``cdiv(M, tile_m) + G`` tile visits. Visits are numbered group by group, so
the visits of real groups come first and the tail's last.

The ragged-row kernels get the schedule as a small int32 table computed by XLA from
``group_sizes`` before the launch (:func:`visit_table`): both visit counts, then one
row per visit (group, first row of the tile, first row and row count of the group in
it). A kernel loop reads the counts and, per work item, four scalars of its visit.
Computing the schedule in the kernel instead kept ``2 (G + 1)`` group bounds live in
every thread and unrolled a ``G + 1``-way lookup per item: at 168 registers that
spilled (ptxas, H200: 200 bytes for G = 8, ~1 KB for G = 64, none for G = 1) and ran
the 8-group GEMM 5% (bf16) to 16% (FP8) slower than the same kernel with one group.

With ``group_starts`` (a *packed* output) the groups' lhs rows need not be contiguous:
group ``i`` reads rows ``[group_starts_i, group_starts_i + size_i)`` of lhs (e.g. the groups of
an aligned layout, each padded to a block multiple) and its output rows are packed, at
``sum(size_j, j < i)`` of an output with its own row count, whose tail is zero-filled; each
visit then also carries the output row of its first row (a fifth column).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import quantize_common

H200_NUM_SMS = 132

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
# Shared memory a config may plan for: Hopper's 227 KiB per CTA less 1 KiB for the barriers and
# scratch Mosaic GPU adds itself (a dense block-FP8 GEMM with f32 output planned exactly 227 KiB
# and was refused on the H200: 232528 > 232448 bytes).
SMEM_BYTES = 227 * 1024 - 1024


# Persistent CTAs when the kernels run in the interpreter under `plgpu.force_gpu_interpret_mode`
# (the library's kernels on a CPU, in tests and notebooks) with the default config: the
# interpreter simulates every CTA, and 132 mostly idle ones made a small grouped layer's
# forward + backward take over a minute. Each CTA runs whole work items, so the results do
# not depend on the count; with 4, CTAs still loop over several items.
INTERPRETER_NUM_SMS = 4


def num_sms_default() -> int:
    """SM count of the target: the abstract device when cross-lowering, else the device
    (INTERPRETER_NUM_SMS in forced interpret mode on a machine without a GPU)."""
    abstract_device = jax.sharding.get_abstract_mesh().abstract_device
    if abstract_device is not None and abstract_device.num_cores:
        return int(abstract_device.num_cores)
    device = jax.devices()[0]
    if device.platform == "gpu":
        return int(device.core_count)
    if quantize_common.interpreting(False):  # forced interpret mode
        return INTERPRETER_NUM_SMS
    return H200_NUM_SMS


def interpret_params(interpret: bool):
    """What plgpu.kernel's ``interpret=`` gets: None on the GPU, else the GPU interpreter.

    Outputs start NaN-filled so that unwritten elements show, and plain reads out of
    bounds raise. TMA copies follow the hardware (out-of-bounds loads fill zeros,
    stores are clipped), so partial tiles are exercised as on the GPU.
    """
    if not interpret:
        return None
    return plgpu.InterpretGPUParams(uninitialized_memory="nan", out_of_bounds_reads="raise")


# Warpgroups per CTA that Mosaic GPU's interpreter ran with a single host CPU device (stop 46);
# more needed as many host CPU devices (see check_interpreter_threads).
MAX_INTERPRETED_THREADS_ANY_HOST = 3


def check_interpreter_threads(num_threads: int, interpret: bool) -> None:
    """Refuses, with the remedy, an interpreted kernel that would hang on this CPU host.

    The interpreter runs each warpgroup of a CTA as a computation of its own on the CPU
    backend, and they wait for each other at barriers. Measured with jax 0.11.2 (stop 46,
    1- and 2-core runs alike): three warpgroups run with a single host device, but four (the
    three-consumer tiles) hang, without an error, unless the CPU backend has at least four
    devices (`XLA_FLAGS=--xla_force_host_platform_device_count=4`; tests/conftest.py sets 8).
    """
    if not quantize_common.interpreting(interpret) or jax.default_backend() != "cpu":
        return
    if num_threads <= MAX_INTERPRETED_THREADS_ANY_HOST:
        return
    devices = jax.local_device_count("cpu")
    if devices < num_threads:
        raise ValueError(
            f"interpret: this kernel runs {num_threads} warpgroups per CTA, and Mosaic GPU's "
            f"interpreter hangs with fewer host CPU devices than that (this process has "
            f"{devices}); set XLA_FLAGS=--xla_force_host_platform_device_count={num_threads} "
            "before jax starts, or use a config with fewer consumers (num_consumers=2)"
        )


def swizzle_elems(minor_dim_elems: int, dtype: jnp.dtype) -> int:
    """Elements per swizzle atom row of a tile whose minor dimension is ``minor_dim_elems``.

    Mosaic GPU builds the TMA descriptor on the tiled view (8, swizzle_elems) of the
    whole GMEM operand, so an operand's minor extent must be a multiple of this (and
    its major extent a multiple of 8); the wrappers zero-pad operands that are not.
    """
    bits = jnp.dtype(dtype).itemsize * 8
    return plgpu.find_swizzle(minor_dim_elems * bits) * 8 // bits


def smem_transforms(minor_dim_elems: int, dtype: jnp.dtype) -> tuple:
    """Tiling + swizzle transforms that wgmma and TMA want for a 2-D SMEM tile."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor_dim_elems * bits)
    return (
        plgpu.TilingTransform((8, swizzle * 8 // bits)),
        plgpu.SwizzleTransform(swizzle),
    )


@dataclasses.dataclass(frozen=True)
class RowTile:
    """One visit of a row tile by one (pseudo-)group, as traced scalars (int32)."""

    group: jax.Array  # group index; == num_groups for the zero-filled tail
    block_start: jax.Array  # first global row of the tile (multiple of tile_m)
    row_begin: jax.Array  # first row of this group inside the tile, relative to block_start
    num_rows: jax.Array  # rows of this group inside the tile (> 0 for every visit)
    # Output row of the visit's first row, for a packed output (None: block_start +
    # row_begin, the output rows are the lhs rows).
    out_row: jax.Array | None = None


def group_bounds(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """The clamped ``(start, end)`` of every group as an int32 ``(G, 2)`` array (jnp, for XLA).

    Negative sizes count as 0 and the running sum stops at ``num_rows`` (module docstring),
    with a saturating running sum: ``min(a + b, M)`` is associative for non-negative terms,
    and in uint32 ``a + b <= 2 M`` cannot overflow.
    """
    total = jnp.uint32(num_rows)
    sizes = jnp.clip(group_sizes.astype(jnp.int32), 0, num_rows).astype(jnp.uint32)
    ends = lax.associative_scan(lambda a, b: jnp.minimum(a + b, total), sizes).astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return jnp.stack([starts, ends], axis=1)


def max_visits(num_rows: int, num_groups: int, tile_m: int, num_out_rows: int | None = None) -> int:
    """Upper bound on the row-tile visits of ``num_groups`` groups and the tail; with
    ``num_out_rows`` (a packed output) the tail's visits are counted in the output's rows."""
    if num_out_rows is None:
        return pl.cdiv(num_rows, tile_m) + num_groups
    return pl.cdiv(num_rows, tile_m) + num_groups + pl.cdiv(num_out_rows, tile_m) + 1


def visit_table(
    group_sizes: jax.Array,
    num_groups: int,
    num_rows: int,
    tile_m: int,
    *,
    group_starts: jax.Array | None = None,
    num_out_rows: int | None = None,
) -> jax.Array:
    """The row-tile schedule as an int32 table (jnp, run by XLA before the kernel).

    Shape ``(1 + max_visits(...), C)``. Row 0 holds ``(visits of the real groups, visits of
    the tail, 0, ...)``; row ``1 + v`` holds visit ``v``'s ``(group, block, row_begin,
    num_rows)`` (see :class:`RowTile`; group ``num_groups`` is the tail; the tile index
    ``block``, not its first row, so that the kernel's ``block * tile_m`` is provably a
    multiple of the tile, which Mosaic GPU's layout inference needs for the TMA windows). Rows
    past the last visit are zeros and never read. Group bounds are clamped as the module
    docstring says (:func:`group_bounds`).

    A packed output (``group_starts`` (G,) and ``num_out_rows`` given; C = 5): group g's
    rows are lhs rows ``[group_starts[g], group_starts[g] + size_g)`` (starts clamped to
    [0, num_rows]; sizes clamped against ``num_out_rows``), its output rows packed from
    ``sum(size_j, j < g)``; the tail is ``[sum(sizes), num_out_rows)`` of the output, and its
    "tiles" are output tiles. Column 4 is the output row of the visit's first row.
    """
    packed = group_starts is not None
    if packed != (num_out_rows is not None):
        raise ValueError("group_starts and num_out_rows go together (a packed output)")
    tile = jnp.int32(tile_m)
    if packed:
        out_bounds = group_bounds(group_sizes, num_out_rows)
        sizes = out_bounds[:, 1] - out_bounds[:, 0]
        in_starts = jnp.clip(group_starts.astype(jnp.int32), 0, num_rows)
        total = out_bounds[-1:, 1]
        # G + 1 (pseudo-)groups: the real ones in lhs rows, then the tail in output rows.
        starts = jnp.concatenate([in_starts, total])
        ends = jnp.concatenate([in_starts + sizes, jnp.full((1,), num_out_rows, jnp.int32)])
        out_starts = jnp.concatenate([out_bounds[:, 0], total])
    else:
        bounds = group_bounds(group_sizes, num_rows)
        # G + 1 (pseudo-)groups: the real ones, then the tail [end_{G-1}, M).
        starts = jnp.concatenate([bounds[:, 0], bounds[-1:, 1]])
        ends = jnp.concatenate([bounds[:, 1], jnp.full((1,), num_rows, jnp.int32)])
        out_starts = starts
    visits = jnp.where(ends > starts, (ends + tile - 1) // tile - starts // tile, 0)
    last_visit = jnp.cumsum(visits)  # one past each (pseudo-)group's last visit
    first_visit = last_visit - visits
    visit = jnp.arange(max_visits(num_rows, num_groups, tile_m, num_out_rows), dtype=jnp.int32)
    # The owner of visit v: the (pseudo-)groups whose visits all come before v.
    owner = jnp.sum(last_visit[None, :] <= visit[:, None], axis=1, dtype=jnp.int32)
    valid = owner <= num_groups
    owner = jnp.minimum(owner, num_groups)
    block = starts[owner] // tile + visit - first_visit[owner]
    block_start = block * tile
    begin = jnp.maximum(starts[owner], block_start)
    stop = jnp.minimum(ends[owner], block_start + tile)
    columns = [owner, block, begin - block_start, jnp.maximum(stop - begin, 0)]
    if packed:
        columns.append(begin - starts[owner] + out_starts[owner])
    rows = jnp.where(valid[:, None], jnp.stack(columns, axis=1), 0)
    header = [last_visit[num_groups - 1], visits[num_groups]] + [jnp.int32(0)] * (len(columns) - 2)
    return jnp.concatenate([jnp.stack(header)[None], rows]).astype(jnp.int32)


def visit_counts(table_gmem) -> tuple[jax.Array, jax.Array]:
    """(visits of the real groups, visits of the zero-filled tail) from a visit table."""
    return table_gmem[0, 0], table_gmem[0, 1]


def row_tile_for_visit(table_gmem, visit: jax.Array, tile_m: int) -> RowTile:
    """Visit ``visit``'s group, tile and row range: four scalar loads from the table (five for
    a packed output's, whose table has the output row too)."""
    row = visit + 1
    packed = table_gmem.shape[1] == 5
    return RowTile(
        group=table_gmem[row, 0],
        block_start=table_gmem[row, 1] * jnp.int32(tile_m),
        row_begin=table_gmem[row, 2],
        num_rows=table_gmem[row, 3],
        out_row=table_gmem[row, 4] if packed else None,
    )


def store_row_range(
    values: jax.Array,
    out_smem,
    out_gmem_rows,
    tile: RowTile,
    tile_m: int,
    *,
    transposed: bool = False,
) -> None:
    """Writes rows ``[row_begin, row_begin + num_rows)`` of ``values`` to GMEM.

    ``values`` is (tile_m, cols) in registers (``transposed``: (cols, tile_m), written
    through the buffer's transposed view), ``out_smem`` an untransformed (tile_m, cols)
    SMEM buffer and ``out_gmem_rows`` the GMEM window whose row 0 is
    the tile's first row, or for a packed output (``tile.out_row``) the visit's first
    output row. TMA boxes have static sizes, so a run-time row count is written as a sum
    of power-of-two row slabs (at most log2(tile_m) + 1 copies); a full tile takes one
    copy. The copies are committed as a single bulk group.
    """
    if transposed:
        store_transposed(out_smem, values)
    else:
        out_smem[...] = values.astype(out_smem.dtype)
    plgpu.commit_smem()
    offset = tile.row_begin
    packed = tile.out_row is not None
    slab = 1 << (tile_m.bit_length() - 1)  # largest power of two <= tile_m
    while slab >= 1:
        take = (tile.num_rows & slab) != 0

        @pl.when(take)
        def _copy_slab(offset=offset, slab=slab):
            plgpu.copy_smem_to_gmem(
                out_smem.at[pl.ds(offset, slab)],
                out_gmem_rows.at[pl.ds(offset - tile.row_begin if packed else offset, slab)],
                commit_group=False,
            )

        offset = offset + jnp.where(take, jnp.int32(slab), jnp.int32(0))
        slab //= 2
    plgpu.commit_smem_to_gmem_group()


def store_transposed(out_smem, values: jax.Array) -> None:
    """Writes wgmma-layout ``values`` (cols, rows) into the (rows, cols) SMEM buffer
    ``out_smem`` through its transposed view. 16-bit values go as they are (``stmatrix``);
    32-bit ones are first moved to the WGMMA_TRANSPOSED layout (a shuffle), without which
    Mosaic GPU 0.11.2's layout inference finds no store for them."""
    values = values.astype(out_smem.dtype)
    if jnp.dtype(out_smem.dtype).itemsize == 4:
        values = plgpu.layout_cast(values, plgpu.Layout.WGMMA_TRANSPOSED)
    out_smem.transpose((1, 0))[...] = values


def e8m0_to_f32(byte_values: jax.Array) -> jax.Array:
    """2^(byte - 127) in f32 for E8M0 bytes given as int32 (0xFF, NaN, is not expected).

    Byte 0 is 2^-127, an f32 subnormal (bit pattern 0x00400000); every other byte
    is a normal power of two whose bit pattern is ``byte << 23``.
    """
    bits = jnp.where(byte_values == 0, jnp.int32(0x00400000), byte_values << 23)
    return lax.bitcast_convert_type(bits, jnp.float32)


# ---------------------------------------------------------------- host-side checks


def check_dtype(name: str, array: jax.Array, allowed: Sequence[jnp.dtype]) -> None:
    if jnp.dtype(array.dtype) not in tuple(jnp.dtype(d) for d in allowed):
        names = ", ".join(jnp.dtype(d).name for d in allowed)
        raise TypeError(f"{name} must have dtype in ({names}), got {jnp.dtype(array.dtype).name}")


def check_shape(name: str, array: jax.Array, shape: tuple[int, ...]) -> None:
    if tuple(array.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(array.shape)}")


def check_rank(name: str, array: jax.Array, rank: int) -> None:
    if not hasattr(array, "shape") or len(array.shape) != rank:
        shape = getattr(array, "shape", None)
        raise ValueError(f"{name} must have rank {rank}, got shape {shape}")


def check_group_sizes(
    group_sizes: jax.Array, num_groups: int | None, name: str = "group_sizes"
) -> int:
    """Validates ``group_sizes`` (or another per-group int32 vector, named ``name``); returns
    the number of groups."""
    check_rank(name, group_sizes, 1)
    if jnp.dtype(group_sizes.dtype) != jnp.dtype(jnp.int32):
        raise TypeError(f"{name} must be int32, got {jnp.dtype(group_sizes.dtype).name}")
    if num_groups is not None and group_sizes.shape[0] != num_groups:
        raise ValueError(
            f"{name} must have length {num_groups} (the number of groups), "
            f"got {group_sizes.shape[0]}"
        )
    if group_sizes.shape[0] < 1:
        raise ValueError(f"{name} must have at least one group")
    return int(group_sizes.shape[0])


def check_block_scaled_operands(lhs, lhs_scale, rhs, rhs_scale, scale_dtype, out_dtype):
    """Ranks and dtypes of a block-scaled ragged-row GEMM's operands (lhs (M, K) and rhs
    (G, N, K) FP8, 2-D / 3-D scales of `scale_dtype`), out_dtype, and the contraction size;
    returns (out_dtype, M, K, G, N). The caller checks the scales' shapes."""
    check_rank("lhs", lhs, 2)
    check_rank("rhs", rhs, 3)
    check_rank("lhs_scale", lhs_scale, 2)
    check_rank("rhs_scale", rhs_scale, 3)
    check_dtype("lhs", lhs, FP8_DTYPES)
    check_dtype("rhs", rhs, FP8_DTYPES)
    check_dtype("lhs_scale", lhs_scale, (scale_dtype,))
    check_dtype("rhs_scale", rhs_scale, (scale_dtype,))
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be bfloat16 or float32, got {out_dtype.name}")
    num_rows, k = lhs.shape
    num_groups, num_cols, k_rhs = rhs.shape
    if k_rhs != k:
        raise ValueError(f"rhs contraction size {k_rhs} does not match lhs K={k}")
    return out_dtype, num_rows, k, num_groups, num_cols


def pad_axis(array: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    """`array` padded with `value` along `axis` up to `size` (unchanged if already that long)."""
    if array.shape[axis] >= size:
        return array
    widths = [(0, 0)] * array.ndim
    widths[axis] = (0, size - array.shape[axis])
    return jnp.pad(array, widths, constant_values=value)


def round_up(value: int, multiple: int) -> int:
    return math.ceil(value / multiple) * multiple


def is_power_of_two(value: int) -> bool:
    return value > 0 and (value & (value - 1)) == 0
