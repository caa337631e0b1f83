"""Where `jax_qtrain.quantize` / `grouped_quantize` spend their GPU time, kernel by kernel.

bench_grouped_quantize times the quantizers end to end: NVFP4 gradients (row + Hadamard col,
stochastic rounding) took ~1.0 ms whole and ~1.6 ms grouped for a 16384×4096 bf16 tensor on
the H200 (stop 24), against ~0.33 ms for the quantize kernel alone. This traces a few calls of
each under `jax.profiler` and sums the GPU kernels by kind and by name (profile_step's
helpers), so the rest — amaxes, tables, padding, copies — has names.

    python -m benchmarks.profile_quantize [--out DIR] [--recipes nvfp4 ...] [--calls N]
        [--backend auto|pallas]

writes DIR/profile_quantize.json and .md. `--backend pallas` runs kernel paths that still await
their GPU verification (`jax_qtrain.kernels._AWAITING_GPU_VERIFICATION`), to time them before
they join "auto" (stop 25 timed the grouped NVFP4 amaxes on `nvfp4_line_amax_bits` so). Run with
`XLA_FLAGS=--xla_gpu_enable_command_buffer=` to get each XLA kernel's jax op path in the
tables. `--small` profiles a tiny shape on whatever device there is (a smoke test; on the CPU
the trace has no GPU kernels).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks.bench_grouped_quantize import RECIPES, grouped_quantizer, whole_quantizer
from benchmarks.profile_step import summarize_kernels, traced_kernel_events
from benchmarks.timing import device_description, median_seconds, report

SHAPE = (16384, 4096, 8)  # tokens, features, groups: bench_grouped_quantize's "8 experts"
SMALL_SHAPE = (256, 128, 4)


def profile_call(fn, x, calls: int) -> dict:
    """Median wall time and the per-call kernel summary of `calls` calls of fn(x)."""
    seconds = median_seconds(fn, [(x,)], iters=calls)
    events = traced_kernel_events(lambda: [fn(x) for _ in range(calls)])
    return dict(us=seconds * 1e6, kernels=summarize_kernels(events, calls) if events else None)


def run(recipe_names, calls: int, small: bool, backend: str = "auto") -> list[dict]:
    tokens, features, groups = SMALL_SHAPE if small else SHAPE
    x = jax.random.normal(jax.random.key(0), (tokens, features), jnp.bfloat16)
    sizes = jnp.full((groups,), tokens // groups, jnp.int32)
    key = jax.random.key(1)
    rows = []
    for name in recipe_names:
        recipe = RECIPES[name]
        sr_key = key if recipe.spec("grad").stochastic_rounding else None
        cases = {
            "whole tensor": whole_quantizer(recipe, sr_key, True, True, backend),
            f"grouped (G={groups})": grouped_quantizer(
                recipe, sizes, tokens, sr_key, True, True, backend
            ),
        }
        for case, fn in cases.items():
            rows.append(dict(recipe=name, case=case, **profile_call(fn, x, calls)))
            print(name, case, f"{rows[-1]['us']:.1f} us", flush=True)
    return rows


def markdown(rows: list[dict], shape, backend: str) -> str:
    lines = [
        f"Gradient quantize (role 'grad', row+col, backend {backend!r}) of a "
        f"{shape[0]}×{shape[1]} bf16 tensor, {device_description()}. Wall µs per call "
        "(median); kernel µs per call from a `jax.profiler` trace of the same calls.",
        "",
    ]
    for row in rows:
        summary = row["kernels"]
        lines.append(f"### {row['recipe']}, {row['case']}: {row['us']:.1f} µs a call")
        if summary is None:
            lines += ["", "(no GPU kernels in the trace)", ""]
            continue
        lines += [
            "",
            f"kernels {summary['kernel_ms_per_step'] * 1e3:.1f} µs a call",
            "",
            "| kernel | kind | µs | launches | jax op |",
            "|---|---|---:|---:|---|",
        ]
        for kernel in summary["top_kernels"]:
            op = kernel["labels"].get("name", "") if kernel["labels"] else ""
            lines.append(
                f"| `{kernel['name'][:60]}` | {kernel['kind']} | "
                f"{kernel['ms_per_step'] * 1e3:.1f} | {kernel['launches_per_step']:g} | "
                f"{op[:90]} |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


def main(
    out_dir=None, recipes=("nvfp4",), calls: int = 5, small: bool = False, backend: str = "auto"
) -> str:
    unknown = sorted(set(recipes) - set(RECIPES))
    if unknown or not recipes:
        raise ValueError(f"recipes must be a non-empty subset of {sorted(RECIPES)}, got {recipes}")
    if backend not in ("auto", "pallas"):
        raise ValueError(f"backend must be 'auto' or 'pallas', got {backend!r}")
    rows = run(recipes, calls, small, backend)
    shape = SMALL_SHAPE if small else SHAPE
    return report(out_dir, "profile_quantize", rows, markdown(rows, shape, backend))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--recipes", nargs="+", default=["nvfp4"], choices=sorted(RECIPES))
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--backend", default="auto", choices=("auto", "pallas"))
    args = parser.parse_args()
    print(main(args.out, args.recipes, args.calls, args.small, args.backend))
