"""`jax_qtrain.sharding.ShardedLinear`: a Flax NNX layer with a split kernel — placement,
per-module recipes inside autocast, training steps, argument checks."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_qtrain as jq
from jax_qtrain import sharding as jqs
from tests.jax_qtrain.sharding_helpers import (
    RECIPES,
    assert_bits_equal,
    layer_data,
    mesh_1d,
    module_value_and_grads,
    replicate_uncommitted,
)


class TwoRecipes(nnx.Module):
    """y = mxfp8_layer(x) + autocast_layer(x): one layer with its own recipe, one following
    autocast; both read x, so every gradient is a sum over the batch of exact products."""

    def __init__(self, linear, **kwargs):
        rngs = nnx.Rngs(0)
        self.mxfp8 = linear(128, 32, recipe=RECIPES["mxfp8"], rngs=rngs, **kwargs)
        self.autocast = linear(128, 32, rngs=rngs, **kwargs)

    def __call__(self, x):
        return self.mxfp8(x) + self.autocast(x)


def _set_integer_params(model, sharding=None):
    """Integer-valued kernels (exact sums, sharding_helpers.py) in both layers."""
    for seed, layer in enumerate((model.mxfp8, model.autocast)):
        _, kernel, bias, _ = layer_data("nvfp4", (64, 128), 32, seed=seed + 1)
        if sharding is not None:
            kernel = sharding.shard_kernel(kernel)
        layer.kernel[...] = kernel.astype(layer.kernel[...].dtype)
        layer.bias[...] = bias.astype(layer.bias[...].dtype)


def _value_and_grads(model, x, dy):
    graphdef, params = nnx.split(model)

    @jax.jit
    def run(params, x, dy):
        y, vjp = jax.vjp(lambda p, x: nnx.merge(graphdef, p)(x), params, x)
        return y, *vjp(dy)

    with jq.autocast(RECIPES["nvfp4"]):
        return run(params, x, dy)


def test_kernel_is_created_split_over_the_axis():
    mesh = mesh_1d(8)
    layer = jqs.ShardedLinear(
        64, 32, sharding=jqs.WeightSharding(mesh, "fsdp", kernel_dim=1), rngs=nnx.Rngs(0)
    )
    assert layer.kernel[...].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    spec = nnx.get_partition_spec(nnx.state(layer))["kernel"].get_value()
    assert spec == jax.sharding.PartitionSpec(None, "fsdp")
    assert layer.bias[...].sharding.is_fully_replicated
    assert layer.bias[...].sharding.mesh == mesh
    unsharded = jq.nn.Linear(64, 32, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(np.asarray(layer.kernel[...]), np.asarray(unsharded.kernel[...]))


def test_per_module_recipe_is_honoured_and_matches_the_unsharded_layers():
    sharding = jqs.WeightSharding(mesh_1d(4), "fsdp")
    sharded = TwoRecipes(jqs.ShardedLinear, sharding=sharding, param_dtype=jnp.bfloat16)
    plain = TwoRecipes(jq.nn.Linear, param_dtype=jnp.bfloat16)
    _set_integer_params(sharded, sharding)
    _set_integer_params(plain)
    x, _, _, dy = layer_data("nvfp4", (64, 128), 32, seed=5)
    y, dparams, dx = _value_and_grads(sharded, x, dy)
    y_ref, dparams_ref, dx_ref = _value_and_grads(plain, x, dy)
    assert_bits_equal((y, dx), (y_ref, dx_ref), "y, dx")
    assert_bits_equal(jax.tree.leaves(dparams), jax.tree.leaves(dparams_ref), "parameter grads")
    # The MXFP8 layer did not follow the NVFP4 autocast: as an NVFP4 layer its output differs.
    with jq.autocast(RECIPES["nvfp4"]):
        as_nvfp4 = jq.dense(x, plain.mxfp8.kernel[...], plain.mxfp8.bias[...])
        as_mxfp8 = plain.mxfp8(x)
    assert not bool(jnp.all(as_nvfp4 == as_mxfp8))


class Stack(nnx.Module):
    def __init__(self, linear, **kwargs):
        rngs = nnx.Rngs(1)
        self.layers = nnx.List([linear(128, 128, rngs=rngs, **kwargs) for _ in range(2)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _train(model, batches, steps=3):
    optimizer = nnx.Optimizer(model, optax.sgd(2.0**-10), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, target):
        def loss_fn(model):
            return jnp.mean((model(x).astype(jnp.float32) - target) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    losses = [step(model, optimizer, *batches[i % len(batches)]) for i in range(steps)]
    return jnp.stack(losses), nnx.state(model, nnx.Param)


def test_training_steps_follow_the_unsharded_model():
    """Three SGD steps of a two-layer MXFP8 stack give the unsharded losses and parameters.
    Here the hidden activations are not integers and the loss is a mean over the split batch,
    so float32 sums over devices may round differently: compared to a tight tolerance (the
    bit-exact claims are test_sharding.py's)."""
    recipe = RECIPES["mxfp8"]
    sharding = jqs.WeightSharding(mesh_1d(4), "fsdp")
    sharded = Stack(jqs.ShardedLinear, sharding=sharding, recipe=recipe)
    plain = Stack(jq.nn.Linear, recipe=recipe)
    rng = np.random.default_rng(0)
    batches = [
        (
            jnp.asarray(rng.integers(-8, 9, (64, 128)), jnp.float32),
            jnp.asarray(rng.integers(-8, 9, (64, 128)), jnp.float32),
        )
        for _ in range(2)
    ]
    losses, params = _train(sharded, batches)
    losses_ref, params_ref = _train(plain, batches)
    np.testing.assert_allclose(np.asarray(losses), np.asarray(losses_ref), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params_ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    kernel = params["layers"][0]["kernel"].get_value()
    split = jax.sharding.NamedSharding(sharding.mesh, sharding.kernel_spec())
    assert kernel.sharding.is_equivalent_to(split, kernel.ndim)  # still split after the updates


def test_sharded_linear_rejects_bad_arguments():
    sharding = jqs.WeightSharding(mesh_1d(8), "fsdp")
    with pytest.raises(TypeError, match="sharding must be a WeightSharding"):
        jqs.ShardedLinear(64, 32, sharding="fsdp", rngs=nnx.Rngs(0))
    gather_first = jqs.WeightSharding(mesh_1d(8), "fsdp", strategy="gather_then_quantize")
    with pytest.raises(ValueError, match=r"kept as quantized shards.*quantize_then_gather"):
        jqs.ShardedLinear(
            64,
            32,
            sharding=gather_first,
            recipe=RECIPES["fp8"],
            quantized_weight=True,
            rngs=nnx.Rngs(0),
        )
    with pytest.raises(ValueError, match="needs recipe="):
        jqs.ShardedLinear(64, 32, sharding=sharding, quantized_weight=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="kept as quantized shards, so it needs a shard length"):
        jqs.ShardedLinear(  # 64 rows per shard: half a 128×128 FP8 block
            512,
            128,
            sharding=sharding,
            recipe=RECIPES["fp8_block"],
            quantized_weight=True,
            rngs=nnx.Rngs(0),
        )
    with pytest.raises(ValueError, match=r"kernel_metadata\['out_sharding'\]"):
        jqs.ShardedLinear(
            64,
            32,
            sharding=sharding,
            kernel_metadata={"out_sharding": (None, "fsdp")},
            rngs=nnx.Rngs(0),
        )
    with pytest.raises(ValueError, match="in_features 36 must be a multiple of 8"):
        jqs.ShardedLinear(36, 32, sharding=sharding, rngs=nnx.Rngs(0))


# --- kept quantized weights with a split kernel (sharding/kept_weight.py) ------------------------
@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("kernel_dim", [0, 1])
def test_kept_copies_are_split_and_equal_the_whole_quantization(name, kernel_dim):
    sharding = jqs.WeightSharding(mesh_1d(4), "fsdp", kernel_dim=kernel_dim)
    layout = jqs.SplitKernelLayout(sharding)
    _, kernel, _, _ = layer_data(name, (16, 512), 512)
    kept = jq.quantize_weight(sharding.shard_kernel(kernel), RECIPES[name], layout=layout)
    whole = jq.quantize_weight(kernel, RECIPES[name])
    assert kept.layout == layout and "split over mesh axis 'fsdp'" in repr(kept)
    assert_bits_equal(jax.tree.leaves(kept), jax.tree.leaves(whole), name)
    for usage in kept.usages:
        data = getattr(kept.tensor, f"{usage}_data")
        split_axis = kernel_dim if usage == "rowwise" else 1 - kernel_dim
        parts = [None, None]
        parts[split_axis] = "fsdp"
        assert data.sharding.spec == jax.sharding.PartitionSpec(*parts), usage
    refreshed = kept.refresh(sharding.shard_kernel(kernel * 2))
    assert refreshed.layout == layout
    assert_bits_equal(
        jax.tree.leaves(refreshed), jax.tree.leaves(jq.quantize_weight(kernel * 2, RECIPES[name]))
    )


def _kept_and_unkept(name, **kept_options):
    sharding = jqs.WeightSharding(mesh_1d(4), "fsdp")
    x, kernel, bias, dy = layer_data(name, (64, 512), 128)

    def layer(**options):
        model = jqs.ShardedLinear(
            512,
            128,
            sharding=sharding,
            recipe=RECIPES[name],
            param_dtype=jnp.bfloat16,
            kernel_init=lambda key, shape, dtype: kernel.astype(dtype),
            rngs=nnx.Rngs(0),
            **options,
        )
        model.bias[...] = bias
        return model

    return layer(quantized_weight=True, **kept_options), layer(), x, dy


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_sharded_linear_with_a_kept_weight_trains_like_the_plain_one(name):
    """Same bits as quantizing the split kernel in every call, through two optimizer steps
    (jq.nn.Optimizer re-quantizes the kept shards after each update)."""
    kept, plain, x, dy = _kept_and_unkept(name)
    assert_bits_equal(
        jax.tree.leaves(module_value_and_grads(kept, x, dy)),
        jax.tree.leaves(module_value_and_grads(plain, x, dy)),
    )

    def train(model):
        optimizer = jq.nn.Optimizer(model, optax.sgd(2.0**-6), wrt=nnx.Param)
        replicate_uncommitted((model, optimizer), model.sharding.mesh)

        @nnx.jit
        def step(model, optimizer, x):
            loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2))(
                model
            )
            optimizer.update(model, grads)
            return loss

        return [step(model, optimizer, x) for _ in range(2)]

    assert_bits_equal(train(kept), train(plain), "losses")
    kernel = kept.kernel[...]
    assert_bits_equal(kernel[None], plain.kernel[...][None], "kernel")
    held = kept.quantized_kernel.get_value()
    assert held.layout == jqs.SplitKernelLayout(kept.sharding)  # still split after refreshes
    assert_bits_equal(
        jax.tree.leaves(held), jax.tree.leaves(jq.quantize_weight(kernel, RECIPES[name]))
    )


def test_sharded_linear_without_a_master_weight():
    kept, plain, x, dy = _kept_and_unkept("mxfp8", keep_master_weight=False)
    assert kept.kernel is None
    y, dparams, dx = module_value_and_grads(kept, x, dy)
    y_ref, _, dx_ref = module_value_and_grads(plain, x, dy)
    assert_bits_equal((y, dx), (y_ref, dx_ref))
    assert "kernel" not in dparams
    held = kept.quantized_kernel.get_value()
    jq.nn.refresh_quantized_weights(kept)  # a frozen weight: nothing to rebuild
    assert_bits_equal(jax.tree.leaves(kept.quantized_kernel.get_value()), jax.tree.leaves(held))


def test_sharded_dense_checks_a_kept_weight():
    sharding = jqs.WeightSharding(mesh_1d(4), "fsdp")
    x, kernel, bias, _ = layer_data("fp8", (64, 512), 128)
    unsplit = jq.quantize_weight(kernel, RECIPES["fp8"])
    with pytest.raises(ValueError, match="must be kept split as sharding splits the kernel"):
        jqs.dense(
            x, kernel, bias, sharding=sharding, recipe=RECIPES["fp8"], quantized_kernel=unsplit
        )
    kept = jq.quantize_weight(kernel, RECIPES["mxfp8"], layout=jqs.SplitKernelLayout(sharding))
    with pytest.raises(ValueError, match="quantized_kernel_shard was quantized as mxfp8"):
        jqs.dense(x, kernel, bias, sharding=sharding, recipe=RECIPES["fp8"], quantized_kernel=kept)
    fprop_only = jq.quantize_weight(
        kernel, RECIPES["fp8"], ("columnwise",), layout=jqs.SplitKernelLayout(sharding)
    )
    with pytest.raises(ValueError, match=r"holds only \['columnwise'\].*add_usages"):
        jqs.dense(
            x, kernel, bias, sharding=sharding, recipe=RECIPES["fp8"], quantized_kernel=fprop_only
        )
    with pytest.raises(TypeError, match="quantized_kernel must be a QuantizedWeight"):
        jqs.dense(
            x, kernel, bias, sharding=sharding, recipe=RECIPES["fp8"], quantized_kernel=kernel
        )
    with pytest.raises(TypeError, match="None only together with quantized_kernel"):
        jqs.dense(x, None, bias, sharding=sharding, recipe=RECIPES["fp8"])
    with pytest.raises(TypeError, match="sharding must be a WeightSharding"):
        jqs.SplitKernelLayout("fsdp")
    with pytest.raises(TypeError, match="layout must be a WeightLayout"):
        jq.quantize_weight(kernel, RECIPES["fp8"], layout="fsdp")
