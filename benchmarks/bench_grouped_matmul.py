"""Grouped (MoE) matmul kernels of issue 5 against their peers, on the H200.

TFLOP/s = 2·M·N·K / time. Time = median over batches of back-to-back calls (per-call
mean of a batch, after warm-up), rotating between two argument sets of random data;
it includes whatever small XLA ops a wrapper adds (scale transposes, padding).
Each kernel config's output is compared with an f32 XLA reference on the same
(dequantized) operands (relative Frobenius error), so a fast wrong config shows.
Peers run in the same process: lax.ragged_dot / ragged_dot_general (bf16), XLA dense
bf16 and fp8 GEMMs of the same total size (ceilings), torch._grouped_mm and
torch._scaled_grouped_mm where torch has them, and the Mosaic GPU kernels that ship inside
the jax wheel (`jax.experimental.pallas.ops.gpu`: `ragged_dot_mgpu`,
`transposed_ragged_dot_mgpu`, `hopper_matmul_mgpu`), a few of their own tuning configs each.

    PYTHONPATH=. python3 benchmarks/bench_grouped_matmul.py OUT_DIR [BUDGET_SECONDS] [--small]
        [--sections=g8,quantized,wgrad,g64,dense_block,skewed,defaults]

"defaults" (opt-in, not in the sections run by default) times only today's defaults and
their alternatives, forward on both G8 shapes, with torch's grouped GEMMs and XLA's dense
GEMMs, then the dense block-FP8 default: the target rows in one short call.

writes OUT_DIR/bench_grouped_matmul.jsonl (one line per measurement, as they happen)
and OUT_DIR/bench_grouped_matmul.md (the table). Work past the time budget is skipped
and listed as such.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback
import unittest.mock
import zlib
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.grouped_matmul_dense import dense_matmul, dense_matmul_fp8_block
from pallas_kernels.grouped_matmul_fwd import (
    GroupedMatmulConfig,
    grouped_matmul,
    grouped_matmul_fp8_block,
)
from pallas_kernels.grouped_matmul_wgrad import GroupedWgradConfig, grouped_matmul_wgrad

BF16, E4M3, E5M2 = jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2

# (name, G, M, K, N, group sizes) — fwd: out (M, N) contracts K; dgrad swaps K and N.
SHAPES = {
    "G8 balanced": (8, 16384, 4096, 4096, [2048] * 8),
    "G8 skewed": (8, 16384, 4096, 4096, [6000, 3100, 2050, 1500, 1100, 1000, 900, 734]),
    "G64 small experts": (64, 32768, 2048, 1408, [512] * 64),
}


def fwd_config(
    tm,
    tn,
    tk,
    steps,
    epi,
    minor=0,
    width=8,
    in_flight=1,
    buffers=1,
    swizzled_epilogue=True,
    persistent=False,
):
    return GroupedMatmulConfig(
        tile_m=tm,
        tile_n=tn,
        tile_k=tk,
        max_concurrent_steps=steps,
        epi_tile_n=epi,
        grid_minor_dim=minor,
        grid_tile_width=width,
        wgmma_in_flight=in_flight,
        epilogue_buffers=buffers,
        swizzled_epilogue=swizzled_epilogue,
        persistent_pipeline=persistent,
    )


def fwd_label(kind: str, cfg: GroupedMatmulConfig) -> str:
    """Row name of a forward config: its CTA tile, the epilogue when it is the plain one, and
    the persistent pipeline when it is on."""
    plain = "" if cfg.swizzled_epilogue else ", plain epilogue"
    persistent = ", persistent" if cfg.persistent_pipeline else ""
    stream_k = ", stream-K" if cfg.stream_k else ""
    streamed = ", streamed scales" if cfg.stream_lhs_scales else ""
    return f"pallas {kind} {cfg.tile_m}x{2 * cfg.tile_n}{plain}{persistent}{stream_k}{streamed}"


def wgrad_config(tm, tn, tt, steps, epi, minor=1, width=4, buffers=2):
    return GroupedWgradConfig(
        tile_m=tm,
        tile_n=tn,
        tile_t=tt,
        max_concurrent_steps=steps,
        epi_tile_n=epi,
        grid_minor_dim=minor,
        grid_tile_width=width,
        epilogue_buffers=buffers,
    )


# CPU smoke test of this script (--small): tiny shapes through the Pallas interpreter.
INTERPRET = False
DENSE_BF16_CONFIG = None  # dense_matmul's own default; --small gives it the tiny config

# Sweeps, most promising first (the budget may cut the tail). The epilogue rows must
# span 128 bytes (epi_tile_n 64 for bf16 outputs, 32 for f32).
# The previous bests (stop 13) come first, each beside the same config with the plain
# (unswizzled) epilogue they were measured with, so the two staging paths meet in one run.
BF16_FWD_CONFIGS = [
    fwd_config(128, 128, 64, 3, 64, in_flight=0, buffers=2),
    fwd_config(128, 128, 64, 3, 64, in_flight=0, buffers=2, swizzled_epilogue=False),
    fwd_config(128, 128, 64, 4, 64),
    fwd_config(128, 128, 64, 3, 64, buffers=2),
    fwd_config(128, 128, 64, 4, 64, in_flight=0),
    fwd_config(128, 128, 64, 4, 64, width=16),
    fwd_config(128, 128, 64, 4, 64, minor=1),
]
FP8_FWD_CONFIGS = [
    fwd_config(128, 128, 128, 4, 64),
    fwd_config(128, 128, 128, 4, 64, swizzled_epilogue=False),
    fwd_config(128, 128, 128, 3, 64, in_flight=0, buffers=2),
    fwd_config(128, 128, 128, 4, 64, in_flight=0),
    fwd_config(128, 128, 128, 4, 64, in_flight=0, width=16),
    fwd_config(128, 128, 128, 4, 64, width=16),
    fwd_config(128, 128, 128, 4, 64, minor=1),
]
BLOCK_CONFIGS = [
    fwd_config(64, 128, 128, 4, 64, in_flight=0, buffers=2),
    fwd_config(64, 128, 128, 4, 64, in_flight=0, buffers=2, persistent=True),
    fwd_config(64, 128, 128, 4, 64, in_flight=0, buffers=2, swizzled_epilogue=False),
    fwd_config(64, 128, 128, 4, 64, buffers=2),
    fwd_config(64, 128, 128, 4, 64, minor=1, buffers=2),
    fwd_config(64, 128, 128, 4, 64, width=16, buffers=2),
]
BF16_WGRAD_CONFIGS = [
    wgrad_config(128, 128, 64, 3, 32),
    wgrad_config(128, 128, 64, 4, 32, buffers=1),
    wgrad_config(128, 128, 64, 4, 32, minor=0, buffers=1),
]
FP8_WGRAD_CONFIGS = [
    wgrad_config(128, 128, 128, 3, 32),
    wgrad_config(128, 128, 128, 4, 32, buffers=1),
]
# N = 1408 = 11 x 128: CTA tiles 128 wide fit exactly; 256 wide leave half a tile idle.
NARROW_BF16_CONFIGS = [fwd_config(128, 64, 64, 5, 64, buffers=2), fwd_config(128, 128, 64, 4, 64)]
NARROW_FP8_CONFIGS = [fwd_config(128, 64, 128, 5, 64, buffers=2), fwd_config(128, 128, 128, 4, 64)]


class Bench:
    """Collects measurements, enforces the time budget, appends JSON lines as it goes."""

    def __init__(self, out_dir: Path, budget_s: float):
        self.out_dir = out_dir
        self.start = time.perf_counter()
        self.budget_s = budget_s
        self.rows: list[dict] = []
        self.jsonl = out_dir / "bench_grouped_matmul.jsonl"

    def over_budget(self) -> bool:
        return time.perf_counter() - self.start > self.budget_s

    def record(self, **row) -> dict:
        row["t_elapsed_s"] = round(time.perf_counter() - self.start, 1)
        self.rows.append(row)
        with self.jsonl.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        flops = row.get("tflops")
        err = row.get("rel_err")
        print(
            f"[{row['t_elapsed_s']:6.1f}s] {row.get('shape', ''):18s} {row.get('op', ''):6s} "
            f"{row.get('impl', ''):34s} "
            + (f"{flops:8.1f} TFLOP/s" if flops else f"{row.get('status', '')[:90]}")
            + (f"  err {err:.2e}" if err is not None else ""),
            flush=True,
        )
        return row


def time_call(fn: Callable, arg_sets: list[tuple], target_batch_s: float = 0.03) -> float:
    """Median per-call seconds over 5 batches of back-to-back calls (after warm-up)."""
    for args in arg_sets:
        jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*arg_sets[0]))
    single = time.perf_counter() - start
    calls = int(min(40, max(3, target_batch_s / max(single, 1e-6))))
    per_call = []
    for _ in range(5):
        start = time.perf_counter()
        out = None
        for i in range(calls):
            out = fn(*arg_sets[i % len(arg_sets)])
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - start) / calls)
    return statistics.median(per_call)


def rel_err(out, ref) -> float:
    out = jnp.asarray(out, jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))


def measure(bench: Bench, *, shape, op, impl, flops, fn, arg_sets, ref=None, config=None):
    """Times ``fn`` (jitted) on arg_sets; compares its output on arg_sets[0] with ``ref``."""
    if bench.over_budget():
        return bench.record(shape=shape, op=op, impl=impl, status="skipped (time budget)")
    try:
        jitted = jax.jit(fn)
        if INTERPRET:
            # The smoke test: the time means nothing and every call is a whole interpretation,
            # so the one call that is checked is also the one timed.
            start = time.perf_counter()
            out = jax.block_until_ready(jitted(*arg_sets[0]))
            seconds = time.perf_counter() - start
            err = None if ref is None else rel_err(out, ref)
        else:
            err = None if ref is None else rel_err(jitted(*arg_sets[0]), ref)
            seconds = time_call(jitted, arg_sets)
        return bench.record(
            shape=shape,
            op=op,
            impl=impl,
            ms=seconds * 1e3,
            tflops=flops / seconds / 1e12,
            rel_err=err,
            config=None if config is None else asdict(config),
            status="ok",
        )
    except Exception as e:  # record and keep going: one failure must not end the run
        msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        traceback.print_exc(limit=3)
        return bench.record(
            shape=shape,
            op=op,
            impl=impl,
            status=f"error {msg}",
            config=None if config is None else asdict(config),
        )


def best(rows: list[dict], max_err: float) -> dict | None:
    good = [r for r in rows if r and r.get("tflops") and (r.get("rel_err") or 0) < max_err]
    return max(good, key=lambda r: r["tflops"]) if good else None


def config_of(row: dict | None, cls, default):
    return cls(**row["config"]) if row and row.get("config") else default


# ----------------------------------------------------------------------------- data


def random_operands(key, g, m, k, n, sizes):
    """Two argument sets: lhs (M, K) bf16, rhs (G, N, K) bf16 and their fp8 versions."""
    sets = []
    for i in range(2):
        k1, k2, k3, k4 = jax.random.split(jax.random.fold_in(key, i), 4)
        lhs = jax.random.normal(k1, (m, k), jnp.float32)
        rhs = jax.random.normal(k2, (g, n, k), jnp.float32)
        sets.append(
            dict(
                lhs=lhs.astype(BF16),
                rhs=rhs.astype(BF16),
                lhs8=lhs.astype(E4M3),
                rhs8=rhs.astype(E4M3),
                lhs_row_scale=jax.random.uniform(k3, (m,), jnp.float32, 0.5, 2.0),
                rhs_col_scale=jax.random.uniform(k4, (g, n), jnp.float32, 0.5, 2.0),
            )
        )
    sets[0]["sizes"] = sets[1]["sizes"] = jnp.asarray(sizes, jnp.int32)
    return sets


def ragged_ref(lhs_f32, rhs_nk_f32, sizes):
    return lax.ragged_dot(
        lhs_f32,
        jnp.swapaxes(rhs_nk_f32, 1, 2),
        sizes,
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def wgrad_ref(lhs_km_f32, rhs_nm_f32, sizes):
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    return lax.ragged_dot_general(
        lhs_km_f32.T,
        rhs_nm_f32.T,
        sizes,
        dims,
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


# ---------------------------------------------------------------------------- peers


def torch_peers(bench: Bench, shape: str, sets, g, m, k, n, flops):
    try:
        import torch
    except ImportError:
        bench.record(shape=shape, op="fwd", impl="torch", status="torch not installed")
        return
    if bench.over_budget() or not torch.cuda.is_available():
        return
    dev = "cuda"
    sizes = np.asarray(sets[0]["sizes"])
    offs = torch.tensor(np.cumsum(sizes), dtype=torch.int32, device=dev)
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w_nk = torch.randn(g, n, k, device=dev, dtype=torch.bfloat16)

    def torch_time(fn) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                fn()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop) / 10 / 1e3)
        return statistics.median(times)

    def record_torch(impl: str, fn) -> None:
        try:
            seconds = torch_time(fn)
            bench.record(
                shape=shape,
                op="fwd",
                impl=impl,
                ms=seconds * 1e3,
                tflops=flops / seconds / 1e12,
                status="ok",
            )
        except Exception as e:
            bench.record(shape=shape, op="fwd", impl=impl, status=f"error {type(e).__name__}: {e}")

    record_torch(
        "torch._grouped_mm bf16", lambda: torch._grouped_mm(a, w_nk.transpose(-2, -1), offs=offs)
    )
    a8 = a.to(torch.float8_e4m3fn)
    w8 = w_nk.to(torch.float8_e4m3fn)
    sa = torch.rand(m, device=dev, dtype=torch.float32) + 0.5
    sb = torch.rand(g, n, device=dev, dtype=torch.float32) + 0.5
    record_torch(
        "torch._scaled_grouped_mm fp8 row",
        lambda: torch._scaled_grouped_mm(
            a8, w8.transpose(-2, -1), sa, sb, offs=offs, out_dtype=torch.bfloat16
        ),
    )
    torch.cuda.empty_cache()


# The Mosaic GPU kernels shipped in the jax wheel: what a JAX user has without us. Their
# tuning configs are picked from the sweeps in each file's main() (each needs N to be a
# multiple of grid_block_n * block_n); they need a GPU (no interpreter run here).
JAX_RAGGED_DOT_CONFIGS = [
    dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1),
    dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=8),
    dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=5, grid_block_n=4),
    dict(block_m=192, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=8),
]
JAX_TRANSPOSED_RAGGED_DOT_CONFIGS = [
    dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1),
    dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=8),
]


def jax_mgpu_peer_available(bench: Bench, shape: str, op: str) -> bool:
    if INTERPRET or jax.default_backend() != "gpu":
        bench.record(
            shape=shape,
            op=op,
            impl="jax.experimental Mosaic GPU kernels",
            status="skipped (needs a GPU)",
        )
        return False
    return True


def jax_ragged_dot_peers(bench: Bench, shape: str, op: str, flops, arg_sets, ref):
    """`ragged_dot_mgpu.ragged_dot` (one warpgroup per CTA, persistent) on lhs (M, K) and
    rhs (G, N, K) (`transpose_rhs=True`: our layout); bf16 out."""
    if not jax_mgpu_peer_available(bench, shape, op):
        return
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    n = arg_sets[0][1].shape[1]
    for cfg in JAX_RAGGED_DOT_CONFIGS:
        if n % (cfg["grid_block_n"] * cfg["block_n"]):
            continue
        label = "x".join(str(cfg[f]) for f in ("block_m", "block_n", "block_k"))
        measure(
            bench,
            shape=shape,
            op=op,
            impl=f"jax ragged_dot_mgpu bf16 {label} s{cfg['max_concurrent_steps']} "
            f"g{cfg['grid_block_n']}",
            flops=flops,
            fn=lambda a, b, s, cfg=cfg: ragged_dot_mgpu.ragged_dot(
                a, b, group_sizes=s, transpose_rhs=True, **cfg
            ),
            arg_sets=arg_sets,
            ref=ref,
        )


def xla_dense_peers(bench: Bench, shape: str, m, k, n):
    flops = 2 * m * k * n
    keys = jax.random.split(jax.random.key(7), 4)
    bf = [
        (jax.random.normal(keys[i], (m, k), BF16), jax.random.normal(keys[i + 2], (k, n), BF16))
        for i in range(2)
    ]
    measure(
        bench,
        shape=shape,
        op="dense",
        impl="XLA dense bf16 (M,K)@(K,N)",
        flops=flops,
        fn=lambda a, b: a @ b,
        arg_sets=bf,
    )
    # Our own kernel as one group, and the dense Mosaic GPU kernel that ships with jax (two
    # consumer warpgroups, warp-specialized like ours): does the grouped kernel lose to its
    # own dense form, and does the dense form lose to jax's?
    bf_nk = [(a, b.T) for a, b in bf]
    measure(
        bench,
        shape=shape,
        op="dense",
        impl="pallas bf16 dense_matmul (default config)",
        flops=flops,
        fn=lambda a, b_nk: dense_matmul(a, b_nk, config=DENSE_BF16_CONFIG, interpret=INTERPRET),
        arg_sets=bf_nk,
    )
    del bf_nk
    if jax_mgpu_peer_available(bench, shape, "dense"):
        from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

        for wg_dim, minor in (
            (hm.MatmulDimension.N, hm.MatmulDimension.N),
            (hm.MatmulDimension.N, hm.MatmulDimension.M),
            (hm.MatmulDimension.M, hm.MatmulDimension.N),
        ):
            config = hm.TuningConfig(
                tile_m=128,
                tile_n=128,
                tile_k=64,
                max_concurrent_steps=4,
                epi_tile_n=64,
                epi_tile_m=64,
                grid_minor_dim=minor,
                grid_tile_width=8,
                wg_dimension=wg_dim,
            )
            measure(
                bench,
                shape=shape,
                op="dense",
                impl=f"jax hopper_matmul_mgpu bf16 wg={wg_dim.name} minor={minor.name} w8",
                flops=flops,
                fn=lambda a, b, config=config: hm.matmul(a, b, None, config),
                arg_sets=bf,
            )
    f8 = [(a.astype(E4M3), b.T.astype(E4M3)) for a, b in bf]

    def fp8_nt(a, b_nk):
        return lax.dot_general(a, b_nk, (((1,), (1,)), ((), ())), preferred_element_type=BF16)

    measure(
        bench,
        shape=shape,
        op="dense",
        impl="XLA dense fp8 e4m3 NT",
        flops=flops,
        fn=fp8_nt,
        arg_sets=f8,
    )


# ---------------------------------------------------------------------------- suites


def forward_suite(
    bench: Bench,
    shape: str,
    op: str,
    g,
    m,
    k,
    n,
    sizes,
    peers: bool,
    bf16_cfgs,
    fp8_cfgs,
    block_cfgs,
):
    """Forward (or dgrad: the caller swaps K and N) for bf16, fp8 rowwise and fp8 block."""
    if bench.over_budget():
        return
    flops = 2 * m * k * n
    sets = random_operands(jax.random.key(zlib.crc32(f"{shape}/{op}".encode())), g, m, k, n, sizes)
    s0 = sets[0]
    ref = ragged_ref(s0["lhs"].astype(jnp.float32), s0["rhs"].astype(jnp.float32), s0["sizes"])
    bf16_rows = []
    for cfg in bf16_cfgs:
        bf16_rows.append(
            measure(
                bench,
                shape=shape,
                op=op,
                impl=fwd_label("bf16", cfg),
                flops=flops,
                config=cfg,
                fn=lambda a, b, s, cfg=cfg: grouped_matmul(
                    a, b, s, config=cfg, interpret=INTERPRET
                ),
                arg_sets=[(x["lhs"], x["rhs"], x["sizes"]) for x in sets],
                ref=ref,
            )
        )
    rows_kn = [(x["lhs"], jnp.swapaxes(x["rhs"], 1, 2), x["sizes"]) for x in sets]
    if peers:
        measure(
            bench,
            shape=shape,
            op=op,
            impl="lax.ragged_dot bf16",
            flops=flops,
            fn=lambda a, b, s: lax.ragged_dot(a, b, s),
            arg_sets=rows_kn,
            ref=ref,
        )
        jax_ragged_dot_peers(
            bench, shape, op, flops, [(x["lhs"], x["rhs"], x["sizes"]) for x in sets], ref
        )
    best_bf16 = best(bf16_rows, 1e-2)
    if best_bf16 is not None and peers:
        cfg = config_of(best_bf16, GroupedMatmulConfig, None)
        measure(
            bench,
            shape=shape,
            op=op,
            impl="pallas bf16 rhs (G,K,N)",
            flops=flops,
            config=cfg,
            fn=lambda a, b, s: grouped_matmul(
                a, b, s, rhs_layout="kn", config=cfg, interpret=INTERPRET
            ),
            arg_sets=rows_kn,
            ref=ref,
        )
    del ref, rows_kn

    ref8 = ragged_ref(
        s0["lhs8"].astype(jnp.float32) * s0["lhs_row_scale"][:, None],
        s0["rhs8"].astype(jnp.float32) * s0["rhs_col_scale"][:, :, None],
        s0["sizes"],
    )
    for cfg in fp8_cfgs:
        measure(
            bench,
            shape=shape,
            op=op,
            impl=fwd_label("fp8 rowwise", cfg),
            flops=flops,
            config=cfg,
            fn=lambda a, b, s, sa, sb, cfg=cfg: grouped_matmul(
                a, b, s, lhs_scale=sa, rhs_scale=sb, config=cfg, interpret=INTERPRET
            ),
            arg_sets=[
                (x["lhs8"], x["rhs8"], x["sizes"], x["lhs_row_scale"], x["rhs_col_scale"])
                for x in sets
            ],
            ref=ref8,
        )
    del ref8

    if k % 128 == 0 and block_cfgs:
        block_sets = []
        for i, x in enumerate(sets):
            kb1, kb2 = jax.random.split(jax.random.key(100 + i))
            block_sets.append(
                (
                    x["lhs8"],
                    jax.random.uniform(kb1, (m, k // 128), jnp.float32, 0.5, 2.0),
                    x["rhs8"],
                    jax.random.uniform(kb2, (g, -(-n // 128), k // 128), jnp.float32, 0.5, 2.0),
                    x["sizes"],
                )
            )
        lq, ls, rq, rs, sz = block_sets[0]
        lhs_dq = lq.astype(jnp.float32) * jnp.repeat(ls, 128, axis=1)
        rhs_dq = (
            rq.astype(jnp.float32) * jnp.repeat(jnp.repeat(rs, 128, axis=1), 128, axis=2)[:, :n]
        )
        ref_block = ragged_ref(lhs_dq, rhs_dq, sz)
        del lhs_dq, rhs_dq
        for cfg in block_cfgs:
            measure(
                bench,
                shape=shape,
                op=op,
                impl=fwd_label("fp8 block", cfg),
                flops=flops,
                config=cfg,
                fn=lambda a, sa, b, sb, s, cfg=cfg: grouped_matmul_fp8_block(
                    a, sa, b, sb, s, config=cfg, interpret=INTERPRET
                ),
                arg_sets=block_sets,
                ref=ref_block,
            )
        del ref_block, block_sets
    return best_bf16


def quantized_operand_suite(bench: Bench, shape: str, g, m, k, n, sizes, backend: str):
    """MXFP8, NVFP4 and block-FP8 operands (already quantized: activations per group, each
    expert's weight per expert) through `jax_qtrain.grouped_matmul`. On the GPU it dequantizes
    the MX ones exactly to bf16 and runs the Pallas 16-bit kernel (issue 5's "≥ 0.95× XLA's
    dense bf16 GEMM": the "XLA dense bf16" row of the same run), the block-FP8 ones on their
    own kernel. Peer for the MX format: `jax.nn.scaled_matmul` (XLA's own block-scaled GEMM)
    on MXFP8 codes and scales of the dense (M, K)·(N, K)ᵀ."""
    if bench.over_budget():
        return
    import jax_qtrain as jq  # the library's public op; the suites above call the kernels directly
    from jax_qtrain.ops.grouped_quantize import token_alignment

    flops = 2 * m * k * n
    sets = random_operands(
        jax.random.key(zlib.crc32(f"{shape}/quantized".encode())), g, m, k, n, sizes
    )
    from jax_qtrain.ops import grouped_gemm

    # The stop-24 path of each: the kernel's output in the aligned layout, a gather after it.
    aligned_output = unittest.mock.patch.object(
        grouped_gemm, "_token_order_values_gemm", lambda *a: None
    )
    block_aligned_output = unittest.mock.patch.object(
        jq.kernels, "gemm_path_enabled", lambda path: False
    )
    xla_dequantize = unittest.mock.patch.object(jq.kernels, "dequantize_bf16", lambda *a: None)
    # (label, backend, patches) per recipe: the library's path first. MXFP8 / NVFP4: the
    # dequantize kernels, then the 16-bit kernel writing the tokens' order; the same with the
    # aligned output and a gather (before stop 25), and with XLA dequantizing (before stop 17).
    # Block FP8: its native kernel, writing the tokens' order or the aligned layout.
    suites = {
        "mxfp8": jq.MXFP8BlockScaling(),
        "nvfp4": jq.NVFP4BlockScaling(),
        "fp8_block": jq.Float8BlockScaling(),
    }
    for name, recipe in suites.items():
        if name == "fp8_block":
            variants = (
                ("block-FP8 kernel, token-order output", backend, ()),
                ("block-FP8 kernel, aligned output + gather", backend, (block_aligned_output,)),
            )
        else:
            variants = (
                ("dequantize kernels + pallas bf16, token-order output", backend, ()),
                (
                    "dequantize kernels + pallas bf16, aligned output + gather",
                    backend,
                    (aligned_output,),
                ),
                (
                    "XLA dequantize + pallas bf16, aligned output + gather",
                    backend,
                    (aligned_output, xla_dequantize),
                ),
            )

        @jax.jit
        def quantized_operands(lhs, rhs, sizes, recipe=recipe):
            layout = jq.group_layout(sizes, lhs.shape[0], token_alignment(recipe))
            qlhs = jq.grouped_quantize(lhs, recipe, "input", layout, rowwise=True)
            qrhs = jq.quantize_per_expert(rhs, recipe, rowwise=True, columnwise=False)
            return qlhs, qrhs

        arg_sets = [(*quantized_operands(x["lhs"], x["rhs"], x["sizes"]), x["sizes"]) for x in sets]
        ref = jax.jit(
            lambda a, b, s: jq.grouped_matmul(
                a, b, s, transpose_rhs=True, out_dtype=jnp.float32, backend="reference"
            )
        )(*arg_sets[0])
        for label, variant_backend, patches in variants:
            with contextlib.ExitStack() as patched:
                for patch in patches:
                    patched.enter_context(patch)
                measure(
                    bench,
                    shape=shape,
                    op="fwd",
                    impl=f"jax_qtrain {name} ({label})",
                    flops=flops,
                    fn=lambda a, b, s, be=variant_backend: jq.grouped_matmul(
                        a, b, s, transpose_rhs=True, out_dtype=jnp.float32, backend=be
                    ),
                    arg_sets=arg_sets,
                    ref=ref,
                )
        del arg_sets, ref
    # XLA's own MXFP8 GEMM (`jax.nn.scaled_matmul`, the block-scaled custom call) on the same
    # M×K×N as one dense GEMM: the tokens' E4M3 codes and one expert's, E8M0 scale bytes
    # 120..134 (1x32 blocks along K). (`jax.nn.scaled_dot_general` without `configs`, this
    # row's peer until stop 60, is a plain bf16 dot_general.)
    keys = jax.random.split(jax.random.key(zlib.crc32(f"{shape}/mx peer".encode())), 2)
    e8m0 = jnp.float8_e8m0fnu
    dense = [
        (
            x["lhs"][None].astype(E4M3),
            x["rhs"][:1].astype(E4M3),
            jax.lax.bitcast_convert_type(
                jax.random.randint(keys[0], (1, m, k // 32), 120, 135).astype(jnp.uint8), e8m0
            ),
            jax.lax.bitcast_convert_type(
                jax.random.randint(keys[1], (1, n, k // 32), 120, 135).astype(jnp.uint8), e8m0
            ),
        )
        for x in sets
    ]
    measure(
        bench,
        shape=shape,
        op="dense",
        impl="XLA scaled_matmul mxfp8 (block-scaled custom call)",
        flops=flops,
        fn=lambda a, b, sa, sb: jax.nn.scaled_matmul(a, b, sa, sb, preferred_element_type=BF16),
        arg_sets=dense,
    )


def wgrad_suite(bench: Bench, shape: str, g, m, k, n, sizes, peers: bool, bf16_cfgs, fp8_cfgs):
    if bench.over_budget():
        return
    flops = 2 * m * k * n
    sets = []
    for i in range(2):
        k1, k2, k3 = jax.random.split(jax.random.key(200 + i), 3)
        x_km = jax.random.normal(k1, (k, m), jnp.float32)
        dy_nm = jax.random.normal(k2, (n, m), jnp.float32)
        sets.append(
            dict(
                x=x_km.astype(BF16),
                dy=dy_nm.astype(BF16),
                x8=x_km.astype(E4M3),
                dy8=dy_nm.astype(E5M2),
                xs=jax.random.uniform(k3, (k,), jnp.float32, 0.5, 2.0),
                sizes=jnp.asarray(sizes, jnp.int32),
            )
        )
    s0 = sets[0]
    ref = wgrad_ref(s0["x"].astype(jnp.float32), s0["dy"].astype(jnp.float32), s0["sizes"])
    # x (M, K) and dy (M, N) as the forward pass stores them, built outside the timing: the
    # token-major kernel reads them as they are; "after XLA transposes" is the K-major kernel
    # behind the two transposes that ragged_tn ran before the token-major kernel existed.
    token_major = [(x["x"].T, x["dy"].T, x["sizes"]) for x in sets]
    k_major = [(x["x"], x["dy"], x["sizes"]) for x in sets]
    for is_token_major, arg_sets in ((False, k_major), (True, token_major)):
        layout = "token-major " if is_token_major else ""
        for cfg in bf16_cfgs:
            measure(
                bench,
                shape=shape,
                op="wgrad",
                impl=f"pallas bf16 {layout}{cfg.tile_m}x{2 * cfg.tile_n}",
                flops=flops,
                config=cfg,
                fn=lambda a, b, s, cfg=cfg, tm=is_token_major: grouped_matmul_wgrad(
                    a, b, s, token_major=tm, config=cfg, interpret=INTERPRET
                ),
                arg_sets=arg_sets,
                ref=ref,
            )
    del k_major
    measure(
        bench,
        shape=shape,
        op="wgrad",
        impl="pallas bf16 K-major after XLA transposes of (M,K),(M,N)",
        flops=flops,
        fn=lambda a, b, s: grouped_matmul_wgrad(a.T, b.T, s, interpret=INTERPRET),
        arg_sets=token_major,
        ref=ref,
    )
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    if peers:
        measure(
            bench,
            shape=shape,
            op="wgrad",
            impl="lax.ragged_dot_general bf16 (M,K),(M,N)",
            flops=flops,
            fn=lambda a, b, s: lax.ragged_dot_general(
                a, b, s, dims, preferred_element_type=jnp.float32
            ),
            arg_sets=token_major,
            ref=ref,
        )
        if jax_mgpu_peer_available(bench, shape, "wgrad"):
            from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as trd

            for cfg in JAX_TRANSPOSED_RAGGED_DOT_CONFIGS:
                measure(
                    bench,
                    shape=shape,
                    op="wgrad",
                    impl=f"jax transposed_ragged_dot_mgpu bf16 {cfg['block_m']}x"
                    f"{cfg['block_n']}x{cfg['block_k']} g{cfg['grid_block_n']}",
                    flops=flops,
                    fn=lambda a, b, s, cfg=cfg: trd.transposed_ragged_dot(
                        a, b, group_sizes=s, **cfg
                    ),
                    arg_sets=token_major,
                    ref=ref,
                )
    del ref, token_major
    ref8 = wgrad_ref(
        s0["x8"].astype(jnp.float32) * s0["xs"][:, None], s0["dy8"].astype(jnp.float32), s0["sizes"]
    )
    for cfg in fp8_cfgs:
        measure(
            bench,
            shape=shape,
            op="wgrad",
            impl=f"pallas fp8 e4m3xe5m2 {cfg.tile_m}x{2 * cfg.tile_n}",
            flops=flops,
            config=cfg,
            fn=lambda a, b, s, sa, cfg=cfg: grouped_matmul_wgrad(
                a, b, s, lhs_scale=sa, rhs_scale=jnp.float32(1.0), config=cfg, interpret=INTERPRET
            ),
            arg_sets=[(x["x8"], x["dy8"], x["sizes"], x["xs"]) for x in sets],
            ref=ref8,
        )


def dense_block_suite(bench: Bench, size: int, configs, peers: bool):
    if bench.over_budget():
        return
    shape = f"dense {size}^3"
    flops = 2 * size**3
    sets = []
    for i in range(2):
        k1, k2, k3, k4 = jax.random.split(jax.random.key(300 + i), 4)
        sets.append(
            (
                jax.random.normal(k1, (size, size), jnp.float32).astype(E4M3),
                jax.random.uniform(k2, (size, size // 128), jnp.float32, 0.5, 2.0),
                jax.random.normal(k3, (size, size), jnp.float32).astype(E4M3),
                jax.random.uniform(k4, (size // 128, size // 128), jnp.float32, 0.5, 2.0),
            )
        )
    a, sa, b, sb = sets[0]
    ref = (a.astype(jnp.float32) * jnp.repeat(sa, 128, axis=1)) @ (
        b.astype(jnp.float32) * jnp.repeat(jnp.repeat(sb, 128, axis=0), 128, axis=1)
    ).T
    for cfg in configs:
        measure(
            bench,
            shape=shape,
            op="dense",
            impl=fwd_label("fp8 block", cfg),
            flops=flops,
            config=cfg,
            fn=lambda a, sa, b, sb, cfg=cfg: dense_matmul_fp8_block(
                a, sa, b, sb, config=cfg, interpret=INTERPRET
            ),
            arg_sets=sets,
            ref=ref,
        )
    del ref
    if peers:
        xla_dense_peers(bench, shape, size, size, size)


# ------------------------------------------------------------------------------ main


def markdown(rows: list[dict]) -> str:
    lines = [
        "| shape | op | implementation | ms | TFLOP/s | rel. error | note |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        ms = f"{r['ms']:.3f}" if r.get("ms") else ""
        tf = f"{r['tflops']:.0f}" if r.get("tflops") else ""
        err = f"{r['rel_err']:.1e}" if r.get("rel_err") is not None else ""
        note = "" if r.get("status") == "ok" else r.get("status", "")[:120]
        lines.append(
            f"| {r.get('shape', '')} | {r.get('op', '')} | {r.get('impl', '')} | {ms} "
            f"| {tf} | {err} | {note} |"
        )
    return "\n".join(lines) + "\n"


def defaults_suite(bench: Bench, shapes: dict, dense_size: int, small: bool) -> None:
    """The 16-bit default (stream-K over the persistent pipeline since stop 45) and the
    whole-item config before it, FP8 rowwise's stream-K config (opt-in) and its default,
    forward on both G8 shapes with torch's grouped GEMMs, XLA's dense GEMMs of G8 balanced's
    flops, then the dense block-FP8 default (the lhs scales streamed since stop 45) and its
    predecessor."""
    from pallas_kernels import grouped_matmul_fwd as fwd

    pairs = [
        (fwd.STREAM_K_BF16_CONFIG, fwd.DEFAULT_BF16_CONFIG),
        (fwd.STREAM_K_FP8_CONFIG, fwd.DEFAULT_FP8_CONFIG),
    ]
    if small:  # the interpreter's tiles and SMs, the same options
        tiny = dict(tile_m=64, tile_n=64, num_sms=2, grid_tile_width=1)
        pairs = [tuple(dataclasses.replace(c, **tiny) for c in pair) for pair in pairs]
    (bf16_new, bf16_old), (fp8_new, fp8_old) = pairs
    # (The interpreter's smoke run: one shape and the new block default only.)
    for shape in ("G8 balanced",) if small else ("G8 balanced", "G8 skewed"):
        g, m, k, n, sizes = shapes[shape]
        forward_suite(
            bench,
            shape,
            "fwd",
            g,
            m,
            k,
            n,
            sizes,
            False,
            [bf16_new, bf16_old],
            [fp8_new, fp8_old],
            [],
        )
        if not small and not bench.over_budget():
            sets = random_operands(jax.random.key(1), g, m, k, n, sizes)
            torch_peers(bench, shape, sets, g, m, k, n, 2 * m * k * n)
            del sets
    if not small and not bench.over_budget():
        g, m, k, n, _ = shapes["G8 balanced"]
        xla_dense_peers(bench, "G8 balanced", m, k, n)
    block = [
        fwd.fp8_block_default_config(
            dense_size, jnp.bfloat16, persistent_pipeline=True, stream_lhs_scales=streamed
        )
        for streamed in (True, False)
    ]
    if small:
        block = [dataclasses.replace(block[0], num_sms=2, grid_tile_width=1)]
    dense_block_suite(bench, dense_size, block, not small)


SECTIONS = ("g8", "quantized", "wgrad", "g64", "dense_block", "skewed")
OPT_IN_SECTIONS = ("defaults",)


def main(
    out_dir: str | None = None,
    budget_s: float = 200.0,
    small: bool = False,
    sections: tuple[str, ...] = SECTIONS,
) -> str:
    """Runs the named sections (all by default) in SECTIONS order; "quantized" also times the
    best bf16 config and XLA's dense GEMMs as its peers when "g8" is not run."""
    known = SECTIONS + OPT_IN_SECTIONS
    unknown = sorted(set(sections) - set(known))
    if unknown or not sections:
        raise ValueError(f"sections must be a non-empty subset of {list(known)}, got {unknown}")
    global INTERPRET, DENSE_BF16_CONFIG
    # Leave GPU memory for torch's peers (read when the backend starts, below).
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
    out = Path(out_dir or "bench_out")
    out.mkdir(parents=True, exist_ok=True)
    bench = Bench(out, budget_s)
    device = jax.devices()[0]
    bench.record(
        shape="device", op="", impl=f"{device.device_kind} jax {jax.__version__}", status="ok"
    )
    shapes = dict(SHAPES)
    bf16_fwd, fp8_fwd, block, bf16_wgrad, fp8_wgrad = (
        BF16_FWD_CONFIGS,
        FP8_FWD_CONFIGS,
        BLOCK_CONFIGS,
        BF16_WGRAD_CONFIGS,
        FP8_WGRAD_CONFIGS,
    )
    narrow, narrow8 = NARROW_BF16_CONFIGS, NARROW_FP8_CONFIGS
    dense_size = 8192
    if small:
        INTERPRET = True
        shapes = {
            "G8 balanced": (2, 256, 256, 256, [100, 120]),
            "G8 skewed": (2, 256, 256, 256, [200, 40]),
            "G64 small experts": (3, 256, 256, 128, [64, 0, 150]),
        }
        tiny = GroupedMatmulConfig(
            tile_m=64,
            tile_n=64,
            tile_k=128,
            max_concurrent_steps=2,
            epi_tile_n=64,
            num_sms=2,
            grid_tile_width=1,
        )
        tiny_block = GroupedMatmulConfig(
            tile_m=64,
            tile_n=128,
            tile_k=128,
            max_concurrent_steps=2,
            epi_tile_n=64,
            num_sms=2,
            wgmma_in_flight=1,
        )
        tiny_wgrad = GroupedWgradConfig(
            tile_m=128, tile_n=64, tile_t=128, max_concurrent_steps=2, epi_tile_n=32, num_sms=2
        )
        bf16_fwd = fp8_fwd = narrow = narrow8 = [tiny]
        DENSE_BF16_CONFIG = tiny
        block = [tiny_block]
        bf16_wgrad = fp8_wgrad = [tiny_wgrad]
        dense_size = 256

    if "defaults" in sections:
        defaults_suite(bench, shapes, dense_size, small)

    # The targets' shape first: every config of the sweeps, with the peers.
    g, m, k, n, sizes = shapes["G8 balanced"]
    if "g8" in sections:
        forward_suite(
            bench, "G8 balanced", "fwd", g, m, k, n, sizes, True, bf16_fwd, fp8_fwd, block
        )
        if not bench.over_budget():
            sets = random_operands(jax.random.key(1), g, m, k, n, sizes)
            torch_peers(bench, "G8 balanced", sets, g, m, k, n, 2 * m * k * n)
            del sets
    if "quantized" in sections:
        if "g8" not in sections:  # the 16-bit kernel the quantized path runs, as its peer
            forward_suite(
                bench, "G8 balanced", "fwd", g, m, k, n, sizes, False, bf16_fwd[:1], [], []
            )
        quantized_operand_suite(
            bench, "G8 balanced", g, m, k, n, sizes, "reference" if small else "auto"
        )
    if {"g8", "quantized"} & set(sections) and not bench.over_budget():
        xla_dense_peers(bench, "G8 balanced", m, k, n)
    if "wgrad" in sections:
        wgrad_suite(bench, "G8 balanced", g, m, k, n, sizes, True, bf16_wgrad, fp8_wgrad)

    g, m, k, n, sizes = shapes["G64 small experts"]
    if "g64" in sections:
        forward_suite(
            bench, "G64 small experts", "fwd", g, m, k, n, sizes, True, narrow, narrow8, []
        )
        forward_suite(
            bench,
            "G64 small experts",
            "dgrad",
            g,
            m,
            n,
            k,
            sizes,
            True,
            bf16_fwd[:1],
            fp8_fwd[:1],
            [],
        )
        wgrad_suite(
            bench, "G64 small experts", g, m, k, n, sizes, True, bf16_wgrad[:1], fp8_wgrad[:1]
        )

    if "dense_block" in sections:
        dense_block_suite(bench, dense_size, block[:2], True)

    g, m, k, n, sizes = shapes["G8 skewed"]
    if "skewed" in sections:
        forward_suite(
            bench,
            "G8 skewed",
            "fwd",
            g,
            m,
            k,
            n,
            sizes,
            True,
            bf16_fwd[:1],
            fp8_fwd[:1],
            block[:1],
        )
        wgrad_suite(bench, "G8 skewed", g, m, k, n, sizes, True, bf16_wgrad[:1], fp8_wgrad[:1])

    text = markdown(bench.rows)
    (out / "bench_grouped_matmul.md").write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--small" and not a.startswith("--sections=")]
    chosen = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--sections=")]
    main(
        args[0] if args else None,
        float(args[1]) if len(args) > 1 else 200.0,
        small="--small" in sys.argv,
        sections=tuple(chosen[0].split(",")) if chosen else SECTIONS,
    )
