"""Variants of the grouped GEMM kernels, timed in alternation (issue 5).

The first H200 run that compared two configs timed each once, seconds apart, and the same
config came out 10% slower than a day earlier: clock drift was as large as the effects.
Here the variants of each case (and XLA's dense bf16 GEMM of the same size, as a yardstick
for the run's clocks) are timed batch by batch in alternation
(`benchmarks.timing.interleaved_seconds`). Variant sets:

* ``epilogue``: whole row tiles staged through the swizzled SMEM view
  (`swizzled_epilogue=True`, the default) or through the plain view;
* ``schedule``: the pipeline kept running across output tiles (`persistent_pipeline`) and
  2-CTA clusters that multicast the lhs tile (`cluster_n=2`), alone and together, against
  the best configs of the earlier sweeps;
* ``grouping``: what grouping itself costs. The same kernel and config on the balanced
  8-group split, on all rows in group 0 of the same (G, N, K) weights (one weight, but the
  grouped bookkeeping), through `dense_matmul` (G = 1), and the balanced split under other
  tile orders (`grid_minor_dim`, `grid_tile_width`), which decide how often a wave of CTAs
  moves on to the next expert's weight. Only the balanced variants compute the same sums;
* ``defaults``: each kernel's default config against its wgmma-overlap and pipeline-depth
  neighbours (after the visit-table change, where single sweeps ranked them differently),
  the balanced shape and the dense block-FP8 GEMM only;
* ``block_tiles``: block FP8 only (G8 balanced and the dense 8192³ GEMM): the default (with
  and without `early_block_scales`, the default since stop 35; with the persistent pipeline;
  with a wgmma in flight, i.e. the previous K block promoted under the MMA; in 2-CTA
  clusters; with the consumers staggered by one K block) and its CTA tile of 64 x (2 x 128)
  against 128 x (2 x 64), whose 128x128 tiles read a fifth less lhs + rhs per product (32
  instead of 40 KB per 2 M multiply-adds and K step) for the same accumulator registers, with
  a wgmma in flight, the persistent pipeline and 2-CTA clusters;
* ``stagger``: block FP8 only, the same two shapes: the default with early and late scale
  loads, alone and with `stagger_consumers` (the second consumer one K block behind the
  first), and with the persistent pipeline: block_tiles' questions that are still open, with
  fewer variants so that each gets more rounds;
* ``wide_tiles``: the bf16 and FP8 rowwise defaults (CTA tile 128 x (2 x 128): each consumer
  issues two m64n128 wgmmas per K slice, re-reading the rhs slice) against 64 x (2 x 256),
  whose consumers issue one m64n256 wgmma each: a sixth less shared-memory traffic per
  multiply-add (20 instead of 24 KB per 128 x 256 x 16), for more L2 traffic per product (the
  lhs tile is half as tall). 72 KB per 64-wide K step leave room for two stages only, so K
  steps of 32 (bf16) / 64 (FP8) with more stages too. Block FP8 keeps its default (its chunk
  accumulator doubles the registers);
* ``consumer_split``: the bf16 and FP8 rowwise defaults (consumers that split the CTA tile's
  columns, each issuing two m64n128 wgmmas per K slice that both read its rhs slice) against
  `consumer_split="m"` on the same 128 x (2 x 128) tile (each consumer owns 64 rows and all
  256 columns: one m64n256 wgmma per K slice, a sixth less shared memory read per product,
  the same L2 traffic and accumulator registers), alone and with a deeper pipeline (its
  epilogue buffers are half as tall), the persistent pipeline or 2-CTA clusters. Block FP8
  keeps its default (the yardstick only);
* ``cluster_m``: the dense entry points (`dense_matmul` bf16 and FP8 rowwise,
  `dense_matmul_fp8_block`) on 8192³, each default against the same config in 2-CTA clusters
  along M (`cluster_m=2`: the rhs tile of every K step multicast to two row tiles, so a
  64 x (2 x 128) block-FP8 CTA reads 24 instead of 40 KB from L2 per K step), with and
  without the persistent pipeline; XLA's dense bf16 and FP8 GEMMs as yardsticks;
* ``weights_in_registers``: the MXFP8 and NVFP4 kernels with the weights dequantized in
  registers (stops 46-47), G8 balanced. bf16 outputs on the default 256-token tiles (MXFP8:
  one wgmma per MX block or per 64-wide step; NVFP4: the byte-permute and the float32
  decodes), and float32 outputs on the default (and the library's) 256-token tiles with two
  stages and on 128-token tiles with four; and each with two K steps a stage (`tile_k=128`,
  stop 48: the second step converts under the first's wgmmas; two stages of 256 tokens for
  bf16, three of 128 for f32, what fits). Outputs of a format and output dtype are checked
  bit for bit against each other (the same values, the same order). One ablation, NVFP4
  without its decode (wrong outputs by design), asks whether the structure alone runs fast
  (stop 48 also timed every default with a wgmma in flight: wrong outputs on the H200, and
  no faster; docs/kernels_grouped_matmul.md);
* ``three_consumers``: block FP8 with three consumer warpgroups of 64 x 128 (`num_consumers=3`,
  `consumer_split="m"`, 192 x (2 x 64) CTA tiles: the default since stop 43), whose main +
  chunk accumulators leave no room for a 128-row tile with two consumers (40 KB of lhs + rhs
  per K step for 3 M products where stop 42's 64 x (2 x 128) reads 40 KB for 2 M), against
  that two-consumer tile, with late scale loads, the persistent pipeline, the lhs scales
  streamed with the K steps (`stream_lhs_scales`: four stages fit), 2-CTA clusters along
  N (the lhs tile multicast), the column tiles walked fastest, and two consumers splitting
  128 x (2 x 64) tiles' rows (DeepGEMM's 128 x 128 with 64-row parts). G8 balanced, G64
  small experts (512 rows a group: where the grouped default keeps two consumers) and the
  dense 8192³ GEMM (`--dense-only`: that alone), with XLA's dense bf16 and FP8 GEMMs of the
  same flops as yardsticks. (Stop 43's first run
  also tried bf16 and FP8 rowwise in 192 x (2 x 128) tiles: ptxas refused their one m64n256
  wgmma per consumer; see ``wide_three_consumers``);
* ``wide_three_consumers``: the bf16 and FP8 rowwise defaults (128 x (2 x 128), two
  consumers) against three consumers of 64 x 256 in 192 x (2 x 128) tiles, each issuing two
  m64n128 wgmmas per K slice (ptxas refuses one m64n256 with four warpgroups:
  benchmarks/ptxas_wgmma_budget.py): 56 KB of lhs + rhs per 64-wide K step for 3.1 M
  products instead of 48 KB for 2.1 M, a fifth less L2 traffic per product, for as much
  shared-memory traffic per product, 6.6% more rows computed at G8's group starts and a
  less even last round of the persistent grid (benchmarks/tile_traffic.py: 0.86 of the
  grid's time on needed work against the default's 0.97); with two
  epilogue buffers, the persistent pipeline (two stages) and columns walked fastest. G8
  balanced only; block FP8's default as the clock yardstick;
* ``stream_k``: the bf16 and FP8 rowwise defaults against the same tiles with the last round
  of the persistent grid and one round before it split along K (`stream_k=True`: issue 5's
  G8 balanced is 2048 items on 132 SMs, 15.5 rounds; benchmarks/tile_traffic.py puts the
  default's last-round loss at ~3%), without and with the persistent pipeline (four
  stages, one epilogue buffer, so that 64 K steps are whole rounds), and the persistent
  pipeline alone; FP8 also without its wgmma in flight (which stream-K needs). A split
  item's second CTA starts its accumulator from the first one's: the default's bits. Both G8
  shapes; block FP8's default with and
  without stream-K (its 192-row tile fits G8 balanced's 2912 items in 22.06 rounds);
* ``wgrad``: the bf16 weight-gradient kernel on x (M, K) and dy (M, N) as the forward stores
  them (`token_major=True`) under the configs of the stop 23 sweep, where the default was
  the slowest token-major one, and the grid-order change alone; then the K-major default on
  the same operands transposed beforehand (xᵀ, dyᵀ, outside the timing); the default has
  one TMA pipeline from tile to tile (`persistent_pipeline`) since stop 58, the sweep's
  configs a pipeline per tile. Balanced and skewed G8 shapes, and G64 small experts (8
  token steps a tile);
* ``fp8_block_wgrad``: block FP8's MoE wgrad (two 1x128 token-block copies, the FP8 wgrad
  kernel with its block scales, the default since stop 53) under pipeline depths, grid
  orders, the scale loads' place (`block_scales_before_mma`, stop 56; before the wgmma in
  the default since stop 57) and the pipeline (one from tile to tile, `persistent_pipeline`,
  in the default since stop 58, or one per tile) around `DEFAULT_FP8_BLOCK_WGRAD_CONFIG`
  (its tile is fixed: a main and a chunk accumulator of 128 x 64 per consumer fill the
  register budget), G8 balanced and G64 small experts (whole 128-token groups; G64: 4 steps
  a tile), XLA's dense FP8 GEMM of the same flops as the yardstick; then one group of 8192
  tokens at 8192 x 8192 (the dense layers' wgrad since stop 54) through
  `dense_matmul_fp8_block_wgrad` with float32 out, as the layers call it, around its own
  default (`DENSE_FP8_BLOCK_WGRAD_CONFIG`: the MoE default since stop 57, with one epilogue
  buffer since stop 59; 5 stages in stops 55-56);
* ``wgrad_stage_spot``: the block-FP8 wgrad kernel at 2 to 5 stages (bfloat16 out, a
  pipeline per tile, as stops 53-57 timed it) on tiles of 16 and 17 token steps (G8) and of
  64 and 65 (one group), each depth with its scales loaded after the wgmma is issued and
  before it (`block_scales_before_mma`). Loaded after, 4 stages ran 0.78-0.87x of 3 and 5 in
  every call of stops 53-56, on 17 and 65 steps as on 16 and 64 (stop 56: not where the
  depth divides a tile's steps); Nsight Compute put it on ptxas's placement of the row-scale
  loads (the config field's docstring). Loaded before, 4 stages were the fastest at G8 (stop
  57), now the MoE default.
* ``wgrad_persistent``: every wgrad the layers call, float32 out as they call it (bf16
  token-major and K-major, per-tensor FP8, block FP8 on G8 balanced and G64 small experts;
  the dense layers' block FP8 on 8192³), around its default: with a pipeline per tile (the
  defaults until stop 58), and with the persistent pipeline at one stage fewer (with either
  epilogue buffer count) or more (one buffer), the other buffer count, the other grid order
  (`wgrad_persistent_variants`; stop 59's defaults came from two of its calls);
* ``fp8_wgrad_depth``: the per-tensor FP8 wgrad (K-major e4m3 x e5m2, float32 out) at 3
  stages and at 4, on issue 5's 16384 x 4096 x 4096 with 2048, 1024, 512 and 256 tokens a
  group, and on G64 small experts (512 tokens, K 2048, N 1408): 4 stages won 3% at G8 and
  lost 18% at G64 small experts in stops 58-59. Stop 60's call (an H100): 4 stages +5% at
  2048 tokens, +10% at 1024, level at 512 and 256, -18% at G64 small experts, so the
  default is 4 stages from 1024 tokens a group (`default_wgrad_config`);
* ``dense_fp8_block_stages``: the dense block-FP8 GEMM (`dense_matmul_fp8_block`, 8192³),
  as the forward (128x128 rhs blocks, issue 5's 1300 TFLOP/s target) and as the layers'
  wgrad (`rhs_block_rows=1`, 1x128 blocks on both operands), under pipeline depths, without
  the persistent pipeline or the streamed lhs scales, and on the two-consumer tile, around
  the config the entry point picks (stop 53 found the grouped wgrad's 4 stages 1.25x slower
  than 3: do these have such a spot?); the wgrad also on the MoE wgrad kernel with one group.

    python -m benchmarks.grouped_ab [--out DIR] [--small]
        [--variants epilogue|schedule|grouping|defaults|block_tiles|stagger|wide_tiles|
                    consumer_split|cluster_m|three_consumers|wide_three_consumers|stream_k|
                    wgrad|fp8_block_wgrad|wgrad_stage_spot|wgrad_persistent|
                    fp8_wgrad_depth|dense_fp8_block_stages]
        [--dense-only]

writes DIR/grouped_ab_<variants>.json and .md. `--small` runs tiny shapes in the Pallas
interpreter (a smoke test; the numbers mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import unittest.mock

import jax
import jax.numpy as jnp

from benchmarks import bench_grouped_matmul
from benchmarks.bench_grouped_matmul import (
    BF16,
    BF16_WGRAD_CONFIGS,
    E4M3,
    fwd_config,
    random_operands,
)
from benchmarks.timing import (
    device_description,
    interleaved_seconds,
    report,
    same_bits_as_first,
)
from pallas_kernels import grouped_matmul_mx_weights as mx_weights
from pallas_kernels.grouped_matmul_dense import (
    dense_matmul,
    dense_matmul_fp8_block,
    dense_matmul_fp8_block_wgrad,
)
from pallas_kernels.grouped_matmul_fwd import (
    DEFAULT_BF16_CONFIG,
    DEFAULT_FP8_BLOCK_CONFIG,
    DEFAULT_FP8_CONFIG,
    TWO_CONSUMER_FP8_BLOCK_CONFIG,
    GroupedMatmulConfig,
    fit_fp8_block_config,
    fp8_block_default_config,
    grouped_matmul,
    grouped_matmul_fp8_block,
)
from pallas_kernels.grouped_matmul_mx_weights import (
    DEFAULT_MXFP8_WEIGHTS_CONFIG,
    grouped_matmul_mxfp8_weights,
    grouped_matmul_nvfp4_weights,
)
from pallas_kernels.grouped_matmul_wgrad import (
    DEEP_FP8_WGRAD_CONFIG,
    DEFAULT_BF16_WGRAD_CONFIG,
    DEFAULT_FP8_BLOCK_WGRAD_CONFIG,
    DEFAULT_FP8_WGRAD_CONFIG,
    DENSE_FP8_BLOCK_WGRAD_CONFIG,
    GroupedWgradConfig,
    default_wgrad_config,
    fit_to_shared_memory,
    grouped_matmul_wgrad,
)

# (case, G, M, K, N, group sizes): the balanced shape, and a skewed split whose
# group boundaries fall inside row tiles (those tiles take the plain path either way).
SHAPES = {
    "G8 balanced": (8, 16384, 4096, 4096, [2048] * 8),
    "G8 skewed": (8, 16384, 4096, 4096, [6000, 3100, 2050, 1500, 1100, 1000, 900, 734]),
}
# The fastest configs of the earlier sweeps (docs/benchmarks.md).
BF16_CONFIG = fwd_config(128, 128, 64, 3, 64, in_flight=0, buffers=2)
FP8_CONFIG = fwd_config(128, 128, 128, 4, 64, width=16)
BLOCK_CONFIG = fwd_config(64, 128, 128, 4, 64, in_flight=0, buffers=2)
DENSE_SIZE = 8192


def epilogue_variants(config: GroupedMatmulConfig) -> dict[str, GroupedMatmulConfig]:
    return {
        "swizzled": config,
        "plain": dataclasses.replace(config, swizzled_epilogue=False),
    }


def schedule_variants(config: GroupedMatmulConfig) -> dict[str, GroupedMatmulConfig]:
    """The config, then the persistent pipeline and 2-CTA clusters alone and together.

    The persistent pipeline cannot keep a wgmma in flight through the pipeline's stages
    (the FP8 config's best setting) and needs whole rounds of stages per tile (64 K steps
    for bf16, 32 for FP8 with K = 4096): those variants drop the wgmma in flight and use 4
    stages, with one epilogue buffer so that bf16's 4 stages fit in shared memory.
    """
    replace = dataclasses.replace
    persistent_base = replace(
        config,
        max_concurrent_steps=4,
        epilogue_buffers=1 if config.tile_k == 64 else config.epilogue_buffers,
        wgmma_in_flight=0,
    )
    variants = {"best so far": config}
    if persistent_base != config:
        variants["4 stages, no wgmma in flight"] = persistent_base
    variants["persistent"] = replace(persistent_base, persistent_pipeline=True)
    variants["cluster 2"] = replace(config, cluster_n=2)
    variants["cluster 2 + persistent"] = replace(
        persistent_base, persistent_pipeline=True, cluster_n=2
    )
    return variants


def default_variants(config: GroupedMatmulConfig) -> dict[str, GroupedMatmulConfig]:
    """The config, with and without a wgmma in flight, 3 or 4 stages, 1 or 2 epilogue buffers
    (only the combinations that fit in shared memory), and the persistent pipeline."""
    replace = dataclasses.replace
    variants = {"default": config}
    for in_flight, stages, buffers in ((0, 4, 1), (0, 3, 2), (1, 4, 1), (1, 3, 2)):
        variant = replace(
            config,
            wgmma_in_flight=in_flight,
            max_concurrent_steps=stages,
            epilogue_buffers=buffers,
        )
        if variant != config and not (config.tile_k == 64 and stages == 4 and buffers == 2):
            variants[f"in flight {in_flight}, {stages} stages, {buffers} buffers"] = variant
    persistent = replace(
        config,
        wgmma_in_flight=0,
        max_concurrent_steps=4,
        epilogue_buffers=1,
        persistent_pipeline=True,
    )
    if persistent != config:
        variants["persistent, 4 stages, 1 buffer"] = persistent
    return variants


def block_tile_variants(config: GroupedMatmulConfig, k: int) -> dict[str, GroupedMatmulConfig]:
    """Block FP8's default config, its persistent pipeline, a wgmma in flight, and 128 x (2 x
    64) CTA tiles alone, with a wgmma in flight, the persistent pipeline or 2-CTA clusters,
    each fitted to shared memory for contraction size k (bf16 output)."""
    replace = dataclasses.replace
    tall = replace(config, tile_m=128, tile_n=64)
    variants = {
        "default": config,
        "default, persistent": replace(config, persistent_pipeline=True),
        # Promotes the previous K block under this block's wgmma: a third accumulator.
        "default, 1 in flight": replace(config, wgmma_in_flight=1),
        "default, 1 in flight, persistent": replace(
            config, wgmma_in_flight=1, persistent_pipeline=True
        ),
        # 2-CTA clusters along N share each 64-row lhs tile (one multicast load): a tenth
        # less L2 traffic per product (36 instead of 40 KB per 2 M multiply-adds).
        "default, cluster 2": replace(config, cluster_n=2),
        "128x(2x64)": tall,
        "128x(2x64), 1 in flight": replace(tall, wgmma_in_flight=1),
        "128x(2x64), persistent": replace(tall, persistent_pipeline=True),
        "128x(2x64), cluster 2": replace(tall, cluster_n=2),
        # Stops <= 34: each K step's scales loaded after the wgmma wait.
        "default, late scale loads": replace(config, early_block_scales=False),
        # The consumers offset by one K block, so each one's promotion runs under the
        # other's MMA (stop 37).
        "default, staggered": replace(config, stagger_consumers=True),
        "default, staggered, late scale loads": replace(
            config, stagger_consumers=True, early_block_scales=False
        ),
        "default, staggered, persistent": replace(
            config, stagger_consumers=True, persistent_pipeline=True
        ),
    }
    return {name: fit_fp8_block_config(c, k, BF16) for name, c in variants.items()}


def stagger_variants(config: GroupedMatmulConfig, k: int) -> dict[str, GroupedMatmulConfig]:
    """Block FP8's default with and without early scale loads, staggered consumers and the
    persistent pipeline (see the docstring), fitted to shared memory for k (bf16 output)."""
    names = (
        "default",
        "default, late scale loads",
        "default, staggered",
        "default, staggered, late scale loads",
        "default, persistent",
        "default, staggered, persistent",
    )
    every = block_tile_variants(config, k)
    return {name: every[name] for name in names}


def wide_tile_variants(config: GroupedMatmulConfig) -> dict[str, GroupedMatmulConfig]:
    """The default, then 64 x (2 x 256) CTA tiles at K steps and depths that fit in shared
    memory (bf16 when the default's K step is 64, FP8 when it is 128; see the docstring)."""
    wide = dataclasses.replace(config, tile_m=64, tile_n=256, epilogue_buffers=1)
    short_k = config.tile_k // 2  # 64-byte swizzle rows, bf16 or FP8
    return {
        "default": config,
        f"64x(2x256), k{short_k}, 5 stages": dataclasses.replace(
            wide, tile_k=short_k, max_concurrent_steps=5, wgmma_in_flight=0
        ),
        f"64x(2x256), k{short_k}, 5 stages, 1 in flight": dataclasses.replace(
            wide, tile_k=short_k, max_concurrent_steps=5, wgmma_in_flight=1
        ),
        f"64x(2x256), k{config.tile_k}, 2 stages": dataclasses.replace(
            wide, max_concurrent_steps=2, wgmma_in_flight=0
        ),
    }


def wide_three_consumer_variants(config: GroupedMatmulConfig) -> dict[str, GroupedMatmulConfig]:
    """The bf16 / FP8 rowwise default against three consumers of 64 x 256 in 192 x (2 x 128)
    tiles (see the docstring): three stages and one epilogue buffer, two buffers, the
    persistent pipeline (two stages: K steps must be whole rounds) and columns walked
    fastest."""
    replace = dataclasses.replace
    three = replace(
        config,
        tile_m=192,
        consumer_split="m",
        num_consumers=3,
        max_concurrent_steps=3,
        epilogue_buffers=1,
    )
    return {
        "default": config,
        "3 consumers": three,
        "3 consumers, 2 epilogue buffers": replace(three, epilogue_buffers=2),
        "3 consumers, persistent, 2 stages": replace(
            three, persistent_pipeline=True, wgmma_in_flight=0, max_concurrent_steps=2
        ),
        "3 consumers, columns minor": replace(three, grid_minor_dim=1),
    }


def stream_k_variants(config: GroupedMatmulConfig) -> dict[str, GroupedMatmulConfig]:
    """The bf16 / FP8 rowwise default against stream-K (see the docstring)."""
    replace = dataclasses.replace
    no_in_flight = replace(config, wgmma_in_flight=0)
    persistent = replace(
        no_in_flight, persistent_pipeline=True, max_concurrent_steps=4, epilogue_buffers=1
    )
    variants = {"default": config}
    if config.wgmma_in_flight:
        variants["no wgmma in flight"] = no_in_flight
    return variants | {
        "stream-K": replace(no_in_flight, stream_k=True),
        "persistent, 4 stages": persistent,
        "stream-K, persistent, 4 stages": replace(persistent, stream_k=True),
    }


def consumer_split_variants(config: GroupedMatmulConfig) -> dict[str, GroupedMatmulConfig]:
    """The default, then its consumers splitting the tile's rows (see the docstring): alone,
    with one more stage (bf16, whose 48 KB stages leave room for a fourth with one epilogue
    buffer) or without the wgmma in flight (FP8, whose 4 stages fill shared memory), with the
    persistent pipeline (which needs no wgmma in flight) and in 2-CTA clusters."""
    replace = dataclasses.replace
    rows = replace(config, consumer_split="m")
    if config.tile_k == 64:
        third_name = f"rows split, {config.max_concurrent_steps + 1} stages"
        third = replace(
            rows, max_concurrent_steps=config.max_concurrent_steps + 1, epilogue_buffers=1
        )
    else:
        in_flight = 1 - min(config.wgmma_in_flight, 1)
        third_name = f"rows split, {in_flight} in flight"
        third = replace(rows, wgmma_in_flight=in_flight)
    return {
        "default": config,
        "rows split": rows,
        third_name: third,
        "rows split, persistent": replace(
            rows,
            persistent_pipeline=True,
            wgmma_in_flight=0,
            max_concurrent_steps=4,
            epilogue_buffers=1,
        ),
        "rows split, cluster 2": replace(rows, cluster_n=2),
    }


def three_consumer_variants(kind: str, k: int) -> dict[str, GroupedMatmulConfig]:
    """Block FP8 ("block" grouped, "block dense") for contraction size k: the two-consumer
    default of stop 42, then three consumers (the default since stop 43) and its neighbours,
    each within shared memory for bf16 output."""
    if kind not in ("block", "block dense"):
        raise ValueError(f"kind must be 'block' or 'block dense', got {kind!r}")
    replace = dataclasses.replace
    dense = kind == "block dense"
    two = fp8_block_default_config(k, BF16, persistent_pipeline=dense, num_consumers=2)
    three = fit_fp8_block_config(DEFAULT_FP8_BLOCK_CONFIG, k, BF16)
    # Persistent needs whole rounds of stages: the deepest depth that divides the K steps.
    depth = max(d for d in range(2, three.max_concurrent_steps + 1) if (k // 128) % d == 0)
    streamed = fit_fp8_block_config(replace(three, stream_lhs_scales=True), k, BF16)
    streamed = replace(streamed, max_concurrent_steps=4)  # as deep as two consumers' default
    return {
        "2 consumers (stop 42)": two,
        "3 consumers": three,
        "3 consumers, late scale loads": replace(three, early_block_scales=False),
        f"3 consumers, persistent, {depth} stages": replace(
            three, persistent_pipeline=True, max_concurrent_steps=depth
        ),
        # The lhs scales through the pipeline: no per-tile table, room for a fourth stage.
        "3 consumers, streamed scales": streamed,
        "3 consumers, streamed scales, persistent": replace(streamed, persistent_pipeline=True),
        "3 consumers, streamed scales, columns minor, persistent": replace(
            streamed, persistent_pipeline=True, grid_minor_dim=1
        ),
        # The 192-row lhs tile is now the larger operand: multicast it to a pair along N.
        "3 consumers, cluster 2": replace(three, cluster_n=2),
        "3 consumers, columns minor": replace(three, grid_minor_dim=1),
        f"3 consumers, columns minor, persistent, {depth} stages": replace(
            three, grid_minor_dim=1, persistent_pipeline=True, max_concurrent_steps=depth
        ),
        "2 consumers split rows, 128x(2x64)": fit_fp8_block_config(
            replace(two, tile_m=128, tile_n=64, consumer_split="m", persistent_pipeline=False),
            k,
            BF16,
        ),
    }


def dense_operands(size: int) -> tuple[jax.Array, jax.Array]:
    """Random bf16 (size, size) lhs and rhs (N, K) of the dense cases."""
    keys = jax.random.split(jax.random.key(9), 2)
    return tuple(jax.random.normal(key, (size, size), jnp.float32).astype(BF16) for key in keys)


def xla_nt_yardsticks(a16: jax.Array, b16: jax.Array) -> dict:
    """XLA's bf16 and FP8 (codes of the same values) GEMMs a @ bᵀ, b (N, K)."""
    a8, b8 = a16.astype(E4M3), b16.astype(E4M3)
    return {
        "XLA dense bf16": (jax.jit(lambda a, b: a @ b.T), [(a16, b16)]),
        "XLA dense fp8": (
            jax.jit(
                lambda a, b: jax.lax.dot_general(
                    a, b, (((1,), (1,)), ((), ())), preferred_element_type=BF16
                )
            ),
            [(a8, b8)],
        ),
    }


def config_candidates(prefix: str, configs: dict, call, args, interpret: bool) -> dict:
    """run_case candidates: `call(*args, config=c)` under jit for each named config."""
    return {
        f"{prefix} {name}": (
            jax.jit(lambda *xs, c=c: call(*xs, config=c, interpret=interpret)),
            [args],
        )
        for name, c in configs.items()
    }


def three_consumer_cases(run_case, shapes: dict, size: int) -> None:
    """Block FP8's variants of `three_consumer_variants` on the grouped `shapes` and the dense
    size³ GEMM, with XLA's dense bf16 and FP8 GEMMs of the same flops (the first expert's
    weight for the grouped shapes) as yardsticks."""

    def candidates(configs: dict, call, args) -> dict:
        return config_candidates("fp8 block", configs, call, args, interpret=False)

    for shape, (g, m, k, n, sizes) in shapes.items():
        x = random_operands(jax.random.key(7), g, m, k, n, sizes)[0]
        args = (
            x["lhs8"],
            jnp.ones((m, k // 128), jnp.float32),
            x["rhs8"],
            jnp.ones((g, n // 128, k // 128), jnp.float32),
            x["sizes"],
        )
        configs = three_consumer_variants("block", k)
        run_case(
            f"{shape} fwd fp8 block",
            2 * m * k * n,
            {
                **candidates(configs, grouped_matmul_fp8_block, args),
                **xla_nt_yardsticks(x["lhs"], x["rhs"][0]),
            },
        )
        del x, args
    a16, b16 = dense_operands(size)
    a8, b8 = a16.astype(E4M3), b16.astype(E4M3)
    a_scale = jnp.ones((size, size // 128), jnp.float32)
    b_scale = jnp.ones((size // 128, size // 128), jnp.float32)
    configs = three_consumer_variants("block dense", size)
    run_case(
        f"dense {size}^3 fp8 block",
        2 * size**3,
        {
            **candidates(configs, dense_matmul_fp8_block, (a8, a_scale, b8, b_scale)),
            **xla_nt_yardsticks(a16, b16),
        },
    )


VARIANT_SETS = {
    "epilogue": epilogue_variants,
    "schedule": schedule_variants,
    "grouping": None,  # not config variants: see grouping_cases
    "defaults": default_variants,
    "block_tiles": block_tile_variants,  # block FP8 only (takes k)
    "stagger": stagger_variants,  # block FP8 only (takes k)
    "wide_tiles": wide_tile_variants,  # bf16 and FP8 rowwise; block FP8 at its default
    "consumer_split": consumer_split_variants,  # bf16 and FP8 rowwise; block FP8 default
    "cluster_m": None,  # dense entry points only: see cluster_m_cases
    "three_consumers": None,  # per format and shape: see three_consumer_cases
    "wide_three_consumers": wide_three_consumer_variants,  # bf16 and FP8 rowwise
    "stream_k": stream_k_variants,  # bf16 and FP8 rowwise; block FP8 default
    "wgrad": None,  # wgrad configs and layouts: see wgrad_variants
    "fp8_block_wgrad": None,  # block FP8's MoE wgrad: see fp8_block_wgrad_cases
    "wgrad_stage_spot": None,  # its 4-stage slow spot: see WGRAD_STAGE_SPOT_SHAPES
    "wgrad_persistent": None,  # every wgrad the layers call: see wgrad_persistent_cases
    "fp8_wgrad_depth": None,  # per-tensor FP8 wgrad depth by group size: FP8_WGRAD_DEPTH_...
    "dense_fp8_block_stages": None,  # dense block FP8, fwd and wgrad: see dense_fp8_block_...
    "weights_in_registers": None,  # MXFP8 / NVFP4 in-register kernels: see weights_cases
}


def xla_dense_yardstick(sets) -> tuple:
    """XLA's dense bf16 (M, K) @ (K, N) GEMM on the first expert's weight: the same flops as
    the grouped cases, and the same GEMM in every set, so its rate compares clocks across runs."""
    return jax.jit(lambda a, b: a @ b), [(x["lhs"], x["rhs"][0].T) for x in sets]


def tile_order_variants(config: GroupedMatmulConfig) -> dict[str, GroupedMatmulConfig]:
    replace = dataclasses.replace
    return {
        "balanced": config,
        "balanced, rows minor, width 16": replace(config, grid_minor_dim=0, grid_tile_width=16),
        "balanced, rows minor, width 4": replace(config, grid_minor_dim=0, grid_tile_width=4),
        "balanced, columns minor, width 8": replace(config, grid_minor_dim=1, grid_tile_width=8),
    }


def grouping_cases(run_case, shapes, bf16_config, fp8_config, interpret) -> None:
    """Balanced split vs one group vs dense_matmul, bf16 and FP8 rowwise (see the docstring)."""
    g, m, k, n, sizes = shapes["G8 balanced"]
    flops = 2 * m * k * n
    sets = random_operands(jax.random.key(7), g, m, k, n, sizes)
    one_group = jnp.zeros((g,), jnp.int32).at[0].set(m)
    xla_dense = xla_dense_yardstick(sets)
    for kind, config in (("bf16", bf16_config), ("fp8 rowwise", fp8_config)):
        lhs_key, rhs_key = ("lhs", "rhs") if kind == "bf16" else ("lhs8", "rhs8")
        scales = (
            (lambda x: {})
            if kind == "bf16"
            else (lambda x: dict(lhs_scale=x["lhs_row_scale"], rhs_scale=x["rhs_col_scale"]))
        )

        def grouped(c, sizes_of, lhs_key=lhs_key, rhs_key=rhs_key, scales=scales):
            fn = jax.jit(
                lambda a, b, s, extra, c=c: grouped_matmul(
                    a, b, s, config=c, interpret=interpret, **extra
                )
            )
            return fn, [(x[lhs_key], x[rhs_key], sizes_of(x), scales(x)) for x in sets]

        candidates = {
            f"{kind} {name}": grouped(c, lambda x: x["sizes"])
            for name, c in tile_order_variants(config).items()
        }
        candidates[f"{kind} one group of {g}"] = grouped(config, lambda x: one_group)
        dense_scales = (
            (lambda x: {})
            if kind == "bf16"
            else (lambda x: dict(lhs_scale=x["lhs_row_scale"], rhs_scale=x["rhs_col_scale"][0]))
        )
        candidates[f"{kind} dense_matmul"] = (
            jax.jit(
                lambda a, b, extra, c=config: dense_matmul(
                    a, b, config=c, interpret=interpret, **extra
                )
            ),
            [(x[lhs_key], x[rhs_key][0], dense_scales(x)) for x in sets],
        )
        candidates["XLA dense bf16"] = xla_dense
        run_case(
            f"G8 balanced fwd {kind} grouping",
            flops,
            candidates,
            compare=[f"{kind} {name}" for name in tile_order_variants(config)],
        )


def cluster_m_cases(run_case, size: int, interpret: bool, tiny: dict | None) -> None:
    """The dense entry points' defaults against 2-CTA clusters along M (see the docstring)."""
    replace = dataclasses.replace
    a16, b16 = dense_operands(size)
    a8, b8 = a16.astype(E4M3), b16.astype(E4M3)
    xla = xla_nt_yardsticks(a16, b16)
    flops = 2 * size**3

    def with_clusters(config: GroupedMatmulConfig, persistent_ok: bool) -> dict:
        config = replace(config, **(tiny or {}))
        variants = {"default": config, "cluster_m 2": replace(config, cluster_m=2)}
        if persistent_ok:  # the other pipeline schedule too, with and without clusters
            other = replace(config, persistent_pipeline=not config.persistent_pipeline)
            label = "persistent" if other.persistent_pipeline else "not persistent"
            variants[f"default, {label}"] = other
            variants[f"cluster_m 2, {label}"] = replace(other, cluster_m=2)
        return variants

    def dense_candidates(prefix: str, configs: dict, call, args) -> dict:
        return config_candidates(prefix, configs, call, args, interpret)

    # bf16: the default has no wgmma in flight, so it may run persistent (8192 / 64 K steps).
    bf16 = with_clusters(
        replace(DEFAULT_BF16_CONFIG, max_concurrent_steps=4, epilogue_buffers=1), True
    )
    run_case(
        f"dense {size}^3 bf16",
        flops,
        {**dense_candidates("bf16", bf16, dense_matmul, (a16, b16)), **xla},
    )
    fp8 = with_clusters(DEFAULT_FP8_CONFIG, False)  # a wgmma in flight: not persistent
    run_case(
        f"dense {size}^3 fp8 rowwise",
        flops,
        {**dense_candidates("fp8", fp8, dense_matmul, (a8, b8)), **xla},
    )
    a_scale = jnp.ones((size, size // 128), jnp.float32)
    b_scale = jnp.ones((size // 128, size // 128), jnp.float32)
    # The two-consumer tile that stop 42 timed this way (the default until stop 43).
    block = fp8_block_default_config(size, BF16, persistent_pipeline=True, num_consumers=2)
    block = with_clusters(block, True)
    run_case(
        f"dense {size}^3 fp8 block",
        flops,
        {
            **dense_candidates(
                "fp8 block", block, dense_matmul_fp8_block, (a8, a_scale, b8, b_scale)
            ),
            **xla,
        },
    )


def wgrad_config_label(config: GroupedWgradConfig) -> str:
    """What the wgrad sweeps vary: depth, epilogue buffers, grid order, pipeline."""
    buffers = f"{config.epilogue_buffers} buffer" + ("s" if config.epilogue_buffers > 1 else "")
    pipeline = "persistent pipeline" if config.persistent_pipeline else "a pipeline per tile"
    return (
        f"{config.max_concurrent_steps} stages, {buffers}, grid minor {config.grid_minor_dim}, "
        f"{pipeline}"
    )


def wgrad_label(config: GroupedWgradConfig) -> str:
    """`wgrad_config_label`, marked when it is the bf16 default."""
    default = " (default)" if config == DEFAULT_BF16_WGRAD_CONFIG else ""
    return wgrad_config_label(config) + default


def wgrad_variants() -> dict[str, tuple[bool, GroupedWgradConfig]]:
    """name -> (token_major, config): the token-major default first (the others are compared
    with it), the stop 23 sweep's configs (a pipeline per tile; its first is the default
    until stop 58), the default with only grid minor 0, and the K-major default."""
    default = DEFAULT_BF16_WGRAD_CONFIG
    grid_minor_0 = dataclasses.replace(default, grid_minor_dim=0)
    token_major = dict.fromkeys([default, *BF16_WGRAD_CONFIGS, grid_minor_0])  # ordered, unique
    variants = {f"token-major {wgrad_label(c)}": (True, c) for c in token_major}
    variants[f"K-major {wgrad_label(default)}"] = (False, default)
    return variants


def wgrad_cases(run_case, shapes, interpret: bool, tiny: dict | None) -> None:
    """The bf16 wgrad variants on each shape (`tiny`: config fields for the interpreter)."""
    for shape, (g, m, k, n, sizes) in shapes.items():
        # x is the other sets' lhs, so the yardstick is their GEMM on their data; dy (M, N).
        sets = random_operands(jax.random.key(7), g, m, k, n, sizes)
        token_major = [
            (x["lhs"], jax.random.normal(jax.random.key(9 + i), (m, n), BF16), x["sizes"])
            for i, x in enumerate(sets)
        ]
        k_major = [(x.T, dy.T, s) for x, dy, s in token_major]  # transposed outside the timing
        candidates = {}
        for name, (is_token_major, config) in wgrad_variants().items():
            config = dataclasses.replace(config, **tiny) if tiny else config
            candidates[name] = (
                jax.jit(
                    lambda a, b, s, c=config, t=is_token_major: grouped_matmul_wgrad(
                        a, b, s, token_major=t, config=c, interpret=interpret
                    )
                ),
                token_major if is_token_major else k_major,
            )
        candidates["XLA dense bf16"] = xla_dense_yardstick(sets)
        run_case(f"{shape} wgrad bf16", 2 * m * k * n, candidates)
        del sets, token_major, k_major, candidates


# `block_scales_before_mma`: each chunk's scales loaded before its wgmma is issued.
SCALES_FIRST = dict(block_scales_before_mma=True)
# The wgrad pipeline of the defaults until stop 58: started empty at every tile.
PER_TILE = dict(persistent_pipeline=False)


def fp8_block_wgrad_variants() -> dict[str, GroupedWgradConfig]:
    """name -> config: the default first (the others are compared with it), then pipeline
    depths in either scale-load order (5 stages with two epilogue buffers is the most the
    shared memory holds; 6 with one), grid orders, and the earlier defaults as they were
    (a pipeline per tile)."""
    default = DEFAULT_FP8_BLOCK_WGRAD_CONFIG
    scales_after = dict(block_scales_before_mma=False, **PER_TILE)
    steps = {
        "a pipeline per tile (stop 57's default)": PER_TILE,
        "3 stages, scales after the MMA (stop 53's default)": dict(
            max_concurrent_steps=3, **scales_after
        ),
        "4 stages, scales after the MMA (stop 51's default)": dict(
            max_concurrent_steps=4, **scales_after
        ),
        "3 stages": dict(max_concurrent_steps=3),
        "5 stages": dict(max_concurrent_steps=5),
        "6 stages, 1 epilogue buffer": dict(max_concurrent_steps=6, epilogue_buffers=1),
        "grid minor 0": dict(grid_minor_dim=0),
    }
    variants = {
        "default (4 stages, scales before the MMA, grid minor 1, width 4, persistent pipeline)": (
            default
        )
    }
    variants.update({name: dataclasses.replace(default, **f) for name, f in steps.items()})
    return variants


def dense_fp8_block_wgrad_variants() -> dict[str, GroupedWgradConfig | None]:
    """name -> config of the dense layers' block-FP8 wgrad (`dense_matmul_fp8_block_wgrad`,
    one group, float32 out as `kernels.dense_fp8_block_wgrad_gemm` calls it): the entry
    point's own pick first (None), then one or two changes each, every config fitted to the
    shared memory as the entry point fits its own (5 stages keep one epilogue buffer)."""
    default = DENSE_FP8_BLOCK_WGRAD_CONFIG
    steps = {
        "2 epilogue buffers (stop 58's default)": dict(epilogue_buffers=2),
        "a pipeline per tile, 2 epilogue buffers (stop 57's default)": dict(
            epilogue_buffers=2, **PER_TILE
        ),
        "5 stages, scales after the MMA (stop 55's default)": dict(
            max_concurrent_steps=5, block_scales_before_mma=False, **PER_TILE
        ),
        "5 stages": dict(max_concurrent_steps=5),
        "3 stages": dict(max_concurrent_steps=3),
        "grid minor 0": dict(grid_minor_dim=0),
    }
    variants: dict[str, GroupedWgradConfig | None] = {
        "default (4 stages, 1 epilogue buffer, scales before the MMA, persistent pipeline)": None
    }
    variants.update({name: dataclasses.replace(default, **f) for name, f in steps.items()})
    return variants


def wgrad_stage_spot_variants() -> dict[str, GroupedWgradConfig]:
    """name -> the MoE block-FP8 wgrad config at 2 to 5 stages, the scales loaded after the
    wgmma is issued (stop 53's 3 stages first: the slow spot was found against it), then each
    with its scales loaded before (4 stages so is the default since stop 57); all with a
    pipeline per tile, as stops 53-57 timed them."""
    default = dataclasses.replace(DEFAULT_FP8_BLOCK_WGRAD_CONFIG, **PER_TILE)
    variants = {}
    for stages in (3, 2, 4, 5):
        variants[f"{stages} stages"] = dataclasses.replace(
            default, max_concurrent_steps=stages, block_scales_before_mma=False
        )
    for stages in (2, 3, 4, 5):
        variants[f"{stages} stages, scales before the MMA"] = dataclasses.replace(
            default, max_concurrent_steps=stages, **SCALES_FIRST
        )
    return variants


def wgrad_persistent_variants(
    default: GroupedWgradConfig, sizes: tuple[int, int, int], block_scaled: bool
) -> dict[str, GroupedWgradConfig]:
    """label -> config: a wgrad default (first), it with a pipeline per tile (the defaults
    until stop 58), and its neighbours with the persistent pipeline: one stage fewer (with
    either epilogue buffer count), one more (one buffer), the other buffer count, the other
    grid order. Each is fitted to the shared memory as the entry points fit their defaults;
    configs that fit to the same one are timed once."""
    other_buffers = 3 - default.epilogue_buffers  # 1 <-> 2
    fewer = default.max_concurrent_steps - 1
    changes = [
        {},
        PER_TILE,
        dict(max_concurrent_steps=fewer),
        # (For bf16 this is stop 58's default: 3 stages, 2 buffers.)
        dict(max_concurrent_steps=fewer, epilogue_buffers=other_buffers),
        dict(max_concurrent_steps=default.max_concurrent_steps + 1, epilogue_buffers=1),
        dict(epilogue_buffers=other_buffers),
        dict(grid_minor_dim=1 - default.grid_minor_dim),
    ]
    variants: dict[str, GroupedWgradConfig] = {}
    for change in changes:
        config = fit_to_shared_memory(dataclasses.replace(default, **change), sizes, block_scaled)
        label = wgrad_config_label(config) + (" (default)" if not change else "")
        if config not in variants.values():
            variants[label] = config
    return variants


def _grouped_wgrad(lhs, rhs, group_sizes, lhs_block_scale=None, rhs_block_scale=None, **kw):
    """`grouped_matmul_wgrad` with its block scales positional (jit arguments in one tuple)."""
    return grouped_matmul_wgrad(
        lhs,
        rhs,
        group_sizes,
        lhs_block_scale=lhs_block_scale,
        rhs_block_scale=rhs_block_scale,
        **kw,
    )


def wgrad_persistent_cases(run_case, shapes, interpret: bool, tiny: dict | None) -> None:
    """Each wgrad the layers call, float32 out as they call it, under
    `wgrad_persistent_variants` of its default: bf16 token-major (x, dy as stored: the bf16
    layers), bf16 K-major (xᵀ, dyᵀ: MXFP8 / NVFP4's exact values), FP8 K-major (e4m3 x e5m2:
    per-tensor FP8) and block FP8 with 1x128 token-block scales (the MoE layers), on each
    grouped shape; on a one-group shape, block FP8 through the dense layers' entry point.
    XLA's dense FP8 GEMM of the same flops is every case's yardstick. `tiny`: config fields
    for the interpreter."""
    from benchmarks.peers_ab import block_fp8_operands, xla_fp8_nt  # (peers_ab imports us)

    f32 = jnp.float32
    for shape, (g, m, k, n, sizes) in shapes.items():
        lhs8, lhs_scale_k_major, _, _ = block_fp8_operands(k, m, 4, seed=13)
        rhs8, rhs_scale_k_major, _, _ = block_fp8_operands(n, m, 4, seed=14)
        block_scales = (lhs_scale_k_major.T, rhs_scale_k_major.T)  # (K, M/128), (N, M/128)
        # kind -> (default, entry point, its array operands, static keywords); the operands
        # are jit arguments (closed over, they would be compiled in as constants).
        if g == 1:
            kinds = {
                "dense block FP8": (
                    DENSE_FP8_BLOCK_WGRAD_CONFIG,
                    dense_matmul_fp8_block_wgrad,
                    (lhs8, block_scales[0], rhs8, block_scales[1]),
                    {},
                )
            }
        else:
            group_sizes = jnp.asarray(sizes, jnp.int32)
            keys = jax.random.split(jax.random.key(17), 2)
            x = jax.random.normal(keys[0], (m, k), f32)
            dy = jax.random.normal(keys[1], (m, n), f32)
            kinds = {
                "bf16 token-major": (
                    DEFAULT_BF16_WGRAD_CONFIG,
                    _grouped_wgrad,
                    (x.astype(BF16), dy.astype(BF16), group_sizes),
                    dict(token_major=True),
                ),
                "bf16 K-major": (
                    DEFAULT_BF16_WGRAD_CONFIG,
                    _grouped_wgrad,
                    (x.T.astype(BF16), dy.T.astype(BF16), group_sizes),
                    {},
                ),
                "FP8 K-major": (
                    default_wgrad_config(True, False, m, g),
                    _grouped_wgrad,
                    (x.T.astype(E4M3), dy.T.astype(jnp.float8_e5m2), group_sizes),
                    {},
                ),
                "block FP8": (
                    DEFAULT_FP8_BLOCK_WGRAD_CONFIG,
                    _grouped_wgrad,
                    (lhs8, rhs8, group_sizes, *block_scales),
                    {},
                ),
            }
            del x, dy
        for kind, (default, entry, args, keywords) in kinds.items():
            default = dataclasses.replace(default, **tiny) if tiny else default
            lhs, rhs = (args[0], args[2]) if g == 1 else args[:2]  # (dense: scales between)
            itemsizes = (lhs.dtype.itemsize, rhs.dtype.itemsize, 4)
            variants = wgrad_persistent_variants(default, itemsizes, "block" in kind)
            if tiny:  # the default and its per-tile pipeline: interpreted calls cost CI time
                variants = dict(list(variants.items())[:2])
            candidates = {
                label: (
                    jax.jit(
                        lambda *a, c=config, entry=entry, kw=keywords: entry(
                            *a, out_dtype=f32, config=c, interpret=interpret, **kw
                        )
                    ),
                    [args],
                )
                for label, config in variants.items()
            }
            candidates["XLA dense FP8"] = (xla_fp8_nt, [(lhs8, rhs8)])
            run_case(f"{shape} wgrad {kind}", 2 * m * k * n, candidates)
            del candidates, args


# (case, G, M, K, N, group sizes) of `--variants fp8_wgrad_depth`: issue 5's 16384 x 4096 x
# 4096 with 2048 down to 256 tokens a group, and G64 small experts (512 tokens, K 2048, N 1408).
FP8_WGRAD_DEPTH_SHAPES = {
    "G8, 2048 tokens a group": (8, 16384, 4096, 4096, [2048] * 8),
    "G16, 1024 tokens a group": (16, 16384, 4096, 4096, [1024] * 16),
    "G32, 512 tokens a group": (32, 16384, 4096, 4096, [512] * 32),
    "G64, 256 tokens a group": (64, 16384, 4096, 4096, [256] * 64),
    "G64 small experts": bench_grouped_matmul.SHAPES["G64 small experts"],
}


def fp8_wgrad_depth_variants() -> dict[str, GroupedWgradConfig]:
    """label -> config: the per-tensor FP8 wgrad at 3 stages (one epilogue buffer) and at 4
    (stops 58-59: +3% at G8, -18% at G64 small experts), the same bits; since stop 60 the
    default is 4 from 1024 tokens a group, 3 below (`default_wgrad_config`). (Steps of 64
    tokens would sum in another order: not the same bits.)"""
    return {"3 stages": DEFAULT_FP8_WGRAD_CONFIG, "4 stages": DEEP_FP8_WGRAD_CONFIG}


def fp8_wgrad_depth_cases(run_case, shapes, interpret: bool, tiny: dict | None) -> None:
    """The per-tensor FP8 wgrad (e4m3 xᵀ by e5m2 dyᵀ, K-major, float32 out, as the layers call
    it) under `fp8_wgrad_depth_variants` on each shape: does the depth that wins depend on
    the tokens a group (the steps of a tile), or on K and N? XLA's dense FP8 GEMM of the same
    flops is the yardstick. `tiny`: config fields for the interpreter."""
    from benchmarks.peers_ab import xla_fp8_nt  # (peers_ab imports us)

    for shape, (_, m, k, n, sizes) in shapes.items():
        keys = jax.random.split(jax.random.key(19), 2)
        lhs = jax.random.normal(keys[0], (k, m), jnp.float32).astype(E4M3)
        rhs = jax.random.normal(keys[1], (n, m), jnp.float32).astype(jnp.float8_e5m2)
        args = (lhs, rhs, jnp.asarray(sizes, jnp.int32))
        candidates = {}
        for label, config in fp8_wgrad_depth_variants().items():
            config = dataclasses.replace(config, **tiny) if tiny else config
            candidates[label] = (
                jax.jit(
                    lambda a, b, s, c=config: grouped_matmul_wgrad(
                        a, b, s, out_dtype=jnp.float32, config=c, interpret=interpret
                    )
                ),
                [args],
            )
        candidates["XLA dense FP8"] = (xla_fp8_nt, [(lhs, rhs.astype(E4M3))])
        run_case(f"{shape} wgrad FP8 K-major", 2 * m * k * n, candidates)
        del candidates, args


# (case, G, M, K, N, group sizes) of `--variants wgrad_stage_spot`: token steps a tile that 4
# (and 2) divide, and one more step, at G8 and in one group.
WGRAD_STAGE_SPOT_SHAPES = {
    "G8, 16 steps a tile": (8, 16384, 4096, 4096, [2048] * 8),
    "G8, 17 steps a tile": (8, 17408, 4096, 4096, [2176] * 8),
    "one group, 64 steps a tile": (1, 8192, 8192, 8192, [8192]),
    "one group, 65 steps a tile": (1, 8320, 8192, 8192, [8320]),
}


def fp8_block_wgrad_cases(
    run_case,
    shapes,
    interpret: bool,
    tiny: dict | None,
    variants: dict[str, GroupedWgradConfig] | None = None,
) -> None:
    """Block FP8's MoE wgrad variants on each shape (`tiny`: config fields for the
    interpreter): dW[g] = x_gᵀ dy_g from the columnwise copies (K, M) and (N, M) with their
    1x128 token-block scales, as the layer calls the kernel (bfloat16 out), under `variants`
    (default: `fp8_block_wgrad_variants`). Without `variants`, a one-group shape is the dense
    layers' wgrad: `dense_fp8_block_wgrad_variants` through the dense entry point, float32
    out, as the dense layers call it."""
    from benchmarks.peers_ab import block_fp8_operands, xla_fp8_nt  # (peers_ab imports us)

    for shape, (g, m, k, n, sizes) in shapes.items():
        lhs8, lhs_scale_k_major, _, _ = block_fp8_operands(k, m, 4, seed=13)
        rhs8, rhs_scale_k_major, _, _ = block_fp8_operands(n, m, 4, seed=14)
        candidates = {}
        if g == 1 and variants is None:
            args = (lhs8, lhs_scale_k_major.T, rhs8, rhs_scale_k_major.T)
            for name, config in dense_fp8_block_wgrad_variants().items():
                if tiny:  # (None: the entry point's pick)
                    config = dataclasses.replace(config or DENSE_FP8_BLOCK_WGRAD_CONFIG, **tiny)
                if config is not None:  # fitted as the entry point fits its own
                    config = fit_to_shared_memory(config, (1, 1, 4), block_scaled=True)
                candidates[name] = (
                    jax.jit(
                        lambda a, sa, b, sb, c=config: dense_matmul_fp8_block_wgrad(
                            a, sa, b, sb, out_dtype=jnp.float32, config=c, interpret=interpret
                        )
                    ),
                    [args],
                )
            shape = f"{shape}, f32 out"
        else:
            args = (lhs8, lhs_scale_k_major.T, rhs8, rhs_scale_k_major.T, jnp.asarray(sizes))
            for name, config in (variants or fp8_block_wgrad_variants()).items():
                config = dataclasses.replace(config, **tiny) if tiny else config
                candidates[name] = (
                    jax.jit(
                        lambda a, sa, b, sb, s, c=config: grouped_matmul_wgrad(
                            a,
                            b,
                            s,
                            lhs_block_scale=sa,
                            rhs_block_scale=sb,
                            out_dtype=jnp.bfloat16,
                            config=c,
                            interpret=interpret,
                        )
                    ),
                    [args],
                )
        # (K, M) · (N, M)ᵀ over the tokens: the same flops without block scales.
        candidates["XLA dense FP8"] = (xla_fp8_nt, [(lhs8, rhs8)])
        run_case(f"{shape} wgrad block FP8", 2 * m * k * n, candidates)
        del candidates, args


def dense_fp8_block_variants(
    k: int, rhs_block_rows: int, small: bool
) -> dict[str, GroupedMatmulConfig]:
    """name -> config of `dense_matmul_fp8_block(..., rhs_block_rows=rhs_block_rows)` for
    contraction size `k`: the entry point's own pick first, then one change each (a variant
    that does not fit shared memory is reported by `run_case`, not timed). `small`: the
    interpreter's tiny two-consumer tile and its stage counts only."""
    blocks = dict(rhs_block_rows=rhs_block_rows)
    default = fp8_block_default_config(
        k, jnp.bfloat16, persistent_pipeline=True, stream_lhs_scales=True, **blocks
    )
    if small:
        default = dataclasses.replace(
            TWO_CONSUMER_FP8_BLOCK_CONFIG, tile_m=64, tile_n=128, num_sms=2, grid_tile_width=1
        )
    variants = {f"default ({default.max_concurrent_steps} stages)": default}
    for steps in (2, 3, 4, 5):
        if steps != default.max_concurrent_steps:
            # The persistent pipeline needs whole rounds of stages over the K steps.
            persistent = default.persistent_pipeline and (k // 128) % steps == 0
            variants[f"{steps} stages"] = dataclasses.replace(
                default, max_concurrent_steps=steps, persistent_pipeline=persistent
            )
    if small:
        return variants
    variants["no persistent pipeline"] = dataclasses.replace(default, persistent_pipeline=False)
    variants["scales before the MMA"] = dataclasses.replace(default, block_scales_before_mma=True)
    variants["lhs scales prefetched per tile"] = fp8_block_default_config(
        k, jnp.bfloat16, persistent_pipeline=True, **blocks
    )
    variants["two consumers (64 x (2 x 128))"] = fp8_block_default_config(
        k, jnp.bfloat16, persistent_pipeline=True, num_consumers=2, **blocks
    )
    return variants


def dense_fp8_block_cases(run_case, size: int, small: bool) -> None:
    """The dense block-FP8 variants on size³ operands, lhs (M, K) FP8 with 1x128 scales: the
    forward (rhs (N, K) in 128x128 blocks) and the layers' wgrad (rhs in 1x128 blocks along
    K: the tokens of a layer's two columnwise copies)."""
    from benchmarks.peers_ab import block_fp8_operands, xla_fp8_nt  # (peers_ab imports us)

    lhs8, lhs_scale_k_major, rhs8, weight_scale = block_fp8_operands(size, size, size)
    token_scale = block_fp8_operands(size, size, 4, seed=12)[1].T  # (N, K/128)
    for case, rhs_block_rows, rhs_scale in (
        ("fwd", 128, weight_scale),
        ("wgrad", 1, token_scale),
    ):
        args = (lhs8, lhs_scale_k_major, rhs8, rhs_scale)
        candidates = {}
        for name, config in dense_fp8_block_variants(size, rhs_block_rows, small).items():
            candidates[name] = (
                jax.jit(
                    lambda a, sa, b, sb, c=config, r=rhs_block_rows: dense_matmul_fp8_block(
                        a,
                        sa,
                        b,
                        sb,
                        config=c,
                        interpret=small,
                        lhs_scale_k_major=True,
                        rhs_block_rows=r,
                    )
                ),
                [args],
            )
        if case == "wgrad":
            # The MoE wgrad kernel on one group of every token under the dense entry point's
            # default (the layers' path since stop 54): the same chunk-by-chunk promotion
            # (both give cuBLASLt's bits), on its own 128 x (2 x 64) tiles.
            tiny = dict(num_sms=2, grid_tile_width=1)
            wgrad_config = (
                dataclasses.replace(DENSE_FP8_BLOCK_WGRAD_CONFIG, **tiny) if small else None
            )
            candidates["MoE wgrad kernel, one group"] = (
                jax.jit(
                    lambda a, sa, b, sb, c=wgrad_config: dense_matmul_fp8_block_wgrad(
                        a, sa, b, sb, config=c, interpret=small
                    )
                ),
                [(lhs8, lhs_scale_k_major.T, rhs8, rhs_scale)],
            )
        candidates["XLA dense FP8"] = (xla_fp8_nt, [(lhs8, rhs8)])
        run_case(f"dense {size}^3 {case} block FP8", 2 * size**3, candidates)


def weights_in_registers_variants(small: bool) -> dict[str, dict]:
    """name -> (format, out dtype, kernel keywords) of the `weights_in_registers` set; the
    first of each (format, out dtype) is the kernel's default, which the others' bits are
    checked against. Every decode is named explicitly (stop 47 made byte_permute the default)."""
    default = DEFAULT_MXFP8_WEIGHTS_CONFIG
    if small:  # 64-token tiles in the interpreter
        default = dataclasses.replace(
            default, tile_m=64, max_concurrent_steps=2, num_sms=2, grid_tile_width=1
        )
    # float32 outputs: the default (and the library's) takes 256-token tiles with two stages.
    tall_f32 = dataclasses.replace(default, max_concurrent_steps=2)
    short_f32 = dataclasses.replace(default, tile_m=min(128, default.tile_m))
    # Two K steps a stage (stop 48): what fits in shared memory, two stages of 256 tokens
    # (bf16 out) or three of 128 (f32 out).
    two_steps = dataclasses.replace(default, tile_k=128, max_concurrent_steps=2)
    two_steps_f32 = dataclasses.replace(short_f32, tile_k=128, max_concurrent_steps=3)
    if small:
        two_steps_f32 = dataclasses.replace(two_steps_f32, max_concurrent_steps=2)
    f32 = jnp.float32

    def mxfp8(out, config, wgmma_k=64):
        return ("mxfp8", out, dict(config=config, wgmma_k=wgmma_k))

    def nvfp4(out, config, e2m1_decode="byte_permute"):
        return ("nvfp4", out, dict(config=config, e2m1_decode=e2m1_decode))

    return {
        "mxfp8 bf16 out, wgmma per 64-wide step (default)": mxfp8(BF16, default),
        "mxfp8 bf16 out, wgmma per MX block": mxfp8(BF16, default, wgmma_k=32),
        "mxfp8 bf16 out, two K steps a stage, 2 stages": mxfp8(BF16, two_steps),
        "mxfp8 f32 out, 256 tokens, 2 stages (default, library)": mxfp8(f32, tall_f32),
        "mxfp8 f32 out, 128 tokens, 4 stages": mxfp8(f32, short_f32),
        "mxfp8 f32 out, 128 tokens, two K steps a stage, 3 stages": mxfp8(f32, two_steps_f32),
        "nvfp4 bf16 out, byte-permute decode (default)": nvfp4(BF16, default),
        "nvfp4 bf16 out, float32 decode": nvfp4(BF16, default, e2m1_decode="float32"),
        "nvfp4 bf16 out, byte-permute decode, two K steps a stage, 2 stages": nvfp4(
            BF16, two_steps
        ),
        "nvfp4 f32 out, byte-permute decode, 256 tokens, 2 stages (default, library)": nvfp4(
            f32, tall_f32
        ),
        "nvfp4 f32 out, byte-permute decode, 128 tokens, 4 stages": nvfp4(f32, short_f32),
        "nvfp4 f32 out, byte-permute decode, 128 tokens, two K steps a stage, 3 stages": nvfp4(
            f32, two_steps_f32
        ),
    }


def weights_cases(run_case, shapes, small: bool) -> None:
    """`weights_in_registers`: each (format, out dtype) group of
    `weights_in_registers_variants` on G8 balanced, XLA's dense bf16 GEMM as the yardstick.
    Tokens are bf16 (as the dequantize kernels give them; NVFP4's in its even/odd order),
    weights random codes with scales that keep the sums finite."""
    g, m, k, n, sizes = shapes["G8 balanced"]
    keys = jax.random.split(jax.random.key(13), 4)
    tokens = jax.random.normal(keys[0], (m, k), jnp.float32).astype(BF16)
    sizes = jnp.asarray(sizes, jnp.int32)
    weights = {
        "mxfp8": (
            jax.random.normal(keys[1], (g, n, k), jnp.float32).astype(E4M3),
            jax.random.randint(keys[2], (g, n, k // 32), 120, 135).astype(jnp.uint8),
        ),
        "nvfp4": (
            jax.random.randint(keys[1], (g, n, k // 2), 0, 256).astype(jnp.uint8),
            jnp.exp2(
                jax.random.randint(keys[3], (g, n, k // 16), -3, 4).astype(jnp.float32)
            ).astype(E4M3),
        ),
    }
    kernels = {
        "mxfp8": grouped_matmul_mxfp8_weights,
        "nvfp4": functools.partial(grouped_matmul_nvfp4_weights, lhs_order="even_odd"),
    }
    dense = (tokens, jax.random.normal(keys[3], (n, k), jnp.float32).astype(BF16))
    groups: dict[tuple, dict] = {}
    for name, (fmt, out_dtype, keywords) in weights_in_registers_variants(small).items():
        call = functools.partial(kernels[fmt], out_dtype=out_dtype, interpret=small, **keywords)
        groups.setdefault((fmt, out_dtype), {})[name] = (
            jax.jit(lambda a, b, sb, s, call=call: call(a, b, sb, s)),
            [(tokens, *weights[fmt], sizes)],
        )
    # Ablation (wrong outputs, by design): NVFP4 with the decode replaced by a constant, so
    # the packed bytes' loads and conversion go (the scales' loads and multiply stay). How
    # fast the structure alone runs (register operands, no wgmma in flight, the transposed
    # epilogue) tells whether the conversion or the structure is what stop 47's H100 run
    # measured as slow. Compiled under the patch; not compared bit for bit.
    ablation = "nvfp4 bf16 out, ABLATION: no decode (constant weights)"
    args = (tokens, *weights["nvfp4"], sizes)
    with unittest.mock.patch.object(
        mx_weights,
        "_e2m1_as_bf16_by_permutes",
        lambda packed, nibble, interpreting: jnp.full(packed.shape, 0.5, BF16),
    ):
        default = weights_in_registers_variants(small)[
            "nvfp4 bf16 out, byte-permute decode (default)"
        ]
        call = functools.partial(kernels["nvfp4"], out_dtype=BF16, interpret=small, **default[2])
        compiled = jax.jit(lambda a, b, sb, s: call(a, b, sb, s)).lower(*args).compile()
    groups[("nvfp4", BF16)][ablation] = (compiled, [args])
    for (fmt, out_dtype), candidates in groups.items():
        candidates["XLA dense bf16"] = (jax.jit(lambda a, b: a @ b.T), [dense])
        out_name = jnp.dtype(out_dtype).name
        compare = [name for name in candidates if "ABLATION" not in name and "XLA" not in name]
        run_case(
            f"G8 balanced fwd {fmt} in registers, {out_name} out",
            2 * m * k * n,
            candidates,
            compare=compare,
        )


def main(
    out_dir: str | None = None,
    small: bool = False,
    rounds: int = 15,
    variants: str = "epilogue",
    dense_only: bool = False,
) -> str:
    if variants not in VARIANT_SETS:
        raise ValueError(f"variants must be one of {sorted(VARIANT_SETS)}, got {variants!r}")
    if dense_only and variants != "three_consumers":
        raise ValueError(f"dense_only applies to variants='three_consumers', got {variants!r}")
    variant_configs = VARIANT_SETS[variants]  # None for grouping and wgrad: cases of their own
    shapes, dense_size, interpret = SHAPES, DENSE_SIZE, False
    bf16_config, fp8_config, block_config = BF16_CONFIG, FP8_CONFIG, BLOCK_CONFIG
    if small:
        shapes = {"G8 balanced": (2, 256, 256, 256, [128, 128])}
        dense_size, interpret, rounds = 256, True, 1
        tiny = dict(tile_m=64, tile_n=64, num_sms=2, grid_tile_width=1)
        bf16_config = dataclasses.replace(bf16_config, **tiny)
        fp8_config = dataclasses.replace(fp8_config, **tiny)
        block_config = dataclasses.replace(block_config, **{**tiny, "tile_n": 128})

    rows = []

    def run_case(case: str, flops: float, candidates: dict, compare=None) -> None:
        # Every variant computes the same sums in the same order: same bits as the first
        # (only the names in `compare`, when given).
        kernels = compare or [name for name in candidates if not name.startswith("XLA")]
        first_outputs = {}
        for name in list(
            candidates
        ):  # a variant that cannot run (e.g. SMEM) is reported, not timed
            try:
                fn, argument_sets = candidates[name]
                first_outputs[name] = jax.block_until_ready(fn(*argument_sets[0]))
            except Exception as e:
                print(f"{case:34s} {name:30s} skipped: {type(e).__name__}: {str(e)[:120]}")
                rows.append(dict(case=case, variant=name, ms=None, tflops=None, same_bits=None))
                del candidates[name]
                kernels = [k for k in kernels if k != name]
        same_bits = same_bits_as_first(candidates, kernels, first_outputs)
        del first_outputs  # (GPU memory for the timing)
        seconds = interleaved_seconds(
            candidates,
            rounds=rounds,
            calls_per_batch=1 if small else 20,
            warmup_seconds=0.0 if small else 1.0,
            compile_first=not small,  # (each ran above; in the interpreter, a call is costly)
        )
        for name, value in seconds.items():
            same = same_bits.get(name)
            rows.append(
                dict(
                    case=case,
                    variant=name,
                    ms=value * 1e3,
                    tflops=flops / value / 1e12,
                    same_bits=same,
                )
            )
            print(f"{case:34s} {name:30s} {value * 1e3:8.3f} ms {flops / value / 1e12:7.1f} {same}")

    if variants == "grouping":
        grouping_cases(run_case, shapes, bf16_config, fp8_config, interpret)
        shapes, dense_size = {}, 0
    if variants == "cluster_m":
        tiny_dense = dict(num_sms=2, grid_tile_width=1) if small else None
        cluster_m_cases(run_case, 256 if small else DENSE_SIZE, interpret, tiny_dense)
        return _report(out_dir, variants, rows, rounds)
    if variants == "three_consumers":
        if small:
            raise ValueError(
                "variants='three_consumers' runs on the GPU only (192-row tiles; the kernel "
                "tests cover them in the interpreter)"
            )
        grouped = (
            {}
            if dense_only
            else {
                "G8 balanced": shapes["G8 balanced"],
                # 512 rows a group: below MIN_ROWS_PER_GROUP_THREE_CONSUMERS (stop 43's model).
                "G64 small experts": bench_grouped_matmul.SHAPES["G64 small experts"],
            }
        )
        three_consumer_cases(run_case, grouped, DENSE_SIZE)
        return _report(out_dir, variants, rows, rounds)
    if variants == "weights_in_registers":
        if small:
            shapes = {"G8 balanced": (2, 256, 128, 128, [100, 156])}
        weights_cases(run_case, shapes, small)
        return _report(out_dir, variants, rows, rounds)
    if variants == "dense_fp8_block_stages":
        dense_fp8_block_cases(run_case, 256 if small else DENSE_SIZE, small)
        return _report(out_dir, variants, rows, rounds)
    if variants == "fp8_block_wgrad":
        tiny_block = None
        # The dense layers' wgrad is the one-group case (since stop 54): 8192³.
        one_group = (1, DENSE_SIZE, DENSE_SIZE, DENSE_SIZE, [DENSE_SIZE])
        # G64's tiles have 4 token steps each: where a pipeline restarted per tile costs most.
        shapes = {
            "G8 balanced": shapes["G8 balanced"],
            "G64 small experts": bench_grouped_matmul.SHAPES["G64 small experts"],
            "dense, one group": one_group,
        }
        if small:  # 128-token groups, 128 x 128 CTA tiles
            shapes = {
                "G8 balanced": (2, 256, 128, 128, [128, 128]),
                "dense, one group": (1, 256, 128, 128, [256]),
            }
            tiny_block = dict(num_sms=2, grid_tile_width=1)
        fp8_block_wgrad_cases(run_case, shapes, interpret, tiny_block)
        return _report(out_dir, variants, rows, rounds)
    if variants == "wgrad_persistent":
        tiny_wgrad = None
        shapes = {
            "G8 balanced": shapes["G8 balanced"],
            "G64 small experts": bench_grouped_matmul.SHAPES["G64 small experts"],
            "dense, one group": (1, DENSE_SIZE, DENSE_SIZE, DENSE_SIZE, [DENSE_SIZE]),
        }
        if small:  # 128-token groups (block FP8's scale blocks), 128 x 128 CTA tiles
            shapes = {
                "G8 balanced": (2, 256, 128, 128, [128, 128]),
                "dense, one group": (1, 256, 128, 128, [256]),
            }
            tiny_wgrad = dict(tile_n=64, num_sms=2, grid_tile_width=1)
        wgrad_persistent_cases(run_case, shapes, interpret, tiny_wgrad)
        return _report(out_dir, variants, rows, rounds)
    if variants == "fp8_wgrad_depth":
        depth_shapes, tiny_depth = FP8_WGRAD_DEPTH_SHAPES, None
        if small:  # 1 and 2 steps of 128 tokens a group (2 and 4 of 64)
            depth_shapes = {
                "G2, 128 tokens a group": (2, 256, 128, 128, [128, 128]),
                "one group of 256 tokens": (1, 256, 128, 128, [256]),
            }
            tiny_depth = dict(tile_n=64, num_sms=2, grid_tile_width=1)
        fp8_wgrad_depth_cases(run_case, depth_shapes, interpret, tiny_depth)
        return _report(out_dir, variants, rows, rounds)
    if variants == "wgrad_stage_spot":
        spot_shapes, tiny_block = WGRAD_STAGE_SPOT_SHAPES, None
        if small:  # 1 and 2 token steps a group (128-token tiles)
            spot_shapes = {
                "G2, 1 step a tile": (2, 256, 128, 128, [128, 128]),
                "one group, 2 steps a tile": (1, 256, 128, 128, [256]),
            }
            tiny_block = dict(num_sms=2, grid_tile_width=1)
        fp8_block_wgrad_cases(
            run_case, spot_shapes, interpret, tiny_block, wgrad_stage_spot_variants()
        )
        return _report(out_dir, variants, rows, rounds)
    if variants == "wgrad":
        tiny_wgrad = None
        # (G64: 8 token steps a tile, where the persistent pipeline should show most.)
        shapes = {**shapes, "G64 small experts": bench_grouped_matmul.SHAPES["G64 small experts"]}
        if small:  # 128 x 128 CTA tiles, 2 per group: interpreter time grows with the grid
            shapes = {"G8 balanced": (2, 256, 256, 128, [128, 128])}
            tiny_wgrad = dict(tile_n=64, num_sms=2, grid_tile_width=1)
        wgrad_cases(run_case, shapes, interpret, tiny_wgrad)
        shapes, dense_size = {}, 0
    single_shape = ("defaults", "block_tiles", "stagger", "wide_tiles", "consumer_split")
    if variants in single_shape or variants == "wide_three_consumers":
        shapes = {"G8 balanced": shapes["G8 balanced"]}
        if not small:
            bf16_config, fp8_config = DEFAULT_BF16_CONFIG, DEFAULT_FP8_CONFIG
            # block_tiles and stagger vary the two-consumer tile (the default until stop 43).
            consumers = 2 if variants in ("block_tiles", "stagger") else 3
            block_config = fp8_block_default_config(
                DENSE_SIZE, jnp.bfloat16, num_consumers=consumers
            )
    if variants == "stream_k" and not small:  # both shapes, the defaults
        bf16_config, fp8_config = DEFAULT_BF16_CONFIG, DEFAULT_FP8_CONFIG
        block_config = fp8_block_default_config(DENSE_SIZE, jnp.bfloat16)
    block_only = variants in ("block_tiles", "stagger")

    def block_variants(k: int) -> dict[str, GroupedMatmulConfig]:
        if block_only:
            return variant_configs(block_config, k)
        if variants == "stream_k":
            return {
                "default": block_config,
                "stream-K": dataclasses.replace(block_config, stream_k=True),
            }
        if variants in ("wide_tiles", "consumer_split", "wide_three_consumers"):
            # a yardstick of the run's clocks
            return {"default": block_config}
        return variant_configs(block_config)

    def run_block_case(shape, g, m, k, n, flops, sets, xla_dense) -> None:
        block_sets = [
            (
                x["lhs8"],
                jnp.ones((m, k // 128), jnp.float32),
                x["rhs8"],
                jnp.ones((g, n // 128, k // 128), jnp.float32),
                x["sizes"],
            )
            for x in sets
        ]
        candidates = {
            f"fp8 block {name}": (
                jax.jit(
                    lambda a, sa, b, sb, s, c=c: grouped_matmul_fp8_block(
                        a, sa, b, sb, s, config=c, interpret=interpret
                    )
                ),
                block_sets,
            )
            for name, c in block_variants(k).items()
        }
        run_case(f"{shape} fwd fp8 block", flops, {**candidates, "XLA dense bf16": xla_dense})

    for shape, (g, m, k, n, sizes) in shapes.items():
        flops = 2 * m * k * n
        sets = random_operands(jax.random.key(7), g, m, k, n, sizes)
        xla_dense = xla_dense_yardstick(sets)
        if block_only:
            run_block_case(shape, g, m, k, n, flops, sets, xla_dense)
            del sets, xla_dense
            continue
        candidates = {
            f"bf16 {name}": (
                jax.jit(
                    lambda a, b, s, c=c: grouped_matmul(a, b, s, config=c, interpret=interpret)
                ),
                [(x["lhs"], x["rhs"], x["sizes"]) for x in sets],
            )
            for name, c in variant_configs(bf16_config).items()
        }
        run_case(f"{shape} fwd bf16", flops, {**candidates, "XLA dense bf16": xla_dense})
        if small:
            # The smoke run stops at bf16 and the dense block-FP8 GEMM below: the FP8 kernels'
            # schedules are the kernel tests' business, and each interpreted variant costs CI
            # time (this test took ~3 minutes on two cores with them).
            continue
        candidates = {
            f"fp8 rowwise {name}": (
                jax.jit(
                    lambda a, b, s, sa, sb, c=c: grouped_matmul(
                        a, b, s, lhs_scale=sa, rhs_scale=sb, config=c, interpret=interpret
                    )
                ),
                [
                    (x["lhs8"], x["rhs8"], x["sizes"], x["lhs_row_scale"], x["rhs_col_scale"])
                    for x in sets
                ],
            )
            for name, c in variant_configs(fp8_config).items()
        }
        run_case(f"{shape} fwd fp8 rowwise", flops, {**candidates, "XLA dense bf16": xla_dense})
        run_block_case(shape, g, m, k, n, flops, sets, xla_dense)
        del sets, candidates, xla_dense

    size = dense_size
    if not size:  # the grouping and wgrad cases have no dense block-FP8 part
        return _report(out_dir, variants, rows, rounds)
    keys = jax.random.split(jax.random.key(8), 2)
    a8 = jax.random.normal(keys[0], (size, size), jnp.float32).astype(E4M3)
    b8 = jax.random.normal(keys[1], (size, size), jnp.float32).astype(E4M3)
    a_scale = jnp.ones((size, size // 128), jnp.float32)
    b_scale = jnp.ones((size // 128, size // 128), jnp.float32)
    a16, b16 = a8.astype(jnp.bfloat16), b8.astype(jnp.bfloat16)
    candidates = {
        f"fp8 block {name}": (
            jax.jit(
                lambda a, sa, b, sb, c=c: dense_matmul_fp8_block(
                    a, sa, b, sb, config=c, interpret=interpret
                )
            ),
            [(a8, a_scale, b8, b_scale)],
        )
        for name, c in block_variants(size).items()
    }
    candidates["XLA dense bf16"] = (jax.jit(lambda a, b: a @ b.T), [(a16, b16)])
    run_case(f"dense {size}^3", 2 * size**3, candidates)
    return _report(out_dir, variants, rows, rounds)


def _report(out_dir, variants: str, rows: list[dict], rounds: int) -> str:
    lines = [
        f"Device: {device_description()}; {rounds} alternating rounds per case.",
        "",
        "| case | variant | ms | TFLOP/s | same bits as the first |",
        "|---|---|---:|---:|---|",
        *(
            f"| {r['case']} | {r['variant']} | "
            + (f"{r['ms']:.3f} | {r['tflops']:.0f} | " if r["ms"] else "did not run | | ")
            + f"{'' if r['same_bits'] is None else ('yes' if r['same_bits'] else '**NO**')} |"
            for r in rows
        ),
    ]
    return report(out_dir, f"grouped_ab_{variants}", rows, "\n".join(lines) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--variants", default="epilogue", choices=sorted(VARIANT_SETS))
    parser.add_argument(
        "--dense-only", action="store_true", help="three_consumers: the dense 8192³ case only"
    )
    args = parser.parse_args()
    main(args.out, small=args.small, variants=args.variants, dense_only=args.dense_only)
