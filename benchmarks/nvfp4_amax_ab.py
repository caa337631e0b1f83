"""NVFP4's global-amax kernel (`pk.nvfp4_amax`): its two designs and their sizes against XLA's
max|x|, timed in alternation.

    PYTHONPATH=. python3 benchmarks/nvfp4_amax_ab.py OUT_DIR [--small]

NVFP4 reads x twice: once for the global amaxes (this kernel), once to quantize. Stop 32's
kernel (one TMA tile per CTA through shared memory) read at ~3.0 TB/s while XLA's `max(abs(x))`
read the same bytes at 4.2 TB/s; stop 33 streamed tiles through a TMA pipeline (no gain) and
then loaded x straight from global memory into registers (`amax_direct_loads`, the default).
The candidates: the TMA kernel, the direct kernel with its default sizes, and the direct kernel
at other load widths and CTA counts (`_direct_amax_partials`' `vector` / `ctas`). Before
timing, each candidate's two amaxes are compared bit for bit with the TMA kernel's on the timed
input and on ones with an Inf and a NaN; a candidate that differs or fails is not timed.
Effective TB/s = bytes of x / time. Bf16 inputs, with and without the Hadamard transform; CUPTI
device times in alternation (`benchmarks.timing.cupti_interleaved_seconds`: the host clock
measured launch overhead as much as these ~35 µs kernels, and XLA's max|x| at 2.1-2.6 TB/s
instead of CUPTI's 4.2). Writes OUT_DIR/nvfp4_amax_ab.{json,md}. `--small`: small shapes (on
the GPU; where there is none, a tiny shape in Mosaic GPU's interpreter, a smoke test whose
times mean nothing).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_kernels as pk
from benchmarks.timing import (
    cupti_interleaved_seconds,
    device_description,
    kernel_timing_setup,
    report,
)

SHAPES = ((8192, 8192), (16384, 4096))
SMALL_SHAPES = ((2048, 2048), (4096, 1024))
INTERPRETED_SHAPES = ((64, 1024),)
BASELINE = "TMA tile per CTA"
DEFAULT = "direct loads (default)"
# Direct-load sizes besides the default: (bytes per thread and load, CTAs).
DIRECT_SIZES = ((16, 1024), (8, 512), (8, 1024), (4, 1024))


def candidates_for(hadamard: bool) -> dict[str, Callable]:
    """name -> jitted x -> (rowwise amax, columnwise amax)."""
    direct_module = importlib.import_module("pallas_kernels.quantize_nvfp4")

    def public(config):
        return jax.jit(lambda v: pk.nvfp4_amax(v, hadamard_columnwise=hadamard, config=config))

    def direct(load_bytes, ctas):
        def amaxes(v):
            partial = direct_module._direct_amax_partials(
                v, hadamard, False, ctas=ctas, vector=load_bytes // v.dtype.itemsize
            )
            amax = lax.bitcast_convert_type(jnp.max(partial, axis=0), jnp.float32)
            return amax[0], amax[1]

        return jax.jit(amaxes)

    out = {
        BASELINE: public(pk.NVFP4QuantizeConfig(amax_direct_loads=False)),
        DEFAULT: public(pk.NVFP4QuantizeConfig()),
    }
    for load_bytes, ctas in DIRECT_SIZES:
        out[f"direct, {load_bytes}-byte loads, {ctas} CTAs"] = direct(load_bytes, ctas)
    return out


XLA_AMAX = "XLA max|x| (the read floor)"


def with_special_blocks(x: jax.Array) -> jax.Array:
    """x with an Inf in one 16-row block and a NaN in another (amax propagates NaN)."""
    x = x.at[3, 5].set(jnp.inf)
    return x.at[x.shape[0] - 20, x.shape[1] - 7].set(jnp.nan)


def run_shape(shape: tuple[int, int], timing: dict) -> list[dict]:
    rows, cols = shape
    keys = jax.random.split(jax.random.key(2), 2)
    # Two inputs, alternated, so a call doesn't find the previous call's x in L2.
    inputs = [jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16) for k in keys]
    checks = [inputs[0], inputs[0].at[3, 5].set(jnp.inf), with_special_blocks(inputs[0])]
    out = []
    for hadamard in (True, False):
        candidates = {}
        functions = candidates_for(hadamard)
        want = [jax.device_get(functions[BASELINE](x)) for x in checks]
        for name, fn in functions.items():
            row = dict(shape=f"{rows}x{cols}", hadamard=hadamard, variant=name)
            try:
                got = [jax.device_get(fn(x)) for x in checks]
                same = all(
                    np.asarray(g).view(np.uint32) == np.asarray(w).view(np.uint32)
                    for gs, ws in zip(got, want, strict=True)
                    for g, w in zip(gs, ws, strict=True)
                )
                row["bits"] = (
                    "baseline" if name == BASELINE else ("identical" if same else "DIFFERENT")
                )
            except Exception as err:  # report and keep going: one variant must not hide the rest
                row["bits"] = f"FAILED: {type(err).__name__}: {str(err)[:300]}"
            if row["bits"] in ("baseline", "identical"):
                candidates[name] = (fn, [(x,) for x in inputs])
            out.append(row)
        xla = jax.jit(lambda v: jnp.max(jnp.abs(v)))
        candidates[XLA_AMAX] = (xla, [(x,) for x in inputs])
        out.append(dict(shape=f"{rows}x{cols}", hadamard=hadamard, variant=XLA_AMAX, bits="—"))
        seconds = cupti_interleaved_seconds(candidates, **timing)
        for row in out:
            if row["hadamard"] != hadamard or "us" in row:
                continue
            s = seconds.get(row["variant"])
            row["us"] = None if s is None else s * 1e6
            row["tb_s"] = None if s is None else 2 * rows * cols / s / 1e12
            row["vs_baseline"] = None if s is None else seconds[BASELINE] / s
            print(
                f"  {row['shape']} hadamard={hadamard!s:5} {row['variant']:48s} "
                + (f"{row['us']:7.1f} us {row['tb_s']:5.2f} TB/s " if s else "  (not timed) ")
                + row["bits"],
                flush=True,
            )
    return out


def format_table(rows: list[dict], device: str) -> str:
    lines = [
        f"# NVFP4 global amax (`nvfp4_amax`), variants in alternation — {device}",
        "",
        "| shape | Hadamard | variant | µs | TB/s (x read once) | vs TMA kernel | bits |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        timed = r.get("us") is not None
        lines.append(
            f"| {r['shape']} | {r['hadamard']} | {r['variant']} | "
            + (
                f"{r['us']:.1f} | {r['tb_s']:.2f} | {r['vs_baseline']:.3f}"
                if timed
                else "— | — | —"
            )
            + f" | {r['bits']} |"
        )
    return "\n".join(lines) + "\n"


def main(out_dir: str | None = None, *, small: bool = False) -> str:
    shapes, timing, context = kernel_timing_setup(
        "nvfp4_amax_ab.py", small, SHAPES, SMALL_SHAPES, INTERPRETED_SHAPES
    )
    timing = dict(
        rounds=timing.get("rounds", 10),
        iterations=timing.get("calls_per_batch", 10),
        compile_first=timing.get("compile_first", True),
    )
    rows: list[dict] = []
    with context:
        for shape in shapes:
            rows += run_shape(shape, timing)
    return report(out_dir, "nvfp4_amax_ab", rows, format_table(rows, device_description()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?")
    parser.add_argument("--small", action="store_true")
    args = parser.parse_args()
    main(args.out_dir, small=args.small)
