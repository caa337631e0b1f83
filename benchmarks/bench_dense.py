"""`jax_qtrain.dense` forward and forward+backward per recipe, against a plain `x @ w` in bf16.

TFLOP/s counts 2·M·K·N per GEMM (1 forward, 3 forward+backward), including the quantization
work inside the op, so it is the layer's effective rate. Forward+backward is
`value_and_grad` of `sum(y · c)` with a random `c`: with a plain `sum(y)` (all-ones cotangent)
XLA turns the peer's two backward GEMMs into row sums and drops its forward, which made it look
faster than the GPU's peak (fixed 2026-11-29).

    python -m benchmarks.bench_dense [--small] [--out DIR]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jax_qtrain as jq
from benchmarks.timing import device_description, median_seconds, report


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


def run(tokens: int, features: int, iters: int) -> list[dict]:
    keys = jax.random.split(jax.random.key(0), 9)
    argument_sets = [
        (
            jax.random.normal(keys[3 * i], (tokens, features), jnp.bfloat16),
            (jax.random.normal(keys[3 * i + 1], (features, features), jnp.float32) * 0.02).astype(
                jnp.bfloat16
            ),
            jax.random.normal(keys[3 * i + 2], (tokens, features), jnp.float32),
        )
        for i in range(3)
    ]
    flops = 2 * tokens * features * features
    rows = []
    layers = {"bf16 peer (x @ w)": plain_matmul}
    for name, recipe in RECIPES.items():
        layers[name] = lambda x, w, r=recipe: jq.dense(x, w, recipe=r)
    for name, layer in layers.items():
        forward = jax.jit(lambda x, w, c, f=layer: f(x, w))
        train = jax.jit(
            jax.value_and_grad(
                lambda x, w, c, f=layer: (f(x, w).astype(jnp.float32) * c).sum(), argnums=(0, 1)
            )
        )
        fwd_s = median_seconds(forward, argument_sets, iters=iters)
        train_s = median_seconds(train, argument_sets, iters=iters)
        rows.append(
            {
                "recipe": name,
                "forward_ms": fwd_s * 1e3,
                "forward_tflops": flops / fwd_s / 1e12,
                "fwd_bwd_ms": train_s * 1e3,
                "fwd_bwd_tflops": 3 * flops / train_s / 1e12,
            }
        )
    return rows


def markdown(rows: list[dict], tokens: int, features: int) -> str:
    lines = [
        f"`dense`, x {tokens}×{features} bf16, kernel {features}×{features} bf16, "
        f"{device_description()}",
        "",
        "| recipe | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['recipe']} | {r['forward_ms']:.3f} | {r['forward_tflops']:.0f} | "
        f"{r['fwd_bwd_ms']:.3f} | {r['fwd_bwd_tflops']:.0f} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def main(out_dir: str | None = None, small: bool = False) -> str:
    tokens, features, iters = (256, 256, 3) if small else (8192, 4096, 20)
    rows = run(tokens, features, iters)
    text = markdown(rows, tokens, features)
    return report(out_dir, "bench_dense", rows, text)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    main(args.out, args.small)
