"""The sharded layers trace with the Pallas kernels the GPU dispatches to.

Inside shard_map JAX types every value with the mesh axes it varies over. On the H200
(2026-11-30) the sharded layers with kernel-quantized operands failed there: `plgpu.kernel` typed
its outputs invariant, so a backward's dx came out typed unlike x and the custom_vjp was refused
(pallas_kernels/manual_axes.py). The CPU suite quantizes on the jnp references and cannot see it;
here the kernels are forced on (as on a GPU) and the layers' forward and backward are traced
(the split dense layer, the grouped MLP, ShardedMoE with and without kept experts), which is
where JAX checks the types. Nothing runs: the Mosaic GPU interpreter cannot run two
devices at once, and the values are the CPU tests' business.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_qtrain import kernels
from jax_qtrain import sharding as jqs
from tests.jax_qtrain.sharding_helpers import RECIPES, mesh_1d, module_value_and_grads

DEVICES = 2
pytestmark = pytest.mark.skipif(len(jax.devices()) < DEVICES, reason="needs 2 devices")


@contextlib.contextmanager
def kernels_as_on_gpu():
    """Dispatch as on a GPU: the quantize kernels under backend="auto", the GEMM kernels."""
    with pytest.MonkeyPatch.context() as patch, kernels.gemm_backend("pallas"):
        patch.setattr(kernels, "on_gpu", lambda: True)
        yield


def abstract(mesh, *pairs):
    """ShapeDtypeStructs placed like shard_map's in_specs expect: (array, spec) pairs."""
    return [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.NamedSharding(mesh, spec))
        for a, spec in pairs
    ]


def assert_kernels_traced(jaxpr) -> None:
    """The trace holds Mosaic GPU kernels (`plgpu.kernel` traces to an `mpmd_map`), so the test
    is not quietly tracing the references."""
    assert "mpmd_map" in str(jaxpr), "no Pallas kernel in the trace"


def trace_vjp(op, mesh, in_specs, out_specs, *args):
    """make_jaxpr of `op`'s value and vjp inside a shard_map (the last argument is dy)."""

    def body(*local):
        *primals, dy = local
        y, vjp = jax.vjp(op, *primals)
        return y, *vjp(dy)

    sharded = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    with kernels_as_on_gpu():
        return jax.make_jaxpr(sharded)(*abstract(mesh, *zip(args, in_specs, strict=True)))


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("strategy", jqs.STRATEGIES)
@pytest.mark.parametrize("kernel_dim", [0, 1])
def test_sharded_dense_traces_with_kernels(name, strategy, kernel_dim):
    tokens, in_features, out_features = 512, 256, 256
    x = jnp.zeros((tokens, in_features), jnp.bfloat16)
    kernel = jnp.zeros((in_features, out_features), jnp.bfloat16)
    bias = jnp.zeros((out_features,), jnp.bfloat16)
    dy = jnp.zeros((tokens, out_features), jnp.bfloat16)
    kernel_spec = P("fsdp") if kernel_dim == 0 else P(None, "fsdp")

    def op(x, kernel_shard, bias):
        return jqs.fsdp_dense(
            x,
            kernel_shard,
            bias,
            axis_name="fsdp",
            kernel_dim=kernel_dim,
            strategy=strategy,
            recipe=RECIPES[name],
        )

    specs = (P("fsdp"), kernel_spec, P(), P("fsdp"))
    jaxpr = trace_vjp(
        op, mesh_1d(DEVICES), specs, (P("fsdp"), P("fsdp"), kernel_spec, P()), x, kernel, bias, dy
    )
    if name != "fp8":  # per-tensor FP8 quantizes and multiplies in XLA (no kernel)
        assert_kernels_traced(jaxpr)


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("strategy", jqs.STRATEGIES)
def test_sharded_grouped_mlp_traces_with_kernels(name, strategy):
    experts, tokens, hidden, ffn = 4, 512, 256, 256
    x = jnp.zeros((tokens, hidden), jnp.bfloat16)
    probs = jnp.zeros((tokens,), jnp.float32)
    fc1 = jnp.zeros((experts, hidden, 2 * ffn), jnp.bfloat16)
    fc2 = jnp.zeros((experts, ffn, hidden), jnp.bfloat16)
    sizes = jnp.full((DEVICES, experts), tokens // DEVICES // experts, jnp.int32)
    dy = jnp.zeros((tokens, hidden), jnp.bfloat16)

    def op(x, probs, fc1_shard, fc2_shard, sizes):
        return jqs.fsdp_grouped_mlp(
            x,
            fc1_shard,
            fc2_shard,
            sizes[0],
            probs,
            "swiglu",
            axis_name="fsdp",
            kernel_dim="experts",
            strategy=strategy,
            recipe=RECIPES[name],
        )

    specs = (P("fsdp"), P("fsdp"), P("fsdp"), P("fsdp"), P("fsdp"), P("fsdp"))
    out_specs = (P("fsdp"), P("fsdp"), P("fsdp"), P("fsdp"), P("fsdp"), P("fsdp"))
    jaxpr = trace_vjp(op, mesh_1d(DEVICES), specs, out_specs, x, probs, fc1, fc2, sizes, dy)
    assert_kernels_traced(jaxpr)


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("kept", [False, True], ids=["quantized_each_call", "kept_experts"])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["gathered", "expert_parallel"])
def test_sharded_moe_traces_with_kernels(name, kept, expert_parallel):
    features, experts, tokens = 256, 4, 512
    sharding = jqs.WeightSharding(mesh_1d(DEVICES), "fsdp", kernel_dim="experts")
    moe = jqs.ShardedMoE(
        features,
        features,
        experts,
        sharding=sharding,
        top_k=2,
        recipe=RECIPES[name],
        quantized_weight=kept,
        expert_parallel=expert_parallel,
        rngs=nnx.Rngs(0),
    )
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(tokens, features)), jnp.float32)
    dy = jnp.asarray(rng.normal(size=(tokens, features)), jnp.float32)
    with kernels_as_on_gpu():
        jaxpr = jax.make_jaxpr(lambda x, dy: module_value_and_grads(moe, x, dy))(x, dy)
    assert_kernels_traced(jaxpr)
