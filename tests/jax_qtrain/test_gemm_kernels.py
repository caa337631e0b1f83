"""The ops' GEMMs on the Pallas kernels (jax_qtrain/kernels.py) against their references.

On CPU the kernels run in Mosaic GPU's interpreter (`gemm_backend("pallas")`, tiny shapes: the
interpreter is slow); on the H200 the `gpu` tests run them compiled, at larger shapes, under the
default "auto" backend. The kernels accumulate in another order, so results match to float32
rounding (relative error ≲ 1e-5 of the output norm), not bit for bit.
"""

import contextlib
import functools
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import jax_qtrain as jq
from benchmarks.h200_lowering import export_for_h200
from jax_qtrain import kernels
from tests.jax_qtrain.adversarial import adversarial_matrix

ON_GPU = any(d.platform == "gpu" for d in jax.devices())


@contextlib.contextmanager
def kernel_gemms(gpu_backend: str = "auto"):
    """The Pallas GEMMs: compiled on the GPU (under `gpu_backend`; "pallas" also takes the
    opt-in paths), interpreted on CPU (always "pallas")."""
    if ON_GPU:
        with kernels.gemm_backend(gpu_backend):
            yield
    else:
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
            with kernels.gemm_backend("pallas"):
                yield


def count_calls(monkeypatch, name, keyword_log=None):
    """Records whether each call of `kernels.<name>` ran a kernel (a bool per call); the
    calls' keyword arguments go to `keyword_log` when given."""
    calls = []
    original = getattr(kernels, name)

    @functools.wraps(original)
    def counted(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append(out is not None)
        if keyword_log is not None:
            keyword_log.append(kwargs)
        return out

    monkeypatch.setattr(kernels, name, counted)
    return calls


def assert_close(got, want, rtol=2e-5):
    """Equal up to float32 summation order; bfloat16 outputs also up to their own rounding (a
    float32 difference can flip the last bf16 bit: ≈1.5e-3 of the norm measured on the H200)."""
    for g, w in zip(got, want, strict=True):
        g32, w32 = np.asarray(g, np.float32), np.asarray(w, np.float32)
        bound = max(rtol, 5e-3) if g.dtype == jnp.bfloat16 else rtol
        assert np.isfinite(g32).all()
        assert np.linalg.norm(g32 - w32) <= bound * np.linalg.norm(w32) + 1e-30


def assert_same_bf16_results(bf16_from_kernels, rounded_after):
    """The layer's bf16 results with the kernels rounding their own output equal those with
    float32 kernel outputs rounded afterwards: bit for bit in the interpreter; on the GPU to
    `assert_close`, since the kernel's tiling may depend on its output dtype (the order of
    float32 sums)."""
    for got, want in zip(bf16_from_kernels, rounded_after, strict=True):
        assert got.dtype == want.dtype == jnp.bfloat16
    if ON_GPU:
        assert_close(bf16_from_kernels, rounded_after)
        return
    for got, want in zip(bf16_from_kernels, rounded_after, strict=True):
        np.testing.assert_array_equal(
            np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16)
        )


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


def _mosaic_result_types(module_text: str) -> list[str]:
    """The result types of every Mosaic GPU kernel call in an exported module's text."""
    types = []
    for line in module_text.splitlines():
        if "stablehlo.custom_call @mosaic_gpu" in line:
            types += re.findall(r"tensor<[^>]*>", line.rsplit("->", 1)[1])
    return types


def dense_operands(shape, seed):
    """float32 x (M, K), w (K, N) and dy (M, N) of a dense layer case of `shape` (M, K, N)."""
    m, k, n = shape
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32)
    w = jax.random.normal(kw, (k, n), jnp.float32) * 0.05
    dy = jax.random.normal(kg, (m, n), jnp.float32)
    return x, w, dy


def _dense_case(monkeypatch, shape, gpu_backend="auto"):
    x, w, dy = dense_operands(shape, seed=0)
    recipe = jq.Float8BlockScaling()
    with kernels.gemm_backend("reference"):
        want = jax.jit(dense_fwd_bwd, static_argnums=3)(x, w, dy, recipe)
    calls = count_calls(monkeypatch, "dense_fp8_block_gemm")
    wgrad_calls = count_calls(monkeypatch, "dense_fp8_block_wgrad_gemm")
    with kernel_gemms(gpu_backend):
        got = jax.jit(dense_fwd_bwd, static_argnums=3)(x, w, dy, recipe)
        on_grouped_kernel = kernels.gemm_path_enabled("fp8_block_wgrad_grouped_kernel")
    # fprop, dgrad and wgrad (two 1×128 copies, rhs_block_rows=1: the path "fp8_block_wgrad",
    # the default since stop 51; before it XLA's GEMM of their dequantized values), the wgrad
    # on the MoE wgrad kernel with one group where "fp8_block_wgrad_grouped_kernel" is on
    # (the default since stop 54).
    assert calls == [True, True] + ([] if on_grouped_kernel else [True])
    assert wgrad_calls == ([True] if on_grouped_kernel else [])
    # Hopper's FP8 wgmma accumulates with fewer bits than float32 between the kernel's
    # promotions every 128 of K: 1.3e-4 of the norm on the H200 (2026-11-29), as
    # tests/pallas_kernels/test_grouped_matmul_gpu.py bounds the kernel itself (1e-3).
    assert_close(got, want, rtol=1e-3 if ON_GPU else 2e-5)


def test_dense_fp8_block_on_the_kernel(monkeypatch):
    _dense_case(monkeypatch, (128, 128, 128))


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_backend", ["auto", "pallas"])
def test_dense_fp8_block_on_the_kernel_gpu(monkeypatch, gpu_backend):
    # 1000 tokens: wgrad's copies are padded to 1024 along its K.
    _dense_case(monkeypatch, (1000, 1024, 768), gpu_backend)


def _rounding_float32_kernel_outputs(fp8_block_kernel):
    """`gemm._fp8_block_kernel` asking the kernels for float32 and rounding afterwards."""

    def wrapped(*args, out_dtype, **kwargs):
        out = fp8_block_kernel(*args, out_dtype=jnp.float32, **kwargs)
        return None if out is None else out.astype(out_dtype)

    return wrapped


@pytest.mark.parametrize("wgrad_path", ["fp8_block_wgrad_grouped_kernel", "fp8_block_wgrad"])
def test_bf16_dense_fp8_block_layer_takes_bf16_from_the_kernels(monkeypatch, wgrad_path):
    # A bf16 layer's block-FP8 GEMMs round in the kernels' epilogue instead of writing float32
    # for XLA to round in another pass (ops/gemm.py `_fp8_block_kernel`): in the interpreter
    # the same bits as rounding the kernels' float32 outputs.
    x, w, dy = (a.astype(jnp.bfloat16) for a in dense_operands((128, 128, 128), seed=2))
    recipe = jq.Float8BlockScaling()
    gemm = importlib.import_module("jax_qtrain.ops.gemm")
    runs = {}
    for kernel_dtype in ("as the layer asks", "float32"):
        log, wgrad_log = [], []
        with monkeypatch.context() as patch:
            if wgrad_path == "fp8_block_wgrad":  # the wgrad on the dense FP8-block kernel too
                patch.setattr(kernels, "dense_fp8_block_wgrad_gemm", lambda *a, **k: None)
            ran = count_calls(patch, "dense_fp8_block_gemm", keyword_log=log)
            ran_wgrad = count_calls(patch, "dense_fp8_block_wgrad_gemm", keyword_log=wgrad_log)
            if kernel_dtype == "float32":
                rounding = _rounding_float32_kernel_outputs(gemm._fp8_block_kernel)
                patch.setattr(gemm, "_fp8_block_kernel", rounding)
            with kernel_gemms():
                runs[kernel_dtype] = jax.jit(lambda *a: dense_fwd_bwd(*a, recipe))(x, w, dy)
        calls = zip(log + wgrad_log, ran + ran_wgrad, strict=True)
        asked = [k_["out_dtype"] for k_, ran_kernel in calls if ran_kernel]
        want_asked = jnp.bfloat16 if kernel_dtype == "as the layer asks" else jnp.float32
        assert asked == [want_asked] * 3, asked  # fprop, dgrad, wgrad
    assert_same_bf16_results(runs["as the layer asks"], runs["float32"])


def test_bf16_dense_fp8_block_layer_lowers_for_h200_as_auto_runs_it(monkeypatch):
    # What "auto" runs on a GPU (kernels.on_gpu patched), exported for an H200 from this host at
    # a layer shape of bench_dense's size (M, K, N all different): the block-FP8 fprop, dgrad
    # and wgrad kernels lower with the configs that shape gets, and each writes its bf16 result
    # itself (y, dx, dW), no float32 one.
    rows, features, out_features = 8192, 4096, 3072
    monkeypatch.setattr(kernels, "on_gpu", lambda: True)
    spec = jax.ShapeDtypeStruct
    exported = export_for_h200(
        lambda x, w, dy: dense_fwd_bwd(x, w, dy, jq.Float8BlockScaling()),
        spec((rows, features), jnp.bfloat16),
        spec((features, out_features), jnp.bfloat16),
        spec((rows, out_features), jnp.bfloat16),
    )
    results = _mosaic_result_types(exported.mlir_module())
    # (dW from the MoE wgrad kernel with one group: (1, K, N).)
    for shape in ((rows, out_features), (rows, features), (1, features, out_features)):
        dims = "x".join(map(str, shape))
        assert f"tensor<{dims}xbf16>" in results and f"tensor<{dims}xf32>" not in results, shape


def exactly_summable_dense_operands(shape, seed):
    """Like `dense_operands`, but x and dy are integers in [-4, 4] times 2^e, e in [-2, 2]
    drawn per 128-token chunk and column (so each 1x128 block gets its own scale): their FP8
    block copies are exact, and every float32 sum of their products is exact in any order,
    so dW = xᵀ dy to the bit on whatever CPU runs the interpreter."""
    m, k, n = shape
    keys = jax.random.split(jax.random.key(seed), 4)
    _, w, _ = dense_operands(shape, seed)

    def operand(int_key, exponent_key, cols):
        ints = jax.random.randint(int_key, (m, cols), -4, 5).astype(jnp.float32)
        exponents = jax.random.randint(exponent_key, (-(-m // 128), cols), -2, 3)
        return ints * jnp.exp2(jnp.repeat(exponents, 128, axis=0)[:m].astype(jnp.float32))

    return operand(keys[0], keys[1], k), w, operand(keys[2], keys[3], n)


def _dense_wgrad_on_either_kernel(monkeypatch, x, w, dy):
    # The block-FP8 wgrad on the FP8 kernel (rhs_block_rows=1) and on the MoE wgrad kernel
    # with one group promote the same 128-token chunks in the same order: the same dW bits.
    recipe = jq.Float8BlockScaling()
    dw = {}
    for wgrad_kernel in ("fp8", "grouped"):
        with monkeypatch.context() as patch:
            if wgrad_kernel == "fp8":
                patch.setattr(kernels, "dense_fp8_block_wgrad_gemm", lambda *args, **kwargs: None)
            calls = count_calls(patch, "dense_fp8_block_wgrad_gemm")
            with kernel_gemms("pallas"):
                # A fresh function per run: a cached trace would not call the patched code.
                dw[wgrad_kernel] = jax.jit(lambda *args: dense_fwd_bwd(*args, recipe))(x, w, dy)[2]
            assert calls == [wgrad_kernel == "grouped"]  # (None: back to the FP8 kernel)
    np.testing.assert_array_equal(
        np.asarray(dw["fp8"]).view(np.uint32), np.asarray(dw["grouped"]).view(np.uint32)
    )
    return dw["fp8"]


def test_dense_fp8_block_wgrad_on_either_kernel(monkeypatch):
    # In the interpreter each 128-token chunk's sum is XLA:CPU's dot, whose order follows the
    # kernels' (different) tile shapes and the CPU (random operands gave the same bits on
    # one CPU, not on an AMD EPYC, 2026-12-07): exactly summable operands make the bits
    # independent of that order, and the scales still differ block by block. The order
    # itself is the GPU test's (random operands, wgmma's sums).
    x, w, dy = exactly_summable_dense_operands((256, 128, 128), seed=2)
    dw = _dense_wgrad_on_either_kernel(monkeypatch, x, w, dy)
    exact = np.asarray(x, np.float64).T @ np.asarray(dy, np.float64)
    np.testing.assert_array_equal(np.asarray(dw), exact.astype(np.float32))
    block_amaxes = np.abs(np.asarray(x)).reshape(2, 128, -1).max(axis=1)
    assert np.unique(block_amaxes).size > 1  # (the blocks' scales do differ)


@pytest.mark.gpu
def test_dense_fp8_block_wgrad_on_either_kernel_gpu(monkeypatch):
    _dense_wgrad_on_either_kernel(monkeypatch, *dense_operands((1000, 1024, 768), seed=2))


def grouped_fwd_bwd(x, w, group_sizes, dy, recipe):
    y, vjp = jax.vjp(lambda x, w: jq.grouped_dense(x, w, group_sizes, recipe=recipe), x, w)
    return (y, *vjp(dy))


GROUPED_KERNELS = {
    # recipe name -> (recipe, adapters expected to run: fprop, dgrad, wgrad)
    "bf16": (None, ["grouped_half_gemm", "grouped_half_gemm", "grouped_wgrad_gemm"]),
    "fp8": (
        jq.Float8CurrentScaling(),
        ["grouped_fp8_gemm", "grouped_fp8_gemm", "grouped_wgrad_gemm"],
    ),
    # wgrad: on the FP8 wgrad kernel with 1×128 token-block scales (the path
    # "fp8_block_grouped_wgrad": built in stop 51, verified on an H100 in stop 53, taken by
    # "auto" since).
    "fp8_block": (
        jq.Float8BlockScaling(),
        ["grouped_fp8_block_gemm"] * 2 + ["grouped_fp8_block_wgrad_gemm"],
    ),
    # no native kernel. Under gemm_backend("pallas") (the interpreter here), which takes the
    # paths awaiting GPU verification: fprop and dgrad with the weights dequantized in the GEMM
    # kernel, the tokens (x, dy) on the dequantize kernel, wgrad's x and dy too; on the GPU
    # ("auto") the 16-bit kernel on bf16 operands from the dequantize kernels (x and W for
    # fprop, dy and W for dgrad, x and dy for wgrad) until that path is verified.
    "mxfp8": (
        jq.MXFP8BlockScaling(),
        ["grouped_mxfp8_weights_gemm"] * 2 + ["grouped_wgrad_gemm"] + ["dequantize_bf16"] * 4
        if not ON_GPU
        else ["grouped_half_gemm", "grouped_half_gemm", "grouped_wgrad_gemm"]
        + ["dequantize_bf16"] * 6,
    ),
    # NVFP4 likewise (stop 47); its tokens' dequantization for fprop and dgrad writes the even/odd
    # column order the weights-in-registers kernel contracts in.
    "nvfp4": (
        jq.NVFP4BlockScaling(),
        ["grouped_nvfp4_weights_gemm"] * 2 + ["grouped_wgrad_gemm"] + ["dequantize_bf16"] * 4
        if not ON_GPU
        else ["grouped_half_gemm", "grouped_half_gemm", "grouped_wgrad_gemm"]
        + ["dequantize_bf16"] * 6,
    ),
}


def _grouped_case(monkeypatch, name, rows, features, group_sizes, gpu_backend="auto"):
    recipe, expected = GROUPED_KERNELS[name]
    kx, kw, kg = jax.random.split(jax.random.key(1), 3)
    groups = len(group_sizes)
    x = jax.random.normal(kx, (rows, features), jnp.bfloat16)
    w = (jax.random.normal(kw, (groups, features, features), jnp.float32) * 0.05).astype(
        jnp.bfloat16
    )
    dy = jax.random.normal(kg, (rows, features), jnp.bfloat16)
    sizes = jnp.asarray(group_sizes, jnp.int32)
    # A new function: a trace cached under other monkeypatches (the opt-in paths) is not reused.
    run = jax.jit(lambda *args: grouped_fwd_bwd(*args), static_argnums=4)
    with kernels.gemm_backend("reference"):
        want = run(x, w, sizes, dy, recipe)
    keywords = {adapter: [] for adapter in set(expected)}
    calls = {
        adapter: count_calls(monkeypatch, adapter, keywords[adapter]) for adapter in set(expected)
    }
    with kernel_gemms(gpu_backend):
        got = run(x, w, sizes, dy, recipe)
        group_scale_path = kernels.gemm_path_enabled("wgrad_group_scale")
    for adapter in set(expected):
        assert calls[adapter] == [True] * expected.count(adapter), adapter
    # fprop and dgrad read the aligned layout and write the tokens' order (no gather after
    # them): the 16-bit kernel on MXFP8 / NVFP4 values, the block-FP8 kernel on its codes.
    packed_adapter = {"mxfp8": expected[0], "nvfp4": expected[0]}.get(name)
    if name == "fp8_block":
        packed_adapter = "grouped_fp8_block_gemm"
    if packed_adapter is not None:
        packed = [kw.get("group_starts") is not None for kw in keywords[packed_adapter]]
        assert packed == [True, True]
    if name in ("nvfp4", "mxfp8") and ON_GPU:  # NVFP4's S_dec in the epilogue
        scaled = [kw.get("rhs_scale") is not None for kw in keywords["grouped_half_gemm"]]
        assert scaled == [name == "nvfp4"] * 2
    if name == "nvfp4" and not ON_GPU:  # the tokens in the kernel's order, the weights' blocks
        orders = [kw.get("column_order", "natural") for kw in keywords["dequantize_bf16"]]
        assert sorted(orders) == ["even_odd"] * 2 + ["natural"] * 2
        blocks = [kw["block_rows"] for kw in keywords["grouped_nvfp4_weights_gemm"]]
        assert blocks == [16, 16]
    if name in ("fp8", "nvfp4"):  # the per-group factors: in the wgrad kernel's epilogue?
        (wgrad,) = keywords["grouped_wgrad_gemm"]
        factors = {"fp8": 1, "nvfp4": 2}[name]  # FP8's product, NVFP4's two S_dec in turn
        if group_scale_path:
            assert wgrad["group_scale"].shape == (factors, len(group_sizes))
        else:
            assert wgrad["group_scale"] is None
    assert_close(got, want)
    assert not np.asarray(got[0], np.float32)[sum(group_sizes) :].any()  # rows past the groups


@pytest.mark.parametrize("name", sorted(GROUPED_KERNELS))
def test_grouped_dense_on_the_kernels(monkeypatch, name):
    _grouped_case(monkeypatch, name, 256, 128, [100, 0, 128])


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GROUPED_KERNELS))
def test_grouped_dense_on_the_kernels_gpu(monkeypatch, name):
    _grouped_case(monkeypatch, name, 4096, 1024, [1000, 0, 1700, 1])


@pytest.mark.parametrize("name", ["fp8", "nvfp4"])
def test_grouped_dense_on_the_kernels_without_the_wgrad_group_scale_path(monkeypatch, name):
    # "auto"'s wgrad on a GPU until the opt-in path is verified (the interpreter runs "pallas",
    # which takes it): the per-group factors applied to the kernel's float32 output.
    enabled = kernels.gemm_path_enabled
    monkeypatch.setattr(
        kernels, "gemm_path_enabled", lambda path: path != "wgrad_group_scale" and enabled(path)
    )
    _grouped_case(monkeypatch, name, 256, 128, [100, 0, 128])


def take_wgrad_group_scale(monkeypatch) -> None:
    """The opt-in path "wgrad_group_scale" taken under "auto" too."""
    opt_in = kernels._OPT_IN_GEMM_PATHS - {"wgrad_group_scale"}
    monkeypatch.setattr(kernels, "_OPT_IN_GEMM_PATHS", opt_in)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fp8", "nvfp4"])
def test_grouped_dense_with_the_wgrad_group_scale_path_gpu(monkeypatch, name):
    # Stop 69's opt-in path: the per-group factors in the wgrad kernel's epilogue, under "auto".
    take_wgrad_group_scale(monkeypatch)
    _grouped_case(monkeypatch, name, 4096, 1024, [1000, 0, 1700, 1])


@pytest.mark.gpu
def test_grouped_dense_fp8_block_wgrad_on_the_kernel_gpu(monkeypatch):
    # The block-FP8 wgrad kernel ("fp8_block_grouped_wgrad") under "pallas" too (stop 53:
    # passed on an H100 while the path was opt-in, before "auto" took it).
    _grouped_case(monkeypatch, "fp8_block", 4096, 1024, [1000, 0, 1700, 1], gpu_backend="pallas")


# What a bf16 grouped layer asks each GEMM kernel to write (fprop, dgrad, wgrad): bfloat16,
# rounded in the epilogue, where nothing is applied after the kernel (ops/gemm.py
# `kernel_out_dtype`, read by ops/grouped_gemm.py); float32 where per-group factors follow it
# (per-tensor FP8's and NVFP4's wgrad unless the opt-in path "wgrad_group_scale" has the
# kernel apply them, NVFP4's S_dec after the weights-in-registers kernel) or a bias does.
_BF16, _F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
GROUPED_KERNEL_OUTPUTS_AUTO = {  # what "auto" asks on a GPU
    "bf16": [_BF16] * 3,
    "bf16 with bias": [_F32, _BF16, _BF16],
    "fp8": [_BF16, _BF16, _F32],
    "fp8_block": [_BF16] * 3,
    "mxfp8": [_BF16] * 3,
    "nvfp4": [_BF16, _BF16, _F32],  # S_dec in the 16-bit kernel's epilogue for fprop and dgrad
}
# With the opt-in path "wgrad_group_scale" the wgrad kernel applies the per-group factors too.
WITH_WGRAD_GROUP_SCALE = {"fp8": [_BF16] * 3, "nvfp4": [_BF16] * 3}
# In the interpreter (always "pallas", which takes the opt-in paths) NVFP4's fprop and dgrad
# run on the weights-in-registers kernel, whose S_dec is applied after it.
GROUPED_KERNEL_OUTPUTS = GROUPED_KERNEL_OUTPUTS_AUTO | (
    {} if ON_GPU else {"fp8": [_BF16] * 3, "nvfp4": [_F32, _F32, _BF16]}
)


def _log_kernel_out_dtypes(monkeypatch, adapters, log: list) -> None:
    """Appends the `out_dtype` each `kernels.<adapter>` call that ran a kernel asked for."""
    for name in adapters:
        original = getattr(kernels, name)

        def logged(*args, _original=original, **kwargs):
            out = _original(*args, **kwargs)
            if out is not None:
                log.append(jnp.dtype(kwargs.get("out_dtype", jnp.float32)))
            return out

        monkeypatch.setattr(kernels, name, logged)


def _grouped_output_case(monkeypatch, name, rows, features, group_sizes, *, compare: bool):
    # A bf16 grouped layer's GEMM kernels round their own output where nothing follows them,
    # instead of writing float32 for XLA to round in another pass: in the interpreter the same
    # bits as asking every kernel for float32 (`kernel_out_dtype` patched) and rounding after.
    # Without `compare` the layer is only traced (what it asks of the kernels is decided then).
    recipe, adapters = GROUPED_KERNELS[name.removesuffix(" with bias")]
    gemm_adapters = sorted(set(adapters) - {"dequantize_bf16"})
    grouped_gemm = importlib.import_module("jax_qtrain.ops.grouped_gemm")
    groups = len(group_sizes)
    kx, kw, kg, kb = jax.random.split(jax.random.key(4), 4)
    x = jax.random.normal(kx, (rows, features), jnp.bfloat16)
    w = jax.random.normal(kw, (groups, features, features), jnp.float32) * features**-0.5
    w = w.astype(jnp.bfloat16)
    dy = jax.random.normal(kg, (rows, features), jnp.bfloat16)
    bias = jax.random.normal(kb, (groups, features), jnp.bfloat16) if "bias" in name else None
    sizes = jnp.asarray(group_sizes, jnp.int32)

    def fwd_bwd(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: jq.grouped_dense(x, w, sizes, bias, recipe=recipe), x, w)
        return (y, *vjp(dy))

    runs = {}
    for kernel_outputs in ("as the layer asks", "float32"):
        asked = []
        with monkeypatch.context() as patch:
            _log_kernel_out_dtypes(patch, gemm_adapters, asked)
            if kernel_outputs == "float32":
                patch.setattr(grouped_gemm, "kernel_out_dtype", lambda dtype: _F32)
            with kernel_gemms():
                traced_anew = lambda *a: fwd_bwd(*a)  # a new function: no cached trace
                run = (
                    jax.jit(traced_anew)
                    if compare
                    else functools.partial(jax.eval_shape, traced_anew)
                )
                runs[kernel_outputs] = run(x, w, dy)
        want_asked = GROUPED_KERNEL_OUTPUTS[name] if kernel_outputs != "float32" else [_F32] * 3
        assert asked == want_asked, (kernel_outputs, asked)
    if not compare:
        return
    assert_same_bf16_results(runs["as the layer asks"], runs["float32"])


@pytest.mark.parametrize("name", sorted(GROUPED_KERNEL_OUTPUTS))
def test_bf16_grouped_layer_takes_bf16_from_the_kernels(monkeypatch, name):
    # Bits compared for the 16-bit kernels and the block-FP8 ones (the interpreter is slow);
    # every recipe's requests checked.
    compare = name in ("bf16", "fp8_block")
    _grouped_output_case(monkeypatch, name, 256, 128, [100, 0, 128], compare=compare)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GROUPED_KERNEL_OUTPUTS))
def test_bf16_grouped_layer_takes_bf16_from_the_kernels_gpu(monkeypatch, name):
    _grouped_output_case(monkeypatch, name, 4096, 1024, [1000, 0, 1700, 1], compare=True)


# bench_moe's "8 experts" FC1 (grouped_output_ab's shape): tokens, in and out features, experts.
MOE_FC1_SHAPE = (16384, 4096, 3584, 8)


@pytest.mark.parametrize(
    ("name", "wgrad_group_scale"),
    [(name, False) for name in sorted(GROUPED_KERNEL_OUTPUTS_AUTO)]
    + [(name, True) for name in sorted(WITH_WGRAD_GROUP_SCALE)],
)
def test_bf16_grouped_layer_lowers_for_h200_as_auto_runs_it(monkeypatch, name, wgrad_group_scale):
    # What "auto" runs on a GPU (kernels.on_gpu patched: the quantize kernels and the GEMM
    # kernels, not the opt-in paths but "wgrad_group_scale" where asked), exported for an H200
    # from this host at a real MoE shape: every Mosaic GPU kernel of the layer's forward and
    # backward lowers with the configs its shapes and output dtypes get (the interpreter's tiny
    # shapes pick others), and y, dx and dW come out of the fprop, dgrad and wgrad kernels in
    # the dtypes the layer asks for.
    recipe = GROUPED_KERNELS[name.removesuffix(" with bias")][0]
    tokens, features, out_features, experts = MOE_FC1_SHAPE
    monkeypatch.setattr(kernels, "on_gpu", lambda: True)
    kernel_outputs = GROUPED_KERNEL_OUTPUTS_AUTO[name]
    if wgrad_group_scale:
        take_wgrad_group_scale(monkeypatch)
        kernel_outputs = WITH_WGRAD_GROUP_SCALE[name]

    def fwd_bwd(x, w, sizes, dy, bias):
        y, vjp = jax.vjp(lambda x, w: jq.grouped_dense(x, w, sizes, bias, recipe=recipe), x, w)
        return (y, *vjp(dy))

    spec = jax.ShapeDtypeStruct
    bias = spec((experts, out_features), jnp.bfloat16) if "bias" in name else None
    exported = export_for_h200(
        fwd_bwd,
        spec((tokens, features), jnp.bfloat16),
        spec((experts, features, out_features), jnp.bfloat16),
        spec((experts,), jnp.int32),
        spec((tokens, out_features), jnp.bfloat16),
        bias,
    )
    results = _mosaic_result_types(exported.mlir_module())
    shapes = ((tokens, out_features), (tokens, features), (experts, features, out_features))
    for shape, dtype in zip(shapes, kernel_outputs, strict=True):
        dims = "x".join(map(str, shape))
        want = f"tensor<{dims}x{'bf16' if dtype == _BF16 else 'f32'}>"
        assert want in results, (shape, dtype, sorted(set(results)))
        other = f"tensor<{dims}x{'f32' if dtype == _BF16 else 'bf16'}>"
        assert other not in results, (shape, dtype)


def _auto_and_pallas_moe(monkeypatch, recipe, adapter: str):
    """(y, dx, dw) of the MoE layer under gemm_backend "auto" and under "pallas" (which takes
    the opt-in weights-in-registers paths), and whether each `kernels.<adapter>` call ran."""
    kx, kw, kg = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (4096, 1024), jnp.bfloat16)
    w = (jax.random.normal(kw, (3, 1024, 768), jnp.float32) * 0.05).astype(jnp.bfloat16)
    dy = jax.random.normal(kg, (4096, 768), jnp.bfloat16)
    sizes = jnp.asarray([1000, 0, 1700], jnp.int32)
    run = jax.jit(grouped_fwd_bwd, static_argnums=4)
    with kernels.gemm_backend("auto"):
        want = run(x, w, sizes, dy, recipe)
    calls = count_calls(monkeypatch, adapter)
    with kernels.gemm_backend("pallas"):
        got = run(x, w, sizes, dy, recipe)
    return want, got, calls


@pytest.mark.gpu
def test_gpu_mxfp8_weights_in_registers_give_the_dequantize_path_bits(monkeypatch):
    # The check (passed on an H100, 2026-12-05) that "mxfp8_weights_in_registers" computes
    # what the default path does: the MoE layer's y, dx and dw under "pallas" (fprop and
    # dgrad with the weights dequantized in the GEMM kernel) equal those under "auto" (the
    # 16-bit kernel on dequantized weights) bit for bit: the same k16 products, same order.
    want, got, calls = _auto_and_pallas_moe(
        monkeypatch, jq.MXFP8BlockScaling(), "grouped_mxfp8_weights_gemm"
    )
    assert calls == [True, True]  # fprop and dgrad
    for g, w_ in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w_))


@pytest.mark.gpu
def test_gpu_nvfp4_weights_in_registers_match_the_dequantize_path(monkeypatch):
    # The check (passed on an H100, 2026-12-05) that "nvfp4_weights_in_registers" computes
    # what the default path does: the MoE layer's y, dx and dw under "pallas" (fprop and
    # dgrad with the weights dequantized in the GEMM kernel, the tokens in its even/odd order)
    # against "auto" (the 16-bit kernel on dequantized operands): the same products summed in
    # another order, so float32 rounding apart (dw is the same path in both).
    want, got, calls = _auto_and_pallas_moe(
        monkeypatch, jq.NVFP4BlockScaling(), "grouped_nvfp4_weights_gemm"
    )
    assert calls == [True, True]  # fprop and dgrad
    assert_close(got, want)
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))


def test_public_grouped_matmul_pallas_option():
    kx, kw = jax.random.split(jax.random.key(2))
    x = jax.random.normal(kx, (192, 128), jnp.bfloat16)
    w = jax.random.normal(kw, (2, 128, 128), jnp.bfloat16)
    sizes = jnp.array([70, 100], jnp.int32)
    want = jq.grouped_matmul(x, w, sizes, out_dtype=jnp.float32, backend="reference")
    interpret = (
        contextlib.nullcontext()
        if ON_GPU
        else plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams())
    )
    with interpret:
        got = jq.grouped_matmul(x, w, sizes, out_dtype=jnp.float32, backend="pallas")
    assert_close((got,), (want,))
    assert not np.asarray(got)[170:].any()


def _dequantize_case(rows: int, cols: int, experts: int, seed: int):
    """kernels.dequantize_bf16 against the reference's exact operands (ops/grouped_gemm.py), bit
    for bit: MXFP8 and NVFP4 activations (2-D) and experts' weights (3-D, NVFP4 in 16×16 blocks),
    both copies, from adversarial values (zeros, ±Inf / NaN blocks, maxima near powers of two)."""
    from jax_qtrain.ops import grouped_gemm
    from jax_qtrain.ops.grouped_quantize import token_alignment

    x = jnp.asarray(adversarial_matrix(rows, cols, seed, block=32), jnp.bfloat16)
    stacked = jnp.stack([jnp.roll(x, 17 * e, axis=0) for e in range(experts)])
    for recipe in (jq.MXFP8BlockScaling(), jq.NVFP4BlockScaling()):
        sizes = jnp.asarray([rows - 40, 40], jnp.int32)  # padded apart to the token block
        layout = jq.group_layout(sizes, rows, token_alignment(recipe))
        activations = jq.grouped_quantize(x, recipe, "input", layout, rowwise=True, columnwise=True)
        weights = jq.quantize_per_expert(stacked, recipe, rowwise=True, columnwise=True)
        for usage in ("rowwise", "columnwise"):
            for spec, (data, scale_inv, amax) in (
                (activations.spec, activations.copy(usage)),
                (
                    weights.spec,
                    tuple(getattr(weights, f"{usage}_{p}") for p in ("data", "scale_inv", "amax")),
                ),
            ):
                if data.ndim == 3:
                    want = jax.vmap(
                        functools.partial(
                            lambda sp, d, s, a: grouped_gemm._exact_operand(sp, d, s, a)[0], spec
                        )
                    )(data, scale_inv, amax)
                else:
                    want = grouped_gemm._exact_operand(spec, data, scale_inv, amax)[0]
                with kernel_gemms():
                    got = jax.jit(kernels.dequantize_bf16, static_argnums=0)(spec, data, scale_inv)
                assert got is not None and got.dtype == jnp.bfloat16, spec.describe()
                # Bits equal, except NaN payloads: the reference's depend on the backend (XLA
                # rounds float32 NaN to bfloat16 0x7FFF on the H200, 0x7FC0 on the CPU).
                got32, want32 = np.asarray(got, np.float32), np.asarray(want, np.float32)
                np.testing.assert_array_equal(np.isnan(got32), np.isnan(want32))
                finite = ~np.isnan(want32)
                np.testing.assert_array_equal(
                    np.asarray(got).view(np.uint16)[finite],
                    np.asarray(want).view(np.uint16)[finite],
                    err_msg=f"{spec.describe()} {usage} {data.shape}",
                )


def test_dequantize_kernels_give_the_exact_operands():
    _dequantize_case(128, 128, 2, seed=3)


@pytest.mark.gpu
def test_dequantize_kernels_give_the_exact_operands_gpu():
    _dequantize_case(1024, 768, 3, seed=4)


def test_dequantize_bf16_declines_what_no_kernel_covers():
    x = jax.random.normal(jax.random.key(5), (128, 128), jnp.bfloat16)
    q = jq.quantize(x, jq.Float8BlockScaling(), "input", rowwise=True, columnwise=False)
    assert kernels.dequantize_bf16(q.spec, q.rowwise_data, q.rowwise_scale_inv) is None
