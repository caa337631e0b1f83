"""Where the grouped GEMM's consumer warpgroups spend their time (issue 5), from a profiler trace.

The bf16 forward kernel runs at ~0.9× torch._grouped_mm, and neither the persistent pipeline nor
2-CTA clusters changed that (docs/benchmarks.md, stop 18). Before building a ping-pong schedule,
this measures what it would win: with `GroupedMatmulConfig.profile_dir` set, every call writes a
Mosaic GPU profiler trace whose ranges are each consumer warpgroup's "k_loop" (the K loop of one
output tile), "epilogue" (scales, conversion and stores of that tile) and "zero_tail". Both
consumers share each K step's SMEM stage, so they finish a tile together and the tensor core
idles during every epilogue: the epilogue's share of a consumer's busy time bounds what
overlapping it with the next tile's K loop could gain.

    python -m benchmarks.profile_grouped [--out DIR] [--small]

writes DIR/profile_grouped.json and .md (the summary; traces stay in a temporary directory).
`--small` runs tiny shapes in the Pallas interpreter, which writes no trace (a smoke test).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import jax

from benchmarks.bench_grouped_matmul import random_operands
from benchmarks.timing import device_description, report
from pallas_kernels.grouped_matmul_driver import (
    PROFILE_EPILOGUE,
    PROFILE_K_LOOP,
    PROFILE_ZERO_TAIL,
)
from pallas_kernels.grouped_matmul_fwd import (
    DEFAULT_BF16_CONFIG,
    DEFAULT_FP8_CONFIG,
    grouped_matmul,
)

RANGES = (PROFILE_K_LOOP, PROFILE_EPILOGUE, PROFILE_ZERO_TAIL)


def summarize_trace(trace: dict) -> dict:
    """Per consumer track (a Chrome-trace tid): busy span, time in each range, the gaps between.

    Returns means over the tracks (µs) and the epilogue's share of the busy span."""
    open_ranges: dict[tuple[int, str], float] = {}
    totals: dict[int, dict[str, float]] = defaultdict(lambda: dict.fromkeys(RANGES, 0.0))
    counts: dict[int, dict[str, int]] = defaultdict(lambda: dict.fromkeys(RANGES, 0))
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for event in trace["traceEvents"]:
        track, name, ts = event["tid"], event["name"], float(event["ts"])
        if name not in RANGES:
            continue
        first[track] = min(first.get(track, ts), ts)
        last[track] = max(last.get(track, ts), ts)
        if event["ph"] == "B":
            open_ranges[(track, name)] = ts
        elif (track, name) in open_ranges:
            totals[track][name] += ts - open_ranges.pop((track, name))
            counts[track][name] += 1
    tracks = sorted(totals)
    if not tracks:
        raise ValueError("the trace has no k_loop / epilogue ranges")
    spans = [last[t] - first[t] for t in tracks]

    def mean_of(name: str) -> float:
        return statistics.mean(totals[t][name] for t in tracks)

    def per_range(name: str) -> float:
        done = sum(counts[t][name] for t in tracks)
        return sum(totals[t][name] for t in tracks) / done if done else 0.0

    busy = statistics.mean(spans)
    k_loop, epilogue, zero_tail = (mean_of(name) for name in RANGES)
    return dict(
        consumer_tracks=len(tracks),
        span_us=busy,
        span_min_us=min(spans),
        span_max_us=max(spans),
        k_loop_us=k_loop,
        epilogue_us=epilogue,
        zero_tail_us=zero_tail,
        gaps_us=busy - k_loop - epilogue - zero_tail,
        k_loop_per_tile_us=per_range(PROFILE_K_LOOP),
        epilogue_per_tile_us=per_range(PROFILE_EPILOGUE),
        epilogue_share=epilogue / busy if busy else 0.0,
    )


def profile_case(run, warm_up, args, trace_dir: Path, warm_up_calls: int = 3) -> dict | None:
    """Runs the unprofiled `warm_up(*args)` a few times (so clocks and caches are warm), then
    the profiled `run(*args)` once, and summarizes its trace; None when no trace was written
    (the interpreter). Mosaic GPU writes a compiled kernel's trace once, at its first launch,
    and refuses to overwrite it later (H200, stop 22), hence one profiled call."""
    for _ in range(warm_up_calls):
        jax.block_until_ready(warm_up(*args))
    jax.block_until_ready(run(*args))
    written = sorted(trace_dir.glob("*.json"))
    if not written:
        return None
    return summarize_trace(json.loads(written[-1].read_text()))


def main(out_dir: str | None = None, small: bool = False) -> str:
    g, m, k, n, sizes = (8, 16384, 4096, 4096, [2048] * 8)
    interpret = False
    # The profiler's buffers take ~1 KiB of SMEM, which the FP8 default (4 stages, 224 KiB)
    # does not have left (H200, 2026-11-30): it is profiled with 3 stages.
    configs = {
        "bf16": DEFAULT_BF16_CONFIG,
        "fp8 rowwise (3 stages)": dataclasses.replace(DEFAULT_FP8_CONFIG, max_concurrent_steps=3),
    }
    if small:
        g, m, k, n, sizes, interpret = 2, 256, 256, 256, [128, 128], True
        tiny = dict(tile_m=64, tile_n=64, num_sms=2, grid_tile_width=1)
        configs = {name: dataclasses.replace(c, **tiny) for name, c in configs.items()}
    operands = random_operands(jax.random.key(9), g, m, k, n, sizes)[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in configs.items():
            trace_dir = Path(tmp) / name.replace(" ", "_")
            trace_dir.mkdir()
            profiled = dataclasses.replace(config, profile_dir=str(trace_dir))
            if name == "bf16":
                args = (operands["lhs"], operands["rhs"], operands["sizes"])

                def make(c):
                    return jax.jit(
                        lambda a, b, s: grouped_matmul(a, b, s, config=c, interpret=interpret)
                    )
            else:
                args = (
                    operands["lhs8"],
                    operands["rhs8"],
                    operands["sizes"],
                    operands["lhs_row_scale"],
                    operands["rhs_col_scale"],
                )

                def make(c):
                    return jax.jit(
                        lambda a, b, s, sa, sb: grouped_matmul(
                            a, b, s, lhs_scale=sa, rhs_scale=sb, config=c, interpret=interpret
                        )
                    )

            case = f"G{g} {m}x{k}x{n} fwd {name}"
            try:
                summary = profile_case(
                    make(profiled), make(config), args, trace_dir, warm_up_calls=0 if small else 3
                )
            except Exception as error:  # one failed case must not lose the others' traces
                rows.append(dict(case=case, summary=None, error=f"{type(error).__name__}: {error}"))
                continue
            rows.append(dict(case=case, summary=summary))
    lines = [
        f"Device: {device_description()}. Means over the consumer warpgroups' tracks (µs).",
        "",
        "| case | tracks | span | k_loop | epilogue | gaps | k_loop / tile | epilogue / tile "
        "| epilogue share |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        s = row["summary"]
        if s is None:
            why = row.get("error", "no trace written (interpreter)")[:200].replace("|", "/")
            lines.append(f"| {row['case']} | {why} |||||||| |")
            continue
        lines.append(
            f"| {row['case']} | {s['consumer_tracks']} | {s['span_us']:.1f} | "
            f"{s['k_loop_us']:.1f} | {s['epilogue_us']:.1f} | {s['gaps_us']:.1f} | "
            f"{s['k_loop_per_tile_us']:.2f} | {s['epilogue_per_tile_us']:.2f} | "
            f"{100 * s['epilogue_share']:.1f}% |"
        )
    return report(out_dir, "profile_grouped", rows, "\n".join(lines) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    parser.add_argument("--small", action="store_true")
    arguments = parser.parse_args()
    print(main(arguments.out, small=arguments.small))
