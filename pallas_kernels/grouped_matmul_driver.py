"""Persistent, warp-specialized driver shared by the ragged-row (forward/dgrad) kernels.

One CTA per SM runs a TMA producer warpgroup and two (or three) wgmma consumers. The
CTA tile is ``tile_m x (2 * tile_n)``. By default (``consumer_split="n"``) both consumers
share the ``tile_m`` lhs rows and each owns ``tile_n`` output columns; with
``consumer_split="m"`` each of the ``num_consumers`` owns ``tile_m / num_consumers`` of the
rows and all ``2 * tile_n`` columns, so a consumer's wgmma is one m64n256 instruction per K
slice instead of two m64n128 ones that both read the rhs slice (see TileSchedule); three
consumers make 192-row tiles with 64-row parts. All consumers work on the same visit (one
group's rhs), and each stores only the rows of its part that belong to the visit's group.
Each CTA loops over *work items*, (row-tile visit, column item) pairs, in a planar-snake
order (for L2 reuse of the rhs tile of a group). Only visits of real groups are items (their
count and each visit's rows come from the visit table that XLA computes from
``group_sizes`` before the launch, see grouped_matmul_common); the tail rows past the last
group are zero-filled by the consumers in a second loop, without the producer.

Two options change how the items run:

* ``cluster_n=2``: CTAs run in clusters of two along N. Both CTAs of a cluster take the
  same row tile and adjacent column tiles, and the lhs tile of every K step is loaded
  once and multicast to both (TMA multicast), halving the lhs traffic from L2.
* ``cluster_m=2`` (one group only: the dense entry points): CTAs run in clusters of two
  along M. Both take the same column tile and consecutive row tiles, and the rhs tile of
  every K step (the larger operand of a 64-row tile) is loaded once and multicast to both.
  With an odd number of row tiles the last cluster's second CTA repeats its partner's tile
  (it must take part in every multicast load) and stores nothing.
* ``persistent_pipeline``: the TMA pipeline keeps running from one item to the next
  (``pipeline_state``): the producer loads the next item's first K steps while the
  consumers finish the current one and store its outputs, instead of starting each
  item with an empty pipeline.
* ``stream_k``: the items of the last round and one full round before it are split along
  K so that every CTA ends together (the data-parallel + stream-K hybrid CUTLASS
  describes; see :class:`StreamKShare`). An item cut in two leaves the raw f32 accumulator
  of its first K steps in a workspace and signals a global semaphore; the CTA holding its
  last K steps waits for it, starts its accumulator from it and stores the tile: the same
  sums in the same order as the unsplit item, so the same bits.

A format plugs in through :class:`RowKernelParts`: which tiles to stream through the
pipeline, what one K step does, and how the f32 tile is finished (scales).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import grouped_matmul_common as common
from pallas_kernels import quantize_common
from pallas_kernels.manual_axes import varying_like

# Names of the consumers' profiler ranges (see TileSchedule.profile_dir).
PROFILE_K_LOOP, PROFILE_EPILOGUE, PROFILE_ZERO_TAIL = "k_loop", "epilogue", "zero_tail"

# Consumer warpgroups of the default schedule (the MXFP8 kernel sizes its buffers for them).
NUM_CONSUMERS = 2
# Registers a thread kept by the TMA warpgroup, by consumer count; the consumers share the
# rest at run time (`setmaxnreg`): 232 each for two, 160 each for three (the PTX minimum of
# 24 for the producer, as FlashAttention-3 gives its three-consumer kernels). ptxas reports
# the launch bound, 65536 / threads: 168 a thread for three warpgroups, 128 for four
# (`benchmarks/kernel_resources.py`); with four, 64 x 256 consumer parts failed to compile
# naming that 128 (GroupedMatmulConfig refuses them; docs/kernels_grouped_matmul.md).
_PRODUCER_REGISTERS = {2: 40, 3: 24}


@dataclasses.dataclass(frozen=True)
class TileSchedule:
    """Static tiling shared by a kernel's producer and consumers."""

    tile_m: int
    tile_n: int  # columns per consumer warpgroup
    max_concurrent_steps: int
    epi_tile_n: int
    epilogue_buffers: int  # 1 or 2 SMEM staging buffers per consumer
    swizzled_epilogue: bool  # whole row tiles through the swizzled staging view
    grid_minor_dim: int  # 0: walk row tiles fastest, 1: column tiles fastest
    grid_tile_width: int
    num_sms: int
    persistent_pipeline: bool = False  # keep the TMA pipeline running across items
    cluster_n: int = 1  # CTAs per cluster along N (2: the lhs tile is multicast)
    cluster_m: int = 1  # CTAs per cluster along M (2: the rhs tile is multicast; one group)
    profile_dir: str | None = None  # Mosaic GPU profiler trace of the consumers' ranges
    # "n": the consumers share the tile's rows and split its columns (each tile_m x tile_n);
    # "m": they split the rows and share the columns (each tile_m / 2 x 2 * tile_n). For
    # the same accumulator registers "m" reads a sixth less shared memory per product: at
    # the 128 x (2 x 128) tile, per 16-wide K slice of bf16, a consumer issues two m64n128
    # wgmmas (2 KB of lhs rows + its 4 KB of rhs columns each, 12 KB) under "n" and one
    # m64n256 (2 KB + all 8 KB of rhs, 10 KB) under "m", for the same 128 x 128 x 16 products.
    consumer_split: str = "n"  # validated by GroupedMatmulConfig, which builds the schedule
    # Consumer warpgroups: 2, or 3 with consumer_split="m" (each a third of the rows).
    num_consumers: int = NUM_CONSUMERS
    # Split the last two rounds' items along K (see StreamKShare); no clusters.
    stream_k: bool = False

    @property
    def consumer_rows(self) -> int:
        """Rows of one consumer's part of the CTA tile."""
        return self.part_shape[0]

    @property
    def consumer_cols(self) -> int:
        """Columns of one consumer's part of the CTA tile."""
        return self.part_shape[1]

    @property
    def part_shape(self) -> tuple[int, int]:
        return consumer_part_shape(
            self.tile_m, self.tile_n, self.consumer_split, self.num_consumers
        )

    def consumer_row_offset(self, consumer: jax.Array) -> jax.Array | int:
        """First row of a consumer's part, relative to the CTA tile's first row."""
        if self.consumer_split == "m":
            return consumer * jnp.int32(self.consumer_rows)
        return 0  # a Python int: a constant array start breaks the wgmma operand's lowering

    def consumer_col_offset(self, consumer: jax.Array) -> jax.Array | int:
        """First column of a consumer's part, relative to the CTA tile's first column."""
        if self.consumer_split == "n":
            return consumer * jnp.int32(self.tile_n)
        return 0  # a Python int, as in consumer_row_offset


def consumer_part_shape(
    tile_m: int, tile_n: int, consumer_split: str, num_consumers: int = NUM_CONSUMERS
) -> tuple[int, int]:
    """(rows, columns) of one consumer's part of a tile_m x (2 * tile_n) CTA tile."""
    if consumer_split == "m":
        return tile_m // num_consumers, 2 * tile_n
    return tile_m, tile_n


@dataclasses.dataclass(frozen=True)
class StreamKShare:
    """One CTA's share of a stream-K schedule (int32 scalars, traced in the kernel).

    The first ``dp_items`` items run whole, item ``cta + i * num_ctas`` on CTA ``cta``
    (whole rounds when anything is split: every CTA runs the same number). The rest, the
    last part-full round and one full round before it, are cut into units (item, K step),
    item-major, and CTA ``cta`` runs the units ``[unit_begin, unit_end)``: between one and
    two items' worth, so each of those items is split between at most two consecutive CTAs,
    and each CTA holds at most one item's first K steps (of its last item) and one item's
    last K steps (of its first).
    """

    dp_items: jax.Array
    unit_begin: jax.Array
    unit_end: jax.Array
    num_k_steps: int

    @property
    def num_pieces(self) -> jax.Array:
        """Items this CTA's units touch (0 to 3)."""
        first = lax.div(self.unit_begin, jnp.int32(self.num_k_steps))
        last = lax.div(self.unit_end - 1, jnp.int32(self.num_k_steps))
        return jnp.where(self.unit_end > self.unit_begin, last - first + 1, 0)

    def piece(self, index: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(item, k_begin, k_end) of piece ``index``, the items in *descending* order.

        Descending, a CTA first runs the piece whose partial another CTA will need (its
        last item's first K steps) and last the piece that needs one (its first item's last
        K steps, whose partial the previous CTA wrote at the start): the wait costs nothing.
        The item is counted from the first stream-K item.
        """
        num_k_steps = jnp.int32(self.num_k_steps)
        item = lax.div(self.unit_end - 1, num_k_steps) - index
        k_begin = jnp.maximum(self.unit_begin - item * num_k_steps, 0)
        k_end = jnp.minimum(self.unit_end - item * num_k_steps, num_k_steps)
        return item, k_begin, k_end


def stream_k_share(
    num_items: jax.Array, cta: jax.Array, num_ctas: int, num_k_steps: int
) -> StreamKShare:
    """CTA ``cta``'s share of ``num_items`` items of ``num_k_steps`` K steps on ``num_ctas``
    CTAs (see StreamKShare). With fewer items than CTAs, or whole rounds, nothing is split."""
    for arg, value in (("num_ctas", num_ctas), ("num_k_steps", num_k_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{arg} must be a positive int, got {value!r}")
    num_items = jnp.asarray(num_items, jnp.int32)
    cta = jnp.asarray(cta, jnp.int32)
    full_rounds = lax.div(num_items, jnp.int32(num_ctas))
    leftover = lax.rem(num_items, jnp.int32(num_ctas))
    split_items = jnp.where((full_rounds >= 1) & (leftover > 0), num_ctas + leftover, 0)
    units = split_items * num_k_steps
    return StreamKShare(
        dp_items=num_items - split_items,
        unit_begin=lax.div(cta * units, jnp.int32(num_ctas)),
        unit_end=lax.div((cta + 1) * units, jnp.int32(num_ctas)),
        num_k_steps=num_k_steps,
    )


@dataclasses.dataclass(frozen=True)
class TilePrefetch:
    """A per-tile slice of an operand that each consumer TMA-copies to SMEM at tile start.

    kind "rows": the operand is (rows,) or (R, rows) and the consumer's rows of the tile
    (``TileSchedule.consumer_rows``) are cut from the last axis. kind "group_cols": the
    operand is (G, cols) or (G, R, cols); the tile's group is selected and the consumer's
    columns (``consumer_cols``) are cut from the last axis. The wrapper pads the last axis so
    that every slice is in bounds.
    """

    operand: int
    kind: str

    def __post_init__(self):
        if self.kind not in ("rows", "group_cols"):
            raise ValueError(f"kind must be 'rows' or 'group_cols', got {self.kind!r}")


@dataclasses.dataclass(frozen=True)
class TileContext:
    """Traced per-tile values handed to a format's callbacks."""

    row_tile: common.RowTile
    col_tile: jax.Array  # index of the CTA column tile (2 * tile_n columns)
    consumer: jax.Array  # 0 .. num_consumers - 1 inside a consumer warpgroup
    # This consumer's part of the CTA tile, relative to its first row / column (see
    # TileSchedule.consumer_split): the lhs rows and rhs columns its wgmma reads.
    row_slice: Any = None
    col_slice: Any = None
    prefetched: tuple = ()  # (smem ref, barrier ref) of this consumer, per TilePrefetch
    scratch: tuple = ()  # the refs of RowKernelParts.scratch (shared by the consumers)
    k_step: jax.Array | None = None  # inside `step`: the K step of this tile (from 0)
    # The first K step the tile's pipeline runs: 0, or a stream-K piece's first (the pieces
    # of a split item run K steps [k_begin, k_end) of it; `k_step` still counts from 0).
    k_begin: Any = 0
    # Whether the pipeline's carry holds the accumulators as values (a stream-K piece, which
    # starts them from a part; see RowKernelParts.accumulate) rather than as ACC refs.
    values_carried: bool = False

    def wait_prefetched(self, index: int):
        """Waits for prefetch ``index`` (call exactly once per tile) and returns its SMEM ref."""
        smem_ref, barrier = self.prefetched[index]
        plgpu.barrier_wait(barrier)
        return smem_ref


@dataclasses.dataclass(frozen=True)
class RowKernelParts:
    """What a format contributes to the ragged-row driver.

    in_specs -> BlockSpecs streamed per K step; index maps see only the K step, so
        pipeline_refs slices the tile's rows/columns out of the operands. in_specs[0]
        must stream the lhs rows: with clusters it is the operand the CTAs share.
    pipeline_refs(refs, ctx) -> the GMEM windows those specs read, in order.
    allocation_refs(refs) -> refs of the same shapes, for sizing SMEM once.
    run_tile(refs, ctx, run_pipeline) -> f32 (consumer_rows, consumer_cols) part of the
        tile of this consumer, scales applied; ``run_pipeline(carry)`` runs the K loop and
        returns the carry.
    step(refs, ctx, smem_refs, carry) -> carry: one K step of one consumer.
    prefetches: per-tile operand slices copied to SMEM at tile start (see TilePrefetch).
    scratch: SMEM buffers and barriers the format's steps use (plgpu.SMEM / plgpu.Barrier),
        allocated once per CTA and shared by the consumers (TileContext.scratch).
    column_specs: indices of the in_specs whose tiles depend on the column tile and K step
        only (the rhs streams), which clusters along M multicast; None: the kernel does not
        run with ``cluster_m=2``.
    accumulate, finish: for ``stream_k``, run_tile in two halves, or None (no stream-K):
        ``accumulate(refs, ctx, run_pipeline, start) -> raw`` runs the K loop from the f32
        part ``start`` (zeros, or the raw part of the item's earlier K steps) instead of
        zeros, and ``finish(refs, ctx, raw) -> values`` what run_tile does after its K loop
        (scales). The steps must work on any range of K steps: they read the K step from
        ``TileContext.k_step``, which counts from the item's first, and the range's first
        from ``TileContext.k_begin``. A split item then sums its K steps in the same order
        into the same accumulator as a whole one: the same bits.
    values_transposed: run_tile returns the consumer's part transposed, (consumer_cols,
        consumer_rows): its wgmma had the rhs rows on the M side (the register A operand) and
        the lhs rows on the N side. The epilogue stores it through transposed SMEM views.
    """

    in_specs: Sequence[Any]
    pipeline_refs: Callable[[Sequence[Any], TileContext], Sequence[Any]]
    allocation_refs: Callable[[Sequence[Any]], Sequence[Any]]
    run_tile: Callable[..., jax.Array]
    step: Callable[[Sequence[Any], TileContext, Sequence[Any], Any], Any]
    num_k_steps: int
    prefetches: tuple[TilePrefetch, ...] = ()
    scratch: tuple = ()
    column_specs: tuple[int, ...] | None = None
    accumulate: Callable[..., Any] | None = None
    finish: Callable[..., jax.Array] | None = None
    values_transposed: bool = False

    @property
    def supports_stream_k(self) -> bool:
        return self.accumulate is not None and self.finish is not None


def ragged_rows_call(
    group_sizes: jax.Array,
    operands: Sequence[jax.Array],
    *,
    num_rows: int,
    num_cols: int,
    num_groups: int,
    out_dtype: jnp.dtype,
    schedule: TileSchedule,
    parts: RowKernelParts,
    interpret: bool,
    name: str,
    group_starts: jax.Array | None = None,
    num_out_rows: int | None = None,
) -> jax.Array:
    """Runs a ragged-row kernel; returns ``out (num_rows, num_cols)``, or with ``group_starts``
    (G,) and ``num_out_rows`` a packed ``out (num_out_rows, num_cols)``: group g reads lhs rows
    from ``group_starts[g]`` and writes its rows after the previous groups' (see
    grouped_matmul_common's module docstring)."""
    packed = group_starts is not None
    tile_m, tile_n = schedule.tile_m, schedule.tile_n
    num_consumers = schedule.num_consumers  # validated by GroupedMatmulConfig
    part_rows, part_cols = schedule.consumer_rows, schedule.consumer_cols
    epi_tile_n = schedule.epi_tile_n
    if part_cols % epi_tile_n:
        raise ValueError(
            f"config: epi_tile_n={epi_tile_n} must divide a consumer's {part_cols} columns"
        )
    num_epi_chunks = part_cols // epi_tile_n
    num_buffers = schedule.epilogue_buffers
    cluster_n, cluster_m = schedule.cluster_n, schedule.cluster_m
    cluster_size = cluster_n * cluster_m
    # With two buffers that alternate, a chunk only waits for the store before last;
    # an odd chunk count breaks the parity across tiles, so then (or with one buffer)
    # each chunk waits until the previous store has read its buffer.
    stores_in_flight = 1 if num_buffers == 2 and num_epi_chunks % 2 == 0 else 0
    epilogue_shape = (num_consumers, num_buffers, part_rows, epi_tile_n)
    swizzled_transforms = common.smem_transforms(epi_tile_n, out_dtype)
    num_col_tiles = pl.cdiv(num_cols, 2 * tile_n)
    if num_col_tiles % cluster_n:
        raise ValueError(
            f"{num_col_tiles} column tiles cannot be split over clusters of cluster_n="
            f"{cluster_n} CTAs (the wrapper pads the columns to whole clusters)"
        )
    num_col_items = num_col_tiles // cluster_n
    in_specs = tuple(parts.in_specs)
    if cluster_n > 1:
        # Both CTAs of a cluster read the same lhs rows: one multicast load feeds both.
        in_specs = (dataclasses.replace(in_specs[0], collective_axes=("cluster",)), *in_specs[1:])
    if cluster_m > 1:  # (GroupedMatmulConfig refuses cluster_m=2 with cluster_n=2)
        if num_groups != 1:
            raise ValueError(
                f"config: cluster_m=2 needs a single group (the dense entry points), got "
                f"{num_groups} groups: the two CTAs of a cluster share every rhs tile, and "
                "consecutive row tiles may belong to different groups"
            )
        if parts.column_specs is None:
            raise ValueError(f"config: {name} does not support cluster_m=2")
        # Both CTAs of a cluster read the same rhs columns: one multicast load feeds both.
        in_specs = tuple(
            dataclasses.replace(spec, collective_axes=("cluster",))
            if i in parts.column_specs
            else spec
            for i, spec in enumerate(in_specs)
        )
    pipeline_depth = min(schedule.max_concurrent_steps, parts.num_k_steps)
    if schedule.persistent_pipeline:
        if parts.num_k_steps % pipeline_depth:
            raise ValueError(
                f"config: persistent_pipeline needs the {parts.num_k_steps} K steps to be a "
                f"multiple of max_concurrent_steps={schedule.max_concurrent_steps}"
            )
        if any(getattr(spec, "delay_release", 0) for spec in in_specs):
            raise ValueError(
                "config: persistent_pipeline cannot keep a wgmma in flight across steps "
                "(wgmma_in_flight must be 0)"
            )
    stream_k = schedule.stream_k
    num_ctas = schedule.num_sms // cluster_size
    # (GroupedMatmulConfig refuses stream_k with clusters or a wgmma in flight.)
    if stream_k and not parts.supports_stream_k:
        raise ValueError(f"config: {name} does not support stream_k")
    num_prefetches = len(parts.prefetches)
    prefetch_types = []
    for prefetch in parts.prefetches:
        operand = operands[prefetch.operand]
        if prefetch.kind == "rows":
            shape = (*operand.shape[:-1], part_rows)
        else:
            shape = (*operand.shape[1:-1], part_cols)
        prefetch_types.append((shape, operand.dtype))

    def body(visit_table_gmem, *refs):
        operand_refs, out_gmem = refs[: len(operands)], refs[len(operands)]
        # stream_k: each CTA's f32 partial of the item it splits with the next CTA, and a
        # global semaphore per (CTA, consumer) that says it is written. XLA zero-fills the
        # semaphores before each launch; the interpreter runs the CTAs one after another in
        # grid order (a partial is always written before its reader runs) and has none.
        partials_gmem = refs[len(operands) + 1] if stream_k else None
        partial_ready = None
        if stream_k and not quantize_common.interpreting(interpret):
            partial_ready = pl.get_global(plgpu.SemaphoreType.REGULAR((num_ctas * num_consumers,)))
        num_group_visits, num_tail_visits = common.visit_counts(visit_table_gmem)
        cta = lax.axis_index("cluster") if cluster_size > 1 else jnp.int32(0)
        cta_n = cta if cluster_n > 1 else jnp.int32(0)  # this CTA's column tile in its cluster
        if cluster_m > 1:
            # A cluster takes two row visits at once (rounded up: see the module docstring).
            num_row_items = lax.div(num_group_visits + 1, jnp.int32(2))
            num_tail_items = lax.div(num_tail_visits + 1, jnp.int32(2))
        else:
            num_row_items, num_tail_items = num_group_visits, num_tail_visits

        def make_pipeline(
            step_fn, compute_context, pipeline_state=None, *, specs=in_specs, num_steps=None
        ):
            return plgpu.emit_pipeline_warp_specialized(
                step_fn,
                grid=(parts.num_k_steps if num_steps is None else num_steps,),
                memory_registers=_PRODUCER_REGISTERS[num_consumers],
                in_specs=specs,
                wg_axis="wg",
                num_compute_wgs=num_consumers,
                # (A static grid shrinks the depth to its steps itself; a stream-K piece's
                # dynamic grid would not, and must use the slots allocated for the static
                # one. Stream-K keeps no wgmma in flight, so the shrunk depth is valid.)
                max_concurrent_steps=(
                    schedule.max_concurrent_steps if num_steps is None else pipeline_depth
                ),
                compute_context=compute_context,
                pipeline_state=pipeline_state,
            )

        ignore = lambda *_, **__: None

        @functools.partial(
            pl.run_scoped,
            pipeline_allocs=make_pipeline(ignore, ignore).get_allocations(
                *parts.allocation_refs(operand_refs)
            ),
            # Two views of one staging area: whole row tiles go through the swizzled view
            # (conflict-free register stores, one TMA copy); a tile shared with another
            # group goes through the plain view, whose rows TMA can copy from any offset.
            out_smem=plgpu.RefUnion(
                plgpu.SMEM(epilogue_shape, out_dtype),
                plgpu.SMEM(epilogue_shape, out_dtype, transforms=swizzled_transforms),
            ),
            prefetch_smem=[
                plgpu.SMEM((num_consumers, *shape), dtype) for shape, dtype in prefetch_types
            ],
            prefetch_barriers=plgpu.Barrier(num_barriers=num_consumers * max(1, num_prefetches)),
            scratch=list(parts.scratch),
            collective_axes="wg",
        )
        def _scope(pipeline_allocs, out_smem, prefetch_smem, prefetch_barriers, scratch):
            plain_out_smem, swizzled_out_smem = out_smem
            wg = lax.axis_index("wg")

            def prefetch_slices(row_tile, col_tile, consumer):
                """(GMEM window, SMEM buffer, barrier) of each prefetch for one consumer."""
                slices = []
                for i, prefetch in enumerate(parts.prefetches):
                    gmem = operand_refs[prefetch.operand]
                    if prefetch.kind == "rows":
                        row0 = row_tile.block_start + schedule.consumer_row_offset(consumer)
                        window = gmem.at[..., pl.ds(row0, part_rows)]
                    else:
                        col0 = col_tile * (2 * tile_n) + schedule.consumer_col_offset(consumer)
                        window = gmem.at[row_tile.group].at[..., pl.ds(col0, part_cols)]
                    barrier = prefetch_barriers.at[i * num_consumers + consumer]
                    slices.append((window, prefetch_smem[i].at[consumer], barrier))
                return slices

            def store_chunk(
                chunk_values, slot: int, chunk_gmem, cols, row_tile: common.RowTile, consumer
            ) -> None:
                """Stores one epilogue chunk of a consumer's part of the tile, whose rows of
                the visit `row_tile` gives (relative to the part's first row): `chunk_gmem` is
                its GMEM window from the part's first row; a packed output's windows start at
                the visit's output row instead, built from the chunk's columns `cols`."""

                def packed_window(first_row):
                    return out_gmem.at[pl.ds(first_row, part_rows)].at[:, cols]

                def store_rows_of_group():
                    common.store_row_range(
                        chunk_values,
                        plain_out_smem.at[consumer, slot],
                        packed_window(row_tile.out_row) if packed else chunk_gmem,
                        row_tile,
                        part_rows,
                        transposed=parts.values_transposed,
                    )

                if not schedule.swizzled_epilogue:
                    store_rows_of_group()
                    return
                whole_tile = row_tile.num_rows == part_rows
                if packed:
                    # TMA writes a swizzled tile through GMEM's (8, ·)-tiled view: whole tiles
                    # of a packed output go that way from rows that are multiples of 8 only.
                    whole_tile = whole_tile & ((row_tile.out_row & 7) == 0)

                @pl.when(whole_tile)
                def _store_whole_tile():
                    swizzled = swizzled_out_smem.at[consumer, slot]
                    if parts.values_transposed:
                        common.store_transposed(swizzled, chunk_values)
                    else:
                        swizzled[...] = chunk_values.astype(out_dtype)
                    plgpu.commit_smem()
                    if packed:
                        window = packed_window(pl.multiple_of(row_tile.out_row, 8))
                    else:
                        window = chunk_gmem
                    plgpu.copy_smem_to_gmem(swizzled, window)

                pl.when(jnp.logical_not(whole_tile))(store_rows_of_group)

            def store_tile(values: jax.Array, ctx: TileContext) -> None:
                """Stores a consumer's part of the tile: the rows of it that the visit owns."""
                row_off = schedule.consumer_row_offset(ctx.consumer)
                col0 = ctx.col_tile * (2 * tile_n) + schedule.consumer_col_offset(ctx.consumer)
                part = consumer_part(ctx.row_tile, row_off)
                rows = out_gmem.at[pl.ds(ctx.row_tile.block_start + row_off, part_rows)]

                def store_chunks():
                    for chunk in range(num_epi_chunks):
                        plgpu.wait_smem_to_gmem(stores_in_flight, wait_read_only=True)
                        chunk_cols = slice(chunk * epi_tile_n, (chunk + 1) * epi_tile_n)
                        chunk_values = (
                            values[chunk_cols] if parts.values_transposed else values[:, chunk_cols]
                        )
                        cols = pl.ds(col0 + chunk * epi_tile_n, epi_tile_n)
                        chunk_gmem = None if packed else rows.at[:, cols]
                        store_chunk(
                            chunk_values, chunk % num_buffers, chunk_gmem, cols, part, ctx.consumer
                        )

                if schedule.consumer_split == "n":
                    store_chunks()  # every visit has rows in the whole tile
                else:
                    pl.when(part.num_rows > 0)(store_chunks)

            def consumer_part(row_tile: common.RowTile, row_off) -> common.RowTile:
                """The visit's rows inside a consumer's part of the tile, which starts
                `row_off` rows into it (the visit itself under consumer_split="n")."""
                if schedule.consumer_split == "n":
                    return row_tile
                begin = jnp.clip(row_tile.row_begin - row_off, 0, part_rows)
                end = jnp.clip(row_tile.row_begin + row_tile.num_rows - row_off, 0, part_rows)
                out_row = row_tile.out_row
                if out_row is not None:  # the output row of the part's first stored row
                    out_row = out_row + (row_off + begin - row_tile.row_begin)
                return common.RowTile(
                    group=row_tile.group,
                    block_start=row_tile.block_start + row_off,
                    row_begin=begin,
                    num_rows=end - begin,
                    out_row=out_row,
                )

            def pipeline_state(loop_info: plgpu.NDLoopInfo):
                """START on this CTA's first item, STOP on its last, STEADY between.

                A CTA with a single item runs it as START: the producer then skips the
                final wait for the consumers' releases, which nothing follows anyway.
                """
                if not schedule.persistent_pipeline:
                    return None
                step, last = loop_info.local_index, loop_info.num_local_steps - 1
                return jnp.where(
                    step == 0,
                    jnp.int32(plgpu.PipelinePipeline.START),
                    jnp.where(
                        step == last,
                        jnp.int32(plgpu.PipelinePipeline.STOP),
                        jnp.int32(plgpu.PipelinePipeline.STEADY),
                    ),
                )

            def split_item_tile(run_pipeline, ctx: TileContext, k_end) -> None:
                """A stream-K piece (K steps [ctx.k_begin, k_end) of its item): one that
                continues an item starts from the previous CTA's raw part, written first (so
                the item's K steps go into one accumulator in order: the unsplit bits); one
                that stops short of the item's end writes its raw part for the next CTA and
                stores nothing; the others store their tile."""
                sm = lax.axis_index("sm")

                def previous_part():
                    previous = jnp.maximum(sm - 1, 0)  # (a piece on CTA 0 never continues)
                    if partial_ready is not None:
                        # Waits and takes the signal back: zero again for the next launch.
                        plgpu.semaphore_wait(
                            partial_ready.at[previous * num_consumers + wg], 1, memory_scope="gpu"
                        )
                    return plgpu.load(
                        partials_gmem.at[previous, wg], layout=plgpu.Layout.WGMMA, optimized=False
                    )

                start = lax.cond(
                    ctx.k_begin > 0, previous_part, lambda: wgmma_zeros((part_rows, part_cols))
                )
                with jax.named_scope(PROFILE_K_LOOP):
                    raw = parts.accumulate(operand_refs, ctx, run_pipeline, start)
                    # (Always: finish waits for the tile's prefetched scales, once per tile.)
                    values = parts.finish(operand_refs, ctx, raw)
                hands_over = k_end < parts.num_k_steps

                @pl.when(hands_over)
                def _write_part():
                    partials_gmem.at[sm, wg][...] = raw
                    if partial_ready is not None:
                        # A release at GPU scope after the warpgroup's stores (the lowering
                        # puts a warpgroup barrier before the one thread that signals).
                        plgpu.semaphore_signal(
                            partial_ready.at[sm * num_consumers + wg], 1, memory_scope="gpu"
                        )

                with jax.named_scope(PROFILE_EPILOGUE):
                    pl.when(jnp.logical_not(hands_over))(lambda: store_tile(values, ctx))

            def run_item(linear, pipeline_state_of=lambda: None, k_range=None):
                """Runs item ``linear`` (or its K steps ``k_range = (k_begin, k_end)``);
                ``pipeline_state_of()`` gives its pipeline state where the pipeline starts."""
                row_item, col_item = plgpu.planar_snake(
                    linear,
                    (num_row_items, num_col_items),
                    schedule.grid_minor_dim,
                    schedule.grid_tile_width,
                )
                owns_tile = None  # every CTA stores its own tile
                if cluster_m > 1:
                    own_visit = row_item * cluster_m + cta
                    # Past the last visit: repeat the partner's tile for the multicast loads.
                    visit = jnp.minimum(own_visit, num_group_visits - 1)
                    owns_tile = own_visit < num_group_visits
                else:
                    visit = row_item
                row_tile = common.row_tile_for_visit(visit_table_gmem, visit, tile_m)
                col_tile = col_item * cluster_n + cta_n
                slices = prefetch_slices(row_tile, col_tile, wg)
                ctx = TileContext(
                    row_tile=row_tile,
                    col_tile=col_tile,
                    consumer=wg,
                    row_slice=pl.ds(schedule.consumer_row_offset(wg), part_rows),
                    col_slice=pl.ds(schedule.consumer_col_offset(wg), part_cols),
                    prefetched=tuple((smem, barrier) for _, smem, barrier in slices),
                    scratch=tuple(scratch),
                    k_begin=0 if k_range is None else k_range[0],
                    values_carried=k_range is not None,
                )
                k_begin = ctx.k_begin

                def compute_context(run_pipeline):
                    # Issued before the K loop so that the scales are in SMEM when needed.
                    for window, smem, barrier in slices:
                        plgpu.copy_gmem_to_smem(window, smem, barrier)
                    if k_range is not None:
                        split_item_tile(run_pipeline, ctx, k_range[1])
                        return
                    # Named scopes are the profiler's ranges (schedule.profile_dir); they
                    # change nothing else.
                    with jax.named_scope(PROFILE_K_LOOP):
                        values = parts.run_tile(operand_refs, ctx, run_pipeline)
                    with jax.named_scope(PROFILE_EPILOGUE):
                        if owns_tile is None:
                            store_tile(values, ctx)
                        else:
                            pl.when(owns_tile)(lambda: store_tile(values, ctx))

                def step_fn(idxs, *smem_and_carry):
                    *smem_refs, carry = smem_and_carry
                    (k_step,) = idxs
                    step_ctx = dataclasses.replace(ctx, k_step=k_step + k_begin)
                    return parts.step(operand_refs, step_ctx, smem_refs, carry)

                pipeline_kwargs = {}
                if k_range is not None:
                    # The specs' index maps see the piece's K steps from its first.
                    pipeline_kwargs = dict(
                        specs=tuple(
                            dataclasses.replace(
                                spec,
                                index_map=functools.partial(_from_k_step, spec.index_map, k_begin),
                            )
                            for spec in in_specs
                        ),
                        num_steps=k_range[1] - k_begin,
                    )
                make_pipeline(step_fn, compute_context, pipeline_state_of(), **pipeline_kwargs)(
                    *parts.pipeline_refs(operand_refs, ctx),
                    allocations=pipeline_allocs,
                )

            num_items = num_row_items * num_col_items
            share = None
            if stream_k:
                share = stream_k_share(num_items, lax.axis_index("sm"), num_ctas, parts.num_k_steps)
                num_items = share.dp_items

            # Items: (visit of a real group, column item); every such visit has rows.
            @plgpu.nd_loop((num_items,), collective_axes="sm")
            def _item_loop(loop_info: plgpu.NDLoopInfo):
                (linear,) = loop_info.index
                run_item(linear, lambda: pipeline_state(loop_info))

            if share is not None:
                # The stream-K pieces, each with a pipeline of its own (no pipeline_state).
                @pl.loop(0, share.num_pieces)
                def _piece_loop(index):
                    item, k_begin, k_end = share.piece(index)
                    run_item(share.dp_items + item, k_range=(k_begin, k_end))

            # The rows past the last group: zeros, stored by the consumers alone.
            @plgpu.nd_loop((num_tail_items * num_col_items,), collective_axes="sm")
            def _tail_loop(loop_info: plgpu.NDLoopInfo):
                (linear,) = loop_info.index
                tail_visit = lax.div(linear, jnp.int32(num_col_items))
                in_range = None  # every tail visit exists without clusters along M
                if cluster_m > 1:  # a pair of tail visits; the second may be past the last
                    tail_visit = tail_visit * cluster_m + cta
                    in_range = tail_visit < num_tail_visits
                    tail_visit = jnp.minimum(tail_visit, num_tail_visits - 1)
                visit = num_group_visits + tail_visit
                col_tile = lax.rem(linear, jnp.int32(num_col_items)) * cluster_n + cta_n
                ctx = TileContext(
                    row_tile=common.row_tile_for_visit(visit_table_gmem, visit, tile_m),
                    col_tile=col_tile,
                    consumer=wg,
                )
                stores = wg < num_consumers
                if in_range is not None:
                    stores = stores & in_range

                @pl.when(stores)
                def _zero_tile():
                    shape = (
                        (part_cols, part_rows)
                        if parts.values_transposed
                        else (part_rows, part_cols)
                    )
                    zeros = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
                    with jax.named_scope(PROFILE_ZERO_TAIL):
                        store_tile(zeros, ctx)

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    cluster_args = {}
    if cluster_size > 1:
        cluster_args = dict(cluster=(cluster_size,), cluster_names=("cluster",))
    profile_args = {}
    if schedule.profile_dir:
        # Ranges per consumer trace: two per item and one per tail tile, for the most items
        # one CTA can get, with room to spare; past that the trace is cut, not corrupted.
        max_items = common.max_visits(num_rows, num_groups, tile_m, num_out_rows) * num_col_items
        # (stream_k adds at most three pieces per CTA.)
        ranges = 2 * pl.cdiv(max_items, schedule.num_sms // cluster_size) + 8 + 6 * stream_k
        profile_args = dict(
            profile_space=ranges,
            profile_dir=schedule.profile_dir,
            profile_bounds_check=True,
        )
    out_types = jax.ShapeDtypeStruct((num_out_rows if packed else num_rows, num_cols), out_dtype)
    if stream_k:  # + the partials' workspace (see body), not returned
        partials = jax.ShapeDtypeStruct(
            (num_ctas, num_consumers, part_rows, part_cols), jnp.float32
        )
        out_types = (out_types, partials)
    common.check_interpreter_threads(num_consumers + 1, interpret)
    kernel = plgpu.kernel(
        body,
        out_type=out_types,
        grid=(schedule.num_sms // cluster_size,),
        grid_names=("sm",),
        num_threads=num_consumers + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup, **profile_args
        ),
        interpret=common.interpret_params(interpret),
        kernel_name=name,
        **cluster_args,
    )
    visit_table = common.visit_table(
        group_sizes,
        num_groups,
        num_rows,
        tile_m,
        group_starts=group_starts,
        num_out_rows=num_out_rows,
    )
    extra_inputs = (group_starts,) if packed else ()
    out = kernel(visit_table, *operands)
    if stream_k:
        out = out[0]
    return varying_like(out, group_sizes, *extra_inputs, *operands)


def _from_k_step(index_map, k_begin, k_step):
    """A BlockSpec index map of the item's K step, called with a piece's K step."""
    return index_map(k_step + k_begin)


def wgmma_zeros(shape: tuple[int, int]) -> jax.Array:
    """An f32 register tile in the wgmma accumulator layout, filled with zeros."""
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def row_vector(ref) -> jax.Array:
    """Loads a (tile_m,) vector that broadcasts along the columns of a wgmma tile."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(1))


def col_vector(ref) -> jax.Array:
    """Loads a (tile_n,) vector that broadcasts along the rows of a wgmma tile."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(0))
