"""NVFP4 quantize kernels (Mosaic GPU, Hopper): 1×16 or 16×16 blocks, rowwise and columnwise copies.

`quantize_nvfp4` reads a bf16 / f32 (M, K) array once and writes, in the same pass,
  rowwise:    packed E2M1 codes (M, K/2) uint8 (element 2i in the low nibble) and E4M3 block
              scales (M, K/16);
  columnwise: the same for xᵀ, (K, M/2) and (K, M/16), optionally rotated first by the 16-point
              Hadamard transform along M (numerics.md §4) and optionally rounded stochastically.
Each copy has its own float32 global amax, which must be known before quantizing: get it from
`nvfp4_amax` (a separate reduction kernel that reads x once for both copies, rotating the
columnwise copy on the fly) or from any other reduction. For a buffer holding several tensors
(grouped), `nvfp4_line_amax_bits` gives each row's and each 16-row block's amax in one pass.
`quantize_nvfp4(..., amax_in_kernel=True)` takes the global amaxes inside its own launch
instead (GPU only); measured 26% slower than the separate kernel (stop 50), it is not the
library's path.

Exact float32 operation order (TransformerEngine's, as in jax_qtrain/formats/nvfp4.py):
  S_enc = min(fp32(2688 / gamax), FLT_MAX) (1 if gamax is 0 or S_enc is 0); S_dec = fp32(1/S_enc)
  t = fp32(S_enc · fp32(1/6)); s_b = e4m3_RNE(min(fp32(vmax_b · t), 448))
  enc_b = min(fp32(1 / fp32(fp32(s_b) · S_dec)), FLT_MAX); q = e2m1(clamp(fp32(x · enc_b), ±6))
The sign nibble bit is set when fp32(x·enc_b) is negative and nonzero, decided on
(x·2^64)·enc_b like the reference so flushed subnormal products agree. Stochastic rounding
uses the reference's 8 random bits per element, from a counter hash of (row, col) in the copy
and a uint32 seed (one hash word per four elements), so kernel and reference draw the same bits.

Weights' 16×16 blocks (`block_shape=(16, 16)`): one E4M3 scale per 16×16 block, shared by
both copies (the columnwise copy is the rowwise one transposed). A block's amax spans 16 lines,
i.e. 16 threads of the row-per-thread layout, so it is not reduced in the quantize kernel:
`nvfp4_block_amax_bits` takes the 16×16 block amaxes in a pass of its own (one block per
thread; 1/256 of x's elements come out, and their maximum is the global amax, so that pass
replaces `nvfp4_amax` for weights). Each thread of the quantize kernel reads its line's block
amaxes from that (M/16, K/16) array by its own address arithmetic (row line / 16; the
columnwise copy reads it down a column; `NVFP4QuantizeConfig.compact_block_amaxes`), or, in
the interpreter, from copies the wrapper repeats along each block's 16 lines; it then
quantizes exactly as for 1×16 blocks, with the given amax in place of the line's own. Scales
come out per line and are cut to one row per block ((M16/16, K16/16) and (K16/16, M16/16), the
reference's layout); codes are (M16, K16/2) and (K16, M16/2).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, vector
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import grouped_matmul_common as gmc
from pallas_kernels import quantize_common as qc
from pallas_kernels.float32_division import divide
from pallas_kernels.manual_axes import varying_like

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
ONE_SIXTH = np.float32(1.0 / 6.0)  # 0x3E2AAAAB
# TransformerEngine's fixed Hadamard sign vector (bitmask 0xD7E8).
HADAMARD_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
# E2M1 round-to-nearest-even thresholds (TE's cast_to_fp4x2): (threshold, inclusive).
_RNE_THRESHOLDS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# 1 / (distance to the next E2M1 value); exact powers of two.
_E2M1_INVERSE_STEPS = (2.0, 2.0, 2.0, 2.0, 1.0, 1.0, 0.5, 1.0)
# Rows of the per-copy scalar table passed to the kernel; also the columns of the per-group
# tables (`group_table`): bits of t and S_dec, then the seed and the hashed position.
_T, _S_DEC = 0, 1
_SEED, _POSITION = 2, 3


@dataclasses.dataclass(frozen=True)
class NVFP4QuantizeConfig(qc.TileConfig):
    """Tuning knobs of the NVFP4 kernels (see `qc.TileConfig`).

    Attributes (besides `qc.TileConfig`'s):
      lean_arithmetic: the same bits with fewer operations per element (counted in the lowered
        module by benchmarks/count_quantize_ops.py: -7% rounding to nearest, -33% with
        stochastic rounding). NaN codes are fixed per block, not per element: a product
        fp32(x·enc) is NaN only in a block whose amax is NaN (elsewhere enc is finite and
        nonzero, so an Inf element gives ±Inf; a NaN global amax gives S_enc = FLT_MAX through
        fmin, not NaN), so one mask per block clears the packed codes of such blocks.
        Stochastic rounding comes from the nearest-even rounding (`e2m1_stochastic`). The same
        operations in the interpreter and on the hardware (no hardware-only shortcut). The
        default since stop 22: bit-identical on the H200 and 1.06-1.08x faster (1.40x with
        stochastic rounding) in alternation timing; False keeps the first kernel's arithmetic
        (the reference's operations one for one). Both draw the same random bits.
      loop_blocks: quantize each line's 16-element blocks in a loop over groups of four
        instead of unrolled over the whole tile, so a copy's code is emitted once per group,
        not once per tile. Unrolled, the row+col tile with stochastic rounding is ~12.6k PTX
        instructions, straight-line code that the SM streams through its instruction cache
        once per CTA. The same bits. The default since stop 24 (2026-12-01): on the H200, row +
        Hadamard col, 8192² bf16, in alternation, 1.57× faster with stochastic rounding (324
        vs 510 µs) and 1.04× without (211 vs 220). False: unrolled (required with
        `reuse_input_tile`, whose held stores cannot leave the loop).
      integer_stochastic_rounding: decide stochastic rounding on integers
        (`e2m1_stochastic_integer`): each element's random byte b, placed as (b + ½)/256 of a
        grid step in fixed point (`byte_thresholds`), against the fraction bits of |x·enc|
        itself (of |x·enc| + 1 below 1, whose rounding error breaks a tie), instead of a float
        uniform against a float fraction. The same decisions, so the same bits (the reference's
        bits in the interpreter and on the H200); fewer operations per element (counted by
        benchmarks/count_quantize_ops.py: 97.9 -> 85.9 for row + Hadamard col). None (the
        default) means `lean_arithmetic`'s value: the default since stop 26 (2026-12-01), on
        the H200 row + Hadamard col with stochastic rounding, bf16, in alternation, 1.11x
        faster (8192²: 296.5 vs 331.5 µs; 16384x4096: 301.5 vs 334.7). True needs
        `lean_arithmetic`; False keeps the lean float comparison.
      amax_direct_loads: the global-amax kernel (`nvfp4_amax`) loads x straight from global
        memory into registers, grid-stride over 16-row units (True), instead of one TMA tile
        per CTA through shared memory (False). The same bits; the TMA kernel is kept to
        measure against (benchmarks/nvfp4_amax_ab.py). `nvfp4_line_amax_bits` always uses tiles.
      native_division: each block's encode scale 1 / (scale · S_dec) by the platform's float
        reciprocal (True) instead of `float32_division.divide`'s integer long division
        (False: four uint32 divisions, each a ~20-instruction sequence on the GPU, and ~50
        other operations per block and copy). The same bits (`qc.ieee_reciprocal`): on the
        GPU the kernel emits PTX's `rcp.rn.f32`, which is IEEE (round to nearest even,
        subnormals kept; Mosaic GPU's own lowering of `1 / x` is `rcp.approx.f32`, whose codes
        differed on the H200), and in the interpreter XLA:CPU's division, IEEE but for
        subnormal quotients, which cannot arise: the divisor is at most 448 · S_dec ≤
        FLT_MAX / 6 ≈ 2^125.4. (The jnp reference keeps the integer division because
        XLA:GPU's float division is approximate.) The default since stop 34 (2026-12-02): on
        the H200, row + Hadamard col, bf16, in alternation, 214.0 → 150.0 µs (8192²) and
        210.4 → 143.4 µs (16384×4096); with stochastic rounding 307.1 → 232.6.
      packed_row_amax: the rowwise copy's 1×16 block amaxes taken on bf16 x's bit patterns,
        two to a 32-bit integer operation (`qc.abs_patterns`, as MXFP8 and FP8 block do),
        before the values are widened to float32; False widens first and takes the amax on
        float32 patterns (one operation per element more). The same bits: bf16 patterns << 16
        are the float32 ones. float32 x: no difference. Within noise on the H200 (stop 34:
        150.0 / 150.5 µs for 8192², 143.4 / 139.3 for 16384×4096 without / with it).
      carry_stochastic_rounding: stochastic rounding's integer decision as one carry
        (`e2m1_stochastic_carry`): ((bits(a) + (2^22 − 1) − threshold) >> 22) − 252, below 1
        on the bits of 1 + a rounded up (PTX add.rp.f32; XLA's ceil in the interpreter)
        instead of the tie-corrected comparison (~8 operations per element instead of ~17).
        The same decisions, so the same bits (tested in the interpreter against
        `e2m1_stochastic_integer` for every byte and against the reference; on the H200 by
        every NVFP4 `gpu` test with stochastic rounding). The default since stop 35
        (2026-12-02): row + Hadamard col with stochastic rounding, bf16, in alternation on
        the H200, 228.1 → 165.4 µs (8192²) and 226.6 → 165.9 µs (16384×4096), the same
        bits. None (the default) means `integer_stochastic_rounding`'s value; True needs it;
        False keeps stops 26-34's tie-corrected comparison.
      grid_min_rounding: round to nearest by `e2m1_nearest_grid_min`: the smallest of three
        float roundings, one per spacing of E2M1's grid (fused multiply-adds and minima, the
        FMA pipe's work), instead of `e2m1_nearest`'s integer sequence (the ALU pipe's, the
        busiest: 76.6% of its peak for row + Hadamard col on the H200 under Nsight Compute,
        FMA 35%). The same codes for every float32 (checked exhaustively on [0, 6]; on the
        H200 by `test_gpu_nvfp4_bit_exact` and friends, and by quantize_ab's bit check with
        NaN / Inf / huge / tiny / zero blocks). None (the default) means `lean_arithmetic`'s
        value: the default since stop 35 (2026-12-02), on the H200 row + Hadamard col, bf16,
        nearest rounding, the kernel alone in alternation 139.5 → 130.1 µs (8192²) and
        140.7 → 129.3 µs (16384×4096). True needs `lean_arithmetic`; False keeps
        `e2m1_nearest`.
      float_sign_test: put each code's sign bit in with FMA-pipe instructions
        (`negative_units`): the sign test r = fp32(x · enc·2^64) < −2^-86 as the saturated
        fused multiply-add sat(r · −2^110 − 2^24), exactly 1.0 or 0.0, then added as 8 · that
        to nearest rounding's float 2^23 + code (grid-min rounding) or to the carry's code
        (stochastic rounding) in the same integer add. Replaces a compare, a select and a
        logic operation per element (the ALU pipe's, still the busiest after grid-min rounding
        on the H200: 73% against FMA's 38%, Nsight Compute, stop 36) by two FMA-pipe ones and
        at most one add. The same bits (the equivalence of the two sign tests is checked on
        every float32 near −2^-86 and on samples elsewhere, tests/pallas_kernels). None (the
        default) means `lean_arithmetic`'s value; True needs it; False keeps the compare
        and select.
      float_block_amax: on the hardware, the amax of a block taken in float32 (a NaN-
        propagating max of |v|, PTX `max.NaN.f32`, whose absolute values ptxas can take as
        operand modifiers) wherever it is taken on float32 values (the Hadamard columnwise
        copy, float32 input) instead of on bit patterns (an and and an integer max per
        element); bf16 rows keep their packed 16-bit amax. The same bits but for a NaN block's
        amax payload, which only its NaN-ness reaches (the block scale's NaN code and the
        block's cleared codes). The interpreter keeps the bit patterns (XLA:CPU would read
        subnormals as zero), so only the `gpu` tests check it (they passed with it on the
        H200, NaN / Inf / subnormal blocks included). The default since stop 36: row +
        Hadamard col, the kernel alone in alternation on the H200 (2026-12-02), 124.7 ->
        122.9 µs (8192²) and 124.5 -> 123.7 (16384×4096); with stochastic rounding 163.9 ->
        161.4 and 163.1 -> 161.2. False keeps the bit patterns everywhere.
      preload_block_amaxes: 16×16 blocks only: each thread loads its lines' block amaxes for
        the whole tile, both copies, from global memory when the tile starts (8 words per line
        and copy at 128-wide tiles), so the columnwise copy's loads wait under the rowwise
        copy's work, instead of 4 words per group of four blocks just before the group (with
        `loop_blocks`, four global-load latencies per tile in sequence, each waited for). The
        same values, so the same bits; a group picks its four words from the tile's by selects.
        The default since stop 38: reading per-line copies (stop 37) it was 5% slower (H200,
        `quantize_ab.py --kernel nvfp4_weight`, in alternation, the block-amax pass included:
        192.3 -> 202.2 µs for 8192²); with `compact_block_amaxes` (each load then an address
        computation per line and block, which per-group loads repeat inside the group loop:
        probably why) preloading was 2.1–2.4% faster in each of three runs (8192²: 155.7 -> 152.0,
        156.8 -> 153.5, 153.6 -> 148.7 µs; 16384×4096 alike). False loads per group.
      compact_block_amaxes (default True; hardware only): 16×16 blocks only: the kernel reads
        the blocks' amaxes from the (M/16, K/16) array `nvfp4_block_amax_bits` gives, thread t
        computing its line's addresses (row (line0 + t) / 16; for the columnwise copy the same
        array read down a column), instead of from one copy of them per line and copy that XLA
        writes first (two (lines, blocks) arrays, 16 MiB each for an 8192² weight). The same
        words, so the same bits. The interpreter cannot run the inline address arithmetic and
        always reads the per-line copies (False does too on the hardware).
      clamp_clears_nan_blocks (stop 53, off: 0.998x the default on an H100, in alternation;
        the same bits there, docs/benchmarks.md; not yet timed on an H200): nearest rounding by grid
        minima with the float sign test (the defaults) clamps |x·enc| at a per-block limit, 6
        or, in a block whose amax is NaN, 0, by a clamp that gives a NaN its limit (PTX
        `min.f32`, `qc.min_ignoring_nan`), so such a block's NaN products get code 0 and its
        sign test 0; the mask that cleared its packed codes (one AND per pair of elements of
        each copy, the ALU pipe's) goes, for one compare and select per block. The same bits
        (every product of a NaN-amax block is NaN, and no other block has a NaN product: see
        `lean_arithmetic`). No effect on stochastic rounding, which keeps the mask.

    Lean arithmetic's sign test multiplies x by enc · 2^64, formed once per block, instead of
    (x · 2^64) · enc: one multiply per element less, the same products
    (`quantize_block_lines`).
    """

    lean_arithmetic: bool = True
    loop_blocks: bool = True
    integer_stochastic_rounding: bool | None = None
    amax_direct_loads: bool = True
    native_division: bool = True
    packed_row_amax: bool = True
    carry_stochastic_rounding: bool | None = None
    grid_min_rounding: bool | None = None
    float_sign_test: bool | None = None
    float_block_amax: bool = True
    preload_block_amaxes: bool = True
    compact_block_amaxes: bool = True
    clamp_clears_nan_blocks: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.integer_stochastic_rounding is None:  # frozen: resolved once, here
            object.__setattr__(self, "integer_stochastic_rounding", self.lean_arithmetic)
        if self.grid_min_rounding is None:
            object.__setattr__(self, "grid_min_rounding", self.lean_arithmetic)
        if self.carry_stochastic_rounding is None:
            object.__setattr__(self, "carry_stochastic_rounding", self.integer_stochastic_rounding)
        if self.float_sign_test is None:
            object.__setattr__(self, "float_sign_test", self.lean_arithmetic)
        for name in (
            "lean_arithmetic",
            "loop_blocks",
            "integer_stochastic_rounding",
            "amax_direct_loads",
            "native_division",
            "packed_row_amax",
            "carry_stochastic_rounding",
            "grid_min_rounding",
            "float_sign_test",
            "float_block_amax",
            "preload_block_amaxes",
            "compact_block_amaxes",
            "clamp_clears_nan_blocks",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.integer_stochastic_rounding and not self.lean_arithmetic:
            raise ValueError(
                "integer_stochastic_rounding=True needs lean_arithmetic=True (it replaces the "
                "lean stochastic rounding's float comparison); pass integer_stochastic_rounding="
                "None to follow lean_arithmetic (also when replacing fields of a config whose "
                "default resolved it to True)"
            )
        if self.carry_stochastic_rounding and not self.integer_stochastic_rounding:
            raise ValueError(
                "carry_stochastic_rounding=True needs integer_stochastic_rounding=True (it "
                "decides the integer comparison as a carry); pass carry_stochastic_rounding="
                "None to follow integer_stochastic_rounding (also when replacing fields of a "
                "config whose default resolved it to True)"
            )
        if self.grid_min_rounding and not self.lean_arithmetic:
            raise ValueError(
                "grid_min_rounding=True needs lean_arithmetic=True; pass grid_min_rounding=None "
                "to follow lean_arithmetic (also when replacing fields of a config whose "
                "default resolved it to True)"
            )
        if self.float_sign_test and not self.lean_arithmetic:
            raise ValueError(
                "float_sign_test=True needs lean_arithmetic=True; pass float_sign_test=None to "
                "follow lean_arithmetic (also when replacing fields of a config whose default "
                "resolved it to True)"
            )
        if self.loop_blocks and self.reuse_input_tile:
            raise ValueError(
                "reuse_input_tile=True needs loop_blocks=False: the codes held for the input "
                "tile's memory cannot leave the block loop"
            )


class NVFP4Quantized(NamedTuple):
    """Outputs of `quantize_nvfp4`; a copy that was not requested is None."""

    rowwise_data: jax.Array | None
    rowwise_scale: jax.Array | None
    columnwise_data: jax.Array | None
    columnwise_scale: jax.Array | None


# ----------------------------------------------------------------------------------------------
# Per-copy global scales (plain jnp, outside the kernel; same expressions as the reference).


def global_encode_scale(global_amax: jax.Array) -> jax.Array:
    """S_enc = min(fp32(2688 / gamax), FLT_MAX); 1 when gamax is 0 or S_enc is 0."""
    global_amax = jnp.asarray(global_amax, jnp.float32)
    quotient = divide(jnp.float32(E2M1_MAX * E4M3_MAX), global_amax)
    # fmin(quotient, FLT_MAX) (NaN and +Inf give FLT_MAX) in compares and selects, which the
    # quantize kernel's own global amax (`_global_amax_prologue`) lowers too.
    flt_max = jnp.float32(qc.FLT_MAX)
    s_enc = jnp.where(quotient <= flt_max, quotient, flt_max)
    is_zero = (lax.bitcast_convert_type(global_amax, jnp.uint32) & jnp.uint32(qc.ABS_MASK)) == 0
    return jnp.where(is_zero | (s_enc == 0), jnp.float32(1.0), s_enc)


def copy_scalars(global_amax: jax.Array) -> jax.Array:
    """[t, S_dec] of one copy as a float32 vector."""
    s_enc = global_encode_scale(global_amax)
    return jnp.stack([s_enc * ONE_SIXTH, divide(jnp.float32(1.0), s_enc)])


# ----------------------------------------------------------------------------------------------
# In-kernel pieces. Every array is (R, c) held row-per-thread: all work stays in one thread.


def hadamard16_lines(v: jax.Array) -> jax.Array:
    """x ⊙ s, then butterflies of strides 1, 2, 4, 8 ((a, b) → (a + b, a − b)), then × 0.25,
    along each row of a (R, 16) float32 array: the reference's exact operation order."""
    return qc.concat_columns(hadamard16_of_lines([v[:, i : i + 1] for i in range(BLOCK)]))


def hadamard16_of_lines(lines: list[jax.Array]) -> list[jax.Array]:
    """`hadamard16_lines` on 16 float32 arrays of one shape, element by element: the i-th
    output holds, at each position, element i of the transform of the 16 inputs' values
    there (the same operations in the same order)."""
    lines = [-line if sign < 0 else line for line, sign in zip(lines, HADAMARD_SIGNS, strict=True)]
    for stride in (1, 2, 4, 8):
        out = list(lines)
        for start in range(0, BLOCK, 2 * stride):
            for i in range(start, start + stride):
                a, b = lines[i], lines[i + stride]
                out[i], out[i + stride] = a + b, a - b
        lines = out
    return [line * jnp.float32(0.25) for line in lines]


def _count(conditions) -> jax.Array:
    """Number of true conditions, as uint32 (selects: bool casts do not lower everywhere)."""
    total = None
    for condition in conditions:
        term = jnp.where(condition, jnp.uint32(1), jnp.uint32(0))
        total = term if total is None else total + term
    return total


def _select_by_index(index: jax.Array, table) -> jax.Array:
    """table[index] for a small static float table and a uint32 index array."""
    out = jnp.full(index.shape, table[0], jnp.float32)
    for i, value in enumerate(table[1:], start=1):
        if value != table[i - 1]:
            out = jnp.where(index >= i, jnp.float32(value), out)
    return out


def e2m1_magnitude_nearest(a: jax.Array) -> jax.Array:
    """E2M1 magnitude code (0..7) of |v| ≤ 6, round to nearest even; NaN → 0."""
    return _count(a >= t if inclusive else a > t for t, inclusive in _RNE_THRESHOLDS)


def e2m1_magnitude_stochastic(a: jax.Array, uniforms: jax.Array) -> jax.Array:
    """Round |v| ≤ 6 up with probability (a − lower) / step; NaN → 0."""
    lower = _count(a >= value for value in _E2M1_VALUES[1:])
    frac = (a - _select_by_index(lower, _E2M1_VALUES)) * _select_by_index(
        lower, _E2M1_INVERSE_STEPS
    )
    return lower + jnp.where(uniforms < frac, jnp.uint32(1), jnp.uint32(0))


# Stochastic rounding's random bits, the reference's (formats/nvfp4.py::stochastic_uniforms):
# 8 per element, one 32-bit hash word per four elements. In a 16-element block, element j takes
# byte j // 4 of the word hashed at the block's column j % 4, so a line's block needs 4 words.
_WORDS_PER_BLOCK = 4
_HASH_ROW_FACTOR = 0x9E3779B1
_HASH_COL_FACTOR = 0x85EBCA77
_ONE_BITS = 0x3F800000  # 1.0f


def mixed_word(h: jax.Array) -> jax.Array:
    """The reference's `hash_word` from its first word h = (row·A) ^ (col·B) ^ seed (uint32)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


def byte_uniforms(words: jax.Array, byte: int) -> jax.Array:
    """(b + 1/2) / 256 for byte `byte` (0..3) b of each uint32 word, the reference's
    `byte_uniforms`: b moved into the top of a float32 mantissa of 1 + b/256 + 1/512, minus 1
    (exact), instead of an integer-to-float conversion (a quarter-rate instruction)."""
    shift = 15 - 8 * byte  # bit 0 of the byte → mantissa bit 15
    moved = words << shift if shift > 0 else words >> -shift
    bits = (moved & jnp.uint32(0xFF << 15)) | jnp.uint32(_ONE_BITS | 1 << 14)
    return qc.f32_from_bits(bits) - jnp.float32(1.0)


def block_uniforms(row_words: jax.Array, col_steps: jax.Array, first_col: jax.Array) -> jax.Array:
    """Stochastic rounding's uniforms of one 16-element block per line, (lines, 16) in RPT1.

    `row_words` (lines, 4) RPT1: each line's (row·A) ^ seed; `col_steps` (lines, 4) RPT1: j·B
    for the word columns j = 0..3; `first_col` (uint32 scalar): the hashed column of the
    block's first element. col·B = first_col·B + j·B in the uint32 ring, so each word costs an
    add, an xor and the mixing: one hash per four elements."""
    words = mixed_word(row_words ^ (col_steps + first_col * jnp.uint32(_HASH_COL_FACTOR)))
    # Columns 4k..4k+3 are byte k of words 0..3: element j = 4k + w takes byte j // 4 of word j % 4.
    return jnp.concatenate([byte_uniforms(words, k) for k in range(4)], axis=1)


_FRACTION_BITS = 22  # the fraction of a grid step in |p|'s mantissa (E2M1: half a binade)
_FRACTION_MASK = (1 << _FRACTION_BITS) - 1


_HALF_BYTE = 1 << (_FRACTION_BITS - 9)  # ½ of a byte's unit, 2^13
# (2^22 − 1) − threshold = (b << 14) ^ this (the threshold's bits 13 and 14–21 never overlap).
_CARRY_BASE = _FRACTION_MASK ^ _HALF_BYTE


def byte_thresholds(words: jax.Array, byte: int, *, carry: bool = False) -> jax.Array:
    """Byte `byte` (0..3) b of each uint32 word as the threshold (b + ½)/256 of a grid step in
    units of 2^-22 of it: (b << 14) | 2^13 (`e2m1_stochastic_integer` rounds up above it).
    `carry`: (2^22 − 1) − that threshold instead, the addend of `e2m1_stochastic_carry`."""
    shift = _FRACTION_BITS - 8 - 8 * byte  # bit 0 of the byte → bit 14
    moved = words << shift if shift > 0 else words >> -shift
    field = moved & jnp.uint32(0xFF << (_FRACTION_BITS - 8))
    return field ^ jnp.uint32(_CARRY_BASE) if carry else field | jnp.uint32(_HALF_BYTE)


def block_thresholds(
    row_words: jax.Array, col_steps: jax.Array, first_col: jax.Array, *, carry: bool = False
) -> jax.Array:
    """`block_uniforms`' random bytes as `byte_thresholds`, (lines, 16) uint32 in RPT1."""
    words = mixed_word(row_words ^ (col_steps + first_col * jnp.uint32(_HASH_COL_FACTOR)))
    return jnp.concatenate([byte_thresholds(words, k, carry=carry) for k in range(4)], axis=1)


def e2m1_stochastic_integer(p: jax.Array, thresholds: jax.Array) -> jax.Array:
    """`e2m1_stochastic(p, uniforms)` decided on integers, for non-NaN p: `thresholds` are the
    uniforms' bytes as `byte_thresholds`.

    E2M1's grid steps are half a binade from 1 up (0.5, 1, 2 in [1, 2), [2, 4), [4, 6]), so
    for 1 ≤ a = min(|p|, 6) the lower neighbour's code is (bits(a) >> 22) − 252 and the
    fraction (a − lower) / step is bits(a)'s low 22 bits over 2^22, exactly; up iff that is
    above (b + ½)/256, i.e. above the threshold. Below 1 the step is 0.5 throughout: z = a + 1
    is read the same way (codes 2 lower). z may round (a has bits below 2^-23), but rounding is
    monotone and the thresholds are on z's grid, so only an exact tie z − 1 == threshold can
    hide the true side, which the rounding error a − (z − 1) (exact: Fast2Sum) gives: a tie
    rounds up iff the error is positive. a = 6 gives code 7 with fraction 0; a NaN p gives
    garbage (the caller clears NaN blocks)."""
    a = jnp.minimum(jnp.abs(p), jnp.float32(E2M1_MAX))
    below_one = a < jnp.float32(1.0)
    one = jnp.where(below_one, jnp.float32(1.0), jnp.float32(0.0))
    z = a + one
    rounded_down = jnp.where(a - (z - one) > jnp.float32(0.0), jnp.uint32(1), jnp.uint32(0))
    z_bits = lax.bitcast_convert_type(z, jnp.uint32)
    lower = (z_bits >> _FRACTION_BITS) - jnp.where(below_one, jnp.uint32(254), jnp.uint32(252))
    fraction = z_bits & jnp.uint32(_FRACTION_MASK)
    up = jnp.where(
        fraction > thresholds,
        jnp.uint32(1),
        jnp.where(fraction == thresholds, rounded_down, jnp.uint32(0)),
    )
    return lower + up


_ONE_BITS_CODE_2 = (_ONE_BITS >> _FRACTION_BITS) - 2  # 252: bits(1.0) >> 22 is code 2's 254


def e2m1_stochastic_carry(p: jax.Array, addends: jax.Array, layout, *, on_hardware: bool):
    """`e2m1_stochastic_integer(p, thresholds)` as one carry, for non-NaN p: `addends` are
    (2^22 − 1) − thresholds (`byte_thresholds(..., carry=True)`).

    For 1 ≤ a = min(|p|, 6) the code is (bits(a) >> 22) − 252 plus [fraction > threshold],
    fraction = bits(a)'s low 22 bits; adding (2^22 − 1) − threshold to bits(a) carries into
    bit 22 exactly when fraction > threshold, so code = ((bits(a) + addend) >> 22) − 252.
    Below 1 (step 0.5) the fraction is F = a·2^23 − floor(2a)·2^22, exact but not always an
    integer: 1 + a rounded *up* to float32's grid in [1, 2] has bits 0x3F800000 +
    ceil(a·2^23), whose carry decides ceil(F) > threshold, the same as F > threshold for an
    integer threshold (and a ceiling that reaches the next step only does so when F >
    2^22 − 1, above every threshold); its codes are 2 higher, so it is read 2 steps lower.
    That rounded-up sum is PTX's add.rp.f32 on the hardware (one full-rate add; Mosaic GPU
    has no ceil), XLA's ceil in the interpreter (`qc.one_plus_rounded_up_bits`)."""
    a = jnp.minimum(jnp.abs(p), jnp.float32(E2M1_MAX))
    below_one = qc.one_plus_rounded_up_bits(a, layout, on_hardware=on_hardware) - jnp.uint32(
        2 << _FRACTION_BITS
    )
    x = jnp.where(a < jnp.float32(1.0), below_one, lax.bitcast_convert_type(a, jnp.uint32))
    return ((x + addends) >> _FRACTION_BITS) - jnp.uint32(_ONE_BITS_CODE_2)


_TWO_POW_64 = np.float32(2.0**64)
_MAGIC_FLOOR_BITS = (22 + 127) << 23  # 2^22, whose float32 ulp is 0.5


def _e2m1_round(p: jax.Array) -> tuple[jax.Array, ...]:
    """(a = min(|p|, 6), C, a + C, nearest code) of `e2m1_nearest`'s magic-number rounding."""
    a = jnp.minimum(jnp.abs(p), jnp.float32(E2M1_MAX))
    a_bits = lax.bitcast_convert_type(a, jnp.uint32)
    magic_bits = jnp.maximum(
        (a_bits & jnp.uint32(qc.F32_INF_BITS)) + jnp.uint32(22 << 23),
        jnp.uint32(_MAGIC_FLOOR_BITS),
    )
    magic = qc.f32_from_bits(magic_bits)
    rounded = a + magic
    binade_offset = (magic_bits - jnp.uint32(_MAGIC_FLOOR_BITS)) >> 22
    code = (lax.bitcast_convert_type(rounded, jnp.uint32) - magic_bits) + binade_offset
    return a, magic, rounded, code


def e2m1_stochastic(p: jax.Array, uniforms: jax.Array) -> jax.Array:
    """`e2m1_magnitude_stochastic(|clip(p, ±6)|, uniforms)` for non-NaN p, from the nearest
    rounding instead of threshold counts (~22 operations instead of ~48).

    a + C − C is the nearest grid value exactly; C·2^-23 is the grid step in a's binade (0.5
    below 2, then 1, then 2), which is also the step above the lower neighbour. So the lower
    neighbour is the nearest one, or one step below it when that is above a, and
    frac = (a − lower) / step, with 1/step a power of two built from C's bits: the reference's
    values and inverse steps, the same float operations. (For a = 6 the reference's inverse
    step is 1, this one 1/2: frac is 0 either way.) NaN p gives garbage: the caller clears NaN
    blocks."""
    a, magic, rounded, nearest = _e2m1_round(p)
    nearest_value = rounded - magic
    step = magic * jnp.float32(2.0**-23)
    # 1/step = 2^23 / C: exponent 150 − (C's), i.e. bits (277 << 23) − bits(C).
    inverse_step = qc.f32_from_bits(
        jnp.uint32(277 << 23) - lax.bitcast_convert_type(magic, jnp.uint32)
    )
    above = nearest_value > a
    lower = nearest - jnp.where(above, jnp.uint32(1), jnp.uint32(0))
    lower_value = jnp.where(above, nearest_value - step, nearest_value)
    frac = (a - lower_value) * inverse_step
    return lower + jnp.where(uniforms < frac, jnp.uint32(1), jnp.uint32(0))


def e2m1_nearest(p: jax.Array) -> jax.Array:
    """E2M1 magnitude code (0..7, uint32) of clamp(p, ±6) rounded to nearest even.

    Float addition rounds to nearest even: adding C = 2^(e+22) (e = exponent of |p|, at least
    2^22) rounds |p| to the E2M1 spacing of its binade (0.5 below 2, 1 in [2, 4), 2 in [4, 6]).
    The low bits of the sum are then the step count k above C, and the code is
    k + 2·log2(C / 2^22): the same ties as TransformerEngine's thresholds (.25, 1.25, 2.5, 5
    go down; .75, 1.75, 3.5 up), in 8 integer/float operations instead of 7 compares and
    selects. NaN is handled by the caller."""
    return _e2m1_round(p)[3]


_INTEGER_GRID = 2.0**23  # float32 in [2^23, 2^24) are the integers (ulp 1)
_INTEGER_GRID_BITS = 0x4B000000


def e2m1_nearest_grid_min(
    p: jax.Array, layout, *, on_hardware: bool, limits: jax.Array | None = None
) -> jax.Array:
    """`e2m1_nearest(p)` (float32 p held in `layout`; a = min(|p|, 6)), as the float
    2^23 + code (its bits: 0x4B000000 + code), by float operations.

    Rounded to each spacing of E2M1's grid, a gives a code candidate: 2a to the integers (the
    code below 2: 0..4), rint(a) + 2 (from 2 to 4: 4..6), rint(a/2) + 4 (from 4 to 6: 6..7),
    and the code is the smallest of the three (checked against `e2m1_nearest` for every
    float32 in [0, 6]: tests/pallas_kernels/test_quantize.py). Each rounding is one addition
    to 2^23 + offset, where float32 holds exactly the integers and rounds to nearest even:
    E2M1's ties, the offsets being even. a·2 and a·½ go into the addition fused
    (`qc.exact_scale_add`: PTX fma.rn.f32 on the hardware; in the interpreter a·½ rounds
    first only when subnormal, whose rint is 0 either way). Three FMA-pipe instructions and
    two minima instead of `_e2m1_round`'s seven integer ones: the integer / logic (ALU) pipe
    is the kernel's busiest (Nsight Compute on the H200, docs/benchmarks.md stop 35). NaN p
    gives NaN (the caller clears NaN blocks), unless `limits` (float32, p's shape and layout,
    never NaN) replace 6 as the clamp: a = min(|p|, limit) then gives a NaN p its limit
    (`qc.min_ignoring_nan`), so a limit of 0 makes its code 0."""
    if limits is None:
        a = jnp.minimum(jnp.abs(p), jnp.float32(E2M1_MAX))
    else:
        a = qc.min_ignoring_nan(jnp.abs(p), limits, layout, on_hardware=on_hardware)
    halves = qc.exact_scale_add(a, 2.0, _INTEGER_GRID, layout, on_hardware=on_hardware)
    units = a + jnp.float32(_INTEGER_GRID + 2)
    doubles = qc.exact_scale_add(a, 0.5, _INTEGER_GRID + 4, layout, on_hardware=on_hardware)
    return jnp.minimum(jnp.minimum(halves, units), doubles)


# sat(r · −2^110 − 2^24) is 1.0 exactly where r < −2^-86 (`negative_units`).
_SIGN_SCALE = -(2.0**110)
_SIGN_OFFSET = -(2.0**24)


def negative_units(signed_products: jax.Array, layout, *, on_hardware: bool) -> jax.Array:
    """1.0 where float32 r < −2^-86, else 0.0 (NaN gives 0.0): the lean sign test
    (`quantize_block_lines`) as one saturated fused multiply-add, sat(r · −2^110 − 2^24), an
    FMA-pipe instruction instead of a compare and a select on the ALU pipe.

    r · −2^110 is exact (a power-of-two scaling up; where it overflows, the sum overflows the
    same way), so the sum is positive exactly when −r · 2^110 > 2^24, i.e. r < −2^-86. The
    float32 next below −2^-86 is −2^-86 − 2^-109 (the spacing just above 2^-86), giving 2: a
    positive sum is at least 2 and saturates to exactly 1.0; r = −2^-86 gives +0."""
    return qc.saturated_scale_add(
        signed_products, _SIGN_SCALE, _SIGN_OFFSET, layout, on_hardware=on_hardware
    )


def quantize_block_lines(
    v,
    layout,
    t,
    s_dec,
    uniforms=None,
    block_amax_bits=None,
    *,
    lean=False,
    thresholds=None,
    native_division=False,
    on_hardware=False,
    carry=False,
    grid_min=False,
    float_sign=False,
    float_amax=False,
    nan_clamp=False,
) -> tuple[jax.Array, jax.Array]:
    """NVFP4 of each row of a (R, 16) float32 array (one block per row) held in `layout`.
    `block_amax_bits` (R,) uint32: each row's block amax when the block spans more than the
    row (16×16 blocks); default the row's own amax. `lean`: see
    `NVFP4QuantizeConfig.lean_arithmetic`. Stochastic rounding takes `uniforms` (float), or
    with lean arithmetic `thresholds` (`block_thresholds`, for
    `NVFP4QuantizeConfig.integer_stochastic_rounding`). `native_division`: see
    `NVFP4QuantizeConfig.native_division` (`on_hardware`: PTX's rcp.rn.f32, not the
    interpreter's division). `carry`: `thresholds` are carry addends
    (`NVFP4QuantizeConfig.carry_stochastic_rounding`). `grid_min`: nearest rounding by
    `e2m1_nearest_grid_min` (`NVFP4QuantizeConfig.grid_min_rounding`; needs `lean`).
    `float_sign`: the sign bits by `negative_units` (`NVFP4QuantizeConfig.float_sign_test`;
    needs `lean`; used by the grid-min and carry paths, the others keep the compare).
    `float_amax`: the block amax taken in float32 on the hardware
    (`NVFP4QuantizeConfig.float_block_amax`). `nan_clamp`: NaN-amax blocks get code 0 from
    the grid-min clamp instead of the packed-code mask (`NVFP4QuantizeConfig.
    clamp_clears_nan_blocks`; used by the grid-min path with `float_sign`).

    Returns (packed codes (R, 8) uint8, block scales (R,) float8_e4m3fn)."""
    if block_amax_bits is None and float_amax and on_hardware:
        # maximumf propagates NaN (PTX max.NaN.f32); |v| keeps subnormals.
        block_amax_bits = lax.bitcast_convert_type(jnp.max(jnp.abs(v), axis=1), jnp.uint32)
    elif block_amax_bits is None:
        block_amax_bits = qc.row_amax_bits(v)
    block_amax = qc.f32_from_bits(block_amax_bits)
    block_scale = jnp.minimum(block_amax * t, jnp.float32(E4M3_MAX)).astype(jnp.float8_e4m3fn)
    denominator = block_scale.astype(jnp.float32) * s_dec
    if native_division:
        reciprocal = qc.ieee_reciprocal(denominator, on_hardware=on_hardware)
    else:
        reciprocal = divide(jnp.float32(1.0), denominator)
    encode = jnp.minimum(reciprocal, jnp.float32(qc.FLT_MAX))
    encode_b = qc.broadcast_rows(encode, v.shape, layout)
    p = v * encode_b
    # The reference's sign test: fp32(x·enc) negative and nonzero, decided on (x·2^64)·enc so
    # that a product XLA:CPU would flush to -0 still counts. Only the sign comes from it: XLA
    # may reassociate that product, and 2^64·enc can overflow. (Not `p < 0` even where
    # subnormals are kept: the two round differently when x·enc is within 2^-24 relative of
    # -2^-150, e.g. x = -3·2^-149, enc = fp32(1/6): p = -2^-149 but (x·2^64)·enc = -2^-86.)
    grid_min_path = grid_min and uniforms is None and thresholds is None
    if (grid_min_path or thresholds is not None or float_sign) and not lean:
        raise ValueError("grid_min, thresholds and float_sign need lean=True")
    float_sign = float_sign and (grid_min_path or (carry and thresholds is not None))
    negative = negative_unit = None
    if lean:
        # x·(enc·2^64), one multiply per element: both scalings by 2^64 are exact unless they
        # overflow, so the product is the same rounding of x·enc·2^64. Where enc·2^64 is Inf
        # (enc ≥ 2^64), x·Inf has x's sign and |(x·2^64)·enc| ≥ 2^-85 for any nonzero bf16 /
        # f32 x, and x = ±0 gives NaN (not negative) where the reference gives ±0 (not
        # negative); where x·2^64 is ±Inf, enc ≥ 2^-125.4 keeps |x·enc·2^64| above 2^-86.
        encode_64 = qc.broadcast_rows(encode * _TWO_POW_64, v.shape, layout)
        signed_product = v * encode_64
        if float_sign:
            negative_unit = negative_units(signed_product, layout, on_hardware=on_hardware)
        else:
            negative = signed_product < jnp.float32(-(2.0**-86))
    else:
        negative = (v * _TWO_POW_64) * encode_b < jnp.float32(-(2.0**-86))
    signed = False  # whether `magnitude` carries the sign bit already
    if uniforms is not None:  # made in RPT1 (four columns per hash word): into v's layout
        uniforms = plgpu.layout_cast(uniforms, layout)
    # NaN-amax blocks by the clamp: every product of such a block is NaN (enc is NaN), and a
    # clamp limit of 0 that a NaN product takes gives it code 0, its sign test 0 (.sat maps
    # NaN to 0): the reference's zero codes without the mask below.
    nan_clamp = nan_clamp and grid_min_path and float_sign
    if grid_min_path:
        limits = None
        if nan_clamp:
            block_limit = jnp.where(
                qc.is_nan_bits(block_amax_bits), jnp.float32(0.0), jnp.float32(E2M1_MAX)
            )
            limits = qc.broadcast_rows(block_limit, v.shape, layout)
        grid_code = e2m1_nearest_grid_min(p, layout, on_hardware=on_hardware, limits=limits)
        if float_sign:
            # 2^23 + code + 8 where negative, exactly: its bits are 0x4B000000 + the signed
            # code, whose bits above the nibble the packing drops (the byte conversion below).
            signed_code = qc.scale_add(
                negative_unit, 8.0, grid_code, layout, on_hardware=on_hardware
            )
            magnitude = lax.bitcast_convert_type(signed_code, jnp.uint32)
        else:
            # 0x4B000000 + code with code < 8: xor with 0x4B000000 (| 8 where negative) leaves
            # the signed code, one operation for the sign and the offset.
            offset = jnp.where(
                negative, jnp.uint32(_INTEGER_GRID_BITS | 8), jnp.uint32(_INTEGER_GRID_BITS)
            )
            magnitude = lax.bitcast_convert_type(grid_code, jnp.uint32) ^ offset
        signed = True  # NaN blocks are cleared below
    elif thresholds is not None:
        # NaN blocks are cleared after packing, as below.
        thresholds = plgpu.layout_cast(thresholds, layout)
        if carry:
            magnitude = e2m1_stochastic_carry(p, thresholds, layout, on_hardware=on_hardware)
            if float_sign:
                # bits(2^23 + 8·negative) − 0x4B000000 is the sign bit 8 or 0; the compiler
                # folds its constant into the carry's (one three-input add).
                sign_bits = lax.bitcast_convert_type(
                    qc.exact_scale_add(
                        negative_unit, 8.0, _INTEGER_GRID, layout, on_hardware=on_hardware
                    ),
                    jnp.uint32,
                )
                magnitude, signed = magnitude + (sign_bits - jnp.uint32(_INTEGER_GRID_BITS)), True
        else:
            magnitude = e2m1_stochastic_integer(p, thresholds)
    elif uniforms is None:
        magnitude = e2m1_nearest(p)
        if not lean:  # lean: NaN blocks are cleared after packing
            magnitude = jnp.where(qc.is_nan_bits(qc.abs_bits(p)), jnp.uint32(0), magnitude)
    elif lean:  # NaN blocks are cleared after packing
        magnitude = e2m1_stochastic(p, uniforms)
    else:
        a = jnp.abs(jnp.clip(p, -E2M1_MAX, E2M1_MAX))
        magnitude = e2m1_magnitude_stochastic(a, uniforms)
    if not signed:
        magnitude = magnitude | jnp.where(negative, jnp.uint32(8), jnp.uint32(0))
    codes = plgpu.layout_cast(magnitude, qc.RPT1)
    low = qc.concat_columns([codes[:, i : i + 1] for i in range(0, BLOCK, 2)])
    high = qc.concat_columns([codes[:, i : i + 1] for i in range(1, BLOCK, 2)])
    packed = low | (high << 4)
    if lean and not nan_clamp:
        # Only a NaN-amax block has NaN products (whose lean codes are garbage): its codes are
        # all 0, like the reference's. One mask per block instead of a test per element.
        keep = jnp.where(qc.is_nan_bits(block_amax_bits), jnp.uint32(0), jnp.uint32(0xFF))
        packed = packed & qc.broadcast_rows(keep, packed.shape, qc.RPT1)
    return packed.astype(jnp.uint8), block_scale


_BLOCKS_PER_STORE = 4  # 4 blocks = 32 packed bytes per line: one (8, 32)-tiled column group


@dataclasses.dataclass(frozen=True)
class _CompactBlockAmaxes:
    """The 16×16 blocks' amax bits as one (M/16, K/16) uint32 array in global memory
    (`NVFP4QuantizeConfig.compact_block_amaxes`), read for the rowwise copy (a line is a row
    of x) or, `transposed`, for the columnwise one (a line is a column of x)."""

    gmem: object
    transposed: bool


def _line_block_amaxes(source, line0, lines: int, block0, n: int) -> jax.Array:
    """(lines, n) uint32 in `qc.RPT1`: the amax bits of blocks block0 … block0 + n − 1 of the
    copy's lines line0 … (thread t: line line0 + t). `source`: a (lines, blocks) array of the
    copy's per-line amaxes, or `_CompactBlockAmaxes`."""
    if not isinstance(source, _CompactBlockAmaxes):
        window = source.at[pl.ds(line0, lines), pl.ds(block0, n)]
        # Thread t gets its line's amaxes: a plain global load of a few words.
        return plgpu.load(window, layout=qc.RPT1, optimized=False)
    line_blocks, blocks = pl.ds(line0 // BLOCK, lines // BLOCK), pl.ds(block0, n)
    window = (
        source.gmem.at[blocks, line_blocks]
        if source.transposed
        else source.gmem.at[line_blocks, blocks]
    )
    return _load_compact_window(window, source.gmem.shape[1], source.transposed, lines, n)


def _load_compact_window(window, row_stride: int, transposed: bool, lines: int, n: int):
    """`_line_block_amaxes` from a window of the compact array: (lines / 16, n), or (n,
    lines / 16) `transposed`, of a (·, `row_stride`) uint32 array. Each register of the RPT1
    result (line l, block b) is one 4-byte load from row l / 16 (column, transposed): the 16
    threads of a 16-line block load the same word, which the L1 serves once."""
    layout = mgpu.tmem_native_layout(1)  # qc.RPT1's Mosaic layout
    shape = (lines, n)

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(),),
        return_type=plgpu.ShapeDtypeStruct(shape, jnp.uint32, layout=qc.RPT1),
    )
    def load(_, window_ref):
        i32 = ir.IntegerType.get_signless(32)
        base = mgpu.utils.memref_ptr(window_ref)
        registers = np.empty(layout.registers_shape(shape), dtype=object)
        for register, (line, block) in zip(
            np.ndindex(registers.shape), layout.thread_idxs(shape), strict=True
        ):
            line_block = arith.divui(arith.index_cast(i32, line), mgpu.utils.c(BLOCK, i32))
            block = arith.index_cast(i32, block)
            row, col = (block, line_block) if transposed else (line_block, block)
            offset = arith.addi(arith.muli(row, mgpu.utils.c(row_stride, i32)), col)
            word = llvm.load(i32, mgpu.utils.getelementptr(base, [offset], i32))
            registers[register] = vector.broadcast(ir.VectorType.get((1,), i32), word)
        return mgpu.FragmentedArray(_registers=registers, _layout=layout, _is_signed=False)

    return load(window)


def _group_columns(values: jax.Array, group) -> jax.Array:
    """Columns `_BLOCKS_PER_STORE`·group … of a (lines, n) register array held row-per-thread:
    a slice for a static group, selects for a loop's traced one."""
    slices = [
        values[:, g * _BLOCKS_PER_STORE : (g + 1) * _BLOCKS_PER_STORE]
        for g in range(values.shape[1] // _BLOCKS_PER_STORE)
    ]
    if isinstance(group, int):
        return slices[group]
    picked = slices[0]
    for g, candidate in enumerate(slices[1:], start=1):
        picked = jnp.where(group == g, candidate, picked)
    return picked


def _quantize_copy(
    load_pair,
    layout,
    n_blocks,
    lines,
    line0,
    col0,
    dest,
    scale_gmem,
    scalars,
    seed,
    hadamard,
    block_amax_gmem=None,
    tile_block_amaxes=None,
    position=None,
    lean=False,
    loop_blocks=False,
    integer_stochastic_rounding=False,
    native_division=False,
    on_hardware=False,
    carry_stochastic_rounding=False,
    grid_min_rounding=False,
    float_sign_test=False,
    float_block_amax=False,
    clamp_clears_nan_blocks=False,
    line_table=None,
    block_table=None,
):
    """Quantize `n_blocks` consecutive 16-column blocks of `lines` lines (first global line
    `line0` and column `col0` of the copy): packed codes into `dest`, block scales to
    `scale_gmem`. `load_pair(p)` gives blocks 2p and 2p+1 as one (lines, 32) array, float32
    or x's own dtype (then each 1×16 block's amax is taken on x's bit patterns, two bf16 per
    32-bit integer operation, before the values are widened: the same amax bits).
    `block_amax_gmem`: the 16×16 blocks' amax bits per line (module docstring) or a
    `_CompactBlockAmaxes`, or None for 1×16 blocks; `tile_block_amaxes`: instead, the
    (lines, n_blocks) of them already loaded (`NVFP4QuantizeConfig.preload_block_amaxes`).
    `position`: uint32 (line, col) of the copy's first element in a larger tensor, added to
    the positions stochastic rounding hashes (None: 0, 0).

    Grouped tensors (`group_table`): `line_table` (lines of the copy, 4) uint32 gives each
    line its own t, S_dec, seed and hashed row (the rowwise copy: a line is one token);
    `block_table` (16-column blocks of the copy, 4) the same per block, the position being the
    hashed column of the block's first element (the columnwise copy: a block is 16 tokens of
    one group, the same for every line). They replace `scalars`, `seed` (then only a flag
    that stochastic rounding is on) and `position`.

    The blocks go in groups of `_BLOCKS_PER_STORE` (one 32-byte store of codes and one of
    scales per line each), unrolled, or with `loop_blocks` as a loop over the groups
    (`NVFP4QuantizeConfig.loop_blocks`). `integer_stochastic_rounding`: see the config."""
    t, s_dec = scalars
    random_bits = block_uniforms
    if integer_stochastic_rounding:
        random_bits = functools.partial(block_thresholds, carry=carry_stochastic_rounding)
    if line_table is not None:
        # Thread t gets its line's four words (a plain global load, like the 16×16 block
        # amaxes below).
        entries = plgpu.load(line_table.at[pl.ds(line0, lines), :], layout=qc.RPT1, optimized=False)

        def entry(k):  # (lines,), in the row layout of every per-line value of the copy
            return jnp.max(entries[:, k : k + 1], axis=1)

        t, s_dec = qc.f32_from_bits(entry(_T)), qc.f32_from_bits(entry(_S_DEC))
    if seed is not None:
        # Stochastic rounding: the hash's row part (row·A) ^ seed made once per line and word,
        # and col·B = col_0·B + j·B, so a block's four words cost one add and one xor each
        # before the mixing. Hashed rows: the grouped rowwise copy's lines carry their own row
        # (the token's row in its group) and seed; otherwise the line index (+ position).
        word_shape = (lines, _WORDS_PER_BLOCK)
        col_steps = qc.iota(word_shape, 1, qc.RPT1) * jnp.uint32(_HASH_COL_FACTOR)
        if line_table is not None:
            line_words = (entry(_POSITION) * jnp.uint32(_HASH_ROW_FACTOR)) ^ entry(_SEED)
            row_words = qc.broadcast_rows(line_words, word_shape, qc.RPT1)
        else:
            hashed_rows = qc.iota(word_shape, 0, qc.RPT1) + line0.astype(jnp.uint32)
            if position is not None:
                hashed_rows = hashed_rows + position[0]
            row_words = hashed_rows * jnp.uint32(_HASH_ROW_FACTOR)
            if block_table is None:  # the grouped columnwise copy's seed comes per block
                row_words = row_words ^ seed

    def quantize_group(group, t, s_dec):
        """Blocks `_BLOCKS_PER_STORE`·group … of every line: codes and scales stored."""
        first_block = group * _BLOCKS_PER_STORE
        line_amaxes = None
        if tile_block_amaxes is not None:
            line_amaxes = _group_columns(tile_block_amaxes, group)
        elif block_amax_gmem is not None:
            line_amaxes = _line_block_amaxes(
                block_amax_gmem, line0, lines, col0 // BLOCK + first_block, _BLOCKS_PER_STORE
            )
        scales, packed_group = [], []
        for p in range(_BLOCKS_PER_STORE // 2):
            pair = load_pair(first_block // 2 + p)
            for half in range(2):
                b = 2 * p + half  # within the group
                v = pair[:, half * BLOCK : (half + 1) * BLOCK]
                own_amax_bits = None  # None: quantize_block_lines takes it from v
                if v.dtype != jnp.float32:
                    if line_amaxes is None:  # (16×16 blocks bring their amaxes)
                        own_amax_bits = qc.line_amax_bits(qc.abs_patterns(v))
                    v = v.astype(jnp.float32)
                if hadamard:
                    v = hadamard16_lines(v)
                bits = None  # stochastic rounding's uniforms or thresholds
                if block_table is not None:
                    # One group per 16 tokens: this block's t, S_dec, seed and first hashed
                    # column are the same for every line (uniform scalar loads).
                    block = col0 // BLOCK + first_block + b
                    t = qc.f32_from_bits(block_table[block, _T])
                    s_dec = qc.f32_from_bits(block_table[block, _S_DEC])
                if seed is not None:
                    if block_table is not None:
                        bits = random_bits(
                            row_words ^ block_table[block, _SEED],
                            col_steps,
                            block_table[block, _POSITION],
                        )
                    else:
                        first_col = (col0 + (first_block + b) * BLOCK).astype(jnp.uint32)
                        if position is not None:  # uint32 adds wrap, as the reference's do
                            first_col = first_col + position[1]
                        bits = random_bits(row_words, col_steps, first_col)
                block_amax_bits = own_amax_bits
                if line_amaxes is not None:
                    block_amax_bits = jnp.max(line_amaxes[:, b : b + 1], axis=1)
                uniforms, thresholds = (None, bits) if integer_stochastic_rounding else (bits, None)
                packed, block_scale = quantize_block_lines(
                    v,
                    layout,
                    t,
                    s_dec,
                    uniforms,
                    block_amax_bits,
                    lean=lean,
                    thresholds=thresholds,
                    native_division=native_division,
                    on_hardware=on_hardware,
                    carry=carry_stochastic_rounding,
                    grid_min=grid_min_rounding,
                    float_sign=float_sign_test,
                    float_amax=float_block_amax,
                    nan_clamp=clamp_clears_nan_blocks,
                )
                packed_group.append(packed)
                scales.append(qc.column(block_scale))
        width = _BLOCKS_PER_STORE * (BLOCK // 2)
        qc.store_line_bytes(dest.cols(group * width, width), jnp.concatenate(packed_group, axis=1))
        qc.store_line_bytes(
            scale_gmem.at[
                pl.ds(line0, lines), pl.ds(col0 // BLOCK + first_block, _BLOCKS_PER_STORE)
            ],
            qc.concat_columns(scales),
        )

    if n_blocks % _BLOCKS_PER_STORE:
        raise ValueError(f"{n_blocks} blocks per line: not a multiple of {_BLOCKS_PER_STORE}")
    groups = n_blocks // _BLOCKS_PER_STORE
    if loop_blocks:
        # One copy of the group's code, run `groups` times: unrolled, the tile's code is
        # fetched into the instruction cache anew by every CTA.
        @pl.loop(0, groups)
        def _(group):
            quantize_group(group, t, s_dec)

    else:
        for group in range(groups):
            quantize_group(group, t, s_dec)


def _kernel(
    x_gmem,
    *refs,
    config,
    cols,
    rowwise,
    columnwise,
    two_d,
    positioned,
    grouped=(False, False),
    compact_block_amaxes=False,
    fused_amax=None,
    **options,
):
    data_outputs = qc.data_outputs(rowwise, columnwise, elements_per_byte=2)
    # Inputs: each copy's [t, S_dec] (2, 2) float32 and seeds (2,) uint32, or with
    # `fused_amax` only the seeds: the kernel takes the scalars itself (`_global_amax_prologue`).
    if fused_amax is None:
        scalars_gmem, seeds_gmem, *refs = refs
    else:
        seeds_gmem, *refs = refs
    # With positions: one more input, each copy's (line, col) offset (4 uint32).
    positions_gmem = refs[0] if positioned else None
    refs = refs[1:] if positioned else refs
    # 16×16 blocks: the per-line block amaxes of each copy (two more inputs), or one more,
    # the compact (M/16, K/16) block amaxes both copies read.
    block_amax_gmems = (None, None)
    if two_d and compact_block_amaxes:
        block_amax_gmems = tuple(_CompactBlockAmaxes(refs[0], t) for t in (False, True))
        refs = refs[1:]
    elif two_d:
        block_amax_gmems, refs = refs[:2], refs[2:]
    # Grouped tensors: one more input per grouped copy, its `group_table`.
    group_gmems = []
    for is_grouped in grouped:
        group_gmems.append(refs[0] if is_grouped else None)
        refs = refs[1:] if is_grouped else refs
    outs, scratch = qc.split_refs(refs, config, cols, data_outputs)
    before_wait = None
    if fused_amax is not None:
        *outs, scalars_gmem, amax_gmem, partials_gmem = outs
        before_wait = functools.partial(
            _global_amax_prologue,
            x_gmem,
            scalars_gmem,
            amax_gmem,
            partials_gmem,
            grid_k=qc.tile_grid(*x_gmem.shape, config)["grid"][1],
            **fused_amax,
        )
    data_gmems, scale_gmems = outs[0::2], outs[1::2]
    body = functools.partial(
        _tile,
        scalars_gmem=scalars_gmem,
        seeds_gmem=seeds_gmem,
        positions_gmem=positions_gmem,
        scale_gmems=scale_gmems,
        block_amax_gmems=block_amax_gmems,
        group_gmems=group_gmems,
        copies=[o.columnwise for o in data_outputs],
        config=config,
        **options,
    )
    qc.for_each_tile(
        x_gmem,
        scratch,
        config,
        cols,
        body,
        list(zip(data_gmems, data_outputs, strict=True)),
        before_wait=before_wait,
    )


def _global_amax_prologue(
    x_gmem,
    scalars_gmem,
    amax_gmem,
    partials_gmem,
    *,
    grid_k: int,
    ctas: int,
    vector: int,
    hadamard: bool,
):
    """The global amax inside the quantize kernel (`quantize_nvfp4(amax_in_kernel=True)`), run
    by every CTA while its tile loads. The first `ctas` CTAs launched reduce x as `nvfp4_amax`'s
    kernel does, each into partials[cta]; CTA 0 waits for all of them, writes the two global
    amaxes and each copy's [t, S_dec] (`copy_scalars`' expressions), and every CTA waits for
    those before quantizing.

    No cooperative launch, so no wait may depend on a CTA that is not resident: the amax CTAs
    wait for nobody before they signal, and they are the first `ctas` ≤ one per SM launched,
    so the first wave holds them all whatever the others do. That needs the launch order,
    which is k fastest: Mosaic GPU reverses the grid so that its last axis is CUDA's x
    (jax/_src/pallas/mosaic_gpu/lowering.py). Counting m fastest instead hung the H100 at
    8192² (the 132 amax CTAs were spread over the first 4096 launched). The semaphores are
    zeroed per call (Pallas allocates them as a zero-filled buffer aliased into the launch),
    so they need not end at zero. A signal releases and a wait acquires: the plain global
    stores before a signal are visible to the loads after the wait it ends."""
    cta = lax.axis_index("m") * grid_k + lax.axis_index("k")
    semaphores = pl.get_global(plgpu.SemaphoreType.REGULAR((2,)))
    partials_written, scalars_written = semaphores.at[0], semaphores.at[1]

    @pl.when(cta < ctas)
    def _partial():
        row_bits, column_bits = _direct_amax_bits(
            x_gmem, cta, ctas=ctas, vector=vector, hadamard=hadamard
        )
        partials_gmem[cta, 0] = row_bits
        partials_gmem[cta, 1] = column_bits
        plgpu.semaphore_signal(partials_written, 1, memory_scope="gpu")

    @pl.when(cta == 0)
    def _reduce():
        plgpu.semaphore_wait(partials_written, ctas, memory_scope="gpu")
        # Unrolled, so that the loads are all in flight at once (a loop would wait for each).
        amax_bits = [
            functools.reduce(jnp.maximum, [partials_gmem[i, copy] for i in range(ctas)])
            for copy in (0, 1)
        ]
        for copy, bits in enumerate(amax_bits):
            amax_gmem[copy] = bits
            s_enc = global_encode_scale(qc.f32_from_bits(bits))
            scalars_gmem[copy, _T] = s_enc * ONE_SIXTH
            scalars_gmem[copy, _S_DEC] = divide(jnp.float32(1.0), s_enc)
        plgpu.semaphore_signal(scalars_written, 1, memory_scope="gpu")

    plgpu.semaphore_wait(scalars_written, 1, decrement=False, memory_scope="gpu")


def _tile(
    x_smem,
    m0,
    k0,
    dests,
    *,
    scalars_gmem,
    seeds_gmem,
    positions_gmem,
    scale_gmems,
    block_amax_gmems,
    group_gmems,
    copies,
    config,
    in_dtype,
    hadamard,
    stochastic,
    on_hardware,
):
    tm, tk = config.tile_m, config.tile_k
    arithmetic = dict(
        on_hardware=on_hardware,
        lean=config.lean_arithmetic,
        loop_blocks=config.loop_blocks,
        integer_stochastic_rounding=config.integer_stochastic_rounding,
        native_division=config.native_division,
        carry_stochastic_rounding=config.carry_stochastic_rounding,
        grid_min_rounding=config.grid_min_rounding,
        float_sign_test=config.float_sign_test,
        float_block_amax=config.float_block_amax,
        clamp_clears_nan_blocks=config.clamp_clears_nan_blocks,
    )
    tile_block_amaxes = [None, None]
    if config.preload_block_amaxes:
        # Both copies' loads issued before either copy's work (the same windows as the
        # per-group loads, whole tiles wide): plain global loads, thread t its line's words.
        windows = {
            False: (m0, tm, k0 // BLOCK, tk // BLOCK),
            True: (k0, tk, m0 // BLOCK, tm // BLOCK),
        }
        for columnwise in copies:
            source = block_amax_gmems[int(columnwise)]
            if source is not None:
                tile_block_amaxes[int(columnwise)] = _line_block_amaxes(
                    source, *windows[columnwise]
                )
    for columnwise, dest, scale_gmem in zip(copies, dests, scale_gmems, strict=True):
        c = int(columnwise)
        scalars = (scalars_gmem[c, _T], scalars_gmem[c, _S_DEC])
        seed = seeds_gmem[c] if stochastic else None
        position = None
        if positions_gmem is not None:
            position = (positions_gmem[2 * c], positions_gmem[2 * c + 1])
        if not columnwise:

            def load_row_pair(p):
                pair = x_smem.at[:, pl.ds(p * 32, 32)]
                if config.packed_row_amax:  # widened per block, after its amax
                    return plgpu.load(pair, layout=qc.rows_layout(in_dtype))
                return qc.load_rows(pair, in_dtype)

            _quantize_copy(
                load_row_pair,
                qc.rows_layout(in_dtype),
                tk // BLOCK,
                tm,
                m0,
                k0,
                dest,
                scale_gmem,
                scalars,
                seed,
                hadamard=False,
                block_amax_gmem=block_amax_gmems[0],
                tile_block_amaxes=tile_block_amaxes[0],
                position=position,
                line_table=group_gmems[0],
                **arithmetic,
            )
        else:

            def load_column_pair(p):
                return qc.load_columns(x_smem.at[pl.ds(p * 32, 32), :])

            _quantize_copy(
                load_column_pair,
                qc.RPT1,
                tm // BLOCK,
                tk,
                k0,
                m0,
                dest,
                scale_gmem,
                scalars,
                seed,
                hadamard=hadamard,
                block_amax_gmem=block_amax_gmems[1],
                tile_block_amaxes=tile_block_amaxes[1],
                position=position,
                block_table=group_gmems[1],
                **arithmetic,
            )


def _check_amax(value, name: str):
    if value is None:
        raise ValueError(f"{name} is required for that copy (use nvfp4_amax)")
    value = jnp.asarray(value)
    if value.shape != () or not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(f"{name} must be a float scalar, got {value.dtype}{value.shape}")
    return value.astype(jnp.float32)


def _check_seed(value, name: str):
    if value is None:
        raise ValueError(f"{name} is required with stochastic_rounding=True")
    value = jnp.asarray(value)
    if value.shape != () or value.dtype != jnp.uint32:
        raise TypeError(f"{name} must be a uint32 scalar, got {value.dtype}{value.shape}")
    return value


def _check_position(value, name: str) -> jax.Array:
    """A copy's (line, col) offset as a (2,) uint32 array; None is (0, 0)."""
    if value is None:
        return jnp.zeros((2,), jnp.uint32)
    if not (isinstance(value, tuple | list) and len(value) == 2):
        raise TypeError(f"{name} must be a (line, col) pair of uint32 scalars, got {value!r}")
    parts = [jnp.asarray(v) for v in value]
    if any(p.shape != () or p.dtype != jnp.uint32 for p in parts):
        raise TypeError(f"{name} must be a (line, col) pair of uint32 scalars, got {value!r}")
    return jnp.stack(parts)


def group_table(global_amax: jax.Array, seed: jax.Array, position: jax.Array) -> jax.Array:
    """(n, 4) uint32 rows [bits(t), bits(S_dec), seed, position] of a grouped copy's lines or
    blocks, from their global amaxes (n,) float32 (each its group's), seeds and hashed
    positions (n,) uint32: t and S_dec are `copy_scalars`' expressions, elementwise."""
    s_enc = global_encode_scale(global_amax)
    t = s_enc * ONE_SIXTH
    s_dec = divide(jnp.float32(1.0), s_enc)
    as_bits = functools.partial(lax.bitcast_convert_type, new_dtype=jnp.uint32)
    return jnp.stack([as_bits(t), as_bits(s_dec), seed, position], axis=1)


def _check_vector(value, name: str, length: int, kind: str, what: str) -> jax.Array:
    """A (length,) float (→ float32) or uint32 array, else an error naming it."""
    shaped = hasattr(value, "shape") and hasattr(value, "dtype")
    ok = shaped and tuple(value.shape) == (length,)
    if ok and kind == "float":
        ok = jnp.issubdtype(value.dtype, jnp.floating)
    elif ok:
        ok = jnp.dtype(value.dtype) == jnp.uint32
    if not ok:
        got = f"{value.dtype}{tuple(value.shape)}" if shaped else type(value).__name__
        expected = "float32" if kind == "float" else "uint32"
        raise TypeError(f"{name} must be a ({length},) {expected} array ({what}), got {got}")
    return value.astype(jnp.float32) if kind == "float" else value


def _grouped_copy_table(
    usage: str,
    per: str,
    length: int,
    padded_length: int,
    position_step: int,
    *,
    wanted: bool,
    two_d: bool,
    stochastic: bool,
    amax,
    seed,
    position,
    scalar_forms: dict,
):
    """The `group_table` of one copy of a grouped tensor (padded to `padded_length` rows of
    zeros), or None when its per-`per` arguments are not given; clear errors otherwise. The
    default positions are i·`position_step` (those of the ungrouped copy)."""
    names = {k: f"{usage}_{per}_{k}" for k in ("amax", "seed", "position")}
    what = "one per line of the rowwise copy" if per == "line" else "one per 16 rows of x"
    if amax is None:
        for key in ("seed", "position"):
            if (seed, position)[key == "position"] is not None:
                raise ValueError(f"{names[key]} needs {names['amax']} (per-group global amaxes)")
        return None
    if not wanted:
        raise ValueError(f"{names['amax']} is given but {usage}=False")
    if two_d:
        raise ValueError(f"{names['amax']} applies to 1×16 blocks only, not 16×16")
    for scalar_name, value in scalar_forms.items():
        if value is not None:
            raise ValueError(
                f"{scalar_name} and {names['amax']} are mutually exclusive: with per-{per} "
                f"global amaxes, pass the per-{per} forms ({names['seed']}, {names['position']})"
            )
    amax = _check_vector(amax, names["amax"], length, "float", what)
    if stochastic:
        if seed is None:
            raise ValueError(f"{names['seed']} is required with stochastic_rounding=True")
        seed = _check_vector(seed, names["seed"], length, "uint32", what)
        if position is None:
            position = jnp.arange(length, dtype=jnp.uint32) * jnp.uint32(position_step)
        position = _check_vector(position, names["position"], length, "uint32", what)
    else:
        if seed is not None or position is not None:
            raise ValueError(f"{names['seed']} / {names['position']} apply to stochastic_rounding")
        seed = position = jnp.zeros((length,), jnp.uint32)
    pad = padded_length - length
    amax, seed, position = (jnp.pad(a, (0, pad)) for a in (amax, seed, position))
    return group_table(amax, seed, position)


BLOCK_SHAPES = ((1, BLOCK), (BLOCK, BLOCK))


def block_amax_bits_reference(x: jax.Array) -> jax.Array:
    """(ceil(M/16), ceil(K/16)) uint32: each 16×16 block's max|x| as float32 bits, x zero-padded
    to whole blocks (NaN-propagating and flush-immune, like the reference quantizer), by jnp:
    the reference of `nvfp4_block_amax_bits` and its path for narrow x."""
    qc.check_input(x)
    rows, cols = (qc.round_up(n, BLOCK) for n in x.shape)
    bits = qc.abs_bits(qc.pad_to(x, rows, cols).astype(jnp.float32))
    return jnp.max(bits.reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK), axis=(1, 3))


# The 16×16 block amax kernel: like the direct-load global amax below, no TMA and no shared
# memory. A unit is 16 rows × 128 blocks of 16 columns; thread t loads its block's 16 columns of
# each of the 16 rows (two 16-byte loads per row for bf16, coalesced across the warp) into the
# row-per-thread layout, keeps the elementwise max of the |x| patterns and reduces its 16
# columns in registers at the end: one block per thread, no exchange between threads.
_BLOCKS_PER_UNIT = qc.LINES_PER_WARPGROUP
BLOCK_AMAX_CTAS = 1024


def _block_amax_kernel(x_blocks_gmem, out_gmem, *, ctas: int):
    """out[r, c, 0] = the float32 bits of max|x| over rows 16r.. and columns 16c.. (x_blocks_gmem
    is x as (M16, K16/16, 16)); units past the last whole one overlap it (same values)."""
    rows, num_blocks, _ = x_blocks_gmem.shape
    chunks = pl.cdiv(num_blocks, _BLOCKS_PER_UNIT)
    units = rows // BLOCK * chunks
    cta = lax.axis_index("cta")
    layout = qc.rows_layout(x_blocks_gmem.dtype)

    def unit(k, carry):
        u = cta + k * ctas
        row_block = u // chunks
        first_block = jnp.minimum((u % chunks) * _BLOCKS_PER_UNIT, num_blocks - _BLOCKS_PER_UNIT)
        patterns = None
        for i in range(BLOCK):
            window = x_blocks_gmem.at[row_block * BLOCK + i, pl.ds(first_block, _BLOCKS_PER_UNIT)]
            line = qc.abs_patterns(plgpu.load(window, layout=layout, optimized=False))
            patterns = line if patterns is None else jnp.maximum(patterns, line)
        amax = qc.line_amax_bits(patterns)
        qc.store_line_bytes(
            out_gmem.at[row_block, pl.ds(first_block, _BLOCKS_PER_UNIT)], qc.column(amax)
        )
        return carry

    lax.fori_loop(0, (units - cta + ctas - 1) // ctas, unit, jnp.int32(0))


def nvfp4_block_amax_bits(
    x: jax.Array, *, use_kernel: bool | None = None, interpret: bool = False
) -> jax.Array:
    """(ceil(M/16), ceil(K/16)) uint32: each 16×16 block's max|x| as float32 bit patterns (the
    amaxes of NVFP4 weight blocks; a tensor's global amax is the largest pattern, NaN's
    patterns being above Inf's), from one pass over x.

    `use_kernel`: True runs the Pallas kernel (x needs at least 128 blocks of 16 columns, K >=
    2033), False the jnp reference (`block_amax_bits_reference`), None the kernel when it
    applies. Both give the same bits."""
    qc.check_input(x)
    rows, cols = (qc.round_up(n, BLOCK) for n in x.shape)
    kernel_applies = cols // BLOCK >= _BLOCKS_PER_UNIT
    if use_kernel is None:
        use_kernel = kernel_applies
    if not isinstance(use_kernel, bool):
        raise TypeError(f"use_kernel must be a bool or None, got {use_kernel!r}")
    if not use_kernel:
        return block_amax_bits_reference(x)
    if not kernel_applies:
        raise ValueError(
            f"use_kernel=True needs x with at least {_BLOCKS_PER_UNIT * BLOCK - BLOCK + 1} "
            f"columns ({_BLOCKS_PER_UNIT} blocks of 16), got shape {tuple(x.shape)}"
        )
    xp = qc.pad_to(x, rows, cols)
    units = rows // BLOCK * pl.cdiv(cols // BLOCK, _BLOCKS_PER_UNIT)
    ctas = min(BLOCK_AMAX_CTAS, units)
    bits = plgpu.kernel(
        functools.partial(_block_amax_kernel, ctas=ctas),
        out_type=jax.ShapeDtypeStruct((rows // BLOCK, cols // BLOCK, 1), jnp.uint32),
        kernel_name="nvfp4_block_amax",
        interpret=qc.interpret_params(interpret),
        compiler_params=qc.compiler_params(),
        grid=(ctas,),
        grid_names=("cta",),
    )(xp.reshape(rows, cols // BLOCK, BLOCK))
    return varying_like(bits.reshape(rows // BLOCK, cols // BLOCK), xp)


def _padded_block_amaxes(block_bits: jax.Array, padded_rows: int, padded_cols: int) -> jax.Array:
    """`block_bits` (M16/16, K16/16) zero-padded to the tile-padded input's blocks (the
    padding's blocks are zeros)."""
    block_rows, block_cols = padded_rows // BLOCK, padded_cols // BLOCK
    return jnp.pad(
        block_bits, ((0, block_rows - block_bits.shape[0]), (0, block_cols - block_bits.shape[1]))
    )


def _block_amax_per_line(
    block_bits: jax.Array, padded_rows: int, padded_cols: int
) -> tuple[jax.Array, jax.Array]:
    """Each copy's lines' block amaxes for the kernel: `block_bits` (M16/16, K16/16) repeated
    along each block's 16 lines, (padded_rows, padded_cols/16) for the rowwise copy and
    (padded_cols, padded_rows/16) for the columnwise one (zero for the padding, whose blocks
    are zeros)."""
    padded = _padded_block_amaxes(block_bits, padded_rows, padded_cols)
    return jnp.repeat(padded, BLOCK, axis=0), jnp.repeat(padded.T, BLOCK, axis=0)


def quantize_nvfp4(
    x: jax.Array,
    *,
    block_shape: tuple[int, int] = (1, BLOCK),
    rowwise: bool = True,
    columnwise: bool = False,
    rowwise_amax: jax.Array | None = None,
    columnwise_amax: jax.Array | None = None,
    hadamard_columnwise: bool = False,
    stochastic_rounding: bool = False,
    rowwise_seed: jax.Array | None = None,
    columnwise_seed: jax.Array | None = None,
    rowwise_position: tuple[jax.Array, jax.Array] | None = None,
    columnwise_position: tuple[jax.Array, jax.Array] | None = None,
    rowwise_line_amax: jax.Array | None = None,
    rowwise_line_seed: jax.Array | None = None,
    rowwise_line_position: jax.Array | None = None,
    columnwise_block_amax: jax.Array | None = None,
    columnwise_block_seed: jax.Array | None = None,
    columnwise_block_position: jax.Array | None = None,
    block_amax_bits: jax.Array | None = None,
    amax_in_kernel: bool = False,
    amax_ctas: int | None = None,
    config: NVFP4QuantizeConfig | None = None,
    interpret: bool = False,
) -> NVFP4Quantized | tuple[NVFP4Quantized, jax.Array, jax.Array]:
    """NVFP4-quantize a 2-D bf16/f32 array (1×16 or 16×16 blocks): both copies in one pass.

    `rowwise_amax` / `columnwise_amax` are each copy's global amax (float32 scalars; the
    columnwise one taken after the Hadamard rotation when `hadamard_columnwise`). With
    `stochastic_rounding`, each copy needs a uint32 seed; `rowwise_position` /
    `columnwise_position` (uint32 (line, col), stochastic rounding only) place x in a larger
    tensor, so that a shard draws the bits its elements get in the whole one (the columnwise
    copy's line is x's column). Shapes (layouts.md), K16 / M16
    rounded up to 16: 1×16 blocks give rowwise data (M, K16/2) uint8 and scales (M, K16/16)
    float8_e4m3fn, columnwise (K, M16/2) and (K, M16/16); 16×16 blocks give (M16, K16/2) and
    (M16/16, K16/16), columnwise (K16, M16/2) and (K16/16, M16/16).

    Grouped tensors (MoE experts in the aligned layout: the rows of x in groups that start on
    multiples of 16, each group quantized as a tensor of its own; 1×16 blocks only):
    `rowwise_line_amax` (M,) float32 gives each row of x (each line of the rowwise copy) its
    own global amax, and with stochastic rounding `rowwise_line_seed` (M,) uint32 its seed and
    `rowwise_line_position` (M,) uint32 the row its elements hash (default: the row index; the
    column hashed is the column). `columnwise_block_amax` (M16/16,) float32 gives each 16 rows
    of x (a block column of the columnwise copy, which must lie in one group) its global amax
    (after the Hadamard rotation), `columnwise_block_seed` (M16/16,) uint32 its seed and
    `columnwise_block_position` (M16/16,) uint32 the column hashed for its first element
    (default 16·b; the row hashed is the line, x's column). t and S_dec are computed here, per
    line or block, with the scalar path's expressions (`group_table`). Each excludes the scalar
    form of the same copy (`rowwise_amax`, `rowwise_seed`, `rowwise_position`; likewise
    columnwise).

    16×16 blocks: `block_amax_bits` (M16/16, K16/16) uint32 are the blocks' amaxes as
    `nvfp4_block_amax_bits(x)` gives them (a caller that took the global amax from them passes
    them on, so x is read once for both); None computes them here.

    `amax_in_kernel`: the global amaxes are taken inside this launch instead of given (the
    issue's "fused into the pass" alternative to `nvfp4_amax`; `_global_amax_prologue`): the
    first `amax_ctas` CTAs launched (default and at most one per SM) reduce x, then every CTA waits
    for the scales. Returns (quantized, rowwise_amax, columnwise_amax) with the amaxes as
    `nvfp4_amax` gives them. 1×16 blocks and scalar amaxes only; GPU only (the interpreter
    has no semaphores); each tile's load overlaps the wait.
    """
    qc.check_input(x)
    qc.check_copies(rowwise, columnwise)
    block_shape = tuple(block_shape) if isinstance(block_shape, tuple | list) else block_shape
    if block_shape not in BLOCK_SHAPES:
        raise ValueError(f"block_shape must be one of {BLOCK_SHAPES}, got {block_shape!r}")
    two_d = block_shape == (BLOCK, BLOCK)
    if block_amax_bits is not None:
        if not two_d:
            raise ValueError("block_amax_bits applies to block_shape=(16, 16) only")
        expected = tuple(qc.round_up(n, BLOCK) // BLOCK for n in x.shape)
        dtype = getattr(block_amax_bits, "dtype", type(block_amax_bits).__name__)
        shape = tuple(getattr(block_amax_bits, "shape", ()))
        if dtype != jnp.uint32 or shape != expected:
            raise TypeError(
                f"block_amax_bits must be uint32 of shape {expected} (nvfp4_block_amax_bits "
                f"of x), got {dtype}{shape}"
            )
    if two_d and hadamard_columnwise:
        raise ValueError(
            "hadamard_columnwise applies to 1×16 blocks only (TransformerEngine rotates "
            "activations and gradients, not 16×16 weight blocks)"
        )
    for name, flag in (
        ("hadamard_columnwise", hadamard_columnwise),
        ("stochastic_rounding", stochastic_rounding),
    ):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    config = qc.resolve_config(config, NVFP4QuantizeConfig)
    scalars = [jnp.ones((2,), jnp.float32), jnp.ones((2,), jnp.float32)]
    seeds = [jnp.uint32(0), jnp.uint32(0)]
    rows, cols = x.shape
    padded_rows, padded_cols = config.padded_shape(rows, cols)
    row_blocks = qc.round_up(rows, BLOCK) // BLOCK
    flags = dict(two_d=two_d, stochastic=stochastic_rounding)
    group_tables = [
        _grouped_copy_table(
            "rowwise",
            "line",
            rows,
            padded_rows,
            1,
            wanted=rowwise,
            amax=rowwise_line_amax,
            seed=rowwise_line_seed,
            position=rowwise_line_position,
            scalar_forms=dict(
                rowwise_amax=rowwise_amax,
                rowwise_seed=rowwise_seed,
                rowwise_position=rowwise_position,
            ),
            **flags,
        ),
        _grouped_copy_table(
            "columnwise",
            "block",
            row_blocks,
            padded_rows // BLOCK,
            BLOCK,
            wanted=columnwise,
            amax=columnwise_block_amax,
            seed=columnwise_block_seed,
            position=columnwise_block_position,
            scalar_forms=dict(
                columnwise_amax=columnwise_amax,
                columnwise_seed=columnwise_seed,
                columnwise_position=columnwise_position,
            ),
            **flags,
        ),
    ]
    grouped = tuple(table is not None for table in group_tables)
    fused_amax = None
    if amax_in_kernel is not False:
        fused_amax = _fused_amax_options(
            x,
            config,
            amax_in_kernel=amax_in_kernel,
            amax_ctas=amax_ctas,
            hadamard_columnwise=hadamard_columnwise,
            two_d=two_d,
            grouped=any(grouped),
            given=dict(rowwise_amax=rowwise_amax, columnwise_amax=columnwise_amax),
            interpret=interpret,
        )
    elif amax_ctas is not None:
        raise ValueError("amax_ctas applies to amax_in_kernel=True only")
    # (With the amax taken in the kernel, so are the scalars: the launch gets none.)
    if rowwise and not grouped[0]:
        if fused_amax is None:
            scalars[0] = copy_scalars(_check_amax(rowwise_amax, "rowwise_amax"))
        if stochastic_rounding:
            seeds[0] = _check_seed(rowwise_seed, "rowwise_seed")
    if columnwise and not grouped[1]:
        if fused_amax is None:
            scalars[1] = copy_scalars(_check_amax(columnwise_amax, "columnwise_amax"))
        if stochastic_rounding:
            seeds[1] = _check_seed(columnwise_seed, "columnwise_seed")
    positioned = rowwise_position is not None or columnwise_position is not None
    if positioned and not stochastic_rounding:
        raise ValueError("rowwise_position / columnwise_position apply to stochastic_rounding")
    # One extra kernel input only when positioned: the unpositioned launch stays as it was.
    extra_inputs = []
    if positioned:
        extra_inputs.append(
            jnp.concatenate(
                [
                    _check_position(rowwise_position, "rowwise_position"),
                    _check_position(columnwise_position, "columnwise_position"),
                ]
            )
        )
    xp = qc.pad_to(x, padded_rows, padded_cols)
    qc.check_smem(
        config, x.dtype, padded_cols, qc.data_outputs(rowwise, columnwise, elements_per_byte=2)
    )
    out_types = []
    if rowwise:
        out_types += [
            jax.ShapeDtypeStruct((padded_rows, padded_cols // 2), jnp.uint8),
            jax.ShapeDtypeStruct((padded_rows, padded_cols // BLOCK), jnp.float8_e4m3fn),
        ]
    if columnwise:
        out_types += [
            jax.ShapeDtypeStruct((padded_cols, padded_rows // 2), jnp.uint8),
            jax.ShapeDtypeStruct((padded_cols, padded_rows // BLOCK), jnp.float8_e4m3fn),
        ]
    block_amaxes = ()
    compact_block_amaxes = two_d and config.compact_block_amaxes and not qc.interpreting(interpret)
    if two_d:
        if block_amax_bits is None:
            block_amax_bits = nvfp4_block_amax_bits(x, interpret=interpret)
        if compact_block_amaxes:
            block_amaxes = (_padded_block_amaxes(block_amax_bits, padded_rows, padded_cols),)
        else:
            block_amaxes = _block_amax_per_line(block_amax_bits, padded_rows, padded_cols)
    # With the amax taken in the kernel, its scalars, amaxes and per-CTA partials are outputs.
    if fused_amax is not None:
        out_types += [
            jax.ShapeDtypeStruct((2, 2), jnp.float32),
            jax.ShapeDtypeStruct((2,), jnp.uint32),
            jax.ShapeDtypeStruct((fused_amax["ctas"], 2), jnp.uint32),
        ]
    scalar_inputs = [jnp.stack(scalars)] if fused_amax is None else []
    outs = qc.run_tiles(
        _kernel,
        xp,
        *scalar_inputs,
        jnp.stack(seeds),
        *extra_inputs,
        *block_amaxes,
        *(table for table in group_tables if table is not None),
        out_types=out_types,
        config=config,
        outputs=qc.data_outputs(rowwise, columnwise, elements_per_byte=2),
        interpret=interpret,
        rowwise=rowwise,
        columnwise=columnwise,
        two_d=two_d,
        compact_block_amaxes=compact_block_amaxes,
        positioned=positioned,
        **({"grouped": grouped} if any(grouped) else {}),
        hadamard=hadamard_columnwise,
        stochastic=stochastic_rounding,
        on_hardware=not qc.interpreting(interpret),
        **({"fused_amax": fused_amax} if fused_amax is not None else {}),
    )
    if fused_amax is not None:
        outs, amax_bits = outs[:-3], outs[-2]
    rows16, cols16 = qc.round_up(rows, BLOCK), qc.round_up(cols, BLOCK)
    # 16×16 blocks keep the padded lines of the last block and one scale row per block.
    lines = {"rowwise": rows16 if two_d else rows, "columnwise": cols16 if two_d else cols}
    width = {"rowwise": cols16, "columnwise": rows16}
    result = {}
    for usage, wanted in (("rowwise", rowwise), ("columnwise", columnwise)):
        if not wanted:
            continue
        data, scale = outs[:2]
        outs = outs[2:]
        if two_d:  # sliced as bytes: XLA:CPU rewrites NaN payloads when it copies float8
            scale_bytes = lax.bitcast_convert_type(scale, jnp.uint8)[::BLOCK]
            scale = lax.bitcast_convert_type(scale_bytes, scale.dtype)
        result[f"{usage}_data"] = qc.crop(data, lines[usage], width[usage] // 2)
        result[f"{usage}_scale"] = qc.crop(
            scale, lines[usage] // (BLOCK if two_d else 1), width[usage] // BLOCK
        )
    quantized = NVFP4Quantized(
        rowwise_data=result.get("rowwise_data"),
        rowwise_scale=result.get("rowwise_scale"),
        columnwise_data=result.get("columnwise_data"),
        columnwise_scale=result.get("columnwise_scale"),
    )
    if fused_amax is None:
        return quantized
    amaxes = lax.bitcast_convert_type(amax_bits, jnp.float32)
    return quantized, amaxes[0], amaxes[1]


def _fused_amax_options(
    x, config, *, amax_in_kernel, amax_ctas, hadamard_columnwise, two_d, grouped, given, interpret
) -> dict:
    """`_global_amax_prologue`'s keywords for `quantize_nvfp4(amax_in_kernel=True)`, after
    checking that the launch can take the amax itself."""
    if amax_in_kernel is not True:
        raise TypeError(f"amax_in_kernel must be a bool, got {amax_in_kernel!r}")
    for name, value in given.items():
        if value is not None:
            raise ValueError(f"{name} must be None with amax_in_kernel=True (the kernel takes it)")
    if two_d or grouped:
        raise ValueError(
            "amax_in_kernel=True takes one global amax per copy: 1×16 blocks without "
            "per-line or per-block (grouped) amaxes"
        )
    if qc.interpreting(interpret):
        raise ValueError(
            "amax_in_kernel=True needs the GPU: the Pallas interpreter has no semaphores"
        )
    padded_rows, padded_cols = config.padded_shape(*x.shape)
    if config.runs_pipeline(padded_cols):
        raise ValueError("amax_in_kernel=True needs one-tile CTAs (steps_per_cta=1)")
    vector = _direct_amax_vector(x.dtype, padded_cols, hadamard_columnwise)
    units = _direct_amax_units(padded_rows, padded_cols, vector)
    grid_ctas = math.prod(qc.tile_grid(padded_rows, padded_cols, config)["grid"])
    # At most one per SM: every partial CTA must be resident while CTA 0 waits for it.
    most = min(gmc.num_sms_default(), grid_ctas, units)
    if amax_ctas is None:
        amax_ctas = most
    if not isinstance(amax_ctas, int) or not 1 <= amax_ctas <= most:
        raise ValueError(
            f"amax_ctas must be an int in [1, {most}] (one per SM at most, and no more than "
            f"the launch's tiles), got {amax_ctas!r}"
        )
    return dict(ctas=amax_ctas, vector=vector, hadamard=hadamard_columnwise)


# ----------------------------------------------------------------------------------------------
# Global amax: a reduction kernel that reads x once for both copies.


def _row_maxima(x_smem, *, tk: int, in_dtype):
    """Each row's max|x| of a tile (tm,), as float32 bit patterns (uint32) of the values
    widened to float32 (NaN bits as the grouped quantizer's reference gives them: stop 33's
    max over the raw bf16 patterns kept the input's NaN payload and failed its gpu tests)."""
    row_max = None
    for c in range(tk // 32):
        m = qc.row_amax_bits(qc.load_rows(x_smem.at[:, pl.ds(c * 32, 32)], in_dtype))
        row_max = m if row_max is None else jnp.maximum(row_max, m)
    return row_max


def _column_block_maxima(x_smem, *, tm: int, hadamard: bool) -> list[jax.Array]:
    """Per 16-row block of a tile, each column's max of |x| (of |hadamard16(xᵀ)| with
    `hadamard`) as uint32 bit patterns (tk,)."""
    block_maxima = []
    for b in range(tm // BLOCK):
        v = qc.load_columns(x_smem.at[pl.ds(b * BLOCK, BLOCK), :])
        if hadamard:
            v = hadamard16_lines(v)
        block_maxima.append(qc.row_amax_bits(v))
    return block_maxima


def _amax_kernel(x_gmem, *refs, config, cols, in_dtype, hadamard):
    """One tile's two maxima (rowwise, columnwise; uint32 bit patterns) into out[i, j]. Without
    the Hadamard transform both copies' amax is max|x|: one row-per-thread pass serves both."""
    out_gmem, *scratch = refs
    tm, tk = config.tile_m, config.tile_k

    def tile(x_smem, m0, k0, dests):
        i, j = m0 // tm, k0 // tk
        row_amax = jnp.max(_row_maxima(x_smem, tk=tk, in_dtype=in_dtype))
        out_gmem[i, j, 0] = row_amax
        if hadamard:
            block_maxima = _column_block_maxima(x_smem, tm=tm, hadamard=True)
            out_gmem[i, j, 1] = jnp.max(functools.reduce(jnp.maximum, block_maxima))
        else:
            out_gmem[i, j, 1] = row_amax

    qc.for_each_tile(x_gmem, tuple(scratch), config, cols, tile, [])


def _line_amax_kernel(x_gmem, *refs, config, in_dtype, hadamard):
    """One tile's amaxes per line (uint32 bit patterns): each row's max into row_out[rows of
    the tile, j] and each 16-row block's columnwise max into block_out[j, blocks of the tile]."""
    row_gmem, block_gmem, x_smem, barrier = refs
    i, j = qc.cta_position(config, x_gmem.shape[0], x_gmem.shape[1])
    tm, tk = config.tile_m, config.tile_k
    plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(i * tm, tm), pl.ds(j * tk, tk)], x_smem, barrier)
    plgpu.barrier_wait(barrier)
    row_max = _row_maxima(x_smem, tk=tk, in_dtype=in_dtype)
    block_maxima = _column_block_maxima(x_smem, tm=tm, hadamard=hadamard)
    for b, m in enumerate(block_maxima):  # this 16-row block's max over the tile's columns
        block_gmem[j, i * (tm // BLOCK) + b] = jnp.max(m)
    qc.store_line_bytes(row_gmem.at[pl.ds(i * tm, tm), pl.ds(j, 1)], qc.column(row_max))


def _check_amax_arguments(x, hadamard_columnwise) -> None:
    qc.check_input(x)
    if not isinstance(hadamard_columnwise, bool):
        raise TypeError(f"hadamard_columnwise must be a bool, got {hadamard_columnwise!r}")


def _amax_partials(x, hadamard_columnwise, config, interpret, per_line):
    """The amax kernel's per-tile outputs for x padded to whole tiles."""
    _check_amax_arguments(x, hadamard_columnwise)
    config = qc.resolve_config(config, NVFP4QuantizeConfig)
    # One tile per CTA: a reduction needs no pipeline (steps_per_cta(_m) are ignored; stop 33
    # streamed 4-32 tiles along K through a 2-3 stage pipeline: within ±3%, no gain).
    config = dataclasses.replace(config, steps_per_cta=1, steps_per_cta_m=1)
    padded_rows, padded_cols = config.padded_shape(*x.shape)
    xp = qc.pad_to(x, padded_rows, padded_cols)
    grid = qc.tile_grid(padded_rows, padded_cols, config)
    grid_m, grid_k = padded_rows // config.tile_m, padded_cols // config.tile_k
    options = dict(config=config, in_dtype=jnp.dtype(x.dtype), hadamard=hadamard_columnwise)
    if per_line:
        out_type = (
            jax.ShapeDtypeStruct((padded_rows, grid_k), jnp.uint32),
            jax.ShapeDtypeStruct((grid_k, padded_rows // BLOCK), jnp.uint32),
        )
        kernel = functools.partial(_line_amax_kernel, **options)
    else:
        out_type = jax.ShapeDtypeStruct((grid_m, grid_k, 2), jnp.uint32)
        kernel = functools.partial(_amax_kernel, cols=padded_cols, **options)
    partials = plgpu.kernel(
        kernel,
        out_type=out_type,
        kernel_name="nvfp4_line_amax" if per_line else "nvfp4_amax",
        scratch_types=qc.tile_scratch(config, x.dtype, padded_cols),
        interpret=qc.interpret_params(interpret),
        compiler_params=qc.kernel_params(config, padded_cols),
        **grid,
    )(xp)
    return jax.tree.map(lambda p: varying_like(p, xp), partials)


# The direct-load global amax: no TMA and no shared memory. Each CTA (one warpgroup) walks
# units of 16 rows x `chunk` columns, grid-stride, loading every row slice straight from global
# memory into registers in one strided layout, so thread t holds the same columns of all 16
# rows and the Hadamard transform runs element by element across the 16 loaded arrays. At 16
# bytes per thread and load a bare max|x| this way reads x at XLA's rate (stop 33, H200:
# 31.4-31.9 µs for 128 MiB, XLA's max|x| 31.4). In alternation, 8192² bf16: 33.8 µs without the
# transform and 37.9 with it, against 42.0 / 44.7 for the TMA tile kernel above.
_WARPGROUP_THREADS = 128
DIRECT_AMAX_CTAS = 1024


def _direct_amax_bits(x_gmem, cta, *, ctas: int, vector: int, hadamard: bool):
    """(max|x|, max|hadamard16(xᵀ)| or max|x|) over CTA `cta`'s units of x (of `ctas` CTAs
    taking every ctas-th unit), as float32 bit patterns (uint32 scalars)."""
    rows, cols = x_gmem.shape
    chunk = _WARPGROUP_THREADS * vector
    chunks_per_row = cols // chunk
    units = _direct_amax_units(rows, cols, vector)
    layout = plgpu.Layout.WG_STRIDED((chunk,), vec_size=vector)

    def unit(k, carry):
        row_bits, column_bits = carry
        u = cta + k * ctas
        r0 = (u // chunks_per_row) * BLOCK
        c0 = (u % chunks_per_row) * chunk
        lines = [
            plgpu.load(x_gmem.at[r0 + i, pl.ds(c0, chunk)], layout=layout).astype(jnp.float32)
            for i in range(BLOCK)
        ]
        # |x| of the values widened to float32, as the tile kernels take it (the same NaN bits).
        for line in lines:
            row_bits = jnp.maximum(row_bits, qc.abs_bits(line))
        if hadamard:
            for line in hadamard16_of_lines(lines):
                column_bits = jnp.maximum(column_bits, qc.abs_bits(line))
        return row_bits, column_bits

    zeros = plgpu.layout_cast(jnp.zeros((chunk,), jnp.uint32), layout)
    row_bits, column_bits = lax.fori_loop(0, (units - cta + ctas - 1) // ctas, unit, (zeros, zeros))
    row_amax = jnp.max(row_bits)
    return row_amax, jnp.max(column_bits) if hadamard else row_amax


def _direct_amax_kernel(x_gmem, out_gmem, *, ctas: int, vector: int, hadamard: bool):
    """out[cta] = `_direct_amax_bits` of this CTA's units."""
    cta = lax.axis_index("cta")
    row_amax, column_amax = _direct_amax_bits(
        x_gmem, cta, ctas=ctas, vector=vector, hadamard=hadamard
    )
    out_gmem[cta, 0] = row_amax
    out_gmem[cta, 1] = column_amax


def _direct_amax_units(rows: int, cols: int, vector: int) -> int:
    """Units (16 rows × one warpgroup's chunk of columns) of `_direct_amax_bits` in x."""
    return rows // BLOCK * (cols // (_WARPGROUP_THREADS * vector))


def _direct_amax_vector(dtype, cols: int, hadamard: bool) -> int:
    """Elements per thread and load of `_direct_amax_bits`: 16 bytes, 8 with the Hadamard
    transform (each thread then holds 16 rows' values in float32, and 8-byte loads keep them in
    registers: stop 33, H200, ~36 µs at 8 bytes, ~39-44 at 16), or the widest below that
    divides the padded columns into whole warpgroup chunks."""
    vector = (8 if hadamard else 16) // jnp.dtype(dtype).itemsize
    while cols % (_WARPGROUP_THREADS * vector):
        vector //= 2
    return vector


def _direct_amax_partials(x, hadamard_columnwise, interpret, *, ctas=None, vector=None):
    """Per-CTA amax bit patterns (ctas, 2) of x padded to 16-row blocks and 128 columns, from
    `_direct_amax_kernel`; `vector` elements per thread and load (default: 16 bytes, 8 with the
    Hadamard transform, or the widest below that divides the padded columns into whole
    warpgroup chunks), `ctas` CTAs (default 1024, 512 with the transform)."""
    _check_amax_arguments(x, hadamard_columnwise)
    rows = -(-x.shape[0] // BLOCK) * BLOCK
    cols = -(-x.shape[1] // _WARPGROUP_THREADS) * _WARPGROUP_THREADS
    xp = qc.pad_to(x, rows, cols)
    if vector is None:
        vector = _direct_amax_vector(x.dtype, cols, hadamard_columnwise)
    if cols % (_WARPGROUP_THREADS * vector):
        raise ValueError(
            f"vector must split x's {cols} padded columns into chunks of {_WARPGROUP_THREADS} "
            f"x vector elements, got vector={vector}"
        )
    if ctas is None:
        ctas = DIRECT_AMAX_CTAS // 2 if hadamard_columnwise else DIRECT_AMAX_CTAS
    ctas = min(ctas, _direct_amax_units(rows, cols, vector))
    partials = plgpu.kernel(
        functools.partial(
            _direct_amax_kernel, ctas=ctas, vector=vector, hadamard=hadamard_columnwise
        ),
        out_type=jax.ShapeDtypeStruct((ctas, 2), jnp.uint32),
        kernel_name="nvfp4_amax_direct",
        interpret=qc.interpret_params(interpret),
        grid=(ctas,),
        grid_names=("cta",),
    )(xp)
    return varying_like(partials, xp)


def nvfp4_amax(
    x: jax.Array,
    *,
    hadamard_columnwise: bool = False,
    config: NVFP4QuantizeConfig | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Global amaxes (float32 scalars) of NVFP4's rowwise copy (max|x|) and columnwise copy
    (max|hadamard16(xᵀ)| when `hadamard_columnwise`, else the same as rowwise), in one pass
    over x: per-CTA (`amax_direct_loads`) or per-tile maxima from the kernel, then a tiny jnp
    max. NaN-propagating."""
    config = qc.resolve_config(config, NVFP4QuantizeConfig)
    if config.amax_direct_loads:
        partial = _direct_amax_partials(x, hadamard_columnwise, interpret)
    else:
        partial = _amax_partials(x, hadamard_columnwise, config, interpret, per_line=False)
    bits = jnp.max(partial.reshape(-1, 2), axis=0)
    amax = lax.bitcast_convert_type(bits, jnp.float32)
    return amax[0], amax[1]


def nvfp4_line_amax_bits(
    x: jax.Array,
    *,
    hadamard_columnwise: bool = False,
    config: NVFP4QuantizeConfig | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """`nvfp4_amax` at a finer grain, for a buffer that holds several tensors along its rows
    (a grouped quantizer's groups, each a whole number of 16-row blocks): the float32 bit
    patterns (uint32) of
      row_amax (M,): max|x| of each row (the rowwise copy's lines), and
      block_amax (ceil(M/16),): max of |hadamard16(xᵀ)| (|xᵀ| without `hadamard_columnwise`)
        over each 16-row block of x, i.e. over 16 tokens of every line of the columnwise copy,
    in one pass over x. A tensor's global amaxes are the maxima of its rows' and blocks'
    patterns (the largest pattern is the largest |value|, and NaN's patterns exceed Inf's)."""
    row_partial, block_partial = _amax_partials(
        x, hadamard_columnwise, config, interpret, per_line=True
    )
    rows = x.shape[0]
    return jnp.max(row_partial, axis=1)[:rows], jnp.max(block_partial, axis=0)[: -(-rows // BLOCK)]
