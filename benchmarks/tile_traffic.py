"""What a grouped-GEMM CTA tile costs in memory traffic and registers, on paper.

    python3 benchmarks/tile_traffic.py

The kernel notes compare tiles by the same few numbers (docs/kernels_grouped_matmul.md): the
bytes TMA brings from L2 into shared memory per multiply-add, the bytes the wgmmas read back
out of shared memory per multiply-add, and the f32 accumulator registers a consumer thread
holds. This computes them from a `GroupedMatmulConfig`, per K step of one CTA:

* L2 -> SMEM: the lhs tile (tile_m rows) and the rhs tile (2 * tile_n columns), tile_k deep;
  a 2-CTA cluster along N multicasts the lhs tile (each CTA pays half), along M the rhs tile.
* SMEM -> tensor core: every wgmma (m64 x n, n at most the widest wgmma the consumer count
  allows, `_MAX_WGMMA_COLS`) reads its 64 lhs rows and its n rhs columns, so a consumer whose
  part spans two m64 row blocks reads its rhs columns twice, and one split into two n128
  wgmmas reads its lhs rows twice.
* Accumulator registers: a consumer's part over its 128 threads (twice that for block FP8,
  whose main and chunk accumulators both live).

And how well a shape fills the persistent grid (`grid_fill`): the kernel runs each (row visit,
column tile) item on one of the SMs in turn, so an SM runs ceil(items / SMs) items and the
grid is busy items / (SMs x that) of the time; each visit computes a whole tile_m rows, so
groups that start inside a tile compute more rows than they hold.

A model, not a measurement: it ignores the scales' bytes and the epilogue, and says nothing
about what the H200 does with the numbers.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from benchmarks import bench_grouped_matmul
from pallas_kernels import grouped_matmul_common as common
from pallas_kernels import grouped_matmul_driver as driver
from pallas_kernels import grouped_matmul_fwd as fwd


@dataclasses.dataclass(frozen=True)
class TileTraffic:
    multiply_adds: int  # per K step of one CTA
    l2_bytes: float  # brought into shared memory by TMA, per K step of one CTA
    smem_read_bytes: int  # read by the wgmmas, per K step of one CTA
    wgmmas_per_k_slice: int  # per consumer
    accumulator_registers: int  # f32 accumulator registers a consumer thread holds

    @property
    def l2_bytes_per_kmac(self) -> float:
        return 1e3 * self.l2_bytes / self.multiply_adds

    @property
    def smem_bytes_per_kmac(self) -> float:
        return 1e3 * self.smem_read_bytes / self.multiply_adds


def tile_traffic(
    config: fwd.GroupedMatmulConfig, itemsize: int, block_fp8: bool = False
) -> TileTraffic:
    """The model of the module docstring for `config` with operands of `itemsize` bytes (2 for
    16-bit, 1 for FP8); `block_fp8`: the block-FP8 kernel's second (chunk) accumulator."""
    if itemsize not in (1, 2):
        raise ValueError(f"itemsize must be 1 (FP8) or 2 (16-bit), got {itemsize!r}")
    tile_m, cols, tile_k = config.tile_m, 2 * config.tile_n, config.tile_k
    part_rows, part_cols = config.consumer_part_shape()
    wgmma_cols = min(part_cols, fwd._MAX_WGMMA_COLS[config.num_consumers])
    wgmmas = (part_rows // 64) * (part_cols // wgmma_cols)
    lhs_bytes = tile_m * tile_k * itemsize / config.cluster_n
    rhs_bytes = cols * tile_k * itemsize / config.cluster_m
    per_wgmma = (64 + wgmma_cols) * tile_k * itemsize
    accumulators = part_rows * part_cols // 128
    return TileTraffic(
        multiply_adds=tile_m * cols * tile_k,
        l2_bytes=lhs_bytes + rhs_bytes,
        smem_read_bytes=config.num_consumers * wgmmas * per_wgmma,
        wgmmas_per_k_slice=wgmmas,
        accumulator_registers=accumulators * (2 if block_fp8 else 1),
    )


@dataclasses.dataclass(frozen=True)
class GridFill:
    items: int  # (row visit, column tile) work items of the persistent grid
    items_per_sm: int  # the most items one SM runs
    fill: float  # items / (SMs x items_per_sm): the share of the grid's time spent busy
    row_overhead: float  # rows the visits compute over the rows the groups hold
    # The same share with stream_k (the kernel's split, driver.stream_k_share): the busiest
    # SM runs its data-parallel items and its stream-K units; the partials' hand-over is
    # not counted.
    stream_k_fill: float


def grid_fill(
    config: fwd.GroupedMatmulConfig,
    group_sizes: list[int],
    num_cols: int,
    num_sms: int = 132,
    k: int = 4096,
) -> GridFill:
    """The persistent grid's fill for `group_sizes` (rows, in order), `num_cols` outputs and
    contraction size `k` (which only the stream-K split depends on)."""
    rows = sum(group_sizes)
    if rows <= 0 or num_cols <= 0:
        raise ValueError(f"need rows and columns, got group_sizes={group_sizes} and {num_cols}")
    table = common.visit_table(
        jnp.asarray(group_sizes, jnp.int32), len(group_sizes), rows, config.tile_m
    )
    visits = int(table[0, 0])
    items = visits * -(-num_cols // (2 * config.tile_n))
    per_sm = -(-items // num_sms)
    num_k_steps = -(-k // config.tile_k)
    busiest_units = 0
    for cta in range(num_sms):
        share = driver.stream_k_share(items, cta, num_sms, num_k_steps)
        units = int(share.dp_items) // num_sms * num_k_steps + int(
            share.unit_end - share.unit_begin
        )
        if int(share.dp_items) == items:  # nothing split: whole items, as without stream-K
            units = per_sm * num_k_steps
        busiest_units = max(busiest_units, units)
    return GridFill(
        items=items,
        items_per_sm=per_sm,
        fill=items / (num_sms * per_sm),
        row_overhead=visits * config.tile_m / rows,
        stream_k_fill=items * num_k_steps / (num_sms * busiest_units),
    )


# Issue 5's shapes (benchmarks/bench_grouped_matmul.py's, and the dense GEMM): (group sizes,
# output columns).
SHAPES = {
    **{name: (sizes, n) for name, (_, _, _, n, sizes) in bench_grouped_matmul.SHAPES.items()},
    "dense 8192^3": ([8192], 8192),
}
CONTRACTION = {
    **{name: k for name, (_, _, k, _, _) in bench_grouped_matmul.SHAPES.items()},
    "dense 8192^3": 8192,
}


def candidate_tiles() -> dict[str, tuple[fwd.GroupedMatmulConfig, int, bool]]:
    """The defaults and the tiles the kernel notes compare: (config, itemsize, block_fp8)."""
    replace = dataclasses.replace
    bf16, fp8 = fwd.DEFAULT_BF16_CONFIG, fwd.DEFAULT_FP8_CONFIG
    three = dict(tile_m=192, consumer_split="m", num_consumers=3)
    return {
        "bf16 default 128 x (2 x 128)": (bf16, 2, False),
        "bf16 rows split 128 x (2 x 128)": (replace(bf16, consumer_split="m"), 2, False),
        "bf16 64 x (2 x 256)": (replace(bf16, tile_m=64, tile_n=256), 2, False),
        "bf16 3 consumers 192 x (2 x 128)": (replace(bf16, **three), 2, False),
        "fp8 default 128 x (2 x 128)": (fp8, 1, False),
        "fp8 3 consumers 192 x (2 x 128)": (replace(fp8, **three), 1, False),
        "block fp8 2 consumers 64 x (2 x 128)": (fwd.TWO_CONSUMER_FP8_BLOCK_CONFIG, 1, True),
        "block fp8 default 192 x (2 x 64)": (fwd.DEFAULT_FP8_BLOCK_CONFIG, 1, True),
    }


def main() -> str:
    rows = [
        "| tile | K step | L2 -> SMEM B / kMAC | SMEM -> wgmma B / kMAC | wgmmas / consumer "
        "/ K slice | accumulator registers / thread |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, (config, itemsize, block_fp8) in candidate_tiles().items():
        t = tile_traffic(config, itemsize, block_fp8)
        rows.append(
            f"| {name} | {config.tile_k} | {t.l2_bytes_per_kmac:.1f} | "
            f"{t.smem_bytes_per_kmac:.1f} | {t.wgmmas_per_k_slice} | {t.accumulator_registers} |"
        )
    rows += [
        "",
        "| tile | shape | items | items / SM | grid fill | rows computed / held | both | "
        "grid fill with stream-K |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, (config, _, _) in candidate_tiles().items():
        for shape, (sizes, num_cols) in SHAPES.items():
            f = grid_fill(config, sizes, num_cols, k=CONTRACTION[shape])
            rows.append(
                f"| {name} | {shape} | {f.items} | {f.items_per_sm} | {f.fill:.3f} | "
                f"{f.row_overhead:.3f} | {f.fill / f.row_overhead:.3f} | "
                f"{f.stream_k_fill:.3f} |"
            )
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(main())
