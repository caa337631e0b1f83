"""The dense/override tests again, on the H200 (`python3 -m pytest -m gpu`).

XLA:GPU can erase fake-quant round trips that the CPU keeps and fuses differently, so every
bit-exact assertion of test_dense.py is repeated there; `test_modes_differ_where_they_should`
checks that "dequantized" really differs from "high_precision" on the GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_qtrain as jq

from .test_dense import *  # noqa: F403  (re-collect every test under the gpu marker)

pytestmark = [pytest.mark.gpu, pytest.mark.reference_gemms]  # see tests/conftest.py


def test_gpu_unquantized_gemms_round_a_float32_accumulator_once():
    # The unquantized layer's bf16 GEMMs return bf16 from the GEMM (ops/dense.py
    # `_high_precision_dot`); on the GPU that must still be one rounding of a float32
    # accumulation, as the float32 product rounded afterwards is: within half a bf16 ulp of the
    # float32 result, plus the float32 summation error of either order. A sum kept in bf16 over
    # K = 4096 would be off by many ulps.
    kx, kw, kg = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (2048, 4096), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (4096, 1536), jnp.float32) * 4096**-0.5).astype(jnp.bfloat16)
    dy = jax.random.normal(kg, (2048, 1536), jnp.float32).astype(jnp.bfloat16)

    @jax.jit
    def layer(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: jq.dense(x, w), x, w)
        return (y, *vjp(dy))

    highest = dict(precision="highest", preferred_element_type=jnp.float32)
    x32, w32, dy32 = (a.astype(jnp.float32) for a in (x, w, dy))
    pairs = {
        "y": (x32, w32),
        "dx": (dy32, w32.T),
        "dw": (x32.T, dy32),
    }
    for name, got in zip(pairs, layer(x, w, dy), strict=True):
        a, b = pairs[name]
        exact = np.asarray(jnp.dot(a, b, **highest))
        magnitude = np.asarray(jnp.dot(jnp.abs(a), jnp.abs(b), **highest))
        half_ulp = np.abs(exact) * 2.0**-8  # bf16: 8 significant bits
        bound = half_ulp + magnitude * a.shape[1] * 2.0**-24 + 1e-30
        error = np.abs(np.asarray(got, np.float32) - exact)
        assert got.dtype == jnp.bfloat16
        assert np.all(error <= bound), (name, float(np.max(error / bound)))
