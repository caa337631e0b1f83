"""MXFP8 and FP8 block 1×128 row+col: the quantize kernel and its scale rearrangement, apart.

    PYTHONPATH=. python3 benchmarks/quantize_scale_split.py OUT_DIR [--small]

For bf16 inputs (8192², 16384×4096), each candidate's GPU kernels are traced over 20 calls
(`jax.profiler`, CUPTI) and listed by name with their median time, so the quantize kernel and
what rearranges its tile-major scales (the untile kernel, XLA transposes) are timed apart; then
the candidates are timed in alternation by wall clock (`interleaved_seconds`). Candidates: the
default (tile-major scales, `untile_scales.py` for both copies), the same with XLA transposes
(`untile_kernel=False`), the kernel's raw outputs (no rearrangement: its time alone), blocks
of 4×8 tiles per CTA with `stage_scales` (written line-major by TMA, no rearrangement), the
tiles taken in 8 × 8 squares (`band_tiles_m`) with tile-major scales and with line-major ones
stored straight from the kernel (no rearrangement), FP8 block 1×128 with and without the untile
kernel and line-major in squares, the row+col cast skeleton (grid order and squares) and XLA's
`x + 1`.
Before timing, every quantizer's outputs are compared with the default's, bit for bit, on the
timed input and on one with Inf / NaN / tiny values (the "bits" entry).

`--small`: small shapes on the GPU; where there is none, tiny shapes in Mosaic GPU's
interpreter (a smoke test whose times mean nothing). Writes OUT_DIR/quantize_scale_split.json
and .md.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import jax
import jax.numpy as jnp
from jax import lax

import pallas_kernels as pk
from benchmarks.bench_quantize import pallas_cast_skeleton
from benchmarks.profile_step import traced_kernel_events
from benchmarks.timing import (
    device_description,
    interleaved_seconds,
    kernel_timing_setup,
    report,
)
from pallas_kernels import quantize_common as qc
from pallas_kernels import untile_scales

SHAPES = ((8192, 8192), (16384, 4096))
SMALL_SHAPES = ((2048, 2048),)
INTERPRETED_SHAPES = ((128, 4096),)  # 32 column tiles: the untile kernel runs
TRACED_CALLS = 20


def _mxfp8(x, config=None):
    return pk.quantize_mxfp8(x, rowwise=True, columnwise=True, config=config)


def _fp8_block(x, config=None):
    return pk.quantize_fp8_block(x, rowwise=True, columnwise=True, config=config)


def _mxfp8_raw(x):
    """The default kernel's outputs as it writes them: the tile-major scales left as they are."""
    kept = untile_scales.untile_line_scales_all
    untile_scales.untile_line_scales_all = lambda outs, **_: outs
    try:
        # A function of its own: jax.jit(_mxfp8) elsewhere would reuse this trace.
        return jax.jit(lambda v: _mxfp8(v)).lower(x).compile()
    finally:
        untile_scales.untile_line_scales_all = kept


def candidates(x: jax.Array) -> dict:
    mx, fb = pk.MXFP8QuantizeConfig, pk.FP8BlockQuantizeConfig
    return {
        "mxfp8 default": jax.jit(_mxfp8),
        "mxfp8 XLA untile": jax.jit(functools.partial(_mxfp8, config=mx(untile_kernel=False))),
        "mxfp8 kernel alone (raw scales)": _mxfp8_raw(x),
        "mxfp8 4x8 tiles per CTA, stage_scales": jax.jit(
            functools.partial(
                _mxfp8, config=mx(steps_per_cta=8, steps_per_cta_m=4, stage_scales=True)
            )
        ),
        # The order CTAs take their tiles in (band_tiles_m): 8 × 8 squares of tiles in flight
        # together fill the line-major scales' 32-byte sectors (8 tiles' 4-byte words of a
        # line, along K for the rowwise copy, along M for the columnwise one) while they are
        # in the L2, where the grid order (along a whole row of tiles: the launch is k
        # fastest) does that for the rowwise copy only. (Stop 32's run read the launch as m
        # fastest, so its "bands" were another order; stop 50 fixed `cta_position`.)
        "mxfp8 band 8": jax.jit(functools.partial(_mxfp8, config=mx(band_tiles_m=8))),
        "mxfp8 line-major scales": jax.jit(
            functools.partial(_mxfp8, config=mx(tile_major_scales=False))
        ),
        **{
            f"mxfp8 line-major scales, band {band}": jax.jit(
                functools.partial(_mxfp8, config=mx(tile_major_scales=False, band_tiles_m=band))
            )
            for band in (4, 8)
        },
        "fp8_block 1x128 default": jax.jit(_fp8_block),
        "fp8_block 1x128 line-major scales, band 8": jax.jit(
            functools.partial(_fp8_block, config=fb(tile_major_scales=False, band_tiles_m=8))
        ),
        "fp8_block 1x128 XLA untile": jax.jit(
            functools.partial(_fp8_block, config=fb(untile_kernel=False))
        ),
        "cast skeleton": jax.jit(pallas_cast_skeleton),
        "cast skeleton, band 8": jax.jit(
            functools.partial(pallas_cast_skeleton, config=qc.TileConfig(band_tiles_m=8))
        ),
        "x + 1": jax.jit(lambda x: x + 1),
    }


def _same_bits(a: jax.Array, b: jax.Array) -> bool:
    unsigned = {1: jnp.uint8, 4: jnp.uint32}[a.dtype.itemsize]
    return bool(
        jnp.all(lax.bitcast_convert_type(a, unsigned) == lax.bitcast_convert_type(b, unsigned))
    )


def check_bits(cands: dict, inputs: list[jax.Array]) -> dict[str, bool]:
    """Each quantizer's outputs against its format's default, on every input."""
    bits = {}
    default_outputs = {}  # (default's name, input index): its outputs, computed once
    for name, fn in cands.items():
        fmt = name.split(" ")[0]
        if fmt not in ("mxfp8", "fp8_block", "cast") or "raw" in name:
            continue
        default = {"mxfp8": "mxfp8 default", "fp8_block": "fp8_block 1x128 default"}.get(
            fmt, "cast skeleton"
        )
        same = True
        for index, x in enumerate(inputs):
            if (default, index) not in default_outputs:
                default_outputs[default, index] = cands[default](x)
            expected = default_outputs[default, index]
            actual = expected if name == default else fn(x)
            same &= all(_same_bits(a, b) for a, b in zip(expected, actual, strict=True))
        bits[name] = same
    return bits


def kernels_per_call(fn, x: jax.Array) -> dict[str, float]:
    """Median µs of each GPU kernel a call of fn(x) launches (summed over its launches)."""
    jax.block_until_ready(fn(x))
    events = traced_kernel_events(lambda: [fn(x) for _ in range(TRACED_CALLS)])
    durations: dict[str, list[float]] = {}
    for event in events:
        durations.setdefault(str(event.get("name")), []).append(float(event.get("dur", 0.0)))
    return {name: statistics.median(us) * len(us) / TRACED_CALLS for name, us in durations.items()}


def run(shapes, on_gpu: bool, timing: dict) -> list[dict]:
    rows = []
    for shape in shapes:
        x = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
        odd = x.at[::97, ::89].set(jnp.inf).at[5::211, 7::53].set(jnp.nan)
        odd = odd.at[::3].multiply(1e-38)
        cands = candidates(x)
        bits = check_bits(cands, [x, odd])
        wall = interleaved_seconds({k: (fn, [(x,)]) for k, fn in cands.items()}, **timing)
        for name, fn in cands.items():
            kernels = kernels_per_call(fn, x) if on_gpu else {}
            rows.append(
                dict(
                    shape=f"{shape[0]}x{shape[1]}",
                    case=name,
                    bits=bits.get(name),
                    kernels_us=kernels,
                    kernels_total_us=sum(kernels.values()) if kernels else None,
                    wall_us=wall[name] * 1e6,
                )
            )
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| shape | case | bits | GPU kernels (µs each, per call) | kernels µs | wall µs |",
        "|---|---|---|---|---:|---:|",
    ]
    for r in rows:
        kernels = ", ".join(f"{k} {v:.2f}" for k, v in r["kernels_us"].items()) or "—"
        total = "—" if r["kernels_total_us"] is None else f"{r['kernels_total_us']:.1f}"
        bits = {None: "", True: "identical", False: "**differ**"}[r["bits"]]
        lines.append(
            f"| {r['shape']} | {r['case']} | {bits} | {kernels} | {total} | {r['wall_us']:.1f} |"
        )
    return "\n".join(lines)


def main(out_dir: str | None = None, *, small: bool = False) -> str:
    shapes, timing, interpret = kernel_timing_setup(
        "quantize_scale_split", small, SHAPES, SMALL_SHAPES, INTERPRETED_SHAPES
    )
    with interpret:
        rows = run(shapes, jax.devices()[0].platform == "gpu", timing)
    text = f"{device_description()}\n\n{markdown(rows)}\n"
    report(out_dir, "quantize_scale_split", rows, text)
    return text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?")
    parser.add_argument("--small", action="store_true", help="small shapes (smoke test)")
    args = parser.parse_args()
    print(main(args.out_dir, small=args.small))
