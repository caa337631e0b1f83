"""A run killed with SIGKILL mid-way and restarted with --resume reproduces the losses of an
uninterrupted run bit for bit (NVFP4: stochastic rounding and the Hadamard transform included)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.train.conftest import TINY_OPTIONS

STEPS = 30
OPTIONS = [
    *TINY_OPTIONS,
    "--recipe=nvfp4",
    f"--steps={STEPS}",
    "--eval-every=8",
    "--checkpoint-every=4",
    "--no-progress",
]


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "jax_qtrain", "train", *args]


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # the line being written
            pass
    return records


def _losses(out: Path) -> list[tuple]:
    return [
        (r["kind"], r["step"], r.get("loss"), r.get("val_loss"))
        for r in _records(out)
        if r["kind"] in ("train", "eval")
    ]


@pytest.mark.slow
def test_sigkill_then_resume_reproduces_the_uninterrupted_losses(tmp_path):
    # The three runs compile the same programs: they share the suite's persistent compilation
    # cache (tests/conftest.py exports it to subprocesses), so the later ones load the same
    # executables (which cannot change a loss) instead of recompiling.
    reference = tmp_path / "reference"
    subprocess.run(_command(*OPTIONS, f"--out={reference}"), check=True, timeout=300)

    interrupted = tmp_path / "interrupted"
    process = subprocess.Popen(_command(*OPTIONS, f"--out={interrupted}"))
    try:
        deadline = time.monotonic() + 300
        while sum(r["kind"] == "train" for r in _records(interrupted)) < 10:
            assert process.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "the run made no progress"
            time.sleep(0.01)
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    steps_done = sum(r["kind"] == "train" for r in _records(interrupted))
    assert 10 <= steps_done < STEPS and not (interrupted / "summary.json").exists()

    subprocess.run(_command(f"--out={interrupted}", "--resume"), check=True, timeout=300)

    resumed_at = [r["step"] for r in _records(interrupted) if r["kind"] == "resume"]
    assert len(resumed_at) == 1 and 8 <= resumed_at[0] <= steps_done
    assert _losses(interrupted) == _losses(reference)
    assert len(_losses(reference)) == STEPS + STEPS // 8 + 1  # + the final evaluation
    summary = json.loads((interrupted / "summary.json").read_text())
    assert summary["final_val_loss"] == _losses(reference)[-1][3]
