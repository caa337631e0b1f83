"""The `h200` preset trains on the GPU (`python3 -m pytest -m gpu` on the H200).

The CPU suite trains the default preset; this is the larger model of `jax-qtrain train --preset
h200` (d_model 512, 8 experts top-2, 64 × 512-byte windows a step) with the kernels the GPU
dispatches to, for a few dozen steps per recipe, with two decoder layers instead of the
preset's four (every layer has the same shapes, so two exercise every kernel and GEMM shape the
preset does; the four-layer compiles took 74 s for bf16 to 257 s for NVFP4 on the H200, too long
for the suite's device call), run as one `lax.scan` (`ModelConfig.scan_layers`, off by default:
so the scan's path through the kernels is checked on the GPU too; `bench_train` runs the loop).
Asserted: every loss finite, the first one about ln 256 (an untrained
model predicts bytes about uniformly), the loss falling, and the quantized recipes within reach
of bf16 after the same steps.
`benchmarks/bench_train.py` runs the preset for its full comparison (loss gaps, step times).
"""

from __future__ import annotations

import math

import pytest

from jax_qtrain.train import PRESETS, RECIPE_NAMES
from jax_qtrain.train.trainer import read_metrics, train

STEPS = 40
NUM_LAYERS = 2
WARMUP_STEPS = 10  # the preset's 100 would not fit; TrainConfig wants warmup < steps

# `slow` makes tests/train/conftest.py start it first, so under xdist its five trainings (a few
# minutes on the H200, compiles included) overlap the rest of the GPU suite.
pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_h200_preset_trains_every_recipe(tmp_path, corpus):
    # One test for all recipes: xdist hands tests to workers one by one, and a shared fixture
    # would train every recipe again in each worker.
    config = PRESETS["h200"].replace(
        num_layers=NUM_LAYERS,
        scan_layers=True,
        steps=STEPS,
        warmup_steps=WARMUP_STEPS,
        eval_every=STEPS,
        checkpoint_every=STEPS,
        eval_windows=64,
    )
    tails = {}
    for name in RECIPE_NAMES:
        train(config.replace(recipe=name), tmp_path / name, progress=False, corpus=corpus)
        records = [r for r in read_metrics(tmp_path / name) if r["kind"] == "train"]
        losses = [r["loss"] for r in records]
        assert len(losses) == STEPS, name
        assert all(math.isfinite(loss) for loss in losses), (name, losses)
        assert losses[0] == pytest.approx(math.log(256), rel=0.05), name
        tails[name] = sum(losses[-5:]) / 5
        assert tails[name] < 0.85 * losses[0], (name, losses[0], losses[-5:])
        assert all(r["tokens_per_s"] > 0 for r in records), name
    # After 40 steps the curves are close; a broken quantized path (wrong
    # scales, a transposed operand) stays near ln 256 or diverges. Bound 10% (NVFP4 15%).
    for name, tail in tails.items():
        bound = 0.15 if name == "nvfp4" else 0.10
        assert tail <= (1 + bound) * tails["bf16"], (name, tail, tails["bf16"])
