"""Helpers shared by the benchmarks: median wall time of a jitted call on the device, the
device's description, and writing a benchmark's rows and table."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax


def median_seconds(
    fn: Callable, argument_sets: Sequence[tuple], *, warmup: int = 3, iters: int = 20
) -> float:
    """Median seconds of `fn(*args)`, rotating through several argument sets (so repeated
    calls don't just measure the L2 cache) after `warmup` calls of each. Blocks on the outputs."""
    for args in argument_sets:
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    times = []
    for i in range(iters):
        args = argument_sets[i % len(argument_sets)]
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def device_description() -> str:
    device = jax.devices()[0]
    return f"{device.device_kind} ({device.platform}), jax {jax.__version__}"


def report(out_dir: str | None, name: str, rows: list[dict], text: str) -> str:
    """Print the table `text`; with `out_dir`, also write OUT/name.json (the rows) and
    OUT/name.md (the table). Returns `text`."""
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / f"{name}.json").write_text(json.dumps(rows, indent=2))
        (Path(out_dir) / f"{name}.md").write_text(text)
    print(text)
    return text
