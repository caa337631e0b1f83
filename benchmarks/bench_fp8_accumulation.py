"""The price of split accumulation: XLA's FP8 GEMM at `Precision.DEFAULT` vs `HIGHEST`.

`jax_qtrain.ops.gemm` runs every per-tensor FP8 GEMM at HIGHEST, which makes XLA turn off
cuBLASLt's FP8 fast accumulation (TransformerEngine's `use_split_accumulator=True`;
docs/design/gemm_accumulation.md says why). This times both modes on the NT layout the layers use
(E4M3 × E4M3, float32 out), with a bf16 GEMM of the same shape as the peer, and reports each
mode's error (relative Frobenius norm) against a bf16 × bf16 → float32 GEMM of the same values
(E4M3 values are exact in bf16). The reference takes bf16 arrays, not `astype` of the FP8 ones:
XLA rewrites `dot(convert(f8), convert(f8))` into the FP8 cuBLASLt GEMM itself (seen on the H200,
2026-11-29: a float32 reference built that way agreed with the HIGHEST GEMM bit for bit).

    python -m benchmarks.bench_fp8_accumulation [--small] [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks.timing import device_description, median_seconds

NT = (((1,), (1,)), ((), ()))  # both operands contiguous along the contraction
SHAPES = [(8192, 4096, 4096), (16384, 8192, 8192), (8192, 16384, 4096)]  # (M, K, N)
SMALL_SHAPES = [(256, 512, 256)]


def fp8_gemm(precision: lax.Precision):
    def gemm(a, b):
        return lax.dot_general(a, b, NT, precision=precision, preferred_element_type=jnp.float32)

    return jax.jit(gemm)


@jax.jit
def bf16_gemm(a, b):
    return lax.dot_general(a, b, NT, preferred_element_type=jnp.bfloat16)


@jax.jit
def float32_accumulated_reference(a_bf16, b_bf16):
    return lax.dot_general(
        a_bf16,
        b_bf16,
        NT,
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def relative_error(got: jax.Array, want: jax.Array) -> float:
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def main(out_dir: str | None = None, small: bool = False) -> str:
    rows = []
    for m, k, n in SMALL_SHAPES if small else SHAPES:
        keys = jax.random.split(jax.random.key(0), 6)
        fp8_sets = [
            (
                jax.random.normal(keys[2 * i], (m, k), jnp.float32).astype(jnp.float8_e4m3fn),
                jax.random.normal(keys[2 * i + 1], (n, k), jnp.float32).astype(jnp.float8_e4m3fn),
            )
            for i in range(3)
        ]
        bf16_sets = [(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)) for a, b in fp8_sets]
        flops = 2 * m * k * n
        want = float32_accumulated_reference(*bf16_sets[0])
        timings = {"bf16 peer": (median_seconds(bf16_gemm, bf16_sets), None)}
        for label, precision in (
            ("fp8 DEFAULT (fast accumulation)", lax.Precision.DEFAULT),
            ("fp8 HIGHEST (split accumulation)", lax.Precision.HIGHEST),
        ):
            gemm = fp8_gemm(precision)
            error = relative_error(gemm(*fp8_sets[0]), want)
            timings[label] = (median_seconds(gemm, fp8_sets), error)
        for label, (seconds, error) in timings.items():
            rows.append(
                f"| {m}×{k}×{n} | {label} | {seconds * 1e3:.3f} | {flops / seconds / 1e12:.0f} | "
                + ("—" if error is None else f"{error:.1e}")
                + " |"
            )
    text = (
        f"FP8 GEMM accumulation modes (NT, E4M3 × E4M3 → f32), {device_description()}\n\n"
        "| M×K×N | GEMM | ms | TFLOP/s | error vs bf16→f32 GEMM |\n|---|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n"
    )
    if out_dir:
        Path(out_dir, "bench_fp8_accumulation.md").write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    main(args.out, args.small)
