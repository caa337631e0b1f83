"""NVFP4 (TransformerEngine `NVFP4BlockScaling`), numerics.md §4.

E2M1 codes {0, .5, 1, 1.5, 2, 3, 4, 6} in blocks of 16 (1×16 activations and gradients, 16×16
weight tiles), one E4M3 scale per block, and one float32 global scale per copy. The exact float32
operation order of TransformerEngine's kernel (not the paper's `(vmax / 6) * S_enc`, which differs
at E4M3 ties):

  S_enc = min(fp32(2688 / gamax), FLT_MAX)   (1 if gamax is 0 or S_enc is 0; NaN → FLT_MAX)
  S_dec = fp32(1 / S_enc)
  t     = fp32(S_enc * fp32(1/6))
  s_b   = e4m3_RNE(min(fp32(vmax_b * t), 448))
  enc_b = min(fp32(1 / fp32(fp32(s_b) * S_dec)), FLT_MAX)
  q     = e2m1(clamp(fp32(x * enc_b), ±6))        (RNE; stochastic for gradients)
  value = (q * s_b) * S_dec

Codes are stored two per uint8, element 2i in the low nibble (Hopper kernels cannot emit fp4,
and packing halves the bytes); block scales are stored as float8_e4m3fn.

The columnwise copies of inputs and gradients are first rotated by the 16-point random Hadamard
transform M = diag(s)·H16/4 along the token axis; both wgrad operands are rotated, so the
rotation cancels in the GEMM.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_qtrain.formats import common
from jax_qtrain.formats.spec import QuantizerSpec

BLOCK_SIZE = 16
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
# Distance from each E2M1 magnitude to the next one up (the last is never used: 6 saturates).
_E2M1_STEPS = np.array([0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 2.0, 1.0], np.float32)
_ONE_SIXTH = np.float32(1.0 / 6.0)  # 0x3E2AAAAB

# TransformerEngine's fixed sign vector for the Hadamard transform (bitmask 0xD7E8: bit i set
# where s_i = -1).
HADAMARD_SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], np.float32)


def hadamard_matrix() -> np.ndarray:
    """M = diag(s) · H16 / 4 (Sylvester H, H_2n = [[H, H], [H, -H]]), float64, for tests/docs."""
    h = np.ones((1, 1))
    while h.shape[0] < 16:
        h = np.block([[h, h], [h, -h]])
    return np.diag(HADAMARD_SIGNS.astype(np.float64)) @ h / 4.0


def hadamard16(x: jax.Array) -> jax.Array:
    """x @ M along the last axis, in 16-element groups (last dim must be a multiple of 16).

    Computed as a float32 butterfly with a fixed order (signs, then pair strides 1, 2, 4, 8,
    each pair (a, b) → (a + b, a - b), then × 0.25) so that kernels can reproduce it bit for bit;
    a matmul would leave the summation order to the backend.
    """
    x = x.astype(jnp.float32)
    if x.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"hadamard16 needs a last dim that is a multiple of 16, got {x.shape}")
    leading = x.shape[:-1]
    groups = x.reshape(*leading, -1, BLOCK_SIZE)
    v = jnp.where(jnp.asarray(HADAMARD_SIGNS) < 0, -groups, groups)
    for stride in (1, 2, 4, 8):
        pairs = v.reshape(*v.shape[:-1], BLOCK_SIZE // (2 * stride), 2, stride)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        v = jnp.stack([a + b, a - b], axis=-2).reshape(v.shape)
    return (v * jnp.float32(0.25)).reshape(x.shape)


def inverse_hadamard16(x: jax.Array) -> jax.Array:
    """x @ Mᵀ along the last axis (M is orthogonal, so this undoes `hadamard16` up to fp32
    rounding): Mᵀ = H·diag(s)/4, and hadamard16(x ⊙ s) = (x @ H)/4."""
    signs = jnp.asarray(HADAMARD_SIGNS)
    groups = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, BLOCK_SIZE)
    return (hadamard16(groups * signs) * signs).reshape(x.shape)


def global_encode_scale(global_amax: jax.Array) -> jax.Array:
    """S_enc = min(fp32(2688 / gamax), FLT_MAX), 1 when gamax is 0 or S_enc is 0 (gamax Inf).
    A NaN gamax gives FLT_MAX, like the CUDA kernel's fminf (the PyTorch reference gives NaN)."""
    global_amax = global_amax.astype(jnp.float32)
    s_enc = jnp.fmin(
        common.divide(jnp.float32(common.E2M1_MAX * common.E4M3_MAX), global_amax), common.FLT_MAX
    )
    return jnp.where(common.is_zero(global_amax) | (s_enc == 0), jnp.float32(1.0), s_enc)


def global_decode_scale(global_amax: jax.Array) -> jax.Array:
    """S_dec = fp32(1 / S_enc), the per-tensor factor of every dequantized value."""
    return common.divide(jnp.float32(1.0), global_encode_scale(global_amax))


def e2m1_round_nearest_even(v: jax.Array, negative: jax.Array | None = None) -> jax.Array:
    """E2M1 codes (uint8, 0..15) of float32 values already clamped to ±6, round to nearest even.

    Thresholds from TransformerEngine's `cast_to_fp4x2`: ties at .25, 1.25, 2.5 and 5 go down,
    at .75, 1.75 and 3.5 go up. Negative values get bit 3; -0 and NaN give code 0 (the reference).
    `negative` overrides the sign test `v < 0` (see `_negative_products`).
    """
    a = jnp.abs(v)
    magnitude = (
        (a > 0.25).astype(jnp.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    ).astype(jnp.uint8)
    return magnitude | _sign_bit(v, negative)


def _sign_bit(v: jax.Array, negative: jax.Array | None) -> jax.Array:
    negative = v < 0 if negative is None else negative
    return jnp.where(negative, jnp.uint8(8), jnp.uint8(0))


def _negative_products(x: jax.Array, encode: jax.Array) -> jax.Array:
    """Whether fp32(x * encode) is negative and nonzero, decided on x·2^64 so that a product in
    the subnormal range (a zero code whose sign bit TE still sets) is not flushed to -0 by
    XLA:CPU. Both factors are arrays, so XLA cannot fold the 2^64 back out."""
    return (x * jnp.float32(2.0**64)) * encode < jnp.float32(-(2.0**-86))


# Stochastic rounding draws 8 random bits per element, as TransformerEngine's
# cvt.rs.satfinite.e2m1x4.f32 does (numerics.md §4): one 32-bit hash word gives four elements'
# bytes, so a kernel hashes once per four elements. In each 16-element block, element j takes
# byte j // 4 of the word hashed at the block's column j % 4.
SR_BITS = 8
_WORDS_PER_BLOCK = 4
HASH_ROW_FACTOR = 0x9E3779B1
HASH_COL_FACTOR = 0x85EBCA77


def hash_word(rows: jax.Array, cols: jax.Array, seed: jax.Array) -> jax.Array:
    """A counter-based 32-bit hash of uint32 (row, col) and a uint32 seed (two multiply /
    xor-shift rounds: every input bit reaches every output bit)."""
    h = (rows * jnp.uint32(HASH_ROW_FACTOR)) ^ (cols * jnp.uint32(HASH_COL_FACTOR)) ^ seed
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


def byte_uniforms(random_bytes: jax.Array) -> jax.Array:
    """uint32 values 0..255 → float32 (b + 1/2) / 256: the centres of 256 equal bins of [0, 1),
    so `uniform < frac` rounds up with probability round(256·frac) / 256 (never for frac = 0)."""
    return (random_bytes.astype(jnp.float32) + jnp.float32(0.5)) * jnp.float32(2.0**-SR_BITS)


def stochastic_uniforms(
    shape: tuple[int, int], seed: jax.Array, origin: tuple[jax.Array, jax.Array] | None = None
) -> jax.Array:
    """Uniforms in (0, 1) with 8 random bits per element, from a counter-based hash of the
    element's (row, col) and a uint32 seed — reproducible, and computable inside a kernel.

    Columns are the block axis (16-element blocks from column 0). Element (r, c), j = c mod 16:
    byte j // 4 of `hash_word(r, c − j + j mod 4, seed)` — the word of the block's column
    j mod 4 — through `byte_uniforms`.

    Grouped quantization stores several tensors in one buffer: there `seed` is an array that
    broadcasts against `shape` (each tensor's seed) and `origin` gives (row, col) offsets, also
    broadcastable, subtracted from each element's position (uint32, wrapping), so every tensor
    draws the bits it would draw on its own when its columns start on a block boundary."""
    rows = jax.lax.broadcasted_iota(jnp.uint32, shape, 0)
    cols = jax.lax.broadcasted_iota(jnp.uint32, shape, 1)
    in_block = cols % jnp.uint32(BLOCK_SIZE)
    byte_index = in_block // jnp.uint32(_WORDS_PER_BLOCK)
    word_cols = cols - in_block + in_block % jnp.uint32(_WORDS_PER_BLOCK)
    if origin is not None:
        rows = rows - origin[0].astype(jnp.uint32)
        word_cols = word_cols - origin[1].astype(jnp.uint32)
    words = hash_word(rows, word_cols, seed.astype(jnp.uint32))
    return byte_uniforms((words >> (byte_index * jnp.uint32(SR_BITS))) & jnp.uint32(0xFF))


def e2m1_round_stochastic(
    v: jax.Array, uniforms: jax.Array, negative: jax.Array | None = None
) -> jax.Array:
    """E2M1 codes of float32 values clamped to ±6, rounded up with probability equal to the
    distance from the lower neighbour (unbiased). NaN gives code 0."""
    a = jnp.abs(v)
    lower = (
        (a >= 0.5).astype(jnp.uint8)
        + (a >= 1.0)
        + (a >= 1.5)
        + (a >= 2.0)
        + (a >= 3.0)
        + (a >= 4.0)
        + (a >= 6.0)
    ).astype(jnp.uint8)
    lower_value = jnp.asarray(E2M1_VALUES)[lower]
    # a - lower_value is exact and the step is a power of two, so frac is exact.
    frac = (a - lower_value) * (1.0 / jnp.asarray(_E2M1_STEPS))[lower]
    magnitude = lower + (uniforms < frac).astype(jnp.uint8)
    return magnitude | _sign_bit(v, negative)


def pack_codes(codes: jax.Array) -> jax.Array:
    """(R, C) codes → (R, C/2) bytes, element 2i in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_codes(packed: jax.Array) -> jax.Array:
    """(R, C/2) bytes → (R, C) codes."""
    low, high = packed & 0x0F, packed >> 4
    return jnp.stack([low, high], axis=-1).reshape(packed.shape[0], -1)


def code_values(codes: jax.Array) -> jax.Array:
    """float32 value of each E2M1 code."""
    magnitude = jnp.asarray(E2M1_VALUES)[codes & 0x7]
    return jnp.where((codes & 0x8) != 0, -magnitude, magnitude)


def quantize(
    x2d: jax.Array,
    spec: QuantizerSpec,
    *,
    global_amax: jax.Array,
    seed: jax.Array | None = None,
    origin: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Rowwise copy of a 2-D array (already rotated, for a Hadamard columnwise copy).

    Returns (packed codes (R', C'/2) uint8, block scales (R'/br, C'/16) float8_e4m3fn), with R',
    C' the block-padded dims. `global_amax` is this copy's amax (taken after the rotation);
    `seed` (uint32) is required when `spec.stochastic_rounding`. Both are used elementwise, so
    grouped quantization passes arrays that broadcast against the rows (rowwise) or the block
    columns (columnwise) to give each group its own; `origin`: see `stochastic_uniforms`.
    """
    block_rows, block_cols = spec.block_shape
    padded = common.pad_to_blocks(x2d.astype(jnp.float32), block_rows, block_cols)
    s_enc = global_encode_scale(global_amax)
    s_dec = common.divide(jnp.float32(1.0), s_enc)
    t = s_enc * _ONE_SIXTH
    block_amax = common.block_amax(padded, block_rows, block_cols)
    block_scale = jnp.minimum(block_amax * t, jnp.float32(common.E4M3_MAX)).astype(
        jnp.float8_e4m3fn
    )
    block_scale_f32 = common.materialize(block_scale).astype(jnp.float32)
    encode = jnp.minimum(
        common.divide(jnp.float32(1.0), block_scale_f32 * s_dec), jnp.float32(common.FLT_MAX)
    )
    blocks = common.split_blocks(padded, block_rows, block_cols)
    block_encode = jnp.broadcast_to(encode[:, None, :, None], blocks.shape)
    scaled = (blocks * block_encode).reshape(padded.shape)
    scaled = jnp.clip(scaled, -common.E2M1_MAX, common.E2M1_MAX)
    negative = _negative_products(blocks, block_encode).reshape(padded.shape)
    if spec.stochastic_rounding:
        if seed is None:
            raise ValueError("stochastic rounding needs a seed (pass key= to jax_qtrain.quantize)")
        uniforms = stochastic_uniforms(padded.shape, seed, origin)
        codes = e2m1_round_stochastic(scaled, uniforms, negative)
    else:
        codes = e2m1_round_nearest_even(scaled, negative)
    return pack_codes(codes), block_scale


def dequantize(
    packed: jax.Array, block_scale: jax.Array, spec: QuantizerSpec, *, global_amax: jax.Array
) -> jax.Array:
    """float32 values (q * s_b) * S_dec of an NVFP4 copy (padded shape)."""
    block_rows, block_cols = spec.block_shape
    values = code_values(unpack_codes(packed))
    blocks = common.split_blocks(values, block_rows, block_cols)
    scaled = blocks * block_scale.astype(jnp.float32)[:, None, :, None]
    return scaled.reshape(values.shape) * global_decode_scale(global_amax)
