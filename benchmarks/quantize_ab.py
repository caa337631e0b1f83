"""MXFP8 row+col quantize: the default kernel against its opt-in variants, timed in alternation.

    PYTHONPATH=. python3 benchmarks/quantize_ab.py OUT_DIR [--small] [--kernel KERNEL]

`--kernel fp8_block_1x128` / `fp8_block_128x128`: the FP8 block kernel (E4M3, power-of-2
scales, row+col) instead, its exact arithmetic against `lean_arithmetic` (the default);
`--kernel nvfp4` / `nvfp4_sr`: NVFP4 row + Hadamard col (with stochastic rounding for `_sr`),
its first kernel (exact arithmetic, unrolled blocks, integer division) against stops 26-33's
default and stops 34-35's changes (`native_division`, `packed_row_amax`,
`carry_stochastic_rounding`, `grid_min_rounding`) one by one; `--kernel nvfp4_amax`: NVFP4
row + Hadamard col with its global amaxes, by the separate amax kernel against the amax taken
inside the quantize launch (GPU only); `--kernel nvfp4_nan_clamp`: NVFP4 row + Hadamard col,
the default against `clamp_clears_nan_blocks` (stop 53); `--kernel nvfp4_weight`: NVFP4 16×16
weight blocks row+col, the default (compact block amaxes, preloaded per tile) against
per-line copies of them and per-group loads; earlier variants (unrolled lean blocks, float
stochastic rounding, steps_per_cta=4) are in docs/benchmarks.md; written to
OUT_DIR/quantize_ab_KERNEL.{json,md}.

For bf16 inputs of each shape, the candidates are the first kernel's exact arithmetic
(`lean_arithmetic=False`, the baseline), each variant (`split_copies`, `lean_arithmetic` (now
the default), both, `reuse_input_tile`, `stage_columnwise_in_input`), the row+col E4M3 cast
skeleton of bench_quantize.py (the same tiles, loads and stores without block scaling: the
ceiling of this structure), the skeleton with `reuse_input_tile` (the codes staged in the input
tile's memory: half the shared memory per CTA) and with `stage_columnwise_in_input` (the
columnwise codes staged over each 32-row slab once read: 4 CTAs per SM instead of 3), and XLA's
`x + 1` (the copy floor). They are timed with
`benchmarks.timing.interleaved_seconds` (batches of calls, alternating between candidates, so
clock drift hits all alike). Before timing, each variant's four outputs are compared with the
baseline's on the device, bit for bit, on the timed input and on one with NaN / Inf / huge /
tiny / zero blocks; the "bits" column records the result (a variant that differs or fails is
not timed).

Effective TB/s = (x read once + codes and scale bytes written once) / time, as in
bench_quantize.py. `--small`: small shapes (on the GPU; where there is none, tiny shapes in
Mosaic GPU's interpreter, a smoke test whose times mean nothing). Writes
OUT_DIR/quantize_ab.json and OUT_DIR/quantize_ab.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_kernels as pk
from benchmarks.bench_quantize import nvfp4_fixed_amax, pallas_cast_skeleton
from benchmarks.timing import (
    device_description,
    interleaved_seconds,
    kernel_timing_setup,
    report,
)
from pallas_kernels import quantize_common as qc

SHAPES = ((8192, 8192), (16384, 4096))
SMALL_SHAPES = ((2048, 2048), (4096, 1024))
INTERPRETED_SHAPES = ((256, 256),)
BASELINE = "exact arithmetic (the first kernel)"
VARIANTS: dict[str, pk.MXFP8QuantizeConfig] = {
    BASELINE: pk.MXFP8QuantizeConfig(lean_arithmetic=False),
    "split_copies": pk.MXFP8QuantizeConfig(split_copies=True, lean_arithmetic=False),
    "lean_arithmetic (default)": pk.MXFP8QuantizeConfig(),
    "split_copies + lean_arithmetic": pk.MXFP8QuantizeConfig(split_copies=True),
    "reuse_input_tile + lean_arithmetic": pk.MXFP8QuantizeConfig(reuse_input_tile=True),
    "stage_columnwise_in_input + lean_arithmetic": pk.MXFP8QuantizeConfig(
        stage_columnwise_in_input=True
    ),
    # Stop 30 made tile-major scales the default; their predecessor, and with reuse.
    "lean, line-major scales (stop 29's default)": pk.MXFP8QuantizeConfig(tile_major_scales=False),
    "reuse_input_tile + lean, line-major scales": pk.MXFP8QuantizeConfig(
        tile_major_scales=False, reuse_input_tile=True
    ),
}
FP8_BLOCK_BASELINE = "exact arithmetic (the first kernel)"
FP8_BLOCK_VARIANTS: dict[str, pk.FP8BlockQuantizeConfig] = {
    FP8_BLOCK_BASELINE: pk.FP8BlockQuantizeConfig(lean_arithmetic=False),
    "lean_arithmetic (default)": pk.FP8BlockQuantizeConfig(),
    "reuse_input_tile + lean_arithmetic": pk.FP8BlockQuantizeConfig(reuse_input_tile=True),
    "lean, line-major scales (stop 29's default)": pk.FP8BlockQuantizeConfig(
        tile_major_scales=False
    ),
}
NVFP4_BASELINE = "exact arithmetic (the first kernel)"


def _nvfp4_before_stop_36(**fields) -> pk.NVFP4QuantizeConfig:
    """An earlier NVFP4 kernel: the sign by a compare and the block amaxes on bit patterns
    (stop 36's defaults off), plus `fields`."""
    return pk.NVFP4QuantizeConfig(float_sign_test=False, float_block_amax=False, **fields)


NVFP4_VARIANTS: dict[str, pk.NVFP4QuantizeConfig] = {
    NVFP4_BASELINE: pk.NVFP4QuantizeConfig(
        lean_arithmetic=False, loop_blocks=False, native_division=False, float_block_amax=False
    ),
    # Stops 26-33's default: lean, loop_blocks, stochastic rounding decided on integers (a
    # tie-corrected comparison), and each block's 1 / (scale · S_dec) by integer long division.
    "lean, loop_blocks, integer division (stops 26-33)": _nvfp4_before_stop_36(
        native_division=False,
        packed_row_amax=False,
        carry_stochastic_rounding=False,
        grid_min_rounding=False,
    ),
    "lean, loop_blocks, native division": _nvfp4_before_stop_36(
        packed_row_amax=False, carry_stochastic_rounding=False, grid_min_rounding=False
    ),
    "lean, loop_blocks, native division, packed row amax (stop 34)": _nvfp4_before_stop_36(
        carry_stochastic_rounding=False, grid_min_rounding=False
    ),
    # Stop 35: stochastic rounding's decision as one carry (no effect without it), then
    # nearest rounding as the smallest of three float roundings (no effect with stochastic
    # rounding, which rounds every element). Stop 36: each code's sign bit by two FMA-pipe
    # instructions instead of a compare and a select (both roundings). All the default.
    "stop 34 + carry stochastic rounding": _nvfp4_before_stop_36(grid_min_rounding=False),
    "+ grid-min nearest rounding (stop 35)": _nvfp4_before_stop_36(),
    "+ float sign test (stop 36)": pk.NVFP4QuantizeConfig(float_block_amax=False),
    # Stop 36: float32 block amaxes by a float max (the Hadamard copy's, float32 x's).
    "+ float block amax (default)": pk.NVFP4QuantizeConfig(),
}
# NVFP4 row + Hadamard col, nearest rounding (`--kernel nvfp4_nan_clamp`): the default against
# stop 53's opt-in NaN-amax blocks cleared by the clamp (no mask on the packed codes; counted
# by count_quantize_ops.py: 34.8 -> 33.8 operations per element), on its own so the call is
# short.
NVFP4_NAN_CLAMP_BASELINE = "default (NaN blocks by a mask)"
NVFP4_NAN_CLAMP_VARIANTS: dict[str, pk.NVFP4QuantizeConfig] = {
    NVFP4_NAN_CLAMP_BASELINE: pk.NVFP4QuantizeConfig(),
    "clamp_clears_nan_blocks": pk.NVFP4QuantizeConfig(clamp_clears_nan_blocks=True),
}
# NVFP4 16×16 weight blocks (`--kernel nvfp4_weight`): each group's block amaxes loaded just
# before it against the tile's loaded at its start (stop 37), read from per-line copies written
# by XLA or from the compact (M/16, K/16) array (stop 38); both of the latter are the default.
NVFP4_WEIGHT_BASELINE = "per-group loads, per-line copies (stop 37's default)"
NVFP4_WEIGHT_VARIANTS: dict[str, pk.NVFP4QuantizeConfig] = {
    NVFP4_WEIGHT_BASELINE: pk.NVFP4QuantizeConfig(
        compact_block_amaxes=False, preload_block_amaxes=False
    ),
    "per-group loads, compact block amaxes (stop 38's first)": pk.NVFP4QuantizeConfig(
        preload_block_amaxes=False
    ),
    "preload_block_amaxes, compact (default)": pk.NVFP4QuantizeConfig(),
    "preload_block_amaxes, per-line copies": pk.NVFP4QuantizeConfig(compact_block_amaxes=False),
}
# NVFP4 row + Hadamard col with the global amaxes taken in the call (`--kernel nvfp4_amax`):
# `nvfp4_amax`'s kernel before the quantize kernel (the default) against the amax inside the
# quantize launch (`quantize_nvfp4(amax_in_kernel=True)`) with a given number of amax CTAs
# (None: one per SM). The "fused into the pass or a separate kernel: measure".
NVFP4_AMAX_BASELINE = "separate amax kernel (default)"
NVFP4_AMAX_VARIANTS: dict[str, int | str | None] = {
    NVFP4_AMAX_BASELINE: "separate",
    "amax in the quantize kernel, one CTA per SM": None,
    "amax in the quantize kernel, 64 CTAs": 64,
}
KERNELS = (
    "mxfp8",
    "fp8_block_1x128",
    "fp8_block_128x128",
    "nvfp4",
    "nvfp4_sr",
    "nvfp4_weight",
    "nvfp4_amax",
    "nvfp4_nan_clamp",
)
SKELETON = "row+col e4m3 cast skeleton"
SKELETON_REUSE = "row+col e4m3 cast skeleton, reuse_input_tile"
SKELETON_SLABS = "row+col e4m3 cast skeleton, stage_columnwise_in_input"
XLA_COPY = "x + 1 (XLA fusion)"
# Timed beside every kernel's variants: what the tile structure and the copy floor reach.
STRUCTURE_CEILINGS = (SKELETON, SKELETON_REUSE, SKELETON_SLABS, XLA_COPY)


def mxfp8_row_col(config: pk.MXFP8QuantizeConfig) -> Callable:
    return jax.jit(lambda x: pk.quantize_mxfp8(x, rowwise=True, columnwise=True, config=config))


def mxfp8_bytes(rows: int, cols: int) -> int:
    """x (bf16) read once; both copies' codes (1 byte each) and scale bytes written once."""
    n = rows * cols
    return 2 * n + 2 * (n + n // 32)


def fp8_block_row_col(block: tuple[int, int]) -> Callable:
    def make(config: pk.FP8BlockQuantizeConfig) -> Callable:
        return jax.jit(
            lambda x: pk.quantize_fp8_block(
                x, block_shape=block, rowwise=True, columnwise=True, config=config
            )
        )

    return make


def fp8_block_bytes(block: tuple[int, int]) -> Callable[[int, int], int]:
    """x (bf16) read once; both copies' codes and float32 scales written once."""
    per_scale = 128 if block == (1, 128) else 128 * 128
    return lambda rows, cols: 2 * rows * cols + 2 * (rows * cols + 4 * (rows * cols // per_scale))


def nvfp4_row_col(stochastic: bool) -> Callable:
    """NVFP4 row + Hadamard-rotated col (`bench_quantize.nvfp4_fixed_amax`)."""

    def make(config: pk.NVFP4QuantizeConfig) -> Callable:
        return jax.jit(lambda x: nvfp4_fixed_amax(x, stochastic=stochastic, config=config))

    return make


def nvfp4_weight_row_col(config: pk.NVFP4QuantizeConfig) -> Callable:
    """NVFP4 16×16 blocks row + col with a fixed global amax; the block amaxes from
    `nvfp4_block_amax_bits` inside the call (as `jax_qtrain.quantize` runs it)."""
    amax = jnp.float32(4.0)
    return jax.jit(
        lambda x: pk.quantize_nvfp4(
            x,
            block_shape=(16, 16),
            columnwise=True,
            rowwise_amax=amax,
            columnwise_amax=amax,
            config=config,
        )
    )


def nvfp4_with_amax(amax_ctas: int | str | None) -> Callable:
    """NVFP4 row + Hadamard col of bf16 x, its global amaxes included: by `nvfp4_amax`'s own
    kernel ("separate") or inside the quantize launch with `amax_ctas` amax CTAs."""
    if amax_ctas == "separate":

        def separate(x):
            row_amax, column_amax = pk.nvfp4_amax(x, hadamard_columnwise=True)
            return pk.quantize_nvfp4(
                x,
                columnwise=True,
                rowwise_amax=row_amax,
                columnwise_amax=column_amax,
                hadamard_columnwise=True,
            )

        return jax.jit(separate)
    return jax.jit(
        lambda x: pk.quantize_nvfp4(
            x,
            columnwise=True,
            hadamard_columnwise=True,
            amax_in_kernel=True,
            amax_ctas=amax_ctas,
        )[0]
    )


def nvfp4_bytes(rows: int, cols: int) -> int:
    """x (bf16) read once; both copies' packed codes (half a byte) and E4M3 scales written."""
    n = rows * cols
    return 2 * n + 2 * (n // 2 + n // 16)


def kernel_setup(kernel: str) -> dict:
    """What `run_shape` compares for `kernel` (one of KERNELS)."""
    if kernel in ("nvfp4", "nvfp4_sr"):
        stochastic = kernel == "nvfp4_sr"
        return dict(
            title="NVFP4 (Hadamard on col" + (", stochastic rounding)" if stochastic else ")"),
            baseline=NVFP4_BASELINE,
            variants=NVFP4_VARIANTS,
            make=nvfp4_row_col(stochastic),
            nbytes=nvfp4_bytes,
            width=16,
        )
    if kernel == "nvfp4_nan_clamp":
        return dict(
            title="NVFP4 (Hadamard on col), NaN blocks by the clamp",
            baseline=NVFP4_NAN_CLAMP_BASELINE,
            variants=NVFP4_NAN_CLAMP_VARIANTS,
            make=nvfp4_row_col(False),
            nbytes=nvfp4_bytes,
            width=16,
        )
    if kernel == "nvfp4_amax":
        return dict(
            title="NVFP4 (Hadamard on col, global amaxes included)",
            baseline=NVFP4_AMAX_BASELINE,
            variants=NVFP4_AMAX_VARIANTS,
            make=nvfp4_with_amax,
            nbytes=nvfp4_bytes,
            width=16,
            # The interpreter has no semaphores: the amax-in-kernel variants run on GPUs only.
            gpu_only=[name for name in NVFP4_AMAX_VARIANTS if name != NVFP4_AMAX_BASELINE],
        )
    if kernel == "nvfp4_weight":
        n_bytes = lambda rows, cols: 2 * rows * cols + rows * cols + rows * cols // 128
        return dict(
            title="NVFP4 16x16 weight blocks (block amax pass included)",
            baseline=NVFP4_WEIGHT_BASELINE,
            variants=NVFP4_WEIGHT_VARIANTS,
            make=nvfp4_weight_row_col,
            nbytes=n_bytes,
            width=16,
        )
    if kernel == "mxfp8":
        return dict(
            title="MXFP8 E4M3",
            baseline=BASELINE,
            variants=VARIANTS,
            make=mxfp8_row_col,
            nbytes=mxfp8_bytes,
            width=32,
        )
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    block = (1, 128) if kernel == "fp8_block_1x128" else (128, 128)
    return dict(
        title=f"FP8 block {block[0]}x{block[1]} E4M3 (power-of-2 scales)",
        baseline=FP8_BLOCK_BASELINE,
        variants=FP8_BLOCK_VARIANTS,
        make=fp8_block_row_col(block),
        nbytes=fp8_block_bytes(block),
        width=128,
    )


def with_special_blocks(x: jax.Array, width: int = 32) -> jax.Array:
    """x with blocks (`width` wide) the scale and cast shortcuts must get right: NaN of both
    signs, ±Inf among huge finite values, a zero block, tiny and bf16-subnormal maxima."""
    huge = jnp.linspace(-3.0e38, 3.0e38, width, dtype=jnp.float32).astype(x.dtype)
    x = x.at[0, 3].set(jnp.nan).at[1, 40].set(-jnp.nan)
    x = x.at[2, :width].set(huge).at[2, 5].set(jnp.inf).at[3, 64].set(-jnp.inf)
    x = x.at[4, :width].set(0).at[5, :width].set(x[5, :width] * 2.0**-120)
    return x.at[6, :width].set(x[6, :width] * 2.0**-130).at[:32, 7].set(jnp.inf)


def _as_bytes(a: jax.Array) -> jax.Array:
    return a if a.dtype == jnp.uint8 else lax.bitcast_convert_type(a, jnp.uint8)


def bits_verdict(fn: Callable, baseline: Callable, inputs: list[jax.Array]) -> str:
    """'identical', or which output differs where, comparing on the device."""
    names = ("rowwise data", "rowwise scale", "columnwise data", "columnwise scale")
    for which, x in enumerate(inputs):
        for name, got, want in zip(names, fn(x), baseline(x), strict=True):
            differ = np.asarray(_as_bytes(got) != _as_bytes(want))
            if differ.any():
                first = tuple(int(i) for i in np.argwhere(differ)[0])
                return (
                    f"DIFFER: {name}, {int(differ.sum())} bytes, first at {first} (input {which})"
                )
    return "identical"


def run_shape(shape: tuple[int, int], timing: dict, kernel: str = "mxfp8") -> list[dict]:
    setup = kernel_setup(kernel)
    rows, cols = shape
    keys = jax.random.split(jax.random.key(1), 2)
    # Two inputs, alternated, so a call doesn't find the previous call's x in L2.
    inputs = [jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16) for k in keys]
    checks = [inputs[0], with_special_blocks(inputs[0], setup["width"])]
    baseline_name = setup["baseline"]
    baseline = setup["make"](setup["variants"][baseline_name])
    out, candidates = [], {}
    for name, config in setup["variants"].items():
        row = dict(shape=f"{rows}x{cols}", variant=name, config=repr(config))
        row["bytes"] = setup["nbytes"](rows, cols)
        fn = setup["make"](config)
        if name in setup.get("gpu_only", ()) and qc.interpreting(False):
            row["bits"] = "not run: GPU only"
            out.append(row)
            continue
        try:
            row["bits"] = (
                "baseline" if name == baseline_name else bits_verdict(fn, baseline, checks)
            )
        except Exception as err:  # report and keep going: one variant must not hide the rest
            row["bits"] = f"FAILED: {type(err).__name__}: {str(err)[:300]}"
        if row["bits"] in ("baseline", "identical"):
            candidates[name] = (fn, [(x,) for x in inputs])
        out.append(row)
    # Structure ceilings: bytes are what they read and write (2 + 2 per element, bf16 in).
    reuse = qc.TileConfig(reuse_input_tile=True)
    # (The skeleton reads its columnwise copy in 32-row slabs like the cast-transpose.)
    slabs = pk.CastTransposeConfig(stage_columnwise_in_input=True)
    for name, fn in (
        (SKELETON, jax.jit(pallas_cast_skeleton)),
        (SKELETON_REUSE, jax.jit(lambda v: pallas_cast_skeleton(v, reuse))),
        (SKELETON_SLABS, jax.jit(lambda v: pallas_cast_skeleton(v, slabs))),
        (XLA_COPY, jax.jit(lambda v: v + 1)),
    ):
        row = dict(shape=f"{rows}x{cols}", variant=name, config="", bits="—", bytes=4 * rows * cols)
        try:
            jax.block_until_ready(fn(inputs[0]))
            candidates[name] = (fn, [(x,) for x in inputs])
        except Exception as err:
            row["bits"] = f"FAILED: {type(err).__name__}: {str(err)[:300]}"
        out.append(row)
    seconds = interleaved_seconds(candidates, **timing)
    base_s = seconds.get(baseline_name)
    for row in out:
        s = seconds.get(row["variant"])
        row["us"] = None if s is None else s * 1e6
        row["tb_s"] = None if s is None else row["bytes"] / s / 1e12
        row["vs_baseline"] = None if s is None or base_s is None else base_s / s
        print(
            f"  {row['shape']} {row['variant']:34s} "
            + (f"{row['us']:8.1f} us {row['tb_s']:5.2f} TB/s " if s else "  (not timed) ")
            + row["bits"],
            flush=True,
        )
    return out


def format_table(rows: list[dict], device: str, kernel: str = "mxfp8") -> str:
    title = kernel_setup(kernel)["title"]
    lines = [
        f"{title} row+col quantize of bf16 x, variants timed in alternation on {device}.",
        "Effective TB/s: x read once + codes and scales written once (ceilings: their own bytes).",
        "",
        "| shape | variant | time (µs) | effective TB/s | vs baseline | bits vs baseline |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        us = f"{r['us']:.1f}" if r["us"] is not None else "—"
        tb = f"{r['tb_s']:.2f}" if r["tb_s"] is not None else "—"
        speedup = f"{r['vs_baseline']:.3f}×" if r["vs_baseline"] is not None else "—"
        lines.append(f"| {r['shape']} | {r['variant']} | {us} | {tb} | {speedup} | {r['bits']} |")
    return "\n".join(lines) + "\n"


def main(out_dir: str | None = None, *, small: bool = False, kernel: str = "mxfp8") -> str:
    """Time every candidate on each shape; write the rows and table under `out_dir`."""
    kernel_setup(kernel)  # a bad name fails before anything runs
    shapes, timing, interpret = kernel_timing_setup(
        "quantize_ab", small, SHAPES, SMALL_SHAPES, INTERPRETED_SHAPES
    )
    device = device_description()
    print(f"device: {device}", flush=True)
    rows = []
    with interpret:
        for shape in shapes:
            rows += run_shape(shape, timing, kernel)
    name = "quantize_ab" if kernel == "mxfp8" else f"quantize_ab_{kernel}"
    return report(out_dir, name, rows, format_table(rows, device, kernel))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", default=None)
    parser.add_argument("--small", action="store_true", help="small shapes (smoke test)")
    parser.add_argument("--kernel", choices=KERNELS, default="mxfp8")
    args = parser.parse_args()
    main(args.out_dir, small=args.small, kernel=args.kernel)
