"""Helpers shared by the benchmarks: median wall time of a jitted call on the device, the
device's description, and writing a benchmark's rows and table."""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import jax
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu


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


def alternation(names: list[str], rounds: int) -> Iterator[str]:
    """Every name once per round, each round starting one name later (so no candidate always
    runs first or after the same neighbour)."""
    for round_index in range(rounds):
        shift = round_index % len(names)
        yield from names[shift:] + names[:shift]


def same_bits_as_first(
    candidates: dict[str, tuple[Callable, Sequence[tuple]]], names, outputs=None
) -> dict:
    """{name: whether its output on its first argument set equals that of ``names[0]`` bit
    for bit (as float32; NaN equal to NaN)} for each of ``names``, the first included.
    `outputs`: those outputs where the caller has them already ({name: array}); each other
    candidate is called once (in the interpreter, every call is a whole interpretation)."""
    outputs = dict(outputs or {})

    def output(name):
        if name not in outputs:
            fn, argument_sets = candidates[name]
            outputs[name] = fn(*argument_sets[0])
        return np.asarray(outputs[name].astype(jax.numpy.float32))

    expected = output(names[0])
    return {name: bool(np.array_equal(output(name), expected, equal_nan=True)) for name in names}


def relative_difference(got, want) -> float:
    """max |got - want| / max |want| (float32): how far a candidate whose sums are ordered
    differently (or whose quantizer differs) lands from the reference it is compared with."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def interleaved_seconds(
    candidates: dict[str, tuple[Callable, Sequence[tuple]]],
    *,
    rounds: int = 15,
    calls_per_batch: int = 20,
    warmup_seconds: float = 1.0,
    compile_first: bool = True,
) -> dict[str, float]:
    """Median per-call seconds of each candidate, timed in alternation.

    Each round times one batch of ``calls_per_batch`` back-to-back calls of every candidate
    (rotating which goes first), so clock and power drift during the run hits all of them
    alike; comparing kernels timed minutes apart mixed that drift into the difference
    (docs/benchmarks.md). Every candidate is first called once on each argument set (its
    compilation; `compile_first=False` skips that, for the interpreter's smoke runs, whose
    times mean nothing and whose every call is a whole interpretation), then the GPU is kept
    busy for ``warmup_seconds``.
    """
    if compile_first:
        for fn, argument_sets in candidates.values():
            for args in argument_sets:
                jax.block_until_ready(fn(*args))
    names = list(candidates)
    deadline = time.perf_counter() + warmup_seconds
    while time.perf_counter() < deadline:
        for name in names:
            fn, argument_sets = candidates[name]
            jax.block_until_ready(fn(*argument_sets[0]))
    per_call: dict[str, list[float]] = {name: [] for name in names}
    for name in alternation(names, rounds):
        fn, argument_sets = candidates[name]
        start = time.perf_counter()
        out = None
        for i in range(calls_per_batch):
            out = fn(*argument_sets[i % len(argument_sets)])
        jax.block_until_ready(out)
        per_call[name].append((time.perf_counter() - start) / calls_per_batch)
    return {name: statistics.median(times) for name, times in per_call.items()}


def cupti_interleaved_seconds(
    candidates: dict[str, tuple[Callable, Sequence[tuple]]],
    *,
    rounds: int = 10,
    iterations: int = 10,
    compile_first: bool = True,
) -> dict[str, float]:
    """Median device seconds per call of each candidate (its kernels' CUPTI times summed, no
    launch gaps), timed in alternation: each round measures ``iterations`` calls of every
    candidate on its first argument set, rotating which goes first. For kernels of tens of
    microseconds, where `interleaved_seconds`' host clock measures dispatch as much as the
    kernel. Falls back to `interleaved_seconds` where CUPTI is unavailable (no GPU), which
    `compile_first` is passed to."""
    try:
        from jax.experimental.mosaic.gpu import profiler

        for fn, argument_sets in candidates.values():
            _, times = profiler.measure(fn, iterations=2)(*argument_sets[0])
            if not times or any(t is None for t in times):
                raise RuntimeError("CUPTI saw no kernel")
    except Exception:  # no GPU or no CUPTI: the host clock
        return interleaved_seconds(
            candidates,
            rounds=rounds,
            calls_per_batch=iterations,
            warmup_seconds=0,
            compile_first=compile_first,
        )
    names = list(candidates)
    per_call: dict[str, list[float]] = {name: [] for name in names}
    for name in alternation(names, rounds):
        fn, argument_sets = candidates[name]
        _, times = profiler.measure(fn, iterations=iterations)(*argument_sets[0])
        per_call[name] += [t * 1e-3 for t in times]  # CUPTI reports milliseconds
    return {name: statistics.median(times) for name, times in per_call.items()}


def kernel_timing_setup(script: str, small: bool, shapes, small_shapes, interpreted_shapes):
    """(shapes, `interleaved_seconds` options, context to run in) of a script that times H200
    kernels: its shapes on a GPU (`small_shapes` with `small`, and fewer rounds), and where
    there is none, with `small`, `interpreted_shapes` in Mosaic GPU's interpreter (a smoke test
    whose times mean nothing); otherwise a RuntimeError naming `script`."""
    if jax.devices()[0].platform == "gpu":
        timing = dict(rounds=5, calls_per_batch=5) if small else {}
        return (small_shapes if small else shapes), timing, contextlib.nullcontext()
    if small:
        timing = dict(rounds=1, calls_per_batch=1, warmup_seconds=0, compile_first=False)
        return (
            interpreted_shapes,
            timing,
            plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()),
        )
    raise RuntimeError(f"{script} times the H200 kernels: run it on a GPU (or --small)")


# `interleaved_seconds` options for a smoke run (--small), whose times mean nothing: one short
# round keeps it quick anywhere.
SMOKE_TIMING = dict(rounds=1, calls_per_batch=1, warmup_seconds=0)


def named_subset(named: dict, names, what: str) -> dict:
    """The entries of `named` that `names` picks, in that order (all of them for no names); a
    ValueError lists the unknown ones and what `what` may be."""
    if not names:
        return named
    unknown = sorted(set(names) - set(named))
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; expected some of {sorted(named)}")
    return {name: named[name] for name in names}


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
