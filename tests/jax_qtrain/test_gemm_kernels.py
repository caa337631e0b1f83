"""The ops' GEMMs on the Pallas kernels (jax_qtrain/kernels.py) against their references.

On CPU the kernels run in Mosaic GPU's interpreter (`gemm_backend("pallas")`, tiny shapes: the
interpreter is slow); on the H200 the `gpu` tests run them compiled, at larger shapes, under the
default "auto" backend. The kernels accumulate in another order, so results match to float32
rounding (relative error ≲ 1e-5 of the output norm), not bit for bit.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import jax_qtrain as jq
from jax_qtrain import kernels

ON_GPU = any(d.platform == "gpu" for d in jax.devices())


@contextlib.contextmanager
def kernel_gemms():
    """The Pallas GEMMs: compiled on the GPU, interpreted on CPU."""
    if ON_GPU:
        with kernels.gemm_backend("auto"):
            yield
    else:
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
            with kernels.gemm_backend("pallas"):
                yield


def count_calls(monkeypatch, name):
    calls = []
    original = getattr(kernels, name)

    @functools.wraps(original)
    def counted(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(kernels, name, counted)
    return calls


def assert_close(got, want, rtol=2e-5):
    for g, w in zip(got, want, strict=True):
        g32, w32 = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.isfinite(g32).all()
        assert np.linalg.norm(g32 - w32) <= rtol * np.linalg.norm(w32) + 1e-30


def dense_fwd_bwd(x, w, dy, recipe):
    y, vjp = jax.vjp(lambda x, w: jq.dense(x, w, recipe=recipe), x, w)
    return (y, *vjp(dy))


def test_gemm_backend_setting():
    with kernels.gemm_backend("reference"):
        assert not kernels.gemm_kernels_enabled()
    with kernels.gemm_backend("pallas"):
        assert kernels.gemm_kernels_enabled()
    assert kernels.gemm_kernels_enabled() == ON_GPU
    with pytest.raises(ValueError, match="gemm backend"):
        with kernels.gemm_backend("cublas"):
            pass


def _dense_case(monkeypatch, shape):
    m, k, n = shape
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32)
    w = jax.random.normal(kw, (k, n), jnp.float32) * 0.05
    dy = jax.random.normal(kg, (m, n), jnp.float32)
    recipe = jq.Float8BlockScaling()
    with kernels.gemm_backend("reference"):
        want = jax.jit(dense_fwd_bwd, static_argnums=3)(x, w, dy, recipe)
    calls = count_calls(monkeypatch, "dense_fp8_block_gemm")
    with kernel_gemms():
        got = jax.jit(dense_fwd_bwd, static_argnums=3)(x, w, dy, recipe)
    assert calls == [True, True]  # fprop and dgrad; wgrad (1×128 · 1×128) stays on the reference
    assert_close(got, want)


def test_dense_fp8_block_on_the_kernel(monkeypatch):
    _dense_case(monkeypatch, (128, 128, 128))


@pytest.mark.gpu
def test_dense_fp8_block_on_the_kernel_gpu(monkeypatch):
    _dense_case(monkeypatch, (1000, 1024, 768))
