"""`jax_qtrain.sharding` on real GPUs (`python3 -m pytest -m gpu` on a host with 2 or more GPUs:
the device tool's `nvidia-h200-x2`; skipped with a reason on one GPU).

The CPU suite runs the split kernels on 8 virtual devices, where a collective is a memory copy.
Here the same code runs over NCCL with XLA:GPU's GEMMs and fusions, on as many devices as the
host has (a power of two that divides the CPU tests' 4 devices). The data are the CPU tests'
integers, whose every float32 sum is exact (sharding_helpers.py), so the sharded results must
still equal the unsharded ones bit for bit: another summation order changes no bit, and a wrong
amax scope, gather or reduce-scatter changes many.
"""

import jax
import pytest

import jax_qtrain as jq
from jax_qtrain import sharding as jqs
from tests.jax_qtrain import test_sharding_grouped
from tests.jax_qtrain.sharding_helpers import (
    RECIPES,
    assert_bits_equal,
    layer_data,
    mesh_1d,
    value_and_grads,
)
from tests.jax_qtrain.test_sharding import SHAPES

GPUS = sum(d.platform == "gpu" for d in jax.devices())

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 2, reason=f"needs 2 or more GPUs, this host has {GPUS}"),
]


@pytest.fixture
def gpu_devices(monkeypatch):
    """The number of devices the test meshes use: every GPU of the host (2 or 4)."""
    devices = 4 if GPUS >= 4 else 2
    monkeypatch.setattr(test_sharding_grouped, "DEVICES", devices)
    return devices


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("strategy", jqs.STRATEGIES)
@pytest.mark.parametrize("kernel_dim", [0, 1])
def test_sharded_dense_over_gpus_equals_unsharded(gpu_devices, name, strategy, kernel_dim):
    recipe = RECIPES[name]
    tokens, in_features, out_features = SHAPES[name]
    x, kernel, bias, dy = layer_data(name, (tokens, in_features), out_features)
    expected = value_and_grads(
        lambda x, k, b: jq.dense(x, k, b, recipe=recipe), x, kernel, bias, dy
    )
    sharding = jqs.WeightSharding(
        mesh_1d(gpu_devices), "fsdp", kernel_dim=kernel_dim, strategy=strategy
    )
    sharded = value_and_grads(
        lambda x, k, b: jqs.dense(x, k, b, sharding=sharding, recipe=recipe),
        sharding.shard_batch(x),
        sharding.shard_kernel(kernel),
        bias,
        dy,
    )
    assert_bits_equal(sharded, expected, f"{name} {strategy} kernel_dim {kernel_dim}")


@pytest.mark.parametrize(
    "name, mode, kernel_dim, strategy", test_sharding_grouped.GROUPED_DENSE_CASES
)
def test_fsdp_grouped_dense_over_gpus(gpu_devices, name, mode, kernel_dim, strategy):
    test_sharding_grouped.test_fsdp_grouped_dense_is_the_unsharded_op_per_device(
        name, mode, kernel_dim, strategy
    )


@pytest.mark.parametrize(
    "name, mode, kernel_dim, strategy", test_sharding_grouped.GROUPED_MLP_CASES
)
def test_fsdp_grouped_mlp_over_gpus(gpu_devices, name, mode, kernel_dim, strategy):
    test_sharding_grouped.test_fsdp_grouped_mlp_is_the_unsharded_op_per_device(
        name, mode, kernel_dim, strategy
    )


def test_sharded_moe_over_gpus(gpu_devices):
    test_sharding_grouped.test_sharded_moe_is_the_unsharded_moe_per_device()


@pytest.mark.parametrize("name, kernel_dim, features", test_sharding_grouped.KEPT_EXPERT_CASES)
def test_sharded_moe_with_kept_experts_over_gpus(gpu_devices, name, kernel_dim, features):
    test_sharding_grouped.test_sharded_moe_with_kept_experts_trains_like_the_plain_one(
        name, kernel_dim, features
    )


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_expert_parallel_moe_with_kept_experts_over_gpus(gpu_devices, name):
    test_sharding_grouped.test_expert_parallel_moe_with_kept_experts_trains_like_the_plain_one(name)
