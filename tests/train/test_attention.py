"""`ModelConfig.attention`: which attention core the model runs, and its errors (CPU).

cuDNN's fused attention itself runs only on a CUDA GPU: test_attention_gpu.py compares it
with the plain core there.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_qtrain.train import cli
from jax_qtrain.train import model as model_lib
from jax_qtrain.train.model import ModelConfig, Transformer, attention_implementation

TINY = ModelConfig(
    d_model=32, num_layers=2, num_heads=2, seq_len=16, num_experts=4, expert_hidden=32
)


def test_auto_is_plain_off_gpu_and_gives_the_same_bits():
    assert jax.default_backend() != "gpu"
    assert TINY.attention == "auto"
    assert attention_implementation(TINY) == "plain"
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 256, jnp.int32)
    logits = {}
    for kind in ("auto", "plain"):
        model = Transformer(dataclasses.replace(TINY, attention=kind), nnx.Rngs(0))
        assert model.blocks[0].attention.implementation == "plain"
        logits[kind] = nnx.jit(lambda m, t: m(t)[0])(model, tokens)
    np.testing.assert_array_equal(logits["auto"], logits["plain"])


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({}, "cudnn"),
        ({"compute_dtype": "float32"}, "plain"),  # cuDNN's flash attention is 16-bit only
        ({"d_model": 36, "num_heads": 2}, "plain"),  # head size 18: not a multiple of 8
        ({"d_model": 512, "num_heads": 2}, "plain"),  # head size 256 > 128
    ],
)
def test_auto_on_a_gpu_takes_cudnn_where_it_applies(monkeypatch, changes, expected):
    monkeypatch.setattr(model_lib.jax, "default_backend", lambda: "gpu")
    config = dataclasses.replace(TINY, **changes)
    assert attention_implementation(config) == expected
    explicit = dataclasses.replace(config, attention="cudnn")
    if expected == "cudnn":
        assert attention_implementation(explicit) == "cudnn"
    else:
        with pytest.raises(ValueError, match="attention='cudnn' needs"):
            attention_implementation(explicit)


def test_cudnn_off_gpu_is_a_clear_error():
    config = dataclasses.replace(TINY, attention="cudnn")
    with pytest.raises(ValueError, match=r"attention='cudnn' needs a CUDA GPU.*backend 'cpu'"):
        Transformer(config, nnx.Rngs(0))
    assert attention_implementation(dataclasses.replace(TINY, attention="plain")) == "plain"


def test_bad_attention_kind():
    with pytest.raises(ValueError, match=r"attention must be one of \['auto', 'plain', 'cudnn'\]"):
        dataclasses.replace(TINY, attention="flash")


@pytest.mark.parametrize(
    "options, kind",
    [([], "auto"), (["--attention", "plain"], "plain"), (["--attention", "cudnn"], "cudnn")],
)
def test_attention_option(options, kind):
    parser = argparse.ArgumentParser()
    cli._add_config_options(parser)
    config = cli._config_from_args(parser.parse_args(["--preset", "h200", *options]))
    assert config.model.attention == kind
