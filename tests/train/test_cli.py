"""`jax-qtrain train` / `compare` on bad input: one clear line on stderr, exit status 2, and
nothing written."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jax_qtrain.__main__ import main
from jax_qtrain.train import cli
from jax_qtrain.train.config import PRESETS
from jax_qtrain.train.trainer import CONFIG_FILE
from tests.train.conftest import TINY_OPTIONS, h200_2000_step_summary


def _files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def _run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        status = main(argv)
    except SystemExit as exit_:  # argparse's errors
        status = exit_.code
    return status, capsys.readouterr().err


def test_unknown_recipe(tmp_path, capsys):
    status, err = _run(["train", "--recipe", "fp16", "--out", str(tmp_path / "out")], capsys)
    assert status == 2
    assert "invalid choice: 'fp16'" in err and "nvfp4" in err
    assert not (tmp_path / "out").exists()


def test_unknown_recipe_in_compare(tmp_path, capsys):
    argv = ["compare", "--recipes", "bf16,fp4,mxfp8", "--out", str(tmp_path / "out")]
    status, err = _run(argv, capsys)
    assert status == 2
    assert "unknown recipe 'fp4'" in err
    assert not (tmp_path / "out").exists()


def test_resume_of_a_missing_run(tmp_path, capsys):
    status, err = _run(["train", "--resume", "--out", str(tmp_path / "none")], capsys)
    assert status == 2
    assert err.strip().endswith(f"no training run in {tmp_path / 'none'} (no config.json)")
    assert not (tmp_path / "none").exists()


def test_resume_needs_out(capsys):
    status, err = _run(["train", "--resume"], capsys)
    assert status == 2 and "--resume needs --out" in err


def test_resume_without_a_finished_checkpoint(tmp_path, capsys, corpus):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints" / "4.orbax-checkpoint-tmp-1").mkdir(parents=True)  # an interrupted save
    (out / CONFIG_FILE).write_text(
        json.dumps({"config": PRESETS["cpu"].to_dict(), "corpus": corpus.fingerprint()})
    )
    before = _files_under(out)
    status, err = _run(["train", "--resume", "--out", str(out)], capsys)
    assert status == 2 and "no finished checkpoint" in err
    assert _files_under(out) == before


def test_output_under_a_file(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    status, err = _run(["train", "--out", str(tmp_path / "file" / "run")], capsys)
    assert status == 2 and "is not a directory" in err
    status, err = _run(["train", "--out", str(tmp_path / "file")], capsys)
    assert status == 2 and "exists and is not a directory" in err
    assert _files_under(tmp_path) == ["file"]


def test_output_on_a_read_only_file_system(capsys):
    # /proc refuses new files even to root, for whom permission bits do not count.
    status, err = _run(["train", "--out", "/proc/jax-qtrain-run"], capsys)
    assert status == 2 and "/proc/jax-qtrain-run is not writable" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits")
def test_output_in_a_read_only_directory(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        status, err = _run(["compare", "--out", str(locked / "cmp")], capsys)
    finally:
        locked.chmod(0o700)
    assert status == 2 and "not writable" in err
    assert _files_under(locked) == []


def test_a_directory_that_holds_a_run(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / CONFIG_FILE).write_text("{}")
    status, err = _run(["train", "--out", str(out)], capsys)
    assert status == 2 and "already holds a run; pass --resume" in err
    assert _files_under(out) == [CONFIG_FILE]


def test_compare_into_a_non_empty_directory(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    status, err = _run(["compare", "--recipes", "bf16", "--out", str(tmp_path)], capsys)
    assert status == 2 and "is not empty" in err
    assert _files_under(tmp_path) == ["keep.txt"]


@pytest.mark.parametrize(
    "options, message",
    [
        (["--steps", "0"], "steps must be a positive integer"),
        (["--heads", "3"], "not divisible by 3 heads"),
        (["--feed-forward", "conv"], "feed_forward must be one of"),
    ],
)
def test_bad_configuration_values(tmp_path, capsys, options, message):
    status, err = _run(["train", *TINY_OPTIONS, *options, "--out", str(tmp_path / "o")], capsys)
    assert status == 2 and message in err
    assert not (tmp_path / "o").exists()


def test_console_script_reports_errors_on_stderr(tmp_path):
    script = Path(sys.executable).parent / "jax-qtrain"
    assert script.exists(), "pip install -e . creates the jax-qtrain console script"
    result = subprocess.run(
        [str(script), "train", "--resume", "--out", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert "jax-qtrain: error: no training run in" in result.stderr


@pytest.mark.parametrize(
    "options, scan_layers", [([], False), (["--scan-layers"], True), (["--no-scan-layers"], False)]
)
def test_scan_layers_option(options, scan_layers):
    parser = argparse.ArgumentParser()
    cli._add_config_options(parser)
    config = cli._config_from_args(parser.parse_args(["--preset", "h200", *options]))
    assert config.model.scan_layers is scan_layers
    assert config.model.num_layers == PRESETS["h200"].model.num_layers


@pytest.mark.parametrize(
    "options, recompute",
    [([], False), (["--recompute-attention"], True), (["--no-recompute-attention"], False)],
)
def test_recompute_attention_option(options, recompute):
    parser = argparse.ArgumentParser()
    cli._add_config_options(parser)
    config = cli._config_from_args(parser.parse_args(["--preset", "h200", *options]))
    assert config.model.recompute_attention is recompute


def test_high_precision_layers_option():
    parser = argparse.ArgumentParser()
    cli._add_config_options(parser)
    config = cli._config_from_args(parser.parse_args(["--preset", "h200"]))
    assert config.model.high_precision_layers == 0
    config = cli._config_from_args(
        parser.parse_args(["--preset", "h200", "--high-precision-layers", "1"])
    )
    assert config.model.high_precision_layers == 1
    with pytest.raises(
        ValueError, match=r"high_precision_layers must be an int in 0\.\.num_layers"
    ):
        cli._config_from_args(
            parser.parse_args(["--preset", "h200", "--high-precision-layers", "5"])
        )


@pytest.mark.parametrize(
    "options, message",
    [
        (["--seeds", "0,0"], "a seed is listed twice in [0, 0]"),
        (["--seeds", "0,-1"], "seeds must be one or more integers >= 0, got [0, -1]"),
        (["--seeds", "0,1", "--seed", "2"], "give --seed or --seeds, not both"),
    ],
)
def test_bad_seeds_in_compare(tmp_path, capsys, options, message):
    status, err = _run(
        ["compare", "--recipes", "bf16", "--out", str(tmp_path / "out"), *options], capsys
    )
    assert status == 2 and message in err, err
    assert not (tmp_path / "out").exists()


def test_seeds_that_are_not_integers(tmp_path, capsys):
    status, err = _run(["compare", "--seeds", "0,x", "--out", str(tmp_path / "out")], capsys)
    assert status == 2 and "seeds must be comma-separated integers, got '0,x'" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("final_val_loss, noted", [(1.118, True), (0.905, False)])
def test_train_notes_a_run_that_ends_above_its_best_validation_loss(
    tmp_path, capsys, monkeypatch, final_val_loss, noted
):
    # The note is the CLI's (on stderr even with --no-progress); the run itself is stubbed out
    # with the summary of the h200 preset's old 2000 steps (docs/training.md).
    from jax_qtrain.train import trainer

    def finished_run(config, out, **kwargs):
        return h200_2000_step_summary(final_val_loss, recipe=config.recipe)

    monkeypatch.setattr(trainer, "train", finished_run)
    status, err = _run(["train", "--out", str(tmp_path / "run"), "--no-progress"], capsys)
    assert status == 0
    note = "jax-qtrain: note: bf16: the final validation loss 1.1180 is 24.2% above the run's best"
    assert (note in err) == noted
    assert ("fewer --steps" in err) == noted
