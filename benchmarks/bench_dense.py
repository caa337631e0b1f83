"""`jax_qtrain.dense` forward and forward+backward per recipe, against a plain `x @ w` in bf16.

TFLOP/s counts 2·M·K·N per GEMM (1 forward, 3 forward+backward), including the quantization
work inside the op, so it is the layer's effective rate. Forward+backward is
`value_and_grad` of `sum(y · c)` with a random `c`: with a plain `sum(y)` (all-ones cotangent)
XLA turns the peer's two backward GEMMs into row sums and drops its forward, which made it look
faster than the GPU's peak (fixed 2026-11-29).

Every layer of one shape is timed in alternation (`timing.interleaved_seconds`: rounds of
back-to-back calls, each round starting with another layer), so the GPU's clock and power
drift during the run falls on all of them alike; the peer is in the same alternation.

    python -m benchmarks.bench_dense [--small] [--out DIR] [--shapes 8192x4096x4096 ...]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jax_qtrain as jq
from benchmarks.timing import (
    SMOKE_TIMING,
    device_description,
    interleaved_seconds,
    named_subset,
    report,
)


def plain_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """The peer: what a JAX user writes without jax_qtrain (bf16 in, bf16 out)."""
    return x @ w


RECIPES = {
    "bf16 (jax_qtrain, no recipe)": None,
    "fp8": jq.Float8CurrentScaling(),
    "fp8-block": jq.Float8BlockScaling(),
    "mxfp8": jq.MXFP8BlockScaling(),
    "nvfp4": jq.NVFP4BlockScaling(),
}
PEER = "bf16 peer (x @ w)"
# (tokens M, in_features K, out_features N): the square layer of every earlier run, a wider one
# where the GEMMs dominate the quantization passes, and an MLP up-projection's aspect.
SHAPES = {
    "8192x4096x4096": (8192, 4096, 4096),
    "16384x8192x8192": (16384, 8192, 8192),
    "16384x4096x14336": (16384, 4096, 14336),
}
SMALL_SHAPES = {"256x256x256": (256, 256, 256), "128x256x512": (128, 256, 512)}


def argument_sets(tokens: int, in_features: int, out_features: int, sets: int = 3):
    """`sets` triples (x, w, c) in rotation, so repeated calls don't just time the L2 cache."""
    keys = jax.random.split(jax.random.key(0), 3 * sets)
    return [
        (
            jax.random.normal(keys[3 * i], (tokens, in_features), jnp.bfloat16),
            (jax.random.normal(keys[3 * i + 1], (in_features, out_features)) * 0.02).astype(
                jnp.bfloat16
            ),
            jax.random.normal(keys[3 * i + 2], (tokens, out_features), jnp.float32),
        )
        for i in range(sets)
    ]


def run(shapes: dict, timing: dict) -> list[dict]:
    """One row per (shape, layer), the layers of each shape timed in alternation."""
    layers = {PEER: plain_matmul}
    for name, recipe in RECIPES.items():
        layers[name] = lambda x, w, r=recipe: jq.dense(x, w, recipe=r)
    rows = []
    for shape, (tokens, in_features, out_features) in shapes.items():
        arguments = argument_sets(tokens, in_features, out_features)
        forward = {
            name: (jax.jit(lambda x, w, c, f=layer: f(x, w)), arguments)
            for name, layer in layers.items()
        }
        train = {
            name: (
                jax.jit(
                    jax.value_and_grad(
                        lambda x, w, c, f=layer: (f(x, w).astype(jnp.float32) * c).sum(),
                        argnums=(0, 1),
                    )
                ),
                arguments,
            )
            for name, layer in layers.items()
        }
        forward_s = interleaved_seconds(forward, **timing)
        train_s = interleaved_seconds(train, **timing)
        flops = 2 * tokens * in_features * out_features
        for name in layers:
            rows.append(
                {
                    "shape": shape,
                    "recipe": name,
                    "forward_ms": forward_s[name] * 1e3,
                    "forward_tflops": flops / forward_s[name] / 1e12,
                    "fwd_bwd_ms": train_s[name] * 1e3,
                    "fwd_bwd_tflops": 3 * flops / train_s[name] / 1e12,
                    "fwd_bwd_speedup_vs_peer": train_s[PEER] / train_s[name],
                }
            )
            print(rows[-1], flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        f"`dense` (x M×K bf16, kernel K×N bf16), every layer of a shape in alternation, "
        f"{device_description()}",
        "",
        "| M×K×N | recipe | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | fwd+bwd × peer |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['shape']} | {r['recipe']} | {r['forward_ms']:.3f} | {r['forward_tflops']:.0f} | "
        f"{r['fwd_bwd_ms']:.3f} | {r['fwd_bwd_tflops']:.0f} | {r['fwd_bwd_speedup_vs_peer']:.2f} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def main(out_dir: str | None = None, small: bool = False, shape_names=None) -> str:
    shapes = named_subset(SMALL_SHAPES if small else SHAPES, shape_names, "shapes")
    rows = run(shapes, SMOKE_TIMING if small else {})
    return report(out_dir, "bench_dense", rows, markdown(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--small", action="store_true", help="tiny shapes (runs on the CPU)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--shapes", nargs="*", help=f"some of {list(SHAPES)} (default: all)")
    args = parser.parse_args()
    main(args.out, args.small, args.shapes)
