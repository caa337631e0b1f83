"""Expert kernels split over a mesh axis: `fsdp_grouped_dense`, `fsdp_grouped_mlp` and
`ShardedMoE`. Tokens are data parallel, so on each device y and dx are, bit for bit, the
unsharded op's on that device's rows with the whole kernels; the kernel gradients are the sums
of the devices' (float32 kernels keep those sums unrounded; integer data keep them exact).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jax_qtrain as jq
from jax_qtrain import sharding as jqs
from jax_qtrain.ops import FC1_KERNEL, FC2_KERNEL, KERNEL
from tests.jax_qtrain.sharding_helpers import (
    RECIPES,
    assert_bits_equal,
    kernel_shapes,
    mesh_1d,
    module_value_and_grads,
    replicate_uncommitted,
)

DEVICES, EXPERTS, TOKENS = 4, 8, 64  # TOKENS per device
SPLIT_SPECS = {"experts": P("fsdp"), 0: P(None, "fsdp"), 1: P(None, None, "fsdp")}


def _integers(rng, shape, scale=1.0):
    return jnp.asarray(rng.integers(-13, 14, shape) * scale, jnp.float32)


def _group_sizes(rng):
    """(DEVICES, EXPERTS) rows per expert on each device, some experts empty, a few rows past
    the groups."""
    return jnp.asarray(
        np.stack(
            [
                np.bincount(rng.integers(0, EXPERTS - 2, TOKENS - 4 * d), minlength=EXPERTS)
                for d in range(DEVICES)
            ]
        ).astype(np.int32)
    )


def _per_device_reference(op, rows_args, shared_args, dy, sizes):
    """Run the unsharded `op(*rows, *shared, sizes)` with vjp on each device's rows: (y and the
    rows' gradients concatenated, the shared arguments' gradients summed over devices)."""

    @jax.jit
    def one(rows, shared, dy, sizes):
        y, vjp = jax.vjp(lambda r, s: op(*r, *s, sizes), rows, shared)
        return y, *vjp(dy)

    results = [
        one(
            tuple(a[d * TOKENS : (d + 1) * TOKENS] for a in rows_args),
            shared_args,
            dy[d * TOKENS : (d + 1) * TOKENS],
            sizes[d],
        )
        for d in range(DEVICES)
    ]
    y = jnp.concatenate([r[0] for r in results])
    rows_grads = [jnp.concatenate([r[1][i] for r in results]) for i in range(len(rows_args))]
    shared_grads = [sum(r[2][i] for r in results) for i in range(len(shared_args))]
    return y, rows_grads, shared_grads


GROUPED_DENSE_CASES = [
    ("fp8", None, "experts", "quantize_then_gather"),
    ("fp8_block", None, "experts", "quantize_then_gather"),
    ("mxfp8", None, 0, "quantize_then_gather"),
    ("nvfp4", None, 1, "gather_then_quantize"),
    ("nvfp4", "dequantized", 0, "quantize_then_gather"),
    ("mxfp8", "high_precision", "experts", "gather_then_quantize"),
    (None, None, 1, "quantize_then_gather"),
]


@pytest.mark.parametrize("name, mode, kernel_dim, strategy", GROUPED_DENSE_CASES)
def test_fsdp_grouped_dense_is_the_unsharded_op_per_device(name, mode, kernel_dim, strategy):
    recipe = None if name is None else RECIPES[name].replace(backward_override=mode)
    rng = np.random.default_rng(0)
    in_features, out_features = 128, 64
    x = _integers(rng, (DEVICES * TOKENS, in_features)).astype(jnp.bfloat16)
    kernels = _integers(rng, (EXPERTS, in_features, out_features), 1 / 16)
    bias = _integers(rng, (EXPERTS, out_features))
    dy = _integers(rng, (DEVICES * TOKENS, out_features))
    sizes = _group_sizes(rng)

    y_ref, (dx_ref,), (dk_ref, db_ref) = _per_device_reference(
        lambda x, k, b, s: jq.grouped_dense(x, k, s, b, recipe=recipe),
        (x,),
        (kernels, bias),
        dy,
        sizes,
    )
    spec = SPLIT_SPECS[kernel_dim]

    def body(x, kernels, bias, sizes, dy):
        def op(x, k, b):
            return jqs.fsdp_grouped_dense(
                x,
                k,
                sizes[0],
                b,
                axis_name="fsdp",
                kernel_dim=kernel_dim,
                strategy=strategy,
                recipe=recipe,
            )

        y, vjp = jax.vjp(op, x, kernels, bias)
        return y, *vjp(dy)

    sharded = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh_1d(DEVICES),
            in_specs=(P("fsdp"), spec, P(), P("fsdp"), P("fsdp")),
            out_specs=(P("fsdp"), P("fsdp"), spec, P()),
        )
    )(x, kernels, bias, sizes, dy)
    assert_bits_equal(sharded, (y_ref, dx_ref, dk_ref, db_ref), f"{name} {mode} {kernel_dim}")


GROUPED_MLP_CASES = [
    ("nvfp4", None, "experts", "quantize_then_gather"),
    ("mxfp8", None, 1, "gather_then_quantize"),
    ("fp8", "dequantized", 0, "quantize_then_gather"),
    (None, None, "experts", "quantize_then_gather"),
]


@pytest.mark.parametrize("name, mode, kernel_dim, strategy", GROUPED_MLP_CASES)
def test_fsdp_grouped_mlp_is_the_unsharded_op_per_device(name, mode, kernel_dim, strategy):
    recipe = None if name is None else RECIPES[name].replace(backward_override=mode)
    rng = np.random.default_rng(1)
    hidden, ffn = 128, 128  # 4 shards of 32 along either dim of either kernel
    x = _integers(rng, (DEVICES * TOKENS, hidden), 1 / 4).astype(jnp.bfloat16)
    probs = jnp.asarray(rng.integers(1, 5, DEVICES * TOKENS) / 4, jnp.float32)
    fc1 = _integers(rng, (EXPERTS, hidden, 2 * ffn), 1 / 64)
    fc2 = _integers(rng, (EXPERTS, ffn, hidden), 1 / 64)
    dy = _integers(rng, (DEVICES * TOKENS, hidden), 1 / 4)
    sizes = _group_sizes(rng)

    y_ref, (dx_ref, dprobs_ref), (dfc1_ref, dfc2_ref) = _per_device_reference(
        lambda x, p, w1, w2, s: jq.grouped_mlp(x, w1, w2, s, p, "swiglu", recipe=recipe),
        (x, probs),
        (fc1, fc2),
        dy,
        sizes,
    )
    spec = SPLIT_SPECS[kernel_dim]

    def body(x, probs, fc1, fc2, sizes, dy):
        def op(x, p, w1, w2):
            return jqs.fsdp_grouped_mlp(
                x,
                w1,
                w2,
                sizes[0],
                p,
                "swiglu",
                axis_name="fsdp",
                kernel_dim=kernel_dim,
                strategy=strategy,
                recipe=recipe,
            )

        y, vjp = jax.vjp(op, x, probs, fc1, fc2)
        return y, *vjp(dy)

    sharded = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh_1d(DEVICES),
            in_specs=(P("fsdp"), P("fsdp"), spec, spec, P("fsdp"), P("fsdp")),
            out_specs=(P("fsdp"), P("fsdp"), P("fsdp"), spec, spec),
        )
    )(x, probs, fc1, fc2, sizes, dy)
    y, dx, dprobs, dfc1, dfc2 = sharded
    assert_bits_equal((y, dx, dprobs), (y_ref, dx_ref, dprobs_ref), f"{name} {mode} y, dx, dprobs")
    # The MLP's hidden activations are not integers: the expert gradients, sums over devices,
    # agree up to float32 summation order.
    for got, expected in ((dfc1, dfc1_ref), (dfc2, dfc2_ref)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy", jqs.STRATEGIES)
def test_grouped_residuals_are_the_kernel_shards(strategy):
    recipe = RECIPES["mxfp8"]
    shard_shapes = {"experts": (2, 128, 128), 0: (8, 32, 128), 1: (8, 128, 32)}  # of (8, 128, 128)
    for kernel_dim, shard_shape in shard_shapes.items():

        def dense_body(x, kernel_shard, sizes, kernel_dim=kernel_dim):
            return jqs.fsdp_grouped_dense(
                x,
                kernel_shard,
                sizes,
                axis_name="fsdp",
                kernel_dim=kernel_dim,
                strategy=strategy,
                recipe=recipe,
            )

        saved = jqs.per_device_saved_residuals(
            dense_body,
            mesh_1d(DEVICES),
            jax.ShapeDtypeStruct((TOKENS, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct(shard_shape, jnp.bfloat16),
            jax.ShapeDtypeStruct((EXPERTS,), jnp.int32),
        )
        kernel_residuals = [r for r in saved if r.name == KERNEL]
        assert kernel_residuals, saved
        if strategy == "gather_then_quantize":
            assert [r.shape for r in kernel_residuals] == [shard_shape]
        else:  # the shard's quantized rowwise copy: (experts, rows of the shard, ...)
            assert kernel_residuals[0].shape[:2] == shard_shape[:2]
        whole = {(EXPERTS, *s) for s in kernel_shapes((128, 128), recipe)} | {(EXPERTS, 128, 128)}
        assert not [r for r in saved if r.shape in whole], saved

        def mlp_body(x, fc1, fc2, sizes, kernel_dim=kernel_dim):
            return jqs.fsdp_grouped_mlp(
                x,
                fc1,
                fc2,
                sizes,
                None,
                "gelu",
                axis_name="fsdp",
                kernel_dim=kernel_dim,
                strategy=strategy,
                recipe=recipe,
            )

        saved = jqs.per_device_saved_residuals(
            mlp_body,
            mesh_1d(DEVICES),
            jax.ShapeDtypeStruct((TOKENS, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct(shard_shape, jnp.bfloat16),
            jax.ShapeDtypeStruct(shard_shape, jnp.bfloat16),
            jax.ShapeDtypeStruct((EXPERTS,), jnp.int32),
        )
        names = {r.name for r in saved}
        assert {FC1_KERNEL, FC2_KERNEL} <= names, names
        whole_fc2 = {(EXPERTS, *s) for s in kernel_shapes((64, 128), recipe)}
        assert not [
            r for r in saved if r.name in (FC1_KERNEL, FC2_KERNEL) and r.shape in whole | whole_fc2
        ]


def test_sharded_moe_is_the_unsharded_moe_per_device():
    """ShardedMoE (MXFP8 experts split by expert) against nn.MoE built from the same rngs, run
    on each device's tokens: y and dx bit for bit, parameter gradients summed over devices."""
    mesh = mesh_1d(DEVICES)
    sharding = jqs.WeightSharding(mesh, "fsdp", kernel_dim="experts")
    kwargs = dict(top_k=2, recipe=RECIPES["mxfp8"])
    sharded = jqs.ShardedMoE(64, 32, EXPERTS, sharding=sharding, rngs=nnx.Rngs(3), **kwargs)
    plain = jq.nn.MoE(64, 32, EXPERTS, rngs=nnx.Rngs(3), **kwargs)
    np.testing.assert_array_equal(
        np.asarray(sharded.fc1_kernel[...]), np.asarray(plain.experts.fc1_kernel[...])
    )
    split = jax.sharding.NamedSharding(mesh, P("fsdp"))
    assert sharded.fc1_kernel[...].sharding.is_equivalent_to(split, 3)

    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(DEVICES * 32, 64)), jnp.float32)
    dy = jnp.asarray(rng.normal(size=(DEVICES * 32, 64)), jnp.float32)

    y, dparams, dx = module_value_and_grads(sharded, x, dy)
    chunks = [
        module_value_and_grads(plain, x[d * 32 : (d + 1) * 32], dy[d * 32 : (d + 1) * 32])
        for d in range(DEVICES)
    ]
    assert_bits_equal(
        (y, dx),
        (jnp.concatenate([c[0] for c in chunks]), jnp.concatenate([c[2] for c in chunks])),
        "y, dx",
    )
    expected = {
        "router": sum(c[1]["router"]["kernel"].get_value() for c in chunks),
        "fc1": sum(c[1]["experts"]["fc1_kernel"].get_value() for c in chunks),
        "fc2": sum(c[1]["experts"]["fc2_kernel"].get_value() for c in chunks),
    }
    got = {
        "router": dparams["router"]["kernel"].get_value(),
        "fc1": dparams["fc1_kernel"].get_value(),
        "fc2": dparams["fc2_kernel"].get_value(),
    }
    for key in expected:
        np.testing.assert_allclose(
            np.asarray(got[key]), np.asarray(expected[key]), rtol=1e-5, atol=1e-6, err_msg=key
        )


def test_grouped_bad_arguments_are_named():
    mesh = mesh_1d(DEVICES)
    with pytest.raises(ValueError, match=r'kernel_dim must be 0 .* or "experts"'):
        jqs.WeightSharding(mesh, "fsdp", kernel_dim=2)
    with pytest.raises(ValueError, match="kernel_dim must be 0"):
        jqs.ShardedLinear(
            64,
            64,
            sharding=jqs.WeightSharding(mesh, "fsdp", kernel_dim="experts"),
            rngs=nnx.Rngs(0),
        )
    with pytest.raises(ValueError, match="num_experts must be multiples of 4"):
        jqs.ShardedMoE(
            64,
            32,
            6,
            sharding=jqs.WeightSharding(mesh, "fsdp", kernel_dim="experts"),
            rngs=nnx.Rngs(0),
        )
    with pytest.raises(ValueError, match="axis_name: axis 'fsdp' is not bound"):
        jqs.fsdp_grouped_dense(
            jnp.ones((8, 16)), jnp.ones((2, 16, 8)), jnp.ones((8,), jnp.int32), axis_name="fsdp"
        )

    def wrong_x(x, kernel_shard, sizes):
        return jqs.fsdp_grouped_dense(x, kernel_shard, sizes, axis_name="fsdp", kernel_dim=0)

    with pytest.raises(ValueError, match=r"x must have shape \(tokens, 64\)"):
        jqs.per_device_saved_residuals(
            wrong_x,
            mesh,
            jax.ShapeDtypeStruct((16, 32), jnp.float32),
            jax.ShapeDtypeStruct((8, 16, 8), jnp.float32),
            jax.ShapeDtypeStruct((8,), jnp.int32),
        )


# --- ShardedMoE with kept quantized experts ---------------------------------------------------
# (recipe, kernel_dim, hidden = ffn): shards of whole blocks along the split dim on 4 devices.
KEPT_EXPERT_CASES = [
    ("mxfp8", "experts", 64),
    ("fp8", 0, 64),
    ("nvfp4", 1, 64),
    ("fp8_block", 0, 512),
    ("mxfp8", 1, 128),
]


def _kept_and_plain_moe(name, kernel_dim, features, **options):
    sharding = jqs.WeightSharding(mesh_1d(DEVICES), "fsdp", kernel_dim=kernel_dim)

    def moe(**extra):
        return jqs.ShardedMoE(
            features,
            features,
            EXPERTS,
            sharding=sharding,
            top_k=2,
            recipe=RECIPES[name],
            rngs=nnx.Rngs(3),
            **options,
            **extra,
        )

    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(DEVICES * 16, features)), jnp.float32)
    dy = jnp.asarray(rng.normal(size=(DEVICES * 16, features)), jnp.float32)
    return moe(quantized_weight=True), moe(), x, dy


@pytest.mark.parametrize("name, kernel_dim, features", KEPT_EXPERT_CASES)
def test_sharded_moe_with_kept_experts_trains_like_the_plain_one(name, kernel_dim, features):
    """The kept experts are the per-expert quantization of the whole kernels, split like them;
    y, dx and every parameter gradient, then two jq.nn.Optimizer steps, are the layer's that
    quantizes its shards in every call, bit for bit."""
    check_kept_experts_train_like_plain(name, kernel_dim, features)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_expert_parallel_moe_with_kept_experts_trains_like_the_plain_one(name):
    """The same with expert parallelism: each device reads its own experts' kept copies (nothing
    gathered) and the rows travel to them."""
    check_kept_experts_train_like_plain(name, "experts", 64, expert_parallel=True)


def check_kept_experts_train_like_plain(name, kernel_dim, features, **options):
    kept, plain, x, dy = _kept_and_plain_moe(name, kernel_dim, features, **options)
    for variable, kernel in (
        (kept.quantized_fc1_kernel, kept.fc1_kernel),
        (kept.quantized_fc2_kernel, kept.fc2_kernel),
    ):
        held = variable.get_value()
        assert held.layout == jqs.SplitKernelLayout(kept.sharding, stacked=True)
        whole = jq.quantize_weight(kernel[...], RECIPES[name])
        assert_bits_equal(jax.tree.leaves(held), jax.tree.leaves(whole), "kept = whole")
        data = held.tensor.rowwise_data
        split_dim = {"experts": 0, 0: 1, 1: 2}[kernel_dim]
        assert data.sharding.spec[split_dim] == "fsdp"
    assert_bits_equal(
        jax.tree.leaves(module_value_and_grads(kept, x, dy)),
        jax.tree.leaves(module_value_and_grads(plain, x, dy)),
        "y, grads, dx",
    )

    def train(model):
        optimizer = jq.nn.Optimizer(model, optax.sgd(2.0**-4), wrt=nnx.Param)
        replicate_uncommitted((model, optimizer), model.sharding.mesh)

        @nnx.jit
        def step(model, optimizer, x):
            loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
            optimizer.update(model, grads)
            return loss

        return [step(model, optimizer, x) for _ in range(2)]

    assert_bits_equal(train(kept), train(plain), "losses")
    fc1 = kept.fc1_kernel[...]
    held = kept.quantized_fc1_kernel.get_value()  # rebuilt by the optimizer, still split
    assert held.layout == jqs.SplitKernelLayout(kept.sharding, stacked=True)
    assert_bits_equal(
        jax.tree.leaves(held), jax.tree.leaves(jq.quantize_weight(fc1, RECIPES[name]))
    )


def test_kept_experts_split_over_experts_carry_their_own_scales():
    kept, _, _, _ = _kept_and_plain_moe("fp8", "experts", 64)
    scale_inv = kept.quantized_fc1_kernel.get_value().tensor.rowwise_scale_inv
    assert scale_inv.shape == (EXPERTS,)
    assert scale_inv.sharding.spec == P("fsdp")  # each device its own experts' scales
    kept, _, _, _ = _kept_and_plain_moe("fp8", 0, 64)
    scale_inv = kept.quantized_fc1_kernel.get_value().tensor.rowwise_scale_inv
    assert scale_inv.sharding.is_fully_replicated  # amax max-reduced over the split


def test_kept_experts_bad_configurations_are_named():
    mesh = mesh_1d(DEVICES)
    by_experts = jqs.WeightSharding(mesh, "fsdp", kernel_dim="experts")

    def moe(sharding=by_experts, **options):
        return jqs.ShardedMoE(64, 64, EXPERTS, sharding=sharding, rngs=nnx.Rngs(0), **options)

    with pytest.raises(ValueError, match="needs recipe="):
        moe(quantized_weight=True)
    with pytest.raises(ValueError, match="quantize_then_gather"):
        moe(
            jqs.WeightSharding(mesh, "fsdp", strategy="gather_then_quantize"),
            recipe=RECIPES["mxfp8"],
            quantized_weight=True,
        )
    with pytest.raises(TypeError, match="quantized_weight must be a bool"):
        moe(quantized_weight=1)
    with pytest.raises(ValueError, match="kernel_dim must be 0"):
        jqs.SplitKernelLayout(by_experts)
    with pytest.raises(TypeError, match="stacked must be a bool"):
        jqs.SplitKernelLayout(by_experts, stacked="yes")


def test_fsdp_grouped_mlp_checks_kept_shards():
    recipe = RECIPES["mxfp8"]
    rng = np.random.default_rng(5)
    x = _integers(rng, (DEVICES * TOKENS, 64))
    fc1 = _integers(rng, (EXPERTS, 64, 64), 1 / 16)
    fc2 = _integers(rng, (EXPERTS, 32, 64), 1 / 16)
    sizes = _group_sizes(rng)
    layout = jqs.SplitKernelLayout(
        jqs.WeightSharding(mesh_1d(DEVICES), "fsdp", kernel_dim="experts"), stacked=True
    )
    kept_fc1 = jq.quantize_weight(fc1, recipe, layout=layout).tensor
    kept_fc2 = jq.quantize_weight(fc2, recipe, layout=layout).tensor

    def run(kept_fc2_shard_of, **options):
        fc1_leaves, fc1_specs = layout.operands(kept_fc1)
        fc2_leaves, fc2_specs = layout.operands(kept_fc2)

        def body(x, fc1, fc2, sizes, fc1_leaves, fc2_leaves):
            return jqs.fsdp_grouped_mlp(
                x,
                fc1,
                fc2,
                sizes[0],
                axis_name="fsdp",
                recipe=recipe,
                quantized_fc1_shard=layout.local(kept_fc1, fc1_leaves),
                quantized_fc2_shard=kept_fc2_shard_of(layout.local(kept_fc2, fc2_leaves)),
                **options,
            )

        return jax.jit(
            jax.shard_map(
                body,
                mesh=mesh_1d(DEVICES),
                in_specs=(P("fsdp"), P("fsdp"), P("fsdp"), P("fsdp"), fc1_specs, fc2_specs),
                out_specs=P("fsdp"),
            )
        )(x, fc1, fc2, sizes, fc1_leaves, fc2_leaves)

    with pytest.raises(ValueError, match="go together"):
        run(lambda kept: None)
    with pytest.raises(ValueError, match="quantized_fc2_shard must quantize fc2_shard"):
        run(
            lambda kept: jq.quantize_per_expert(
                jnp.ones((2, 64, 32)), recipe, rowwise=True, columnwise=True
            )
        )
    with pytest.raises(ValueError, match="needs strategy='quantize_then_gather'"):
        run(lambda kept: kept, strategy="gather_then_quantize")


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_sharded_moe_reads_its_kept_experts(expert_parallel):
    """The forward reads the kept copies, not the master: with fc1's kept copy made from 2·fc1,
    y is the plain layer's with fc1 doubled."""
    kept, plain, x, _ = _kept_and_plain_moe("mxfp8", "experts", 64, expert_parallel=expert_parallel)
    doubled = 2 * kept.fc1_kernel[...]
    held = kept.quantized_fc1_kernel.get_value()
    kept.quantized_fc1_kernel.set_value(held.refresh(doubled))
    plain.fc1_kernel[...] = doubled
    forward = nnx.jit(lambda model, x: model(x))
    assert_bits_equal((forward(kept, x),), (forward(plain, x),), "y")
