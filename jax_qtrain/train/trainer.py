"""The training loop: one run of one recipe, written to one output directory.

    OUT/config.json      the TrainConfig and the corpus fingerprint (written first)
    OUT/metrics.jsonl    one JSON object a line: {"kind": "train", "step", "loss", ...} after
                         every step, {"kind": "eval", "step", "val_loss"} after evaluations,
                         {"kind": "resume", "step"} where a resumed run restarted
    OUT/checkpoints/N/   Orbax checkpoint of the model and optimizer state after N steps
    OUT/summary.json     final and best losses, epochs and timings (written last)

A run is a pure function of its TrainConfig and the corpus: the initial parameters come from
`seed`, batch `step` from (`seed`, `step`) (see corpus.py), and a checkpoint holds every array
the next step reads. So `resume=True` restores the latest checkpoint, drops the metrics of the
steps after it and recomputes them with bit-identical losses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

from jax_qtrain.ops.context import autocast
from jax_qtrain.train.config import TrainConfig, recipe_for
from jax_qtrain.train.corpus import Corpus, load_corpus
from jax_qtrain.train.model import Transformer, count_parameters

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_ITEM = "state"  # OUT/checkpoints/<step>/state/: the model and optimizer state


class RunError(Exception):
    """A run cannot start as asked (bad output directory, nothing to resume, ...)."""


@dataclasses.dataclass(frozen=True)
class RunSummary:
    recipe: str
    steps: int
    final_train_loss: float
    final_val_loss: float
    # The lowest validation loss of the run and the step it was measured at: past about three
    # epochs of a small corpus the validation loss turns up again (docs/training.md).
    best_val_loss: float
    best_val_step: int
    epochs: float  # bytes trained on / bytes of the training split
    step_time_s: float  # median over the steps (robust to a busy machine); excludes compiling
    tokens_per_s: float
    compile_time_s: float
    parameters: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# How far above its best a final validation loss may end before the run reports overfitting.
OVERFITTING_TOLERANCE = 0.01


def best_evaluation(eval_records: list[dict]) -> tuple[float, int]:
    """The lowest validation loss and its step (the first of equal ones; the last evaluation
    when every loss is NaN)."""
    if not eval_records:
        raise ValueError("eval_records: need at least one evaluation, got none")
    losses = np.array([r["val_loss"] for r in eval_records], dtype=np.float64)
    if np.isnan(losses).all():
        return float(losses[-1]), int(eval_records[-1]["step"])
    best = int(np.nanargmin(losses))
    return float(losses[best]), int(eval_records[best]["step"])


class RunResult(Protocol):
    """What `overfitting_note` reads: a RunSummary or a comparison row."""

    recipe: str
    final_val_loss: float
    best_val_loss: float
    best_val_step: int
    epochs: float


def overfitting_note(result: RunResult) -> str | None:
    """A line for the user when the final validation loss ended more than
    OVERFITTING_TOLERANCE above the run's best one, else None (the CLI prints it)."""
    best, final = result.best_val_loss, result.final_val_loss
    if not final > best * (1 + OVERFITTING_TOLERANCE):  # False for NaN too
        return None
    return (
        f"{result.recipe}: the final validation loss {final:.4f} is "
        f"{100 * (final / best - 1):.1f}% above the run's best, {best:.4f} at step "
        f"{result.best_val_step} ({result.epochs:.1f} epochs of the training split): the model "
        "overfits the corpus; fewer --steps may train a better one"
    )


# --- checking the output directory before anything is written ------------------------------


def _nearest_existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def check_writable(out_dir: Path) -> None:
    """Raise RunError unless `out_dir` is, or can be created as, a writable directory.

    Probes with a temporary file in the nearest existing ancestor (os.access says yes to root
    on read-only file systems) and removes it, so a failed check leaves nothing behind.
    """
    existing = _nearest_existing(out_dir.absolute())
    if not existing.is_dir():
        raise RunError(f"cannot create output directory {out_dir}: {existing} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise RunError(f"output directory {out_dir} is not writable: {error.strerror}") from None


def checkpoint_manager(out_dir: Path) -> ocp.CheckpointManager:
    """Saves OUT/checkpoints/<step>/state/, synchronously; keeps the latest two."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=2,
        save_interval_steps=1,  # the loop decides when to save
        enable_async_checkpointing=False,
        cleanup_tmp_directories=True,  # a save cut short by a kill leaves a tmp directory
    )
    return ocp.CheckpointManager((out_dir / CHECKPOINT_DIR).absolute(), options=options)


def save_checkpoint(manager: ocp.CheckpointManager, step: int, state: nnx.State) -> None:
    manager.save(step, args=ocp.args.Composite(**{CHECKPOINT_ITEM: ocp.args.StandardSave(state)}))


def latest_checkpoint_step(out_dir: str | os.PathLike) -> int | None:
    """The step of the newest finished (committed) checkpoint in `out_dir`, or None."""
    directory = Path(out_dir) / CHECKPOINT_DIR
    steps = ocp.utils.checkpoint_steps(directory) if directory.is_dir() else []
    return max(steps, default=None)


def restore_checkpoint(out_dir: str | os.PathLike, step: int, target: nnx.State) -> nnx.State:
    """Checkpoint `step` of `out_dir`, with the structure, dtypes and shardings of `target`."""
    path = (Path(out_dir) / CHECKPOINT_DIR / str(step) / CHECKPOINT_ITEM).absolute()
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(path, target)


def saved_config(out_dir: str | os.PathLike) -> TrainConfig:
    """The config of the run in `out_dir` (RunError if there is none)."""
    config_path = Path(out_dir) / CONFIG_FILE
    if not config_path.is_file():
        raise RunError(f"no training run in {out_dir} (no {CONFIG_FILE})")
    return TrainConfig.from_dict(json.loads(config_path.read_text())["config"])


def prepare_run(out_dir: Path, config: TrainConfig, *, resume: bool) -> TrainConfig:
    """Validate a run before any file is written; return the config to train with.

    A new run needs an output directory that is writable and holds no run yet. `resume` needs
    a run with at least one finished checkpoint, and then trains with that run's saved config
    (`config` must equal it).
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise RunError(f"output path {out_dir} exists and is not a directory")
    if resume:
        saved = saved_config(out_dir)
        if saved != config:
            changed = _differences(saved.to_dict(), config.to_dict())
            raise RunError(
                f"--resume: the options differ from the run's saved config in {out_dir} "
                f"({'; '.join(changed)}); resume without them or with the saved values"
            )
        if latest_checkpoint_step(out_dir) is None:
            raise RunError(
                f"--resume: no finished checkpoint in {out_dir / CHECKPOINT_DIR} (the run "
                f"stopped before its first one: remove {out_dir} and start again)"
            )
        check_writable(out_dir)
        return saved
    if (out_dir / CONFIG_FILE).exists() or (out_dir / CHECKPOINT_DIR).exists():
        raise RunError(
            f"{out_dir} already holds a run; pass --resume to continue it or choose another "
            "output directory"
        )
    check_writable(out_dir)
    return config


def _differences(saved: dict, given: dict, prefix: str = "") -> list[str]:
    out = []
    for key in saved:
        if isinstance(saved[key], dict):
            out += _differences(saved[key], given[key], f"{prefix}{key}.")
        elif saved[key] != given[key]:
            out.append(f"{prefix}{key}: saved {saved[key]!r}, given {given[key]!r}")
    return out


# --- model, optimizer, steps --------------------------------------------------------------


def learning_rate_schedule(config: TrainConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=config.warmup_steps,
        decay_steps=config.steps,
        end_value=config.learning_rate * config.final_lr_fraction,
    )


def build_model_and_optimizer(config: TrainConfig) -> tuple[Transformer, nnx.Optimizer]:
    model = Transformer(config.model, nnx.Rngs(config.seed))
    tx = optax.chain(
        optax.clip_by_global_norm(config.grad_clip_norm),
        optax.adamw(
            learning_rate_schedule(config),
            b1=0.9,
            b2=0.95,
            weight_decay=config.weight_decay,
        ),
    )
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def next_byte_loss(model: Transformer, windows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(mean cross-entropy of each next byte, summed auxiliary loss) on (batch, seq+1) bytes."""
    tokens = windows.astype(jnp.int32)
    logits, aux_loss = model(tokens[:, :-1])
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.mean(cross_entropy), aux_loss


def max_expert_share(intermediates: nnx.State) -> jax.Array:
    """The largest fraction of a MoE layer's routed assignments that one expert received, over
    all layers (1 / num_experts is perfect balance; 0 without MoE layers)."""
    shares = [jnp.zeros((), jnp.float32)]
    for path, counts in nnx.to_flat_state(intermediates):
        if path[-1] == "tokens_per_expert":
            counts = counts.get_value()
            shares.append(jnp.max(counts) / jnp.maximum(jnp.sum(counts), 1))
    return jnp.max(jnp.stack(shares))


class CompiledSteps:
    """The jitted train and eval steps on a split (graphdef, state) of model and optimizer.

    Both are traced under `autocast(recipe)`, so every jax_qtrain layer of the model quantizes
    with the run's recipe (bf16: none) in the forward and backward passes.
    """

    def __init__(self, config: TrainConfig, graphdef, state):
        self.config = config
        self.recipe = recipe_for(config.recipe)
        self.graphdef = graphdef
        aux_weight = config.aux_loss_weight

        def train_step(state, windows):
            model, optimizer = nnx.merge(graphdef, state)

            def objective(model):
                loss, aux_loss = next_byte_loss(model, windows)
                return loss + aux_weight * aux_loss, (loss, aux_loss)

            grads, (loss, aux_loss) = nnx.grad(objective, has_aux=True)(model)
            grad_norm = optax.tree.norm(grads)
            optimizer.update(model, grads)
            metrics = {
                "loss": loss,
                "aux_loss": aux_loss,
                "grad_norm": grad_norm,
                "max_expert_share": max_expert_share(nnx.state(model, nnx.Intermediate)),
            }
            return nnx.state((model, optimizer)), metrics

        def eval_step(state, windows):
            model, _ = nnx.merge(graphdef, state)
            return next_byte_loss(model, windows)[0]

        batch = jax.ShapeDtypeStruct((config.batch_size, config.model.seq_len + 1), jnp.uint8)
        with autocast(self.recipe):
            start = time.perf_counter()
            self.train_step = jax.jit(train_step, donate_argnums=0).lower(state, batch).compile()
            self.eval_step = jax.jit(eval_step).lower(state, batch).compile()
            self.compile_time_s = time.perf_counter() - start

    def validation_loss(self, state, windows: np.ndarray) -> float:
        """Mean loss over fixed validation windows, in batches of the training batch size."""
        size = self.config.batch_size
        losses = []
        for start in range(0, len(windows), size):
            chunk = windows[start : start + size]
            count = len(chunk)
            if count < size:  # pad the last chunk; its padding rows are not counted
                chunk = np.concatenate([chunk, np.repeat(chunk[-1:], size - count, 0)])
            losses.append(float(self.eval_step(state, chunk)) * count)
        return sum(losses) / len(windows)


def restore_model(out_dir: str | os.PathLike) -> Transformer:
    """The model of the run in `out_dir`, with the weights of its latest checkpoint."""
    out_dir = Path(out_dir)
    config = saved_config(out_dir)
    model, optimizer = build_model_and_optimizer(config)
    graphdef, state = nnx.split((model, optimizer))
    step = latest_checkpoint_step(out_dir)
    if step is None:
        raise RunError(f"no finished checkpoint in {out_dir / CHECKPOINT_DIR}")
    state = restore_checkpoint(out_dir, step, state)
    model, _ = nnx.merge(graphdef, state)
    return model


# --- the run --------------------------------------------------------------------------------


def _write_json_atomically(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)


def read_metrics(out_dir: Path) -> list[dict]:
    """The complete lines of a run's metrics.jsonl (a line cut short by a kill is skipped)."""
    path = Path(out_dir) / METRICS_FILE
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _truncate_metrics(out_dir: Path, last_step: int) -> None:
    kept = [r for r in read_metrics(out_dir) if r["step"] <= last_step]
    tmp = out_dir / (METRICS_FILE + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, out_dir / METRICS_FILE)


def train(
    config: TrainConfig,
    out_dir: str | os.PathLike,
    *,
    resume: bool = False,
    progress: bool = True,
    corpus: Corpus | None = None,
) -> RunSummary:
    """Train `config` into `out_dir` (or continue the run there with `resume`)."""
    out_dir = Path(out_dir)
    config = prepare_run(out_dir, config, resume=resume)
    corpus = load_corpus() if corpus is None else corpus
    run_record = {"config": config.to_dict(), "corpus": corpus.fingerprint()}
    if resume:
        saved_corpus = json.loads((out_dir / CONFIG_FILE).read_text())["corpus"]
        if saved_corpus != run_record["corpus"]:
            raise RunError(
                f"--resume: the corpus differs from the one the run in {out_dir} started on "
                f"(saved {saved_corpus}, now {run_record['corpus']})"
            )
    validation_windows = corpus.validation_windows(config.eval_windows, config.model.seq_len)

    model, optimizer = build_model_and_optimizer(config)
    parameters = count_parameters(model)
    graphdef, state = nnx.split((model, optimizer))
    del model, optimizer
    steps = CompiledSteps(config, graphdef, state)

    out_dir.mkdir(parents=True, exist_ok=True)
    manager = checkpoint_manager(out_dir)
    if resume:
        start_step = latest_checkpoint_step(out_dir)
        state = restore_checkpoint(out_dir, start_step, state)
        _truncate_metrics(out_dir, start_step)
    else:
        start_step = 0
        _write_json_atomically(out_dir / CONFIG_FILE, run_record)

    schedule = learning_rate_schedule(config)
    train_loss = val_loss = float("nan")
    bar = tqdm(
        total=config.steps,
        initial=start_step,
        desc=f"train {config.recipe}",
        unit="step",
        disable=not progress,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    with bar, (out_dir / METRICS_FILE).open("a") as metrics_file:

        def log(record: dict) -> None:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()

        if resume:
            log({"kind": "resume", "step": start_step})
        for step in range(start_step, config.steps):
            windows = corpus.train_batch(config.seed, step, config.batch_size, config.model.seq_len)
            started = time.perf_counter()
            state, metrics = steps.train_step(state, windows)
            metrics = jax.device_get(metrics)
            step_time = time.perf_counter() - started
            done = step + 1
            train_loss = float(metrics["loss"])
            tokens_per_s = config.tokens_per_step / step_time
            log(
                {
                    "kind": "train",
                    "step": done,
                    "loss": train_loss,
                    "aux_loss": float(metrics["aux_loss"]),
                    "grad_norm": float(metrics["grad_norm"]),
                    "max_expert_share": float(metrics["max_expert_share"]),
                    "lr": float(schedule(step)),
                    "step_time_s": step_time,
                    "tokens_per_s": tokens_per_s,
                }
            )
            postfix = {"loss": f"{train_loss:.3f}", "tok/s": f"{tokens_per_s:,.0f}"}
            if done % config.eval_every == 0 or done == config.steps:
                val_loss = steps.validation_loss(state, validation_windows)
                log({"kind": "eval", "step": done, "val_loss": val_loss})
            if val_loss == val_loss:  # not NaN: shown once there is one
                postfix["val"] = f"{val_loss:.3f}"
            bar.set_postfix(postfix, refresh=False)
            bar.update(1)
            if done % config.checkpoint_every == 0 or done == config.steps:
                save_checkpoint(manager, done, state)
    manager.close()

    records = read_metrics(out_dir)
    train_records = [r for r in records if r["kind"] == "train"]
    eval_records = [r for r in records if r["kind"] == "eval"]
    step_time = float(np.median([r["step_time_s"] for r in train_records]))
    best_val_loss, best_val_step = best_evaluation(eval_records)
    summary = RunSummary(
        recipe=config.recipe,
        steps=config.steps,
        final_train_loss=train_records[-1]["loss"],
        final_val_loss=eval_records[-1]["val_loss"],
        best_val_loss=best_val_loss,
        best_val_step=best_val_step,
        epochs=config.steps * config.tokens_per_step / len(corpus.train.data),
        step_time_s=step_time,
        tokens_per_s=config.tokens_per_step / step_time,
        compile_time_s=steps.compile_time_s,
        parameters=parameters,
    )
    _write_json_atomically(out_dir / SUMMARY_FILE, summary.to_dict())
    return summary
