"""Residual bytes of `jax_qtrain.dense` per recipe and backward_override mode.

Exact byte counts from `jax_qtrain.saved_residuals` on abstract inputs (no memory is allocated,
so this runs anywhere): a 4096×4096 layer on 8192 bf16 tokens by default. Writes a markdown table
(docs/overrides.md quotes it).

    python -m benchmarks.residual_bytes [--tokens 8192 --features 4096] [--out table.md]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import jax
import jax.numpy as jnp

import jax_qtrain as jq

RECIPES = {
    "FP8 current": jq.Float8CurrentScaling(),
    "FP8 block": jq.Float8BlockScaling(),
    "MXFP8": jq.MXFP8BlockScaling(),
    "NVFP4": jq.NVFP4BlockScaling(),
}
MODES = (
    ("None", None, False),
    ("None + save_original_input", None, True),
    ("high_precision", "high_precision", False),
    ("dequantized", "dequantized", False),
)


def residual_bytes(tokens: int, features: int) -> dict[tuple[str, str], dict[str, int]]:
    x = jax.ShapeDtypeStruct((tokens, features), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((features, features), jnp.bfloat16)
    table = {}
    for recipe_name, recipe in RECIPES.items():
        for mode_name, mode, save_original in MODES:
            r = recipe.replace(backward_override=mode)
            saved = jq.saved_residuals(
                lambda x, w, r=r, s=save_original: jq.dense(x, w, recipe=r, save_original_input=s),
                x,
                w,
            )
            by_name: dict[str, int] = defaultdict(int)
            for residual in saved:
                by_name[residual.name] += residual.nbytes
            table[(recipe_name, mode_name)] = dict(by_name)
    return table


def markdown(tokens: int, features: int) -> str:
    table = residual_bytes(tokens, features)
    mib = 2**20
    bf16_input = tokens * features * 2 / mib
    lines = [
        f"Residual bytes of one `dense` call, x: {tokens}×{features} bf16, kernel: "
        f"{features}×{features} bf16 (raw input = {bf16_input:.1f} MiB). MiB = 2^20 bytes.",
        "",
        "| recipe | mode | input | kernel | total |",
        "|---|---|---:|---:|---:|",
    ]
    for (recipe_name, mode_name), by_name in table.items():
        input_bytes = by_name.get(jq.ops.INPUT, 0)
        kernel_bytes = by_name.get(jq.ops.KERNEL, 0)
        total = sum(by_name.values())
        lines.append(
            f"| {recipe_name} | {mode_name} | {input_bytes / mib:.2f} | "
            f"{kernel_bytes / mib:.2f} | {total / mib:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--features", type=int, default=4096)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    text = markdown(args.tokens, args.features)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
