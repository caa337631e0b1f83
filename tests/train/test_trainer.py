"""One run in-process: files, metrics, checkpoints, summary, resume rules, restore_model."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_qtrain.train.config import TrainConfig, recipe_for
from jax_qtrain.train.trainer import (
    CONFIG_FILE,
    METRICS_FILE,
    OVERFITTING_TOLERANCE,
    SUMMARY_FILE,
    RunError,
    best_evaluation,
    latest_checkpoint_step,
    learning_rate_schedule,
    overfitting_note,
    read_metrics,
    restore_model,
    train,
)
from tests.train.conftest import TINY, h200_2000_step_summary


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("run") / "mxfp8"
    summary = train(dataclasses.replace(TINY, recipe="mxfp8"), out, progress=False, corpus=corpus)
    return out, summary


def test_run_writes_config_metrics_checkpoints_and_summary(finished_run, corpus):
    out, summary = finished_run
    saved = json.loads((out / CONFIG_FILE).read_text())
    assert TrainConfig.from_dict(saved["config"]) == dataclasses.replace(TINY, recipe="mxfp8")
    assert saved["corpus"] == corpus.fingerprint()

    records = read_metrics(out)
    train_records = [r for r in records if r["kind"] == "train"]
    eval_records = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train_records] == list(range(1, TINY.steps + 1))
    assert [r["step"] for r in eval_records] == [4, 8]
    schedule = learning_rate_schedule(TINY)
    for r in train_records:
        assert np.isfinite(r["loss"]) and r["loss"] > 0
        assert r["lr"] == pytest.approx(float(schedule(r["step"] - 1)))
        assert r["tokens_per_s"] == pytest.approx(TINY.tokens_per_step / r["step_time_s"])
        # Two experts, top-1: the busiest one gets between half and all of the tokens.
        assert 0.5 <= r["max_expert_share"] <= 1.0
        assert 0.0 < r["aux_loss"] < 2.0  # E·Σ f·P of one layer, about 1 when balanced
    # The untrained model predicts bytes about uniformly: loss ≈ ln 256 at the start.
    assert train_records[0]["loss"] == pytest.approx(np.log(256), rel=0.05)

    assert latest_checkpoint_step(out) == TINY.steps
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["4", "8"]

    written = json.loads((out / SUMMARY_FILE).read_text())
    assert written == summary.to_dict()
    assert summary.final_train_loss == train_records[-1]["loss"]
    assert summary.final_val_loss == eval_records[-1]["val_loss"]
    assert summary.recipe == "mxfp8" and summary.steps == TINY.steps
    best = min(eval_records, key=lambda r: r["val_loss"])
    assert (summary.best_val_loss, summary.best_val_step) == (best["val_loss"], best["step"])
    assert summary.epochs == TINY.steps * TINY.tokens_per_step / len(corpus.train.data)


def test_best_evaluation_skips_nan_and_takes_the_first_of_equal_losses():
    records = [
        {"step": 4, "val_loss": float("nan")},
        {"step": 8, "val_loss": 2.0},
        {"step": 12, "val_loss": 1.5},
        {"step": 16, "val_loss": 1.5},
        {"step": 20, "val_loss": 1.7},
    ]
    assert best_evaluation(records) == (1.5, 12)
    nan, step = best_evaluation([{"step": 4, "val_loss": float("nan")}] * 2)
    assert np.isnan(nan) and step == 4
    with pytest.raises(ValueError, match="eval_records: need at least one evaluation"):
        best_evaluation([])


def test_overfitting_note_names_the_best_step_past_the_tolerance():
    # The h200 preset's old 2000 steps on the H200 image's corpus (docs/training.md).
    note = overfitting_note(h200_2000_step_summary(1.118))
    assert note is not None
    assert "bf16: the final validation loss 1.1180 is 24.2% above the run's best" in note
    assert "0.9000 at step 1000 (6.5 epochs" in note
    assert "--steps" in note
    # Within the tolerance, at the best, or NaN: nothing to say.
    assert overfitting_note(h200_2000_step_summary(0.900 * (1 + OVERFITTING_TOLERANCE))) is None
    assert overfitting_note(h200_2000_step_summary(0.9)) is None
    assert overfitting_note(h200_2000_step_summary(float("nan"))) is None


def test_restore_model_has_the_trained_weights(finished_run, corpus):
    out, summary = finished_run
    model = restore_model(out)
    windows = corpus.validation_windows(TINY.eval_windows, TINY.model.seq_len)
    tokens = jnp.asarray(windows, jnp.int32)
    from jax_qtrain.ops.context import autocast

    @nnx.jit
    def loss(model, tokens):
        from jax_qtrain.train.trainer import next_byte_loss

        return next_byte_loss(model, tokens)[0]

    with autocast(recipe_for("mxfp8")):
        value = float(loss(model, tokens))
    # The eval step batches the windows differently (padding the last batch), so equal up to
    # summation order; an untrained model is far off (its loss is near ln 256 = 5.55).
    assert value == pytest.approx(summary.final_val_loss, rel=1e-3)
    assert summary.final_val_loss < 0.98 * np.log(256)


def test_a_new_run_refuses_a_directory_that_holds_one(finished_run, corpus):
    out, _ = finished_run
    before = sorted(p.name for p in out.rglob("*"))
    with pytest.raises(RunError, match="already holds a run"):
        train(dataclasses.replace(TINY, recipe="mxfp8"), out, progress=False, corpus=corpus)
    assert sorted(p.name for p in out.rglob("*")) == before


def test_resume_with_different_options_is_refused(finished_run, corpus):
    out, _ = finished_run
    with pytest.raises(RunError, match=r"steps: saved 8, given 9"):
        train(
            dataclasses.replace(TINY, recipe="mxfp8", steps=9),
            out,
            resume=True,
            progress=False,
            corpus=corpus,
        )


def test_resuming_a_finished_run_changes_nothing(finished_run, corpus):
    out, summary = finished_run
    metrics_before = (out / METRICS_FILE).read_text()
    resumed = train(
        dataclasses.replace(TINY, recipe="mxfp8"), out, resume=True, progress=False, corpus=corpus
    )
    before = [json.loads(line) for line in metrics_before.splitlines()]
    after = read_metrics(out)
    assert after == [*before, {"kind": "resume", "step": TINY.steps}]
    assert resumed.final_val_loss == summary.final_val_loss


def test_resume_without_a_checkpoint_is_refused(tmp_path, corpus):
    with pytest.raises(RunError, match="no training run"):
        train(TINY, tmp_path / "nothing", resume=True, progress=False, corpus=corpus)
    assert not (tmp_path / "nothing").exists()
    (tmp_path / "started").mkdir()
    (tmp_path / "started" / CONFIG_FILE).write_text(
        json.dumps({"config": TINY.to_dict(), "corpus": corpus.fingerprint()})
    )
    with pytest.raises(RunError, match="no finished checkpoint"):
        train(TINY, tmp_path / "started", resume=True, progress=False, corpus=corpus)
    assert sorted(p.name for p in (tmp_path / "started").iterdir()) == [CONFIG_FILE]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"recipe": "fp16"}, "unknown recipe 'fp16'"),
        ({"steps": 0}, "steps must be a positive integer"),
        ({"warmup_steps": 8}, "warmup_steps"),
        ({"learning_rate": -1.0}, "learning_rate"),
    ],
)
def test_bad_train_config(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY, **changes)
