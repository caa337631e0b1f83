"""Per-tensor FP8 GEMMs at `Precision.HIGHEST` accumulate like float32 on the H200, in a plain
and in a vmapped program alike (docs/design/gemm_accumulation.md).

`ops/gemm.py::matmul_nt` asks XLA for the split accumulator by `HIGHEST`; on 2026-11-29 that
held for plain and vmapped programs (3e-9 of the norm at K = 64, against 8e-5 for a vmapped
program at `DEFAULT`). On 2026-11-30 `test_jit_grad_vmap[None-fp8]` saw a vmapped and a plain
FP8 gradient differ by up to 4.4e-3 on values near 10, with contractions of 32 and 64, which
float32 summation order cannot explain. These tests measure each program against the exact
product of the same codes, so a run says which program lost bits (XLA autotunes each program's
GEMM, cuBLASLt or Triton, from timings).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_qtrain as jq
from jax_qtrain.ops.gemm import matmul_nt

pytestmark = pytest.mark.gpu

BATCH = 3


def operands(m, k, n, a_format, seed=0):
    """A batch of quantized (m, k) and (n, k) operands: per-tensor FP8, the recipe's formats."""
    ka, kb = jax.random.split(jax.random.key(seed))
    a = jax.random.normal(ka, (BATCH, m, k), jnp.float32)
    b = jax.random.normal(kb, (BATCH, n, k), jnp.float32)
    recipe = jq.Float8CurrentScaling(fp8_format="hybrid")
    role = "grad" if a_format == "e5m2" else "input"  # hybrid: E5M2 gradients, E4M3 otherwise
    qa = jax.vmap(lambda v: jq.quantize(v, recipe, role, rowwise=True, columnwise=False))(a)
    qb = jax.vmap(lambda v: jq.quantize(v, recipe, "weight", rowwise=True, columnwise=False))(b)
    return qa, qb


def exact_products(qa, qb):
    """float64 products of the dequantized codes (every product and sum exact enough)."""
    values = jax.vmap(lambda q: q.dequantize("rowwise", jnp.float32))
    a, b = (np.asarray(values(q), np.float64) for q in (qa, qb))
    return np.einsum("bmk,bnk->bmn", a, b)


def one(q, i):
    """Member i of a batch of quantized tensors."""
    return jax.tree.map(lambda leaf: leaf[i], q)


# (m, k, n, bound on the relative error). Measured on 2026-11-29 (gemm_accumulation.md): at
# K = 64, HIGHEST 3.1e-9 plain and vmapped, DEFAULT 7.9e-5 vmapped; at K = 4096 HIGHEST 1.3e-4
# (FP8 tensor-core sums keep fewer bits than float32 between promotions), DEFAULT 8.5e-4 plain
# and 1.3e-3 vmapped. (32, 32, 64) is test_jit_grad_vmap's dgrad.
SHAPES = [(32, 64, 32, 1e-6), (32, 32, 64, 1e-6), (1024, 4096, 1024, 4e-4)]


@pytest.mark.parametrize("m, k, n, bound", SHAPES)
@pytest.mark.parametrize("a_format", ["e4m3", "e5m2"])
def test_fp8_gemm_at_highest_sums_like_float32_plain_and_vmapped(m, k, n, bound, a_format):
    qa, qb = operands(m, k, n, a_format)
    gemm = lambda a, b: matmul_nt(a, "rowwise", b, "rowwise", rows=m, cols=n)
    plain = np.stack(
        [np.asarray(jax.jit(gemm)(one(qa, i), one(qb, i)), np.float64) for i in range(BATCH)]
    )
    vmapped = np.asarray(jax.jit(jax.vmap(gemm))(qa, qb), np.float64)
    exact = exact_products(qa, qb)
    for name, got in (("plain", plain), ("vmapped", vmapped)):
        error = np.linalg.norm(got - exact) / np.linalg.norm(exact)
        assert error < bound, f"{name} program: relative error {error:.2e}"
