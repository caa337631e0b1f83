"""`jax-qtrain compare --seeds`: one comparison per seed, and each recipe's gaps seed by seed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jax_qtrain.__main__ import main
from jax_qtrain.train.compare import JSON_FILE, PLOT_FILE, TABLE_FILE
from tests.train.conftest import TINY_OPTIONS

SEEDS = (3, 5)
RECIPES = ("bf16", "fp8")


def test_compare_over_seeds_tabulates_each_seeds_gap(tmp_path, capsys):
    out = tmp_path / "compare"
    argv = ["compare", "--recipes", ",".join(RECIPES), "--seeds", "3,5", "--out", str(out)]
    assert main([*argv, *TINY_OPTIONS, "--steps=4", "--eval-every=4", "--no-progress"]) == 0

    per_seed = {}
    for seed in SEEDS:
        seed_dir = out / f"seed-{seed}"
        assert (seed_dir / PLOT_FILE).read_bytes()[:4] == b"\x89PNG"
        per_seed[seed] = {
            r["recipe"]: r for r in json.loads((seed_dir / JSON_FILE).read_text())["rows"]
        }
        for recipe in RECIPES:
            config = json.loads((seed_dir / recipe / "config.json").read_text())["config"]
            assert config["seed"] == seed and config["recipe"] == recipe
    # Other seeds, other initial weights and batches: other losses.
    assert per_seed[3]["bf16"]["final_val_loss"] != per_seed[5]["bf16"]["final_val_loss"]

    summary = json.loads((out / JSON_FILE).read_text())
    assert summary["seeds"] == list(SEEDS)
    rows = {r["recipe"]: r for r in summary["rows"]}
    assert list(rows) == list(RECIPES)
    fp8_gaps = [per_seed[seed]["fp8"]["val_gap_vs_bf16"] for seed in SEEDS]
    assert rows["fp8"]["val_gaps_vs_bf16"] == fp8_gaps
    assert rows["fp8"]["mean_val_gap_vs_bf16"] == pytest.approx(np.mean(fp8_gaps))
    assert rows["fp8"]["worst_val_gap_vs_bf16"] == max(fp8_gaps)
    assert rows["bf16"]["val_gaps_vs_bf16"] == [0.0, 0.0]
    assert rows["fp8"]["final_val_losses"] == [per_seed[s]["fp8"]["final_val_loss"] for s in SEEDS]

    table = (out / TABLE_FILE).read_text()
    assert capsys.readouterr().out.startswith(table)
    gaps = " / ".join(f"{100 * gap:+.2f}%" for gap in fp8_gaps)
    assert f"| {gaps} | {100 * np.mean(fp8_gaps):+.2f}% |" in table
