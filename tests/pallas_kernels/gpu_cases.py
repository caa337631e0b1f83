"""Shapes and configs of the grouped-matmul `gpu` tests that the CPU tests also lower for the
H200 (test_grouped_matmul.py), so that a config error shows before a device session. Kept
apart from both test modules, which import it (they would import each other otherwise)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.grouped_matmul_fwd import (
    DEFAULT_BF16_CONFIG,
    DEFAULT_FP8_CONFIG,
    GroupedMatmulConfig,
    fp8_block_default_config,
)

F32 = jnp.float32
ROWS, K_DIM, N_DIM = 1000, 512, 384
SIZES = jnp.asarray([0, 300, 1, 0, 550], jnp.int32)  # 149 tail rows
NUM_GROUPS = 5


# Three consumer warpgroups of 64 rows each (192 x (2 x 64) CTA tiles, or 192 x (2 x 128) for
# bf16 / FP8 rowwise): every output element sums the same products in the same K order (for
# block FP8: the same 128-wide chunks promoted in the same order) as under two consumers'
# tiles, so the bits must match theirs. 1000 rows in 5 uneven groups give tiles whose visits
# cover one, two or three consumers' parts; 4 SMs make each CTA run several tiles
# (persistent: START, STEADY, STOP).
THREE_CONSUMERS = dict(tile_m=192, tile_n=64, consumer_split="m", num_consumers=3)
THREE_CONSUMER_CASES = {
    "bf16": dict(operands="bf16", schedule=dict(max_concurrent_steps=3)),
    "fp8_rowwise": dict(operands="fp8", schedule=dict(max_concurrent_steps=3)),
    "fp8_rowwise_persistent_4_sms": dict(
        operands="fp8",
        schedule=dict(
            max_concurrent_steps=2, wgmma_in_flight=0, persistent_pipeline=True, num_sms=4
        ),
    ),
    # 64 x 256 parts (192 x (2 x 128) tiles): two 128-column wgmmas per consumer and K slice
    # (one m64n256 was refused by ptxas with four warpgroups).
    "bf16_wide_parts": dict(operands="bf16", schedule=dict(tile_n=128, max_concurrent_steps=3)),
    "fp8_rowwise_wide_parts": dict(
        operands="fp8", schedule=dict(tile_n=128, max_concurrent_steps=3)
    ),
    "fp8_rowwise_wide_parts_persistent_4_sms": dict(
        operands="fp8",
        schedule=dict(
            tile_n=128,
            max_concurrent_steps=2,
            wgmma_in_flight=0,
            persistent_pipeline=True,
            num_sms=4,
        ),
    ),
    "fp8_block": dict(operands="fp8_block", schedule=dict(max_concurrent_steps=2)),
    "fp8_block_dense_persistent_4_sms": dict(
        operands="fp8_block_dense",
        schedule=dict(max_concurrent_steps=2, persistent_pipeline=True, num_sms=4),
    ),
    # The lhs scales streamed with the K steps instead of prefetched per tile.
    "fp8_block_streamed_scales": dict(
        operands="fp8_block",
        schedule=dict(max_concurrent_steps=4, epilogue_buffers=1, stream_lhs_scales=True),
    ),
    "fp8_block_dense_streamed_scales_persistent_4_sms": dict(
        operands="fp8_block_dense",
        schedule=dict(
            max_concurrent_steps=4,
            epilogue_buffers=1,
            persistent_pipeline=True,
            stream_lhs_scales=True,
            grid_minor_dim=1,
            num_sms=4,
        ),
    ),
}


def three_consumer_configs(case: str) -> tuple[GroupedMatmulConfig, GroupedMatmulConfig]:
    """(the two-consumer default, its three-consumer variant) of a THREE_CONSUMER_CASES case;
    the configs are also lowered for the H200 on the CPU (test_grouped_matmul.py), so that a
    config error shows before a device session."""
    spec = THREE_CONSUMER_CASES[case]
    operands = spec["operands"]
    if operands.startswith("fp8_block"):
        # Two consumers in 64 x (2 x 128) tiles (the default until stop 43) against three.
        dense = operands == "fp8_block_dense"
        base = fp8_block_default_config(K_DIM, F32, persistent_pipeline=dense, num_consumers=2)
    else:
        # 128-byte rows of float32 output: 32 columns.
        base = DEFAULT_FP8_CONFIG if operands == "fp8" else DEFAULT_BF16_CONFIG
        base = dataclasses.replace(base, epi_tile_n=32)
    return base, dataclasses.replace(base, **(THREE_CONSUMERS | spec["schedule"]))


# Stream-K (GroupedMatmulConfig.stream_k): a shape whose items leave the 132 SMs a part-full
# last round (G4, 6 column tiles of 256, ~39 row visits: one round + ~100 items), so items
# are split between neighbouring CTAs. Small-integer operands make every f32 sum exact: the
# split items must then give the default kernel's bits, and a partial that is not waited
# for, or not added, shows. A second call with other operands checks that the semaphores
# came back to zero and no stale partial is read.
# (N a multiple of 32: the f32 output's 128-byte epilogue rows; the last column tile partial.)
STREAM_K_ROWS, STREAM_K_K, STREAM_K_N = 5000, 1000, 1312
STREAM_K_SIZES = jnp.asarray([1200, 0, 2000, 1337], jnp.int32)  # 463 tail rows
STREAM_K_CASES = {
    "bf16": dict(operands="bf16", schedule=dict()),
    "bf16_persistent": dict(
        operands="bf16", schedule=dict(persistent_pipeline=True, max_concurrent_steps=2)
    ),
    "bf16_three_consumers": dict(
        operands="bf16",
        schedule=dict(tile_m=192, tile_n=128, consumer_split="m", num_consumers=3),
    ),
    "fp8_rowwise": dict(operands="fp8", schedule=dict(wgmma_in_flight=0)),
    # Block FP8's default (three consumers, 192 x (2 x 64)), K a multiple of 128.
    "fp8_block": dict(operands="fp8_block", schedule=dict()),
    "fp8_block_streamed_scales": dict(
        operands="fp8_block",
        schedule=dict(max_concurrent_steps=4, epilogue_buffers=1, stream_lhs_scales=True),
    ),
}
STREAM_K_BLOCK_K = 1024


def stream_k_configs(case: str) -> tuple[GroupedMatmulConfig, GroupedMatmulConfig]:
    """(the default config, its stream-K variant) of a STREAM_K_CASES case (f32 output)."""
    spec = STREAM_K_CASES[case]
    if spec["operands"] == "fp8_block":
        base = fp8_block_default_config(STREAM_K_BLOCK_K, F32)
    else:
        base = DEFAULT_FP8_CONFIG if spec["operands"] == "fp8" else DEFAULT_BF16_CONFIG
        base = dataclasses.replace(base, epi_tile_n=32)  # 128-byte rows of f32 output
    return base, dataclasses.replace(base, **spec["schedule"], stream_k=True)
