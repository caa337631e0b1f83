"""Weights split over a mesh axis (FSDP) on `jax.sharding`: gather, quantize, re-gather in
backward, reduce-scatter the gradient (docs/distributed.md)."""

from jax_qtrain.sharding.config import (
    DEFAULT_STRATEGY,
    EXPERTS,
    GATHER_THEN_QUANTIZE,
    QUANTIZE_THEN_GATHER,
    STRATEGIES,
    Strategy,
    WeightSharding,
)
from jax_qtrain.sharding.expert_parallel import expert_parallel_mlp
from jax_qtrain.sharding.gather import (
    GatherBytes,
    gather_and_quantize,
    gather_bytes,
    gather_quantized,
    gather_raw,
    quantize_shard,
)
from jax_qtrain.sharding.kept_weight import SplitKernelLayout
from jax_qtrain.sharding.layers import ShardedLinear, ShardedMoE
from jax_qtrain.sharding.residuals import DeviceResidual, per_device_saved_residuals
from jax_qtrain.sharding.sharded_dense import dense, fsdp_dense
from jax_qtrain.sharding.sharded_grouped import fsdp_grouped_dense, fsdp_grouped_mlp

__all__ = [
    "DEFAULT_STRATEGY",
    "EXPERTS",
    "GATHER_THEN_QUANTIZE",
    "QUANTIZE_THEN_GATHER",
    "STRATEGIES",
    "DeviceResidual",
    "GatherBytes",
    "ShardedLinear",
    "ShardedMoE",
    "SplitKernelLayout",
    "Strategy",
    "WeightSharding",
    "dense",
    "expert_parallel_mlp",
    "fsdp_dense",
    "fsdp_grouped_dense",
    "fsdp_grouped_mlp",
    "gather_and_quantize",
    "gather_bytes",
    "gather_quantized",
    "gather_raw",
    "per_device_saved_residuals",
    "quantize_shard",
]
