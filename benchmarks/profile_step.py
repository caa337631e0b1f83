"""Where a training step's GPU time goes, per recipe: a jax.profiler trace summed by kernel kind.

NVFP4 trains the `h200` preset at 0.63× bf16's speed and MXFP8 at 1.10× (docs/benchmarks.md,
run E), and the step time alone does not say which kernels take the difference. This builds
the preset's model and compiled train step for each recipe (the same `CompiledSteps` as
`jax-qtrain train`), runs a few warm-up steps, times `steps` steps by the wall clock, then runs
them once more under `jax.profiler.trace` and sums the durations of the GPU kernels in the
trace: by kind (our Pallas GEMMs, quantize and dequantize kernels, XLA's GEMMs, XLA's other
fusions, copies) and the top kernels by name.

    python -m benchmarks.profile_step [--out DIR] [--recipes R ...] [--steps N] [--scan-layers]
                                       [--recompute-attention] [--attention auto|plain|cudnn]
                                       [--small]

writes DIR/profile_step.json and .md. Kernel times are summed over every CUDA stream line of
the trace, so kernels that overlap on different streams count twice: "kernel ms / step" can
exceed the step's wall time; read the kinds against each other and against bf16. `--small`
runs the CPU preset (a smoke test: a CPU trace has no device kernels, and the table says so).
XLA runs the step inside CUDA graphs, so a kernel's trace labels name its graph
(`command_buffer_N`), not its jax op; under `XLA_FLAGS=--xla_gpu_enable_command_buffer=` (XLA's
switch for command buffers) each top kernel's `labels` in the JSON carry its jax op path
(`name`, e.g. `jit(train_step)/transpose(jvp())/while/body/...`), at nearly the same step time
(H200, bf16: 43.0 ms without CUDA graphs, 43.7 with them; docs/benchmarks.md, stop 23).
"""

from __future__ import annotations

import argparse
import gzip
import json
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
from flax import nnx

from benchmarks.timing import device_description, report
from jax_qtrain.train import PRESETS, RECIPE_NAMES
from jax_qtrain.train.corpus import load_corpus
from jax_qtrain.train.model import ATTENTION_KINDS, attention_implementation
from jax_qtrain.train.trainer import CompiledSteps, build_model_and_optimizer

WARM_UP_STEPS = 3
TOP_KERNELS = 20

# Kinds, first match wins; matched against the kernel's name and its HLO op / module names.
KINDS = (
    ("Pallas GEMM (grouped / dense)", ("grouped_matmul", "dense_matmul")),
    ("Pallas dequantize", ("dequantize",)),
    ("Pallas quantize / amax", ("quantize", "amax", "cast_transpose")),
    ("XLA GEMM (cuBLAS / cuDNN / Triton)", ("gemm", "xmma", "cutlass", "cublas", "triton")),
    ("copies / memsets", ("memcpy", "memset", "copy")),
    ("NCCL", ("nccl",)),
)
OTHER_KIND = "XLA fusions and other kernels"


def kind_of(text: str) -> str:
    lowered = text.lower()
    for kind, needles in KINDS:
        if any(needle in lowered for needle in needles):
            return kind
    return OTHER_KIND


def device_kernel_events(trace: dict) -> list[dict]:
    """The complete ("X") events on the CUDA stream lines of every GPU process of a Chrome
    trace (not the "XLA Ops" / "XLA Modules" lines, which repeat the same time)."""
    gpu_pids, stream_lines = set(), set()
    for event in trace["traceEvents"]:
        if event.get("ph") != "M":
            continue
        name = str(event.get("args", {}).get("name", ""))
        if event.get("name") == "process_name" and "/device:GPU" in name:
            gpu_pids.add(event["pid"])
        elif event.get("name") == "thread_name" and name.lower().startswith("stream"):
            stream_lines.add((event["pid"], event.get("tid")))
    return [
        event
        for event in trace["traceEvents"]
        if event.get("ph") == "X"
        and event.get("pid") in gpu_pids
        and (event["pid"], event.get("tid")) in stream_lines
    ]


def summarize_kernels(events: Sequence[dict], steps: int) -> dict:
    """Per-step milliseconds by kind and by kernel name (the top `TOP_KERNELS`)."""
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, list] = defaultdict(lambda: [0.0, 0, "", {}])
    for event in events:
        name = str(event.get("name", "?"))
        args = event.get("args", {})
        labels = " ".join(str(args.get(key, "")) for key in ("hlo_op", "hlo_module", "name"))
        kind = kind_of(f"{name} {labels}")
        ms = float(event.get("dur", 0.0)) / 1000.0
        by_kind[kind] += ms
        entry = by_name[name]
        entry[0] += ms
        entry[1] += 1
        entry[2] = kind
        # The first launch's labels (e.g. the HLO op and the jax op path it came from).
        entry[3] = entry[3] or {key: str(value)[:300] for key, value in args.items()}
    top = sorted(by_name.items(), key=lambda item: -item[1][0])[:TOP_KERNELS]
    return dict(
        kernel_ms_per_step=sum(by_kind.values()) / steps,
        by_kind={kind: ms / steps for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        top_kernels=[
            dict(
                name=name,
                kind=kind,
                ms_per_step=ms / steps,
                launches_per_step=count / steps,
                labels=labels,
            )
            for name, (ms, count, kind, labels) in top
        ],
    )


def traced_kernel_events(run: Callable[[], object]) -> list[dict]:
    """The GPU kernel events (`device_kernel_events`) of one `run()`, its result blocked on,
    traced by `jax.profiler`."""
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir):
            jax.block_until_ready(run())
        return device_kernel_events(read_trace(Path(log_dir)))


def read_trace(log_dir: Path) -> dict:
    traces = sorted(log_dir.glob("plugins/profile/*/*.trace.json.gz"))
    if not traces:
        raise FileNotFoundError(f"jax.profiler wrote no *.trace.json.gz under {log_dir}")
    with gzip.open(traces[-1], "rb") as handle:
        return json.load(handle)


def profile_recipe(config, recipe: str, steps: int) -> dict:
    config = config.replace(recipe=recipe)
    model, optimizer = build_model_and_optimizer(config)
    graphdef, state = nnx.split((model, optimizer))
    compiled = CompiledSteps(config, graphdef, state)
    corpus = load_corpus()
    batches = [
        corpus.train_batch(config.seed, step, config.batch_size, config.model.seq_len)
        for step in range(WARM_UP_STEPS + steps)
    ]
    for windows in batches[:WARM_UP_STEPS]:
        state, metrics = compiled.train_step(state, windows)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for windows in batches[WARM_UP_STEPS:]:
        state, metrics = compiled.train_step(state, windows)
    jax.block_until_ready(metrics)
    step_ms = (time.perf_counter() - start) * 1000.0 / steps

    def timed_steps(state=state):
        for windows in batches[WARM_UP_STEPS:]:
            state, metrics = compiled.train_step(state, windows)
        return metrics

    events = traced_kernel_events(timed_steps)
    summary = summarize_kernels(events, steps) if events else None
    return dict(
        recipe=recipe,
        attention=attention_implementation(config.model),
        step_ms=step_ms,
        compile_s=compiled.compile_time_s,
        kernels=summary,
    )


def markdown(rows: list[dict]) -> str:
    kinds = [kind for kind, _ in KINDS] + [OTHER_KIND]
    lines = [
        f"Device: {device_description()}. Attention core: "
        f"{', '.join(sorted({row.get('attention', 'plain') for row in rows}))}. Wall ms per "
        "step over the timed steps; kernel ms per step summed over the trace's CUDA streams, "
        "by kind (cuDNN's attention kernels count as XLA GEMMs or other kernels by their names).",
        "",
        "| recipe | step ms | compile s | kernel ms | " + " | ".join(kinds) + " |",
        "|---|---:|---:|---:|" + "---:|" * len(kinds),
    ]
    for row in rows:
        summary = row["kernels"]
        if summary is None:
            cells = ["no device kernels in the trace"] + [""] * len(kinds)
        else:
            cells = [f"{summary['kernel_ms_per_step']:.2f}"] + [
                f"{summary['by_kind'].get(kind, 0.0):.2f}" for kind in kinds
            ]
        lines.append(
            f"| {row['recipe']} | {row['step_ms']:.1f} | {row['compile_s']:.0f} | "
            + " | ".join(cells)
            + " |"
        )
    for row in rows:
        if row["kernels"] is None:
            continue
        lines += [
            "",
            f"Top kernels, {row['recipe']} (ms per step, launches per step; the jax op path "
            "where the trace has one, i.e. without CUDA graphs):",
            "",
            "| kernel | kind | ms | launches | jax op |",
            "|---|---|---:|---:|---|",
        ]
        for kernel in row["kernels"]["top_kernels"]:
            name = kernel["name"].replace("|", "/")[:90]
            op_path = kernel["labels"].get("name", "").replace("|", "/")[:120]
            lines.append(
                f"| `{name}` | {kernel['kind']} | {kernel['ms_per_step']:.3f} | "
                f"{kernel['launches_per_step']:.0f} | {op_path} |"
            )
    return "\n".join(lines) + "\n"


def main(
    out_dir: str | None = None,
    recipes: Sequence[str] = ("bf16", "mxfp8", "nvfp4"),
    steps: int = 5,
    scan_layers: bool = False,
    small: bool = False,
    recompute_attention: bool = False,
    attention: str = "auto",
) -> str:
    unknown = sorted(set(recipes) - set(RECIPE_NAMES))
    if unknown or not recipes:
        raise ValueError(f"recipes must be a non-empty subset of {RECIPE_NAMES}, got {recipes}")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    config = PRESETS["cpu" if small else "h200"].replace(
        scan_layers=scan_layers, recompute_attention=recompute_attention, attention=attention
    )
    rows, text = [], ""
    for recipe in recipes:
        rows.append(profile_recipe(config, recipe, steps))
        # Rewritten after each recipe, so a run cut by a time limit keeps what it measured.
        text = report(out_dir, "profile_step", rows, markdown(rows))
    return text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--recipes", nargs="+", default=["bf16", "mxfp8", "nvfp4"], choices=RECIPE_NAMES
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--scan-layers", action="store_true")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--recompute-attention", action="store_true")
    parser.add_argument("--attention", choices=ATTENTION_KINDS, default="auto")
    arguments = parser.parse_args()
    print(
        main(
            arguments.out,
            arguments.recipes,
            arguments.steps,
            arguments.scan_layers,
            arguments.small,
            arguments.recompute_attention,
            arguments.attention,
        )
    )
