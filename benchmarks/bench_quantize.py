"""Effective bandwidth of the Pallas quantize / dequantize kernels (issue 4) on the H200.

Effective bandwidth = (bytes the operation must read + bytes it must write) / time: the input
once, every output once. The NVFP4 pipelines also re-read x for the global amax; that traffic is
*not* counted (it is what the "amax" rows cost on their own). Every case is timed as the median
over many runs after a warm-up, with CUPTI kernel times (jax.experimental.mosaic.gpu.profiler;
the sum of the kernels one call launches), falling back to wall-clock around
block_until_ready where CUPTI is unavailable. The jnp references (jax_qtrain, under jit) and
two copy baselines run in the same process.

    PYTHONPATH=. python3 benchmarks/bench_quantize.py OUT_DIR
writes OUT_DIR/bench_quantize.json and OUT_DIR/bench_quantize.md, and prints the table.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import jax_qtrain as jq
import pallas_kernels as pk
from jax_qtrain.formats import common, nvfp4
from pallas_kernels import quantize_common as qc

SHAPES = ((8192, 8192), (16384, 4096))
E4M3 = jnp.float8_e4m3fn


# --- timing -------------------------------------------------------------------------------------
def _wall_clock_ms(fn, args, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return times


def time_ms(fn: Callable, *args, iters: int = 30) -> tuple[float, str]:
    """Median time of one call of jitted `fn` (ms) and the clock used."""
    jitted = jax.jit(fn)
    jax.block_until_ready(jitted(*args))  # compile + warm up
    jax.block_until_ready(jitted(*args))
    try:
        from jax.experimental.mosaic.gpu import profiler

        _, times = profiler.measure(jitted, iterations=iters)(*args)
        if times and all(t is not None for t in times):
            return statistics.median(times), "cupti"
    except Exception as err:  # CUPTI missing or busy: fall back to the host clock
        print(f"  (cupti unavailable: {type(err).__name__}: {err}; using wall clock)")
    return statistics.median(_wall_clock_ms(jitted, args, iters)), "wall"


# --- baselines ----------------------------------------------------------------------------------
def pallas_copy(x: jax.Array, config: qc.TileConfig | None = None) -> jax.Array:
    """The quantize kernels' skeleton with no arithmetic: tiles into shared memory, read
    row-per-thread, stored back with 16-byte stores. Its bandwidth is that structure's ceiling."""
    config = config or qc.TileConfig()
    rows, cols = x.shape

    def tile(x_smem, m0, k0, dests, *, out_gmem):
        del dests  # no staged outputs: stores go straight to global memory
        for j in range(config.tile_k // 32):
            v = plgpu.load(x_smem.at[:, pl.ds(32 * j, 32)], layout=qc.rows_layout(x.dtype))
            qc.store_line_bytes(out_gmem.at[pl.ds(m0, config.tile_m), pl.ds(k0 + 32 * j, 32)], v)

    def kernel(x_gmem, *refs):
        outs, scratch = qc.split_refs(refs, config, cols)
        qc.for_each_tile(x_gmem, scratch, config, cols, functools.partial(tile, out_gmem=outs[0]))

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
        scratch_types=qc.tile_scratch(config, x.dtype, cols),
        compiler_params=qc.kernel_params(config, cols),
        **qc.tile_grid(rows, cols, config),
    )(x)


def pallas_cast_skeleton(x: jax.Array, config: qc.TileConfig | None = None):
    """The row+col quantize structure without block scaling: each tile read rowwise and
    columnwise, cast to E4M3 and written (staged in shared memory, TMA out, as the quantize
    kernels do by default). Bytes: 2 read + 2 written per element (bf16)."""
    config = config or qc.TileConfig()
    rows, cols = x.shape
    outputs = [qc.DataOutput(columnwise=False), qc.DataOutput(columnwise=True)]

    def tile(x_smem, m0, k0, dests):
        for j in range(config.tile_k // 32):
            v = qc.load_rows(x_smem.at[:, pl.ds(32 * j, 32)], x.dtype)
            qc.store_line_bytes(dests[0].cols(32 * j, 32), qc.as_bytes(qc.saturating_fp8(v, E4M3)))
        for i in range(config.tile_m // 32):
            v = qc.load_columns(x_smem.at[pl.ds(32 * i, 32), :])
            qc.store_line_bytes(dests[1].cols(32 * i, 32), qc.as_bytes(qc.saturating_fp8(v, E4M3)))

    def kernel(x_gmem, *refs):
        outs, scratch = qc.split_refs(refs, config, cols, outputs)
        qc.for_each_tile(x_gmem, scratch, config, cols, tile, list(zip(outs, outputs, strict=True)))

    return plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((rows, cols), jnp.uint8),
            jax.ShapeDtypeStruct((cols, rows), jnp.uint8),
        ),
        scratch_types=qc.tile_scratch(config, x.dtype, cols, outputs),
        compiler_params=qc.kernel_params(config, cols),
        **qc.tile_grid(rows, cols, config),
    )(x)


def nvfp4_fixed_amax(
    x: jax.Array,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
    stochastic: bool = False,
    config: pk.NVFP4QuantizeConfig | None = None,
):
    """The NVFP4 quantize kernel alone, as TransformerEngine quantizes activations / gradients
    (the columnwise copy Hadamard-rotated, stochastic rounding with fixed seeds if asked), with
    fixed global amaxes: the amax pass is its own kernel, the same for every variant compared."""
    return pk.quantize_nvfp4(
        x,
        rowwise=rowwise,
        columnwise=columnwise,
        rowwise_amax=jnp.float32(8.0),
        columnwise_amax=jnp.float32(8.0),
        hadamard_columnwise=columnwise,
        stochastic_rounding=stochastic,
        rowwise_seed=jnp.uint32(1) if stochastic else None,
        columnwise_seed=jnp.uint32(2) if stochastic else None,
        config=config,
    )


# --- cases --------------------------------------------------------------------------------------
def _nvfp4_xla_amaxes(x, rht: bool):
    """What jax_qtrain.quantize computes before calling the kernel: jnp amaxes of x and of the
    (rotated) xᵀ."""
    col = nvfp4.hadamard16(x.T) if rht else x.T
    return common.amax(x), common.amax(col)


def headline_cases(x: jax.Array) -> list[tuple[str, str, str, Callable, tuple, int]]:
    """The issue's table: each format rowwise and rowwise+columnwise, kernel (through
    jax_qtrain.quantize, backend="pallas") and jnp reference, and the copy baselines.
    Entries are (group, name, implementation, fn, args, bytes moved)."""
    m, k = x.shape
    n = m * k
    xb = n * x.dtype.itemsize
    key = jax.random.key(0)
    mx_row = xb + n + n // 32
    nv_row = xb + n // 2 + n // 16
    fb_row = xb + n + 4 * (n // 128)
    out = [
        ("copy", "x + 1 (XLA fusion)", "xla", lambda v: v + jnp.bfloat16(1), (x,), 2 * xb),
        ("copy", "tile skeleton (direct stores)", "pallas", pallas_copy, (x,), 2 * xb),
        ("copy", "row+col e4m3 cast skeleton", "pallas", pallas_cast_skeleton, (x,), 2 * xb),
    ]

    def add_quantize(group, recipe, role, columnwise, nbytes, scale_layout="lines"):
        for impl, backend in (("pallas", "pallas"), ("reference", "reference")):
            fn = functools.partial(
                jq.quantize,
                recipe=recipe,
                role=role,
                columnwise=columnwise,
                backend=backend,
                scale_layout=scale_layout,
            )
            name = "row+col" if columnwise else "row"
            if scale_layout == "tiles":
                name += ", GEMM-ready (tiles) scales"
            out.append((group, name, impl, lambda v, f=fn: f(v, key=key), (x,), nbytes))

    add_quantize("mxfp8 e4m3", jq.MXFP8BlockScaling(), "input", True, 2 * mx_row - xb)
    add_quantize("mxfp8 e4m3", jq.MXFP8BlockScaling(), "input", False, mx_row)
    # The same bytes with the scales as the kernel writes them (the layout the block-FP8 GEMM
    # reads; docs/design/layouts.md), so no rearranging pass follows.
    add_quantize("mxfp8 e4m3", jq.MXFP8BlockScaling(), "input", True, 2 * mx_row - xb, "tiles")
    # NVFP4 inputs: Hadamard on the columnwise copy; end to end through jax_qtrain (jnp amaxes).
    add_quantize("nvfp4 rht (input)", jq.NVFP4BlockScaling(), "input", True, 2 * nv_row - xb)
    add_quantize("nvfp4 (input)", jq.NVFP4BlockScaling(), "input", False, nv_row)
    add_quantize("fp8 block 1x128", jq.Float8BlockScaling(), "input", True, 2 * fb_row - xb)
    add_quantize("fp8 block 1x128", jq.Float8BlockScaling(), "input", False, fb_row)
    add_quantize(
        "fp8 block 1x128", jq.Float8BlockScaling(), "input", True, 2 * fb_row - xb, "tiles"
    )
    add_quantize(
        "fp8 block 128x128", jq.Float8BlockScaling(), "weight", True, xb + 2 * n + 8 * n // 16384
    )
    # NVFP4 weights: 16×16 blocks, one scale per block for both copies (no Hadamard).
    add_quantize("nvfp4 16x16 (weight)", jq.NVFP4BlockScaling(), "weight", True, xb + n + n // 128)
    return out


def extra_cases(x: jax.Array) -> list[tuple[str, str, str, Callable, tuple, int]]:
    """NVFP4 gradients (stochastic rounding), the NVFP4 pipeline's pieces, dequantize."""
    n = x.size
    xb = n * x.dtype.itemsize
    key = jax.random.key(0)
    nv_row = xb + n // 2 + n // 16
    out = []
    for impl in ("pallas", "reference"):
        fn = functools.partial(
            jq.quantize, recipe=jq.NVFP4BlockScaling(), role="grad", columnwise=True, backend=impl
        )
        out.append(
            (
                "nvfp4 rht+sr (grad)",
                "row+col",
                impl,
                lambda v, f=fn: f(v, key=key),
                (x,),
                2 * nv_row - xb,
            )
        )

    # NVFP4 pieces: the global amax (Pallas, one pass for both copies, vs jnp), the quantize
    # kernel alone, and the all-Pallas pipeline.
    amaxes = jax.jit(lambda v: _nvfp4_xla_amaxes(v, True))(x)
    quantize_rht = functools.partial(
        pk.quantize_nvfp4, rowwise=True, columnwise=True, hadamard_columnwise=True
    )
    out += [
        (
            "nvfp4 amax (row + rht col)",
            "amax",
            "pallas",
            lambda v: pk.nvfp4_amax(v, hadamard_columnwise=True),
            (x,),
            xb,
        ),
        (
            "nvfp4 amax (row + rht col)",
            "amax",
            "xla (jnp)",
            lambda v: _nvfp4_xla_amaxes(v, True),
            (x,),
            xb,
        ),
        (
            "nvfp4 rht (input)",
            "row+col kernel only",
            "pallas",
            lambda v, a: quantize_rht(v, rowwise_amax=a[0], columnwise_amax=a[1]),
            (x, amaxes),
            2 * nv_row - xb,
        ),
        (
            "nvfp4 rht (input)",
            "row+col, pallas amax",
            "pallas",
            lambda v: (lambda a: quantize_rht(v, rowwise_amax=a[0], columnwise_amax=a[1]))(
                pk.nvfp4_amax(v, hadamard_columnwise=True)
            ),
            (x,),
            2 * nv_row - xb,
        ),
        # NVFP4 weights' 16×16 block amaxes (stop 37): the Pallas pass jax_qtrain now takes
        # (the global amax is their maximum) vs the jnp reduction it replaces.
        (
            "nvfp4 16x16 block amaxes",
            "amax",
            "pallas",
            lambda v: pk.nvfp4_block_amax_bits(v, use_kernel=True),
            (x,),
            xb + n // 64,
        ),
        (
            "nvfp4 16x16 block amaxes",
            "amax",
            "xla (jnp)",
            lambda v: pk.nvfp4_block_amax_bits(v, use_kernel=False),
            (x,),
            xb + n // 64,
        ),
    ]
    # NVFP4 weights' quantize kernel alone (block amaxes and global amax given; the wrapper's
    # per-line repetition of the block amaxes included), with each group's block amaxes loaded
    # before it (the default) and the tile's loaded at its start (`preload_block_amaxes`).
    weight_bits = jax.jit(pk.nvfp4_block_amax_bits)(x)
    weight_amax = jax.lax.bitcast_convert_type(jnp.max(weight_bits), jnp.float32)
    for label, config in (
        ("row+col kernel only", None),
        (
            "row+col kernel only, preloaded block amaxes",
            pk.NVFP4QuantizeConfig(preload_block_amaxes=True),
        ),
    ):
        quantize_weight = functools.partial(
            pk.quantize_nvfp4, block_shape=(16, 16), columnwise=True, config=config
        )
        out.append(
            (
                "nvfp4 16x16 (weight)",
                label,
                "pallas",
                lambda v, b, a, f=quantize_weight: f(
                    v, rowwise_amax=a, columnwise_amax=a, block_amax_bits=b
                ),
                (x, weight_bits, weight_amax),
                xb + n + n // 128,
            )
        )

    # Dequantize (bf16 out) of the rowwise copies.
    mx = jq.quantize(x, jq.MXFP8BlockScaling(), backend="reference")
    nv = jq.quantize(x, jq.NVFP4BlockScaling(), backend="reference")
    fb = jq.quantize(x, jq.Float8BlockScaling(), backend="reference")
    bf = jnp.bfloat16
    out += [
        (
            "dequantize mxfp8",
            "row -> bf16",
            "pallas",
            lambda d, s: pk.dequantize_mxfp8(d, s, out_dtype=bf),
            (mx.rowwise_data, mx.rowwise_scale_inv),
            n + n // 32 + 2 * n,
        ),
        (
            "dequantize mxfp8",
            "row -> bf16",
            "reference",
            lambda q: q.dequantize(dtype=bf),
            (mx,),
            n + n // 32 + 2 * n,
        ),
        (
            "dequantize nvfp4",
            "row -> bf16",
            "pallas",
            lambda d, s, a: pk.dequantize_nvfp4(d, s, a, out_dtype=bf),
            (nv.rowwise_data, nv.rowwise_scale_inv, nv.rowwise_amax),
            n // 2 + n // 16 + 2 * n,
        ),
        (
            "dequantize nvfp4, integer decode (stops <= 35)",
            "row -> bf16",
            "pallas",
            lambda d, s, a: pk.dequantize_nvfp4(
                d, s, a, out_dtype=bf, config=pk.DequantizeConfig(scaled_e2m1_decode=False)
            ),
            (nv.rowwise_data, nv.rowwise_scale_inv, nv.rowwise_amax),
            n // 2 + n // 16 + 2 * n,
        ),
        (
            "dequantize nvfp4",
            "row -> bf16",
            "reference",
            lambda q: q.dequantize(dtype=bf),
            (nv,),
            n // 2 + n // 16 + 2 * n,
        ),
        (
            "dequantize fp8 block",
            "row -> bf16",
            "pallas",
            lambda d, s: pk.dequantize_fp8_block(d, s, out_dtype=bf),
            (fb.rowwise_data, fb.rowwise_scale_inv),
            n + 4 * (n // 128) + 2 * n,
        ),
        (
            "dequantize fp8 block",
            "row -> bf16",
            "reference",
            lambda q: q.dequantize(dtype=bf),
            (fb,),
            n + 4 * (n // 128) + 2 * n,
        ),
    ]
    return out


def config_sweep(x: jax.Array) -> list[tuple[str, str, str, Callable, tuple, int]]:
    """Tile shapes of the two headline kernels (the defaults are 128×128), and the opt-in
    arithmetic variants (MXFP8's former exact path, FP8 block's lean one)."""
    n = x.size
    xb = n * x.dtype.itemsize
    amaxes = jax.jit(lambda v: _nvfp4_xla_amaxes(v, True))(x)
    out = []
    variants = [
        dict(tile_m=128, tile_k=256),
        dict(tile_m=256, tile_k=128),
        dict(tile_m=256, tile_k=256, stage_outputs=False),
        dict(stage_outputs=False),
        dict(steps_per_cta=4, max_concurrent_steps=2),
        dict(steps_per_cta=8, max_concurrent_steps=3),
    ]

    def mxfp8_row_col(label: str, cfg: pk.MXFP8QuantizeConfig):
        return (
            "mxfp8 e4m3",
            f"row+col, {label}",
            "pallas",
            lambda v: pk.quantize_mxfp8(v, columnwise=True, config=cfg),
            (x,),
            xb + 2 * (n + n // 32),
        )

    out.append(mxfp8_row_col("exact arithmetic", pk.MXFP8QuantizeConfig(lean_arithmetic=False)))
    out.append(mxfp8_row_col("split copies", pk.MXFP8QuantizeConfig(split_copies=True)))
    out.append(
        (
            "copy",
            "tile skeleton, steps 4",
            "pallas",
            lambda v: pallas_copy(v, qc.TileConfig(steps_per_cta=4)),
            (x,),
            2 * xb,
        )
    )
    out.append(
        (
            "fp8 block 1x128",
            "row+col, steps 4",
            "pallas",
            lambda v: pk.quantize_fp8_block(
                v, columnwise=True, config=pk.FP8BlockQuantizeConfig(steps_per_cta=4)
            ),
            (x,),
            xb + 2 * (n + 4 * n // 128),
        )
    )
    # FP8 block: the first kernel's exact arithmetic against lean_arithmetic (the default since
    # stop 19, same bits), called directly (the headline rows go through jax_qtrain.quantize):
    # Float8BlockScaling's inputs (1×128, E4M3, power-of-2 scales) and weights (128×128).
    fb_bytes = {(1, 128): xb + 2 * (n + 4 * n // 128), (128, 128): xb + 2 * n + 8 * n // 16384}
    exact = pk.FP8BlockQuantizeConfig(lean_arithmetic=False)
    for block, label, cfg in (
        ((1, 128), "exact arithmetic", exact),
        ((1, 128), "default (lean arithmetic)", None),
        ((128, 128), "exact arithmetic", exact),
        ((128, 128), "default (lean arithmetic)", None),
    ):
        out.append(
            (
                f"fp8 block {block[0]}x{block[1]}",
                f"row+col kernel only, {label}",
                "pallas",
                lambda v, b=block, c=cfg: pk.quantize_fp8_block(
                    v, block_shape=b, columnwise=True, config=c
                ),
                (x,),
                fb_bytes[block],
            )
        )
    for variant in variants:
        label = ", ".join(f"{k}={v}" for k, v in variant.items())
        nv_cfg = pk.NVFP4QuantizeConfig(**variant)
        out.append(mxfp8_row_col(label, pk.MXFP8QuantizeConfig(**variant)))
        out.append(
            (
                "nvfp4 rht (input)",
                f"row+col kernel only, {label}",
                "pallas",
                lambda v, a, c=nv_cfg: pk.quantize_nvfp4(
                    v,
                    columnwise=True,
                    rowwise_amax=a[0],
                    columnwise_amax=a[1],
                    hadamard_columnwise=True,
                    config=c,
                ),
                (x, amaxes),
                xb + 2 * (n // 2 + n // 16),
            )
        )
    return out


# --- driver -------------------------------------------------------------------------------------
def _format_table(rows: list[dict]) -> str:
    lines = [
        "| shape | case | variant | implementation | time (µs) | effective TB/s |",
        "|---|---|---|---|---:|---:|",
    ]
    for r in rows:
        time_text = f"{r['ms'] * 1e3:.1f}" if r["ms"] is not None else "—"
        bw = f"{r['tb_s']:.2f}" if r["tb_s"] is not None else r.get("error", "failed")[:60]
        lines.append(
            f"| {r['shape']} | {r['group']} | {r['name']} | {r['impl']} | {time_text} | {bw} |"
        )
    return "\n".join(lines)


CASE_GROUPS = ("headline", "extra", "sweep")


def main(
    out_dir: str | os.PathLike | None = None,
    *,
    small: bool = False,
    budget_s: float | None = None,
    cases: tuple[str, ...] = CASE_GROUPS,
) -> str:
    """Run the case groups `cases` (headline cases on both shapes, extra cases and the config
    sweep on the first); write JSON and a markdown table under `out_dir` and return the table.
    `small`: one 256×256 shape, few runs (a smoke test; kernels run in Mosaic GPU's
    interpreter where there is no GPU). `budget_s` (default: env BENCH_BUDGET_S, else none)
    stops starting new cases after that many seconds, so a time-limited run still reports."""
    unknown = sorted(set(cases) - set(CASE_GROUPS))
    if unknown or not cases:
        raise ValueError(f"cases must be a non-empty subset of {list(CASE_GROUPS)}, got {unknown}")
    if small and jax.devices()[0].platform != "gpu":
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
            return _run(out_dir, ((256, 256),), iters=2, budget_s=budget_s, cases=cases)
    return _run(
        out_dir,
        ((256, 256),) if small else SHAPES,
        iters=3 if small else 30,
        budget_s=budget_s,
        cases=cases,
    )


def _run(out_dir, shapes, *, iters: int, budget_s: float | None, cases: tuple[str, ...]) -> str:
    if budget_s is None and os.environ.get("BENCH_BUDGET_S"):
        budget_s = float(os.environ["BENCH_BUDGET_S"])
    start = time.time()
    device = jax.devices()[0]
    print(f"device: {device.device_kind}, jax {jax.__version__}", flush=True)
    rows: list[dict] = []
    schedule = []
    # Most important first: a time budget cuts from the end.
    if "headline" in cases:
        for shape in shapes:
            schedule.append((shape, headline_cases))
    if "extra" in cases:
        schedule.append((shapes[0], extra_cases))
    if "sweep" in cases:
        schedule.append((shapes[0], config_sweep))
    for shape, make in schedule:
        x = jax.random.normal(jax.random.key(1), shape, jnp.float32).astype(jnp.bfloat16)
        for group, name, impl, fn, args, nbytes in make(x):
            if budget_s is not None and time.time() - start > budget_s:
                print(f"  budget of {budget_s:.0f} s reached: skipping {group} / {name} / {impl}")
                continue
            row = dict(
                shape=f"{shape[0]}x{shape[1]}",
                group=group,
                name=name,
                impl=impl,
                bytes=nbytes,
                ms=None,
                tb_s=None,
                clock=None,
            )
            try:
                ms, clock = time_ms(fn, *args, iters=iters)
                row.update(ms=ms, tb_s=nbytes / (ms * 1e-3) / 1e12, clock=clock)
            except Exception as err:  # report and keep going: one failure must not hide the rest
                row["error"] = f"{type(err).__name__}: {err}"
            rows.append(row)
            print(
                f"  {row['shape']} {group:28s} {name:34s} {impl:10s} "
                f"{'%.1f us' % (row['ms'] * 1e3) if row['ms'] else row.get('error', '')[:120]}"
                f"{'  {:.2f} TB/s'.format(row['tb_s']) if row['tb_s'] else ''}",
                flush=True,
            )
    table = _format_table(rows)
    print(table)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        meta = dict(
            device=device.device_kind,
            jax=jax.__version__,
            date=time.strftime("%Y-%m-%d"),
            numpy=np.__version__,
        )
        (out / "bench_quantize.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        (out / "bench_quantize.md").write_text(table + "\n")
    return table


if __name__ == "__main__":
    # bench_quantize.py [OUT_DIR] [--cases=headline,extra,sweep]
    positional = [a for a in sys.argv[1:] if not a.startswith("--cases=")]
    selected = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--cases=")]
    main(
        positional[0] if positional else None,
        cases=tuple(selected[-1].split(",")) if selected else CASE_GROUPS,
    )
