"""`python -m jax_qtrain demo`: quantize real arrays in every format; print error and bytes.

The arrays need no download: a byte-bigram statistics matrix built from the Python standard
library's own source files (real, heavy-tailed data), and a Flax-initialised weight matrix.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax_qtrain.quantize import quantize
from jax_qtrain.recipes import (
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

DEMO_RECIPES = (
    Float8CurrentScaling(),
    Float8BlockScaling(),
    MXFP8BlockScaling(),
    NVFP4BlockScaling(),
)


def stdlib_bigram_matrix(max_files: int = 200) -> np.ndarray:
    """log(1 + count) of each byte pair in the first `max_files` stdlib .py files (sorted), centred:
    a deterministic 256x256 float32 array drawn from real text."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    counts = np.zeros((256, 256), np.float64)
    for path in sorted(stdlib.glob("*.py"))[:max_files]:
        data = np.frombuffer(path.read_bytes(), np.uint8)
        np.add.at(counts, (data[:-1], data[1:]), 1)
    logs = np.log1p(counts)
    return (logs - logs.mean()).astype(np.float32)


def relative_error(approx: jax.Array, exact: jax.Array) -> float:
    exact = exact.astype(jnp.float32)
    return float(jnp.linalg.norm(approx.astype(jnp.float32) - exact) / jnp.linalg.norm(exact))


def run_demo() -> list[dict]:
    """Quantize each array with each recipe; return one row per (array, recipe)."""
    import flax.nnx as nnx

    weight = nnx.Linear(1024, 1024, rngs=nnx.Rngs(0)).kernel.value
    arrays = {
        "stdlib bigrams 256x256 (input)": (jnp.asarray(stdlib_bigram_matrix()), "input"),
        "Linear kernel 1024x1024 (weight)": (weight.astype(jnp.bfloat16), "weight"),
    }
    rows = []
    for label, (array, role) in arrays.items():
        for recipe in DEMO_RECIPES:
            q = quantize(array, recipe, role, rowwise=True, columnwise=True)
            row_only = q.restrict_to("rowwise")
            rows.append(
                {
                    "array": label,
                    "format": q.spec.describe(),
                    "rowwise_error": relative_error(q.dequantize("rowwise"), array),
                    "columnwise_error": relative_error(q.dequantize("columnwise"), array),
                    "bytes_per_element_rowwise": row_only.nbytes / array.size,
                    "bytes_per_element_both": q.nbytes / array.size,
                    "source_bytes_per_element": array.dtype.itemsize,
                }
            )
    return rows


def main() -> int:
    rows = run_demo()
    print(f"jax_qtrain demo on {jax.default_backend()} (relative error = ‖dq(q(x)) - x‖ / ‖x‖)")
    header = (
        f"{'array':34} {'format':28} {'err row':>8} {'err col':>8} {'B/el row':>8} {'B/el both':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['array']:34} {r['format']:28} {r['rowwise_error']:8.4f} "
            f"{r['columnwise_error']:8.4f} {r['bytes_per_element_rowwise']:8.3f} "
            f"{r['bytes_per_element_both']:9.3f}"
        )
    return 0
