"""Does writing a dense GEMM's float32 accumulator to memory, then rounding it to bf16 in a second
pass, cost the layers their forward time? Timed in alternation on XLA's own GEMMs.

    PYTHONPATH=. python3 benchmarks/dense_output_ab.py OUT_DIR [--small]

`jax_qtrain.dense` without a recipe (and every quantized dense GEMM) asks XLA for a float32
result (`preferred_element_type=float32`) and rounds it afterwards, with the FP8 scales or the
bias applied in float32 first. On the H100 (2026-12-07, `bench_dense`) that layer's forward took
1.19x the time of a plain `x @ w` at 16384x8192x8192 and 1.33x at 16384x4096x14336, but only
1.04x at 8192x4096x4096: the float32 product (0.5-0.9 GB at the larger shapes) written, read
back and rounded would explain the gap, unless XLA folds the rounding into the GEMM. The
candidates, each on the same operands:

- bf16: `x @ w` (bf16 out); `lax.dot_general(..., preferred_element_type=float32)` then
  `.astype(bf16)` (the library's plain path); `preferred_element_type=bf16` (one rounding of
  the float32 accumulator inside the GEMM: the same value up to accumulation order); and
  `jq.dense(x, w)` itself;
- per-tensor FP8, operands quantized beforehand by `jq.quantize` (x's rowwise copy (M, K) E4M3,
  the kernel's columnwise copy (N, K) E4M3, float32 scale_invs): the library's `matmul_nt` (an
  FP8 dot to float32, times both scale_invs, then bf16), and the form XLA's GEMM rewriter
  documents for scaled FP8 GEMMs (each operand converted to a wider type and multiplied by its
  scale_inv, a bf16-output dot), which it can hand to cuBLASLt as one FP8 GEMM applying the
  scales and rounding in its epilogue: with the operands widened to float32 (TE's float32
  scale_invs, exactly) and to bf16 (the scale_invs rounded to bf16).

Result (H100, 2026-12-07, docs/benchmarks.md "Stop 67"): bf16 from the GEMM was 1.13-1.18x
faster at the two larger shapes with the same bits, so the library's unquantized bf16 GEMMs now
take that form (the "jq.dense" row measures whichever form the library has); the FP8 forms ran
level (XLA already folds the scales and the rounding into the FP8 GEMM).

Each candidate's output is compared with its group's first (the library's form) as the largest
difference over the largest magnitude, to show the forms compute the same product (they differ
by accumulation order and by where the one rounding to bf16 happens). Writes
OUT_DIR/dense_output_ab.{json,md}. `--small`: tiny shapes (a smoke run anywhere; its times mean
nothing).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

import jax_qtrain as jq
from benchmarks.timing import (
    SMOKE_TIMING,
    device_description,
    interleaved_seconds,
    relative_difference,
    report,
)
from jax_qtrain.ops.gemm import matmul_nt

SHAPES = ((8192, 4096, 4096), (16384, 8192, 8192), (16384, 4096, 14336))  # M, K, N
SMALL_SHAPES = ((128, 256, 384),)
_NN = (((1,), (0,)), ((), ()))
_NT = (((1,), (1,)), ((), ()))
# Per-tensor current scaling, E4M3 for x and W (TE's HYBRID): scales 448 / amax, not powers of 2.
FP8 = jq.Float8CurrentScaling()


def bf16_candidates() -> dict[str, Callable]:
    """name -> jitted (x, w) -> bf16 (M, N); the library's plain form first."""
    return {
        "f32 out, then bf16 (the library's plain form)": jax.jit(
            lambda x, w: lax.dot_general(x, w, _NN, preferred_element_type=jnp.float32).astype(
                jnp.bfloat16
            )
        ),
        "bf16 out (preferred_element_type=bf16)": jax.jit(
            lambda x, w: lax.dot_general(x, w, _NN, preferred_element_type=jnp.bfloat16)
        ),
        "x @ w (XLA's default)": jax.jit(lambda x, w: x @ w),
        "jq.dense(x, w), no recipe": jax.jit(lambda x, w: jq.dense(x, w)),
    }


def fp8_candidates() -> dict[str, Callable]:
    """name -> jitted (qx, qw) -> bf16 (M, N), qx the input's rowwise FP8 copy (M, K) and qw the
    weight's columnwise one (N, K); the library's `matmul_nt` first."""

    def library(qx, qw):
        (rows, _), (_, cols) = qx.shape, qw.shape
        return matmul_nt(
            qx, "rowwise", qw, "columnwise", rows=rows, cols=cols, out_dtype=jnp.bfloat16
        )

    def scaled_pattern(dtype):
        def gemm(qx, qw):
            x = qx.rowwise_data.astype(dtype) * qx.rowwise_scale_inv.astype(dtype)
            w = qw.columnwise_data.astype(dtype) * qw.columnwise_scale_inv.astype(dtype)
            return lax.dot_general(
                x, w, _NT, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.bfloat16
            )

        return jax.jit(gemm)

    return {
        "FP8 dot to f32, x scales, then bf16 (the library's form)": jax.jit(library),
        # The scale_invs in float32, as TE applies them: only as fast if XLA still finds the
        # FP8 GEMM behind the float32 converts (otherwise this is a float32 GEMM).
        "XLA's scaled-FP8 pattern in f32, bf16 out": scaled_pattern(jnp.float32),
        # The scale_invs rounded to bf16 (TE's are float32: a different product unless the
        # scales are powers of 2).
        "XLA's scaled-FP8 pattern in bf16, bf16 out": scaled_pattern(jnp.bfloat16),
    }


def run_group(group: str, shape, candidates, argument_sets, timing) -> list[dict]:
    rows_, depth, cols = shape
    names = list(candidates)
    outputs = {name: candidates[name](*argument_sets[0]) for name in names}
    seconds = interleaved_seconds(
        {name: (candidates[name], argument_sets) for name in names}, **timing
    )
    flops = 2 * rows_ * depth * cols
    first = names[0]
    return [
        {
            "shape": f"{rows_}x{depth}x{cols}",
            "group": group,
            "candidate": name,
            "ms": seconds[name] * 1e3,
            "tflops": flops / seconds[name] / 1e12,
            "x first": seconds[first] / seconds[name],
            "max diff / max abs(first)": relative_difference(outputs[name], outputs[first]),
        }
        for name in names
    ]


def run(shapes, timing) -> list[dict]:
    rows = []
    for shape in shapes:
        m, k, n = shape
        sets = []
        for seed in range(2):  # two operand sets, alternated, so no call finds its inputs in L2
            kx, kw = jax.random.split(jax.random.key(seed))
            x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
            w = (jax.random.normal(kw, (k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
            sets.append((x, w))
        rows += run_group("bf16", shape, bf16_candidates(), sets, timing)
        fp8_sets = [
            (
                jq.quantize(x, FP8, "input", columnwise=False),
                jq.quantize(w, FP8, "weight", rowwise=False, columnwise=True),
            )
            for x, w in sets
        ]
        rows += run_group("fp8", shape, fp8_candidates(), fp8_sets, timing)
        for row in rows[-7:]:
            print(row, flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        f"Dense GEMM output: float32 then bf16 vs bf16 from the GEMM, {device_description()}",
        "",
        "| M×K×N | candidate | ms | TFLOP/s | × first | max diff / max abs(first) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['shape']} | {r['candidate']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
        f"{r['x first']:.2f} | {r['max diff / max abs(first)']:.1e} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def main(out_dir: str | None = None, small: bool = False) -> str:
    rows = run(SMALL_SHAPES if small else SHAPES, SMOKE_TIMING if small else {})
    return report(out_dir, "dense_output_ab", rows, markdown(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", nargs="?", default=None)
    parser.add_argument("--small", action="store_true", help="tiny shapes (smoke run)")
    args = parser.parse_args()
    main(args.out, args.small)
