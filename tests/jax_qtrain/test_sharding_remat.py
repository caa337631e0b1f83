"""Split-kernel layers under `jax.checkpoint` policies that save, recompute or offload the named
residuals: gradients bit-identical to the run without a policy; the gathered kernel is never
saved; offloaded residuals live in host memory (XLA:CPU has a "pinned_host" memory kind, so the
policy runs here; on the CPU both memories are host RAM, so this checks placement and results,
not memory savings)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from jax_qtrain import sharding as jqs
from jax_qtrain.ops import (
    FC1_INPUT,
    FC1_KERNEL,
    FC2_INPUT,
    FC2_KERNEL,
    INPUT,
    KERNEL,
    PRE_ACTIVATION,
)
from tests.jax_qtrain.sharding_helpers import (
    RECIPES,
    assert_bits_equal,
    kernel_shapes,
    layer_data,
    mesh_1d,
    quantized_leaf_shapes,
)

POLICIES = {
    "no policy": None,
    "save the input, recompute the kernel copy": jax.checkpoint_policies.save_only_these_names(
        INPUT
    ),
    "recompute everything": jax.checkpoint_policies.nothing_saveable,
    "offload the input, save the kernel": (
        jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[KERNEL],
            names_which_can_be_offloaded=[INPUT],
            offload_src="device",
            offload_dst="pinned_host",
        )
    ),
}
# One recipe per strategy keeps the run short; both strategies see every policy.
CASES = [("nvfp4", "quantize_then_gather"), ("mxfp8", "gather_then_quantize")]


@pytest.mark.parametrize("name, strategy", CASES)
def test_gradients_are_identical_under_every_policy(name, strategy):
    recipe = RECIPES[name]
    sharding = jqs.WeightSharding(mesh_1d(8), "fsdp", strategy=strategy)
    x, kernel, bias, dy = layer_data(name, (128, 256), 128)

    def layer(x, kernel, bias):
        return jqs.dense(x, kernel, bias, sharding=sharding, recipe=recipe)

    results = {}
    for label, policy in POLICIES.items():
        fn = layer if policy is None else jax.checkpoint(layer, policy=policy)

        @jax.jit
        def grads(x, kernel, bias, dy, fn=fn):
            y, vjp = jax.vjp(fn, x, kernel, bias)
            return (y, *vjp(dy))

        results[label] = grads(x, kernel, bias, dy)
    for label, result in results.items():
        assert_bits_equal(result, results["no policy"], label)


def _device_residuals(recipe, strategy, policy):
    rows = 16 if recipe.name == "nvfp4" else 32  # one weight block per device

    def body(x, kernel_shard):
        return jqs.fsdp_dense(x, kernel_shard, axis_name="fsdp", strategy=strategy, recipe=recipe)

    fn = body if policy is None else jax.checkpoint(body, policy=policy)
    args = (
        jax.ShapeDtypeStruct((32, 8 * rows), jnp.bfloat16),
        jax.ShapeDtypeStruct((rows, 64), jnp.bfloat16),
    )
    return rows, jqs.per_device_saved_residuals(fn, mesh_1d(8), *args)


@pytest.mark.parametrize("name, strategy", CASES)
def test_each_policy_saves_what_it_names_and_never_the_gathered_kernel(name, strategy):
    recipe = RECIPES[name]
    bf16 = jnp.dtype(jnp.bfloat16)
    for label, policy in POLICIES.items():
        rows, saved = _device_residuals(recipe, strategy, policy)
        listing = [(r.name, r.shape, r.dtype, r.memory) for r in saved]
        x_copy = quantized_leaf_shapes((32, 8 * rows), recipe, "input", "columnwise")
        kernel_copy = (
            [((rows, 64), bf16)]
            if strategy == "gather_then_quantize"
            else quantized_leaf_shapes((rows, 64), recipe, "weight", "rowwise")
        )
        device = [(r.shape, r.dtype) for r in saved if r.memory == "device"]
        host = [(r.shape, r.dtype) for r in saved if r.memory == "host"]
        if policy is None:
            assert [(r.shape, r.dtype) for r in saved if r.name == INPUT] == x_copy, listing
            assert [(r.shape, r.dtype) for r in saved if r.name == KERNEL] == kernel_copy
        elif label.startswith("save the input"):
            # The input copy is kept; the kernel residual is recomputed from the raw shard,
            # which backward reads as an argument.
            assert [(r.shape, r.dtype) for r in saved if r.name == INPUT] == x_copy, listing
            assert [(r.name, r.shape) for r in saved if r.name != INPUT] == [
                ("from the argument kernel_shard", (rows, 64))
            ], listing
        elif label.startswith("recompute"):
            assert sorted(r.name for r in saved) == [
                "from the argument kernel_shard",
                "from the argument x",
            ], listing
        else:  # offload
            assert sorted(host, key=str) == sorted(x_copy, key=str), listing
            if strategy == "quantize_then_gather":
                assert [(r.shape, r.dtype) for r in saved if r.name == KERNEL] == kernel_copy
            assert sorted(device, key=str) == sorted(kernel_copy, key=str), listing
        whole = kernel_shapes((8 * rows, 64), recipe) - {s for s, _ in x_copy}
        assert not [r for r in saved if r.shape in whole], listing


GROUPED_POLICIES = {
    "no policy": None,
    "save the inputs, recompute the kernel copies": (
        jax.checkpoint_policies.save_only_these_names(FC1_INPUT, PRE_ACTIVATION, FC2_INPUT)
    ),
    "recompute everything": jax.checkpoint_policies.nothing_saveable,
    "offload the inputs, save the kernels": (
        jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[FC1_KERNEL, FC2_KERNEL],
            names_which_can_be_offloaded=[FC1_INPUT, PRE_ACTIVATION, FC2_INPUT],
            offload_src="device",
            offload_dst="pinned_host",
        )
    ),
}


@pytest.mark.parametrize("name, strategy", [("mxfp8", "quantize_then_gather")])
def test_grouped_mlp_gradients_are_identical_under_every_policy(name, strategy):
    """The fused expert MLP with its kernels split by expert over 4 devices: every policy gives
    the bits of the run without one (dx, dprobs and both kernels' gradients)."""
    recipe = RECIPES[name]
    devices, experts, tokens, hidden, ffn = 4, 8, 64, 64, 64
    keys = jax.random.split(jax.random.key(3), 5)
    x = jax.random.normal(keys[0], (devices * tokens, hidden), jnp.bfloat16)
    probs = jax.random.uniform(keys[1], (devices * tokens,), jnp.float32)
    fc1 = jax.random.normal(keys[2], (experts, hidden, 2 * ffn), jnp.float32) * 0.1
    fc2 = jax.random.normal(keys[3], (experts, ffn, hidden), jnp.float32) * 0.1
    dy = jax.random.normal(keys[4], (devices * tokens, hidden), jnp.float32)
    sizes = jnp.tile(jnp.array([[10, 0, 20, 6, 8, 10, 5, 1]], jnp.int32), (devices, 1))

    def layer(x, probs, fc1, fc2, sizes):
        return jqs.fsdp_grouped_mlp(
            x, fc1, fc2, sizes[0], probs, "swiglu",
            axis_name="fsdp", kernel_dim="experts", strategy=strategy, recipe=recipe,
        )  # fmt: skip

    results = {}
    for label, policy in GROUPED_POLICIES.items():
        fn = layer if policy is None else jax.checkpoint(layer, policy=policy)

        def body(x, probs, fc1, fc2, sizes, dy, fn=fn):
            y, vjp = jax.vjp(lambda *a: fn(*a, sizes), x, probs, fc1, fc2)
            return (y, *vjp(dy))

        results[label] = jax.jit(
            jax.shard_map(
                body,
                mesh=mesh_1d(devices),
                in_specs=(P("fsdp"), P("fsdp"), P("fsdp"), P("fsdp"), P("fsdp"), P("fsdp")),
                out_specs=(P("fsdp"), P("fsdp"), P("fsdp"), P("fsdp"), P("fsdp")),
            )
        )(x, probs, fc1, fc2, sizes, dy)
    for label, result in results.items():
        assert_bits_equal(result, results["no policy"], label)
