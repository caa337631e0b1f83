"""ALU operations per element of the quantize kernels, counted in the module lowered for an H200.

    PYTHONPATH=. python3 benchmarks/count_quantize_ops.py [--kernel fp8_block|mxfp8|nvfp4]

Runs on the CPU: each kernel variant is cross-lowered for an H200 (`jax.export`, abstract mesh)
and the Mosaic GPU module is captured just before it is serialized. In lane semantics each op
acts on one thread's registers, so the count is per thread; a 128×128 tile gives a thread 128
elements of x per copy, hence "per element". Weights: a 32-bit arith / math op counts once per
vector element; bitwise ops and integer min / max on 8- / 16-bit vectors once per 32-bit
register (`and.b32`, `max.u16x2`); inline PTX by its `cvt.` / `min.` / `max.` instructions, and
since stop 35 its `fma.` / `add.` / `rcp.` ones (NVFP4's grid-min rounding, carry stochastic
rounding and block reciprocal: earlier counts in docs/benchmarks.md leave those out); inline
`abs.` is not counted.
Register moves (extracts, inserts, broadcasts, bitcasts), loads, stores and address arithmetic
(scalar i32 / index ops) are left out. Both sides of a `pl.when` are counted (the FP8 block
kernel's exact path has a NaN-tile branch: see `--skip-nan-branch`). A proxy for speed, not a
measurement: an integer division counts as one op but is ~20 instructions on the GPU.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import re

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from benchmarks import h200_lowering
from benchmarks.bench_quantize import nvfp4_fixed_amax

_LINE = re.compile(r"^\s*(?:(%[\w#:]+(?:, %[\w#:]+)*) = )?\"?([a-z_0-9]+\.[a-z_0-9.]+)\"?(.*)$")
_VECTOR = re.compile(r"vector<(\d+)x([a-z0-9A-Z]+)>")
_BITS = {"bf16": 16, "f16": 16, "i16": 16, "i8": 8}
_MOVES = {
    "vector.extract",
    "vector.insert",
    "vector.broadcast",
    "vector.shuffle",
    "vector.bitcast",
    "vector.extract_strided_slice",
    "vector.insert_strided_slice",
    "vector.splat",
    "arith.bitcast",
}
_PACKED = {"arith.andi", "arith.ori", "arith.xori", "arith.maxui", "arith.minui"}
_PACKED |= {"arith.maxsi", "arith.minsi"}


def lowered_module(fn, shape=(128, 128), dtype=jnp.bfloat16) -> str:
    """The Mosaic GPU module text of the one kernel `fn` launches, lowered for an H200."""
    modules = h200_lowering.mosaic_modules(fn, jax.ShapeDtypeStruct(shape, dtype))
    if len(modules) != 1:
        raise RuntimeError(f"expected one Mosaic GPU kernel, lowered {len(modules)}")
    return modules[0]


def alu_ops(text: str) -> collections.Counter:
    """Weighted ALU op counts of a module (see the module docstring), by op name."""
    ops: collections.Counter = collections.Counter()
    for line in text.splitlines():
        match = _LINE.match(line)
        if not match or not match.group(1):
            continue
        op, rest = match.group(2), match.group(3)
        if op == "llvm.inline_asm":
            if "has_side_effects" not in rest:
                ops["ptx cvt"] += rest.count("cvt.")
                ops["ptx min/max"] += rest.count("min.") + rest.count("max.")
                ops["ptx fma/add/rcp"] += (
                    rest.count("fma.") + rest.count("add.") + rest.count("rcp.")
                )
            continue
        if op.startswith("llvm.") or op in _MOVES or op in ("vector.load", "vector.store"):
            continue
        result_type = rest.rsplit(":", 1)[-1].split("->")[-1] if ":" in rest else ""
        vector = _VECTOR.search(result_type)
        if not vector or op == "arith.constant":
            continue
        n, element = int(vector.group(1)), vector.group(2)
        if op in _PACKED and element in _BITS:
            n = max(1, n * _BITS[element] // 32)
        ops[op] += n
    return ops


def per_element(fn, dtype) -> float:
    """Weighted ALU ops per element of x (a 128×128 tile: 128 elements per thread)."""
    return sum(alu_ops(lowered_module(fn, dtype=dtype)).values()) / 128


def fp8_block_rows(skip_nan_branch: bool) -> list[tuple[str, float]]:
    module = importlib.import_module("pallas_kernels.quantize_fp8_block")
    if skip_nan_branch:  # counting only: the path of a tile without NaN
        qc = module.qc

        def clean_tile_only(v, scale_b, fp8_dtype, tile_has_nan, dst_ref):
            codes = module._codes(v, scale_b, fp8_dtype, False)
            qc.store_line_bytes(dst_ref, qc.as_bytes(codes))

        module._store_codes = clean_tile_only
    out = []
    for block in ((1, 128), (128, 128)):
        for pow2 in (True, False):
            for dtype in (jnp.bfloat16, jnp.float32):
                for lean in (False, True):
                    config = pk.FP8BlockQuantizeConfig(lean_arithmetic=lean)
                    for rowwise, columnwise in ((True, False), (False, True), (True, True)):
                        copies = "+".join(
                            c for c, w in (("row", rowwise), ("col", columnwise)) if w
                        )
                        name = (
                            f"fp8_block {block[0]}x{block[1]} pow2={pow2} "
                            f"{jnp.dtype(dtype).name} {'lean' if lean else 'exact'} {copies}"
                        )

                        def fn(x, b=block, p=pow2, c=config, r=rowwise, k=columnwise):
                            return pk.quantize_fp8_block(
                                x, block_shape=b, rowwise=r, columnwise=k, power_2_scale=p, config=c
                            )

                        out.append((name, per_element(fn, dtype)))
    return out


def mxfp8_rows() -> list[tuple[str, float]]:
    out = []
    for dtype in (jnp.bfloat16, jnp.float32):
        for lean in (False, True):
            config = pk.MXFP8QuantizeConfig(lean_arithmetic=lean)
            for rowwise, columnwise in ((True, False), (False, True), (True, True)):
                copies = "+".join(c for c, w in (("row", rowwise), ("col", columnwise)) if w)
                name = f"mxfp8 {jnp.dtype(dtype).name} {'lean' if lean else 'exact'} {copies}"

                def fn(x, c=config, r=rowwise, k=columnwise):
                    return pk.quantize_mxfp8(x, rowwise=r, columnwise=k, config=c)

                out.append((name, per_element(fn, dtype)))
    return out


def nvfp4_rows() -> list[tuple[str, float]]:
    """1×16 blocks, bf16 input: each copy alone (the columnwise one with the Hadamard
    transform, as TransformerEngine quantizes activations / gradients), row+col, with and
    without stochastic rounding; both arithmetic paths, and the lean one's stochastic rounding
    decided on integers, by a comparison or (the default) one carry. The blocks unrolled
    (`loop_blocks=False`): a loop's body would count once for all its trips."""
    out = []
    arithmetics = {
        "exact": dict(lean_arithmetic=False),
        "lean": dict(
            lean_arithmetic=True, integer_stochastic_rounding=False, grid_min_rounding=False
        ),
        "lean integer-sr": dict(
            lean_arithmetic=True, integer_stochastic_rounding=True, carry_stochastic_rounding=False
        ),
        # The default since stop 35: the integer decision as one carry (one add.rp.f32 per
        # element below 1 on the GPU, inline PTX: counted since stop 35).
        "lean carry-sr": dict(
            lean_arithmetic=True, carry_stochastic_rounding=True, float_sign_test=False
        ),
        # The default since stop 35: nearest rounding as the smallest of three float roundings.
        "lean grid-min": dict(lean_arithmetic=True, grid_min_rounding=True, float_sign_test=False),
        # The defaults since stop 36: each code's sign bit by FMA-pipe instructions (both
        # roundings; the counts are MLIR's: the carry's sign add folds into one IADD3 later)
        # and float32 block amaxes by a float max (on the hardware, which this lowering is for).
        "lean float-sign": dict(lean_arithmetic=True),
        # Stop 53 (opt-in): NaN-amax blocks cleared by the grid-min clamp's limit, no mask.
        "lean nan-clamp": dict(lean_arithmetic=True, clamp_clears_nan_blocks=True),
    }
    for arithmetic, options in arithmetics.items():
        if arithmetic not in ("lean float-sign", "lean nan-clamp"):
            # the earlier kernels: block amaxes on bit patterns
            options = dict(options, float_block_amax=False)
        config = pk.NVFP4QuantizeConfig(loop_blocks=False, **options)
        for rowwise, columnwise in ((True, False), (False, True), (True, True)):
            for stochastic in (False, True):
                if arithmetic.endswith("-sr") and not stochastic:
                    continue  # the same kernel as "lean"
                if arithmetic.endswith(("grid-min", "nan-clamp")) and stochastic:
                    continue  # the same kernel as "lean carry-sr"
                copies = "+".join(c for c, w in (("row", rowwise), ("col+rht", columnwise)) if w)
                name = f"nvfp4 bfloat16 {arithmetic} {copies}{' sr' if stochastic else ''}"

                fn = functools.partial(
                    nvfp4_fixed_amax,
                    rowwise=rowwise,
                    columnwise=columnwise,
                    stochastic=stochastic,
                    config=config,
                )

                out.append((name, per_element(fn, jnp.bfloat16)))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", choices=("fp8_block", "mxfp8", "nvfp4"), default="fp8_block")
    parser.add_argument(
        "--skip-nan-branch",
        action="store_true",
        help="FP8 block: count the exact path of a tile without NaN (one side of its pl.when)",
    )
    args = parser.parse_args()
    if args.kernel == "fp8_block":
        rows = fp8_block_rows(args.skip_nan_branch)
    else:
        rows = mxfp8_rows() if args.kernel == "mxfp8" else nvfp4_rows()
    for name, ops in rows:
        print(f"{name:55s} {ops:6.2f} ops / element")
