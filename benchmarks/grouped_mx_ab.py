"""MXFP8 grouped GEMM: in-kernel dequantization against dequantize-then-GEMM, in alternation.

Issue 5 asks for MXFP8 operands dequantized tile by tile inside the GEMM and for ≥ 0.95× XLA's
dense bf16 GEMM of the same size. Candidates, per shape, timed batch by batch in alternation
(`benchmarks.timing.interleaved_seconds`):

* ``in-kernel dequant`` (`pallas_kernels.grouped_matmul_mx`, its default config),
  ``wgmma in flight`` (double-buffered bf16 tiles, the wgmma of one step running while the next
  step is converted), the bf16-arithmetic and 8-bit-layout conversions, and ``lhs in registers``
  (the lhs converted straight into the wgmma's register operand; hardware only);
* ``dequantize kernels + bf16 GEMM``: the path jax_qtrain took before (Pallas dequantize
  kernels write bf16 copies of both operands, then the 16-bit grouped kernel);
* ``XLA dense bf16``: one (M, K) x (K, N) bf16 GEMM, the issue's yardstick.

All outputs are float32. Before timing, each Pallas candidate's output is compared with the
dequantize-then-GEMM one on the device (max |difference| / max |reference|, f32 summation
order only).

`--ablation` adds two deliberately wrong kernels that show where the in-kernel version spends
its time (their outputs are garbage, their "diff" column says so): the conversion replaced by
the row scales alone (no loads of the FP8 codes from shared memory), and by a constant (no
loads at all: what remains is writing the bf16 tiles, the fence and the wgmma of every step).

    python -m benchmarks.grouped_mx_ab [--out DIR] [--small] [--ablation]

writes DIR/grouped_mx_ab.json and .md. `--small` runs tiny shapes in the Pallas interpreter
(a smoke test; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import unittest.mock

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

import pallas_kernels.grouped_matmul_mx as mx_kernel
from benchmarks.timing import device_description, interleaved_seconds, report
from pallas_kernels.dequantize import dequantize_mxfp8
from pallas_kernels.grouped_matmul_fwd import GroupedMatmulConfig, grouped_matmul
from pallas_kernels.grouped_matmul_mx import DEFAULT_MXFP8_CONFIG, grouped_matmul_mxfp8

E4M3 = jnp.float8_e4m3fn
SHAPES = {
    "G8 balanced 16384x4096x4096": (8, 16384, 4096, 4096, [2048] * 8),
    "G64 small experts 32768x2048x1408": (64, 32768, 2048, 1408, [512] * 64),
}
SMALL_SHAPES = {"G2 tiny 128x128x128": (2, 128, 128, 128, [100, 28])}
IN_FLIGHT = dataclasses.replace(
    DEFAULT_MXFP8_CONFIG,
    wgmma_in_flight=1,
    max_concurrent_steps=2,
    epi_tile_n=32,
    epilogue_buffers=1,
)
TINY = dict(tile_m=64, tile_n=64, num_sms=2, grid_tile_width=1, epi_tile_n=32)


def operands(key, g, m, k, n):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    lhs = jax.random.normal(k1, (m, k), jnp.float32).astype(E4M3)
    rhs = jax.random.normal(k2, (g, n, k), jnp.float32).astype(E4M3)
    lhs_scale = jax.random.randint(k3, (m, k // 32), 120, 134, jnp.int32).astype(jnp.uint8)
    rhs_scale = jax.random.randint(k4, (g, n, k // 32), 120, 134, jnp.int32).astype(jnp.uint8)
    return lhs, lhs_scale, rhs, rhs_scale


def candidates(sizes, small: bool):
    interpret = small
    mx_default = dataclasses.replace(DEFAULT_MXFP8_CONFIG, **TINY) if small else None
    mx_in_flight = dataclasses.replace(IN_FLIGHT, **TINY) if small else IN_FLIGHT
    bf16_config = GroupedMatmulConfig(**TINY, tile_k=64, max_concurrent_steps=2) if small else None

    def in_kernel(config, arithmetic="float32", layout="wgmma", lhs_in_registers=False):
        return jax.jit(
            lambda a, sa, b, sb: grouped_matmul_mxfp8(
                a,
                sa,
                b,
                sb,
                sizes,
                out_dtype=jnp.float32,
                config=config,
                dequant_arithmetic=arithmetic,
                dequant_layout=layout,
                lhs_in_registers=lhs_in_registers,
                interpret=interpret,
            )
        )

    @jax.jit
    def dequantize_then_gemm(a, sa, b, sb):
        g, n, k = b.shape
        a16 = dequantize_mxfp8(a, sa, out_dtype=jnp.bfloat16, interpret=interpret)
        b16 = dequantize_mxfp8(
            b.reshape(g * n, k),
            sb.reshape(g * n, k // 32),
            out_dtype=jnp.bfloat16,
            interpret=interpret,
        ).reshape(g, n, k)
        return grouped_matmul(
            a16, b16, sizes, out_dtype=jnp.float32, config=bf16_config, interpret=interpret
        )

    @jax.jit
    def xla_dense_bf16(a, sa, b, sb):
        # bf16 inputs (made outside the timed call): an FP8 input converted inside the jitted
        # function lets XLA run an FP8 GEMM instead (1346 "bf16" TFLOP/s in the first run).
        del sa, b
        return jnp.dot(a, sb, preferred_element_type=jnp.float32)

    registers = {}
    if not small:  # the interpreter has no register-operand wgmma
        registers = {
            "in-kernel, lhs in registers (f32 arithmetic)": in_kernel(None, lhs_in_registers=True),
            "in-kernel, lhs in registers, bf16 arithmetic": in_kernel(
                None, "bfloat16", lhs_in_registers=True
            ),
        }
    return registers | {
        "in-kernel dequant (f32 arithmetic)": in_kernel(mx_default),
        "in-kernel, wgmma in flight (f32 arithmetic)": in_kernel(mx_in_flight),
        "in-kernel, wgmma in flight, bf16 arithmetic": in_kernel(mx_in_flight, "bfloat16"),
        "in-kernel, wgmma in flight, bf16 arithmetic, 8-bit layout": in_kernel(
            mx_in_flight, "bfloat16", "wgmma_8bit"
        ),
        "in-kernel, bf16 arithmetic, 8-bit layout": in_kernel(mx_default, "bfloat16", "wgmma_8bit"),
        "dequantize kernels + bf16 GEMM": dequantize_then_gemm,
        "XLA dense bf16": xla_dense_bf16,
    }


def _scales_only(codes_ref, scale_ref, fp8_dtype, arithmetic, layout_name):
    """Ablation: the row scales broadcast over the block, the codes never loaded."""
    layout = mx_kernel.DEQUANT_LAYOUTS[layout_name]
    scales = plgpu.load(scale_ref, layout=layout.reduce(1)).astype(jnp.float32)
    values = lax.broadcast_in_dim(scales, codes_ref.shape, (0,))
    return plgpu.layout_cast(values, layout).astype(jnp.bfloat16)


def _constant(codes_ref, scale_ref, fp8_dtype, arithmetic, layout_name):
    """Ablation: ones, nothing loaded."""
    values = jnp.full(codes_ref.shape, 1.0, jnp.float32)
    return plgpu.layout_cast(values, mx_kernel.DEQUANT_LAYOUTS[layout_name]).astype(jnp.bfloat16)


ABLATIONS = {
    "ablation: no code loads (wrong result)": _scales_only,
    "ablation: no loads at all (wrong result)": _constant,
}


def run_shape(name, shape, small: bool, ablation: bool = False) -> list[dict]:
    g, m, k, n, sizes = shape
    sizes = jnp.asarray(sizes, jnp.int32)
    arg_sets = [operands(jax.random.key(i), g, m, k, n) for i in range(2)]
    fns = candidates(sizes, small)
    patches = {label: contextlib.nullcontext() for label in fns}
    if ablation:
        in_flight = dataclasses.replace(IN_FLIGHT, **TINY) if small else IN_FLIGHT
        for label, replacement in ABLATIONS.items():
            fns[label] = jax.jit(
                lambda a, sa, b, sb: mx_kernel.grouped_matmul_mxfp8(
                    a, sa, b, sb, sizes, out_dtype=jnp.float32, config=in_flight, interpret=small
                )
            )
            patches[label] = unittest.mock.patch.object(mx_kernel, "dequantize_block", replacement)
    reference = jax.block_until_ready(fns["dequantize kernels + bf16 GEMM"](*arg_sets[0]))
    scale = float(jnp.max(jnp.abs(reference)))
    differences = {}
    for label in fns:
        if label.startswith(("in-kernel", "ablation")):
            with patches[label]:  # traced (and compiled) here, with its patch if any
                out = fns[label](*arg_sets[0])
            differences[label] = float(jnp.max(jnp.abs(out - reference))) / scale
    # The dense yardstick's operands: bf16 (M, K) and (K, N) of the same sizes.
    dense_sets = [
        (a.astype(jnp.bfloat16), None, None, b[0].astype(jnp.bfloat16).T) for a, _, b, _ in arg_sets
    ]
    timing = (
        dict(rounds=1, calls_per_batch=1, warmup_seconds=0.0, compile_first=False) if small else {}
    )
    seconds = interleaved_seconds(
        {
            label: (fn, dense_sets if label == "XLA dense bf16" else arg_sets)
            for label, fn in fns.items()
        },
        **timing,
    )
    flops = 2 * m * k * n
    dense = seconds["XLA dense bf16"]
    return [
        dict(
            shape=name,
            impl=label,
            us=1e6 * s,
            tflops=flops / s / 1e12,
            vs_xla_dense_bf16=dense / s,
            max_rel_diff=differences.get(label),
        )
        for label, s in seconds.items()
    ]


def markdown(rows: list[dict]) -> str:
    lines = [
        f"Device: {device_description()}. Forward, float32 out, timed in alternation.",
        "",
        "| shape | implementation | µs | TFLOP/s | × XLA dense bf16 "
        "| max diff vs dequantize path |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        diff = "—" if r["max_rel_diff"] is None else f"{r['max_rel_diff']:.1e}"
        lines.append(
            f"| {r['shape']} | {r['impl']} | {r['us']:.0f} | {r['tflops']:.0f} | "
            f"{r['vs_xla_dense_bf16']:.2f} | {diff} |"
        )
    return "\n".join(lines) + "\n"


def main(out_dir: str | None = None, small: bool = False, ablation: bool = False) -> str:
    rows = []
    shapes = SMALL_SHAPES if small else SHAPES
    for index, (name, shape) in enumerate(shapes.items()):
        rows += run_shape(name, shape, small, ablation=ablation and index == 0)
    return report(out_dir, "grouped_mx_ab", rows, markdown(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--ablation", action="store_true", help="where the time goes (G=8 only)")
    args = parser.parse_args()
    main(args.out, small=args.small, ablation=args.ablation)
