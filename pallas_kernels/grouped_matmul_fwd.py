"""Grouped (MoE) forward/dgrad GEMM on Hopper: ``out[rows of g] = lhs[rows of g] @ rhs[g]ᵀ``.

Every GEMM of a linear layer is an NT GEMM in jax_qtrain (docs/design/layouts.md):
``lhs (M, K)`` rows sorted by group, ``rhs (G, N, K)``, both contiguous along the
contraction ``K``; ``group_sizes (G,) int32`` lives on the device. Rows past
``sum(group_sizes)`` come out as zeros, like ``lax.ragged_dot``.

Two entry points live here:

* :func:`grouped_matmul` — bf16/f16 operands, or FP8 (e4m3/e5m2, mixed allowed) with
  optional f32 dequantization scales applied to the f32 accumulator in the epilogue:
  lhs per-tensor ``()`` or per-row ``(M,)``; rhs per-group ``(G,)`` or per-column
  ``(G, N)``. For 16-bit operands ``rhs`` may also be given as ``(G, K, N)``
  (``rhs_layout="kn"``; 16-bit wgmma reads either major order). FP8 wgmma requires
  K-major operands, hence ``(G, N, K)`` only.
* :func:`grouped_matmul_fp8_block` — DeepSeek-V3 style block-scaled FP8: lhs 1x128
  blocks (scales ``(M, K/128)``), rhs 128x128 blocks (scales ``(G, N/128, K/128)``), or
  1x128 rhs blocks too (``rhs_block_rows=1``, scales ``(G, N, K/128)``: a wgrad's two
  token-direction copies). Each 128-wide K step runs fp8 wgmma into a fresh accumulator,
  which is then promoted into the f32 main accumulator as ``main += chunk *
  lhs_scale[row] * rhs_scale`` (the split accumulator of DeepSeek-V3 / DeepGEMM), so the
  tensor core never accumulates more than 128 products in its reduced-precision adder.

Run-time values of ``group_sizes`` cannot be checked at trace time. The kernels
clamp them: a negative size counts as 0, and once the running sum reaches ``M`` the
remaining groups are truncated (they get the rows that are left, possibly none).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import grouped_matmul_common as common
from pallas_kernels import grouped_matmul_driver as driver
from pallas_kernels import quantize_common

SMEM_BYTES = common.SMEM_BYTES
# f32 accumulator elements a consumer warpgroup may hold in registers, by consumer count
# (192 or 128 a thread); the rest is for addresses, scales and the wgmma descriptors.
_MAX_ACC_ELEMS_PER_WG = {2: 128 * 192, 3: 128 * 128}
# Columns of one wgmma's f32 accumulator, by consumer count. ptxas checks each instruction
# against the kernel's entry register budget, 65536 / threads, and not against the budget
# `setmaxnreg` raises the consumers to: with four warpgroups (three consumers) that is 128,
# and a wgmma of N f32 columns needs N / 2 + 26 (ptxas 13.0 on hand-written PTX,
# benchmarks/ptxas_wgmma_budget.py: m64n256 "Insufficient registers (128) ... try 154", the
# H200's own refusal of 64 x 256 parts in stop 43; m64n200 compiles). A wider part is issued
# as several 128-column wgmmas, which together may hold up to the raised budget (two
# m64n128 accumulators, 128 registers, compile without spills under setmaxnreg 160).
_MAX_WGMMA_COLS = {2: 256, 3: 128}


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """Tiling of the ragged-row kernels (forward / dgrad).

    tile_m: rows of the CTA tile (64, 128, 192 or 256; a multiple of 64).
    tile_n: output columns per consumer warpgroup (64, 128, 192 or 256); the CTA tile is
      tile_m x 2*tile_n.
    tile_k: K per pipeline step (block FP8 requires 128).
    max_concurrent_steps: SMEM pipeline depth.
    epi_tile_n: columns per epilogue store (divides tile_n).
    grid_minor_dim: 0 walks row tiles fastest, 1 walks column tiles fastest.
    grid_tile_width: width of the planar-snake bands.
    num_sms: persistent CTAs; None = the device's SM count.
    wgmma_in_flight: 0 waits for each K step's wgmma before the next; 1 keeps one step in
      flight (its SMEM stage is released a step later). For block FP8, 1 promotes the
      previous step's partial product while the current step's wgmma runs.
    epilogue_buffers: SMEM staging buffers per consumer for the output stores (1 or 2).
    swizzled_epilogue: stage whole row tiles in a swizzled buffer (conflict-free stores from
      the wgmma registers); False stages every tile in the plain buffer that tiles shared by
      two groups need (kept to measure the difference).
    persistent_pipeline: keep the TMA pipeline running from one output tile to the next, so
      the producer loads the next tile's first K steps during the current tile's last steps
      and epilogue. Needs the K steps to be a multiple of max_concurrent_steps and no wgmma
      kept in flight through the pipeline (wgmma_in_flight=0, except for block FP8, whose
      overlap does not delay the release of a stage).
    cluster_n: 1, or 2 for clusters of two CTAs along N that share each lhs tile (one TMA
      multicast load feeds both); the columns are padded to an even number of CTA tiles
      (an rhs copy when they are not) and num_sms must be even.
    cluster_m: 1, or 2 for clusters of two CTAs along M that share each rhs tile (one TMA
      multicast load feeds both CTAs' consecutive row tiles). One group only: the dense
      entry points (`dense_matmul`, `dense_matmul_fp8_block`); the grouped calls reject it
      for G > 1. Not with cluster_n=2; num_sms must be even.
    early_block_scales: block FP8 only: load each K step's scales (the rhs block's from
      global memory, the tile's lhs row scales from shared memory) right after its wgmma is
      issued, so their latency runs under the MMA (True, the default since stop 35), instead
      of after the wgmma has been waited for (False, stops <= 34). The same arithmetic, the
      same bits (compared on the H200 by `test_gpu_fp8_block_forward`); on the H200 in
      alternation (2026-12-02) 0.590 -> 0.553 ms for G8 balanced (M 16384, K 4096, N 4096) and
      1.167 -> 1.021 ms for the dense 8192³ GEMM (942 -> 1077 TFLOP/s). Not confirmed: stop
      36's rerun of the same alternation gave the late loads 2-4% faster (G8 0.569 -> 0.559
      ms, dense 1.094 -> 1.055), so neither order is shown better (docs/benchmarks.md).
    stagger_consumers: block FP8 with wgmma_in_flight=0 only: at each tile's first K step the
      second consumer issues its wgmma only after the first consumer's has finished. Both
      consumers otherwise start a tile together, share the tensor core, finish their K block
      together and promote it together while the tensor core idles; offset by one K block,
      each one's promotion runs under the other's MMA (an ordering change only: the same bits).
      Measured and not adopted (stop 37, H200, `grouped_ab --variants stagger`): 4% slower
      for G8 balanced and 6-7% for the dense 8192³ GEMM, in every combination tried.
    stream_lhs_scales: block FP8 only: each K step's 1x128 lhs scales of the tile's rows come
      through the TMA pipeline with its operand tiles (tile_m f32 per stage) instead of each
      consumer copying the tile's whole (K/128, rows) scale table to shared memory at tile
      start. That table grows with K (48 KB for three consumers at K = 8192) and takes the
      room of a pipeline stage; streamed, the dense 8192³ GEMM keeps four stages and may run
      the persistent pipeline. Needs wgmma_in_flight=0 (the previous step's scales leave
      with its stage).
    block_scales_before_mma: block FP8 with wgmma_in_flight=0 only: load each K step's scales
      before its wgmma is issued (waiting for the tile's prefetched lhs scale table first when
      it is not streamed), instead of right after the issue (early_block_scales=True) or after
      the wgmma has been waited for (False). The same bits. Why: on the block-FP8 wgrad
      kernel ptxas placed such loads after the wgmma instructions at one pipeline depth and
      before them at another, and the late placement ran 0.78-0.87x as fast (stop 56,
      `GroupedWgradConfig.block_scales_before_mma`). Stop 36's unsteady early_block_scales
      timings may be the same effect. One H100 call (stop 57, dense 8192³): 1127 against
      the default's 1108 TFLOP/s, within noise: off by default.
    consumer_split: "n" (default): the two consumer warpgroups share the tile's tile_m rows and
      own tile_n columns each; "m": each owns tile_m / 2 rows and all 2 * tile_n columns, so
      that its wgmma is one m64n(2 * tile_n) instruction per K slice where "n" issues two
      m64n(tile_n) ones that both read the consumer's rhs columns (a sixth less shared memory
      read per product at 128 x (2 x 128), the same accumulator registers; CUTLASS's
      "cooperative" Hopper kernels split the rows the same way). Needs tile_m a multiple of
      64 * num_consumers and 2 * tile_n <= 256; `grouped_matmul` (16-bit and FP8
      rowwise), and the block-FP8 kernels with tile_n=64 (each consumer's 128 columns one
      rhs scale block).
    num_consumers: consumer warpgroups per CTA: 2, or 3 with consumer_split="m", for a
      taller tile (each consumer 64 rows: tile_m=192, CTA tile 192 x 2 * tile_n). With three,
      a consumer issues its part as wgmmas of at most 128 columns (two per K slice for 64 x
      256 parts, tile_n=128): ptxas refuses one m64n256 in a four-warpgroup kernel
      (`_MAX_WGMMA_COLS`). Made for block FP8, whose two live 64 x 128 accumulators (main
      and chunk) leave no room for a 128-row tile with two consumers: 192 x (2 x 64) reads
      40 KB of lhs + rhs per K step for 3 M products where 64 x (2 x 128) reads 40 KB for
      2 M; its default since stop 43 (H200: dense 8192³ 947 -> 1101 TFLOP/s, G8 894 -> 1000,
      the same bits). For bf16 / FP8 rowwise, 192 x (2 x 128) tiles read 56 KB of lhs + rhs
      per 64-wide K step for 3.1 M products where the 128 x (2 x 128) default reads 48 KB for
      2.1 M (a fifth less L2 traffic per product); not yet timed on the H200.
    stream_k: split the persistent grid's last round of items, and one full round before it,
      along K so that every CTA ends together (the data-parallel + stream-K hybrid): issue
      5's G8 shape is 2048 items of 128 x 256 on 132 SMs, 15.5 rounds, so without it the last
      round leaves half the SMs idle (~3% of the kernel, `benchmarks/tile_traffic.py`). An
      item split between two CTAs costs one f32 accumulator tile written and read through L2
      and a global semaphore; the second CTA starts its accumulators from the first one's,
      so the item's K steps are summed in the same order: the unsplit kernel's bits.
      `grouped_matmul` (16-bit and FP8 rowwise) and the block-FP8 kernels; needs
      wgmma_in_flight=0 and no clusters. Part of the 16-bit default where K allows
      (`grouped_default_config`).
    profile_dir: for diagnosis only: each call writes a Mosaic GPU profiler trace (Chrome /
      Perfetto JSON, one track per consumer warpgroup) of the ranges "k_loop", "epilogue" and
      "zero_tail" into this directory; benchmarks/profile_grouped.py summarizes it. Timing
      the ranges costs a few cycles each. Ignored by the interpreter.
    The epilogue buffers' rows (epi_tile_n x output itemsize) must span a multiple of
    128 bytes: partial row tiles are stored from arbitrary rows of the buffer, and TMA
    needs 128-byte aligned shared-memory addresses.
    """

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 4
    epi_tile_n: int = 64
    grid_minor_dim: int = 0
    grid_tile_width: int = 8
    num_sms: int | None = None
    wgmma_in_flight: int = 0
    epilogue_buffers: int = 2
    swizzled_epilogue: bool = True
    persistent_pipeline: bool = False
    cluster_n: int = 1
    cluster_m: int = 1
    early_block_scales: bool = True
    stagger_consumers: bool = False
    stream_lhs_scales: bool = False
    block_scales_before_mma: bool = False
    consumer_split: str = "n"
    num_consumers: int = 2
    stream_k: bool = False
    profile_dir: str | None = None

    def __post_init__(self):
        if self.tile_m not in (64, 128, 192, 256):
            raise ValueError(f"tile_m must be 64, 128, 192 or 256, got {self.tile_m}")
        if self.tile_n not in (64, 128, 192, 256):
            # Narrower or odd widths (tile_n=88) faulted with a misaligned address on the
            # H200 (2026-11-29, cause not isolated); a 16-bit (G, K, N) rhs also needs
            # whole 64-column swizzle atoms per consumer.
            raise ValueError(f"tile_n must be 64, 128, 192 or 256, got {self.tile_n}")
        if self.tile_k not in (32, 64, 128, 256):
            raise ValueError(f"tile_k must be 32, 64, 128 or 256, got {self.tile_k}")
        if not 1 <= self.max_concurrent_steps <= 8:
            raise ValueError(
                f"max_concurrent_steps must be in [1, 8], got {self.max_concurrent_steps}"
            )
        if self.epi_tile_n < 8 or self.tile_n % self.epi_tile_n:
            raise ValueError(
                f"epi_tile_n must be >= 8 and divide tile_n={self.tile_n}, got {self.epi_tile_n}"
            )
        if self.grid_minor_dim not in (0, 1):
            raise ValueError(f"grid_minor_dim must be 0 or 1, got {self.grid_minor_dim}")
        if self.grid_tile_width < 1:
            raise ValueError(f"grid_tile_width must be >= 1, got {self.grid_tile_width}")
        if self.num_sms is not None and self.num_sms < 1:
            raise ValueError(f"num_sms must be >= 1 or None, got {self.num_sms}")
        if self.wgmma_in_flight not in (0, 1):
            raise ValueError(f"wgmma_in_flight must be 0 or 1, got {self.wgmma_in_flight}")
        if self.wgmma_in_flight >= self.max_concurrent_steps:
            raise ValueError("wgmma_in_flight=1 needs max_concurrent_steps >= 2")
        if self.epilogue_buffers not in (1, 2):
            raise ValueError(f"epilogue_buffers must be 1 or 2, got {self.epilogue_buffers}")
        if not isinstance(self.swizzled_epilogue, bool):
            raise TypeError(f"swizzled_epilogue must be a bool, got {self.swizzled_epilogue!r}")
        if not isinstance(self.persistent_pipeline, bool):
            raise TypeError(f"persistent_pipeline must be a bool, got {self.persistent_pipeline!r}")
        if not isinstance(self.early_block_scales, bool):
            raise TypeError(f"early_block_scales must be a bool, got {self.early_block_scales!r}")
        if not isinstance(self.stagger_consumers, bool):
            raise TypeError(f"stagger_consumers must be a bool, got {self.stagger_consumers!r}")
        if not isinstance(self.stream_lhs_scales, bool):
            raise TypeError(f"stream_lhs_scales must be a bool, got {self.stream_lhs_scales!r}")
        if self.stream_lhs_scales and self.wgmma_in_flight:
            raise ValueError(
                "stream_lhs_scales needs wgmma_in_flight=0 (the promotion of the previous K "
                "block would read scales whose stage is released)"
            )
        if not isinstance(self.block_scales_before_mma, bool):
            raise TypeError(
                f"block_scales_before_mma must be a bool, got {self.block_scales_before_mma!r}"
            )
        if self.block_scales_before_mma and self.wgmma_in_flight:
            raise ValueError(
                "block_scales_before_mma needs wgmma_in_flight=0 (with a wgmma in flight the "
                "previous K block is promoted under the MMA instead)"
            )
        if self.stagger_consumers and self.wgmma_in_flight:
            raise ValueError(
                "stagger_consumers needs wgmma_in_flight=0 (with a wgmma in flight the "
                "promotion already runs under the next MMA)"
            )
        if self.profile_dir is not None and (
            not isinstance(self.profile_dir, str) or not self.profile_dir
        ):
            raise ValueError(
                f"profile_dir must be None or a directory path, got {self.profile_dir!r}"
            )
        if self.consumer_split not in ("n", "m"):
            raise ValueError(f"consumer_split must be 'n' or 'm', got {self.consumer_split!r}")
        if self.num_consumers not in (2, 3):
            raise ValueError(f"num_consumers must be 2 or 3, got {self.num_consumers!r}")
        if self.num_consumers == 3 and self.consumer_split != "m":
            raise ValueError(
                "num_consumers=3 needs consumer_split='m' (the CTA tile is tile_m x 2 * tile_n; "
                "three consumers split its rows)"
            )
        if self.num_consumers == 3 and self.stagger_consumers:
            raise ValueError("stagger_consumers needs num_consumers=2 (it orders a pair)")
        if self.consumer_split == "m":
            if self.tile_m % (64 * self.num_consumers):
                raise ValueError(
                    f"consumer_split='m' needs tile_m to be a multiple of "
                    f"{64 * self.num_consumers} (at least 64 rows per consumer, "
                    f"num_consumers={self.num_consumers}), got tile_m={self.tile_m}"
                )
            if 2 * self.tile_n > 256:
                raise ValueError(
                    f"consumer_split='m' gives each consumer 2 * tile_n columns, at most 256 "
                    f"(one wgmma), got tile_n={self.tile_n}"
                )
        part_rows, part_cols = self.consumer_part_shape()
        max_acc = _MAX_ACC_ELEMS_PER_WG[self.num_consumers]
        if part_rows * part_cols > max_acc:
            raise ValueError(
                f"a consumer's {part_rows} x {part_cols} part of the tile exceeds the register "
                f"budget of one of {self.num_consumers} consumer warpgroups ({max_acc} f32 "
                "accumulators)"
            )
        if self.cluster_n not in (1, 2):
            raise ValueError(f"cluster_n must be 1 or 2, got {self.cluster_n!r}")
        if self.cluster_m not in (1, 2):
            raise ValueError(f"cluster_m must be 1 or 2, got {self.cluster_m!r}")
        if self.cluster_m > 1 and self.cluster_n > 1:
            raise ValueError("cluster_m=2 and cluster_n=2 cannot be combined (clusters of 2 CTAs)")
        if not isinstance(self.stream_k, bool):
            raise TypeError(f"stream_k must be a bool, got {self.stream_k!r}")
        if self.stream_k and self.cluster_size > 1:
            raise ValueError("stream_k needs cluster_n=1 and cluster_m=1")
        if self.stream_k and self.wgmma_in_flight:
            raise ValueError(
                "stream_k needs wgmma_in_flight=0 (each split item's K range runs a pipeline "
                "of its own)"
            )
        if self.num_sms is not None and self.num_sms % self.cluster_size:
            raise ValueError(
                f"num_sms={self.num_sms} must be a multiple of the cluster size "
                f"(cluster_n={self.cluster_n}, cluster_m={self.cluster_m})"
            )

    @property
    def cluster_size(self) -> int:
        """CTAs per cluster."""
        return self.cluster_n * self.cluster_m

    def check_out_dtype(self, out_dtype: jnp.dtype) -> None:
        row_bytes = self.epi_tile_n * jnp.dtype(out_dtype).itemsize
        if row_bytes % 128:
            raise ValueError(
                f"config: epi_tile_n={self.epi_tile_n} {jnp.dtype(out_dtype).name} outputs give "
                f"{row_bytes}-byte epilogue rows; they must span a multiple of 128 bytes"
            )

    def check_not_block_fp8_only(self) -> None:
        """For the kernels without block scales: options only block FP8 has must be off."""
        if self.stagger_consumers:
            raise ValueError("config: stagger_consumers applies to the block-FP8 kernel only")
        if self.stream_lhs_scales:
            raise ValueError("config: stream_lhs_scales applies to the block-FP8 kernel only")
        if self.block_scales_before_mma:
            raise ValueError("config: block_scales_before_mma applies to the block-FP8 kernel only")

    def check_consumers_split_columns(self, kernel: str) -> None:
        """For the kernels whose K steps are written for consumers that own columns."""
        if self.consumer_split != "n":
            raise ValueError(
                f"config: {kernel} needs consumer_split='n' (consumer_split='m' is implemented "
                "by grouped_matmul, 16-bit and FP8 rowwise, only)"
            )

    def padded_cols(self, num_cols: int, out_dtype: jnp.dtype, multiple: int = 8) -> int:
        """Output columns the kernel computes: at least one CTA tile, a multiple of
        ``multiple`` (TMA) and of the epilogue's swizzle atom (its TMA stores go through the
        output's tiled view: 64 bf16 or 32 f32 columns), and whole clusters of CTA tiles."""
        cta_cols = 2 * self.tile_n
        multiple = max(multiple, common.swizzle_elems(self.epi_tile_n, out_dtype))
        cols = common.round_up(max(num_cols, cta_cols), multiple)
        if pl.cdiv(cols, cta_cols) % self.cluster_n:
            cols = common.round_up(cols, cta_cols * self.cluster_n)
        return cols

    def consumer_part_shape(self) -> tuple[int, int]:
        """(rows, columns) of one consumer warpgroup's part of the CTA tile."""
        return driver.consumer_part_shape(
            self.tile_m, self.tile_n, self.consumer_split, self.num_consumers
        )

    def schedule(self) -> driver.TileSchedule:
        num_sms = self.num_sms or common.num_sms_default()
        return driver.TileSchedule(
            tile_m=self.tile_m,
            tile_n=self.tile_n,
            max_concurrent_steps=self.max_concurrent_steps,
            epi_tile_n=self.epi_tile_n,
            epilogue_buffers=self.epilogue_buffers,
            swizzled_epilogue=self.swizzled_epilogue,
            grid_minor_dim=self.grid_minor_dim,
            grid_tile_width=self.grid_tile_width,
            # Whole clusters: an odd SM count leaves one SM idle.
            num_sms=num_sms - num_sms % self.cluster_size,
            persistent_pipeline=self.persistent_pipeline,
            cluster_n=self.cluster_n,
            cluster_m=self.cluster_m,
            profile_dir=self.profile_dir,
            consumer_split=self.consumer_split,
            num_consumers=self.num_consumers,
            stream_k=self.stream_k,
        )


# Defaults: the fastest configs of the H200 sweep (benchmarks/bench_grouped_matmul.py,
# 2026-11-29, G=8, M=16384, K=N=4096): bf16 696 TFLOP/s, FP8 rowwise 1211, FP8 block 891.
DEFAULT_BF16_CONFIG = GroupedMatmulConfig(
    tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=3, epi_tile_n=64
)
DEFAULT_FP8_CONFIG = GroupedMatmulConfig(
    tile_m=128,
    tile_n=128,
    tile_k=128,
    max_concurrent_steps=4,
    epi_tile_n=64,
    wgmma_in_flight=1,
    epilogue_buffers=1,
)
# Stream-K over the persistent pipeline (stop 45): the same tiles, the partial last round
# split along K, the pipeline kept running across items; the DEFAULT_*_CONFIG bits. On the
# H200 (G8, M 16384, K = N = 4096; docs/benchmarks.md, stop 45) bf16 +1.7% balanced / +4.2%
# skewed in alternation, +1.9% / +7.4% in bench_grouped_matmul: the 16-bit default where the
# K steps are whole rounds of four stages (`grouped_default_config`). FP8 rowwise +0.0% /
# +2.1% in alternation but -4.5% / -2.7% in bench_grouped_matmul's sequential timing against
# the default's wgmma in flight: opt-in (STREAM_K_FP8_CONFIG).
STREAM_K_BF16_CONFIG = dataclasses.replace(
    DEFAULT_BF16_CONFIG,
    max_concurrent_steps=4,
    epilogue_buffers=1,
    persistent_pipeline=True,
    stream_k=True,
)
STREAM_K_FP8_CONFIG = dataclasses.replace(
    DEFAULT_FP8_CONFIG, wgmma_in_flight=0, persistent_pipeline=True, stream_k=True
)
# Block FP8: three consumers of 64 x 128 in 192 x (2 x 64) CTA tiles (stop 43: on the H200
# in alternation, dense 8192³ 947 -> 1101 TFLOP/s and G8 balanced 894 -> 1000, the same
# bits); the stop-42 default of two consumers in 64 x (2 x 128) tiles where the three's
# per-consumer lhs scales do not fit in shared memory (K past ~20 K).
DEFAULT_FP8_BLOCK_CONFIG = GroupedMatmulConfig(
    tile_m=192,
    tile_n=64,
    tile_k=128,
    max_concurrent_steps=4,
    epi_tile_n=64,
    consumer_split="m",
    num_consumers=3,
)
TWO_CONSUMER_FP8_BLOCK_CONFIG = GroupedMatmulConfig(
    tile_m=64, tile_n=128, tile_k=128, max_concurrent_steps=4, epi_tile_n=64
)
# Grouped calls with fewer lhs rows than this per group on average keep the two-consumer
# tile. A group whose rows start anywhere computes about one extra row tile of rows (192
# instead of 64; with the FP8-block recipe's 128-token alignment ~128 more), and three
# consumers were ~1.17x faster per computed row (dense 8192³, stop 43), so they pay off from
# ~700-800 rows a group: measured at 2048 (G8 balanced, +12%), not below (G64's 512 pending).
MIN_ROWS_PER_GROUP_THREE_CONSUMERS = 1024


def _smem_bytes(
    config: GroupedMatmulConfig, stage_bytes: int, out_dtype: jnp.dtype, prefetch_bytes: int = 0
) -> int:
    # Each consumer's staging buffers hold epi_tile_n columns of its rows.
    epilogue = (
        config.num_consumers
        * config.epilogue_buffers
        * config.consumer_part_shape()[0]
        * config.epi_tile_n
        * jnp.dtype(out_dtype).itemsize
    )
    return config.max_concurrent_steps * stage_bytes + epilogue + prefetch_bytes


def fit_default_config(
    config: GroupedMatmulConfig, stage_bytes: int, out_dtype: jnp.dtype, prefetch_bytes: int = 0
) -> GroupedMatmulConfig:
    """Shrinks a *default* config until it fits in SMEM.

    The epilogue width goes down to 128-byte rows first, then to one staging buffer,
    then the pipeline gets shallower.
    """
    min_epi = 128 // jnp.dtype(out_dtype).itemsize
    while _smem_bytes(config, stage_bytes, out_dtype, prefetch_bytes) > SMEM_BYTES:
        if config.epi_tile_n > min_epi:
            config = dataclasses.replace(config, epi_tile_n=config.epi_tile_n // 2)
        elif config.epilogue_buffers > 1:
            config = dataclasses.replace(config, epilogue_buffers=1)
        elif config.max_concurrent_steps > 2:
            config = dataclasses.replace(
                config, max_concurrent_steps=config.max_concurrent_steps - 1
            )
        else:
            break
    return config


def grouped_default_config(
    fp8: bool, k: int, out_dtype: jnp.dtype, *, vector_bytes: int = 0
) -> GroupedMatmulConfig:
    """`grouped_matmul`'s default for 16-bit (``fp8=False``) or FP8 rowwise operands with
    contraction size ``k``, fitted to shared memory: for 16-bit operands STREAM_K_BF16_CONFIG
    where ``k``'s K steps are whole rounds of its stages (the persistent pipeline needs
    that), else DEFAULT_BF16_CONFIG; for FP8 DEFAULT_FP8_CONFIG (see STREAM_K_FP8_CONFIG).
    ``vector_bytes``: the row / column scale vectors the kernel prefetches per tile."""
    if not isinstance(fp8, bool):
        raise TypeError(f"fp8 must be a bool, got {fp8!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if jnp.dtype(out_dtype) not in common.OUT_DTYPES:
        raise ValueError(f"out_dtype must be bfloat16 or float32, got {jnp.dtype(out_dtype)}")
    if isinstance(vector_bytes, bool) or not isinstance(vector_bytes, int) or vector_bytes < 0:
        raise ValueError(f"vector_bytes must be an int >= 0, got {vector_bytes!r}")
    itemsize = 1 if fp8 else 2

    def fitted(config: GroupedMatmulConfig) -> GroupedMatmulConfig:
        stage = config.tile_k * (config.tile_m + 2 * config.tile_n) * itemsize
        return fit_default_config(config, stage, out_dtype, vector_bytes)

    if fp8:
        return fitted(DEFAULT_FP8_CONFIG)
    base = DEFAULT_BF16_CONFIG
    streamed = fitted(STREAM_K_BF16_CONFIG)
    # K steps as the wrapper pads K (to whole swizzle atoms: tile_k elements here).
    num_k_steps = pl.cdiv(k, streamed.tile_k)
    if num_k_steps % min(streamed.max_concurrent_steps, num_k_steps) == 0:
        return streamed
    return fitted(base)


def _check_smem(
    config: GroupedMatmulConfig, stage_bytes: int, out_dtype: jnp.dtype, prefetch_bytes: int = 0
) -> None:
    total = _smem_bytes(config, stage_bytes, out_dtype, prefetch_bytes)
    if total > SMEM_BYTES:
        raise ValueError(
            f"config needs {total} bytes of shared memory ({config.max_concurrent_steps} "
            f"stages x {stage_bytes}, epilogue and {prefetch_bytes} of prefetched scales), "
            f"more than {SMEM_BYTES}; lower max_concurrent_steps, tile sizes or epi_tile_n"
        )


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    lhs_scale: jax.Array | None = None,
    rhs_scale: jax.Array | None = None,
    out_dtype: jnp.dtype = jnp.bfloat16,
    rhs_layout: Literal["nk", "kn"] = "nk",
    group_starts: jax.Array | None = None,
    out_rows: int | None = None,
    config: GroupedMatmulConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Ragged-row grouped GEMM ``out[rows of g] = (lhs[rows of g] @ rhs[g]ᵀ) * scales``.

    Args:
      lhs: (M, K) bf16/f16 or float8_e4m3fn/float8_e5m2, rows sorted by group.
      rhs: (G, N, K) (``rhs_layout="nk"``), or (G, K, N) for 16-bit operands
        (``rhs_layout="kn"``). Same dtype as lhs, except that two FP8 dtypes may mix.
      group_sizes: (G,) int32 rows per group (device values; see module docstring).
      lhs_scale: optional f32 dequantization scale of lhs: () per-tensor or (M,) per-row.
      rhs_scale: optional f32 scale of rhs: (G,) per group or (G, N) per output column.
      out_dtype: bfloat16 or float32 (the accumulator is always f32).
      rhs_layout: "nk" (K-major, any dtype) or "kn" (16-bit dtypes only).
      group_starts, out_rows: a packed output from groups with gaps between them (e.g. each
        padded to a block multiple, as the quantized activations' aligned layout stores
        them): group g's rows are lhs rows ``[group_starts[g], group_starts[g] + size_g)``
        ((G,) int32, device values) and its output rows follow the previous groups' in an
        (out_rows, N) output, rows past the groups zero (sizes clamped against out_rows).
        Group g must end before group g + 1 starts; lhs rows past M read as zeros.
      config: tiling; None: `grouped_default_config` for the dtype and K (for 16-bit
        operands stream-K over the persistent pipeline where K's steps are whole rounds of
        its stages).
      interpret: run the Pallas interpreter (CPU) instead of compiling for the GPU.

    Returns:
      (M, N) array of out_dtype ((out_rows, N) for a packed output); rows past
      sum(group_sizes) are zero.
    """
    common.check_rank("lhs", lhs, 2)
    common.check_rank("rhs", rhs, 3)
    common.check_dtype("lhs", lhs, common.HALF_DTYPES + common.FP8_DTYPES)
    common.check_dtype("rhs", rhs, common.HALF_DTYPES + common.FP8_DTYPES)
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in common.OUT_DTYPES:
        raise TypeError(f"out_dtype must be bfloat16 or float32, got {out_dtype.name}")
    is_fp8 = jnp.dtype(lhs.dtype) in common.FP8_DTYPES
    if is_fp8 != (jnp.dtype(rhs.dtype) in common.FP8_DTYPES) or (
        not is_fp8 and lhs.dtype != rhs.dtype
    ):
        raise TypeError(
            f"lhs and rhs dtypes must match (two FP8 dtypes may mix), got "
            f"{jnp.dtype(lhs.dtype).name} and {jnp.dtype(rhs.dtype).name}"
        )
    if rhs_layout not in ("nk", "kn"):
        raise ValueError(f"rhs_layout must be 'nk' or 'kn', got {rhs_layout!r}")
    if rhs_layout == "kn" and is_fp8:
        raise ValueError("rhs_layout='kn' needs 16-bit operands: FP8 wgmma reads K-major rhs only")
    num_rows, k = lhs.shape
    if rhs_layout == "nk":
        num_groups, num_cols, k_rhs = rhs.shape
    else:
        num_groups, k_rhs, num_cols = rhs.shape
    if k_rhs != k:
        raise ValueError(f"rhs contraction size {k_rhs} does not match lhs K={k}")
    if k == 0:
        raise ValueError("lhs and rhs must have a contraction size K >= 1, got K=0")
    common.check_group_sizes(group_sizes, num_groups)
    check_packed_output(group_starts, out_rows, num_groups)
    if lhs_scale is not None:
        common.check_dtype("lhs_scale", lhs_scale, (jnp.float32,))
        if lhs_scale.shape not in ((), (num_rows,)):
            raise ValueError(
                f"lhs_scale must have shape () or ({num_rows},), got {tuple(lhs_scale.shape)}"
            )
    if rhs_scale is not None:
        common.check_dtype("rhs_scale", rhs_scale, (jnp.float32,))
        if rhs_scale.shape not in ((num_groups,), (num_groups, num_cols)):
            raise ValueError(
                f"rhs_scale must have shape ({num_groups},) or ({num_groups}, {num_cols}), "
                f"got {tuple(rhs_scale.shape)}"
            )
    if config is None:
        vector_bytes = _vector_bytes(DEFAULT_FP8_CONFIG if is_fp8 else DEFAULT_BF16_CONFIG)
        config = grouped_default_config(is_fp8, k, out_dtype, vector_bytes=vector_bytes)
    if not isinstance(config, GroupedMatmulConfig):
        raise TypeError(f"config must be a GroupedMatmulConfig, got {type(config).__name__}")

    config.check_out_dtype(out_dtype)
    config.check_not_block_fp8_only()
    tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
    _check_smem(config, _stage_bytes(config, lhs, rhs), out_dtype, _vector_bytes(config))

    # Zero padding (a copy, only for shapes that need it) to whole TMA tiles: rows and
    # columns to multiples of 8 and at least one tile, K to whole swizzle atoms (zeros
    # add nothing to the sums). Padded rows belong to no group and are sliced off.
    rows_p = common.round_up(max(num_rows, tile_m), 8)
    k_p = common.round_up(k, common.swizzle_elems(tile_k, lhs.dtype))
    if rhs_layout == "nk":
        cols_p = config.padded_cols(num_cols, out_dtype)
        rhs_p = common.pad_axis(common.pad_axis(rhs, 1, cols_p), 2, k_p)
    else:
        cols_p = config.padded_cols(
            num_cols, out_dtype, common.swizzle_elems(2 * tile_n, rhs.dtype)
        )
        rhs_p = common.pad_axis(common.pad_axis(rhs, 2, cols_p), 1, k_p)
    lhs_p = common.pad_axis(common.pad_axis(lhs, 0, rows_p), 1, k_p)
    operands = [lhs_p, rhs_p]
    lhs_scale_kind = rhs_scale_kind = lhs_scale_index = rhs_scale_index = None
    if lhs_scale is not None:
        lhs_scale_index = len(operands)
        if lhs_scale.ndim == 0:
            lhs_scale_kind = "tensor"
            operands.append(lhs_scale.reshape(1))
        else:
            lhs_scale_kind = "row"
            operands.append(common.pad_axis(lhs_scale, 0, common.round_up(rows_p, tile_m)))
    if rhs_scale is not None:
        rhs_scale_index = len(operands)
        if rhs_scale.ndim == 1:
            rhs_scale_kind = "group"
            operands.append(rhs_scale)
        else:
            rhs_scale_kind = "col"
            operands.append(common.pad_axis(rhs_scale, 1, common.round_up(cols_p, 2 * tile_n)))

    lhs_transforms = common.smem_transforms(tile_k, lhs.dtype)
    in_flight = config.wgmma_in_flight
    if rhs_layout == "nk":
        rhs_spec = plgpu.BlockSpec(
            (2 * tile_n, tile_k),
            lambda kk: (0, kk),
            transforms=common.smem_transforms(tile_k, rhs.dtype),
            delay_release=in_flight,
        )
    else:
        rhs_spec = plgpu.BlockSpec(
            (tile_k, 2 * tile_n),
            lambda kk: (kk, 0),
            transforms=common.smem_transforms(2 * tile_n, rhs.dtype),
            delay_release=in_flight,
        )
    in_specs = (
        plgpu.BlockSpec(
            (tile_m, tile_k),
            lambda kk: (0, kk),
            transforms=lhs_transforms,
            delay_release=in_flight,
        ),
        rhs_spec,
    )

    def pipeline_refs(refs, ctx: driver.TileContext):
        lhs_ref, rhs_ref = refs[0], refs[1]
        rows = pl.ds(ctx.row_tile.block_start, tile_m)
        cols = pl.ds(ctx.col_tile * (2 * tile_n), 2 * tile_n)
        group_rhs = rhs_ref.at[ctx.row_tile.group]
        rhs_window = group_rhs.at[cols] if rhs_layout == "nk" else group_rhs.at[:, cols]
        return (lhs_ref.at[rows], rhs_window)

    def allocation_refs(refs):
        return (refs[0], refs[1].at[0])

    # A consumer's part as one wgmma, or as several of _MAX_WGMMA_COLS columns (three
    # consumers with 64 x 256 parts).
    part_rows, part_cols = config.consumer_part_shape()
    wgmma_cols = min(part_cols, _MAX_WGMMA_COLS[config.num_consumers])
    num_wgmmas = part_cols // wgmma_cols

    def rhs_operand(rhs_smem, cols):
        if rhs_layout == "nk":
            return rhs_smem.at[cols].transpose((1, 0))
        return rhs_smem.at[:, cols]

    def step(refs, ctx, smem_refs, accs):
        lhs_smem, rhs_smem = smem_refs
        # This consumer's lhs rows (all of them unless consumer_split="m") and rhs columns.
        lhs_operand = lhs_smem.at[ctx.row_slice] if config.consumer_split == "m" else lhs_smem

        def issue(acc_refs):
            if num_wgmmas == 1:
                plgpu.wgmma(acc_refs[0], lhs_operand, rhs_operand(rhs_smem, ctx.col_slice))
            else:
                for i, acc_ref in enumerate(acc_refs):
                    cols = pl.ds(ctx.col_slice.start + i * wgmma_cols, wgmma_cols)
                    plgpu.wgmma(acc_ref, lhs_operand, rhs_operand(rhs_smem, cols))

        if ctx.values_carried:
            # A stream-K piece carries its accumulators as values (they may start from an
            # item's earlier K steps); reading them back waits for the wgmmas.
            if quantize_common.interpreting(interpret):
                # The interpreter has no preinitialized accumulators: each step's products
                # are added to the carried values (exact on the tests' exact sums; the GPU's
                # bits are the `gpu` tests' business).
                def products(*acc_refs):
                    issue(acc_refs)
                    return tuple(acc_ref[...] for acc_ref in acc_refs)

                acc_types = [plgpu.ACC((part_rows, wgmma_cols), jnp.float32)] * num_wgmmas
                step_products = pl.run_scoped(products, *acc_types)
                return tuple(acc + p for acc, p in zip(accs, step_products, strict=True))
            return pl.run_state(issue)(tuple(plgpu.ACC.init(acc) for acc in accs))
        issue(accs)
        # The stage read by the wgmmas still in flight is released one step later (each
        # wgmma call is one commit group).
        plgpu.wgmma_wait(in_flight * num_wgmmas)
        return accs

    prefetches = []
    if lhs_scale_kind == "row":
        prefetches.append(driver.TilePrefetch(lhs_scale_index, "rows"))
    if rhs_scale_kind == "col":
        prefetches.append(driver.TilePrefetch(rhs_scale_index, "group_cols"))

    def joined(parts):
        return parts[0] if num_wgmmas == 1 else jnp.concatenate(parts, axis=1)

    def accumulate(refs, ctx, run_pipeline, start):
        """The K loop from the f32 part `start` (stream-K: zeros, or an item's earlier K
        steps): the accumulators start from it instead of zeros."""
        del refs, ctx
        starts = [start[:, i * wgmma_cols : (i + 1) * wgmma_cols] for i in range(num_wgmmas)]
        return joined(list(run_pipeline(tuple(starts))))

    def run_tile(refs, ctx, run_pipeline):
        def with_accs(*acc_refs):
            run_pipeline(acc_refs)
            return joined([acc_ref[...] for acc_ref in acc_refs])

        acc_types = [plgpu.ACC((part_rows, wgmma_cols), jnp.float32)] * num_wgmmas
        return finish(refs, ctx, pl.run_scoped(with_accs, *acc_types))

    def finish(refs, ctx, values):
        """The accumulated part times the scales."""
        next_prefetch = 0
        if lhs_scale_kind == "tensor":
            values = values * refs[lhs_scale_index][0]
        elif lhs_scale_kind == "row":
            row_scale = driver.row_vector(ctx.wait_prefetched(next_prefetch))
            next_prefetch += 1
            values = values * lax.broadcast_in_dim(row_scale, values.shape, [0])
        if rhs_scale_kind == "group":
            values = values * refs[rhs_scale_index][ctx.row_tile.group]
        elif rhs_scale_kind == "col":
            col_scale = driver.col_vector(ctx.wait_prefetched(next_prefetch))
            values = values * lax.broadcast_in_dim(col_scale, values.shape, [1])
        return values

    parts = driver.RowKernelParts(
        in_specs=in_specs,
        pipeline_refs=pipeline_refs,
        allocation_refs=allocation_refs,
        run_tile=run_tile,
        step=step,
        num_k_steps=pl.cdiv(k_p, tile_k),
        prefetches=tuple(prefetches),
        column_specs=(1,),
        accumulate=accumulate,
        finish=finish,
    )
    return run_row_kernel(
        parts,
        group_sizes,
        operands,
        config=config,
        name="grouped_matmul_fp8" if is_fp8 else "grouped_matmul_bf16",
        num_groups=num_groups,
        num_rows=num_rows,
        num_cols=num_cols,
        padded_rows=rows_p,
        padded_cols=cols_p,
        out_dtype=out_dtype,
        interpret=interpret,
        group_starts=group_starts,
        out_rows=out_rows,
    )


def run_row_kernel(
    parts: driver.RowKernelParts,
    group_sizes: jax.Array,
    operands: list[jax.Array],
    *,
    config: GroupedMatmulConfig,
    name: str,
    num_groups: int,
    num_rows: int,
    num_cols: int,
    padded_rows: int,
    padded_cols: int,
    out_dtype: jnp.dtype,
    interpret: bool,
    group_starts: jax.Array | None = None,
    out_rows: int | None = None,
) -> jax.Array:
    """A ragged-row wrapper's last step: `parts` on the padded operands through the driver,
    and the (num_rows, num_cols) result (or a packed (out_rows, num_cols) one, with
    `group_starts`) cut out of the padded output."""
    packed = group_starts is not None
    out = driver.ragged_rows_call(
        group_sizes,
        operands,
        num_rows=padded_rows,
        num_cols=padded_cols,
        num_groups=num_groups,
        out_dtype=out_dtype,
        schedule=config.schedule(),
        parts=parts,
        interpret=interpret,
        name=name,
        group_starts=group_starts,
        num_out_rows=common.round_up(max(out_rows, config.tile_m), 8) if packed else None,
    )
    result_rows = out_rows if packed else num_rows
    if out.shape != (result_rows, num_cols):
        out = out[:result_rows, :num_cols]
    return out


def check_packed_output(group_starts, out_rows, num_groups: int) -> bool:
    """Whether `grouped_matmul` writes a packed output; its arguments checked."""
    if (group_starts is None) != (out_rows is None):
        raise ValueError(
            "group_starts and out_rows go together (a packed output): got "
            f"group_starts={'None' if group_starts is None else 'an array'}, out_rows={out_rows!r}"
        )
    if group_starts is None:
        return False
    common.check_group_sizes(group_starts, num_groups, name="group_starts")
    if not isinstance(out_rows, int) or isinstance(out_rows, bool) or out_rows < 1:
        raise ValueError(f"out_rows must be a positive int, got {out_rows!r}")
    return True


def _stage_bytes(config: GroupedMatmulConfig, lhs: jax.Array, rhs: jax.Array) -> int:
    return config.tile_k * (
        config.tile_m * lhs.dtype.itemsize + 2 * config.tile_n * rhs.dtype.itemsize
    )


def _block_scale_bytes(config: GroupedMatmulConfig, k: int) -> int:
    # Per-consumer SMEM copy of the (K/128, rows of its part) f32 lhs block scales (none when
    # they are streamed with the K steps: then they are part of each stage).
    if config.stream_lhs_scales:
        return 0
    return config.num_consumers * 4 * (k // 128) * config.consumer_part_shape()[0]


def _vector_bytes(config: GroupedMatmulConfig) -> int:
    # Per-consumer SMEM copies of a row-scale and a column-scale vector (f32) of its part.
    return config.num_consumers * 4 * sum(config.consumer_part_shape())


def _block_stage_bytes(config: GroupedMatmulConfig, rhs_block_rows: int = 128) -> int:
    # fp8 lhs and rhs tiles, the K block's f32 lhs scales of the tile's rows if streamed
    # (else they are prefetched per tile, `_block_scale_bytes`), and with 1x128 rhs blocks
    # the K block's f32 scales of the tile's rhs rows (always streamed).
    scales = 4 * config.tile_m if config.stream_lhs_scales else 0
    if rhs_block_rows == 1:
        scales += 4 * 2 * config.tile_n
    return config.tile_k * (config.tile_m + 2 * config.tile_n) + scales


def _check_rhs_block_rows(rhs_block_rows) -> None:
    if rhs_block_rows not in (1, 128) or isinstance(rhs_block_rows, bool):
        raise ValueError(
            f"rhs_block_rows must be 128 (128x128 weight blocks) or 1 (1x128 blocks), "
            f"got {rhs_block_rows!r}"
        )


def fit_fp8_block_config(
    config: GroupedMatmulConfig, k: int, out_dtype: jnp.dtype, rhs_block_rows: int = 128
) -> GroupedMatmulConfig:
    """``config`` shrunk as `fit_default_config` does until the block-FP8 kernel's stages,
    epilogue and prefetched lhs scales for contraction size ``k`` fit in shared memory
    (``rhs_block_rows``: 128 or 1, the rhs scale blocks, as `grouped_matmul_fp8_block`)."""
    if not isinstance(config, GroupedMatmulConfig):
        raise TypeError(f"config must be a GroupedMatmulConfig, got {type(config).__name__}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 128 or k % 128:
        raise ValueError(f"k must be a positive multiple of 128 (1x128 blocks), got {k!r}")
    if jnp.dtype(out_dtype) not in common.OUT_DTYPES:
        raise ValueError(f"out_dtype must be bfloat16 or float32, got {jnp.dtype(out_dtype)}")
    _check_rhs_block_rows(rhs_block_rows)
    return fit_default_config(
        config,
        _block_stage_bytes(config, rhs_block_rows),
        out_dtype,
        _block_scale_bytes(config, k),
    )


def fp8_block_default_config(
    k: int,
    out_dtype: jnp.dtype,
    *,
    persistent_pipeline: bool = False,
    num_consumers: int = 3,
    stream_lhs_scales: bool = False,
    rows_per_group: float | None = None,
    rhs_block_rows: int = 128,
) -> GroupedMatmulConfig:
    """The block-FP8 kernel's default config for contraction size ``k``, fitted to SMEM.

    ``persistent_pipeline=True`` keeps the pipeline running across tiles where the K steps
    allow it (a whole number of rounds of stages); the dense entry point asks for it: on the
    H200 it made the two-consumer 8192³ GEMM 3–4% faster in two runs (2026-11-30, interleaved
    and sequential), while the grouped 8-expert GEMM was 1–2% slower with it.
    ``num_consumers=2`` gives the stop-42 default (64 x (2 x 128) tiles), which is also what
    three consumers fall back to where fewer than three stages fit beside their lhs scales
    (K past 12 K: with two stages the three-consumer dense 8192³ GEMM ran at 878 TFLOP/s,
    below the two consumers' 947, stop 43). ``stream_lhs_scales=True`` moves those scales
    into the pipeline's stages (see GroupedMatmulConfig), so three consumers keep four stages
    at any K. ``rows_per_group``: a grouped call's lhs rows over its groups; below
    `MIN_ROWS_PER_GROUP_THREE_CONSUMERS` three consumers' taller tiles waste more rows at the
    group boundaries than they gain, so two are used (None: one group, as the dense GEMM).
    ``rhs_block_rows``: 128 or 1, the rhs scale blocks (1: each stage also carries the K
    block's rhs scales, `grouped_matmul_fp8_block`).
    """
    _check_rhs_block_rows(rhs_block_rows)
    if num_consumers not in (2, 3):
        raise ValueError(f"num_consumers must be 2 or 3, got {num_consumers!r}")
    if not isinstance(stream_lhs_scales, bool):
        raise TypeError(f"stream_lhs_scales must be a bool, got {stream_lhs_scales!r}")
    if rows_per_group is not None:
        if isinstance(rows_per_group, bool) or not isinstance(rows_per_group, (int, float)):
            raise TypeError(f"rows_per_group must be a number or None, got {rows_per_group!r}")
        if rows_per_group < 0:
            raise ValueError(f"rows_per_group must be >= 0, got {rows_per_group}")
        if rows_per_group < MIN_ROWS_PER_GROUP_THREE_CONSUMERS:
            num_consumers = 2
    config = None
    if num_consumers == 3:
        config = dataclasses.replace(DEFAULT_FP8_BLOCK_CONFIG, stream_lhs_scales=stream_lhs_scales)
        config = fit_fp8_block_config(config, k, out_dtype, rhs_block_rows)
        stage = _block_stage_bytes(config, rhs_block_rows)
        scales = _block_scale_bytes(config, k)
        fits = _smem_bytes(config, stage, out_dtype, scales) <= SMEM_BYTES
        if not fits or config.max_concurrent_steps < 3:
            config = None
    if config is None:
        config = dataclasses.replace(
            TWO_CONSUMER_FP8_BLOCK_CONFIG, stream_lhs_scales=stream_lhs_scales
        )
        config = fit_fp8_block_config(config, k, out_dtype, rhs_block_rows)
    num_k_steps = k // 128
    depth = min(config.max_concurrent_steps, num_k_steps)
    if persistent_pipeline and num_k_steps % depth == 0:
        config = dataclasses.replace(config, persistent_pipeline=True)
    return config


def grouped_matmul_fp8_block(
    lhs: jax.Array,
    lhs_scale: jax.Array,
    rhs: jax.Array,
    rhs_scale: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype: jnp.dtype = jnp.bfloat16,
    group_starts: jax.Array | None = None,
    out_rows: int | None = None,
    config: GroupedMatmulConfig | None = None,
    interpret: bool = False,
    lhs_scale_k_major: bool = False,
    rhs_block_rows: int = 128,
) -> jax.Array:
    """Block-scaled FP8 ragged-row GEMM (1x128 lhs blocks, 128x128 or 1x128 rhs blocks).

    ``out[r, c] = Σ_kb (Σ_{k in kb} lhs[r, k] rhs[g, c, k]) * lhs_scale[r, kb] *
    rhs_scale[g, c // rhs_block_rows, kb]`` for the group g of row r, with every 128-wide
    inner sum taken by fp8 wgmma into a fresh accumulator and promoted to f32 (see module
    doc).

    Args:
      lhs: (M, K) float8_e4m3fn or float8_e5m2; K a multiple of 128.
      lhs_scale: (M, K/128) f32 scale_inv of each 1x128 block.
      rhs: (G, N, K) FP8, K-major (the columnwise copy of the (K, N) weight).
      rhs_scale: (G, ceil(N/128), K/128) f32 scale_inv of each 128x128 block, or (G, N,
        K/128) of each 1x128 block with ``rhs_block_rows=1``.
      group_sizes: (G,) int32.
      out_dtype: bfloat16 or float32.
      group_starts, out_rows: a packed (out_rows, N) output, as `grouped_matmul`'s (lhs_scale
        stays per lhs row).
      config: tiling; tile_k must be 128 and tile_n 128 or 64 (64 with consumer_split="m"),
        so that each consumer's columns lie in one 128-column rhs scale block (one rhs scale
        per consumer and K step). tile_m=192 with three consumers (`num_consumers=3`,
        consumer_split="m", tile_n=64) gives 192x128 CTA tiles of 64x128 parts, each with
        its main and chunk accumulators. tile_m=128 with tile_n=64 gives 128x128 CTA tiles
        (a fifth less operand traffic per product than the default 64x256, the same
        accumulator registers): on
        the H200 (stop 26, `grouped_ab --variants block_tiles`) 0.79x the default grouped
        and 0.77x dense, 0.90x with the persistent pipeline; kept as an option.
      interpret: run the Pallas interpreter.
      lhs_scale_k_major: lhs_scale is given as (K/128, M), each K block's scales for
        consecutive rows, the order the kernel reads (the quantize kernels' "tiles" layout
        of 1x128 scales, docs/design/layouts.md), instead of being transposed here.
      rhs_block_rows: 128 (128x128 weight blocks: one rhs scale per consumer and K step) or 1
        (1x128 blocks along K, a wgrad's token-direction copy: each K step's scales of the
        tile's rhs rows come through the pipeline with its operand tiles and multiply the
        chunk's columns; no wgmma in flight).
    """
    _check_rhs_block_rows(rhs_block_rows)
    rhs_rowwise = rhs_block_rows == 1
    out_dtype, num_rows, k, num_groups, num_cols = common.check_block_scaled_operands(
        lhs, lhs_scale, rhs, rhs_scale, jnp.float32, out_dtype
    )
    if k % 128:
        raise ValueError(f"lhs: K={k} must be a multiple of 128 for 1x128 block scaling")
    common.check_group_sizes(group_sizes, num_groups)
    check_packed_output(group_starts, out_rows, num_groups)
    if not isinstance(lhs_scale_k_major, bool):
        raise TypeError(f"lhs_scale_k_major must be a bool, got {lhs_scale_k_major!r}")
    lhs_scale_shape = (k // 128, num_rows) if lhs_scale_k_major else (num_rows, k // 128)
    common.check_shape("lhs_scale", lhs_scale, lhs_scale_shape)
    rhs_scale_rows = num_cols if rhs_rowwise else pl.cdiv(num_cols, 128)
    common.check_shape("rhs_scale", rhs_scale, (num_groups, rhs_scale_rows, k // 128))
    if config is None:
        rows_per_group = num_rows / num_groups if num_groups > 1 else None
        config = fp8_block_default_config(
            k, out_dtype, rows_per_group=rows_per_group, rhs_block_rows=rhs_block_rows
        )
    if not isinstance(config, GroupedMatmulConfig):
        raise TypeError(f"config must be a GroupedMatmulConfig, got {type(config).__name__}")
    if config.tile_k != 128 or config.tile_n not in (64, 128):
        raise ValueError(
            f"config: block FP8 needs tile_k=128 and tile_n=128 or 64, got "
            f"tile_k={config.tile_k}, tile_n={config.tile_n}"
        )
    if rhs_rowwise and config.wgmma_in_flight:
        raise ValueError(
            "config: block FP8 with rhs_block_rows=1 needs wgmma_in_flight=0 (the previous K "
            "step's rhs scales leave the pipeline with its stage)"
        )
    if config.consumer_split == "m" and config.tile_n != 64:
        raise ValueError(
            "config: block FP8 with consumer_split='m' needs tile_n=64 (each consumer's "
            f"2 * tile_n columns in one 128-column rhs scale block), got tile_n={config.tile_n}"
        )
    part_rows, part_cols = config.consumer_part_shape()
    live_tiles = 2 + config.wgmma_in_flight  # main, current (and previous) partial products
    max_acc = _MAX_ACC_ELEMS_PER_WG[config.num_consumers]
    if live_tiles * part_rows * part_cols > max_acc:
        raise ValueError(
            f"config: a consumer's {part_rows} x {part_cols} part is too large for block FP8 "
            f"with {config.num_consumers} consumers ({live_tiles} f32 tiles of it must stay "
            f"in registers, at most {max_acc} elements); use 64-row parts (tile_m=64, or "
            "tile_m=192 with three consumers) and no wgmma in flight with three"
        )
    config.check_out_dtype(out_dtype)
    tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
    _check_smem(
        config,
        _block_stage_bytes(config, rhs_block_rows),
        out_dtype,
        _block_scale_bytes(config, k),
    )

    # Rows and columns padded to multiples of 8 (and one tile) for TMA; K is whole.
    rows_p = common.round_up(max(num_rows, tile_m), 8)
    cols_p = config.padded_cols(num_cols, out_dtype)
    lhs_p = common.pad_axis(lhs, 0, rows_p)
    rhs_p = common.pad_axis(rhs, 1, cols_p)
    num_k_blocks = k // 128
    # Scales of one K block for consecutive rows, so each step reads one TMA row.
    scale_cols = common.round_up(rows_p, 4)
    lhs_scale_t = common.pad_axis(lhs_scale if lhs_scale_k_major else lhs_scale.T, 1, scale_cols)
    num_col_blocks = rhs_scale.shape[1]
    if rhs_rowwise:
        # (G, K/128, N): one K block's scales for consecutive rhs rows, one TMA row a step.
        rhs_scale = common.pad_axis(jnp.swapaxes(rhs_scale, 1, 2), 2, cols_p)

    in_specs = (
        plgpu.BlockSpec(
            (tile_m, tile_k),
            lambda kk: (0, kk),
            transforms=common.smem_transforms(tile_k, lhs.dtype),
        ),
        plgpu.BlockSpec(
            (2 * tile_n, tile_k),
            lambda kk: (0, kk),
            transforms=common.smem_transforms(tile_k, rhs.dtype),
        ),
    )
    streamed = config.stream_lhs_scales
    if streamed:  # each K step's lhs scales of the tile's rows, with its operand tiles
        in_specs += (plgpu.BlockSpec((1, tile_m), lambda kk: (kk, 0)),)
    if rhs_rowwise:  # each K step's scales of the tile's rhs rows (output columns)
        in_specs += (plgpu.BlockSpec((1, 2 * tile_n), lambda kk: (kk, 0)),)

    def pipeline_refs(refs, ctx):
        lhs_ref, rhs_ref, lhs_scale_ref, rhs_scale_ref = refs[:4]
        rows = pl.ds(ctx.row_tile.block_start, tile_m)
        cols = pl.ds(ctx.col_tile * (2 * tile_n), 2 * tile_n)
        windows = (lhs_ref.at[rows], rhs_ref.at[ctx.row_tile.group].at[cols])
        if streamed:
            windows += (lhs_scale_ref.at[:, rows],)
        if rhs_rowwise:
            windows += (rhs_scale_ref.at[ctx.row_tile.group].at[:, cols],)
        return windows

    def allocation_refs(refs):
        lhs_ref, rhs_ref, lhs_scale_ref, rhs_scale_ref = refs[:4]
        operands = (lhs_ref, rhs_ref.at[0])
        if streamed:
            operands += (lhs_scale_ref,)
        if rhs_rowwise:
            operands += (rhs_scale_ref.at[0],)
        return operands

    overlap = config.wgmma_in_flight == 1
    scales_first = config.block_scales_before_mma  # (overlap is refused with it)

    def lhs_block_scale(ctx, k_block, streamed_scales=None):
        """lhs_scale[rows of this consumer, k_block] as a row vector; `streamed_scales` is the
        K step's (1, tile_m) SMEM stage of lhs scales when they are streamed."""
        if streamed_scales is not None:
            rows = ctx.row_slice if config.consumer_split == "m" else slice(None)
            return driver.row_vector(streamed_scales.at[0, rows])
        # The tile's (K/128, rows of this consumer) lhs block scales, prefetched at tile start.
        lhs_scales_smem = ctx.prefetched[0][0]
        return driver.row_vector(lhs_scales_smem.at[k_block])

    def block_scale(refs, ctx, k_block, streamed_scales=None, rhs_scales_stage=None):
        """(row factor, column factor or None) of this consumer's chunk at `k_block`:
        lhs_scale[rows, k_block] times rhs_scale[g, the 128-column block of this consumer's
        columns, k_block] with 128x128 rhs blocks; with 1x128 ones the lhs scales and the
        K step's (1, 2 * tile_n) SMEM stage of rhs scales, this consumer's columns of it."""
        if rhs_scales_stage is not None:
            row_scale = lhs_block_scale(ctx, k_block, streamed_scales)
            return row_scale, driver.col_vector(rhs_scales_stage.at[0, ctx.col_slice])
        # (The rhs scalar's global load first, as before stop 51: the same lowered module.)
        first_col = ctx.col_tile * (2 * tile_n) + ctx.col_slice.start
        col_block = jnp.minimum(first_col // 128, num_col_blocks - 1)
        rhs_block_scale = refs[3][ctx.row_tile.group, col_block, k_block]
        return lhs_block_scale(ctx, k_block, streamed_scales) * rhs_block_scale, None

    def promote(main, chunk, scales):
        row_scale, col_scale = scales
        scale = lax.broadcast_in_dim(row_scale, chunk.shape, [0])
        if col_scale is not None:
            # The two scales' product first, as with 128x128 blocks (each row's scale times
            # the block's): then `main + chunk * scale` contracts to one FMA per element.
            scale = scale * lax.broadcast_in_dim(col_scale, chunk.shape, [1])
        return main + chunk * scale

    stagger = config.stagger_consumers

    def step(refs, ctx, smem_refs, carry):
        lhs_smem, rhs_smem, *scale_stages = smem_refs
        streamed_scales = scale_stages.pop(0) if streamed else None
        rhs_scales_stage = scale_stages.pop(0) if rhs_rowwise else None
        # This consumer's lhs rows (all of them unless consumer_split="m") and rhs columns.
        lhs_operand = lhs_smem.at[ctx.row_slice] if config.consumer_split == "m" else lhs_smem
        rhs_operand = rhs_smem.at[ctx.col_slice].transpose((1, 0))
        if overlap:
            k_step, main, previous = carry
        else:
            k_step, main = carry
        # The tile's first K step, or a stream-K piece's (ctx.k_begin; k_step counts K blocks
        # from the tile's first either way).
        first_step = lambda: k_step == ctx.k_begin
        if stagger:
            first_step_of = lambda consumer: first_step() & (ctx.consumer == consumer)
            pl.when(first_step_of(1))(lambda: plgpu.barrier_wait(ctx.scratch[0]))

        def wait_prefetched_scales():
            if not streamed:  # the tile's lhs scale table, copied at tile start

                @pl.when(first_step())
                def _wait_scales():
                    ctx.wait_prefetched(0)

        def chunk_product(chunk_ref):
            if scales_first:
                # Loaded before the wgmma is issued, so that ptxas cannot place the loads
                # behind the MMA's instructions (stop 56's wgrad finding).
                wait_prefetched_scales()
                scale = block_scale(refs, ctx, k_step, streamed_scales, rhs_scales_stage)
            # A freshly scoped accumulator starts at zero: this K block's products
            # never share the tensor core's adder with earlier blocks.
            plgpu.wgmma(chunk_ref, lhs_operand, rhs_operand)
            if not scales_first:
                wait_prefetched_scales()

            if overlap:
                # Promote the previous K block while this block's wgmma runs (at
                # k_step 0 the previous partial product is zero).
                prev_block = jnp.maximum(k_step - 1, 0)
                promoted = promote(main, previous, block_scale(refs, ctx, prev_block))
                return promoted, chunk_ref[...]
            if scales_first:
                chunk = chunk_ref[...]
            elif config.early_block_scales:
                # Loaded before reading the accumulator (which waits for the wgmma): the
                # loads' latency runs under the MMA instead of after it.
                scale = block_scale(refs, ctx, k_step, streamed_scales, rhs_scales_stage)
                chunk = chunk_ref[...]
            else:
                chunk = chunk_ref[...]
                scale = block_scale(refs, ctx, k_step, streamed_scales, rhs_scales_stage)
            if stagger:
                # The first consumer's MMA is done: the second one's may start.
                pl.when(first_step_of(0))(lambda: plgpu.barrier_arrive(ctx.scratch[0]))
            return promote(main, chunk, scale)

        result = pl.run_scoped(chunk_product, plgpu.ACC((part_rows, part_cols), jnp.float32))
        if overlap:
            main, chunk = result
            return k_step + 1, main, chunk
        return k_step + 1, result

    def accumulate(refs, ctx, run_pipeline, start):
        """The K loop with the promoted sum starting from `start` (stream-K: zeros, or an
        item's earlier K blocks, promoted in the same order as in a whole tile)."""
        del refs
        _, main = run_pipeline((ctx.k_begin, start))
        return main

    def run_tile(refs, ctx, run_pipeline):
        zeros = driver.wgmma_zeros((part_rows, part_cols))
        if not overlap:
            _, main = run_pipeline((jnp.int32(0), zeros))
            return main
        _, main, last = run_pipeline((jnp.int32(0), zeros, zeros))
        return promote(main, last, block_scale(refs, ctx, num_k_blocks - 1))

    parts = driver.RowKernelParts(
        in_specs=in_specs,
        pipeline_refs=pipeline_refs,
        allocation_refs=allocation_refs,
        run_tile=run_tile,
        step=step,
        num_k_steps=num_k_blocks,
        prefetches=() if streamed else (driver.TilePrefetch(2, "rows"),),
        # stagger_consumers: the first consumer's first K block done, once per tile.
        scratch=(plgpu.Barrier(num_arrivals=1),) if stagger else (),
        # (The rhs scale stage, like the rhs tiles, depends on the column tile and K step only.)
        column_specs=(1, len(in_specs) - 1) if rhs_rowwise else (1,),
        # (With wgmma_in_flight=1 the last block is promoted after the pipeline, as block
        # num_k_blocks - 1: GroupedMatmulConfig refuses stream_k with it.)
        accumulate=accumulate,
        finish=lambda refs, ctx, main: main,  # the scales are applied per K block
    )
    return run_row_kernel(
        parts,
        group_sizes,
        [lhs_p, rhs_p, lhs_scale_t, rhs_scale],
        config=config,
        name="grouped_matmul_fp8_block",
        num_groups=num_groups,
        num_rows=num_rows,
        num_cols=num_cols,
        padded_rows=rows_p,
        padded_cols=cols_p,
        out_dtype=out_dtype,
        interpret=interpret,
        group_starts=group_starts,
        out_rows=out_rows,
    )
