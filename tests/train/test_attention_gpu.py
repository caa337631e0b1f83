"""cuDNN's fused attention against the plain core on the GPU (`python3 -m pytest -m gpu`).

The h200 preset's shapes (batch 8 of its 64, 8 heads of 64, 512 positions, bf16): the outputs
and the gradients of q, k and v agree to bf16 rounding, and a model built with attention="auto"
runs cuDNN there.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_qtrain.train import PRESETS
from jax_qtrain.train import model as model_lib

pytestmark = pytest.mark.gpu


def _qkv(batch=8, seq=512, heads=8, head_dim=64):
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(k, (batch, seq, heads, head_dim), jnp.bfloat16) for k in keys]


def _relative_error(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def test_cudnn_attention_matches_the_plain_core():
    q, k, v = _qkv()
    cotangent = jax.random.normal(jax.random.key(1), q.shape, jnp.bfloat16)
    results = {}
    for name, core in (
        ("plain", model_lib._causal_attention),
        ("cudnn", model_lib._cudnn_causal_attention),
    ):

        @jax.jit
        def forward_and_backward(q, k, v, core=core):
            out, vjp = jax.vjp(core, q, k, v)
            return (out, *vjp(cotangent))

        results[name] = forward_and_backward(q, k, v)
    for index, what in enumerate(("out", "dq", "dk", "dv")):
        error = _relative_error(results["cudnn"][index], results["plain"][index])
        # Both round the probabilities to bf16 before the value product; the sums differ in
        # order only. A wrong mask or scale gives errors of order 1.
        assert error < 2e-2, (what, error)
    # Causality: the first position attends to itself only.
    np.testing.assert_allclose(
        np.asarray(results["cudnn"][0][:, 0], np.float32),
        np.asarray(v[:, 0], np.float32),
        rtol=1e-2,
        atol=1e-2,
    )


def test_auto_runs_cudnn_in_the_h200_model():
    # The dense feed-forward: with the MoE, bf16-level differences flip some tokens' top-2
    # experts, and whole rows of the logits differ (7% relative in a first H200 run).
    config = dataclasses.replace(PRESETS["h200"].model, num_layers=1, feed_forward="dense")
    assert model_lib.attention_implementation(config) == "cudnn"
    tokens = jax.random.randint(jax.random.key(0), (2, config.seq_len), 0, 256, jnp.int32)
    x = jax.random.normal(jax.random.key(1), (2, config.seq_len, config.d_model), jnp.bfloat16)
    logits, attended = {}, {}
    for kind in ("auto", "plain"):
        model = model_lib.Transformer(dataclasses.replace(config, attention=kind), nnx.Rngs(0))
        assert model.blocks[0].attention.implementation == ("cudnn" if kind == "auto" else kind)
        logits[kind] = nnx.jit(lambda m, t: m(t)[0])(model, tokens)
        attended[kind] = nnx.jit(lambda m, x: m.blocks[0].attention(x))(model, x)
        assert bool(jnp.isfinite(logits[kind]).all()), kind
    attention_error = _relative_error(attended["auto"], attended["plain"])
    logits_error = _relative_error(logits["auto"], logits["plain"])
    print(f"relative error: attention layer {attention_error:.2e}, logits {logits_error:.2e}")
    assert attention_error < 2e-2
    assert logits_error < 5e-2
    graphdef, state = nnx.split(model_lib.Transformer(config, nnx.Rngs(0)))
    forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens)[0])
    text = forward.lower(state, tokens).compile().as_text()
    assert "cudnn" in text.lower(), "no cuDNN custom call in the compiled model"
