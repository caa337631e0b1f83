"""Do the grouped layers' GEMM kernels writing float32, rounded to bf16 in a second pass, cost
the MoE layers time? The library's own grouped layer in both forms, timed in alternation.

    PYTHONPATH=. python3 benchmarks/grouped_output_ab.py OUT_DIR [--small] [--recipes bf16 ...]

Until 2026-12-07 every Pallas grouped GEMM kernel the grouped layers ran wrote a float32 result,
which XLA read back and rounded to bf16 (per-group factors or a bias applied in float32 first,
where there are any); the kernels can round in their epilogue instead (their `out_dtype`), and
the layers now ask them to wherever nothing follows the kernel (ops/gemm.py
`kernel_out_dtype`, read by ops/grouped_gemm.py). Per-tensor FP8's and NVFP4's wgrad still
write float32 under "auto": their per-group factors follow the kernel, unless the opt-in path
"wgrad_group_scale" (stop 69, awaiting its gpu tests) has the kernel apply them (its
`group_scale`) and round. This times `jq.grouped_dense`
forward+backward on an FC1-shaped MoE layer (bench_moe's "8 experts": 16384 tokens,
4096 → 3584, 8 balanced experts, bf16 x, kernels and dy), per recipe in both forms: "float32
from the kernels" (the old form: grouped_gemm's `kernel_out_dtype` patched to float32 while
tracing), "as the layer asks" (the library's form) and, for those two recipes, "with the
wgrad group_scale" (the opt-in path taken). Each candidate is compiled under its form before
timing (the choice is made at trace time).

The second form's outputs are compared with the first's as the largest difference over the
largest magnitude (the kernels' tiling may depend on the output dtype, which may change the
order of float32 sums). Writes OUT_DIR/grouped_output_ab.{json,md}. `--small`: tiny shapes
on the Pallas interpreter (a smoke run anywhere; its times mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import time
import unittest.mock

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

import jax_qtrain as jq
from benchmarks.timing import (
    SMOKE_TIMING,
    device_description,
    interleaved_seconds,
    named_subset,
    relative_difference,
    report,
)
from jax_qtrain import kernels
from jax_qtrain.ops import grouped_gemm

SHAPE = (16384, 4096, 3584, 8)  # tokens, in_features, out_features, experts
SMALL_SHAPE = (256, 128, 128, 2)
RECIPES = {
    "bf16": None,
    "fp8": jq.Float8CurrentScaling(),
    "fp8_block": jq.Float8BlockScaling(),
    "mxfp8": jq.MXFP8BlockScaling(),
    "nvfp4": jq.NVFP4BlockScaling(),
}
FORMS = ("float32 from the kernels", "as the layer asks", "with the wgrad group_scale")
# The recipes whose wgrad has per-group factors: the third form differs for them only.
GROUP_FACTOR_RECIPES = ("fp8", "nvfp4")


def operand_sets(tokens, features, out_features, experts, sets=2):
    """Two operand sets (x, kernels, dy, group_sizes), alternated so no call finds its inputs
    in L2; balanced groups."""
    sizes = jnp.full((experts,), tokens // experts, jnp.int32)
    out = []
    for seed in range(sets):
        kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
        x = jax.random.normal(kx, (tokens, features), jnp.bfloat16)
        w = jax.random.normal(kw, (experts, features, out_features), jnp.float32)
        w = (w * features**-0.5).astype(jnp.bfloat16)
        dy = jax.random.normal(kg, (tokens, out_features), jnp.bfloat16)
        out.append((x, w, dy, sizes))
    return out


def fwd_bwd(recipe):
    def run(x, w, dy, sizes):
        y, vjp = jax.vjp(lambda x, w: jq.grouped_dense(x, w, sizes, recipe=recipe), x, w)
        return (y, *vjp(dy))

    return run


def compiled(recipe, form: str, args):
    """`fwd_bwd(recipe)` compiled in `form` (the choice is read while tracing)."""
    patch = contextlib.nullcontext()
    if form == FORMS[0]:
        float32 = lambda dtype: jnp.dtype(jnp.float32)
        patch = unittest.mock.patch.object(grouped_gemm, "kernel_out_dtype", float32)
    elif form == FORMS[2]:
        opt_in = kernels._OPT_IN_GEMM_PATHS - {"wgrad_group_scale"}
        patch = unittest.mock.patch.object(kernels, "_OPT_IN_GEMM_PATHS", opt_in)
    with patch:
        return jax.jit(fwd_bwd(recipe)).lower(*args).compile()


def run(shape, recipe_names, timing) -> list[dict]:
    tokens, features, out_features, experts = shape
    sets = operand_sets(tokens, features, out_features, experts)
    flops = 3 * 2 * tokens * features * out_features  # fprop, dgrad, wgrad
    rows = []
    for name, recipe in named_subset(RECIPES, recipe_names, "recipes").items():
        candidates, outputs = {}, {}
        forms = FORMS if name in GROUP_FACTOR_RECIPES else FORMS[:2]
        for form in forms:
            start = time.perf_counter()
            candidates[form] = compiled(recipe, form, sets[0])
            outputs[form] = jax.block_until_ready(candidates[form](*sets[0]))
            print(
                f"{name} / {form}: compiled and ran in {time.perf_counter() - start:.1f} s",
                flush=True,
            )
        seconds = interleaved_seconds({form: (candidates[form], sets) for form in forms}, **timing)
        for form in forms:
            rows.append(
                {
                    "shape": f"T={tokens} {features}->{out_features} E={experts}",
                    "recipe": name,
                    "form": form,
                    "ms": seconds[form] * 1e3,
                    "tflops": flops / seconds[form] / 1e12,
                    "x first": seconds[FORMS[0]] / seconds[form],
                    "max diff / max abs(first)": max(  # over y, dx and dW
                        relative_difference(got, want)
                        for got, want in zip(outputs[form], outputs[FORMS[0]], strict=True)
                    ),
                }
            )
            print(rows[-1], flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "Grouped layer (forward+backward): float32 from the GEMM kernels vs bf16 from their "
        f"epilogue, {device_description()}",
        "",
        "| shape | recipe | form | ms | TFLOP/s | × first | max diff / max abs(first) |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['shape']} | {r['recipe']} | {r['form']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
        f"{r['x first']:.2f} | {r['max diff / max abs(first)']:.1e} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def main(out_dir: str | None = None, small: bool = False, recipe_names=None) -> str:
    if small and not kernels.on_gpu():  # the kernels in the interpreter
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
            with kernels.gemm_backend("pallas"):
                rows = run(SMALL_SHAPE, recipe_names, SMOKE_TIMING)
    else:
        rows = run(SMALL_SHAPE if small else SHAPE, recipe_names, SMOKE_TIMING if small else {})
    return report(out_dir, "grouped_output_ab", rows, markdown(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", nargs="?", default=None)
    parser.add_argument("--small", action="store_true", help="tiny shapes (smoke run)")
    parser.add_argument("--recipes", nargs="*", help=f"some of {list(RECIPES)} (default: all)")
    args = parser.parse_args()
    main(args.out, args.small, args.recipes)
