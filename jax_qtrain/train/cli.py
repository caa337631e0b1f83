"""The `train` and `compare` subcommands of `jax-qtrain` (`python -m jax_qtrain`).

Every input is checked before a file is written: a bad recipe, a missing checkpoint or an
unwritable output directory prints one line on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from jax_qtrain.train.config import PRESETS, RECIPE_NAMES, TrainConfig
from jax_qtrain.train.model import ATTENTION_KINDS

# (flag, TrainConfig or ModelConfig field, type, help)
_OVERRIDES: tuple[tuple[str, str, type, str], ...] = (
    ("--steps", "steps", int, "training steps"),
    ("--batch-size", "batch_size", int, "windows per step"),
    ("--seq-len", "seq_len", int, "bytes per window (model context)"),
    ("--learning-rate", "learning_rate", float, "peak AdamW learning rate"),
    ("--warmup-steps", "warmup_steps", int, "linear warm-up steps"),
    ("--seed", "seed", int, "initial weights and batch order"),
    ("--d-model", "d_model", int, "model width"),
    ("--layers", "num_layers", int, "transformer blocks"),
    ("--heads", "num_heads", int, "attention heads"),
    ("--feed-forward", "feed_forward", str, "'moe' (default) or 'dense'"),
    ("--experts", "num_experts", int, "experts per MoE layer"),
    ("--experts-per-token", "experts_per_token", int, "top-k routing"),
    ("--expert-hidden", "expert_hidden", int, "hidden units per expert"),
    ("--eval-every", "eval_every", int, "steps between validation losses"),
    ("--eval-windows", "eval_windows", int, "validation windows"),
    ("--checkpoint-every", "checkpoint_every", int, "steps between checkpoints"),
    (
        "--high-precision-layers",
        "high_precision_layers",
        int,
        "how many of the last blocks compute without quantization (default 0)",
    ),
)


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="starting configuration: 'cpu' (default; under a minute per recipe on 2 cores) "
        "or 'h200' (a larger model for one GPU); the options below override it",
    )
    group = parser.add_argument_group("configuration overrides")
    for flag, field, kind, help_text in _OVERRIDES:
        group.add_argument(flag, dest=field, type=kind, default=None, help=help_text)
    group.add_argument(
        "--scan-layers",
        dest="scan_layers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the blocks as one lax.scan (a much smaller compiled step) instead of a "
        "Python loop (the default, --no-scan-layers)",
    )
    group.add_argument(
        "--recompute-attention",
        dest="recompute_attention",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="save only q, k, v for the attention's backward and recompute its softmax there "
        "(less memory, ~3%% slower steps on an H200; default --no-recompute-attention)",
    )
    group.add_argument(
        "--attention",
        dest="attention",
        choices=ATTENTION_KINDS,
        default=None,
        help="the attention core: 'plain' (scores and softmax as XLA ops), 'cudnn' (cuDNN's "
        "fused flash attention; CUDA GPUs, 16-bit compute) or 'auto' (the default: cudnn "
        "where it applies, plain elsewhere)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _config_from_args(args: argparse.Namespace, base: TrainConfig | None = None) -> TrainConfig:
    """The preset (or `base`, a resumed run's saved config) with the options given applied."""
    if base is None:
        base = PRESETS[args.preset or "cpu"]
    elif args.preset is not None and PRESETS[args.preset].model != base.model:
        raise ValueError(f"--preset {args.preset} is not the preset the run started with")
    names = [field for _, field, _, _ in _OVERRIDES]
    names += ["scan_layers", "recompute_attention", "attention", "recipe"]
    overrides = {name: getattr(args, name, None) for name in names}
    return base.replace(**{k: v for k, v in overrides.items() if v is not None})


def _recipe_list(text: str) -> list[str]:
    recipes = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in recipes if name not in RECIPE_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown recipe {', '.join(map(repr, unknown))}; choose from {','.join(RECIPE_NAMES)}"
        )
    return recipes


def _seed_list(text: str) -> list[int]:
    try:
        seeds = [int(seed) for seed in text.split(",") if seed.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"seeds must be comma-separated integers, got {text!r}"
        ) from None
    return seeds


def _default_out(kind: str) -> Path:
    return Path("runs") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


def add_commands(commands: argparse._SubParsersAction) -> None:
    train_parser = commands.add_parser(
        "train",
        help="train a small MoE byte-level language model on the stdlib's sources",
        description="Train a small decoder-only MoE transformer on the Python standard "
        "library's source files (byte tokens; no download) with one quantization recipe.",
    )
    train_parser.add_argument(
        "--recipe",
        choices=RECIPE_NAMES,
        default=None,
        help="quantization recipe (default bf16: none)",
    )
    train_parser.add_argument(
        "--out", type=Path, default=None, help="output directory (default runs/train-<time>)"
    )
    train_parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its latest checkpoint, with its saved options "
        "(options given must agree with them)",
    )
    _add_config_options(train_parser)

    compare_parser = commands.add_parser(
        "compare",
        help="train once per recipe; plot and tabulate the losses",
        description="Train the same configuration once per recipe; write comparison.png, "
        "comparison.md and comparison.json.",
    )
    compare_parser.add_argument(
        "--recipes",
        type=_recipe_list,
        default=list(RECIPE_NAMES),
        help=f"comma-separated (default {','.join(RECIPE_NAMES)})",
    )
    compare_parser.add_argument(
        "--out", type=Path, default=None, help="output directory (default runs/compare-<time>)"
    )
    compare_parser.add_argument(
        "--seeds",
        type=_seed_list,
        default=None,
        help="comma-separated seeds: compare once per seed (OUT/seed-<s>/) and tabulate each "
        "recipe's gap to bf16 seed by seed, with their mean and worst (instead of --seed)",
    )
    _add_config_options(compare_parser)


def _fail(message: str) -> int:
    print(f"jax-qtrain: error: {message}", file=sys.stderr)
    return 2


def run_train(args: argparse.Namespace) -> int:
    from jax_qtrain.train.trainer import RunError, prepare_run, saved_config, train

    if args.resume and args.out is None:
        return _fail("--resume needs --out, the directory of the run to continue")
    out = args.out if args.out is not None else _default_out("train")
    try:
        config = _config_from_args(args, saved_config(out) if args.resume else None)
        prepare_run(out, config, resume=args.resume)  # fails before anything is written
        verb = "resuming" if args.resume else "training"
        print(f"{verb} {config.recipe} in {out}", file=sys.stderr)
        summary = train(config, out, resume=args.resume, progress=not args.no_progress)
    except (RunError, ValueError) as error:
        return _fail(str(error))
    print(
        f"{summary.recipe}: {summary.steps} steps, train loss {summary.final_train_loss:.4f}, "
        f"validation loss {summary.final_val_loss:.4f}, "
        f"{summary.step_time_s * 1e3:.0f} ms/step, {summary.tokens_per_s:,.0f} tokens/s "
        f"({summary.parameters:,} parameters); metrics in {out}/metrics.jsonl"
    )
    _print_overfitting_notes([summary])
    return 0


def _print_overfitting_notes(results) -> None:
    """On stderr, whatever --no-progress says: a run that overfits its corpus is worth a line."""
    from jax_qtrain.train.trainer import overfitting_note

    for result in results:
        note = overfitting_note(result)
        if note:
            print(f"jax-qtrain: note: {note}", file=sys.stderr)


def run_compare(args: argparse.Namespace) -> int:
    from jax_qtrain.train.compare import (
        PLOT_FILE,
        TABLE_FILE,
        check_seeds,
        compare,
        compare_over_seeds,
        markdown_table,
        prepare_comparison,
        seed_gap_table,
    )
    from jax_qtrain.train.trainer import RunError

    out = args.out if args.out is not None else _default_out("compare")
    try:
        if args.seeds is not None and args.seed is not None:
            raise RunError("give --seed or --seeds, not both")
        config = _config_from_args(args)
        seeds = None if args.seeds is None else check_seeds(args.seeds)
        prepare_comparison(out, args.recipes)  # fails before anything is written
        if seeds is not None:
            print(
                f"comparing {','.join(args.recipes)} over seeds {','.join(map(str, seeds))} "
                f"in {out}",
                file=sys.stderr,
            )
            summary = compare_over_seeds(
                config, args.recipes, seeds, out, progress=not args.no_progress
            )
            print(seed_gap_table(summary), end="")
            print(f"plots: {out}/seed-*/{PLOT_FILE}; table: {out / TABLE_FILE}")
            return 0
        print(f"comparing {','.join(args.recipes)} in {out}", file=sys.stderr)
        rows = compare(config, args.recipes, out, progress=not args.no_progress)
    except (RunError, ValueError) as error:
        return _fail(str(error))
    print(markdown_table(rows), end="")
    print(f"plot: {out / PLOT_FILE}; table: {out / TABLE_FILE}")
    _print_overfitting_notes(rows)
    return 0
