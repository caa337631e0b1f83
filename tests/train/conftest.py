"""Fixtures for the trainer tests: a tiny configuration and the corpus, loaded once."""

from __future__ import annotations

import pytest

from jax_qtrain.train.config import TrainConfig
from jax_qtrain.train.corpus import load_corpus
from jax_qtrain.train.model import ModelConfig
from jax_qtrain.train.trainer import RunSummary

# A few seconds per run on a CPU, for tests of the machinery rather than of the numbers.
TINY_MODEL = ModelConfig(
    d_model=32,
    num_layers=1,
    num_heads=2,
    seq_len=16,
    num_experts=2,
    experts_per_token=1,
    expert_hidden=32,
)
TINY = TrainConfig(
    model=TINY_MODEL,
    steps=8,
    batch_size=4,
    warmup_steps=2,
    eval_every=4,
    eval_windows=6,
    checkpoint_every=4,
)

# The same, as command-line options.
TINY_OPTIONS = [
    "--d-model=32",
    "--layers=1",
    "--heads=2",
    "--seq-len=16",
    "--experts=2",
    "--experts-per-token=1",
    "--expert-hidden=32",
    "--batch-size=4",
    "--warmup-steps=2",
    "--eval-windows=6",
]


@pytest.fixture(scope="session")
def corpus():
    return load_corpus()


def pytest_collection_modifyitems(config, items):
    """Start this directory's slow tests (whole training runs) first, so that under
    `pytest -n 2` they overlap the rest of the suite instead of finishing last."""
    slow = [item for item in items if "slow" in item.keywords and "tests/train/" in item.nodeid]
    items[:] = slow + [item for item in items if item not in slow]


def h200_2000_step_summary(final_val_loss: float, recipe: str = "bf16") -> RunSummary:
    """The h200 preset's old 2000-step bf16 run on the H200 (docs/training.md): best validation
    loss 0.900 at step 1000, 6.5 epochs; `final_val_loss` as the test needs it."""
    return RunSummary(
        recipe=recipe,
        steps=2000,
        final_train_loss=0.24,
        final_val_loss=final_val_loss,
        best_val_loss=0.900,
        best_val_step=1000,
        epochs=6.5,
        step_time_s=0.026,
        tokens_per_s=1.2e6,
        compile_time_s=40.0,
        parameters=55_000_000,
    )
