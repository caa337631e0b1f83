"""The transformer: shapes, causality, pluggable feed-forward, quantized projections."""

from __future__ import annotations

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


def test_projections_and_experts_quantize_under_autocast():
    model = Transformer(TINY, nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def loss_of_state(state, tokens):
        return _loss(nnx.merge(graphdef, state), tokens)

    tokens = _tokens()
    plain = jq.saved_residuals(loss_of_state, state, tokens)
    with jq.autocast(jq.Float8CurrentScaling()):
        quantized = jq.saved_residuals(loss_of_state, state, tokens)
        quantized_loss = jax.jit(loss_of_state)(state, tokens)
    assert not any(r.name.startswith("qtrain/") for r in plain)
    names = [r.name for r in quantized]
    # qkv and out per layer (dense), the experts' FC1 per layer (grouped MLP).
    assert names.count("qtrain/input") >= 2 * TINY.num_layers
    assert names.count("qtrain/fc1_input") >= TINY.num_layers
    assert float(quantized_loss) != float(jax.jit(loss_of_state)(state, tokens))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_heads": 3}, "not divisible"),
        ({"feed_forward": "conv"}, "feed_forward must be one of"),
        ({"experts_per_token": 5}, "experts_per_token"),
        ({"compute_dtype": "float7"}, "float7"),
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
