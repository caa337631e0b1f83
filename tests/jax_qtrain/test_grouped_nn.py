"""NNX layers: nn.GroupedLinear, nn.GroupedMLP and the MoE block nn.MoE."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_qtrain as jq
from jax_qtrain.nn.moe import (
    combine_slots,
    dispatch_tokens,
    expert_counts,
    load_balancing_loss,
    permute_by_expert,
    permute_rows,
)

from .gpu_compare import assert_same_result
from .grouped_common import ON_GPU, RECIPES, assert_bits_equal


def test_grouped_linear_calls_grouped_dense_with_its_parameters():
    layer = jq.nn.GroupedLinear(
        4, 64, 32, dtype=jnp.bfloat16, recipe=RECIPES["mxfp8"], rngs=nnx.Rngs(0)
    )
    assert layer.kernel[...].shape == (4, 64, 32) and layer.kernel[...].dtype == jnp.float32
    assert layer.bias[...].shape == (4, 32)
    # lecun_normal per expert: the fan-in is in_features, not 4 * in_features
    assert 0.8 < float(jnp.std(layer.kernel[...])) * np.sqrt(64) < 1.2
    x = jax.random.normal(jax.random.key(1), (100, 64), jnp.float32)
    group_sizes = jnp.array([30, 0, 50, 10], jnp.int32)
    layer.bias[...] = jax.random.normal(jax.random.key(2), (4, 32))
    want = jax.jit(lambda x, w, b: jq.grouped_dense(x, w, group_sizes, b, recipe=RECIPES["mxfp8"]))(
        x.astype(jnp.bfloat16),
        layer.kernel[...].astype(jnp.bfloat16),
        layer.bias[...].astype(jnp.bfloat16),
    )
    got = nnx.jit(lambda layer, x: layer(x, group_sizes))(layer, x)
    assert got.dtype == jnp.bfloat16
    assert_same_result(got, want)
    no_bias = jq.nn.GroupedLinear(2, 8, 8, use_bias=False, rngs=nnx.Rngs(0))
    assert no_bias.bias is None
    assert no_bias(jnp.ones((3, 8)), jnp.array([1, 2], jnp.int32)).shape == (3, 8)


def test_grouped_mlp_layer_calls_grouped_mlp():
    mlp = jq.nn.GroupedMLP(4, 32, 48, recipe=RECIPES["fp8"], rngs=nnx.Rngs(0))
    assert mlp.fc1_kernel[...].shape == (4, 32, 96) and mlp.fc2_kernel[...].shape == (4, 48, 32)
    x = jax.random.normal(jax.random.key(3), (64, 32), jnp.float32)
    probs = jax.random.uniform(jax.random.key(4), (64,))
    group_sizes = jnp.array([16, 16, 0, 32], jnp.int32)
    want = jax.jit(
        lambda x, w1, w2, p: jq.grouped_mlp(x, w1, w2, group_sizes, p, recipe=RECIPES["fp8"])
    )(x, mlp.fc1_kernel[...], mlp.fc2_kernel[...], probs)
    assert_bits_equal(nnx.jit(lambda m, x, p: m(x, group_sizes, p))(mlp, x, probs), want)
    plain = jq.nn.GroupedMLP(2, 8, 16, activation="srelu", out_features=4, rngs=nnx.Rngs(0))
    assert plain.fc1_kernel[...].shape == (2, 8, 16) and plain.fc2_kernel[...].shape == (2, 16, 4)


def test_a_layer_recipe_stays_inside_a_global_autocast():
    mlp = jq.nn.GroupedMLP(4, 32, 32, recipe=RECIPES["mxfp8"], rngs=nnx.Rngs(0))
    follower = jq.nn.GroupedMLP(4, 32, 32, rngs=nnx.Rngs(0))  # same weights, follows autocast
    x = jax.random.normal(jax.random.key(5), (64, 32), jnp.bfloat16)
    group_sizes = jnp.array([16, 16, 16, 16], jnp.int32)
    forward = nnx.jit(lambda m, x: m(x, group_sizes))
    alone = forward(mlp, x)
    with jq.autocast(RECIPES["nvfp4"]):
        assert_bits_equal(forward(mlp, x), alone)
        assert not np.array_equal(np.asarray(forward(follower, x)), np.asarray(alone))
    with jq.autocast(RECIPES["mxfp8"]):
        assert_bits_equal(forward(follower, x), alone)


def reference_moe(model, x):
    """Token by token: Σ_j p_j · expert_{e_j}(x_t), float32 (the MoE block with recipe None)."""
    w_router = np.asarray(model.router.kernel[...], np.float64)
    fc1 = np.asarray(model.experts.fc1_kernel[...], np.float64)
    fc2 = np.asarray(model.experts.fc2_kernel[...], np.float64)
    tokens = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    logits = tokens @ w_router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(tokens)
    ffn = fc2.shape[1]
    for t, row in enumerate(tokens):
        top = np.argsort(-probs[t], kind="stable")[: model.top_k]
        weights = probs[t, top] / probs[t, top].sum()
        for e, p in zip(top, weights, strict=True):
            h = row @ fc1[e]
            a, b = h[:ffn], h[ffn:]
            out[t] += p * ((a / (1 + np.exp(-a)) * b) @ fc2[e])
    return out.reshape(x.shape), probs


def test_moe_routes_each_token_to_its_top_k_experts():
    model = jq.nn.MoE(16, 24, 4, top_k=2, aux_loss_coef=0.5, rngs=nnx.Rngs(0))
    model.router.kernel[...] = jax.random.normal(jax.random.key(6), (16, 4)) * 0.5
    x = jax.random.normal(jax.random.key(7), (3, 10, 16), jnp.float32)
    (y, aux_loss), intermediates = nnx.capture(model, nnx.Intermediate)(x, return_aux_loss=True)
    want, probs = reference_moe(model, x)
    tolerance = 2e-2 if ON_GPU else 2e-4  # the GPU may run float32 GEMMs in TF32
    np.testing.assert_allclose(np.asarray(y), want, rtol=tolerance, atol=tolerance / 10)
    counts = np.zeros(4)
    for t in range(30):
        counts[np.argsort(-probs[t], kind="stable")[:2]] += 1
    expected_aux = 0.5 * 4 * np.sum(counts / 60 * probs.mean(0))
    np.testing.assert_allclose(float(aux_loss), expected_aux, rtol=1e-5)
    np.testing.assert_allclose(float(intermediates["aux_loss"][...]), expected_aux, rtol=1e-5)
    np.testing.assert_array_equal(intermediates["tokens_per_expert"][...], counts)


def test_permutation_and_load_balancing_helpers():
    top_experts = jnp.array([[2, 0], [0, 1], [2, 1]], jnp.int32)
    order, inverse, group_sizes = permute_by_expert(top_experts, 4)
    np.testing.assert_array_equal(group_sizes, [2, 2, 2, 0])
    np.testing.assert_array_equal(top_experts.reshape(-1)[order], [0, 0, 1, 1, 2, 2])
    np.testing.assert_array_equal(order[inverse], np.arange(6))
    np.testing.assert_array_equal(order // 2, [0, 1, 1, 2, 0, 2])  # tokens keep their order
    uniform = jnp.full((8, 4), 0.25)
    balanced = jnp.array([[0, 1], [2, 3]] * 4, jnp.int32)
    np.testing.assert_allclose(load_balancing_loss(uniform, balanced), 1.0)
    skewed = jnp.zeros((8, 2), jnp.int32)  # every assignment to expert 0
    np.testing.assert_allclose(load_balancing_loss(uniform, skewed), 4 * 0.25)
    peaked = jnp.tile(jnp.array([[1.0, 0.0, 0.0, 0.0]]), (8, 1))
    np.testing.assert_allclose(load_balancing_loss(peaked, skewed), 4.0)  # the worst case


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dispatch_sums_each_tokens_row_gradients_without_a_scatter(dtype):
    """dispatch_tokens is jnp.take(tokens, order // k) forward; its transpose gathers each
    token's k row gradients and sums them in float32 in slot order, where jnp.take's would
    scatter-add them in an order XLA picks per program on GPU (the sharded MoE's dx then
    differed from the plain one's by up to 128 ulps on the H200)."""
    rng = np.random.default_rng(0)
    top_experts = jnp.asarray(rng.integers(0, 4, size=(10, 3)), jnp.int32)
    order, inverse, _ = permute_by_expert(top_experts, 4)
    tokens = jnp.asarray(rng.normal(size=(10, 8)), dtype)
    row_grads = jnp.asarray(rng.normal(size=(30, 8)), dtype)

    rows, vjp = jax.vjp(lambda t: dispatch_tokens(t, order, inverse, 3), tokens)
    np.testing.assert_array_equal(rows, jnp.take(tokens, order // 3, axis=0))
    (token_grads,) = vjp(row_grads)
    assert token_grads.dtype == dtype
    # The k gradients of a token, in slot order, summed in float32 and rounded once.
    by_slot = np.asarray(row_grads, np.float32)[np.asarray(inverse)].reshape(10, 3, 8)
    expected = ((by_slot[:, 0] + by_slot[:, 1]) + by_slot[:, 2]).astype(dtype)
    np.testing.assert_array_equal(np.asarray(token_grads), expected)
    backward = jax.make_jaxpr(vjp)(row_grads)
    assert "scatter" not in str(backward), backward


def test_dispatch_rejects_bad_arguments():
    order, inverse, _ = permute_by_expert(jnp.zeros((4, 2), jnp.int32), 3)
    tokens = jnp.zeros((4, 8))
    cases = [
        ((tokens, order, inverse, 0), "top_k must be a positive int"),
        ((tokens, order, inverse, 2.0), "top_k must be a positive int"),
        ((tokens[0], order, inverse, 2), "tokens must be"),
        ((tokens, order[:6], inverse, 2), r"order must be an int array of shape \(8,\)"),
        ((tokens, order, inverse.astype(jnp.float32), 2), "inverse must be an int array"),
        ((tokens, order, inverse, 3), r"order must be an int array of shape \(12,\)"),
    ]
    for arguments, message in cases:
        with pytest.raises(ValueError, match=message):
            dispatch_tokens(*arguments)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_permute_rows_transposes_by_a_gather(dtype):
    """permute_rows is jnp.take(rows, index) forward; its transpose is the gather by the
    inverse permutation (jnp.take's would be a scatter-add: an atomic loop for 16-bit rows on
    the GPU), with the same values, -0.0 kept."""
    rng = np.random.default_rng(1)
    order, inverse, _ = permute_by_expert(jnp.asarray(rng.integers(0, 4, (10, 3)), jnp.int32), 4)
    rows = jnp.asarray(rng.normal(size=(30, 8)), dtype)
    grads = jnp.asarray(rng.normal(size=(30, 8)), dtype).at[3, 2].set(-0.0)
    permuted, vjp = jax.vjp(lambda r: permute_rows(r, inverse, order), rows)
    np.testing.assert_array_equal(permuted, jnp.take(rows, inverse, axis=0))
    (row_grads,) = vjp(grads)
    _, take_vjp = jax.vjp(lambda r: jnp.take(r, inverse, axis=0), rows)
    np.testing.assert_array_equal(row_grads, take_vjp(grads)[0])
    assert row_grads.dtype == dtype
    # grads[3] is rows[inverse[3]]'s gradient; its -0.0 comes back as -0.0 (a scatter-add
    # onto zeros would give +0.0).
    negative_zero = np.asarray(row_grads, np.float32)[int(inverse[3]), 2]
    assert negative_zero == 0 and np.signbit(negative_zero)
    assert "scatter" not in str(jax.make_jaxpr(vjp)(grads))
    # 1-D (the router probabilities) too.
    probs = jnp.asarray(rng.uniform(size=30), jnp.float32)
    _, probs_vjp = jax.vjp(lambda p: permute_rows(p, order, inverse), probs)
    np.testing.assert_array_equal(probs_vjp(probs)[0], jnp.take(probs, inverse, axis=0))
    with pytest.raises(ValueError, match=r"index and inverse must both have shape \(30,\)"):
        permute_rows(rows, order[:5], inverse)
    with pytest.raises(ValueError, match="inverse must be an int array"):
        permute_rows(rows, order, inverse.astype(jnp.float32))


def test_expert_counts_equal_bincount_without_a_scatter():
    top_experts = jnp.asarray(np.random.default_rng(3).integers(0, 6, (50, 2)), jnp.int32)
    counts = expert_counts(top_experts, 8)  # experts 6 and 7 never chosen
    np.testing.assert_array_equal(counts, jnp.bincount(top_experts.reshape(-1), length=8))
    assert counts.dtype == jnp.int32
    assert "scatter" not in str(jax.make_jaxpr(lambda t: expert_counts(t, 8))(top_experts))
    order, inverse, group_sizes = permute_by_expert(top_experts, 8)
    np.testing.assert_array_equal(group_sizes, counts)
    np.testing.assert_array_equal(inverse, np.argsort(np.asarray(order)))


def test_combine_slots_sums_each_tokens_rows_in_slot_order():
    rng = np.random.default_rng(2)
    order, inverse, _ = permute_by_expert(jnp.asarray(rng.integers(0, 4, (10, 2)), jnp.int32), 4)
    expert_out = jnp.asarray(rng.normal(size=(20, 8)), jnp.bfloat16)
    y = combine_slots(expert_out, order, inverse, 2)
    by_slot = np.asarray(expert_out, np.float32)[np.asarray(inverse)].reshape(10, 2, 8)
    np.testing.assert_array_equal(y, (by_slot[:, 0] + by_slot[:, 1]).astype(jnp.bfloat16))
    _, vjp = jax.vjp(lambda e: combine_slots(e, order, inverse, 2), expert_out)
    assert "scatter" not in str(jax.make_jaxpr(vjp)(y))


def test_moe_with_a_recipe_trains():
    model = jq.nn.MoE(
        32, 64, 4, top_k=2, recipe=RECIPES["mxfp8"], dtype=jnp.bfloat16, rngs=nnx.Rngs(0)
    )
    kx, kt = jax.random.split(jax.random.key(8))
    x = jax.random.normal(kx, (2, 32, 32), jnp.float32)
    target = jnp.tanh(x @ jax.random.normal(kt, (32, 32)) * 0.3)
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        def loss_fn(model):
            y, aux_loss = model(x, return_aux_loss=True)
            return jnp.mean((y.astype(jnp.float32) - target) ** 2) + aux_loss

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(30)]
    assert losses[-1] < 0.25 * losses[0]
    router_grad = nnx.grad(lambda m: jnp.sum(m(x).astype(jnp.float32)))(model).router.kernel
    assert float(jnp.abs(router_grad[...]).max()) > 0  # the router learns through the probs


def test_bad_layer_arguments_are_named():
    cases = [
        (ValueError, "top_k", lambda: jq.nn.MoE(8, 8, 2, top_k=3, rngs=nnx.Rngs(0))),
        (ValueError, "num_experts", lambda: jq.nn.MoE(8, 8, 0, rngs=nnx.Rngs(0))),
        (
            ValueError,
            "activation",
            lambda: jq.nn.GroupedMLP(2, 8, 8, activation="x", rngs=nnx.Rngs(0)),
        ),
        (TypeError, "recipe", lambda: jq.nn.GroupedLinear(2, 8, 8, recipe="fp8", rngs=nnx.Rngs(0))),
        (ValueError, "in_features", lambda: jq.nn.GroupedLinear(2, 0, 8, rngs=nnx.Rngs(0))),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()
    with pytest.raises(ValueError, match="last dim"):
        jq.nn.MoE(8, 8, 2, rngs=nnx.Rngs(0))(jnp.ones((4, 6)))
