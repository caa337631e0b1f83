"""Where MXFP8 row+col quantize spends its time: the kernel rebuilt stage by stage, timed in
alternation.

    PYTHONPATH=. python3 benchmarks/quantize_ablation.py OUT_DIR [--small]

Each copy (rowwise, columnwise) runs one of four stages of the lean MXFP8 kernel, on the same
tiles, loads and staged code stores:
  cast:  the codes of x itself (saturating E4M3 cast; no block scaling: the cast skeleton);
  amax:  the cast, plus each block's amax and E8M0 byte, stored as the scale (the amax feeds
         the stored byte only);
  scale: the whole MXFP8 arithmetic (`quantize_mxfp8.quantize_lines`, lean, on hardware);
and the kernels themselves (`pallas_kernels.quantize_mxfp8`, rowwise, columnwise, both) run
beside them. Scales are stored the way the stop-29 kernel did, straight into the (lines,
blocks) layout (4 bytes per line per tile). Stop 30 found with it that the amax stage, not the
scaling, carried the extra time, and with Nsight Compute that it was the scale stores
(docs/benchmarks.md). Wall clock per call with dispatch (`benchmarks.timing.
interleaved_seconds`), so compare rows with each other only. `--small`: a 2048² input (on a
GPU) or 256² in the interpreter, a smoke test. Writes OUT_DIR/quantize_ablation.{json,md}.
"""

from __future__ import annotations

import argparse
import functools
import importlib

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import pallas_kernels as pk
from benchmarks.timing import device_description, interleaved_seconds, report
from pallas_kernels import quantize_common as qc

mxfp8 = importlib.import_module("pallas_kernels.quantize_mxfp8")  # the module, not the function

E4M3 = jnp.float8_e4m3fn
BLOCK = 32
STAGES = ("cast", "amax", "scale")
# (rowwise stage, columnwise stage); None: that copy is not written.
CASES = (
    *((stage, None) for stage in STAGES),
    *((None, stage) for stage in STAGES),
    *((stage, stage) for stage in STAGES),
    ("cast", "scale"),
    ("scale", "cast"),
    ("amax", "scale"),
    ("scale", "amax"),
)


def _quantize_stage(v, layout, stage: str, on_hardware: bool):
    """(code bytes, scale bytes or None) of one (lines, 32) block column at `stage`."""
    if stage == "cast":
        return qc.as_bytes(qc.saturating_fp8(v, E4M3)), None
    amax_bits = qc.row_amax_bits(v)
    if stage == "amax":
        byte = mxfp8.e8m0_scale_byte_without_division(amax_bits, qc.FP8_MAX[jnp.dtype(E4M3)])
        return qc.as_bytes(qc.saturating_fp8(v, E4M3)), byte.astype(jnp.uint8)
    codes, byte = mxfp8.quantize_lines(
        v, layout, E4M3, amax_bits=amax_bits, lean=True, on_hardware=on_hardware
    )
    return qc.as_bytes(codes), byte


def staged_kernel(x: jax.Array, row_stage: str | None, col_stage: str | None, interpret: bool):
    """The MXFP8 tile structure with each copy at its stage: (codes..., scales...)."""
    config = qc.TileConfig()
    rows, cols = x.shape
    on_hardware = not qc.interpreting(interpret)
    copies = [(False, row_stage), (True, col_stage)]
    copies = [(columnwise, stage) for columnwise, stage in copies if stage is not None]
    outputs = [qc.DataOutput(columnwise=columnwise) for columnwise, _ in copies]
    scaled = [stage != "cast" for _, stage in copies]

    def tile(x_smem, m0, k0, dests, scale_gmems):
        scale_refs = iter(scale_gmems)
        for (columnwise, stage), dest, has_scale in zip(copies, dests, scaled, strict=True):
            scale_bytes = []
            for b in range(4):
                if columnwise:
                    v = qc.load_columns(x_smem.at[pl.ds(BLOCK * b, BLOCK), :])
                    layout = qc.RPT1
                else:
                    v = qc.load_rows(x_smem.at[:, pl.ds(BLOCK * b, BLOCK)], x.dtype)
                    layout = qc.rows_layout(x.dtype)
                code_bytes, byte = _quantize_stage(v, layout, stage, on_hardware)
                qc.store_line_bytes(dest.cols(BLOCK * b, BLOCK), code_bytes)
                if byte is not None:
                    scale_bytes.append(qc.column(byte))
            if has_scale:
                line0, block0 = (k0, m0 // BLOCK) if columnwise else (m0, k0 // BLOCK)
                line_major = next(scale_refs).at[pl.ds(line0, 128), pl.ds(block0, 4)]
                qc.store_line_bytes(line_major, qc.concat_columns(scale_bytes))

    def kernel(x_gmem, *refs):
        outs, scratch = qc.split_refs(refs, config, cols, outputs)
        data, scales = outs[: len(outputs)], outs[len(outputs) :]
        body = functools.partial(tile, scale_gmems=scales)
        qc.for_each_tile(x_gmem, scratch, config, cols, body, list(zip(data, outputs, strict=True)))

    def lines_and_width(columnwise):
        return (cols, rows) if columnwise else (rows, cols)

    out_types = [jax.ShapeDtypeStruct(lines_and_width(c), jnp.uint8) for c, _ in copies]
    for (columnwise, _), has_scale in zip(copies, scaled, strict=True):
        if has_scale:
            lines, width = lines_and_width(columnwise)
            out_types.append(jax.ShapeDtypeStruct((lines, width // BLOCK), jnp.uint8))
    return plgpu.kernel(
        kernel,
        out_type=tuple(out_types),
        kernel_name=f"ablation_{row_stage}_{col_stage}",
        scratch_types=qc.tile_scratch(config, x.dtype, cols, outputs),
        compiler_params=qc.kernel_params(config, cols),
        interpret=qc.interpret_params(interpret),
        **qc.tile_grid(rows, cols, config),
    )(x)


def candidates(inputs: list[jax.Array], interpret: bool) -> dict:
    out = {}
    for row_stage, col_stage in CASES:
        fn = jax.jit(
            functools.partial(
                staged_kernel, row_stage=row_stage, col_stage=col_stage, interpret=interpret
            )
        )
        out[f"row {row_stage or '-'}, col {col_stage or '-'}"] = (fn, [(x,) for x in inputs])
    line_major = pk.MXFP8QuantizeConfig(tile_major_scales=False)
    for rowwise, columnwise in ((True, False), (False, True), (True, True)):
        for name, config in (("default", None), ("line-major scales", line_major)):
            fn = jax.jit(
                functools.partial(
                    pk.quantize_mxfp8,
                    rowwise=rowwise,
                    columnwise=columnwise,
                    config=config,
                    interpret=interpret,
                )
            )
            copies = "row+col" if rowwise and columnwise else ("row" if rowwise else "col")
            out[f"quantize_mxfp8 {copies}, {name}"] = (fn, [(x,) for x in inputs])
    return out


def main(out_dir: str | None = None, *, small: bool = False) -> str:
    on_gpu = jax.devices()[0].platform == "gpu"
    if not (on_gpu or small):
        raise RuntimeError("quantize_ablation times H200 kernels: run it on a GPU (or --small)")
    shape = (8192, 8192) if on_gpu and not small else (2048, 2048) if on_gpu else (256, 256)
    timing = (
        dict(rounds=9, calls_per_batch=20)
        if on_gpu
        else dict(rounds=1, calls_per_batch=1, warmup_seconds=0)
    )
    keys = jax.random.split(jax.random.key(1), 2)
    inputs = [jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16) for k in keys]
    interpret = not on_gpu
    scale_case = staged_kernel(inputs[0], "scale", "scale", interpret)
    kernel = pk.quantize_mxfp8(inputs[0], columnwise=True, interpret=interpret)
    wanted = (kernel.rowwise_data, kernel.columnwise_data)
    wanted += (kernel.rowwise_scale, kernel.columnwise_scale)
    same = all(
        bool(jnp.array_equal(qc.as_bytes(want) if want.dtype != jnp.uint8 else want, got))
        for want, got in zip(wanted, scale_case, strict=True)
    )
    if not same:
        raise AssertionError("the 'scale' stage of both copies differs from quantize_mxfp8")
    seconds = interleaved_seconds(candidates(inputs, interpret), **timing)
    device = device_description()
    rows = [
        dict(shape=f"{shape[0]}x{shape[1]}", case=name, us=s * 1e6) for name, s in seconds.items()
    ]
    lines = [
        f"MXFP8 row+col quantize rebuilt stage by stage, {shape[0]}x{shape[1]} bf16, timed in "
        f"alternation (wall clock with dispatch) on {device}. The 'scale' stage of both copies "
        "equals quantize_mxfp8 bit for bit.",
        "",
        "| case | µs |",
        "|---|---:|",
        *(f"| {r['case']} | {r['us']:.1f} |" for r in rows),
    ]
    return report(out_dir, "quantize_ablation", rows, "\n".join(lines) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", default=None)
    parser.add_argument("--small", action="store_true", help="small shapes (smoke test)")
    args = parser.parse_args()
    main(args.out_dir, small=args.small)
