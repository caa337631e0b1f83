"""Quantize / dequantize kernels (pallas_kernels, issue 4) against the jnp references, bit for bit.

- CPU: the kernels run in Mosaic GPU's interpreter on small shapes (a few tiles; unwritten
  outputs come back NaN / 0xFF there, so they cannot pass), and every kernel × option is
  cross-lowered for an H200 (Pallas → Mosaic GPU → LLVM-level IR) to catch lowering errors.
- GPU (`-m gpu`, the H200): large random and adversarial inputs, outputs landing in memory that
  was filled with 0xFF just before the call, compared with the references run on the GPU and on
  the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from benchmarks.h200_lowering import export_for_h200
from jax_qtrain.formats import common, fp8_block, fp8_tensor, mxfp8, nvfp4
from jax_qtrain.formats.spec import QuantizerSpec
from jax_qtrain.quantize import columnwise_source
from pallas_kernels import quantize_common as qc
from pallas_kernels import untile_scales

from ..jax_qtrain.adversarial import adversarial_matrix

E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
FLT_MAX = float(np.finfo(np.float32).max)
ON_GPU = any(d.platform == "gpu" for d in jax.devices())
INTERPRET = not ON_GPU


def bits(a) -> np.ndarray:
    """Bit pattern of any array (uint8/16/32 view), for NaN- and -0-exact comparisons."""
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_same_bits(got, want, what: str, *, any_nan: bool = False) -> None:
    """Bit-exact equality. `any_nan`: for float values (dequantized outputs), every NaN equals
    every other NaN (XLA and the kernel may produce different NaN payloads; the payload is not
    part of a float's value)."""
    got_b, want_b = bits(got), bits(want)
    assert got_b.shape == want_b.shape, f"{what}: shape {got_b.shape} != {want_b.shape}"
    differ = got_b != want_b
    if any_nan:
        differ &= ~(np.isnan(np.asarray(got, np.float32)) & np.isnan(np.asarray(want, np.float32)))
    bad = np.argwhere(differ)
    assert bad.size == 0, (
        f"{what}: {len(bad)} of {got_b.size} differ; first at {tuple(bad[0])}: "
        f"got {got_b[tuple(bad[0])]:#x}, want {want_b[tuple(bad[0])]:#x}"
    )


def sample(shape, dtype, seed, *, block=32, adversarial=True, subnormals=False):
    if adversarial:
        x = adversarial_matrix(*shape, seed, block=block, subnormals=subnormals)
    else:
        x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 3
    return jnp.asarray(x).astype(dtype)


# --- references --------------------------------------------------------------------------------
def ref_mxfp8(x, fp8_dtype):
    spec = QuantizerSpec("mxfp8", fp8_dtype, (1, 32))
    f = jax.jit(lambda v: (*mxfp8.quantize(v, spec), *mxfp8.quantize(v.T, spec)))
    return f(x)


def ref_nvfp4(x, *, rht, sr, seeds, block=(1, 16), positions=(None, None)):
    """The jnp reference; `positions`: each copy's (line, col) in a larger tensor, or None."""
    spec = QuantizerSpec(
        "nvfp4", jnp.float4_e2m1fn, block, hadamard_columnwise=rht, stochastic_rounding=sr
    )
    # The reference subtracts an origin from the positions it hashes; a position adds.
    origins = [None if p is None else (-p[0], -p[1]) for p in positions]

    def f(v):
        col = columnwise_source(v, spec)
        row_amax, col_amax = common.amax(v), common.amax(col)
        rd, rs = nvfp4.quantize(v, spec, global_amax=row_amax, seed=seeds[0], origin=origins[0])
        cd, cs = nvfp4.quantize(col, spec, global_amax=col_amax, seed=seeds[1], origin=origins[1])
        return (rd, rs, cd, cs), (row_amax, col_amax)

    return jax.jit(f)(x)


def ref_fp8_block(x, fp8_dtype, block, pow2, eps=0.0):
    spec = QuantizerSpec("fp8_block", fp8_dtype, block, power_2_scale=pow2, amax_epsilon=eps)
    q = lambda v: fp8_block.quantize(v, spec, input_dtype=x.dtype)
    return jax.jit(lambda v: (*q(v), *q(v.T)))(x)


def run_mxfp8(x, fp8_dtype, **kw):
    return jax.jit(
        lambda v: pk.quantize_mxfp8(
            v, rowwise=True, columnwise=True, fp8_dtype=fp8_dtype, interpret=INTERPRET, **kw
        )
    )(x)


def run_nvfp4(x, *, rht, sr, amaxes, seeds, positions=(None, None), **kw):
    return jax.jit(
        lambda v: pk.quantize_nvfp4(
            v,
            rowwise=True,
            columnwise=True,
            rowwise_amax=amaxes[0],
            columnwise_amax=amaxes[1],
            hadamard_columnwise=rht,
            stochastic_rounding=sr,
            rowwise_seed=seeds[0],
            columnwise_seed=seeds[1],
            rowwise_position=positions[0],
            columnwise_position=positions[1],
            interpret=INTERPRET,
            **kw,
        )
    )(x)


def run_fp8_block(x, fp8_dtype, block, pow2, **kw):
    return jax.jit(
        lambda v: pk.quantize_fp8_block(
            v,
            block_shape=block,
            rowwise=True,
            columnwise=True,
            fp8_dtype=fp8_dtype,
            power_2_scale=pow2,
            interpret=INTERPRET,
            **kw,
        )
    )(x)


def scaled_sample(shape, dtype, seed):
    """Already-scaled FP8 inputs: values across and past the FP8 range (each row its own power
    of two), ties, NaN of both signs, ±Inf, subnormals."""
    x = sample(shape, jnp.float32, seed, block=32, subnormals=True)
    x = x * jnp.exp2(jnp.arange(shape[0], dtype=jnp.float32) % 40 - 20)[:, None]
    x = x.at[0, :8].set(jnp.array([448, 464, 480, 57344, 61440, 0.5 * 2.0**-9, -0.0, 1e-45]))
    x = x.at[1, :4].set(jnp.array([jnp.nan, -jnp.nan, jnp.inf, -jnp.inf]))
    return x.astype(dtype)


def check_cast_transpose(x, fp8_dtype, config=None):
    want = common.saturating_cast(x.astype(jnp.float32), fp8_dtype)
    got = jax.jit(
        lambda v: pk.cast_transpose_fp8(
            v, columnwise=True, fp8_dtype=fp8_dtype, config=config, interpret=INTERPRET
        )
    )(x)
    assert_same_bits(got.rowwise_data, want, "cast-transpose rowwise")
    assert_same_bits(got.columnwise_data, want.T, "cast-transpose columnwise")
    only_columnwise = pk.cast_transpose_fp8(
        x, rowwise=False, columnwise=True, fp8_dtype=fp8_dtype, config=config, interpret=INTERPRET
    )
    assert only_columnwise.rowwise_data is None
    assert_same_bits(only_columnwise.columnwise_data, want.T, "cast-transpose columnwise only")


NAMES = ("rowwise data", "rowwise scale", "columnwise data", "columnwise scale")
SEEDS = (jnp.uint32(0x1234567), jnp.uint32(0x9ABCDEF))


def check_mxfp8(x, fp8_dtype, config=None):
    for got, want, name in zip(
        run_mxfp8(x, fp8_dtype, config=config), ref_mxfp8(x, fp8_dtype), NAMES, strict=True
    ):
        assert_same_bits(got, want, f"mxfp8 {name} ({config})")


def check_mxfp8_one_copy_at_a_time(x, fp8_dtype, config, label: str):
    """The rowwise copy alone, then the columnwise copy alone, against the reference."""
    want = ref_mxfp8(x, fp8_dtype)
    for rowwise, columnwise in ((True, False), (False, True)):
        got = pk.quantize_mxfp8(
            x,
            rowwise=rowwise,
            columnwise=columnwise,
            fp8_dtype=fp8_dtype,
            config=config,
            interpret=INTERPRET,
        )
        for g, w, name in zip(got, want, NAMES, strict=True):
            if g is not None:
                assert_same_bits(g, w, f"{label}, one copy: mxfp8 {name}")


# MXFP8 variants besides the default (lean_arithmetic on): every one gives the same bits.
MXFP8_SPLIT = pk.MXFP8QuantizeConfig(split_copies=True)
MXFP8_EXACT = pk.MXFP8QuantizeConfig(lean_arithmetic=False)
MXFP8_SPLIT_EXACT = pk.MXFP8QuantizeConfig(split_copies=True, lean_arithmetic=False)
# Codes staged in the input tile's shared memory once it has been read. The interpreter keeps
# RefUnion members apart, so only the GPU tests can see a code written too early.
MXFP8_REUSE = pk.MXFP8QuantizeConfig(reuse_input_tile=True)
# The columnwise codes staged over each 32-row slab of the input tile once every thread has
# read it (a warpgroup barrier per slab): again only the GPU tests see a slab written early.
MXFP8_SLABS = pk.MXFP8QuantizeConfig(stage_columnwise_in_input=True)
# Scales stored straight into the (lines, blocks) layout (the default writes them tile-major,
# one contiguous piece per tile, and the wrapper rearranges them).
MXFP8_LINE_MAJOR = pk.MXFP8QuantizeConfig(tile_major_scales=False)
# A CTA of 4×4 tiles whose scales are collected in shared memory and written line-major by TMA
# (16 bytes per line and copy): only the GPU tests see a stage read before every thread wrote.
MXFP8_STAGED = pk.MXFP8QuantizeConfig(steps_per_cta=4, steps_per_cta_m=4, stage_scales=True)


def mxfp8_edge_matrix() -> np.ndarray:
    """Block maxima at and around 448·2^k, zero / NaN / Inf blocks, tiny normal maxima, and an
    Inf block whose finite values are huge (their codes are x·2^-127: not all ±0)."""
    x = np.zeros((128, 128), np.float32)
    peaks = [448.0, 449.0, 500.0, 896.0, 1.0, 2.0**-118, 2.0**-119, 3.0e38, 2.0**-100]
    for i, peak in enumerate(peaks):
        for k, p in enumerate(
            [
                peak,
                np.nextafter(np.float32(peak), np.float32(0)),
                np.nextafter(np.float32(peak), np.float32(np.inf)),
            ]
        ):
            # float64 steps: float32 ones overflow at 3e38 (±6e38 span) and give Inf / NaN.
            x[i * 3 + k, :32] = np.linspace(-float(p), float(p), 32).astype(np.float32)
    x[40, 32:64] = np.nan
    x[41, 64] = np.inf
    x[42, 96] = -np.inf
    x[43, 100] = np.nan
    x[44, 101] = -np.nan
    x[45, :32] = np.linspace(-3.0e38, 3.0e38, 32).astype(np.float32)
    x[45, 7] = np.inf
    return x


def check_nvfp4(x, rht, sr, block=(1, 16), positions=(None, None), config=None):
    want, amaxes = ref_nvfp4(x, rht=rht, sr=sr, seeds=SEEDS, block=block, positions=positions)
    got = run_nvfp4(
        x,
        rht=rht,
        sr=sr,
        amaxes=amaxes,
        seeds=SEEDS,
        block_shape=block,
        positions=positions,
        config=config,
    )
    for g, w, name in zip(got, want, NAMES, strict=True):
        assert_same_bits(g, w, f"nvfp4 {name} ({config})")
    kernel_amaxes = jax.jit(
        lambda v: pk.nvfp4_amax(v, hadamard_columnwise=rht, interpret=INTERPRET)
    )(x)
    for g, w, name in zip(kernel_amaxes, amaxes, ("rowwise", "columnwise"), strict=True):
        assert_same_bits(g, w, f"nvfp4 {name} global amax")


def check_fp8_block(x, fp8_dtype, block, pow2, config=None, eps=0.0):
    got = run_fp8_block(x, fp8_dtype, block, pow2, config=config, amax_epsilon=eps)
    want = ref_fp8_block(x, fp8_dtype, block, pow2, eps)
    for g, w, name in zip(got, want, NAMES, strict=True):
        assert_same_bits(g, w, f"fp8_block {name} ({x.dtype}, {config}, eps={eps})")


# FP8 block's exact arithmetic (lean_arithmetic is the default): the same bits.
FP8_BLOCK_EXACT = pk.FP8BlockQuantizeConfig(lean_arithmetic=False)
FP8_BLOCK_REUSE = pk.FP8BlockQuantizeConfig(reuse_input_tile=True)
FP8_BLOCK_LINE_MAJOR = pk.FP8BlockQuantizeConfig(tile_major_scales=False)
FP8_BLOCK_STAGED = pk.FP8BlockQuantizeConfig(steps_per_cta=4, steps_per_cta_m=4, stage_scales=True)


def fp8_block_edge_matrix() -> np.ndarray:
    """One 128-element block per row (and, transposed, per column): maxima at and around
    448·2^k, 57344·2^k, 1.75 and 2^k (the power-of-2 scale's closed form switches exponent at
    1.75·2^k), the smallest normal, subnormal maxima (scale overflow → the input dtype's max),
    maxima near FLT_MAX; zero, NaN (both signs) and Inf blocks, and an Inf block whose finite
    values are huge (codes saturate); a block mixing huge and subnormal values."""
    x = np.zeros((128, 256), np.float32)
    peaks = [448.0, 57344.0, 1.75, 2.0, 1.0, 2.0**-126, 2.0**-119, 1.0e-40, 3.0e38, 2.0**-100]
    for i, peak in enumerate(peaks):
        for k, p in enumerate(
            [
                peak,
                np.nextafter(np.float32(peak), np.float32(0)),
                np.nextafter(np.float32(peak), np.float32(np.inf)),
            ]
        ):
            p = float(p)  # float64 steps: no overflow near FLT_MAX
            x[i * 3 + k, :128] = np.linspace(-p, p, 128).astype(np.float32)
            x[i * 3 + k, 128:] = (p * np.linspace(1, -1, 128) ** 3).astype(np.float32)
    x[40, 32:64] = np.nan
    x[41, 64] = np.inf
    x[42, 200] = -np.inf
    x[43, 100] = np.nan
    x[44, 129] = -np.nan
    x[45, :128] = np.linspace(-3.0e38, 3.0e38, 128).astype(np.float32)
    x[45, 7] = np.inf
    x[46, 128:] = np.float32(1e-40)
    x[46, 130] = np.float32(3.0e38)
    x[47, :128] = np.float32(FLT_MAX)
    return x


def flush_subnormals(x: np.ndarray) -> np.ndarray:
    """x with its subnormal float32 elements (0 < |v| < 2^-126) set to zero of the same sign."""
    tiny = (np.abs(x) < np.finfo(np.float32).tiny) & (x != 0)
    return np.where(tiny, np.copysign(np.float32(0), x), x).astype(np.float32)


# --- CPU: interpreter ----------------------------------------------------------------------------
cpu_only = pytest.mark.skipif(ON_GPU, reason="interpreter tests run on the CPU")


@cpu_only
@pytest.mark.parametrize(
    "config",
    [None, MXFP8_SPLIT, MXFP8_EXACT, MXFP8_SPLIT_EXACT, MXFP8_REUSE, MXFP8_SLABS, MXFP8_LINE_MAJOR],
)
@pytest.mark.parametrize(
    "shape, dtype, fp8_dtype, seed",
    [
        ((256, 256), jnp.bfloat16, E4M3, 0),  # 2×2 tiles
        ((128, 384), jnp.float32, E5M2, 1),  # 1×3 tiles
        ((200, 136), jnp.bfloat16, E4M3, 2),  # padding: neither dim a multiple of 128 (or 32)
    ],
)
def test_mxfp8_interpret(shape, dtype, fp8_dtype, seed, config):
    check_mxfp8(sample(shape, dtype, seed, block=32), fp8_dtype, config)


@cpu_only
@pytest.mark.parametrize("config", [None, MXFP8_EXACT, MXFP8_REUSE, MXFP8_SLABS])
def test_mxfp8_interpret_edge_blocks(config):
    x = mxfp8_edge_matrix()
    for fp8_dtype in (E4M3, E5M2):
        for dtype in (jnp.float32, jnp.bfloat16):
            check_mxfp8(jnp.asarray(x).astype(dtype), fp8_dtype, config)
            check_mxfp8(jnp.asarray(x.T.copy()).astype(dtype), fp8_dtype, config)


@cpu_only
def test_mxfp8_split_copies_variants_interpret():
    # One copy only (split_copies is ignored: one warpgroup), unstaged outputs with two
    # warpgroups (each stores its rows straight to global memory), 256-row tiles.
    x = sample((256, 256), jnp.bfloat16, 4, block=32)
    check_mxfp8_one_copy_at_a_time(x, E4M3, MXFP8_SPLIT_EXACT, "split")
    for config in (
        pk.MXFP8QuantizeConfig(split_copies=True, stage_outputs=False),
        pk.MXFP8QuantizeConfig(split_copies=True, lean_arithmetic=True, tile_m=256),
    ):
        check_mxfp8(x, E4M3, config)


def test_mxfp8_scale_byte_without_division_matches_reference():
    # Every bf16 amax, float32 ones around the subnormal-v thresholds and each 448·2^k,
    # random float32 ones, Inf and NaN (the exhaustive check over all 2^31 float32 amaxes
    # was run once with numpy: no mismatch for E4M3 nor E5M2).
    # (pallas_kernels re-exports the function under the module's name.)
    kernel_mxfp8 = importlib.import_module("pallas_kernels.quantize_mxfp8")
    bf16_bits = np.arange(0x8000, dtype=np.uint32) << 16
    rng = np.random.default_rng(0)
    near = []
    for fp8_max in (448.0, 57344.0):
        edges = list(kernel_mxfp8.subnormal_amax_thresholds(fp8_max))
        edges += [int(np.float32(fp8_max * 2.0**k).view(np.uint32)) for k in range(-140, 110)]
        near += [np.arange(e - 3, e + 4, dtype=np.int64) for e in edges]
    near = np.clip(np.concatenate(near), 0, 0x7FFFFFFF).astype(np.uint32)
    random_bits = rng.integers(0, 0x7F800000, 1 << 16, dtype=np.uint32)
    specials = np.array([0x7F800000, 0x7FC00000, 0x7FFFFFFF], np.uint32)
    amax_bits = jnp.asarray(np.concatenate([bf16_bits, near, random_bits, specials]))
    for fp8_dtype in (E4M3, E5M2):
        fp8_max = float(jnp.finfo(fp8_dtype).max)
        got = kernel_mxfp8.e8m0_scale_byte_without_division(amax_bits, fp8_max)
        want = mxfp8.e8m0_from_amax(jax.lax.bitcast_convert_type(amax_bits, jnp.float32), fp8_max)
        assert_same_bits(got.astype(jnp.uint8), want, f"{fp8_dtype} E8M0 byte")


# NVFP4's first arithmetic (the reference's operations one for one); the default since stop 22
# is lean_arithmetic (a per-block NaN mask, stochastic rounding from the nearest rounding, the
# hash's row part made once per line): both must give the reference's bits.
NVFP4_EXACT = pk.NVFP4QuantizeConfig(lean_arithmetic=False)
# The blocks unrolled over the tile (loop_blocks=True is the default since stop 24): the same bits.
NVFP4_UNROLLED = pk.NVFP4QuantizeConfig(loop_blocks=False)
NVFP4_UNROLLED_EXACT = pk.NVFP4QuantizeConfig(loop_blocks=False, lean_arithmetic=False)
# The lean float comparison for stochastic rounding (the default before stop 26, which decides
# it on integers): the same bits.
NVFP4_FLOAT_SR = pk.NVFP4QuantizeConfig(integer_stochastic_rounding=False)
# Stochastic rounding's integer decision as a tie-corrected comparison (stops 26-34's default;
# since stop 35 the default decides it as one carry, add.rp.f32 on the GPU): the same bits.
NVFP4_COMPARISON_SR = pk.NVFP4QuantizeConfig(carry_stochastic_rounding=False)
# The global-amax kernel through TMA tiles (the default before stop 33 loads x directly).
NVFP4_AMAX_TMA = pk.NVFP4QuantizeConfig(amax_direct_loads=False)
# Stops 26-33's kernel: each block's 1 / (scale · S_dec) by integer long division and the row
# amaxes on float32 patterns (stop 34: the platform's float division, bf16 patterns).
NVFP4_INTEGER_DIVISION = pk.NVFP4QuantizeConfig(native_division=False, packed_row_amax=False)
# Nearest rounding by the magic-number integer sequence (stops <= 34; since stop 35 the default
# takes the smallest of three float roundings, `grid_min_rounding`): the same bits.
NVFP4_MAGIC_ROUNDING = pk.NVFP4QuantizeConfig(grid_min_rounding=False)
# Each code's sign by a compare and a select (stops <= 35; since stop 36 the default adds it by
# FMA-pipe instructions, `float_sign_test`): the same bits.
NVFP4_COMPARE_SIGN = pk.NVFP4QuantizeConfig(float_sign_test=False)
# Block amaxes of float32 values on bit patterns (stops <= 35; since stop 36 the hardware takes
# them by a float max, `float_block_amax`, which the interpreter does not run: the gpu tests
# tell): the same bits.
NVFP4_BITS_AMAX = pk.NVFP4QuantizeConfig(float_block_amax=False)
# 16×16 blocks: each tile's block amaxes loaded when the tile starts (stop 37).
NVFP4_PRELOAD = pk.NVFP4QuantizeConfig(preload_block_amaxes=True)  # the default since stop 38
# 16×16 block amaxes loaded per group of four blocks, just before it (the default until stop 38).
NVFP4_PER_GROUP = pk.NVFP4QuantizeConfig(preload_block_amaxes=False)
# 16×16 block amaxes read from per-line copies that XLA writes (the only path the interpreter
# has; on the hardware the kernel reads the compact (M/16, K/16) array by default).
NVFP4_PER_LINE_BLOCK_AMAXES = pk.NVFP4QuantizeConfig(compact_block_amaxes=False)
# NaN-amax blocks cleared by a clamp limit of 0 instead of a mask on the packed codes (stop 53,
# opt-in): the same bits.
NVFP4_NAN_CLAMP = pk.NVFP4QuantizeConfig(clamp_clears_nan_blocks=True)


NVFP4_CASES = [  # rht, sr, dtype, shape, block
    (False, False, jnp.bfloat16, (256, 128), (1, 16)),
    (True, False, jnp.float32, (128, 256), (1, 16)),
    (True, True, jnp.bfloat16, (128, 256), (1, 16)),
    (True, False, jnp.bfloat16, (144, 160), (1, 16)),  # padding
    (False, False, jnp.bfloat16, (256, 128), (16, 16)),  # weights
    (False, True, jnp.float32, (144, 200), (16, 16)),  # padding, stochastic rounding
]
NVFP4_CONFIGS = {
    "default": None,
    "exact": NVFP4_EXACT,
    "unrolled": NVFP4_UNROLLED,
    "integer_division": NVFP4_INTEGER_DIVISION,
    "magic_rounding": NVFP4_MAGIC_ROUNDING,
    "compare_sign": NVFP4_COMPARE_SIGN,
    "nan_clamp": NVFP4_NAN_CLAMP,
}
# Options of stochastic rounding alone: without it they build the default kernel, so they
# run on the stochastic cases only.
NVFP4_SR_CONFIGS = {"float_sr": NVFP4_FLOAT_SR, "comparison_sr": NVFP4_COMPARISON_SR}


def nvfp4_params(configs, stochastic_only=False):
    """One param per config and case (the stochastic cases only with `stochastic_only`), with a
    readable id such as "exact-rht-rn-float32-128x256-1x16"."""
    params = []
    for name, config in configs.items():
        for rht, sr, dtype, shape, block in NVFP4_CASES:
            if stochastic_only and not sr:
                continue
            words = [name, "rht" if rht else "no_rht", "sr" if sr else "rn", dtype.dtype.name]
            case_id = "-".join(words + ["x".join(map(str, dims)) for dims in (shape, block)])
            params.append(pytest.param(rht, sr, dtype, shape, block, config, id=case_id))
    return params


@cpu_only
@pytest.mark.parametrize(
    "rht, sr, dtype, shape, block, config",
    nvfp4_params(NVFP4_CONFIGS) + nvfp4_params(NVFP4_SR_CONFIGS, stochastic_only=True),
)
def test_nvfp4_interpret(rht, sr, dtype, shape, block, config):
    check_nvfp4(sample(shape, dtype, 7, block=16), rht, sr, block, config=config)


# Global amaxes whose S_dec = 1 / S_enc make each block's divisor e4m3 scale · S_dec land
# everywhere the division can go wrong: S_dec subnormal (amax ≤ 2688 · 2^-126), S_enc clamped
# to FLT_MAX, mantissas next to a power of two, huge ones (S_dec · 448 near 2^125), random.
DIVISION_SWEEP_AMAXES = (
    2.0**-149,
    2.0**-130,
    2688.0 * 2.0**-127,
    1e-30,
    2.0**-20,
    0.37,
    1.0,
    2688.0,
    float(np.nextafter(np.float32(2688.0), np.float32(np.inf))),
    3.3e5,
    1e20,
    2.0**100,
    3.0e38,
    FLT_MAX,
    *(float(v) for v in np.exp2(np.random.default_rng(5).uniform(-120, 127, 6))),
)


def division_sweep_input(shape, dtype):
    """Gaussian 1×16 blocks (along rows) scaled by 2^u, u uniform in [-60, 60]: under one
    global amax their e4m3 scales take most of the format's values, saturated and subnormal
    ones included (a 16-line strip of one block column shares its scale, so the columnwise
    copy sees them too)."""
    rng = np.random.default_rng(3)
    rows, cols = shape
    values = rng.standard_normal((rows, cols // 16, 16)) * np.exp2(
        rng.uniform(-60, 60, (rows // 16, 1, cols // 16, 1))
    ).repeat(16, axis=0).reshape(rows, cols // 16, 1)
    return jnp.asarray(values.reshape(rows, cols).astype(np.float32)).astype(dtype)


def division_sensitive_input(shape, global_amax):
    """float32 x whose rowwise products x·enc sit within an ulp of E2M1's rounding thresholds
    (0.25 … 5), so that an encode scale enc = 1 / (scale · S_dec) one ulp off flips codes.
    Each 1×16 block: a maximum A (log-uniform below the global amax), then elements
    fl(threshold / enc) nudged by -1, 0, +1 ulp; t and S_dec from `copy_scalars`, the block
    scale and enc from the reference's rules in float64 (correctly rounded)."""
    rng = np.random.default_rng(9)
    rows, cols = shape
    f32 = np.float32
    scalars = importlib.import_module("pallas_kernels.quantize_nvfp4").copy_scalars
    t, s_dec = np.asarray(scalars(jnp.float32(global_amax)), np.float32)  # the kernel's own
    # Block maxima up to 2^17 below the global amax: every nonzero e4m3 scale (2^-9 … 448).
    maxima = (f32(global_amax) * np.exp2(rng.uniform(-17, 0, (rows, cols // 16)))).astype(f32)
    scales = np.minimum(maxima * t, f32(448.0)).astype(jnp.float8_e4m3fn).astype(np.float32)
    enc = (1.0 / (scales * s_dec).astype(np.float64)).astype(np.float32)
    thresholds = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = np.empty((rows, cols // 16, 16), np.float32)
    x[..., 0] = maxima
    for j in range(1, 16):
        value = (thresholds[j % 7] / enc.astype(np.float64)).astype(np.float32)
        nudge = j // 7 - 1  # -1, 0, +1 ulp
        if nudge:
            value = np.nextafter(value, np.float32(np.inf * nudge))
        x[..., j] = value * rng.choice([-1.0, 1.0], value.shape).astype(np.float32)
    return jnp.asarray(x.reshape(rows, cols))


def check_nvfp4_over_global_amaxes(x, amaxes, config, rht=True):
    """The kernel against the reference under each global amax (both copies), bit for bit:
    one compile each, the amax an argument."""
    spec = QuantizerSpec("nvfp4", jnp.float4_e2m1fn, (1, 16), hadamard_columnwise=rht)

    def reference(v, amax):
        col = columnwise_source(v, spec)
        return (
            *nvfp4.quantize(v, spec, global_amax=amax),
            *nvfp4.quantize(col, spec, global_amax=amax),
        )

    def kernel(v, amax):
        return pk.quantize_nvfp4(
            v,
            rowwise=True,
            columnwise=True,
            rowwise_amax=amax,
            columnwise_amax=amax,
            hadamard_columnwise=rht,
            interpret=INTERPRET,
            config=config,
        )

    reference, kernel = jax.jit(reference), jax.jit(kernel)
    for amax in amaxes:
        amax = jnp.float32(amax)
        want = reference(x, amax)
        if not INTERPRET:
            poison_device_memory(2 * x.size)
        for g, w, name in zip(kernel(x, amax), want, NAMES, strict=True):
            assert_same_bits(g, w, f"nvfp4 {name}, global amax {float(amax):.6g} ({config})")


@cpu_only
def test_nvfp4_division_over_global_amaxes_interpret():
    # The kernel's float division (native_division) against the reference's integer one under
    # XLA:CPU, which runs the interpreter: the same quotients for every divisor that arises.
    x = division_sweep_input((128, 256), jnp.float32)
    check_nvfp4_over_global_amaxes(x, DIVISION_SWEEP_AMAXES, None)
    # Products within an ulp of the rounding thresholds: an encode scale an ulp off fails.
    for amax in (1.0, 3.3e5, 2.0**-100):
        x = division_sensitive_input((128, 256), amax)
        check_nvfp4_over_global_amaxes(x, (amax,), None, rht=False)
    for name in ("native_division", "packed_row_amax", "carry_stochastic_rounding"):
        with pytest.raises(TypeError, match=f"{name} must be a bool, got 1"):
            pk.NVFP4QuantizeConfig(**{name: 1})
    with pytest.raises(ValueError, match="carry_stochastic_rounding=True needs integer_stoch"):
        pk.NVFP4QuantizeConfig(carry_stochastic_rounding=True, integer_stochastic_rounding=False)
    # The default follows integer_stochastic_rounding, which follows lean_arithmetic.
    assert pk.NVFP4QuantizeConfig().carry_stochastic_rounding is True
    assert (
        pk.NVFP4QuantizeConfig(integer_stochastic_rounding=False).carry_stochastic_rounding is False
    )
    assert pk.NVFP4QuantizeConfig(lean_arithmetic=False).carry_stochastic_rounding is False
    with pytest.raises(ValueError, match="pass carry_stochastic_rounding=None"):
        dataclasses.replace(pk.NVFP4QuantizeConfig(), integer_stochastic_rounding=False)


def test_nvfp4_lean_stochastic_rounding_matches_the_threshold_counts():
    # e2m1_stochastic (from the nearest rounding) against e2m1_magnitude_stochastic (threshold
    # counts, the reference's order) on every grid value, each midpoint and ±1 ulp around them,
    # the clip at 6, random magnitudes, and uniforms at 0, just below / at each fraction, ~1.
    kernel_nvfp4 = importlib.import_module("pallas_kernels.quantize_nvfp4")
    grid = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
    points = np.concatenate([grid, (grid[1:] + grid[:-1]) / 2, [7.0, 1e30, 2.0**-140]])
    points = np.concatenate(
        [points, np.nextafter(points, np.float32(0)), np.nextafter(points, np.float32(np.inf))]
    )
    rng = np.random.default_rng(0)
    points = np.concatenate([points, rng.uniform(0, 6.5, 4000).astype(np.float32)])
    p = np.concatenate([points, -points]).astype(np.float32)
    a = np.minimum(np.abs(p), np.float32(6.0))
    lower_value = grid[np.searchsorted(grid, a, side="right") - 1]
    step = np.where(a < 2, 0.5, np.where(a < 4, 1.0, 2.0)).astype(np.float32)
    frac = ((a - lower_value) / step).astype(np.float32)
    for uniforms in (
        np.zeros_like(p),
        np.nextafter(frac, np.float32(0)),
        frac,
        np.full_like(p, 1 - 2.0**-24),
        rng.uniform(0, 1, p.shape).astype(np.float32),
    ):
        p_, u_ = jnp.asarray(p), jnp.asarray(uniforms.astype(np.float32))
        want = kernel_nvfp4.e2m1_magnitude_stochastic(jnp.abs(jnp.clip(p_, -6.0, 6.0)), u_)
        got = kernel_nvfp4.e2m1_stochastic(p_, u_)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_nvfp4_grid_min_rounding_matches_the_magic_number_codes_for_every_float():
    # e2m1_nearest_grid_min (the smallest of three float roundings) against e2m1_nearest for
    # every float32 in [0, 6] (1.09e9 values, 2^24 per jitted call: ~2 s on a CPU core).
    kernel_nvfp4 = importlib.import_module("pallas_kernels.quantize_nvfp4")

    @jax.jit
    def mismatches(first_bits):
        a = jax.lax.bitcast_convert_type(
            first_bits + jnp.arange(1 << 24, dtype=jnp.uint32), jnp.float32
        )
        a = jnp.minimum(a, jnp.float32(6.0))
        grid = kernel_nvfp4.e2m1_nearest_grid_min(a, None, on_hardware=False)
        codes = jax.lax.bitcast_convert_type(grid, jnp.uint32) - jnp.uint32(0x4B000000)
        return jnp.sum(codes != kernel_nvfp4.e2m1_nearest(a))

    six_bits = int(np.float32(6.0).view(np.uint32))
    for first in range(0, six_bits + 1, 1 << 24):
        assert int(mismatches(jnp.uint32(first))) == 0, hex(first)
    with pytest.raises(ValueError, match="grid_min_rounding=True needs lean_arithmetic=True"):
        pk.NVFP4QuantizeConfig(grid_min_rounding=True, lean_arithmetic=False)
    assert pk.NVFP4QuantizeConfig().grid_min_rounding is True
    assert pk.NVFP4QuantizeConfig(lean_arithmetic=False).grid_min_rounding is False
    with pytest.raises(TypeError, match="grid_min_rounding must be a bool, got 1"):
        pk.NVFP4QuantizeConfig(grid_min_rounding=1)
    with pytest.raises(ValueError, match=r"scale must be a power of two, got 3\.0"):
        qc.exact_scale_add(jnp.zeros((128, 16)), 3.0, 1.0, None, on_hardware=True)


def test_nvfp4_float_sign_test_matches_the_compare():
    # negative_units (sat(r · −2^110 − 2^24), NVFP4QuantizeConfig.float_sign_test) against the
    # lean sign test r < −2^-86: every float32 of magnitude in [2^-100, 2^-72) (both signs,
    # 2^24 per jitted call), then ±0, ±Inf, NaN, subnormals, the largest floats and 2^24 random
    # bit patterns. Each result must be exactly 1.0 or +0.0, and the same as the fused
    # multiply-add of the hardware rounded once (numpy float64: r · 2^110 is exact there).
    kernel_nvfp4 = importlib.import_module("pallas_kernels.quantize_nvfp4")

    def check(bits):
        r = jax.lax.bitcast_convert_type(bits, jnp.float32)
        units = kernel_nvfp4.negative_units(r, None, on_hardware=False)
        want = jnp.where(r < jnp.float32(-(2.0**-86)), jnp.float32(1.0), jnp.float32(0.0))
        unit_bits = jax.lax.bitcast_convert_type(units, jnp.uint32)
        return jnp.sum(unit_bits != jax.lax.bitcast_convert_type(want, jnp.uint32))

    mismatches = jax.jit(lambda first: check(first + jnp.arange(1 << 24, dtype=jnp.uint32)))
    low, high = (int(np.float32(2.0**e).view(np.uint32)) for e in (-100, -72))
    for sign in (0, 1 << 31):
        for first in range(low, high, 1 << 24):
            assert int(mismatches(jnp.uint32(sign | first))) == 0, hex(sign | first)
    special = np.array(
        [
            0.0,
            -0.0,
            np.inf,
            -np.inf,
            np.nan,
            2.0**-149,
            -(2.0**-149),
            -(2.0**-126),
            3.4e38,
            -3.4e38,
        ],
        np.float32,
    ).view(np.uint32)
    rng = np.random.default_rng(7)
    samples = np.concatenate([special, rng.integers(0, 2**32, 1 << 24, dtype=np.uint32)])
    assert int(jax.jit(check)(jnp.asarray(samples))) == 0
    # The hardware's single rounding, clamped as .sat does (NaN to +0), on normal floats
    # (XLA:CPU reads subnormal inputs as zero; their unit is 0 either way).
    r = samples.view(np.float32)
    normal = np.isnan(r) | (np.abs(r) >= np.float32(2.0**-126)) | (r == 0)
    with np.errstate(over="ignore", invalid="ignore"):
        fused = (r[normal].astype(np.float64) * -(2.0**110) - 2.0**24).astype(np.float32)
    hardware = np.where(fused > 0, np.minimum(fused, np.float32(1.0)), np.float32(0.0))
    got = kernel_nvfp4.negative_units(jnp.asarray(r[normal]), None, on_hardware=False)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), hardware.view(np.uint32))
    assert pk.NVFP4QuantizeConfig().float_sign_test is True
    assert pk.NVFP4QuantizeConfig(lean_arithmetic=False).float_sign_test is False
    with pytest.raises(ValueError, match="float_sign_test=True needs lean_arithmetic=True"):
        pk.NVFP4QuantizeConfig(float_sign_test=True, lean_arithmetic=False)
    with pytest.raises(TypeError, match="float_sign_test must be a bool, got 1"):
        pk.NVFP4QuantizeConfig(float_sign_test=1)
    with pytest.raises(TypeError, match="float_block_amax must be a bool, got 1"):
        pk.NVFP4QuantizeConfig(float_block_amax=1)
    with pytest.raises(ValueError, match=r"scale must be ± a power of two, got 3\.0"):
        qc.saturated_scale_add(jnp.zeros((128, 16)), 3.0, 1.0, None, on_hardware=True)
    with pytest.raises(ValueError, match=r"scale must be ± a power of two, got -6\.0"):
        qc.scale_add(jnp.zeros((128, 16)), -6.0, jnp.zeros((128, 16)), None, on_hardware=True)


def test_nvfp4_clamp_clears_nan_blocks_option():
    # The interpreter's spelling of PTX min.f32 (`qc.min_ignoring_nan`): a NaN takes its limit,
    # everything else the plain minimum (±Inf and ±0 included). The option is off by default
    # (0.998x on an H100, stop 53) and must be a bool.
    values = jnp.asarray([np.nan, -np.nan, np.inf, 7.0, 5.5, 0.0, -0.0, -np.inf], jnp.float32)
    limits = jnp.asarray([0.0, 6.0, 6.0, 6.0, 6.0, 6.0, 0.0, 6.0], jnp.float32)
    got = qc.min_ignoring_nan(values, limits, None, on_hardware=False)
    want = np.asarray([0.0, 6.0, 6.0, 6.0, 5.5, 0.0, -0.0, -np.inf], np.float32)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32))
    assert pk.NVFP4QuantizeConfig().clamp_clears_nan_blocks is False
    with pytest.raises(TypeError, match="clamp_clears_nan_blocks must be a bool, got 1"):
        pk.NVFP4QuantizeConfig(clamp_clears_nan_blocks=1)


def test_nvfp4_integer_stochastic_rounding_matches_the_float_decision():
    # e2m1_stochastic_integer (the byte against |p|'s fraction bits) and e2m1_stochastic_carry
    # (the same comparison as a carry, below 1 on a ceiling) against e2m1_stochastic
    # (its uniform (b + 1/2)/256 against a float fraction) for every byte: grid values, the
    # fraction exactly at each byte's threshold and one ulp either side (the ties), values
    # below 1 whose + 1 rounds (bits under 2^-23) next to a threshold, the clip at 6, tiny and
    # random magnitudes.
    kernel_nvfp4 = importlib.import_module("pallas_kernels.quantize_nvfp4")
    grid = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
    steps = np.array([0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 2.0], np.float32)
    byte_values = np.arange(256, dtype=np.float32)
    at_thresholds = (
        (grid[:-1, None] + steps[:, None] * (byte_values[None, :] + 0.5) / 256)
        .astype(np.float32)
        .ravel()
    )
    points = np.concatenate([grid, [7.0, 1e30, 2.0**-140, 2.0**-30, 1 - 2.0**-25], at_thresholds])
    points = np.concatenate(
        [points, np.nextafter(points, np.float32(0)), np.nextafter(points, np.float32(np.inf))]
    )
    rng = np.random.default_rng(1)
    # Below 1 with bits under 2^-23 (a + 1 rounds): a threshold plus a sub-ulp offset.
    below_one = at_thresholds[at_thresholds < 1]
    points = np.concatenate(
        [points, below_one + np.float32(2.0**-27), below_one - np.float32(2.0**-27)]
    )
    # Just below a step of 0.5 by less than 2^-23 (the fraction's ceiling reaches the step).
    points = np.concatenate(
        [points, np.float32([0.5, 1.0]) - np.float32(2.0**-30), np.float32([0.5 - 2.0**-26])]
    )
    points = np.concatenate([points, rng.uniform(0, 6.5, 4000).astype(np.float32)])
    p = jnp.asarray(np.concatenate([points, -points]).astype(np.float32))
    words = jnp.asarray(rng.integers(0, 2**32, p.shape, dtype=np.uint64).astype(np.uint32))

    def carry_decision(word, byte):  # e2m1_stochastic_carry's interpreter path
        addends = kernel_nvfp4.byte_thresholds(word, byte, carry=True)
        return kernel_nvfp4.e2m1_stochastic_carry(p, addends, None, on_hardware=False)

    for byte in range(4):
        uniforms = kernel_nvfp4.byte_uniforms(words, byte)
        thresholds = kernel_nvfp4.byte_thresholds(words, byte)
        want = kernel_nvfp4.e2m1_stochastic(p, uniforms)
        got = kernel_nvfp4.e2m1_stochastic_integer(p, thresholds)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"byte {byte}")
        got = carry_decision(words, byte)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"carry {byte}")
    # Every byte against the same points (all thresholds of every binade, ties included).
    for b in range(256):
        word = jnp.full(p.shape, b, jnp.uint32)
        want = kernel_nvfp4.e2m1_stochastic(p, kernel_nvfp4.byte_uniforms(word, 0))
        got = kernel_nvfp4.e2m1_stochastic_integer(p, kernel_nvfp4.byte_thresholds(word, 0))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"b={b}")
        got = carry_decision(word, 0)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"carry b={b}")


def test_nvfp4_integer_stochastic_rounding_follows_lean_arithmetic():
    assert pk.NVFP4QuantizeConfig().integer_stochastic_rounding is True
    assert pk.NVFP4QuantizeConfig(lean_arithmetic=False).integer_stochastic_rounding is False
    assert pk.NVFP4QuantizeConfig() == pk.NVFP4QuantizeConfig(integer_stochastic_rounding=True)
    with pytest.raises(ValueError, match="integer_stochastic_rounding=True needs lean_arithmetic"):
        pk.NVFP4QuantizeConfig(integer_stochastic_rounding=True, lean_arithmetic=False)
    # The default resolved to True: replacing lean_arithmetic alone says how to follow it.
    with pytest.raises(ValueError, match="pass integer_stochastic_rounding=None"):
        dataclasses.replace(pk.NVFP4QuantizeConfig(), lean_arithmetic=False)
    exact = dataclasses.replace(
        pk.NVFP4QuantizeConfig(),
        lean_arithmetic=False,
        integer_stochastic_rounding=None,
        carry_stochastic_rounding=None,
        grid_min_rounding=None,
        float_sign_test=None,
    )
    assert exact == pk.NVFP4QuantizeConfig(lean_arithmetic=False)
    with pytest.raises(TypeError, match="integer_stochastic_rounding must be a bool"):
        pk.NVFP4QuantizeConfig(integer_stochastic_rounding=1)


# A shard's copies placed in a larger tensor: the rowwise copy's lines start at row 4096, the
# columnwise copy's (x's columns) at 2^32 - 16 (uint32 positions wrap, as the reference's do).
POSITIONS = (
    (jnp.uint32(4096), jnp.uint32(0)),
    (jnp.uint32(2**32 - 16), jnp.uint32(4096)),
)


@cpu_only
def test_nvfp4_stochastic_rounding_positions_interpret():
    x = sample((144, 160), jnp.float32, 8, block=16)
    check_nvfp4(x, True, True, positions=POSITIONS)
    check_nvfp4(x, True, True, positions=POSITIONS, config=NVFP4_EXACT)
    check_nvfp4(x, True, True, positions=POSITIONS, config=NVFP4_UNROLLED)
    check_nvfp4(x, True, True, positions=POSITIONS, config=NVFP4_FLOAT_SR)
    check_nvfp4(x, True, True, positions=POSITIONS, config=NVFP4_COMPARISON_SR)
    # The positions change the bits drawn (else this test could not tell them apart).
    moved, _ = ref_nvfp4(x, rht=True, sr=True, seeds=SEEDS, positions=POSITIONS)
    unmoved, _ = ref_nvfp4(x, rht=True, sr=True, seeds=SEEDS)
    assert not np.array_equal(bits(moved[0]), bits(unmoved[0]))


# --- grouped tensors: per-line / per-block global amaxes, seeds and positions -------------------
# MoE experts in the aligned layout (ops/grouped_quantize.py): the rows of x are token slots in
# groups that start on multiples of 16 (zero padding slots in between, and a tail past the last
# group), each group quantized as a tensor of its own. The kernel takes each rowwise line's and
# each 16-token block column's global amax, seed and hashed position.
# Groups [0, 32), [32, 32) (empty), [32, 80), [80, 96): each group's last 5 slots are padding.
GROUP_STARTS = (0, 32, 32, 80)


def grouped_arguments(x, rht, sr, starts=GROUP_STARTS, seed=0):
    """The grouped kernel arguments of an aligned x (P, K): per-group amaxes taken from x (the
    columnwise one after the rotation, as the reference's columnwise source), per-group seeds,
    positions relative to each group's first slot."""
    spec = QuantizerSpec("nvfp4", jnp.float4_e2m1fn, (1, 16), hadamard_columnwise=rht)
    rows = x.shape[0]
    starts = np.asarray(starts)
    slot_group = np.searchsorted(starts, np.arange(rows), side="right") - 1
    row_bits = np.asarray(common.abs_bits(x.astype(jnp.float32))).max(axis=1)
    col_bits = np.asarray(common.abs_bits(columnwise_source(x, spec))).max(axis=0)
    row_amax = np.zeros(len(starts), np.uint32)
    col_amax = np.zeros(len(starts), np.uint32)
    np.maximum.at(row_amax, slot_group, row_bits)
    np.maximum.at(col_amax, slot_group, col_bits)
    group_seeds = np.random.default_rng(seed).integers(0, 2**32, len(starts), dtype=np.uint32)
    position = (np.arange(rows) - starts[slot_group]).astype(np.uint32)
    blocks = slice(None, None, 16)
    args = dict(
        rowwise_line_amax=jnp.asarray(row_amax.view(np.float32)[slot_group]),
        columnwise_block_amax=jnp.asarray(col_amax.view(np.float32)[slot_group][blocks]),
    )
    if sr:
        args |= dict(
            rowwise_line_seed=jnp.asarray(group_seeds[slot_group]),
            rowwise_line_position=jnp.asarray(position),
            columnwise_block_seed=jnp.asarray(group_seeds[slot_group][blocks]),
            columnwise_block_position=jnp.asarray(position[blocks]),
        )
    return args


def ref_nvfp4_grouped(x, *, rht, sr, args):
    """The jnp reference fed the same per-line / per-block values (what
    ops/grouped_quantize.py::_quantize_nvfp4_group_copy does with per-group ones)."""
    spec = QuantizerSpec(
        "nvfp4", jnp.float4_e2m1fn, (1, 16), hadamard_columnwise=rht, stochastic_rounding=sr
    )

    def f(v, args):
        rows = jnp.arange(v.shape[0], dtype=jnp.uint32)
        zero = jnp.uint32(0)
        seed = origin = None
        if sr:  # the reference subtracts an origin from the hashed (row, col)
            seed = args["rowwise_line_seed"][:, None]
            origin = ((rows - args["rowwise_line_position"])[:, None], zero)
        rd, rs = nvfp4.quantize(
            v, spec, global_amax=args["rowwise_line_amax"][:, None], seed=seed, origin=origin
        )
        col = columnwise_source(v, spec)
        if sr:
            cols = jnp.arange(col.shape[1], dtype=jnp.uint32)
            first = jnp.repeat(args["columnwise_block_position"], 16) + cols % 16
            seed = jnp.repeat(args["columnwise_block_seed"], 16)[None, :]
            origin = (zero, (cols - first)[None, :])
        cd, cs = nvfp4.quantize(
            col, spec, global_amax=args["columnwise_block_amax"][None, :], seed=seed, origin=origin
        )
        return rd, rs, cd, cs

    return jax.jit(f)(x, args)


def run_nvfp4_grouped(x, *, rht, sr, args, rowwise=True, columnwise=True, **kw):
    return jax.jit(
        lambda v, args: pk.quantize_nvfp4(
            v,
            rowwise=rowwise,
            columnwise=columnwise,
            hadamard_columnwise=rht,
            stochastic_rounding=sr,
            interpret=INTERPRET,
            **args,
            **kw,
        )
    )(x, args)


def check_nvfp4_grouped(x, rht, sr, config=None, args=None):
    args = grouped_arguments(x, rht, sr) if args is None else args
    want = ref_nvfp4_grouped(x, rht=rht, sr=sr, args=args)
    got = run_nvfp4_grouped(x, rht=rht, sr=sr, args=args, config=config)
    for g, w, name in zip(got, want, NAMES, strict=True):
        assert_same_bits(g, w, f"nvfp4 grouped {name} (rht={rht}, sr={sr}, {config})")


@functools.cache
def _adversarial_without_specials(rows, cols, seed):
    return adversarial_matrix(rows, cols, seed, block=16, specials=False)


def grouped_sample(rows, cols, dtype, seed, starts=GROUP_STARTS):
    """Adversarial blocks (zero / tiny / huge / ties / maxima at format limits) in the groups'
    slots, each group at its own power-of-two scale (so their global amaxes differ) and NaN /
    Inf in the last, zeros in the padding slots (the aligned layout's)."""
    x = _adversarial_without_specials(rows, cols, seed)
    sizes = np.diff(np.append(starts, rows))
    out = np.zeros_like(x)
    for g, (start, size) in enumerate(zip(starts, sizes, strict=True)):
        live = slice(start, start + max(size - 5, 0))
        out[live] = x[live] * np.float32(2.0 ** (8 * g))
    out[starts[-1], 3], out[starts[-1] + 2, 20] = np.nan, -np.inf
    return jnp.asarray(out).astype(dtype)


def ref_nvfp4_line_amax_bits(x, rht):
    """Per-row max|x| and per-16-row-block max of the (rotated) columnwise source, as bits."""
    rows16 = -(-x.shape[0] // 16) * 16
    spec = QuantizerSpec("nvfp4", jnp.float4_e2m1fn, (1, 16), hadamard_columnwise=rht)

    def f(v):
        row_bits = jnp.max(common.abs_bits(v.astype(jnp.float32)), axis=1)
        padded = jnp.pad(v, ((0, rows16 - v.shape[0]), (0, 0)))
        token_bits = jnp.max(common.abs_bits(columnwise_source(padded, spec)), axis=0)
        return row_bits, jnp.max(token_bits.reshape(-1, 16), axis=1)

    return jax.jit(f)(x)


def check_nvfp4_line_amax_bits(x, rht, config=None, interpret=INTERPRET):
    want = ref_nvfp4_line_amax_bits(x, rht)
    got = jax.jit(
        lambda v: pk.nvfp4_line_amax_bits(
            v, hadamard_columnwise=rht, config=config, interpret=interpret
        )
    )(x)
    for g, w, name in zip(got, want, ("row", "16-row block"), strict=True):
        assert g.dtype == jnp.uint32 and g.shape == w.shape, (name, g.dtype, g.shape, w.shape)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{name} amax bits")


@cpu_only
@pytest.mark.parametrize(
    "rht, dtype, shape, config",
    [
        (True, jnp.bfloat16, (256, 384), None),
        (False, jnp.float32, (200, 136), None),  # padding both ways
        (True, jnp.float32, (136, 300), pk.NVFP4QuantizeConfig(tile_m=256)),
    ],
)
def test_nvfp4_line_amax_bits_interpret(rht, dtype, shape, config):
    # Per-row and per-16-row-block amaxes (a grouped quantizer's per-group global amaxes are
    # maxima of these), NaN / Inf / huge blocks among them (sample's adversarial blocks).
    check_nvfp4_line_amax_bits(sample(shape, dtype, 31, block=16), rht, config)


def ref_nvfp4_block_amax_bits(x):
    """Each 16×16 block's max|x| as float32 bits, x zero-padded: the reference quantizer's."""
    rows, cols = (-(-n // 16) * 16 for n in x.shape)
    padded = jnp.pad(x.astype(jnp.float32), ((0, rows - x.shape[0]), (0, cols - x.shape[1])))
    blocks = common.abs_bits(padded).reshape(rows // 16, 16, cols // 16, 16)
    return jnp.max(blocks, axis=(1, 3))


def check_nvfp4_block_amax_bits(x, use_kernel=True, interpret=INTERPRET):
    want = ref_nvfp4_block_amax_bits(x)
    got = jax.jit(
        lambda v: pk.nvfp4_block_amax_bits(v, use_kernel=use_kernel, interpret=interpret)
    )(x)
    assert got.dtype == jnp.uint32 and got.shape == want.shape, (got.dtype, got.shape)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg="block amax bits")


@cpu_only
@pytest.mark.parametrize(
    "dtype, shape",
    [
        (jnp.bfloat16, (48, 2048)),  # 128 blocks of 16 columns: one unit per 16 rows
        (jnp.float32, (40, 2100)),  # padding both ways; the last unit overlaps the one before
    ],
)
def test_nvfp4_block_amax_bits_interpret(dtype, shape):
    # NVFP4 weights' 16×16 block amaxes (the quantize kernel's, and their maximum the global
    # amax): NaN / Inf / huge / tiny blocks among them (sample's adversarial blocks).
    check_nvfp4_block_amax_bits(sample(shape, dtype, 33, block=16))


def test_nvfp4_block_amax_bits_paths_and_bad_arguments():
    x = sample((40, 100), jnp.float32, 34, block=16)  # 7 blocks wide: the jnp path
    check_nvfp4_block_amax_bits(x, use_kernel=None)
    with pytest.raises(ValueError, match="use_kernel=True needs x with at least 2033 columns"):
        pk.nvfp4_block_amax_bits(x, use_kernel=True)
    with pytest.raises(TypeError, match="use_kernel must be a bool or None, got 1"):
        pk.nvfp4_block_amax_bits(x, use_kernel=1)
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        pk.nvfp4_block_amax_bits(x.astype(jnp.float16))
    amax = jnp.float32(1.0)
    bits = pk.nvfp4_block_amax_bits(x)
    with pytest.raises(TypeError, match=r"block_amax_bits must be uint32 of shape \(3, 7\)"):
        pk.quantize_nvfp4(x, block_shape=(16, 16), rowwise_amax=amax, block_amax_bits=bits[:, :6])
    with pytest.raises(TypeError, match="block_amax_bits must be uint32"):
        pk.quantize_nvfp4(
            x, block_shape=(16, 16), rowwise_amax=amax, block_amax_bits=bits.astype(jnp.int32)
        )
    with pytest.raises(ValueError, match=r"block_amax_bits applies to block_shape=\(16, 16\)"):
        pk.quantize_nvfp4(x, rowwise_amax=amax, block_amax_bits=bits)


@cpu_only
@pytest.mark.parametrize(
    "sr, dtype, shape, config",
    [
        (False, jnp.bfloat16, (256, 384), NVFP4_PER_GROUP),  # each group's loads
        (True, jnp.float32, (144, 200), NVFP4_PER_GROUP),  # with stochastic rounding
        (False, jnp.bfloat16, (256, 384), NVFP4_PRELOAD),  # loop over groups: selects
        (True, jnp.float32, (144, 200), NVFP4_PRELOAD),  # padding, stochastic rounding
        (False, jnp.bfloat16, (256, 256), dataclasses.replace(NVFP4_PRELOAD, loop_blocks=False)),
        (False, jnp.bfloat16, (512, 256), dataclasses.replace(NVFP4_PRELOAD, tile_m=256)),
    ],
)
def test_nvfp4_preloaded_block_amaxes_interpret(sr, dtype, shape, config):
    # The tile's block amaxes loaded at its start (the default since stop 38), a group's four
    # picked from them, and each group's loaded just before it: the same bits.
    # Without NaN / Inf blocks, which would make most 16×16 blocks' amaxes alike (a 16×16 block
    # holds 16 of sample's 1×16 blocks), so that a block given another's amax shows.
    x = jnp.asarray(_adversarial_without_specials(*shape, 37)).astype(dtype)
    check_nvfp4(x, False, sr, (16, 16), config=config)


def test_preload_block_amaxes_must_be_a_bool():
    with pytest.raises(TypeError, match="preload_block_amaxes must be a bool, got 1"):
        pk.NVFP4QuantizeConfig(preload_block_amaxes=1)
    with pytest.raises(TypeError, match="compact_block_amaxes must be a bool, got 0"):
        pk.NVFP4QuantizeConfig(compact_block_amaxes=0)


def check_nvfp4_from_block_amaxes(x, config=None, interpret=INTERPRET, poison=False):
    """The NVFP4 weight path: 16×16 block amaxes from `nvfp4_block_amax_bits`, the global amax
    their maximum (equal to the reference's), the 16×16 quantizer given both (equal to the
    reference quantizer). `poison`: fill device memory before the quantizer runs."""
    want, amaxes = ref_nvfp4(x, rht=False, sr=False, seeds=SEEDS, block=(16, 16))
    bits = jax.jit(lambda v: pk.nvfp4_block_amax_bits(v, interpret=interpret))(x)
    assert_same_bits(
        common.f32_from_bits(jnp.max(bits)), amaxes[0], "global amax from the block amaxes"
    )
    if poison:
        poison_device_memory(2 * x.size)
    got = run_nvfp4(
        x,
        rht=False,
        sr=False,
        amaxes=amaxes,
        seeds=SEEDS,
        block_shape=(16, 16),
        block_amax_bits=bits,
        config=config,
    )
    for g, w, name in zip(got, want, NAMES, strict=True):
        assert_same_bits(g, w, f"nvfp4 16x16 from the block amaxes, {name} ({config})")


@cpu_only
def test_nvfp4_weight_blocks_from_given_block_amaxes_interpret():
    # A caller that took the global amax from the block amaxes passes them on: the same bits
    # as the wrapper taking them itself (here from the kernel, x 129 blocks wide).
    check_nvfp4_from_block_amaxes(sample((32, 2064), jnp.bfloat16, 35, block=16))


@cpu_only
@pytest.mark.parametrize(
    "rht, sr, dtype, config",
    [
        (False, False, jnp.bfloat16, None),
        (True, True, jnp.bfloat16, None),
        (True, False, jnp.float32, NVFP4_EXACT),
        (True, True, jnp.float32, NVFP4_EXACT),
        (True, True, jnp.bfloat16, NVFP4_UNROLLED_EXACT),
        (True, True, jnp.float32, NVFP4_FLOAT_SR),
        (True, True, jnp.bfloat16, NVFP4_COMPARISON_SR),
    ],
)
def test_nvfp4_grouped_interpret(rht, sr, dtype, config):
    check_nvfp4_grouped(grouped_sample(96, 48, dtype, 12), rht, sr, config)


@cpu_only
def test_nvfp4_grouped_any_per_line_values_interpret():
    # Not only group-shaped values: every line and block its own amax, seed and position
    # (positions near 2^32 wrap), one copy at a time.
    x = sample((96, 48), jnp.bfloat16, 13, block=16)
    rng = np.random.default_rng(1)
    amax = np.asarray(common.amax(x.astype(jnp.float32)))
    args = dict(
        rowwise_line_amax=jnp.asarray(amax * rng.uniform(0.5, 4, 96).astype(np.float32)),
        rowwise_line_seed=jnp.asarray(rng.integers(0, 2**32, 96, dtype=np.uint32)),
        rowwise_line_position=jnp.asarray(rng.integers(2**32 - 64, 2**32, 96, dtype=np.uint32)),
        columnwise_block_amax=jnp.asarray(amax * rng.uniform(0.5, 4, 6).astype(np.float32)),
        columnwise_block_seed=jnp.asarray(rng.integers(0, 2**32, 6, dtype=np.uint32)),
        columnwise_block_position=jnp.asarray(rng.integers(2**32 - 8, 2**32, 6, dtype=np.uint32)),
    )
    want = ref_nvfp4_grouped(x, rht=True, sr=True, args=args)
    for copy in ("rowwise", "columnwise"):
        copy_args = {k: v for k, v in args.items() if k.startswith(copy)}
        got = run_nvfp4_grouped(
            x,
            rht=True,
            sr=True,
            args=copy_args,
            rowwise=copy == "rowwise",
            columnwise=copy == "columnwise",
        )
        for g, w, name in zip(got, want, NAMES, strict=True):
            if name.startswith(copy):
                assert_same_bits(g, w, f"nvfp4 grouped {name}, one copy")
            else:
                assert g is None


def test_nvfp4_grouped_arguments_are_checked():
    x = jnp.ones((96, 48), jnp.bfloat16)
    amax, seed = jnp.ones((96,), jnp.float32), jnp.zeros((96,), jnp.uint32)
    block_amax = jnp.ones((6,), jnp.float32)
    quantize = functools.partial(pk.quantize_nvfp4, x, interpret=INTERPRET)
    with pytest.raises(TypeError, match=r"rowwise_line_amax must be a \(96,\) float32 array"):
        quantize(rowwise_line_amax=amax[:95])
    with pytest.raises(TypeError, match=r"columnwise_block_amax must be a \(6,\) float32"):
        quantize(rowwise=False, columnwise=True, columnwise_block_amax=amax)
    with pytest.raises(TypeError, match=r"rowwise_line_seed must be a \(96,\) uint32 array"):
        quantize(stochastic_rounding=True, rowwise_line_amax=amax, rowwise_line_seed=amax)
    with pytest.raises(ValueError, match="rowwise_line_seed is required"):
        quantize(stochastic_rounding=True, rowwise_line_amax=amax)
    with pytest.raises(ValueError, match="mutually exclusive"):
        quantize(rowwise_line_amax=amax, rowwise_amax=jnp.float32(1))
    with pytest.raises(ValueError, match="mutually exclusive"):
        quantize(
            stochastic_rounding=True,
            rowwise_line_amax=amax,
            rowwise_line_seed=seed,
            rowwise_seed=jnp.uint32(1),
        )
    with pytest.raises(ValueError, match="apply to stochastic_rounding"):
        quantize(rowwise_line_amax=amax, rowwise_line_seed=seed)
    with pytest.raises(ValueError, match="needs rowwise_line_amax"):
        quantize(rowwise_amax=jnp.float32(1), rowwise_line_position=seed)
    with pytest.raises(ValueError, match="columnwise=False"):
        quantize(rowwise_amax=jnp.float32(1), columnwise_block_amax=block_amax)
    with pytest.raises(ValueError, match="1×16 blocks only"):
        quantize(block_shape=(16, 16), rowwise_line_amax=amax)


@cpu_only
@pytest.mark.parametrize(
    "block, fp8_dtype, pow2, shape, dtype, config",
    [
        ((1, 128), E4M3, True, (256, 256), jnp.float32, FP8_BLOCK_EXACT),
        ((1, 128), E5M2, False, (200, 130), jnp.float32, FP8_BLOCK_EXACT),  # padding
        ((128, 128), E4M3, False, (256, 128), jnp.float32, FP8_BLOCK_EXACT),
        ((128, 128), E5M2, True, (128, 256), jnp.float32, FP8_BLOCK_EXACT),
        # The default (lean_arithmetic): bf16 takes the 16-bit amaxes and the one-read
        # columnwise copy.
        ((1, 128), E4M3, True, (256, 256), jnp.bfloat16, None),
        ((1, 128), E5M2, False, (200, 130), jnp.bfloat16, None),  # padding
        ((1, 128), E5M2, True, (128, 256), jnp.float32, None),
        ((128, 128), E4M3, False, (256, 128), jnp.bfloat16, None),
        ((128, 128), E5M2, True, (128, 256), jnp.float32, None),
        ((1, 128), E4M3, True, (200, 130), jnp.bfloat16, FP8_BLOCK_REUSE),  # padding
        ((128, 128), E5M2, True, (256, 256), jnp.float32, FP8_BLOCK_REUSE),
        ((1, 128), E5M2, True, (200, 390), jnp.bfloat16, FP8_BLOCK_LINE_MAJOR),  # padding
        ((128, 128), E4M3, True, (256, 256), jnp.bfloat16, FP8_BLOCK_LINE_MAJOR),  # ignored
    ],
)
def test_fp8_block_interpret(block, fp8_dtype, pow2, shape, dtype, config):
    x = sample(shape, dtype, 11, block=128, subnormals=config is None)
    check_fp8_block(x, fp8_dtype, block, pow2, config)


@cpu_only
def test_fp8_block_interpret_edge_blocks():
    # One 128-column block per row: zero, NaN (both signs), Inf, huge (scale overflow) and
    # tiny maxima, and maxima at 448·2^k ± 1 ulp; pow2 and fp32 scales.
    x = np.random.default_rng(3).standard_normal((128, 256)).astype(np.float32)
    x[0] = 0.0
    x[1, 5], x[2, 6], x[3, 7] = np.nan, -np.nan, np.inf
    x[4] *= np.float32(2.0**-120)
    x[5] = np.float32(1e-38)
    x[6, 0] = np.float32(448.0 * 2.0**10)
    x[7, 0] = np.nextafter(np.float32(448.0), np.float32(np.inf))
    for block, pow2 in (((1, 128), True), ((128, 128), False)):
        check_fp8_block(jnp.asarray(x), E4M3, block, pow2)


@cpu_only
def test_fp8_block_lean_edge_blocks_interpret():
    # The lean path's scale shortcut meets the maxima it depends on, both copies, both input
    # dtypes, both FP8 formats; an amax_epsilon that lifts the tiny blocks.
    x = fp8_block_edge_matrix()
    for fp8_dtype, dtype, pow2, eps in (
        (E4M3, jnp.float32, True, 0.0),
        (E5M2, jnp.bfloat16, True, 0.0),
        (E4M3, jnp.bfloat16, False, 1e-30),
    ):
        for matrix in (x, x.T.copy()):
            v = jnp.asarray(matrix).astype(dtype)
            check_fp8_block(v, fp8_dtype, (1, 128), pow2, None, eps)
    check_fp8_block(jnp.asarray(x[:, :128]), E5M2, (128, 128), True, None)


@cpu_only
def test_fp8_block_lean_variants_interpret():
    # Two blocks per line (256-row / 256-column tiles), one copy at a time, direct stores,
    # pipelined tiles.
    x = sample((256, 256), jnp.bfloat16, 15, block=128, subnormals=True)
    want = ref_fp8_block(x, E4M3, (1, 128), True)
    for rowwise, columnwise, config in (
        (False, True, pk.FP8BlockQuantizeConfig(lean_arithmetic=True, tile_m=256)),
        (True, False, pk.FP8BlockQuantizeConfig(lean_arithmetic=True, tile_k=256)),
    ):
        got = pk.quantize_fp8_block(
            x, rowwise=rowwise, columnwise=columnwise, config=config, interpret=INTERPRET
        )
        for g, w, name in zip(got, want, NAMES, strict=True):
            if g is not None:
                assert_same_bits(g, w, f"lean fp8_block {name} ({config})")
    config = pk.FP8BlockQuantizeConfig(lean_arithmetic=True, steps_per_cta=2, stage_outputs=False)
    check_fp8_block(x.astype(jnp.float32), E5M2, (1, 128), False, config)


def test_fp8_block_pow2_scale_without_division_matches_reference():
    # Every bf16 amax, float32 ones around each fp8_max·2^k, 1.75·2^k, 2^k and the overflow
    # threshold, random float32 ones, subnormals, Inf and NaN, against the reference's rule
    # (IEEE division, Inf → the input dtype's max, power of two by masking). The exhaustive
    # check over all 2^31 non-negative float32 amaxes was run once with numpy (numpy division,
    # E4M3 and E5M2, bf16 / fp32 / fp16 overflow scales): no mismatch.
    kernel_fp8_block = importlib.import_module("pallas_kernels.quantize_fp8_block")
    bf16_bits = np.arange(0x8000, dtype=np.uint32) << 16
    edges = []
    for base in (448.0, 57344.0, 1.75, 1.0):
        edges += [int(np.float32(base * 2.0**k).view(np.uint32)) for k in range(-149, 113)]
    edges = [e for e in edges if 0 < e < 0x7F800000] + [0x7F7FFFFF]
    near = np.concatenate([np.arange(e - 2, e + 3, dtype=np.int64) for e in edges])
    near = np.clip(near, 0, 0x7FFFFFFF).astype(np.uint32)
    rng = np.random.default_rng(1)
    random_bits = rng.integers(0, 0x7F800000, 1 << 16, dtype=np.uint32)
    specials = np.array([0, 1, 0x7FFFFF, 0x800000, 0x7F800000, 0x7FC00000, 0x7FFFFFFF], np.uint32)
    amax_bits = jnp.asarray(np.concatenate([bf16_bits, near, random_bits, specials]))
    amax = jax.lax.bitcast_convert_type(amax_bits, jnp.float32)
    for fp8_dtype in (E4M3, E5M2):
        fp8_max = float(jnp.finfo(fp8_dtype).max)
        for input_dtype in (jnp.bfloat16, jnp.float32, jnp.float16):
            overflow = common.input_dtype_max(input_dtype)
            got = kernel_fp8_block.pow2_scale_bits_without_division(
                amax_bits, fp8_max=fp8_max, overflow_scale=overflow
            )
            want = fp8_tensor.compute_scale(
                amax, fp8_max, power_2_scale=True, amax_epsilon=0.0, overflow_scale=overflow
            )
            assert_same_bits(
                jax.lax.bitcast_convert_type(got, jnp.float32),
                want,
                f"{fp8_dtype} power-of-2 scale, {jnp.dtype(input_dtype)} overflow",
            )


@cpu_only
@pytest.mark.parametrize(
    "shape, dtype, fp8_dtype",
    [((256, 256), jnp.float32, E4M3), ((200, 136), jnp.bfloat16, E5M2)],  # 2nd: padded tiles
)
def test_cast_transpose_interpret(shape, dtype, fp8_dtype):
    check_cast_transpose(scaled_sample(shape, dtype, 13), fp8_dtype)


PIPELINED = {
    "mxfp8": pk.MXFP8QuantizeConfig(steps_per_cta=2),
    "nvfp4": pk.NVFP4QuantizeConfig(steps_per_cta=2, max_concurrent_steps=3),
    "fp8_block": pk.FP8BlockQuantizeConfig(steps_per_cta=2, stage_outputs=False),
    "cast_transpose": pk.CastTransposeConfig(steps_per_cta=2),
}


@cpu_only
def test_pipelined_tiles_interpret():
    # steps_per_cta > 1: each CTA streams several tiles through plgpu.emit_pipeline.
    x = sample((128, 256), jnp.bfloat16, 12, block=16)
    got = run_mxfp8(x, E4M3, config=PIPELINED["mxfp8"])
    for g, w, name in zip(got, ref_mxfp8(x, E4M3), NAMES, strict=True):
        assert_same_bits(g, w, f"pipelined mxfp8 {name}")
    want, amaxes = ref_nvfp4(x, rht=True, sr=True, seeds=SEEDS)
    got = run_nvfp4(x, rht=True, sr=True, amaxes=amaxes, seeds=SEEDS, config=PIPELINED["nvfp4"])
    for g, w, name in zip(got, want, NAMES, strict=True):
        assert_same_bits(g, w, f"pipelined nvfp4 {name}")
    got = run_fp8_block(x, E4M3, (1, 128), True, config=PIPELINED["fp8_block"])
    for g, w, name in zip(got, ref_fp8_block(x, E4M3, (1, 128), True), NAMES, strict=True):
        assert_same_bits(g, w, f"pipelined fp8_block {name}")
    check_cast_transpose(x.astype(jnp.float32) * 300, E4M3, config=PIPELINED["cast_transpose"])
    want, amaxes = ref_nvfp4(x, rht=False, sr=False, seeds=SEEDS, block=(16, 16))
    got = run_nvfp4(
        x,
        rht=False,
        sr=False,
        amaxes=amaxes,
        seeds=SEEDS,
        block_shape=(16, 16),
        config=PIPELINED["nvfp4"],
    )
    for g, w, name in zip(got, want, NAMES, strict=True):
        assert_same_bits(g, w, f"pipelined nvfp4 16x16 {name}")


@cpu_only
def test_reuse_input_tile_interpret():
    # The codes of each copy held in registers, then staged in the input tile's memory: NVFP4
    # (Hadamard, stochastic rounding), the cast-transpose and one copy at a time. (MXFP8 and
    # FP8 block: in their interpreter tests above.)
    x = sample((256, 384), jnp.bfloat16, 16, block=16)
    want, amaxes = ref_nvfp4(x, rht=True, sr=True, seeds=SEEDS)
    config = pk.NVFP4QuantizeConfig(reuse_input_tile=True, loop_blocks=False)
    got = run_nvfp4(x, rht=True, sr=True, amaxes=amaxes, seeds=SEEDS, config=config)
    for g, w, name in zip(got, want, NAMES, strict=True):
        assert_same_bits(g, w, f"reuse_input_tile nvfp4 {name}")
    config = pk.CastTransposeConfig(reuse_input_tile=True)
    check_cast_transpose(scaled_sample((200, 136), jnp.float32, 17), E5M2, config)
    check_mxfp8_one_copy_at_a_time(x, E4M3, MXFP8_REUSE, "reuse_input_tile")


@cpu_only
def test_stage_columnwise_in_input_interpret():
    # The columnwise codes staged over the input tile's 32-row slabs: MXFP8 one copy at a time
    # and with 256×256 tiles (8 slabs of 256 lines), the cast-transpose (f32 input: slabs of
    # 16 KiB with 4 KiB of codes). Both copies, bf16 / f32 and edge blocks: the tests above.
    x = sample((256, 384), jnp.bfloat16, 18, block=32)
    check_mxfp8_one_copy_at_a_time(x, E4M3, MXFP8_SLABS, "stage_columnwise_in_input")
    config = pk.MXFP8QuantizeConfig(stage_columnwise_in_input=True, **_TILE_256)
    check_mxfp8(sample((512, 256), jnp.bfloat16, 19, block=32), E5M2, config)
    config = pk.CastTransposeConfig(stage_columnwise_in_input=True)
    check_cast_transpose(scaled_sample((200, 136), jnp.float32, 20), E4M3, config)


@cpu_only
def test_scale_layouts_interpret():
    # Both scale layouts the kernels can write (tile-major, the default, and straight into the
    # (lines, blocks) layout) with every tile shape, one copy at a time, the unstaged,
    # pipelined and split-copies structures (the default structure: test_mxfp8_interpret /
    # test_fp8_block_interpret).
    x = sample((200, 392), jnp.bfloat16, 21, block=32)
    for options in (
        dict(tile_m=256),
        dict(tile_k=256, stage_outputs=False),
        dict(steps_per_cta=2),
        dict(split_copies=True),
    ):
        for tile_major in (True, False):
            config = pk.MXFP8QuantizeConfig(tile_major_scales=tile_major, **options)
            check_mxfp8(x, E4M3, config)
    check_mxfp8_one_copy_at_a_time(x, E5M2, MXFP8_LINE_MAJOR, "line-major scales")
    for options in (dict(tile_m=256, tile_k=256, stage_outputs=False), dict(lean_arithmetic=False)):
        for tile_major in (True, False):
            config = pk.FP8BlockQuantizeConfig(tile_major_scales=tile_major, **options)
            check_fp8_block(x, E4M3, (1, 128), True, config)


@cpu_only
def test_staged_scales_interpret():
    # Scales collected over a CTA's block of tiles and written line-major by TMA: both copies,
    # one at a time, 256-wide tiles (2 × 8 bytes) with unstaged codes, float32 1×128 scales,
    # and shapes whose blocks of tiles fall short of 16 bytes for one copy (then tile-major).
    x = sample((512, 512), jnp.bfloat16, 23, block=32)
    layouts = [
        qc.line_scales(MXFP8_STAGED, x.shape, c, 32, jnp.uint8).layout for c in (False, True)
    ]
    assert layouts == [qc.STAGED, qc.STAGED]
    check_mxfp8(x, E4M3, MXFP8_STAGED)
    check_mxfp8_one_copy_at_a_time(x, E5M2, MXFP8_STAGED, "staged scales")
    config = pk.MXFP8QuantizeConfig(
        tile_k=256, steps_per_cta=2, steps_per_cta_m=4, stage_scales=True, stage_outputs=False
    )
    check_mxfp8(sample((512, 512), jnp.bfloat16, 24, block=32), E5M2, config)
    uneven = sample((500, 600), jnp.bfloat16, 25, block=32)  # 4 × 5 tiles: rows staged only
    layouts = [
        qc.line_scales(MXFP8_STAGED, (512, 640), c, 32, jnp.uint8).layout for c in (False, True)
    ]
    assert layouts == [qc.TILE_MAJOR, qc.STAGED]
    check_mxfp8(uneven, E4M3, MXFP8_STAGED)
    check_mxfp8(uneven, E4M3, dataclasses.replace(MXFP8_STAGED, tile_major_scales=False))
    check_fp8_block(x, E4M3, (1, 128), True, FP8_BLOCK_STAGED)
    check_fp8_block(uneven, E5M2, (1, 128), False, FP8_BLOCK_STAGED)
    exact = dataclasses.replace(FP8_BLOCK_STAGED, lean_arithmetic=False)
    check_fp8_block(x.astype(jnp.float32), E4M3, (1, 128), True, exact)
    # A 128×128 tile has one scale (no stage): the 4×4 block of tiles walks through the pipeline.
    check_fp8_block(uneven, E4M3, (128, 128), True, FP8_BLOCK_STAGED)


def test_band_order_is_a_permutation_walking_bands():
    # band_tiles_m re-reads the launch index (m fastest) band by band: every tile exactly once,
    # b consecutive CTAs down a band's column, the short last band (5 rows in bands of 2) too.
    for grid_m, grid_k, band in ((5, 3, 2), (8, 8, 8), (64, 64, 8), (7, 1, 3), (4, 6, 1)):
        linear = np.arange(grid_m * grid_k)
        rows, cols = (np.asarray(v) for v in qc.band_order(linear, grid_m, grid_k, band))
        assert sorted(zip(rows.tolist(), cols.tolist(), strict=True)) == [
            (i, j) for i in range(grid_m) for j in range(grid_k)
        ]
        assert rows.max() < grid_m and cols.max() < grid_k
    rows, cols = (np.asarray(v).tolist() for v in qc.band_order(np.arange(15), 5, 3, 2))
    assert list(zip(rows, cols, strict=True)) == [
        (0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2),
        (2, 0), (3, 0), (2, 1), (3, 1), (2, 2), (3, 2),
        (4, 0), (4, 1), (4, 2),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="band_tiles_m must be >= 0"):
        pk.MXFP8QuantizeConfig(band_tiles_m=-1)
    with pytest.raises(TypeError, match="band_tiles_m must be an int"):
        pk.NVFP4QuantizeConfig(band_tiles_m=2.0)


@cpu_only
def test_band_order_interpret():
    # Tiles taken band by band (band_tiles_m) come out exactly as in the grid order: 5 × 3 tiles
    # in bands of 2 (a short last band), both MXFP8 scale layouts, FP8 block 1×128 and 128×128,
    # NVFP4 (its amax kernel too), the cast-transpose, pipelined blocks of tiles, dequantize.
    x = sample((600, 380), jnp.bfloat16, 32, block=32)
    for tile_major in (True, False):
        check_mxfp8(x, E4M3, pk.MXFP8QuantizeConfig(band_tiles_m=2, tile_major_scales=tile_major))
    check_mxfp8(x, E5M2, pk.MXFP8QuantizeConfig(band_tiles_m=2, split_copies=True))
    check_mxfp8(x, E4M3, pk.MXFP8QuantizeConfig(band_tiles_m=1, steps_per_cta_m=2))
    for block in ((1, 128), (128, 128)):
        check_fp8_block(x, E4M3, block, True, pk.FP8BlockQuantizeConfig(band_tiles_m=2))
    config = pk.NVFP4QuantizeConfig(band_tiles_m=2)
    want, amaxes = ref_nvfp4(x, rht=True, sr=True, seeds=SEEDS)
    got = run_nvfp4(x, rht=True, sr=True, amaxes=amaxes, seeds=SEEDS, config=config)
    for g, w, name in zip(got, want, NAMES, strict=True):
        assert_same_bits(g, w, f"nvfp4 band 2 {name}")
    got_amax = pk.nvfp4_amax(x, hadamard_columnwise=True, config=config, interpret=INTERPRET)
    for g, w in zip(got_amax, amaxes, strict=True):
        assert_same_bits(g, w, "nvfp4 amax band 2")
    check_cast_transpose(x.astype(jnp.float32) * 300, E4M3, pk.CastTransposeConfig(band_tiles_m=3))
    d, s, *_ = ref_mxfp8(x, E4M3)
    got = pk.dequantize_mxfp8(d, s, config=pk.DequantizeConfig(band_tiles_m=2), interpret=True)
    assert_same_bits(got, mxfp8.dequantize(d, s), "mxfp8 dequantize band 2", any_nan=True)


@cpu_only
def test_nvfp4_amax_designs_interpret():
    # The direct-load kernel (default; several CTA counts, so CTAs take unequal numbers of
    # units, and load widths) and the TMA tile kernel give the reference's amax bits: padded
    # rows and columns, float32 and bf16, with and without the Hadamard transform, on random
    # data and on data with Inf / NaN / adversarial blocks.
    direct_module = importlib.import_module("pallas_kernels.quantize_nvfp4")
    random = jax.random.normal(jax.random.key(4), (300, 700), jnp.float32)
    inputs = [
        random,
        random.astype(jnp.bfloat16)[:, :512].at[17, 5].set(jnp.inf),
        sample((48, 384), jnp.bfloat16, 39, block=16),
    ]
    for x in inputs:
        for rht in (True, False):
            _, want = ref_nvfp4(x, rht=rht, sr=False, seeds=SEEDS)
            for config in (None, NVFP4_AMAX_TMA):
                got = pk.nvfp4_amax(x, hadamard_columnwise=rht, config=config, interpret=INTERPRET)
                for g, w in zip(got, want, strict=True):
                    assert_same_bits(g, w, f"nvfp4 amax {x.shape} rht={rht} {config}")
            padded_cols = -(-x.shape[1] // 128) * 128
            for ctas, vector in ((3, 1), (5, 2), (2, None)):
                if padded_cols % (128 * (vector or 1)):
                    continue
                partial = direct_module._direct_amax_partials(
                    x, rht, INTERPRET, ctas=ctas, vector=vector
                )
                got = jax.lax.bitcast_convert_type(jnp.max(partial, axis=0), jnp.float32)
                for g, w in zip(got, want, strict=True):
                    assert_same_bits(g, w, f"direct amax {x.shape} rht={rht} {ctas} {vector}")
    with pytest.raises(ValueError, match=r"vector must split x's 768 padded columns"):
        direct_module._direct_amax_partials(random[:, :700], False, INTERPRET, vector=4)
    for config in (None, NVFP4_AMAX_TMA):  # both designs check their arguments
        with pytest.raises(TypeError, match="hadamard_columnwise must be a bool, got 1"):
            pk.nvfp4_amax(random, hadamard_columnwise=1, config=config, interpret=INTERPRET)
        with pytest.raises(ValueError, match="x must be 2-D"):
            pk.nvfp4_amax(random[0], config=config, interpret=INTERPRET)
    with pytest.raises(TypeError, match="amax_direct_loads must be a bool, got 1"):
        pk.NVFP4QuantizeConfig(amax_direct_loads=1)


def check_untile_words(shapes, seed: int, interpret: bool):
    """The untile kernel's word transposes, all arrays in one launch, against numpy."""
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    words = [jax.random.bits(k, shape, jnp.uint32) for k, shape in zip(keys, shapes, strict=True)]
    for got, w in zip(untile_scales._transpose_words(words, interpret), words, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(w).T)


@cpu_only
def test_untile_scales_interpret():
    # Tile-major scales rearranged by the untile kernel (the default): arrays of 32 and 64
    # tiles in one launch; MXFP8 and FP8 block 1×128 with 32 column tiles (the rowwise scales
    # go through the kernel, the columnwise ones, 1 row tile, through XLA).
    check_untile_words([(32, 256), (64, 128)], 28, INTERPRET)
    x = sample((128, 4096), jnp.bfloat16, 29, block=32)
    assert untile_scales.as_words(jnp.zeros((32, 128, 4), jnp.uint8)) is not None
    check_mxfp8(x, E4M3)
    check_fp8_block(x, E5M2, (1, 128), True)


@cpu_only
def test_blocks_of_tiles_along_m_interpret():
    # steps_per_cta_m: a CTA streams a block of tiles, rows of them at a time, through the
    # pipeline (every kernel that runs on `for_each_tile`), also where the input reduces the
    # block to a single tile (a one-step pipeline).
    x = sample((256, 384), jnp.bfloat16, 26, block=16)
    for options in (dict(steps_per_cta_m=2), dict(steps_per_cta=3, steps_per_cta_m=2)):
        config = pk.NVFP4QuantizeConfig(max_concurrent_steps=3, **options)
        want, amaxes = ref_nvfp4(x, rht=True, sr=True, seeds=SEEDS)
        got = run_nvfp4(x, rht=True, sr=True, amaxes=amaxes, seeds=SEEDS, config=config)
        for g, w, name in zip(got, want, NAMES, strict=True):
            assert_same_bits(g, w, f"nvfp4 {options} {name}")
        check_cast_transpose(x.astype(jnp.float32) * 300, E4M3, pk.CastTransposeConfig(**options))
    check_mxfp8(sample((128, 128), jnp.bfloat16, 27, block=32), E4M3, MXFP8_STAGED)


def test_blocks_of_tiles_config_errors():
    with pytest.raises(ValueError, match="steps_per_cta_m must be in"):
        pk.MXFP8QuantizeConfig(steps_per_cta_m=0)
    with pytest.raises(TypeError, match="steps_per_cta_m must be an int"):
        pk.NVFP4QuantizeConfig(steps_per_cta_m=2.0)
    with pytest.raises(TypeError, match="stage_scales must be a bool"):
        pk.FP8BlockQuantizeConfig(stage_scales=1)
    with pytest.raises(ValueError, match="split_copies needs one-tile CTAs"):
        pk.MXFP8QuantizeConfig(split_copies=True, steps_per_cta_m=2)
    with pytest.raises(ValueError, match="reuse_input_tile needs one-tile CTAs"):
        pk.MXFP8QuantizeConfig(reuse_input_tile=True, steps_per_cta_m=2)
    with pytest.raises(ValueError, match="steps_per_cta_m must be 1 for dequantize"):
        pk.DequantizeConfig(steps_per_cta_m=2)
    with pytest.raises(TypeError, match="untile_kernel must be a bool"):
        pk.MXFP8QuantizeConfig(untile_kernel="yes")
    with pytest.raises(ValueError, match=r"scale_outputs must be .* got \(4,\)"):
        untile_scales.untile_line_scales_all([jnp.zeros((4,), jnp.uint8)])
    with pytest.raises(TypeError, match="kernel must be a bool"):
        untile_scales.untile_line_scales_all([jnp.zeros((4, 4), jnp.uint8)], kernel=1)


# NVFP4 codes decoded by integer operations (the default before stop 36, kept as an option):
# the same values as the default float16-bit decode.
NVFP4_INTEGER_DECODE = pk.DequantizeConfig(scaled_e2m1_decode=False)


def test_e2m1_half_bits_give_every_code_s_value_over_2_to_the_14():
    dequantize = importlib.import_module("pallas_kernels.dequantize")
    byte = jnp.arange(256, dtype=jnp.uint32)
    for nibble in (0, 1):
        halves = jax.lax.bitcast_convert_type(dequantize.e2m1_half_bits(byte, nibble), jnp.float16)
        got = np.asarray(halves.astype(jnp.float32)) * np.float32(2.0**14)
        code = (byte >> (4 * nibble)) & 0xF
        want = jax.lax.bitcast_convert_type(dequantize.e2m1_value_bits(code), jnp.float32)
        np.testing.assert_array_equal(got.view(np.uint32), np.asarray(want).view(np.uint32))
    with pytest.raises(ValueError, match=r"nibble must be 0 \(bits 3..0\) or 1 .*got 2"):
        dequantize.e2m1_half_bits(byte, 2)
    with pytest.raises(TypeError, match="scaled_e2m1_decode must be a bool, got 1"):
        pk.DequantizeConfig(scaled_e2m1_decode=1)


@cpu_only
def test_dequantize_interpret():
    x = sample((128, 256), jnp.float32, 5, block=32)
    d, s, *_ = ref_mxfp8(x, E5M2)
    s = s.at[0, 0].set(0).at[1, 1].set(254).at[2, 2].set(255)  # 2^-127, Inf- and NaN-blocks
    got = pk.dequantize_mxfp8(d, s, interpret=True)
    assert_same_bits(got, mxfp8.dequantize(d, s), "mxfp8 dequantize", any_nan=True)
    spec = QuantizerSpec("nvfp4", jnp.float4_e2m1fn, (1, 16))
    amax = common.amax(x)
    d, s = nvfp4.quantize(x, spec, global_amax=amax)
    s = s.at[0, 0].set(jnp.nan).at[1, 1].set(0.0).at[2, 2].set(2.0**-9)  # NaN, 0, tiny
    want = nvfp4.dequantize(d, s, spec, global_amax=amax)
    for config in (None, NVFP4_INTEGER_DECODE):
        got = pk.dequantize_nvfp4(d, s, amax, config=config, interpret=True)
        assert_same_bits(got, want, f"nvfp4 dequantize ({config})", any_nan=True)
        got16 = pk.dequantize_nvfp4(
            d, s, amax, out_dtype=jnp.bfloat16, config=config, interpret=True
        )
        assert_same_bits(got16, want.astype(jnp.bfloat16), "nvfp4 dequantize bf16", any_nan=True)
    spec = QuantizerSpec("fp8_block", E4M3, (128, 128), power_2_scale=False)
    d, s = fp8_block.quantize(x, spec, input_dtype=jnp.float32)
    got16 = pk.dequantize_fp8_block(
        d, s, block_shape=(128, 128), out_dtype=jnp.bfloat16, interpret=True
    )
    want16 = fp8_block.dequantize(d, s, spec).astype(jnp.bfloat16)
    assert_same_bits(got16, want16, "fp8_block 128x128 dequantize to bf16", any_nan=True)


# --- CPU: argument validation --------------------------------------------------------------------
def test_wrappers_reject_bad_arguments():
    x = jnp.zeros((128, 128), jnp.bfloat16)
    with pytest.raises(TypeError, match="x must be bfloat16 or float32"):
        pk.quantize_mxfp8(x.astype(jnp.int32))
    with pytest.raises(ValueError, match="x must be 2-D"):
        pk.quantize_mxfp8(x.reshape(-1))
    with pytest.raises(ValueError, match="rowwise and columnwise are both False"):
        pk.quantize_mxfp8(x, rowwise=False)
    with pytest.raises(TypeError, match="fp8_dtype"):
        pk.quantize_mxfp8(x, fp8_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="tile_m must be 128 or 256"):
        pk.MXFP8QuantizeConfig(tile_m=64)
    with pytest.raises(TypeError, match="tile_k must be an int"):
        pk.NVFP4QuantizeConfig(tile_k=128.0)
    with pytest.raises(TypeError, match="config must be None or of type MXFP8QuantizeConfig"):
        pk.quantize_mxfp8(x, config=pk.NVFP4QuantizeConfig())
    with pytest.raises(TypeError, match="split_copies must be a bool"):
        pk.MXFP8QuantizeConfig(split_copies=1)
    with pytest.raises(TypeError, match="lean_arithmetic must be a bool"):
        pk.MXFP8QuantizeConfig(lean_arithmetic="yes")
    with pytest.raises(ValueError, match="split_copies needs one-tile CTAs"):
        pk.MXFP8QuantizeConfig(split_copies=True, steps_per_cta=2)
    with pytest.raises(TypeError, match="lean_arithmetic must be a bool"):
        pk.NVFP4QuantizeConfig(lean_arithmetic=1)
    with pytest.raises(TypeError, match="loop_blocks must be a bool"):
        pk.NVFP4QuantizeConfig(loop_blocks="yes")
    with pytest.raises(ValueError, match="reuse_input_tile=True needs loop_blocks=False"):
        pk.NVFP4QuantizeConfig(reuse_input_tile=True)
    with pytest.raises(TypeError, match="hadamard_columnwise must be a bool"):
        pk.nvfp4_line_amax_bits(jnp.zeros((16, 32), jnp.bfloat16), hadamard_columnwise=1)
    with pytest.raises(TypeError, match="x must be bfloat16 or float32"):
        pk.nvfp4_line_amax_bits(jnp.zeros((16, 32), jnp.float16))
    with pytest.raises(ValueError, match="x must be 2-D"):
        pk.nvfp4_line_amax_bits(jnp.zeros((32,), jnp.bfloat16))
    with pytest.raises(TypeError, match="reuse_input_tile must be a bool"):
        pk.MXFP8QuantizeConfig(reuse_input_tile=1)
    with pytest.raises(ValueError, match="reuse_input_tile needs one-tile CTAs"):
        pk.NVFP4QuantizeConfig(reuse_input_tile=True, steps_per_cta=2)
    with pytest.raises(ValueError, match="reuse_input_tile needs one-tile CTAs"):
        pk.CastTransposeConfig(reuse_input_tile=True, stage_outputs=False)
    with pytest.raises(ValueError, match="split_copies and reuse_input_tile cannot be combined"):
        pk.MXFP8QuantizeConfig(split_copies=True, reuse_input_tile=True)
    with pytest.raises(TypeError, match="tile_major_scales must be a bool"):
        pk.FP8BlockQuantizeConfig(tile_major_scales=None)
    with pytest.raises(TypeError, match="stage_columnwise_in_input must be a bool"):
        pk.MXFP8QuantizeConfig(stage_columnwise_in_input=1)
    with pytest.raises(ValueError, match="split_copies and stage_columnwise_in_input cannot"):
        pk.MXFP8QuantizeConfig(split_copies=True, stage_columnwise_in_input=True)
    for other in (
        dict(steps_per_cta=2),
        dict(stage_outputs=False),
        dict(reuse_input_tile=True),
    ):
        with pytest.raises(ValueError, match="stage_columnwise_in_input needs one-tile CTAs"):
            pk.CastTransposeConfig(stage_columnwise_in_input=True, **other)
    for config_type in (pk.FP8BlockQuantizeConfig, pk.NVFP4QuantizeConfig, pk.DequantizeConfig):
        with pytest.raises(ValueError, match="stage_columnwise_in_input is not supported by"):
            config_type(stage_columnwise_in_input=True)
    with pytest.raises(ValueError, match="reuse_input_tile needs lean_arithmetic=True"):
        pk.FP8BlockQuantizeConfig(reuse_input_tile=True, lean_arithmetic=False)
    with pytest.raises(ValueError, match="reuse_input_tile must be False for dequantize"):
        pk.DequantizeConfig(reuse_input_tile=True)
    with pytest.raises(ValueError, match="rowwise_amax is required"):
        pk.quantize_nvfp4(x)
    with pytest.raises(ValueError, match="columnwise_seed is required"):
        pk.quantize_nvfp4(
            x,
            rowwise=False,
            columnwise=True,
            columnwise_amax=jnp.float32(1),
            stochastic_rounding=True,
        )
    with pytest.raises(TypeError, match="rowwise_seed must be a uint32 scalar"):
        pk.quantize_nvfp4(
            x, rowwise_amax=jnp.float32(1), stochastic_rounding=True, rowwise_seed=jnp.int32(1)
        )
    with pytest.raises(ValueError, match="block_shape must be one of"):
        pk.quantize_fp8_block(x, block_shape=(1, 32))
    with pytest.raises(ValueError, match="apply to stochastic_rounding"):
        pk.quantize_nvfp4(
            x, rowwise_amax=jnp.float32(1), rowwise_position=(jnp.uint32(0), jnp.uint32(0))
        )
    with pytest.raises(TypeError, match="rowwise_position must be a"):
        pk.quantize_nvfp4(
            x,
            rowwise_amax=jnp.float32(1),
            stochastic_rounding=True,
            rowwise_seed=jnp.uint32(1),
            rowwise_position=(0, 0),
        )
    with pytest.raises(ValueError, match="block_shape must be one of"):
        pk.quantize_nvfp4(x, block_shape=(16, 1), rowwise_amax=jnp.float32(1))
    with pytest.raises(ValueError, match="hadamard_columnwise applies to 1×16 blocks only"):
        pk.quantize_nvfp4(
            x,
            block_shape=(16, 16),
            columnwise=True,
            rowwise_amax=jnp.float32(1),
            columnwise_amax=jnp.float32(1),
            hadamard_columnwise=True,
        )
    with pytest.raises(ValueError, match="128×128 blocks need tile_m = tile_k = 128"):
        pk.quantize_fp8_block(
            x, block_shape=(128, 128), config=pk.FP8BlockQuantizeConfig(tile_k=256)
        )
    with pytest.raises(ValueError, match="bytes of shared memory"):
        pk.quantize_mxfp8(
            jnp.zeros((256, 256), jnp.float32),
            columnwise=True,
            config=pk.MXFP8QuantizeConfig(tile_m=256, tile_k=256),
        )
    with pytest.raises(TypeError, match="scaled must be bfloat16 or float32"):
        pk.cast_transpose_fp8(x.astype(E4M3))
    with pytest.raises(ValueError, match="rowwise and columnwise are both False"):
        pk.cast_transpose_fp8(x, rowwise=False)
    with pytest.raises(TypeError, match="config must be None or of type CastTransposeConfig"):
        pk.cast_transpose_fp8(x, config=pk.MXFP8QuantizeConfig())
    with pytest.raises(ValueError, match="amax_epsilon"):
        pk.quantize_fp8_block(x, amax_epsilon=-1.0)
    with pytest.raises(TypeError, match="lean_arithmetic must be a bool"):
        pk.FP8BlockQuantizeConfig(lean_arithmetic=1)
    with pytest.raises(ValueError, match="128×128 blocks need tile_m = tile_k = 128"):
        pk.quantize_fp8_block(
            x,
            block_shape=(128, 128),
            config=pk.FP8BlockQuantizeConfig(lean_arithmetic=True, tile_m=256),
        )
    with pytest.raises(ValueError, match="scale must have shape"):
        pk.dequantize_mxfp8(x.astype(E4M3), jnp.zeros((128, 3), jnp.uint8))
    with pytest.raises(TypeError, match="out_dtype must be float32 or bfloat16"):
        pk.dequantize_mxfp8(x.astype(E4M3), jnp.zeros((128, 4), jnp.uint8), out_dtype=jnp.float16)
    with pytest.raises(TypeError, match="scale must have dtype"):
        pk.dequantize_nvfp4(jnp.zeros((128, 64), jnp.uint8), jnp.zeros((128, 8)), 1.0)
    with pytest.raises(TypeError, match="global_amax must be a float scalar or None"):
        pk.dequantize_nvfp4(
            jnp.zeros((128, 64), jnp.uint8), jnp.zeros((128, 8), jnp.float8_e4m3fn), jnp.ones(2)
        )


def test_nvfp4_amax_in_kernel_refusals():
    x = jnp.zeros((256, 384), jnp.bfloat16)
    one = jnp.float32(1)
    with pytest.raises(ValueError, match="rowwise_amax must be None with amax_in_kernel=True"):
        pk.quantize_nvfp4(x, rowwise_amax=one, amax_in_kernel=True)
    with pytest.raises(ValueError, match="1×16 blocks without per-line or per-block"):
        pk.quantize_nvfp4(x, block_shape=(16, 16), amax_in_kernel=True)
    with pytest.raises(ValueError, match="1×16 blocks without per-line or per-block"):
        pk.quantize_nvfp4(x, rowwise_line_amax=jnp.ones((256,)), amax_in_kernel=True)
    with pytest.raises(TypeError, match="amax_in_kernel must be a bool"):
        pk.quantize_nvfp4(x, amax_in_kernel=1)
    with pytest.raises(ValueError, match="amax_ctas applies to amax_in_kernel=True only"):
        pk.quantize_nvfp4(x, rowwise_amax=one, amax_ctas=4)
    with pytest.raises(ValueError, match="needs the GPU: the Pallas interpreter has no"):
        pk.quantize_nvfp4(x, amax_in_kernel=True, interpret=True)
    # Traced only (no kernel runs): x has 2 × 3 one-tile CTAs, so at most 6 take the amax.
    with pytest.raises(ValueError, match=r"amax_ctas must be an int in \[1, 6\]"):
        jax.eval_shape(lambda v: pk.quantize_nvfp4(v, amax_in_kernel=True, amax_ctas=7), x)
    with pytest.raises(ValueError, match="needs one-tile CTAs"):
        jax.eval_shape(
            lambda v: pk.quantize_nvfp4(
                v, amax_in_kernel=True, config=pk.NVFP4QuantizeConfig(steps_per_cta=3)
            ),
            x,
        )


# --- CPU: cross-lowering for the H200 ------------------------------------------------------------
def _cross_lower(fn, *args) -> None:
    assert "mosaic_gpu" in export_for_h200(fn, *args).mlir_module()


_AMAX = jnp.float32(3.0)
_X = {dt: jax.ShapeDtypeStruct((256, 384), dt) for dt in (jnp.bfloat16, jnp.float32)}
_TILE_256 = dict(tile_m=256, tile_k=256)


def _nvfp4_rht(x, *, sr=True, **options):
    """Both NVFP4 copies, Hadamard on the columnwise one, stochastic rounding by default
    (gradients; `sr=False`: nearest, as activations)."""
    return pk.quantize_nvfp4(
        x,
        columnwise=True,
        rowwise_amax=_AMAX,
        columnwise_amax=_AMAX,
        hadamard_columnwise=True,
        stochastic_rounding=sr,
        rowwise_seed=jnp.uint32(1) if sr else None,
        columnwise_seed=jnp.uint32(2) if sr else None,
        **options,
    )


def _nvfp4_grouped(x, *, sr=True, **options):
    """Both NVFP4 copies of a grouped tensor (per-line / per-block amaxes, seeds, positions),
    Hadamard on the columnwise copy."""
    rows = x.shape[0]
    lines, blocks = jnp.arange(rows, dtype=jnp.uint32), jnp.arange(rows // 16, dtype=jnp.uint32)
    per_group = dict(
        rowwise_line_amax=jnp.full((rows,), 3.0, jnp.float32),
        columnwise_block_amax=jnp.full((rows // 16,), 5.0, jnp.float32),
    )
    if sr:
        per_group |= dict(
            rowwise_line_seed=lines * jnp.uint32(7),
            rowwise_line_position=lines % jnp.uint32(48),
            columnwise_block_seed=blocks,
            columnwise_block_position=blocks * jnp.uint32(16) % jnp.uint32(48),
        )
    return pk.quantize_nvfp4(
        x,
        columnwise=True,
        hadamard_columnwise=True,
        stochastic_rounding=sr,
        **per_group,
        **options,
    )


def _nvfp4_amax_in_kernel(x, *, sr=True, **options):
    """`_nvfp4_rht` with the global amaxes taken inside the quantize launch."""
    return pk.quantize_nvfp4(
        x,
        columnwise=True,
        hadamard_columnwise=True,
        stochastic_rounding=sr,
        rowwise_seed=jnp.uint32(1) if sr else None,
        columnwise_seed=jnp.uint32(2) if sr else None,
        amax_in_kernel=True,
        **options,
    )


CROSS_LOWERED = {
    "nvfp4 rht+sr row+col, global amax in the kernel": (_nvfp4_amax_in_kernel, jnp.bfloat16),
    "nvfp4 row+col nearest, global amax in the kernel by one CTA": (
        functools.partial(_nvfp4_amax_in_kernel, sr=False, amax_ctas=1),
        jnp.float32,
    ),
    "mxfp8 e4m3 row+col": (lambda x: pk.quantize_mxfp8(x, columnwise=True), jnp.bfloat16),
    "mxfp8 row+col line-major scales, tiles in bands of 3": (
        lambda x: pk.quantize_mxfp8(
            x,
            columnwise=True,
            config=pk.MXFP8QuantizeConfig(tile_major_scales=False, band_tiles_m=3),
        ),
        jnp.bfloat16,
    ),
    "mxfp8 e5m2 col": (
        lambda x: pk.quantize_mxfp8(x, rowwise=False, columnwise=True, fp8_dtype=E5M2),
        jnp.float32,
    ),
    "mxfp8 row+col split copies": (
        lambda x: pk.quantize_mxfp8(x, columnwise=True, config=MXFP8_SPLIT),
        jnp.bfloat16,
    ),
    "mxfp8 row+col lean arithmetic": (
        lambda x: pk.quantize_mxfp8(x, columnwise=True, config=MXFP8_EXACT),
        jnp.bfloat16,
    ),
    "mxfp8 e5m2 row+col split + lean": (
        lambda x: pk.quantize_mxfp8(x, columnwise=True, fp8_dtype=E5M2, config=MXFP8_SPLIT_EXACT),
        jnp.float32,
    ),
    "mxfp8 row+col split, unstaged, 256-row tiles": (
        lambda x: pk.quantize_mxfp8(
            x,
            columnwise=True,
            config=pk.MXFP8QuantizeConfig(split_copies=True, stage_outputs=False, tile_m=256),
        ),
        jnp.bfloat16,
    ),
    "nvfp4 row+col rht sr exact arithmetic": (
        lambda x: _nvfp4_rht(x, config=NVFP4_EXACT),
        jnp.bfloat16,
    ),
    "nvfp4 row+col rht, nearest rounding by grid minima (inline fma.rn.f32)": (
        functools.partial(_nvfp4_rht, sr=False),
        jnp.bfloat16,
    ),
    "mxfp8 row+col reuse_input_tile": (
        lambda x: pk.quantize_mxfp8(x, columnwise=True, config=MXFP8_REUSE),
        jnp.bfloat16,
    ),
    "mxfp8 e5m2 row+col stage_columnwise_in_input": (
        lambda x: pk.quantize_mxfp8(x, columnwise=True, fp8_dtype=E5M2, config=MXFP8_SLABS),
        jnp.float32,
    ),
    "fp8 block 1x128 e5m2 row+col reuse_input_tile": (
        lambda x: pk.quantize_fp8_block(x, columnwise=True, fp8_dtype=E5M2, config=FP8_BLOCK_REUSE),
        jnp.float32,
    ),
    "mxfp8 row 256x256 tiles": (
        lambda x: pk.quantize_mxfp8(x, config=pk.MXFP8QuantizeConfig(**_TILE_256)),
        jnp.bfloat16,
    ),
    "nvfp4 row+col": (
        lambda x: pk.quantize_nvfp4(x, columnwise=True, rowwise_amax=_AMAX, columnwise_amax=_AMAX),
        jnp.bfloat16,
    ),
    "nvfp4 rht+sr row+col": (_nvfp4_rht, jnp.float32),
    "nvfp4 rht+sr row+col, comparison stochastic rounding": (
        functools.partial(_nvfp4_rht, config=NVFP4_COMPARISON_SR),
        jnp.bfloat16,
    ),
    "nvfp4 rht+sr row+col at a shard's positions": (
        functools.partial(
            _nvfp4_rht,
            rowwise_position=(jnp.uint32(4096), jnp.uint32(0)),
            columnwise_position=(jnp.uint32(0), jnp.uint32(4096)),
        ),
        jnp.float32,
    ),
    "nvfp4 grouped rht+sr row+col": (_nvfp4_grouped, jnp.float32),
    "nvfp4 grouped rht+sr row+col exact arithmetic": (
        functools.partial(_nvfp4_grouped, config=NVFP4_EXACT),
        jnp.bfloat16,
    ),
    "nvfp4 grouped rht row+col, 256x256 tiles": (
        functools.partial(_nvfp4_grouped, sr=False, config=pk.NVFP4QuantizeConfig(**_TILE_256)),
        jnp.bfloat16,
    ),
    "nvfp4 grouped rht+sr row+col pipelined": (
        functools.partial(
            _nvfp4_grouped, config=pk.NVFP4QuantizeConfig(steps_per_cta=3, max_concurrent_steps=3)
        ),
        jnp.bfloat16,
    ),
    "nvfp4 rht col": (
        lambda x: pk.quantize_nvfp4(
            x, rowwise=False, columnwise=True, columnwise_amax=_AMAX, hadamard_columnwise=True
        ),
        jnp.bfloat16,
    ),
    "nvfp4 16x16 row+col": (
        lambda x: pk.quantize_nvfp4(
            x, block_shape=(16, 16), columnwise=True, rowwise_amax=_AMAX, columnwise_amax=_AMAX
        ),
        jnp.bfloat16,
    ),
    "nvfp4 16x16 sr col, 256-row tiles": (
        lambda x: pk.quantize_nvfp4(
            x,
            block_shape=(16, 16),
            rowwise=False,
            columnwise=True,
            columnwise_amax=_AMAX,
            stochastic_rounding=True,
            columnwise_seed=jnp.uint32(2),
            config=pk.NVFP4QuantizeConfig(tile_m=256),
        ),
        jnp.float32,
    ),
    "nvfp4 16x16 pipelined": (
        lambda x: pk.quantize_nvfp4(
            x,
            block_shape=(16, 16),
            columnwise=True,
            rowwise_amax=_AMAX,
            columnwise_amax=_AMAX,
            config=pk.NVFP4QuantizeConfig(steps_per_cta=3, max_concurrent_steps=3),
        ),
        jnp.bfloat16,
    ),
    "nvfp4 amax rht": (lambda x: pk.nvfp4_amax(x, hadamard_columnwise=True), jnp.bfloat16),
    "nvfp4 amax": (lambda x: pk.nvfp4_amax(x), jnp.float32),
    "fp8_block 1x128 row+col": (lambda x: pk.quantize_fp8_block(x, columnwise=True), jnp.bfloat16),
    "fp8_block 1x128 fp32 scales e5m2": (
        lambda x: pk.quantize_fp8_block(
            x, columnwise=True, power_2_scale=False, fp8_dtype=E5M2, amax_epsilon=1e-6
        ),
        jnp.float32,
    ),
    "fp8_block 128x128 row+col": (
        lambda x: pk.quantize_fp8_block(x, block_shape=(128, 128), columnwise=True),
        jnp.bfloat16,
    ),
    "mxfp8 pipelined": (
        lambda x: pk.quantize_mxfp8(
            x, columnwise=True, config=pk.MXFP8QuantizeConfig(steps_per_cta=3)
        ),
        jnp.bfloat16,
    ),
    "nvfp4 rht pipelined": (
        lambda x: pk.quantize_nvfp4(
            x,
            columnwise=True,
            rowwise_amax=_AMAX,
            columnwise_amax=_AMAX,
            hadamard_columnwise=True,
            config=pk.NVFP4QuantizeConfig(steps_per_cta=3, max_concurrent_steps=3),
        ),
        jnp.bfloat16,
    ),
    "fp8_block 128x128 pipelined": (
        lambda x: pk.quantize_fp8_block(
            x,
            block_shape=(128, 128),
            columnwise=True,
            config=pk.FP8BlockQuantizeConfig(steps_per_cta=3),
        ),
        jnp.float32,
    ),
    "cast-transpose e4m3 row+col": (
        lambda x: pk.cast_transpose_fp8(x, columnwise=True),
        jnp.float32,
    ),
    "cast-transpose e5m2 col, 256x256 tiles": (
        lambda x: pk.cast_transpose_fp8(
            x,
            rowwise=False,
            columnwise=True,
            fp8_dtype=E5M2,
            config=pk.CastTransposeConfig(**_TILE_256),
        ),
        jnp.bfloat16,
    ),
    "cast-transpose pipelined": (
        lambda x: pk.cast_transpose_fp8(x, columnwise=True, config=PIPELINED["cast_transpose"]),
        jnp.float32,
    ),
    "fp8_block 1x128 256x256 tiles": (
        lambda x: pk.quantize_fp8_block(
            x, columnwise=True, config=pk.FP8BlockQuantizeConfig(**_TILE_256, stage_outputs=False)
        ),
        jnp.bfloat16,
    ),
    "fp8_block 1x128 row+col lean": (
        lambda x: pk.quantize_fp8_block(x, columnwise=True, config=FP8_BLOCK_EXACT),
        jnp.bfloat16,
    ),
    "fp8_block 1x128 lean fp32 scales e5m2 eps": (
        lambda x: pk.quantize_fp8_block(
            x,
            columnwise=True,
            power_2_scale=False,
            fp8_dtype=E5M2,
            amax_epsilon=1e-6,
            config=FP8_BLOCK_EXACT,
        ),
        jnp.float32,
    ),
    "fp8_block 1x128 lean col, fp16 overflow scale": (
        lambda x: pk.quantize_fp8_block(
            x, rowwise=False, columnwise=True, input_dtype=jnp.float16, config=FP8_BLOCK_EXACT
        ),
        jnp.float32,
    ),
    "fp8_block 1x128 lean 256x256 tiles, unstaged": (
        lambda x: pk.quantize_fp8_block(
            x,
            columnwise=True,
            config=pk.FP8BlockQuantizeConfig(
                **_TILE_256, stage_outputs=False, lean_arithmetic=True
            ),
        ),
        jnp.bfloat16,
    ),
    "fp8_block 128x128 row+col lean": (
        lambda x: pk.quantize_fp8_block(
            x, block_shape=(128, 128), columnwise=True, config=FP8_BLOCK_EXACT
        ),
        jnp.bfloat16,
    ),
    "fp8_block 128x128 lean e5m2 fp32 scales pipelined": (
        lambda x: pk.quantize_fp8_block(
            x,
            block_shape=(128, 128),
            columnwise=True,
            fp8_dtype=E5M2,
            power_2_scale=False,
            config=pk.FP8BlockQuantizeConfig(steps_per_cta=3, lean_arithmetic=True),
        ),
        jnp.float32,
    ),
}


@pytest.mark.parametrize("name", list(CROSS_LOWERED))
def test_cross_lowers_for_h200(name):
    fn, dtype = CROSS_LOWERED[name]
    _cross_lower(fn, _X[dtype])


def test_staged_and_untiled_scales_cross_lower_for_h200():
    # Shapes with 32 column tiles (the untile kernel moves the rowwise scales) and with 4×4
    # blocks of tiles (staged scales, TMA out of a (512, 16)-byte stage).
    wide = jax.ShapeDtypeStruct((512, 4096), jnp.bfloat16)
    _cross_lower(lambda x: pk.quantize_mxfp8(x, columnwise=True), wide)
    _cross_lower(lambda x: pk.quantize_fp8_block(x, columnwise=True), wide)
    square = jax.ShapeDtypeStruct((512, 512), jnp.float32)
    _cross_lower(lambda x: pk.quantize_mxfp8(x, columnwise=True, config=MXFP8_STAGED), square)
    _cross_lower(
        lambda x: pk.quantize_fp8_block(x, columnwise=True, config=FP8_BLOCK_STAGED), square
    )


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_dequantize_cross_lowers_for_h200(out_dtype):
    codes = jax.ShapeDtypeStruct((256, 384), E4M3)
    _cross_lower(
        lambda d, s: pk.dequantize_mxfp8(d, s, out_dtype=out_dtype),
        codes,
        jax.ShapeDtypeStruct((256, 12), jnp.uint8),
    )
    for config in (None, NVFP4_INTEGER_DECODE):
        _cross_lower(
            lambda d, s, c=config: pk.dequantize_nvfp4(d, s, _AMAX, out_dtype=out_dtype, config=c),
            jax.ShapeDtypeStruct((256, 192), jnp.uint8),
            jax.ShapeDtypeStruct((256, 24), E4M3),
        )
    for block, scale_shape in (((1, 128), (256, 3)), ((128, 128), (2, 3))):
        _cross_lower(
            lambda d, s, b=block: pk.dequantize_fp8_block(d, s, block_shape=b, out_dtype=out_dtype),
            codes,
            jax.ShapeDtypeStruct(scale_shape, jnp.float32),
        )


# --- GPU: the H200 -------------------------------------------------------------------------------
def poison_device_memory(nbytes: int) -> None:
    """Fill, then free, device buffers so that the next allocations likely reuse memory holding
    0xFF bytes: an output element a kernel never writes then shows up as a mismatch."""
    chunks = [jnp.full((nbytes // 4 + 1,), 0xFFFFFFFF, jnp.uint32) for _ in range(4)]
    jax.block_until_ready(chunks)
    del chunks


gpu_cases = pytest.mark.gpu


@functools.cache
def _adversarial(shape, seed, block):
    return adversarial_matrix(*shape, seed, block=block, subnormals=True)


def gpu_inputs(dtype, seed, block):
    """One large adversarial input (Gaussian blocks at scales 2^-40..2^40, maxima at and around
    format maxima × 2^k, ties, zero / NaN / Inf blocks, subnormals) whose width needs padding.
    (One shape per case: every new shape is another kernel compile on the device.)"""
    return (jnp.asarray(_adversarial((1992, 1000), seed, block)).astype(dtype),)


@gpu_cases
@pytest.mark.parametrize(
    "dtype, fp8_dtype, config",
    [
        (jnp.bfloat16, E4M3, None),
        (jnp.float32, E5M2, None),
        (jnp.bfloat16, E4M3, PIPELINED["mxfp8"]),
        (jnp.bfloat16, E5M2, pk.MXFP8QuantizeConfig(tile_m=256, tile_k=128)),
        (jnp.bfloat16, E4M3, pk.MXFP8QuantizeConfig(stage_outputs=False)),
        (jnp.bfloat16, E4M3, MXFP8_SPLIT),
        (jnp.bfloat16, E4M3, MXFP8_REUSE),
        (jnp.float32, E5M2, MXFP8_REUSE),
        (jnp.bfloat16, E4M3, MXFP8_SLABS),
        (jnp.float32, E5M2, MXFP8_SLABS),
        (jnp.bfloat16, E4M3, pk.MXFP8QuantizeConfig(stage_columnwise_in_input=True, **_TILE_256)),
        (jnp.bfloat16, E4M3, MXFP8_LINE_MAJOR),
        (jnp.float32, E5M2, MXFP8_LINE_MAJOR),
        (jnp.bfloat16, E5M2, pk.MXFP8QuantizeConfig(tile_major_scales=False, tile_m=256)),
        (jnp.bfloat16, E4M3, MXFP8_EXACT),
        (jnp.float32, E5M2, MXFP8_EXACT),
        (jnp.bfloat16, E4M3, MXFP8_SPLIT_EXACT),
        (jnp.float32, E5M2, MXFP8_SPLIT_EXACT),
        (jnp.bfloat16, E4M3, MXFP8_STAGED),
        (jnp.float32, E5M2, MXFP8_STAGED),
        (jnp.bfloat16, E4M3, pk.MXFP8QuantizeConfig(band_tiles_m=8, tile_major_scales=False)),
        (jnp.float32, E5M2, pk.MXFP8QuantizeConfig(band_tiles_m=3)),  # a short last band
    ],
)
def test_gpu_mxfp8_bit_exact(dtype, fp8_dtype, config):
    for x in gpu_inputs(dtype, 0, 32):
        want = ref_mxfp8(x, fp8_dtype)
        poison_device_memory(2 * x.size)
        got = run_mxfp8(x, fp8_dtype, config=config)
        for g, w, name in zip(got, want, NAMES, strict=True):
            assert_same_bits(g, w, f"mxfp8 {name}")


@gpu_cases
def test_gpu_untile_scales_bit_exact():
    # The untile kernel (default) on the hardware: word transposes of the sizes the benchmarks
    # run (8192² / 16384×4096 inputs: 32, 64 and 128 tiles), and both quantizers end to end on
    # an input with 32 tiles each way (both copies through the kernel), poisoned outputs.
    check_untile_words([(64, 8192), (128, 4096), (32, 16384)], 30, False)
    x = jax.random.normal(jax.random.key(31), (4096, 4096), jnp.float32) * 2.0**20
    x = x.at[::37, ::41].set(jnp.inf).at[5::97, ::13].set(jnp.nan).astype(jnp.bfloat16)
    for config in (None, pk.MXFP8QuantizeConfig(untile_kernel=False)):
        poison_device_memory(2 * x.size)
        got = run_mxfp8(x, E4M3, config=config)
        for g, w, name in zip(got, ref_mxfp8(x, E4M3), NAMES, strict=True):
            assert_same_bits(g, w, f"mxfp8 {name} ({config})")
    poison_device_memory(2 * x.size)
    got = run_fp8_block(x, E4M3, (1, 128), True)
    for g, w, name in zip(got, ref_fp8_block(x, E4M3, (1, 128), True), NAMES, strict=True):
        assert_same_bits(g, w, f"fp8_block {name}")


@gpu_cases
@pytest.mark.parametrize(
    "config",
    [
        None,
        MXFP8_EXACT,
        MXFP8_SPLIT_EXACT,
        MXFP8_REUSE,
        MXFP8_SLABS,
        MXFP8_LINE_MAJOR,
        MXFP8_STAGED,
    ],
)
def test_gpu_mxfp8_edge_blocks_bit_exact(config):
    # lean_arithmetic's hardware-only path (no clip, no NaN fix-up, one subnormal multiplier
    # for Inf blocks) meets the blocks it depends on: Inf blocks with huge finite values, NaN
    # blocks of both signs, maxima at 448·2^k ± 1 ulp. Against the CPU reference too.
    x = mxfp8_edge_matrix()
    for fp8_dtype in (E4M3, E5M2):
        for dtype in (jnp.float32, jnp.bfloat16):
            for matrix in (x, x.T.copy()):
                v = jnp.asarray(matrix).astype(dtype)
                want_cpu = ref_mxfp8(jax.device_put(v, jax.devices("cpu")[0]), fp8_dtype)
                poison_device_memory(4 * v.size)
                got = run_mxfp8(v, fp8_dtype, config=config)
                for g, w, w_cpu, name in zip(
                    got, ref_mxfp8(v, fp8_dtype), want_cpu, NAMES, strict=True
                ):
                    assert_same_bits(g, w, f"mxfp8 edge {name} ({config})")
                    assert_same_bits(g, w_cpu, f"mxfp8 edge {name} vs CPU ({config})")


@gpu_cases
@pytest.mark.parametrize(
    "rht, sr, dtype, config, block",
    [
        (False, False, jnp.bfloat16, None, (1, 16)),
        (True, False, jnp.bfloat16, None, (1, 16)),
        (True, True, jnp.float32, None, (1, 16)),
        (True, False, jnp.bfloat16, PIPELINED["nvfp4"], (1, 16)),
        (
            True,
            True,
            jnp.bfloat16,
            pk.NVFP4QuantizeConfig(steps_per_cta=2, steps_per_cta_m=2),
            (1, 16),
        ),
        (
            True,
            True,
            jnp.bfloat16,
            pk.NVFP4QuantizeConfig(reuse_input_tile=True, loop_blocks=False),
            (1, 16),
        ),
        (True, False, jnp.bfloat16, NVFP4_EXACT, (1, 16)),
        (True, True, jnp.float32, NVFP4_EXACT, (1, 16)),
        (False, True, jnp.bfloat16, NVFP4_EXACT, (16, 16)),
        (False, False, jnp.bfloat16, None, (16, 16)),
        (False, True, jnp.float32, PIPELINED["nvfp4"], (16, 16)),
        (True, True, jnp.bfloat16, NVFP4_UNROLLED, (1, 16)),
        (True, False, jnp.bfloat16, NVFP4_UNROLLED, (1, 16)),
        (True, True, jnp.float32, NVFP4_UNROLLED_EXACT, (1, 16)),
        (False, True, jnp.bfloat16, NVFP4_UNROLLED, (16, 16)),
        (True, True, jnp.bfloat16, NVFP4_FLOAT_SR, (1, 16)),
        (False, True, jnp.float32, NVFP4_FLOAT_SR, (16, 16)),
        (True, False, jnp.bfloat16, NVFP4_AMAX_TMA, (1, 16)),
        (False, False, jnp.float32, NVFP4_AMAX_TMA, (1, 16)),
        (True, True, jnp.bfloat16, NVFP4_INTEGER_DIVISION, (1, 16)),
        (False, False, jnp.bfloat16, NVFP4_INTEGER_DIVISION, (16, 16)),
        (True, False, jnp.bfloat16, NVFP4_BITS_AMAX, (1, 16)),
        (True, True, jnp.float32, NVFP4_BITS_AMAX, (1, 16)),
        (False, False, jnp.float32, NVFP4_BITS_AMAX, (16, 16)),
        (False, False, jnp.bfloat16, NVFP4_PER_GROUP, (16, 16)),
        (False, True, jnp.float32, NVFP4_PER_GROUP, (16, 16)),
        (False, False, jnp.bfloat16, dataclasses.replace(NVFP4_PRELOAD, tile_m=256), (16, 16)),
    ],
)
def test_gpu_nvfp4_bit_exact(rht, sr, dtype, config, block):
    for x in gpu_inputs(dtype, 3, 16):
        (want, amaxes) = ref_nvfp4(x, rht=rht, sr=sr, seeds=SEEDS, block=block)
        poison_device_memory(2 * x.size)
        got = run_nvfp4(
            x, rht=rht, sr=sr, amaxes=amaxes, seeds=SEEDS, config=config, block_shape=block
        )
        for g, w, name in zip(got, want, NAMES, strict=True):
            assert_same_bits(g, w, f"nvfp4 {name}")
        kernel_amaxes = jax.jit(lambda v: pk.nvfp4_amax(v, hadamard_columnwise=rht, config=config))(
            x
        )
        for g, w in zip(kernel_amaxes, amaxes, strict=True):
            assert_same_bits(g, w, "nvfp4 global amax")


@gpu_cases
@pytest.mark.parametrize(
    "rht, sr, dtype, block",
    [
        (True, False, jnp.bfloat16, (1, 16)),
        (False, False, jnp.float32, (1, 16)),
        (False, False, jnp.bfloat16, (16, 16)),
        (True, True, jnp.bfloat16, (1, 16)),  # stochastic rounding keeps the mask
    ],
)
def test_gpu_nvfp4_nan_clamp_bit_exact(rht, sr, dtype, block):
    # clamp_clears_nan_blocks (stop 53, opt-in): NaN-amax blocks get code 0 from PTX's
    # min.f32 (a NaN gives the limit 0), which the interpreter spells out: only the hardware
    # runs the instruction. The reference's bits on the adversarial inputs (NaN / Inf blocks).
    test_gpu_nvfp4_bit_exact(rht, sr, dtype, NVFP4_NAN_CLAMP, block)


def planted_maximum_input(shape, dtype, seed, where):
    """Gaussian x with one element 40× its largest elsewhere, at the first or last element
    (`where`), so that only a reduction over every CTA's part finds it."""
    x = np.array(jax.random.normal(jax.random.key(seed), shape, jnp.float32))
    index = (0, 0) if where == "first" else (shape[0] - 1, shape[1] - 1)
    x[index] = -40.0 * np.abs(x).max()
    return jnp.asarray(x).astype(dtype)


@gpu_cases
@pytest.mark.parametrize(
    "rht, sr, dtype, amax_ctas",
    [
        (True, True, jnp.bfloat16, None),
        (True, False, jnp.bfloat16, None),
        (False, False, jnp.float32, None),
        (True, False, jnp.bfloat16, 1),
        (True, True, jnp.float32, 7),
    ],
)
def test_gpu_nvfp4_amax_in_kernel_bit_exact(rht, sr, dtype, amax_ctas):
    # The global amaxes taken inside the quantize launch (`amax_in_kernel`, a grid-wide wait on
    # semaphores): the reference's codes, scales and amaxes, for the adversarial input (NaN /
    # Inf blocks: a NaN amax) and finite inputs whose maximum only one CTA's part holds, one
    # of them 8192 × 4096 (2048 tiles, most CTAs beyond the first wave).
    inputs = [
        *gpu_inputs(dtype, 3, 16),
        planted_maximum_input((1000, 1992), dtype, 4, "first"),
        planted_maximum_input((8192, 4096), dtype, 5, "last"),
    ]
    for x in inputs:
        want, amaxes = ref_nvfp4(x, rht=rht, sr=sr, seeds=SEEDS, block=(1, 16))
        poison_device_memory(2 * x.size)
        got, *got_amaxes = jax.jit(
            lambda v: pk.quantize_nvfp4(
                v,
                columnwise=True,
                hadamard_columnwise=rht,
                stochastic_rounding=sr,
                rowwise_seed=SEEDS[0],
                columnwise_seed=SEEDS[1],
                amax_in_kernel=True,
                amax_ctas=amax_ctas,
            )
        )(x)
        for g, w, name in zip(got, want, NAMES, strict=True):
            assert_same_bits(g, w, f"nvfp4, amax in the kernel, {name} of {x.shape}")
        for g, w in zip(got_amaxes, amaxes, strict=True):
            assert_same_bits(g, w, f"nvfp4 global amax in the kernel of {x.shape}")


@gpu_cases
@pytest.mark.parametrize(
    "rht, sr, dtype, config",
    [
        (True, True, jnp.bfloat16, None),
        (True, False, jnp.bfloat16, None),
        (False, False, jnp.float32, None),
        (True, True, jnp.float32, NVFP4_EXACT),
        (True, True, jnp.bfloat16, PIPELINED["nvfp4"]),
        (True, True, jnp.bfloat16, NVFP4_UNROLLED),
        (True, True, jnp.bfloat16, NVFP4_FLOAT_SR),
        (True, True, jnp.bfloat16, NVFP4_INTEGER_DIVISION),
        (True, False, jnp.bfloat16, NVFP4_BITS_AMAX),
    ],
)
def test_gpu_nvfp4_grouped_bit_exact(rht, sr, dtype, config):
    # First passed on the H200 on 2026-12-01 (the grouped path then joined backend="auto"): 8 uneven
    # groups (one empty) of an aligned 16384-slot buffer, 520 features (padded to 640).
    sizes = [3000, 1, 0, 2500, 4100, 17, 2900, 3700]
    starts = tuple(int(s) for s in np.cumsum([0, *[-(-n // 16) * 16 for n in sizes[:-1]]]))
    x = grouped_sample(16384, 520, dtype, 21, starts=starts)
    args = grouped_arguments(x, rht, sr, starts=starts)
    want = ref_nvfp4_grouped(x, rht=rht, sr=sr, args=args)
    poison_device_memory(2 * x.size)
    got = run_nvfp4_grouped(x, rht=rht, sr=sr, args=args, config=config)
    for g, w, name in zip(got, want, NAMES, strict=True):
        assert_same_bits(g, w, f"nvfp4 grouped {name} ({config})")


_EARLIER_NEAREST_CASES = ["1x16 bf16 rht", "1x16 f32", "16x16", "grouped", "ties", "sign"]


@gpu_cases
@pytest.mark.parametrize(
    "path, case",
    [("magic-number rounding", case) for case in _EARLIER_NEAREST_CASES]
    + [("compare sign", case) for case in [*_EARLIER_NEAREST_CASES, "1x16 bf16 rht sr"]],
)
def test_gpu_nvfp4_earlier_arithmetic_bit_exact(path, case):
    # Paths the defaults replaced, kept as options: nearest rounding by the magic-number
    # sequence (grid_min_rounding=False, stops <= 34) and each code's sign by a compare and a
    # select (float_sign_test=False, stops <= 35). The reference's bits for 1×16 blocks (bf16
    # with the Hadamard transform, f32; with stochastic rounding for the sign), 16×16 weight
    # blocks, a grouped tensor, products within an ulp of E2M1's rounding thresholds (the
    # ties) and the sign of a product past half the smallest subnormal. The magic-number cases
    # passed on the H200 with grid_min_rounding=True (its fma.rn.f32 runs on the hardware
    # only) before it became the default (stop 35), which every other NVFP4 gpu test now runs.
    config = {"magic-number rounding": NVFP4_MAGIC_ROUNDING, "compare sign": NVFP4_COMPARE_SIGN}
    config = config[path]
    blocks = {
        "1x16 bf16 rht": (True, False, jnp.bfloat16, (1, 16)),
        "1x16 bf16 rht sr": (True, True, jnp.bfloat16, (1, 16)),
        "1x16 f32": (False, False, jnp.float32, (1, 16)),
        "16x16": (False, False, jnp.bfloat16, (16, 16)),
    }
    if case in blocks:
        rht, sr, dtype, block = blocks[case]
        test_gpu_nvfp4_bit_exact(rht, sr, dtype, config, block)
    elif case == "grouped":
        test_gpu_nvfp4_grouped_bit_exact(True, False, jnp.bfloat16, config)
    elif case == "ties":
        for amax in (1.0, 3.3e5):
            x = division_sensitive_input((1024, 1024), amax)
            check_nvfp4_over_global_amaxes(x, (amax,), config, rht=False)
    else:
        test_gpu_nvfp4_sign_of_a_product_just_past_half_the_smallest_subnormal(config, False)


@gpu_cases
def test_gpu_nvfp4_comparison_stochastic_rounding_bit_exact():
    # Stops 26-34's stochastic rounding decision (the tie-corrected integer comparison; the
    # default since stop 35 is the carry, whose add.rp.f32 the default gpu tests run): the
    # reference's bits for 1×16 blocks (bf16 with the Hadamard transform, f32), 16×16 weight
    # blocks and a grouped tensor.
    for rht, dtype, block in (
        (True, jnp.bfloat16, (1, 16)),
        (True, jnp.float32, (1, 16)),
        (False, jnp.bfloat16, (16, 16)),
    ):
        test_gpu_nvfp4_bit_exact(rht, True, dtype, NVFP4_COMPARISON_SR, block)
    test_gpu_nvfp4_grouped_bit_exact(True, True, jnp.bfloat16, NVFP4_COMPARISON_SR)


@gpu_cases
@pytest.mark.parametrize("rht, dtype", [(True, jnp.bfloat16), (False, jnp.float32)])
def test_gpu_nvfp4_line_amax_bits(rht, dtype):
    # The grouped NVFP4 quantizer's per-group amaxes under backend="auto" on GPU since this
    # passed on the H200 (2026-12-01, stop 25).
    for x in gpu_inputs(dtype, 5, 16):
        poison_device_memory(2 * x.size)
        check_nvfp4_line_amax_bits(x, rht, interpret=False)


@gpu_cases
@pytest.mark.parametrize(
    "dtype, config",
    [
        (jnp.bfloat16, None),
        (jnp.float32, None),
        (jnp.bfloat16, NVFP4_PER_GROUP),
        (jnp.bfloat16, NVFP4_PER_LINE_BLOCK_AMAXES),
    ],
)
def test_gpu_nvfp4_weight_blocks_on_the_block_amax_kernel(dtype, config):
    # x 263 blocks of 16 wide (the last unit overlaps the one before) and padded rows: the
    # block amax kernel against the reference's bits, then the 16×16 quantizer fed by it (the
    # path jax_qtrain takes for NVFP4 weights) against the reference quantizer.
    x = jnp.asarray(_adversarial((1000, 4200), 36, 16)).astype(dtype)
    poison_device_memory(2 * x.size)
    check_nvfp4_block_amax_bits(x, interpret=False)
    # The quantizer on blocks without NaN / Inf (with them most 16×16 amaxes are alike, and a
    # block given another's amax would not show).
    x = jnp.asarray(_adversarial_without_specials(1000, 4200, 36)).astype(dtype)
    check_nvfp4_from_block_amaxes(x, config, interpret=False, poison=True)


@gpu_cases
@pytest.mark.parametrize(
    "sr, dtype, config",
    [
        (False, jnp.bfloat16, None),
        (True, jnp.float32, None),
        (True, jnp.bfloat16, pk.NVFP4QuantizeConfig(tile_m=256)),
        (False, jnp.bfloat16, pk.NVFP4QuantizeConfig(tile_k=256, loop_blocks=False)),
        (True, jnp.bfloat16, NVFP4_PER_GROUP),
        (False, jnp.float32, dataclasses.replace(NVFP4_PER_GROUP, tile_m=256)),
        (True, jnp.bfloat16, NVFP4_PER_LINE_BLOCK_AMAXES),
    ],
)
def test_gpu_nvfp4_compact_block_amaxes_bit_exact(sr, dtype, config):
    # The kernel's own address arithmetic into the compact (M/16, K/16) block amaxes (the
    # default on the hardware; the interpreter reads per-line copies): rows and columns padded
    # (1000 × 4200), tiles of 256 lines (two lines per thread), unrolled groups, the tile's
    # amaxes preloaded, both roundings. Blocks without NaN / Inf, so that a line given another
    # block row's amaxes shows.
    x = jnp.asarray(_adversarial_without_specials(1000, 4200, 38)).astype(dtype)
    want, amaxes = ref_nvfp4(x, rht=False, sr=sr, seeds=SEEDS, block=(16, 16))
    poison_device_memory(2 * x.size)
    got = run_nvfp4(
        x, rht=False, sr=sr, amaxes=amaxes, seeds=SEEDS, block_shape=(16, 16), config=config
    )
    for g, w, name in zip(got, want, NAMES, strict=True):
        assert_same_bits(g, w, f"nvfp4 16x16 {name} (sr={sr}, {dtype}, {config})")


@gpu_cases
@pytest.mark.parametrize(
    "dtype, rht, config",
    [
        (jnp.bfloat16, True, None),
        (jnp.float32, False, None),
        (jnp.bfloat16, True, NVFP4_INTEGER_DIVISION),
    ],
)
def test_gpu_nvfp4_division_over_global_amaxes(dtype, rht, config):
    # native_division (stop 34) computes each block's 1 / (e4m3 scale · S_dec) with the GPU's
    # float division; the reference with integer long division. Every e4m3 scale under 20
    # global amaxes, S_dec subnormal to huge.
    x = division_sweep_input((2048, 1024), dtype)
    check_nvfp4_over_global_amaxes(x, DIVISION_SWEEP_AMAXES, config, rht)
    for amax in DIVISION_SWEEP_AMAXES[4:]:  # S_dec normal: the model of enc above holds
        x = division_sensitive_input((1024, 1024), amax)
        check_nvfp4_over_global_amaxes(x, (amax,), config, rht=False)


@gpu_cases
@pytest.mark.parametrize(
    "config, sr",
    [(None, False), (None, True), (NVFP4_EXACT, False), (NVFP4_INTEGER_DIVISION, False)],
)
def test_gpu_nvfp4_sign_of_a_product_just_past_half_the_smallest_subnormal(config, sr):
    # Global amax 2688 (S_enc = 1) and a block maximum of 36 give s_b = 6 and enc = fp32(1/6),
    # so x = -3·2^-149 has x·enc = -2^-150·(1 + 2^-25): fp32(x·enc) = -2^-149, while the
    # reference's (x·2^64)·enc rounds to -2^-86 exactly, i.e. "not negative" (code 0). Only the
    # GPU keeps the subnormal x (XLA:CPU flushes it), so only here can a sign shortcut show.
    x = np.zeros((128, 128), np.float32)
    x[0, 0] = 2688.0
    x[1:, 0] = 36.0
    x[1:, 1] = np.float32(-3 * 2.0**-149)
    x = jnp.asarray(x)
    want, amaxes = ref_nvfp4(x, rht=False, sr=sr, seeds=SEEDS)
    poison_device_memory(2 * x.size)
    got = run_nvfp4(x, rht=False, sr=sr, amaxes=amaxes, seeds=SEEDS, config=config)
    for g, w, name in zip(got, want, NAMES, strict=True):
        assert_same_bits(g, w, f"nvfp4 {name} ({config}, sr={sr})")


@gpu_cases
@pytest.mark.parametrize(
    "block, fp8_dtype, pow2, dtype, config",
    [
        ((1, 128), E4M3, True, jnp.bfloat16, None),
        ((1, 128), E5M2, False, jnp.float32, None),
        ((128, 128), E4M3, False, jnp.bfloat16, None),
        ((1, 128), E4M3, True, jnp.bfloat16, PIPELINED["fp8_block"]),
        ((1, 128), E4M3, True, jnp.bfloat16, FP8_BLOCK_REUSE),
        ((128, 128), E5M2, True, jnp.float32, FP8_BLOCK_REUSE),
        ((1, 128), E4M3, True, jnp.bfloat16, FP8_BLOCK_LINE_MAJOR),
        ((1, 128), E5M2, False, jnp.float32, FP8_BLOCK_LINE_MAJOR),
        ((1, 128), E4M3, True, jnp.bfloat16, FP8_BLOCK_STAGED),
        ((1, 128), E5M2, False, jnp.float32, FP8_BLOCK_STAGED),
        ((128, 128), E4M3, True, jnp.bfloat16, FP8_BLOCK_STAGED),
        ((1, 128), E4M3, True, jnp.bfloat16, FP8_BLOCK_EXACT),
        ((1, 128), E5M2, False, jnp.bfloat16, FP8_BLOCK_EXACT),
        ((1, 128), E5M2, True, jnp.float32, FP8_BLOCK_EXACT),
        ((1, 128), E4M3, False, jnp.float32, FP8_BLOCK_EXACT),
        ((128, 128), E4M3, True, jnp.bfloat16, FP8_BLOCK_EXACT),
        ((128, 128), E5M2, False, jnp.float32, FP8_BLOCK_EXACT),
        (
            (1, 128),
            E4M3,
            True,
            jnp.bfloat16,
            dataclasses.replace(FP8_BLOCK_LINE_MAJOR, band_tiles_m=3),
        ),
        (
            (1, 128),
            E4M3,
            True,
            jnp.bfloat16,
            pk.FP8BlockQuantizeConfig(lean_arithmetic=True, tile_m=256, steps_per_cta=2),
        ),
        (
            (1, 128),
            E4M3,
            True,
            jnp.float32,
            pk.FP8BlockQuantizeConfig(lean_arithmetic=True, tile_k=256, stage_outputs=False),
        ),
    ],
)
def test_gpu_fp8_block_bit_exact(block, fp8_dtype, pow2, dtype, config):
    for x in gpu_inputs(dtype, 6, 128):
        want = ref_fp8_block(x, fp8_dtype, block, pow2)
        poison_device_memory(2 * x.size)
        got = run_fp8_block(x, fp8_dtype, block, pow2, config=config)
        for g, w, name in zip(got, want, NAMES, strict=True):
            assert_same_bits(g, w, f"fp8_block {name} ({config})")


@gpu_cases
@pytest.mark.parametrize(
    "config", [None, FP8_BLOCK_EXACT, FP8_BLOCK_REUSE, FP8_BLOCK_LINE_MAJOR, FP8_BLOCK_STAGED]
)
def test_gpu_fp8_block_edge_blocks_bit_exact(config):
    # lean_arithmetic's hardware-only path (no clip, no NaN fix-up: cvt.rn.satfinite) and its
    # scale shortcut meet the blocks they depend on: NaN of both signs, Inf among huge finite
    # values, maxima at fp8_max·2^k, 1.75·2^k and 2^k ± 1 ulp, subnormal maxima (overflowing
    # scales), both copies. Against the GPU and the CPU references.
    x = fp8_block_edge_matrix()
    cases = [
        ((1, 128), E4M3, jnp.float32, True, 0.0),
        ((1, 128), E5M2, jnp.bfloat16, True, 0.0),
        ((1, 128), E4M3, jnp.bfloat16, False, 0.0),
        ((1, 128), E5M2, jnp.float32, False, 1e-30),
        ((1, 128), E4M3, jnp.bfloat16, True, 1e-3),
        ((128, 128), E4M3, jnp.bfloat16, True, 0.0),
        ((128, 128), E5M2, jnp.float32, False, 0.0),
    ]
    for block, fp8_dtype, dtype, pow2, eps in cases:
        for matrix in (x, x.T.copy()):
            v = jnp.asarray(matrix).astype(dtype)
            what = f"{block} {fp8_dtype} {dtype.__name__} pow2={pow2} eps={eps} ({config})"
            want = ref_fp8_block(v, fp8_dtype, block, pow2, eps)
            poison_device_memory(4 * v.size)
            got = run_fp8_block(v, fp8_dtype, block, pow2, config=config, amax_epsilon=eps)
            for g, w, name in zip(got, want, NAMES, strict=True):
                assert_same_bits(g, w, f"fp8_block edge {name} {what}")
            # XLA:CPU flushes subnormal operands (docs/formats.md, platform note), so the codes
            # of subnormal elements differ there by design: against the CPU reference, the
            # same matrix with those elements zeroed.
            flushed = jnp.asarray(flush_subnormals(matrix)).astype(dtype)
            want_cpu = ref_fp8_block(
                jax.device_put(flushed, jax.devices("cpu")[0]), fp8_dtype, block, pow2, eps
            )
            got = run_fp8_block(flushed, fp8_dtype, block, pow2, config=config, amax_epsilon=eps)
            for g, w_cpu, name in zip(got, want_cpu, NAMES, strict=True):
                assert_same_bits(g, w_cpu, f"fp8_block edge {name} vs CPU {what}")


@gpu_cases
@pytest.mark.parametrize(
    "dtype, fp8_dtype, config",
    [
        (jnp.float32, E4M3, None),
        (jnp.float32, E5M2, PIPELINED["cast_transpose"]),
        (jnp.bfloat16, E4M3, pk.CastTransposeConfig(stage_outputs=False)),
        (jnp.float32, E4M3, pk.CastTransposeConfig(reuse_input_tile=True)),
        (jnp.float32, E5M2, pk.CastTransposeConfig(stage_columnwise_in_input=True)),
        (jnp.bfloat16, E4M3, pk.CastTransposeConfig(stage_columnwise_in_input=True)),
        (jnp.bfloat16, E5M2, pk.CastTransposeConfig(steps_per_cta=2, steps_per_cta_m=2)),
    ],
)
def test_gpu_cast_transpose_bit_exact(dtype, fp8_dtype, config):
    x = scaled_sample((1992, 1000), dtype, 14)
    poison_device_memory(2 * x.size)
    check_cast_transpose(x, fp8_dtype, config)


@gpu_cases
def test_gpu_dequantize_bit_exact():
    # (NaN values compare equal whatever their payload; every other bit must match.)
    x = sample((2048, 1024), jnp.float32, 9, block=32, subnormals=True)
    for fp8_dtype in (E4M3, E5M2):
        d, s, *_ = ref_mxfp8(x, fp8_dtype)
        want = mxfp8.dequantize(d, s)
        poison_device_memory(4 * x.size)
        assert_same_bits(pk.dequantize_mxfp8(d, s), want, "mxfp8 dequant", any_nan=True)
        got16 = pk.dequantize_mxfp8(d, s, out_dtype=jnp.bfloat16)
        assert_same_bits(got16, want.astype(jnp.bfloat16), "mxfp8 dequant bf16", any_nan=True)
    spec = QuantizerSpec("nvfp4", jnp.float4_e2m1fn, (1, 16))
    amax = common.amax(x)
    d, s = nvfp4.quantize(x, spec, global_amax=amax)
    # The float16 decode (the default): float16 subnormals on the hardware.
    for config in (None, NVFP4_INTEGER_DECODE):
        poison_device_memory(4 * x.size)
        assert_same_bits(
            pk.dequantize_nvfp4(d, s, amax, config=config),
            nvfp4.dequantize(d, s, spec, global_amax=amax),
            f"nvfp4 dequant ({config})",
            any_nan=True,
        )
    # grouped_matmul_nvfp4_weights' token order, written by the kernel: the same bits reordered.
    from pallas_kernels.grouped_matmul_mx_weights import even_odd_columns

    natural = pk.dequantize_nvfp4(d, s, None, out_dtype=jnp.bfloat16)
    poison_device_memory(4 * x.size)
    assert_same_bits(
        pk.dequantize_nvfp4(d, s, None, out_dtype=jnp.bfloat16, column_order="even_odd"),
        even_odd_columns(natural),
        "nvfp4 dequant even_odd",
        any_nan=True,
    )
    for block in ((1, 128), (128, 128)):
        spec = QuantizerSpec("fp8_block", E4M3, block)
        d, s = fp8_block.quantize(x, spec, input_dtype=jnp.float32)
        poison_device_memory(4 * x.size)
        assert_same_bits(
            pk.dequantize_fp8_block(d, s, block_shape=block),
            fp8_block.dequantize(d, s, spec),
            "fp8_block dequant",
            any_nan=True,
        )
