"""GEMM-ready ("tiles") block scales: `quantize(..., scale_layout="tiles")`, the layout's
definition, the tensor's accessors, the kernels writing it as they compute it, and the dense
layer's block-FP8 GEMM reading it (docs/design/layouts.md, "GEMM-ready scales")."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import jax_qtrain as jq
import pallas_kernels as pk
from jax_qtrain import kernels
from jax_qtrain.formats import common
from jax_qtrain.ops import gemm
from tests.jax_qtrain.adversarial import adversarial_matrix
from tests.jax_qtrain.test_gemm_kernels import (
    count_calls,
    dense_fwd_bwd,
    dense_operands,
    kernel_gemms,
)

# The module (jax_qtrain.ops exports its `dense` function under the same name).
dense_ops = importlib.import_module("jax_qtrain.ops.dense")

ON_GPU = any(d.platform == "gpu" for d in jax.devices())

# The specs with per-line block scales that fill 128-wide tiles.
TILED = {
    "mxfp8": (jq.MXFP8BlockScaling(), "input"),
    "mxfp8_e5m2": (jq.MXFP8BlockScaling(fp8_format="hybrid"), "grad"),
    "fp8_block": (jq.Float8BlockScaling(), "input"),
    "fp8_block_fp32_scales": (jq.Float8BlockScaling(power_2_scale=False), "grad"),
}


def bits(a) -> np.ndarray:
    return np.atleast_1d(np.asarray(a)).view(np.uint8)


def assert_same_bits(got, want) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(bits(g), bits(w))


def sample(shape, seed, dtype=jnp.bfloat16):
    return jnp.asarray(adversarial_matrix(*shape, seed, block=32)).astype(dtype)


def test_tiles_layout_definition():
    # tiled[t, line, b] is the scale of block t·per_tile + b of `line`; leading dims are kept.
    lines = np.arange(3 * 5 * 8, dtype=np.int32).reshape(3, 5, 8)
    tiled = np.asarray(common.tile_scales(jnp.asarray(lines), 4))
    assert tiled.shape == (3, 2, 5, 4)
    for e, t, line, b in np.ndindex(tiled.shape):
        assert tiled[e, t, line, b] == lines[e, line, 4 * t + b]
    np.testing.assert_array_equal(np.asarray(common.untile_scales(jnp.asarray(tiled))), lines)
    assert common.scale_blocks_per_tile(32) == 4 and common.scale_blocks_per_tile(128) == 1
    with pytest.raises(ValueError, match="not a whole number of 4-block tiles"):
        common.tile_scales(jnp.zeros((2, 6)), 4)


@pytest.mark.parametrize("name", TILED)
def test_tiles_hold_the_line_scales_of_the_same_codes(name):
    recipe, role = TILED[name]
    x = sample((256, 384), 1)
    lines = jq.quantize(x, recipe, role, columnwise=True, backend="reference")
    tiles = jq.quantize(x, recipe, role, columnwise=True, backend="reference", scale_layout="tiles")
    assert (lines.scale_layout, tiles.scale_layout) == ("lines", "tiles")
    per_tile = 4 if recipe.spec(role).format == "mxfp8" else 1
    assert tiles.rowwise_scale_inv.shape == (384 // 128, 256, per_tile)  # (tiles, lines, blocks)
    assert tiles.columnwise_scale_inv.shape == (256 // 128, 384, per_tile)
    for usage in ("rowwise", "columnwise"):
        np.testing.assert_array_equal(
            bits(getattr(tiles, f"{usage}_data")), bits(getattr(lines, f"{usage}_data"))
        )
        np.testing.assert_array_equal(
            bits(tiles.line_scale_inv(usage)), bits(lines.line_scale_inv(usage))
        )
        np.testing.assert_array_equal(bits(tiles.dequantize(usage)), bits(lines.dequantize(usage)))
    assert_same_bits(tiles.with_scale_layout("lines"), lines)
    assert_same_bits(lines.with_scale_layout("tiles"), tiles)
    assert tiles.nbytes == lines.nbytes
    assert "scale_layout='tiles'" in repr(tiles) and "scale_layout" not in repr(lines)


def test_tiles_layout_survives_pytrees_jit_and_views():
    recipe, role = TILED["mxfp8"]
    x = sample((128, 256), 2)
    q = jq.quantize(x, recipe, role, columnwise=True, scale_layout="tiles")
    through_jit = jax.jit(lambda t: t)(q)
    assert through_jit.scale_layout == "tiles"
    assert_same_bits(through_jit, q)
    rowwise = q.restrict_to("rowwise")
    assert rowwise.scale_layout == "tiles" and rowwise.usages == ("rowwise",)
    with pytest.raises(ValueError, match="holds only"):
        rowwise.line_scale_inv("columnwise")


def test_tiles_layout_errors_name_the_argument():
    x = jnp.ones((128, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="scale_layout must be one of"):
        jq.quantize(x, jq.MXFP8BlockScaling(), scale_layout="swizzled")
    with pytest.raises(ValueError, match="only MXFP8 and FP8 block 1×128"):
        jq.quantize(x, jq.NVFP4BlockScaling(), scale_layout="tiles")
    with pytest.raises(ValueError, match="only MXFP8 and FP8 block 1×128"):
        jq.quantize(x, jq.Float8BlockScaling(), "weight", scale_layout="tiles")  # 128×128
    with pytest.raises(ValueError, match=r"whole 128×128 tiles, got \(96, 256\)"):
        jq.quantize(jnp.ones((2, 48, 256)), jq.MXFP8BlockScaling(), scale_layout="tiles")
    q = jq.quantize(x, jq.NVFP4BlockScaling())
    with pytest.raises(ValueError, match="only MXFP8 and FP8 block 1×128"):
        q.with_scale_layout("tiles")
    with pytest.raises(ValueError, match="scale_layout='tiles' needs x of whole 128×128"):
        pk.quantize_mxfp8(jnp.ones((64, 128), jnp.bfloat16), scale_layout="tiles")
    with pytest.raises(ValueError, match="scale_layout='tiles' is for 1×128 blocks"):
        pk.quantize_fp8_block(x, block_shape=(128, 128), scale_layout="tiles")


@pytest.mark.skipif(ON_GPU, reason="the interpreter path is the CPU's")
@pytest.mark.parametrize("name", ["mxfp8", "fp8_block"])
def test_kernels_write_the_tiles_layout_in_interpreter(name):
    recipe, role = TILED[name]
    x = sample((256, 256), 3)
    want = jq.quantize(x, recipe, role, columnwise=True, backend="reference", scale_layout="tiles")
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        got = jq.quantize(x, recipe, role, columnwise=True, backend="pallas", scale_layout="tiles")
    assert_same_bits(got, want)


@pytest.mark.skipif(ON_GPU, reason="the interpreter path is the CPU's")
def test_configs_whose_output_is_not_the_tiles_layout_are_rearranged():
    # Line-major kernel scales (tile_major_scales=False), and 256-wide tiles (8 MXFP8 blocks a
    # tile): the wrapper rearranges them into 128-wide tiles.
    x = sample((256, 256), 4)
    want = jq.quantize(x, jq.MXFP8BlockScaling(), columnwise=True, scale_layout="tiles")
    for config in (
        pk.MXFP8QuantizeConfig(tile_major_scales=False),
        pk.MXFP8QuantizeConfig(tile_k=256),
    ):
        got = pk.quantize_mxfp8(
            x, columnwise=True, config=config, interpret=True, scale_layout="tiles"
        )
        np.testing.assert_array_equal(bits(got.rowwise_scale), bits(want.rowwise_scale_inv))
        np.testing.assert_array_equal(bits(got.columnwise_scale), bits(want.columnwise_scale_inv))


def test_grouped_fp8_block_kernel_takes_k_major_lhs_scales():
    q = jq.quantize(sample((128, 256), 5), jq.Float8BlockScaling(), scale_layout="tiles")
    w = jq.quantize(sample((128, 256), 6), jq.Float8BlockScaling(), "weight")
    k_major = q.rowwise_scale_inv[..., 0]  # (K/128, M)
    assert k_major.shape == (2, 128)
    with pytest.raises(ValueError, match=r"lhs_scale must have shape \(2, 128\)"):
        pk.dense_matmul_fp8_block(
            q.rowwise_data, k_major.T, w.rowwise_data, w.rowwise_scale_inv, lhs_scale_k_major=True
        )
    with pytest.raises(TypeError, match="lhs_scale_k_major must be a bool"):
        pk.grouped_matmul_fp8_block(
            q.rowwise_data,
            k_major,
            w.rowwise_data[None],
            w.rowwise_scale_inv[None],
            jnp.array([128], jnp.int32),
            lhs_scale_k_major="yes",
        )


def _dense_layouts(monkeypatch, shape, wgrad_kernel="fp8"):
    """The dense layer's outputs and gradients with its block-FP8 GEMM lhs quantized in the
    "tiles" layout (the default where the kernel reads it) and, forced, in "lines"; the
    keyword arguments the FP8 GEMM kernel got in each run. `wgrad_kernel`: "fp8" keeps the
    wgrad on that kernel (the path "fp8_block_wgrad" before stop 54), "grouped" takes the
    path "fp8_block_wgrad_grouped_kernel" (the MoE wgrad kernel, one group: line scales)."""
    x, w, dy = dense_operands(shape, seed=1)
    recipe = jq.Float8BlockScaling()
    runs = {}
    for layout in ("tiles", "lines"):
        with monkeypatch.context() as patch:
            if layout == "lines":
                patch.setattr(gemm, "lhs_scale_layout", lambda *args: "lines")
                patch.setattr(dense_ops, "lhs_scale_layout", lambda *args: "lines")
            if wgrad_kernel == "fp8":
                patch.setattr(kernels, "dense_fp8_block_wgrad_gemm", lambda *args, **kwargs: None)
            log = []
            count_calls(patch, "dense_fp8_block_gemm", keyword_log=log)
            with kernel_gemms(), kernels.gemm_backend("pallas"):
                # A fresh function per run: a cached trace would not call the patched code.
                out = jax.jit(lambda *args: dense_fwd_bwd(*args, recipe))(x, w, dy)
            runs[layout] = (out, [kw_.get("lhs_scale_k_major", False) for kw_ in log])
    return runs


def _check_dense_layouts(monkeypatch, shape, wgrad_kernel="fp8"):
    runs = _dense_layouts(monkeypatch, shape, wgrad_kernel)
    (tiled_out, tiled_k_major), (lines_out, lines_k_major) = runs["tiles"], runs["lines"]
    # fprop (x), dgrad (dy) and wgrad (x's columnwise copy against dy's, the kernel path
    # "fp8_block_wgrad", the default since stop 51) read the tiles as written; on the MoE
    # wgrad kernel the wgrad takes line scales, so only fprop and dgrad reach the FP8 kernel.
    calls = 3 if wgrad_kernel == "fp8" else 2
    assert tiled_k_major == [True] * calls
    assert lines_k_major == [False] * calls
    # The same scale values reach the same kernel: the same bits.
    for got, want in zip(tiled_out, lines_out, strict=True):
        np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("wgrad_kernel", ["fp8", "grouped"])
def test_dense_block_fp8_gemm_reads_tiled_scales(monkeypatch, wgrad_kernel):
    assert dense_ops.lhs_scale_layout is gemm.lhs_scale_layout
    _check_dense_layouts(monkeypatch, (128, 128, 128), wgrad_kernel)


def test_lhs_scale_layout_picks_tiles_only_where_the_kernel_reads_them(monkeypatch):
    block, bf16 = jq.Float8BlockScaling(), jnp.bfloat16
    mxfp8 = jq.MXFP8BlockScaling()
    with kernels.gemm_backend("pallas"):
        assert gemm.lhs_scale_layout(block, "input", (256, 128), bf16) == "tiles"
        assert gemm.lhs_scale_layout(block, "grad", (256, 384), bf16) == "tiles"
        assert gemm.lhs_scale_layout(block, "input", (200, 128), bf16) == "lines"  # partial tiles
        assert (
            gemm.lhs_scale_layout(
                jq.Float8BlockScaling(w_block_scaling_dim=1), "input", (256, 128), bf16
            )
            == "lines"
        )  # no kernel for 1×128 weights
    with kernels.gemm_backend("reference"):
        assert gemm.lhs_scale_layout(block, "input", (256, 128), bf16) == "lines"
    # MXFP8: tiles where the quantize kernel writes them (on the GPU), whatever the GEMMs run.
    assert gemm.lhs_scale_layout(mxfp8, "input", (256, 128), bf16) == (
        "tiles" if kernels.on_gpu() else "lines"
    )
    monkeypatch.setattr(kernels, "on_gpu", lambda: True)  # the kernel's other conditions hold
    assert gemm.lhs_scale_layout(mxfp8, "input", (256, 128), bf16) == "tiles"
    assert gemm.lhs_scale_layout(mxfp8, "grad", (128, 384), jnp.float32) == "tiles"
    assert gemm.lhs_scale_layout(mxfp8, "input", (256, 96), bf16) == "lines"  # partial tiles
    assert gemm.lhs_scale_layout(mxfp8, "input", (256, 128), jnp.float16) == "lines"  # no kernel
    assert gemm.lhs_scale_layout(jq.NVFP4BlockScaling(), "input", (256, 128), bf16) == "lines"


def _check_mxfp8_dense_layouts(monkeypatch, shape):
    """The MXFP8 dense layer's outputs and gradients with x and dy quantized in each layout
    (forced): the same codes and scale values reach the dequantizing GEMMs, so the same bits."""
    m, k, n = shape
    kx, kw, kg = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) * 0.05).astype(jnp.bfloat16)
    dy = jax.random.normal(kg, (m, n), jnp.float32).astype(jnp.bfloat16)
    recipe = jq.MXFP8BlockScaling()
    runs = {}
    for layout in ("tiles", "lines"):
        with monkeypatch.context() as patch:
            patch.setattr(dense_ops, "lhs_scale_layout", lambda *args, layout=layout: layout)
            seen = {}

            def logged(value, recipe, role, *args, seen=seen, quantize=dense_ops.quantize, **kw):
                seen[role] = kw.get("scale_layout", "lines")
                return quantize(value, recipe, role, *args, **kw)

            patch.setattr(dense_ops, "quantize", logged)
            runs[layout] = jax.jit(lambda *args: dense_fwd_bwd(*args, recipe))(x, w, dy)
        assert seen == {"input": layout, "weight": "lines", "grad": layout}, seen
    for got, want in zip(runs["tiles"], runs["lines"], strict=True):
        np.testing.assert_array_equal(bits(got), bits(want))


def test_mxfp8_dense_layer_gives_the_same_bits_in_either_layout(monkeypatch):
    _check_mxfp8_dense_layouts(monkeypatch, (128, 256, 128))


@pytest.mark.gpu
@pytest.mark.parametrize("name", TILED)
def test_gpu_kernels_write_the_tiles_layout(name):
    recipe, role = TILED[name]
    for dtype in (jnp.bfloat16, jnp.float32):
        x = sample((1024, 1536), 7, dtype)

        def run(backend, layout, x=x):
            return jq.quantize(
                x, recipe, role, columnwise=True, backend=backend, scale_layout=layout
            )

        tiles = run("pallas", "tiles")
        assert_same_bits(tiles, run("reference", "tiles"))
        assert_same_bits(tiles.with_scale_layout("lines"), run("pallas", "lines"))


@pytest.mark.gpu
@pytest.mark.parametrize("wgrad_kernel", ["fp8", "grouped"])
def test_gpu_dense_block_fp8_gemm_reads_tiled_scales(monkeypatch, wgrad_kernel):
    _check_dense_layouts(monkeypatch, (1024, 1024, 768), wgrad_kernel)


@pytest.mark.gpu
def test_gpu_mxfp8_dense_layer_gives_the_same_bits_in_either_layout(monkeypatch):
    # On the GPU the layer quantizes x and dy in tiles by default (the kernel writes them).
    assert (
        dense_ops.lhs_scale_layout(jq.MXFP8BlockScaling(), "input", (1024, 1024), jnp.bfloat16)
        == "tiles"
    )
    _check_mxfp8_dense_layouts(monkeypatch, (1024, 1024, 768))
