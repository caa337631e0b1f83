"""`compare`: train one run per recipe on the same config; plot and tabulate the losses.

    OUT/<recipe>/          one training run each (see trainer.py)
    OUT/comparison.png     training loss (smoothed) and validation loss against steps
    OUT/comparison.md      the table below, as markdown
    OUT/comparison.json    the same rows, plus the config

Every run has the same seed, so the same initial weights and batches: the curves differ only
by the recipe's numerics. The relative gap is (val_loss − bf16 val_loss) / bf16 val_loss.

`compare_over_seeds` repeats that for several seeds (OUT/seed-<s>/ each, laid out as above)
and tabulates each recipe's gaps seed by seed: a short run's gap moves by about a point from
one seed to another (docs/benchmarks.md, stop 28), so one seed can pass or fail a tolerance
by chance.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jax_qtrain.train.config import TrainConfig
from jax_qtrain.train.corpus import Corpus, load_corpus
from jax_qtrain.train.trainer import (
    RunError,
    RunSummary,
    check_writable,
    read_metrics,
    train,
)

PLOT_FILE = "comparison.png"
TABLE_FILE = "comparison.md"
JSON_FILE = "comparison.json"
BASELINE = "bf16"


@dataclasses.dataclass(frozen=True)
class ComparisonRow:
    recipe: str
    final_train_loss: float
    final_val_loss: float
    best_val_loss: float  # the run's lowest validation loss, at best_val_step
    best_val_step: int
    val_gap_vs_bf16: float | None  # relative, of the final losses; None without a bf16 run
    epochs: float  # passes over the training split (the same for every recipe)
    step_time_ms: float
    tokens_per_s: float
    compile_time_s: float
    evaluations: tuple[tuple[int, float], ...] = ()  # (step, validation loss) of each evaluation


def evaluations_of(run_dir: Path) -> tuple[tuple[int, float], ...]:
    """(step, validation loss) of every evaluation in a run's metrics file."""
    return tuple(
        (int(r["step"]), float(r["val_loss"])) for r in read_metrics(run_dir) if r["kind"] == "eval"
    )


def relative_gap(loss: float, baseline_loss: float) -> float:
    """(loss − baseline) / baseline: the gaps every table reports."""
    return (loss - baseline_loss) / baseline_loss


def comparison_rows(
    summaries: Sequence[RunSummary],
    evaluations: dict[str, tuple[tuple[int, float], ...]] | None = None,
) -> list[ComparisonRow]:
    """One row per run; `evaluations` (recipe -> (step, val loss) pairs) fills the rows'
    evaluations when given."""
    evaluations = evaluations or {}
    unknown = sorted(set(evaluations) - {s.recipe for s in summaries})
    if unknown:
        raise ValueError(f"evaluations: recipes without a run summary: {unknown}")
    baseline = next((s for s in summaries if s.recipe == BASELINE), None)
    rows = []
    for s in summaries:
        gap = None
        if baseline is not None:
            gap = relative_gap(s.final_val_loss, baseline.final_val_loss)
        rows.append(
            ComparisonRow(
                recipe=s.recipe,
                final_train_loss=s.final_train_loss,
                final_val_loss=s.final_val_loss,
                best_val_loss=s.best_val_loss,
                best_val_step=s.best_val_step,
                val_gap_vs_bf16=gap,
                epochs=s.epochs,
                evaluations=tuple(evaluations.get(s.recipe, ())),
                step_time_ms=s.step_time_s * 1e3,
                tokens_per_s=s.tokens_per_s,
                compile_time_s=s.compile_time_s,
            )
        )
    return rows


def _check_rows(rows: Sequence) -> None:
    if not rows:
        raise ValueError("rows: a table needs at least one recipe's row, got none")


def _percent(gap: float | None) -> str:
    return "—" if gap is None else f"{100 * gap:+.2f}%"


def markdown_table(rows: Sequence[ComparisonRow]) -> str:
    """The comparison table, and below it how many epochs the runs trained (a best validation
    loss well before the last step, past a few epochs, means the runs overfit the corpus and
    the final gap measures that as much as the recipes' numerics)."""
    _check_rows(rows)
    lines = [
        "| recipe | final train loss | final val loss | best val loss (step) | val gap vs bf16 "
        "| step time (ms) | tokens/s | compile (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.recipe} | {r.final_train_loss:.4f} | {r.final_val_loss:.4f} "
            f"| {r.best_val_loss:.4f} ({r.best_val_step}) | {_percent(r.val_gap_vs_bf16)} "
            f"| {r.step_time_ms:.1f} | {r.tokens_per_s:,.0f} | {r.compile_time_s:.1f} |"
        )
    lines += ["", f"Each run trained {rows[0].epochs:.2f} epochs of the training split."]
    if any(r.evaluations for r in rows):
        lines += ["", *evaluation_table(rows).splitlines()]
    return "\n".join(lines) + "\n"


def evaluation_table(rows: Sequence[ComparisonRow]) -> str:
    """Each recipe's validation loss at every evaluation, with its gap to bf16's at the same
    step: how the gap moves over training (early steps favour bf16 on small models; late
    ones, past a few epochs, favour whichever run memorizes the corpus more slowly)."""
    _check_rows(rows)
    losses = [dict(r.evaluations) for r in rows]  # step -> loss, per recipe
    steps = sorted({step for by_step in losses for step in by_step})
    baseline = next(
        (by_step for r, by_step in zip(rows, losses, strict=True) if r.recipe == BASELINE), {}
    )
    lines = [
        "Validation loss at each evaluation (gap vs bf16 at the same step):",
        "",
        "| step | " + " | ".join(r.recipe for r in rows) + " |",
        "|---|" + "---|" * len(rows),
    ]
    for step in steps:
        cells = []
        for r, by_step in zip(rows, losses, strict=True):
            loss = by_step.get(step)
            if loss is None:
                cells.append("—")
            elif r.recipe == BASELINE or step not in baseline:
                cells.append(f"{loss:.4f}")
            else:
                cells.append(f"{loss:.4f} ({_percent(relative_gap(loss, baseline[step]))})")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def smooth(values: np.ndarray, weight: float = 0.9) -> np.ndarray:
    """Exponential moving average, debiased (so the first points are not pulled to 0)."""
    out = np.empty(len(values))
    average = 0.0
    for i, value in enumerate(values):
        average = weight * average + (1 - weight) * value
        out[i] = average / (1 - weight ** (i + 1))
    return out


def plot_losses(run_dirs: dict[str, Path], path: Path, title: str) -> None:
    """Training loss (EMA, raw faint) and validation loss per recipe, side by side.

    Draws on a bare `Figure` (no pyplot): leaves the caller's matplotlib backend alone."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.2))
    train_axis, val_axis = figure.subplots(1, 2)
    for recipe, run_dir in run_dirs.items():
        records = read_metrics(run_dir)
        train_records = [r for r in records if r["kind"] == "train"]
        eval_records = [r for r in records if r["kind"] == "eval"]
        steps = np.array([r["step"] for r in train_records])
        losses = np.array([r["loss"] for r in train_records])
        (line,) = train_axis.plot(steps, smooth(losses), label=recipe, linewidth=1.5)
        train_axis.plot(steps, losses, color=line.get_color(), alpha=0.15, linewidth=0.8)
        val_axis.plot(
            [r["step"] for r in eval_records],
            [r["val_loss"] for r in eval_records],
            marker="o",
            color=line.get_color(),
            label=recipe,
        )
    train_axis.set(title="training loss (EMA 0.9)", xlabel="step", ylabel="next-byte loss (nats)")
    val_axis.set(title="validation loss", xlabel="step", ylabel="next-byte loss (nats)")
    for axis in (train_axis, val_axis):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def prepare_comparison(out_dir: Path, recipes: Sequence[str]) -> None:
    """Validate before anything is written (recipes are checked by TrainConfig)."""
    if not recipes:
        raise RunError("compare needs at least one recipe")
    if len(set(recipes)) != len(recipes):
        raise RunError(f"compare: a recipe is listed twice in {','.join(recipes)}")
    if out_dir.exists() and not out_dir.is_dir():
        raise RunError(f"output path {out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        raise RunError(f"{out_dir} is not empty; choose another output directory")
    check_writable(out_dir)


def compare(
    config: TrainConfig,
    recipes: Sequence[str],
    out_dir: str | os.PathLike,
    *,
    progress: bool = True,
    corpus: Corpus | None = None,
) -> list[ComparisonRow]:
    """Train `config` once per recipe into OUT/<recipe>/; write the plot and the tables."""
    out_dir = Path(out_dir)
    configs = [dataclasses.replace(config, recipe=recipe) for recipe in recipes]  # validates
    prepare_comparison(out_dir, recipes)
    corpus = load_corpus() if corpus is None else corpus
    summaries = [
        train(run_config, out_dir / run_config.recipe, progress=progress, corpus=corpus)
        for run_config in configs
    ]
    rows = comparison_rows(summaries, {r: evaluations_of(out_dir / r) for r in recipes})
    model = config.model
    title = (
        f"{config.steps} steps × {config.tokens_per_step} bytes ({rows[0].epochs:.2f} epochs), "
        f"d_model {model.d_model}, "
        f"{model.num_layers} layers, {model.feed_forward} feed-forward"
    )
    plot_losses({r: out_dir / r for r in recipes}, out_dir / PLOT_FILE, title)
    (out_dir / TABLE_FILE).write_text(markdown_table(rows))
    payload = {"config": config.to_dict(), "rows": [dataclasses.asdict(r) for r in rows]}
    (out_dir / JSON_FILE).write_text(json.dumps(payload, indent=2) + "\n")
    return rows


@dataclasses.dataclass(frozen=True)
class SeedGapRow:
    """One recipe over several seeds; each gap is against bf16's run of the same seed."""

    recipe: str
    seeds: tuple[int, ...]
    final_val_losses: tuple[float, ...]
    val_gaps_vs_bf16: tuple[float, ...] | None  # relative, per seed; None without bf16
    mean_val_gap_vs_bf16: float | None
    worst_val_gap_vs_bf16: float | None  # the largest (most positive) of the seeds' gaps
    step_time_ms: float  # median over the seeds


def seed_gap_rows(
    rows_by_seed: dict[int, Sequence[ComparisonRow]],
) -> list[SeedGapRow]:
    seeds = tuple(rows_by_seed)
    recipes = [row.recipe for row in rows_by_seed[seeds[0]]]
    summary = []
    for recipe in recipes:
        rows = [next(r for r in rows_by_seed[seed] if r.recipe == recipe) for seed in seeds]
        gaps = None
        if all(r.val_gap_vs_bf16 is not None for r in rows):
            gaps = tuple(float(r.val_gap_vs_bf16) for r in rows)
        summary.append(
            SeedGapRow(
                recipe=recipe,
                seeds=seeds,
                final_val_losses=tuple(r.final_val_loss for r in rows),
                val_gaps_vs_bf16=gaps,
                mean_val_gap_vs_bf16=None if gaps is None else float(np.mean(gaps)),
                worst_val_gap_vs_bf16=None if gaps is None else max(gaps),
                step_time_ms=float(np.median([r.step_time_ms for r in rows])),
            )
        )
    return summary


def seed_gap_table(rows: Sequence[SeedGapRow]) -> str:
    _check_rows(rows)
    seeds = rows[0].seeds
    lines = [
        "| recipe | final val loss, seeds " + " / ".join(map(str, seeds)) + " | val gap vs bf16 "
        "per seed | mean gap | worst gap | step time (ms, median) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        losses = " / ".join(f"{loss:.4f}" for loss in r.final_val_losses)
        gaps = "—" if r.val_gaps_vs_bf16 is None else " / ".join(map(_percent, r.val_gaps_vs_bf16))
        lines.append(
            f"| {r.recipe} | {losses} | {gaps} | {_percent(r.mean_val_gap_vs_bf16)} "
            f"| {_percent(r.worst_val_gap_vs_bf16)} | {r.step_time_ms:.1f} |"
        )
    return "\n".join(lines) + "\n"


def check_seeds(seeds: Sequence[int]) -> tuple[int, ...]:
    seeds = tuple(seeds)
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds):
        raise RunError(f"seeds must be one or more integers >= 0, got {list(seeds)}")
    if len(set(seeds)) != len(seeds):
        raise RunError(f"a seed is listed twice in {list(seeds)}")
    return seeds


def compare_over_seeds(
    config: TrainConfig,
    recipes: Sequence[str],
    seeds: Sequence[int],
    out_dir: str | os.PathLike,
    *,
    progress: bool = True,
    corpus: Corpus | None = None,
) -> list[SeedGapRow]:
    """`compare` once per seed into OUT/seed-<s>/; OUT/comparison.md and .json get the gaps
    of every seed side by side (`config.seed` is replaced by each of `seeds`)."""
    out_dir = Path(out_dir)
    seeds = check_seeds(seeds)
    for recipe in recipes:  # validates the recipe names before anything is written
        dataclasses.replace(config, recipe=recipe)
    prepare_comparison(out_dir, recipes)
    corpus = load_corpus() if corpus is None else corpus
    rows_by_seed = {
        seed: compare(
            dataclasses.replace(config, seed=seed),
            recipes,
            out_dir / f"seed-{seed}",
            progress=progress,
            corpus=corpus,
        )
        for seed in seeds
    }
    summary = seed_gap_rows(rows_by_seed)
    (out_dir / TABLE_FILE).write_text(seed_gap_table(summary))
    payload = {
        "config": config.to_dict(),
        "seeds": list(seeds),
        "rows": [dataclasses.asdict(r) for r in summary],
        "rows_by_seed": {
            str(seed): [dataclasses.asdict(r) for r in rows] for seed, rows in rows_by_seed.items()
        },
    }
    (out_dir / JSON_FILE).write_text(json.dumps(payload, indent=2) + "\n")
    return summary
