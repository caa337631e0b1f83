"""Comparing two differently compiled programs that compute the same thing (not collected).

On the CPU they are bit-identical, and the suites assert exactly that. On the H200 they need not
be (seen 2026-11-29, docs/design/gemm_accumulation.md): XLA autotunes each GEMM's algorithm per
program and fuses differently, so float32 sums run in other orders (up to ~60 ulps seen in
float32 gradients, one ulp in bfloat16 outputs), and an intermediate that moves by one ulp before
a quantizer can move a scale, and with it every code that scale governs. The GPU bounds below
(relative Frobenius norm) say how far apart two such programs may be; a wrong residual, a
missing quantization or a transposed operand lands far outside them.

JAX_QTRAIN_STRICT_GPU=1 asserts bit-identity on the GPU as well (for trying XLA flags that make
GPU programs deterministic).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

ON_GPU = jax.default_backend() == "gpu"
STRICT = not ON_GPU or os.environ.get("JAX_QTRAIN_STRICT_GPU") == "1"

SUMMATION = 1e-5  # float32 sums in another order
REQUANTIZATION = 5e-2  # a quantizer downstream of such a sum: up to the format's step (E4M3 1/16)


def requantization_rtol(recipe_name: str) -> float:
    """REQUANTIZATION, or for NVFP4 0.25: E2M1 steps are 1/3 to 1/2 of a value near a block's
    top, and one NVFP4 quantization of N(0, 1) data is 0.08-0.2 off in norm (test_quantize_gpu)."""
    return 0.25 if recipe_name == "nvfp4" else REQUANTIZATION


def bits(a) -> np.ndarray:
    """A bit view of an array (uint of the same width) for exact comparisons (NaN, -0)."""
    a = np.asarray(a)
    return a.view(np.uint8 if a.dtype.itemsize == 1 else f"u{a.dtype.itemsize}")


def assert_same_result(got, want, *, gpu_rtol: float = SUMMATION, what: str = "") -> None:
    """Pytrees `got` and `want`: same structure, dtypes and shapes; every leaf bit-identical on
    the CPU. On the GPU, floating leaves of 16 bits or more within `gpu_rtol` of each other in
    relative norm (at least their own dtype's epsilon: a float32 difference can flip the last
    bit of a bfloat16 output); narrow leaves (FP8 codes, packed FP4, E8M0 scales) and integers
    still bit-identical."""
    leaves_got, tree_got = jax.tree_util.tree_flatten(got)
    leaves_want, tree_want = jax.tree_util.tree_flatten(want)
    assert tree_got == tree_want, what
    for u, v in zip(leaves_got, leaves_want, strict=True):
        assert u.dtype == v.dtype and u.shape == v.shape, (what, u.dtype, v.dtype, u.shape, v.shape)
        wide_float = jnp.issubdtype(u.dtype, jnp.floating) and jnp.dtype(u.dtype).itemsize >= 2
        if STRICT or not wide_float:
            np.testing.assert_array_equal(bits(u), bits(v), err_msg=what)
            continue
        u32, v32 = np.asarray(u, np.float32), np.asarray(v, np.float32)
        np.testing.assert_array_equal(np.isfinite(u32), np.isfinite(v32), err_msg=what)
        finite = np.isfinite(v32)
        bound = max(gpu_rtol, float(jnp.finfo(u.dtype).eps))
        error = np.linalg.norm(u32[finite] - v32[finite])
        assert error <= bound * np.linalg.norm(v32[finite]) + 1e-30, (what, error, bound)
