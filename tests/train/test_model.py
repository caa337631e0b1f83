"""The transformer: shapes, causality, pluggable feed-forward, quantized projections."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_qtrain as jq
from jax_qtrain.train.config import PRESETS
from jax_qtrain.train.model import DenseFeedForward, ModelConfig, Transformer, count_parameters

TINY = ModelConfig(
    d_model=32, num_layers=2, num_heads=2, seq_len=16, num_experts=4, expert_hidden=32
)


def _tokens(batch: int = 2, seq: int = 16, seed: int = 0) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (batch, seq), 0, 256, jnp.int32)


@nnx.jit
def _forward(model: Transformer, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    return model(tokens)


def test_forward_shapes_and_moe_aux_loss():
    model = Transformer(TINY, nnx.Rngs(0))
    logits, aux_loss = _forward(model, _tokens())
    assert logits.shape == (2, 16, 256) and logits.dtype == jnp.float32
    # Two MoE layers, each E·Σ f·P ≥ 1 (1 only for perfectly uniform routing).
    assert aux_loss.shape == () and 2.0 <= float(aux_loss) < 8.0
    assert isinstance(model.blocks[0].feed_forward, jq.nn.MoE)


def test_dense_feed_forward_has_no_aux_loss():
    model = Transformer(ModelConfig(**{**TINY.__dict__, "feed_forward": "dense"}), nnx.Rngs(0))
    assert isinstance(model.blocks[0].feed_forward, DenseFeedForward)
    _, aux_loss = _forward(model, _tokens())
    assert float(aux_loss) == 0.0
    assert count_parameters(model) < count_parameters(Transformer(TINY, nnx.Rngs(0)))


def test_attention_is_causal():
    model = Transformer(TINY, nnx.Rngs(0))
    tokens = _tokens()
    changed = tokens.at[:, 10].set((tokens[:, 10] + 1) % 256)
    before, _ = _forward(model, tokens)
    after, _ = _forward(model, changed)
    np.testing.assert_array_equal(before[:, :10], after[:, :10])
    assert not np.array_equal(before[:, 10:], after[:, 10:])


def _loss(model: Transformer, tokens: jax.Array) -> jax.Array:
    logits, aux_loss = model(tokens)
    return jnp.mean(logits**2) + aux_loss


@pytest.mark.parametrize("scan_layers", [False, True])
def test_projections_and_experts_quantize_under_autocast(scan_layers):
    model = Transformer(dataclasses.replace(TINY, scan_layers=scan_layers), nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def loss_of_state(state, tokens):
        return _loss(nnx.merge(graphdef, state), tokens)

    tokens = _tokens()
    plain = jq.saved_residuals(loss_of_state, state, tokens)
    with jq.autocast(jq.Float8CurrentScaling()):
        quantized = jq.saved_residuals(loss_of_state, state, tokens)
        quantized_loss = jax.jit(loss_of_state)(state, tokens)
    assert not any(r.name.startswith("qtrain/") for r in plain)
    fp8 = [r for r in quantized if r.dtype == jnp.float8_e4m3fn]
    assert not [r for r in plain if r.dtype == jnp.float8_e4m3fn]
    if scan_layers:
        # The scan saves its body's residuals stacked over the layers, reported by JAX as
        # "output of scan" (the names stay inside the body, where remat policies read them).
        assert len(fp8) >= 3 and {r.shape[0] for r in fp8} == {TINY.num_layers}
    else:
        names = [r.name for r in quantized]
        # qkv and out per layer (dense), the experts' FC1 per layer (grouped MLP).
        assert names.count("qtrain/input") >= 2 * TINY.num_layers
        assert names.count("qtrain/fc1_input") >= TINY.num_layers
        assert len(fp8) >= 3 * TINY.num_layers
    assert float(quantized_loss) != float(jax.jit(loss_of_state)(state, tokens))


def _loss_grads_and_statistics(config: ModelConfig, recipe) -> tuple:
    model = Transformer(config, nnx.Rngs(0))

    def loss(model):
        logits, aux_loss = model(_tokens(4))
        return jnp.mean(logits**2) + aux_loss

    with jq.autocast(recipe):
        value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
    return value, grads, nnx.state(model, nnx.Intermediate)


@pytest.mark.parametrize("recipe", [None, jq.MXFP8BlockScaling()], ids=["bf16", "mxfp8"])
def test_scanned_layers_compute_the_loop(recipe):
    """One lax.scan over the stacked blocks computes the Python loop over them. With float32
    activations: the loss is the same bits, the gradients agree to float32 summation order (XLA
    sums the tied embedding's two uses in another order), and each layer's sown MoE statistics
    come back to its own block. With bfloat16 activations only the loss is compared (to 2e-3):
    XLA:CPU skips a bfloat16 rounding between unrolled layers that the scan's carry keeps, and
    through the quantizers one rounding moves the gradients by percents."""
    three = dataclasses.replace(TINY, num_layers=3)
    for scan_layers in (True, False):
        model = Transformer(dataclasses.replace(three, scan_layers=scan_layers), nnx.Rngs(0))
        graphdef, state = nnx.split(model)
        jaxpr = jax.make_jaxpr(lambda s, g=graphdef: nnx.merge(g, s)(_tokens()))(state)
        assert (" scan[" in str(jaxpr)) == scan_layers
    results = {
        (dtype, scan): _loss_grads_and_statistics(
            dataclasses.replace(three, compute_dtype=dtype, scan_layers=scan), recipe
        )
        for dtype in ("float32", "bfloat16")
        for scan in (False, True)
    }
    loop, scan = results["float32", False], results["float32", True]
    np.testing.assert_array_equal(scan[0], loop[0])
    assert jax.tree.structure(scan) == jax.tree.structure(loop)
    for got, want in zip(jax.tree.leaves(scan), jax.tree.leaves(loop), strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape)
        if want.dtype == jnp.int32:  # tokens per expert: the same routing, layer by layer
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    blocks = scan[2]["blocks"].values()
    counts = [np.asarray(b["feed_forward"]["tokens_per_expert"][...]) for b in blocks]
    assert len(counts) == 3 and not all(np.array_equal(counts[0], c) for c in counts[1:])
    np.testing.assert_allclose(
        results["bfloat16", True][0], results["bfloat16", False][0], rtol=2e-3
    )


def test_recompute_attention_saves_q_k_v_instead_of_the_probabilities():
    """With `recompute_attention` the backward keeps no (batch, heads, seq, seq) array (the
    softmax is recomputed from q, k there), and the loss and gradients are the same bits."""
    seq = TINY.seq_len
    results = {}
    for recompute in (False, True):
        config = dataclasses.replace(TINY, recompute_attention=recompute)
        graphdef, state = nnx.split(Transformer(config, nnx.Rngs(0)))

        def loss_of_state(state, graphdef=graphdef):
            return _loss(nnx.merge(graphdef, state), _tokens())

        residuals = jq.saved_residuals(loss_of_state, state)
        square = [r for r in residuals if r.shape[-2:] == (seq, seq)]
        # Saved, per layer (jax 0.11.2): the broadcast causal mask, the masked scores, their
        # exponentials (float32) and the compute-dtype probabilities.
        if recompute:
            assert not square, square
        else:
            assert len(square) == 4 * TINY.num_layers, [(r.shape, r.dtype) for r in square]
        for scan in (False, True):  # the h200 preset scans its blocks
            scanned = dataclasses.replace(config, scan_layers=scan)
            results[recompute, scan] = _loss_grads_and_statistics(scanned, None)
    for scan in (False, True):
        recomputed, saved = (jax.tree.leaves(results[r, scan]) for r in (True, False))
        for got, want in zip(recomputed, saved, strict=True):
            np.testing.assert_array_equal(got, want)


def _float8_residuals(config: ModelConfig, recipe) -> list:
    graphdef, state = nnx.split(Transformer(config, nnx.Rngs(0)))

    def loss_of_state(state):
        return _loss(nnx.merge(graphdef, state), _tokens())

    with jq.autocast(recipe):
        residuals = jq.saved_residuals(loss_of_state, state)
    return [r for r in residuals if r.dtype == jnp.float8_e4m3fn]


@pytest.mark.parametrize("scan_layers", [False, True])
def test_high_precision_layers_leave_the_last_blocks_unquantized(scan_layers):
    """`high_precision_layers=k` runs the last k blocks as `autocast(None)` does whatever the
    recipe: all of them give the unquantized model's loss, gradients and statistics bit for bit
    (so their backward is not quantized either); one of three keeps exactly the first two
    blocks' float8 residuals (a scan of two layers when the blocks are scanned) and a loss
    between neither of the others'."""
    three = dataclasses.replace(TINY, num_layers=3, scan_layers=scan_layers)
    recipe = jq.MXFP8BlockScaling()
    every = _loss_grads_and_statistics(dataclasses.replace(three, high_precision_layers=3), recipe)
    unquantized = _loss_grads_and_statistics(three, None)
    assert jax.tree.structure(every) == jax.tree.structure(unquantized)
    for got, want in zip(jax.tree.leaves(every), jax.tree.leaves(unquantized), strict=True):
        np.testing.assert_array_equal(got, want)

    last = dataclasses.replace(three, high_precision_layers=1)
    quantized_residuals = _float8_residuals(three, recipe)
    last_residuals = _float8_residuals(last, recipe)
    assert quantized_residuals and not _float8_residuals(three, None)
    if scan_layers:
        assert {r.shape[0] for r in quantized_residuals} == {3}
        assert {r.shape[0] for r in last_residuals} == {2}
        assert len(last_residuals) == len(quantized_residuals)
    else:
        assert 3 * len(last_residuals) == 2 * len(quantized_residuals)
    losses = {
        float(_loss_grads_and_statistics(config, recipe)[0])
        for config in (three, last, dataclasses.replace(three, high_precision_layers=3))
    }
    assert len(losses) == 3, losses


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_heads": 3}, "not divisible"),
        ({"feed_forward": "conv"}, "feed_forward must be one of"),
        ({"experts_per_token": 5}, "experts_per_token"),
        ({"compute_dtype": "float7"}, "float7"),
        ({"scan_layers": "yes"}, "scan_layers must be a bool"),
        ({"recompute_attention": 1}, "recompute_attention must be a bool"),
        ({"high_precision_layers": 3}, r"high_precision_layers must be an int in 0\.\.num_layers"),
        ({"high_precision_layers": -1}, "high_precision_layers"),
        ({"high_precision_layers": True}, "high_precision_layers"),
    ],
)
def test_bad_model_config(changes, message):
    with pytest.raises((ValueError, TypeError), match=message):
        ModelConfig(**{**TINY.__dict__, **changes})


def test_h200_preset_model_shapes():
    config = PRESETS["h200"].model
    model = nnx.eval_shape(lambda: Transformer(config, nnx.Rngs(0)))  # no memory, no compute
    experts = model.blocks[0].feed_forward.experts
    assert experts.fc1_kernel.shape == (8, 512, 2 * 1024)
    assert 50_000_000 < count_parameters(model) < 60_000_000
