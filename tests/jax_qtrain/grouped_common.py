"""Helpers shared by the test_grouped_*.py modules (not collected: no test_ prefix)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_qtrain as jq
from jax_qtrain.formats import common

from .gpu_compare import ON_GPU, bits

RECIPES = {
    "fp8": jq.Float8CurrentScaling(),
    "fp8_block": jq.Float8BlockScaling(),
    "mxfp8": jq.MXFP8BlockScaling(),
    "nvfp4": jq.NVFP4BlockScaling(),
}
MODES = [None, "high_precision", "dequantized"]


def assert_bits_equal(got, want, what: str = "") -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype)
    np.testing.assert_array_equal(bits(got), bits(want), err_msg=what)


def assert_equal_up_to_summation_order(got, want, what: str = "") -> None:
    """For results of *different* GEMM implementations over the same products: grouped ragged
    GEMMs vs one dense GEMM per expert, or vs JAX's autodiff of ragged_dot.

    They are not bit-identical in general: XLA:CPU lowers lax.ragged_dot to a dot that
    contracts over (K, groups) at once, the GPU may pick other GEMM algorithms, and both can sum
    the float32 products in another order than a plain dot. Each element may then differ by the
    float32 rounding of its sum; after the cast to the output dtype that is at most one unit in
    its last place (eps·|want|), plus a float32-sized absolute slack where the sum cancels.
    Quantized operands have few significant bits, so their sums are usually exact and the
    results identical; asserted: ≥ 99% of the elements bit-equal on the CPU (90% on the GPU).
    On the GPU a per-tensor FP8 GEMM runs on cuBLASLt, whose FP8 tensor-core sums keep fewer
    bits than float32 between promotions (1.3e-4 of the norm at K=4096 on the H200, even at
    Precision.HIGHEST): the absolute slack there is 2^-10 of the largest element.
    """
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype)
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    eps = float(jnp.finfo(got.dtype).eps)
    slack = 2.0 ** (-10 if ON_GPU else -16) * float(np.max(np.abs(w), initial=0.0))
    excess = np.abs(g - w) - (eps * np.abs(w) + slack)
    assert np.all(excess <= 0), (what, float(np.max(excess)))
    assert np.mean(bits(got) == bits(want)) >= (0.9 if ON_GPU else 0.99), what


def reference_ragged_dot(lhs, rhs, group_sizes, dimension_numbers=None):
    """What the grouped GEMM reference computes (ops/grouped_gemm.py), written out for the
    tests: ragged_dot with float32 accumulation, 16-bit operands widened to float32 first off
    the GPU (XLA:CPU's bfloat16 ragged_dot sums in a group-count-dependent order on some
    hosts), as they are on it (widening does not make XLA:GPU's ragged_dot group-count
    independent either, stop 42; the GPU's kernels are)."""
    if jnp.dtype(lhs.dtype).itemsize < 4 and not ON_GPU:
        lhs, rhs = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
    if dimension_numbers is None:
        return lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    return lax.ragged_dot_general(
        lhs, rhs, group_sizes, dimension_numbers, preferred_element_type=jnp.float32
    )


def group_slices(sizes) -> list[slice]:
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return [slice(int(s), int(s + n)) for s, n in zip(starts, sizes, strict=True)]


def padded_rows(num_rows: int, num_groups: int, align: int) -> int:
    """The aligned layout's row count (docs/layers.md), written out independently."""
    return math.ceil((num_rows + num_groups * (align - 1)) / align) * align


def copy_bytes(spec, rows: int, cols: int, batch: int = 1, per_tensor: int = 1) -> int:
    """Bytes of one stored copy of a (rows, cols) tensor (blocks along cols), from the table in
    docs/design/layouts.md; `batch` stacked copies; `per_tensor` FP8 scales / NVFP4 amaxes."""
    if spec.format == "fp8":
        return batch * rows * cols + 4 * per_tensor
    block_rows, block_cols = spec.block_shape
    rows_p, cols_p = common.round_up(rows, block_rows), common.round_up(cols, block_cols)
    blocks = (rows_p // block_rows) * (cols_p // block_cols)
    if spec.format == "fp8_block":
        return batch * (rows_p * cols_p + 4 * blocks)
    if spec.format == "mxfp8":
        return batch * (rows_p * cols_p + blocks)
    return batch * (rows_p * cols_p // 2 + blocks) + 4 * per_tensor  # nvfp4


def residual_bytes_by_name(residuals) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in residuals:
        out[r.name] = out.get(r.name, 0) + r.nbytes
    return out
