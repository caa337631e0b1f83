"""`jax-qtrain compare` with the H200 preset: loss gaps and step times of every recipe on one GPU.

Trains the `h200` preset (d_model 512, 4 layers, 8 experts top-2, 64 × 512-byte windows a step)
once per recipe for `steps` steps and returns the comparison table (final losses, relative gap
to bf16, step time, tokens/s). The loss curves are in OUT/bench_train/comparison.png.

    python -m benchmarks.bench_train [--small] [--recipes R ...] [--scan-layers]
                                      [--recompute-attention] [--attention KIND] [--seeds N ...]
                                      [--high-precision-layers K] [--steps N] [--out DIR]

`--small` trains the CPU preset for 20 steps instead (a smoke test that runs anywhere);
`--scan-layers` runs the decoder blocks as one `lax.scan` (compile and step times against the
default Python loop); `--recompute-attention` saves only q, k, v for the attention's backward
(`ModelConfig.recompute_attention`); `--attention plain|cudnn|auto` picks the attention core
(`ModelConfig.attention`; auto, the default, is cuDNN's fused attention on a GPU); `--seeds`
sets the runs' initial weights and batch order (default 0; several seeds run the comparison
once per seed and add a table of each recipe's gap seed by seed, `compare_over_seeds`);
`--high-precision-layers K` leaves the last K blocks unquantized
(`ModelConfig.high_precision_layers`); `--steps` replaces the 300 steps (the h200 preset's
schedule is 1000).
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks.timing import device_description
from jax_qtrain.train import PRESETS, RECIPE_NAMES, compare
from jax_qtrain.train.compare import (
    check_seeds,
    compare_over_seeds,
    markdown_table,
    seed_gap_table,
)
from jax_qtrain.train.model import ATTENTION_KINDS, attention_implementation

H200_STEPS = 300  # five runs must fit the device time of one session


def main(
    out_dir: str | None = None,
    small: bool = False,
    recipes: Sequence[str] = RECIPE_NAMES,
    scan_layers: bool = False,
    recompute_attention: bool = False,
    attention: str = "auto",
    seeds: Sequence[int] = (0,),
    high_precision_layers: int = 0,
    steps: int | None = None,
) -> str:
    seeds = check_seeds(seeds)
    if small:
        config = PRESETS["cpu"].replace(steps=20, eval_every=10, checkpoint_every=20)
    else:
        steps = H200_STEPS if steps is None else steps
        config = PRESETS["h200"].replace(
            steps=steps,
            eval_every=max(1, steps // 4),
            checkpoint_every=steps,
            warmup_steps=min(PRESETS["h200"].warmup_steps, steps // 2),
        )
    config = config.replace(
        scan_layers=scan_layers, recompute_attention=recompute_attention, attention=attention
    ).replace(seed=seeds[0], high_precision_layers=high_precision_layers)
    unknown = sorted(set(recipes) - set(RECIPE_NAMES))
    if unknown or not recipes:
        raise ValueError(
            f"recipes must be a non-empty subset of {RECIPE_NAMES}, got {list(recipes)}"
        )
    base = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="bench_train-"))
    runs = base / "bench_train"
    if len(seeds) > 1:
        summary = compare_over_seeds(config, list(recipes), seeds, runs, progress=True)
        per_seed = [
            f"seed {seed}:\n\n" + (runs / f"seed-{seed}" / "comparison.md").read_text()
            for seed in seeds
        ]
        table = seed_gap_table(summary) + "\n" + "\n".join(per_seed)
    else:
        table = markdown_table(compare(config, list(recipes), runs, progress=True))
    model = config.model
    text = (
        f"`jax-qtrain compare`, preset {'cpu' if small else 'h200'}: {config.steps} steps × "
        f"{config.tokens_per_step} bytes, d_model {model.d_model}, {model.num_layers} layers "
        f"({'one scan' if model.scan_layers else 'a Python loop'}"
        f"{', attention recomputed' if model.recompute_attention else ''}"
        f"{f', last {high_precision_layers} unquantized' if high_precision_layers else ''}, "
        f"attention {model.attention} → {attention_implementation(model)}), "
        f"{model.num_experts} experts top-{model.experts_per_token}, "
        f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}, "
        f"{device_description()}\n\n" + table
    )
    (base / "bench_train.md").write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--recipes", nargs="+", default=list(RECIPE_NAMES), choices=RECIPE_NAMES)
    parser.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument(
        "--recompute-attention", action=argparse.BooleanOptionalAction, default=False
    )
    parser.add_argument("--attention", choices=ATTENTION_KINDS, default="auto")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--high-precision-layers", type=int, default=0)
    args = parser.parse_args()
    main(
        args.out,
        args.small,
        args.recipes,
        args.scan_layers,
        args.recompute_attention,
        args.attention,
        args.seeds,
        args.high_precision_layers,
        args.steps,
    )
