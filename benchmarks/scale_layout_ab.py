"""GEMM-ready ("tiles") block scales against the (lines, blocks) layout, timed in alternation.

    PYTHONPATH=. python3 benchmarks/scale_layout_ab.py OUT_DIR [--small]

Two comparisons, each candidate pair checked bit for bit on the device before timing:
  * `jax_qtrain.quantize` of a bf16 x, row+col, on the kernels (backend="pallas"): MXFP8 and
    FP8 block 1×128 with `scale_layout="lines"` (the kernel's tile-major scales rearranged by
    the untile kernel) and `"tiles"` (kept as written). CUPTI device time per call, the kernels
    of one call summed (`timing.cupti_interleaved_seconds`). Effective TB/s as
    bench_quantize.py counts it (x read once, codes and scales written once).
  * A dense layer's forward + backward (`jax_qtrain.dense`, jit of the value and both
    gradients), its GEMMs on the kernels where they exist (`gemm_backend("pallas")`), with the
    GEMMs' lhs (x for fprop, dy for dgrad) quantized in each layout: Float8BlockScaling (the
    block-FP8 GEMM kernel reads tiles directly; the layer's default,
    ops/gemm.py::lhs_scale_layout) and MXFP8BlockScaling (dequantized by XLA, which reads
    tiles through a transposed index: does it cost more than the untile kernel saves?); wall
    clock of back-to-back calls in alternation (`timing.interleaved_seconds`).

Writes OUT_DIR/scale_layout_ab.{json,md}. `--small`: small shapes (on the GPU; without one, tiny
shapes in Mosaic GPU's interpreter, a smoke test whose times mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib

import jax
import jax.numpy as jnp
import numpy as np

import jax_qtrain as jq
from benchmarks.timing import (
    cupti_interleaved_seconds,
    device_description,
    interleaved_seconds,
    kernel_timing_setup,
    report,
)
from jax_qtrain import kernels

QUANTIZE_SHAPES = ((8192, 8192), (16384, 4096))
DENSE_SHAPES = ((8192, 4096, 4096),)  # tokens, in_features, out_features
SMALL = {"quantize": ((2048, 2048),), "dense": ((2048, 1024, 1024),)}
INTERPRETED = {"quantize": ((256, 256),), "dense": ((128, 128, 128),)}
FORMATS = {
    "mxfp8": (jq.MXFP8BlockScaling(), 32, 1),  # recipe, block, scale bytes
    "fp8 block 1x128": (jq.Float8BlockScaling(), 128, 4),
}
dense_ops = importlib.import_module("jax_qtrain.ops.dense")


def _bits(tree) -> list[np.ndarray]:
    return [np.asarray(leaf).view(np.uint8) for leaf in jax.tree.leaves(tree)]


def _same_bits(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(_bits(a), _bits(b), strict=True))


def quantize_rows(shape, rounds: int) -> list[dict]:
    rows, cols = shape
    x = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
    out = []
    for name, (recipe, block, scale_bytes) in FORMATS.items():
        fns = {
            layout: jax.jit(
                lambda v, r=recipe, s=layout: jq.quantize(
                    v, r, columnwise=True, backend="pallas", scale_layout=s
                )
            )
            for layout in ("lines", "tiles")
        }
        same = _same_bits(fns["tiles"](x).with_scale_layout("lines"), fns["lines"](x))
        seconds = cupti_interleaved_seconds(
            {layout: (fn, [(x,)]) for layout, fn in fns.items()}, rounds=rounds
        )
        n = rows * cols
        nbytes = 2 * n + 2 * (n + n // block * scale_bytes)
        for layout, s in seconds.items():
            out.append(
                dict(
                    case=f"quantize {name} row+col",
                    shape=f"{rows}x{cols}",
                    layout=layout,
                    us=s * 1e6,
                    tb_s=nbytes / s / 1e12,
                    bits="identical" if same else "DIFFER",
                )
            )
    return out


@contextlib.contextmanager
def _forced_layout(layout: str):
    """The dense layer's GEMM lhs quantized in `layout` whatever `lhs_scale_layout` picks."""
    original = dense_ops.lhs_scale_layout
    dense_ops.lhs_scale_layout = lambda *args: layout
    try:
        yield
    finally:
        dense_ops.lhs_scale_layout = original


def dense_rows(shape, name: str, timing: dict) -> list[dict]:
    tokens, k, n = shape
    kx, kw, kg = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (tokens, k), jnp.bfloat16)
    w = jax.random.normal(kw, (k, n), jnp.float32) * 0.02
    dy = jax.random.normal(kg, (tokens, n), jnp.float32)
    recipe = FORMATS[name][0]

    def step(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: jq.dense(x, w, recipe=recipe), x, w)
        return (y, *vjp(dy))

    fns = {}
    with kernels.gemm_backend("pallas"):
        for layout in ("tiles", "lines"):
            # Traced (and compiled) here, each under its own layout.
            with _forced_layout(layout):
                fns[layout] = jax.jit(step).lower(x, w, dy).compile()
    same = _same_bits(fns["tiles"](x, w, dy), fns["lines"](x, w, dy))
    seconds = interleaved_seconds({k_: (f, [(x, w, dy)]) for k_, f in fns.items()}, **timing)
    return [
        dict(
            case=f"dense {name} fwd+bwd",
            shape=f"{tokens}x{k}x{n}",
            layout=layout,
            us=s * 1e6,
            tb_s=None,
            bits="identical" if same else "DIFFER",
        )
        for layout, s in seconds.items()
    ]


def format_table(rows: list[dict], device: str) -> str:
    lines = [
        f"GEMM-ready (tiles) vs (lines, blocks) scales, timed in alternation on {device}.",
        "Quantize: CUPTI device time per call (kernels summed); dense: wall clock per step.",
        "",
        "| case | shape | scale_layout | time (µs) | effective TB/s | bits |",
        "|---|---|---|---:|---:|---|",
    ]
    for r in rows:
        tb = "—" if r["tb_s"] is None else f"{r['tb_s']:.2f}"
        lines.append(
            f"| {r['case']} | {r['shape']} | {r['layout']} | {r['us']:.1f} | {tb} | {r['bits']} |"
        )
    return "\n".join(lines) + "\n"


def main(out_dir: str | None = None, *, small: bool = False) -> str:
    quantize_shapes, timing, interpret = kernel_timing_setup(
        "scale_layout_ab", small, QUANTIZE_SHAPES, SMALL["quantize"], INTERPRETED["quantize"]
    )
    on_gpu = jax.devices()[0].platform == "gpu"
    dense_shapes = DENSE_SHAPES if not small else SMALL["dense"] if on_gpu else INTERPRETED["dense"]
    device = device_description()
    print(f"device: {device}", flush=True)
    rows = []
    with interpret:
        for shape in quantize_shapes:
            rows += quantize_rows(shape, rounds=timing.get("rounds", 10))
        for shape in dense_shapes:
            for name in FORMATS:
                rows += dense_rows(shape, name, timing)
    return report(out_dir, "scale_layout_ab", rows, format_table(rows, device))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", default=None)
    parser.add_argument("--small", action="store_true", help="small shapes (smoke test)")
    args = parser.parse_args()
    main(args.out_dir, small=args.small)
