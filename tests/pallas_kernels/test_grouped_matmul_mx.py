"""MXFP8 grouped GEMM with in-kernel dequantization (issue 5): interpreter, cross-lowering, bad
inputs. The GPU tests are in test_grouped_matmul_gpu.py.

The reference dequantizes exactly as jax_qtrain does (float32 code · 2^(byte − 127), byte 0xFF
→ NaN), rounds to bfloat16 (the kernel's wgmma operands) and multiplies in float64; the kernel
accumulates those exact products in float32, so f32 outputs agree to ~1e-5 of max |ref|.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul_mx import DEFAULT_MXFP8_CONFIG, grouped_matmul_mxfp8
from tests.pallas_kernels.test_grouped_matmul import (
    BF16,
    E4M3,
    E5M2,
    TINY_FWD,
    _lower_for_h200,
    assert_close,
    keys,
    random_fp8,
    ref_ragged_rows,
)

TINY_MX = TINY_FWD  # the forward kernels' tiny tiles: tile_k=64 is one MX step


def random_mxfp8(key, shape, dtype, low: int = 117, high: int = 137):
    """FP8 codes and E8M0 scale bytes in [low, high) for each 1x32 block along the last axis."""
    k_codes, k_scale = jax.random.split(key)
    codes = random_fp8(k_codes, shape, dtype)
    scale_shape = (*shape[:-1], shape[-1] // 32)
    scale = jax.random.randint(k_scale, scale_shape, low, high, jnp.int32).astype(jnp.uint8)
    return codes, scale


def dequant_mxfp8_bf16(codes, scale) -> np.ndarray:
    """The kernel's wgmma operands: bf16(code · 2^(byte − 127)), NaN for byte 0xFF, as float64."""
    scale = np.asarray(scale).astype(np.int64)
    factor = np.where(scale == 255, np.nan, np.ldexp(1.0, scale - 127))
    values = np.asarray(jnp.asarray(codes).astype(jnp.float32), np.float64)
    values = values * np.repeat(factor, 32, axis=-1)
    return np.asarray(jnp.asarray(values, jnp.float32).astype(BF16).astype(jnp.float32), np.float64)


def run(lhs, lhs_scale, rhs, rhs_scale, sizes, **kwargs):
    kwargs.setdefault("config", TINY_MX)
    return grouped_matmul_mxfp8(
        lhs, lhs_scale, rhs, rhs_scale, jnp.asarray(sizes, jnp.int32), interpret=True, **kwargs
    )


@pytest.mark.parametrize("wgmma_in_flight", [0, 1])
@pytest.mark.parametrize(
    "sizes, rows, k, cols",
    [
        ([37, 0, 90], 160, 128, 128),  # empty group, straddled tiles, 33 tail rows
        ([0, 100, 0], 100, 96, 72),  # K = 3 MX blocks (a padded step); partial column tile
    ],
)
def test_mxfp8_forward_matches_the_dequantized_reference(wgmma_in_flight, sizes, rows, k, cols):
    k_lhs, k_rhs = keys(2, seed=30)
    lhs, lhs_scale = random_mxfp8(k_lhs, (rows, k), E4M3)
    rhs, rhs_scale = random_mxfp8(k_rhs, (len(sizes), cols, k), E5M2)
    config = dataclasses.replace(TINY_MX, wgmma_in_flight=wgmma_in_flight)
    out = run(lhs, lhs_scale, rhs, rhs_scale, sizes, out_dtype=jnp.float32, config=config)
    want = ref_ragged_rows(
        dequant_mxfp8_bf16(lhs, lhs_scale), dequant_mxfp8_bf16(rhs, rhs_scale), sizes
    )
    assert_close(out, want, rel=1e-5)
    assert np.all(np.asarray(out)[sum(sizes) :] == 0)


def test_mxfp8_edge_scales_bf16_out():
    # Scale bytes 0 (2^-127, applied as 2^-63 · 2^-64: values below bf16's normal range round
    # like the reference's), 254 (2^127) next to tiny codes, and a NaN-marking 0xFF block,
    # whose row gets NaN outputs while the other rows stay finite.
    k_lhs, k_rhs = keys(2, seed=31)
    lhs, lhs_scale = random_mxfp8(k_lhs, (64, 64), E4M3)
    rhs, rhs_scale = random_mxfp8(k_rhs, (1, 64, 64), E4M3)
    # (lhs's second blocks scaled down so that the 2^127 column's sums stay finite)
    lhs_scale = lhs_scale.at[:, 1].set(100)
    lhs_scale = lhs_scale.at[0, 0].set(0).at[1, 1].set(1).at[2, :].set(0)
    rhs_scale = rhs_scale.at[0, 5, 1].set(254).at[0, 6, 0].set(0)
    rhs = rhs.at[0, 5, 32:].set(jnp.asarray(2.0**-9, E4M3))  # 2^-9 · 2^127: large, finite
    lhs = lhs.at[3, :32].set(jnp.asarray(2.0**-9, E4M3))  # smallest subnormal code
    lhs_scale = lhs_scale.at[3, 0].set(200)
    lhs_scale = lhs_scale.at[10, 1].set(255)
    config = dataclasses.replace(TINY_MX, epi_tile_n=64)
    out = np.asarray(run(lhs, lhs_scale, rhs, rhs_scale, [64], out_dtype=BF16, config=config))
    a, b = dequant_mxfp8_bf16(lhs, lhs_scale), dequant_mxfp8_bf16(rhs, rhs_scale)
    assert np.isnan(out[10]).all() and not np.isnan(np.delete(out, 10, axis=0)).any()
    finite = np.ones(64, bool)
    finite[10] = False
    want = a[finite] @ b[0].T
    assert_close(out[finite], want, rel=2**-8)


def test_mxfp8_default_config_fits_both_out_dtypes():
    k_lhs, k_rhs = keys(2, seed=32)
    lhs, lhs_scale = random_mxfp8(k_lhs, (128, 64), E4M3)
    rhs, rhs_scale = random_mxfp8(k_rhs, (2, 256, 64), E4M3)
    small = dict(num_sms=1, grid_tile_width=1)
    for out_dtype in (BF16, jnp.float32):
        out = run(
            lhs,
            lhs_scale,
            rhs,
            rhs_scale,
            [100, 28],
            out_dtype=out_dtype,
            config=dataclasses.replace(DEFAULT_MXFP8_CONFIG, **small)
            if out_dtype == BF16
            else None,
        )
        want = ref_ragged_rows(
            dequant_mxfp8_bf16(lhs, lhs_scale), dequant_mxfp8_bf16(rhs, rhs_scale), [100, 28]
        )
        assert_close(out, want, rel=1e-5 if out_dtype == jnp.float32 else 2**-8)


S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("wgmma_in_flight, lhs_in_registers", [(0, False), (1, False), (0, True)])
@pytest.mark.parametrize("out_dtype", [BF16, jnp.float32])
def test_mxfp8_cross_lowers_for_h200(wgmma_in_flight, out_dtype, lhs_in_registers):
    # (lhs_in_registers=True is checked here and on the GPU only: the interpreter has no
    # register-operand wgmma.)
    g, m, k, n = 8, 16384, 4096, 4096
    config = None
    if wgmma_in_flight:
        config = dataclasses.replace(
            DEFAULT_MXFP8_CONFIG,
            wgmma_in_flight=1,
            max_concurrent_steps=2,
            epi_tile_n=128 // jnp.dtype(out_dtype).itemsize,
            epilogue_buffers=1,
        )
    text = _lower_for_h200(
        lambda a, sa, b, sb, s: grouped_matmul_mxfp8(
            a, sa, b, sb, s, out_dtype=out_dtype, config=config, lhs_in_registers=lhs_in_registers
        ),
        S((m, k), E4M3),
        S((m, k // 32), jnp.uint8),
        S((g, n, k), E4M3),
        S((g, n, k // 32), jnp.uint8),
        S((g,), jnp.int32),
    )
    assert "grouped_matmul_mxfp8" in text


def _operands():
    lhs, lhs_scale = random_mxfp8(keys(1, seed=33)[0], (64, 64), E4M3)
    rhs, rhs_scale = random_mxfp8(keys(1, seed=34)[0], (2, 64, 64), E4M3)
    return lhs, lhs_scale, rhs, rhs_scale, jnp.asarray([32, 32], jnp.int32)


@pytest.mark.parametrize(
    "change, error, needle",
    [
        (lambda a: a | {"lhs": a["lhs"].astype(BF16)}, TypeError, "lhs must have dtype"),
        (lambda a: a | {"lhs_scale": a["lhs_scale"].astype(jnp.int32)}, TypeError, "lhs_scale"),
        (lambda a: a | {"rhs_scale": a["rhs_scale"][:, :, :1]}, ValueError, "rhs_scale"),
        (
            lambda a: a | {"lhs": a["lhs"][:, :32], "lhs_scale": a["lhs_scale"][:, :1]},
            ValueError,
            "rhs contraction",
        ),
        (lambda a: a | {"sizes": jnp.asarray([1, 2, 3], jnp.int32)}, ValueError, "group_sizes"),
    ],
)
def test_mxfp8_bad_inputs_raise_naming_the_argument(change, error, needle):
    names = ("lhs", "lhs_scale", "rhs", "rhs_scale", "sizes")
    args = change(dict(zip(names, _operands(), strict=True)))
    with pytest.raises(error, match=needle):
        grouped_matmul_mxfp8(*(args[name] for name in names), interpret=True, config=TINY_MX)


@pytest.mark.parametrize(
    ("changes", "one_group", "needle"),
    [
        # Its scale streams are not declared multicastable (RowKernelParts.column_specs),
        # even for one group.
        (dict(cluster_m=2), True, "does not support cluster_m=2"),
        # Not built for it: its RowKernelParts give no accumulate / finish (the in-kernel
        # MXFP8 path is not a default; the library dequantizes and runs the 16-bit kernel).
        (dict(stream_k=True), False, "does not support stream_k"),
        # Its K steps convert each consumer's rhs columns for the whole tile's rows.
        (
            dict(tile_m=192, consumer_split="m", num_consumers=3),
            False,
            "grouped_matmul_mxfp8 needs consumer_split='n'",
        ),
    ],
)
def test_mxfp8_kernel_refuses_options_it_is_not_built_for(changes, one_group, needle):
    lhs, lhs_scale, rhs, rhs_scale, sizes = _operands()
    if one_group:
        rhs, rhs_scale, sizes = rhs[:1], rhs_scale[:1], jnp.asarray([64], jnp.int32)
    with pytest.raises(ValueError, match=needle):
        grouped_matmul_mxfp8(
            lhs,
            lhs_scale,
            rhs,
            rhs_scale,
            sizes,
            out_dtype=jnp.float32,
            config=dataclasses.replace(TINY_MX, **changes),
            interpret=True,
        )


def test_mxfp8_k_must_be_whole_blocks_and_config_checked():
    lhs, lhs_scale, rhs, rhs_scale, sizes = _operands()
    with pytest.raises(ValueError, match="multiple of 32"):
        grouped_matmul_mxfp8(
            lhs[:, :40], lhs_scale[:, :1], rhs[:, :, :40], rhs_scale[:, :, :1], sizes
        )
    with pytest.raises(ValueError, match="tile_k=64"):
        grouped_matmul_mxfp8(
            lhs, lhs_scale, rhs, rhs_scale, sizes, config=dataclasses.replace(TINY_MX, tile_k=128)
        )
    with pytest.raises(ValueError, match="shared memory"):
        grouped_matmul_mxfp8(
            lhs,
            lhs_scale,
            rhs,
            rhs_scale,
            sizes,
            config=dataclasses.replace(DEFAULT_MXFP8_CONFIG, max_concurrent_steps=8),
        )
    with pytest.raises(ValueError, match="lhs_in_registers=True needs wgmma_in_flight=0"):
        grouped_matmul_mxfp8(
            lhs,
            lhs_scale,
            rhs,
            rhs_scale,
            sizes,
            out_dtype=jnp.float32,
            config=dataclasses.replace(TINY_MX, wgmma_in_flight=1),
            lhs_in_registers=True,
        )
    with pytest.raises(TypeError, match="lhs_in_registers must be a bool"):
        grouped_matmul_mxfp8(lhs, lhs_scale, rhs, rhs_scale, sizes, lhs_in_registers="yes")
    with pytest.raises(ValueError, match="dequant_arithmetic must be one of"):
        grouped_matmul_mxfp8(lhs, lhs_scale, rhs, rhs_scale, sizes, dequant_arithmetic="f16")
    with pytest.raises(ValueError, match="dequant_layout must be one of"):
        grouped_matmul_mxfp8(lhs, lhs_scale, rhs, rhs_scale, sizes, dequant_layout="rows")
    with pytest.raises(TypeError, match="config must be a GroupedMatmulConfig"):
        grouped_matmul_mxfp8(lhs, lhs_scale, rhs, rhs_scale, sizes, config={"tile_m": 64})
