"""An independent NumPy oracle for the quantization formats, written from numerics.md.

NumPy keeps float32 subnormals (XLA:CPU flushes them), and ml_dtypes' casts round to nearest
even, so this oracle is what TransformerEngine's kernels compute. It works row by row on a 2-D
float32 array already padded to block multiples and returns uint8 bit patterns, so tests compare
bits, never floats (NaN, -0).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
E4M3 = ml_dtypes.float8_e4m3fn
E5M2 = ml_dtypes.float8_e5m2
FP8_MAX = {np.dtype(E4M3): F32(448.0), np.dtype(E5M2): F32(57344.0)}


def _bits(v) -> np.ndarray:
    return np.asarray(v, np.float32).view(np.uint32)


def _from_bits(b) -> np.ndarray:
    return np.asarray(b, np.uint32).view(np.float32)


def fp8_bits(values: np.ndarray, dtype) -> np.ndarray:
    """Saturating round-to-nearest-even FP8 cast, as uint8 bits."""
    limit = FP8_MAX[np.dtype(dtype)]
    with np.errstate(invalid="ignore"):
        codes = np.clip(values, -limit, limit).astype(dtype).view(np.uint8)
    return np.where(np.isnan(values), np.uint8(0x7F), codes)  # CUDA's canonical NaN


def te_scale(amax: np.ndarray, fp8_max, pow2: bool, overflow=FLT_MAX, eps=0.0) -> np.ndarray:
    """numerics.md §1 scale rule, elementwise."""
    amax = np.asarray(amax, np.float32)
    if eps > 0:
        amax = np.maximum(amax, F32(eps))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scale = F32(fp8_max) / amax
    scale = np.where(np.isinf(scale), F32(overflow), scale).astype(np.float32)
    scale = np.where((amax == 0) | ~np.isfinite(amax), F32(1.0), scale).astype(np.float32)
    if pow2:
        scale = _from_bits(_bits(scale) & np.uint32(0xFF800000))
    return scale


def fp8_tensor(x: np.ndarray, dtype, pow2=False, eps=0.0):
    amax = np.max(np.abs(x)) if not np.isnan(x).any() else F32(np.nan)
    scale = te_scale(amax, FP8_MAX[np.dtype(dtype)], pow2, eps=eps)
    with np.errstate(over="ignore", invalid="ignore"):
        codes = fp8_bits(x * scale, dtype)
        scale_inv = (F32(1.0) / scale).astype(np.float32)
    return codes, _bits(scale_inv)


def _blocks(x: np.ndarray, br: int, bc: int) -> np.ndarray:
    r, c = x.shape
    return x.reshape(r // br, br, c // bc, bc).transpose(0, 2, 1, 3).reshape(r // br, c // bc, -1)


def _block_amax(x, br, bc):
    b = _blocks(x, br, bc)
    amax = np.max(np.abs(b), axis=-1)
    return np.where(np.isnan(b).any(axis=-1), F32(np.nan), amax).astype(np.float32)


def _expand(s, br, bc):
    return np.repeat(np.repeat(s, br, axis=0), bc, axis=1)


def fp8_block(x, dtype, block, pow2=True, overflow=FLT_MAX):
    br, bc = block
    scale = te_scale(_block_amax(x, br, bc), FP8_MAX[np.dtype(dtype)], pow2, overflow=overflow)
    with np.errstate(over="ignore", invalid="ignore"):
        codes = fp8_bits(x * _expand(scale, br, bc), dtype)
        scale_inv = (F32(1.0) / scale).astype(np.float32)
    return codes, _bits(scale_inv)


def e8m0(amax: np.ndarray, fp8_max) -> np.ndarray:
    """numerics.md §3 pseudo-code, literally."""
    out = np.zeros(amax.shape, np.uint8)
    for idx, a in np.ndenumerate(amax):
        with np.errstate(under="ignore", invalid="ignore"):
            v = F32(a) / F32(fp8_max)
        if np.isnan(v):
            out[idx] = 0xFF
            continue
        if np.isinf(v):
            out[idx] = 0xFE
            continue
        b = int(_bits(v))
        e, m = b >> 23, b & 0x7FFFFF
        if m > 0 and e != 0xFE and not (e == 0 and m <= 0x400000):
            e += 1
        out[idx] = e
    return out


def mxfp8(x, dtype):
    fp8_max = FP8_MAX[np.dtype(dtype)]
    byte = e8m0(_block_amax(x, 1, 32), fp8_max)
    e = byte.astype(np.int64)
    mult_bits = np.where(e <= 253, (254 - np.minimum(e, 253)) << 23, 0x00400000)
    mult = _from_bits(mult_bits.astype(np.uint32))
    mult = np.where(e == 255, F32(np.nan), mult).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        codes = fp8_bits(x * _expand(mult, 1, 32), dtype)
    return codes, byte


E2M1_GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def e2m1_rne(v: np.ndarray) -> np.ndarray:
    """Codes from ml_dtypes' float4_e2m1fn cast (RNE, saturating), with the reference's NaN → 0
    and -0 → 0 conventions."""
    codes = np.abs(v).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x7
    codes = np.where(np.isnan(v), 0, codes)
    return (codes | np.where(v < 0, 8, 0)).astype(np.uint8)


def nvfp4(x, block, global_amax, uniforms=None):
    """Returns (codes (R, C) uint8 unpacked, block scale bits uint8, dequantized float32)."""
    br, bc = block
    ga = F32(global_amax)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        s_enc = np.fmin(F32(2688.0) / ga, FLT_MAX).astype(np.float32)
        if ga == 0 or s_enc == 0:
            s_enc = F32(1.0)
        s_dec = F32(1.0) / s_enc
        t = F32(s_enc * F32(1.0 / 6.0))
        vmax = _block_amax(x, br, bc)
        s_b = np.minimum((vmax * t).astype(np.float32), F32(448.0)).astype(E4M3)
        s_b32 = s_b.astype(np.float32)
        enc = np.minimum(F32(1.0) / (s_b32 * s_dec).astype(np.float32), FLT_MAX).astype(np.float32)
        scaled = np.clip((x * _expand(enc, br, bc)).astype(np.float32), -6, 6)
    if uniforms is None:
        codes = e2m1_rne(scaled)
    else:
        a = np.abs(scaled)
        lower = np.searchsorted(E2M1_GRID, a, side="right") - 1
        lower = np.where(np.isnan(a), 0, lower)
        upper = np.minimum(lower + 1, 7)
        lo, hi = E2M1_GRID[lower], E2M1_GRID[upper]
        with np.errstate(invalid="ignore", divide="ignore"):
            frac = np.where(upper > lower, (a - lo) / (hi - lo), 0)
        mag = lower + (uniforms < frac)
        codes = (mag | np.where(scaled < 0, 8, 0)).astype(np.uint8)
    values = np.where(codes & 8, -1, 1) * E2M1_GRID[codes & 7]
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        deq = ((values * _expand(s_b32, br, bc)).astype(np.float32) * s_dec).astype(np.float32)
    return codes, s_b.view(np.uint8), deq
