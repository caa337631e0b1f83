"""Bytes of one quantized weight per recipe (docs/quantized_weights.md quotes the table).

Exact counts from `QuantizedWeight.nbytes` and `jax_qtrain.saved_residuals` on abstract arrays
(`jax.eval_shape`: nothing is allocated, so this runs anywhere): a 4096×4096 bf16 kernel and
8192 bf16 tokens by default.

    python -m benchmarks.quantized_weight_bytes [--features 4096 --tokens 8192] [--out table.md]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jax_qtrain as jq
from jax_qtrain.ops import INPUT, KERNEL

RECIPES = {
    "FP8 current": jq.Float8CurrentScaling(),
    "FP8 block": jq.Float8BlockScaling(),
    "MXFP8": jq.MXFP8BlockScaling(),
    "NVFP4": jq.NVFP4BlockScaling(),
}


def _residual_bytes(fn, *args) -> dict[str, int]:
    by_name = {INPUT: 0, KERNEL: 0}
    for residual in jq.saved_residuals(fn, *args):
        by_name[residual.name] = by_name.get(residual.name, 0) + residual.nbytes
    return by_name


def weight_bytes(features: int, tokens: int) -> dict[str, dict[str, int]]:
    kernel = jax.ShapeDtypeStruct((features, features), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((tokens, features), jnp.bfloat16)
    table = {}
    for name, recipe in RECIPES.items():
        both = jax.eval_shape(lambda w, r=recipe: jq.quantize_weight(w, r), kernel)
        fprop_only = jax.eval_shape(
            lambda w, r=recipe: jq.quantize_weight(w, r, ("columnwise",)), kernel
        )
        trained = _residual_bytes(lambda x, w, r=recipe: jq.dense(x, w, recipe=r), x, kernel)
        frozen = _residual_bytes(
            lambda x, q, r=recipe: jq.dense(x, None, recipe=r, quantized_kernel=q), x, both
        )
        table[name] = {
            "both": both.nbytes,
            "fprop": fprop_only.nbytes,
            "kernel_residual": trained[KERNEL],
            "input_residual": trained[INPUT],
            "frozen_input_residual": frozen[INPUT],
        }
    return table


def markdown(features: int = 4096, tokens: int = 8192) -> str:
    mib = 2**20
    elements = features * features
    lines = [
        f"One {features}×{features} weight (fp32 master {4 * elements / mib:.2f} MiB, bf16 "
        f"{2 * elements / mib:.2f} MiB); residuals of one `dense` call on {tokens} bf16 tokens "
        "in the default mode. MiB = 2^20 bytes.",
        "",
        "| recipe | quantized, both copies (training) | fprop copy only (inference) | "
        "kernel residual per call | input residual, trained weight | input residual, "
        "frozen weight |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in weight_bytes(features, tokens).items():
        cells = (
            row["both"],
            row["fprop"],
            row["kernel_residual"],
            row["input_residual"],
            row["frozen_input_residual"],
        )
        lines.append(f"| {name} | " + " | ".join(f"{c / mib:.2f}" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--features", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    text = markdown(args.features, args.tokens)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
