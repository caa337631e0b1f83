"""The grouped (per-expert) quantizer of MoE activations, against quantizing the same tensor whole.

`jax_qtrain.grouped_quantize` quantizes each expert's rows of x as a tensor of its own (one amax
per group for FP8 and NVFP4, blocks that never straddle two groups) in the aligned layout
(ops/grouped_quantize.py). An MoE backward runs it for x, the activation and both gradients, so
it decides how far the quantized blocks are from the bf16 one (docs/benchmarks.md, MoE). Peers in
the same run: `jax_qtrain.quantize` of the whole tensor (what a dense layer pays, the Pallas
kernels where they apply) and XLA's `x + 1` (one read and one write of x: the copy floor).
Effective TB/s = (bytes of x + bytes of every output) / time.

    python -m benchmarks.bench_grouped_quantize [--small] [--out DIR] [--recipes fp8 ...]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jax_qtrain as jq
from benchmarks.timing import device_description, median_seconds, report
from jax_qtrain.ops.grouped_quantize import token_alignment

RECIPES = {
    "fp8": jq.Float8CurrentScaling(),
    "fp8-block": jq.Float8BlockScaling(),
    "mxfp8": jq.MXFP8BlockScaling(),
    "nvfp4": jq.NVFP4BlockScaling(),
}
SHAPES = {"8 experts": (16384, 4096, 8), "64 experts": (32768, 2048, 64)}  # tokens, features, G
SMALL_SHAPES = {"4 experts": (256, 128, 4)}
COPIES = {"row": (True, False), "col": (False, True), "row+col": (True, True)}


def _nbytes(tree) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def grouped_quantizer(
    recipe, sizes, tokens: int, key, rowwise: bool, columnwise: bool, backend: str = "auto"
):
    """jit of `grouped_quantize` of a (tokens, ·) gradient in groups of `sizes` (the layout
    computed inside, as the ops do)."""

    def grouped(x):
        layout = jq.group_layout(sizes, tokens, token_alignment(recipe))
        return jq.grouped_quantize(
            x,
            recipe,
            "grad",
            layout,
            rowwise=rowwise,
            columnwise=columnwise,
            key=key,
            backend=backend,
        )

    return jax.jit(grouped)


def whole_quantizer(recipe, key, rowwise: bool, columnwise: bool, backend: str = "auto"):
    """jit of `quantize` of the whole gradient: the peer."""
    return jax.jit(
        lambda x: jq.quantize(
            x, recipe, "grad", rowwise=rowwise, columnwise=columnwise, key=key, backend=backend
        )
    )


def run_shape(
    label: str, tokens: int, features: int, groups: int, iters: int, recipes: dict = RECIPES
) -> list[dict]:
    keys = jax.random.split(jax.random.key(0), 3)
    argument_sets = [(jax.random.normal(k, (tokens, features), jnp.bfloat16),) for k in keys[:2]]
    sizes = jnp.full((groups,), tokens // groups, jnp.int32)
    rows = []

    def record(case: str, copies: str, fn) -> None:
        seconds = median_seconds(fn, argument_sets, iters=iters)
        moved = tokens * features * 2 + _nbytes(jax.eval_shape(fn, *argument_sets[0]))
        rows.append(
            {
                "shape": f"{label} ({tokens}×{features}, G={groups})",
                "case": case,
                "copies": copies,
                "us": seconds * 1e6,
                "tbps": moved / seconds / 1e12,
            }
        )
        print(rows[-1], flush=True)

    record("copy floor: XLA x + 1", "-", jax.jit(lambda x: x + 1))
    for name, recipe in recipes.items():
        key = keys[2] if recipe.spec("grad").stochastic_rounding else None
        for copies, (rowwise, columnwise) in COPIES.items():
            grouped = grouped_quantizer(recipe, sizes, tokens, key, rowwise, columnwise)
            record(f"{name} grouped", copies, grouped)
            record(
                f"{name} whole tensor", copies, whole_quantizer(recipe, key, rowwise, columnwise)
            )
    return rows


def run(shapes: dict, iters: int, recipes: dict = RECIPES) -> list[dict]:
    return [
        row for label, shape in shapes.items() for row in run_shape(label, *shape, iters, recipes)
    ]


def markdown(rows: list[dict]) -> str:
    lines = [
        f"Grouped quantization of a bf16 gradient (role 'grad'), {device_description()}",
        "",
        "| shape | case | copies | µs | effective TB/s |",
        "|---|---|---|---:|---:|",
    ]
    lines += [
        f"| {r['shape']} | {r['case']} | {r['copies']} | {r['us']:.1f} | {r['tbps']:.2f} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def main(out_dir: str | None = None, small: bool = False, recipe_names=tuple(RECIPES)) -> str:
    recipes = {name: RECIPES[name] for name in recipe_names}
    rows = run(SMALL_SHAPES if small else SHAPES, iters=2 if small else 20, recipes=recipes)
    text = markdown(rows)
    return report(out_dir, "bench_grouped_quantize", rows, text)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--small", action="store_true", help="tiny shapes (runs on the CPU)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--recipes", nargs="*", choices=list(RECIPES), default=list(RECIPES))
    args = parser.parse_args()
    main(args.out, args.small, args.recipes)
