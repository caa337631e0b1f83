"""Pieces shared by the Hopper (sm_90) quantize / dequantize kernels.

Register layout: "one thread owns one line"
-------------------------------------------
Every kernel works on 128×128 tiles of the 2-D input, one warpgroup (128 threads) per tile. The
tile is copied into shared memory once (TMA, swizzled), then read twice into registers with the
"row per thread" layout ``RPT(v)`` (Mosaic GPU's ``tmem_native_layout(v)``): thread ``t`` holds
row ``t`` of a ``(128·n, c)`` array, in vectors of ``v`` consecutive elements.

- rowwise copy: the tile itself, ``RPT(8)`` (16-byte shared-memory loads);
- columnwise copy: the *transposed view* of the tile, ``RPT(1)``: thread ``t`` holds column
  ``t`` of the tile, i.e. row ``t`` of the transposed copy (2- or 4-byte loads; the 32 lanes
  of a warp read 32 consecutive elements of one tile row, so there are no bank conflicts).

So both copies are "quantize the rows of a register array", every block reduction (amax, the
Hadamard butterfly, nibble packing) stays inside one thread, and each thread writes the bytes
of its own output row with 16-byte vector stores straight to global memory. Switching between
``RPT(1)`` and ``RPT(v)`` only regroups a thread's registers (no data movement).

Numerics follow ../shared/reference/numerics.md and the jnp references in jax_qtrain/formats
(this package never imports jax_qtrain; tests compare the two bit for bit). Amaxes are taken on
float32 bit patterns (``bits & 0x7FFFFFFF``, max as uint32): NaN-propagating and immune to
flush-to-zero, exactly like the references.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import config as jax_config
from jax._src.lib.mlir.dialects import llvm
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.manual_axes import varying_like

# One warpgroup per tile; the row-per-thread layout maps its 128 threads onto 128 rows.
LINES_PER_WARPGROUP = 128
TILE = 128

INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
FP8_MAX = {jnp.dtype(jnp.float8_e4m3fn): 448.0, jnp.dtype(jnp.float8_e5m2): 57344.0}
FLT_MAX = float(np.finfo(np.float32).max)
BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)
F32_INF_BITS = 0x7F800000
ABS_MASK = 0x7FFFFFFF


def row_per_thread(vector: int) -> plgpu.Layout:
    """Register layout: thread t holds row t (mod 128) in vectors of `vector` elements."""
    return plgpu.Layout.TCGEN05_TMEM_NATIVE(vector)


RPT1 = row_per_thread(1)


def interpret_params(interpret: bool):
    """What `plgpu.kernel(interpret=...)` takes: the Mosaic GPU interpreter or the hardware."""
    if not isinstance(interpret, bool):
        raise TypeError(f"interpret must be a bool, got {interpret!r}")
    # Unwritten outputs come back NaN / all-ones in the interpreter, so tests catch them.
    return plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else None


def interpreting(interpret: bool) -> bool:
    """Whether the kernel will run in Mosaic GPU's interpreter: asked for, or forced by
    `plgpu.force_gpu_interpret_mode` (which the benchmarks' CPU smoke runs use). Kernels whose
    hardware path leans on PTX semantics the interpreter does not share (a saturating FP8 cast)
    keep their interpreter-exact path there."""
    return interpret or jax_config.pallas_tpu_interpret_mode_context_manager.value is not None


def vector_for(dtype) -> int:
    """Elements per 16-byte vector."""
    return 16 // jnp.dtype(dtype).itemsize


def rows_layout(dtype) -> plgpu.Layout:
    """Layout of a tile slice loaded row-per-thread (16-byte vectors)."""
    return row_per_thread(vector_for(dtype))


def load_rows(ref, dtype) -> jax.Array:
    """Load a (128·n, c) slice of a tile buffer row-per-thread, as float32 (layout
    `rows_layout(dtype)`)."""
    return plgpu.load(ref, layout=rows_layout(dtype)).astype(jnp.float32)


def load_columns(ref) -> jax.Array:
    """Load a (rows, 128·n) slice of a tile buffer transposed: thread t gets column t (RPT1)."""
    return plgpu.load(ref.T, layout=RPT1).astype(jnp.float32)


def abs_bits(v: jax.Array) -> jax.Array:
    """|v| as uint32 bits; integer order = float order, NaN above +Inf."""
    return lax.bitcast_convert_type(v, jnp.uint32) & jnp.uint32(ABS_MASK)


def f32_from_bits(bits: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(bits, jnp.float32)


def row_amax_bits(v: jax.Array) -> jax.Array:
    """Per-row max|v| of a (R, C) float32 array, as uint32 bits (in-thread in RPT layouts)."""
    return jnp.max(abs_bits(v), axis=1)


def abs_patterns(raw: jax.Array) -> jax.Array:
    """|x| as bit patterns of x's own width (bf16: uint16, two per 32-bit register: half the
    integer operations; f32: uint32): integer order = float order, NaN above Inf."""
    if raw.dtype == jnp.bfloat16:
        return lax.bitcast_convert_type(raw, jnp.uint16) & jnp.uint16(0x7FFF)
    return abs_bits(raw)


def line_amax_bits(patterns: jax.Array) -> jax.Array:
    """Per-row amax, as float32 bit patterns (uint32), of `abs_patterns` (R, c): bf16 bits
    << 16 are the float32 bits, so the order and the NaN / Inf tests are unchanged."""
    amax = jnp.max(patterns, axis=1)
    return amax.astype(jnp.uint32) << 16 if patterns.dtype == jnp.uint16 else amax


def _inline_ptx_f32(values: jax.Array, layout, asm: str, *more_values: jax.Array) -> jax.Array:
    """`asm` (one PTX instruction, result $0, operands $1, $2, ...) on every element of float32
    arrays of one shape held in `layout` (`values`, then `more_values`), on the hardware only
    (inline code has no interpreter path)."""
    operands = (values, *more_values)
    constraints = "=f" + ",f" * len(operands)

    @plgpu.inline_mgpu(
        arg_types=(layout,) * len(operands),
        return_type=plgpu.ShapeDtypeStruct(values.shape, jnp.float32, layout=layout),
    )
    def apply(_, fragments, *more_fragments):
        def one_register(*registers):
            return llvm.inline_asm(registers[0].type, list(registers), asm, constraints)

        # Mosaic GPU's own helpers for one instruction per register (private API; jax is
        # pinned to 0.11.2, and the cross-lowering tests would catch a change).
        lifted = mgpu.FragmentedArray._lift_fast_instr(one_register)
        return fragments._pointwise(lifted, *more_fragments)

    return apply(*operands)


def ieee_reciprocal(values: jax.Array, *, on_hardware: bool) -> jax.Array:
    """1 / values for per-line float32 values (R,), correctly rounded (IEEE 754: to nearest
    even, subnormals kept), as the references' `float32_division.divide` gives.

    Mosaic GPU lowers a float `1 / x` to PTX's `rcp.approx.f32` (in the H200's PTX of jax
    0.11.2; NVFP4 codes then differed from the reference's), so on the hardware the kernel
    emits `rcp.rn.f32`, which is IEEE. The interpreter's `/` is XLA:CPU's IEEE division,
    which flushes subnormal quotients (and may read subnormal divisors as zero): callers
    must rule those out (tested for NVFP4's block scales)."""
    if not on_hardware:
        return jnp.float32(1.0) / values
    # (R, 1) in RPT1: a layout the inline code can be typed with.
    return jnp.max(_inline_ptx_f32(column(values), RPT1, "rcp.rn.f32 $0, $1;"), axis=1)


def one_plus_rounded_up_bits(values: jax.Array, layout, *, on_hardware: bool) -> jax.Array:
    """float32 bits (uint32) of 1 + values rounded toward +∞, for float32 0 ≤ values < 1:
    0x3F800000 + ceil(values · 2^23) (other values give unspecified bits). On the hardware
    PTX's `add.rp.f32` (Mosaic GPU lowers no ceil, and converting to an integer is a
    quarter-rate instruction), in the interpreter XLA's ceil of the exact product."""
    if not on_hardware:
        fixed = jnp.ceil(values * jnp.float32(2.0**23)).astype(jnp.uint32)
        return fixed + jnp.uint32(0x3F800000)
    one_plus = _inline_ptx_f32(values, layout, "add.rp.f32 $0, $1, 0f3F800000;")
    return lax.bitcast_convert_type(one_plus, jnp.uint32)


def exact_scale_add(
    values: jax.Array, scale: float, addend: float, layout, *, on_hardware: bool
) -> jax.Array:
    """values · scale + addend in one rounding, for a power-of-two `scale` (float32 values
    held in `layout`). On the hardware PTX's `fma.rn.f32` with both constants inline (one
    FMA-pipe instruction; Mosaic GPU's lowering does not contract a multiply and an add). In
    the interpreter the product is rounded first, which is exact unless it is subnormal:
    callers must make such products round the same either way."""
    _check_power_of_two(scale)
    if not on_hardware:
        return values * jnp.float32(scale) + jnp.float32(addend)
    asm = f"fma.rn.f32 $0, $1, {_ptx_f32(scale)}, {_ptx_f32(addend)};"
    return _inline_ptx_f32(values, layout, asm)


def _check_power_of_two(scale: float, *, signed: bool = False) -> None:
    """The fused multiply-adds below scale exactly only by a power of two (± when `signed`)."""
    magnitude = abs(scale) if signed else scale
    if np.frexp(magnitude)[0] != 0.5:
        raise ValueError(f"scale must be {'± ' if signed else ''}a power of two, got {scale}")


def _ptx_f32(value: float) -> str:
    """A float32 constant as PTX spells it inline (0f + its bits in hex)."""
    return f"0f{np.float32(value).view(np.uint32):08X}"


def saturated_scale_add(
    values: jax.Array, scale: float, addend: float, layout, *, on_hardware: bool
) -> jax.Array:
    """values · scale + addend in one rounding, clamped to [0, 1] (NaN to 0), for a power-of-two
    `scale` whose products do not lose bits (|scale| ≥ 1, or no subnormal products). On the
    hardware PTX's `fma.rn.sat.f32` (one FMA-pipe instruction); in the interpreter the same
    from the exact product: a product that overflows makes the sum overflow the same way."""
    _check_power_of_two(scale, signed=True)
    if not on_hardware:
        total = values * jnp.float32(scale) + jnp.float32(addend)
        # `total > 0` is False for NaN and ±0: both clamp to +0, as .sat does.
        return jnp.where(total > 0, jnp.minimum(total, jnp.float32(1.0)), jnp.float32(0.0))
    asm = f"fma.rn.sat.f32 $0, $1, {_ptx_f32(scale)}, {_ptx_f32(addend)};"
    return _inline_ptx_f32(values, layout, asm)


def scale_add(
    values: jax.Array, scale: float, addends: jax.Array, layout, *, on_hardware: bool
) -> jax.Array:
    """values · scale + addends (an array) in one rounding, for a power-of-two `scale` whose
    products are exact (no subnormal products): PTX's `fma.rn.f32` on the hardware (one
    instruction: Mosaic GPU's lowering keeps a multiply and an add apart), the product then
    the sum in the interpreter."""
    _check_power_of_two(scale, signed=True)
    if not on_hardware:
        return values * jnp.float32(scale) + addends
    return _inline_ptx_f32(values, layout, f"fma.rn.f32 $0, $1, {_ptx_f32(scale)}, $2;", addends)


def min_ignoring_nan(
    values: jax.Array, limits: jax.Array, layout, *, on_hardware: bool
) -> jax.Array:
    """min(values, limits) element by element, float32, where a NaN value gives its limit (IEEE
    minNum; `limits` are never NaN). On the hardware PTX's `min.f32`, which returns the other
    operand of a NaN (Mosaic GPU lowers `jnp.minimum` to `min.NaN.f32`, which propagates it);
    in the interpreter the same spelled out."""
    if not on_hardware:
        return jnp.where(jnp.isnan(values), limits, jnp.minimum(values, limits))
    return _inline_ptx_f32(values, layout, "min.f32 $0, $1, $2;", limits)


def is_nan_bits(bits: jax.Array) -> jax.Array:
    return bits > jnp.uint32(F32_INF_BITS)


def is_inf_bits(bits: jax.Array) -> jax.Array:
    return bits == jnp.uint32(F32_INF_BITS)


def broadcast_rows(values: jax.Array, shape: tuple[int, int], layout) -> jax.Array:
    """(R,) per-row values → (R, c) in `layout` (Mosaic's lane semantics needs the target
    layout of every broadcast spelled out)."""
    return plgpu.layout_cast(lax.broadcast_in_dim(values, shape, (0,)), layout)


def column(values: jax.Array) -> jax.Array:
    """(R,) per-row values → (R, 1) in RPT1."""
    return broadcast_rows(values, (values.shape[0], 1), RPT1)


def iota(shape: tuple[int, int], dimension: int, layout) -> jax.Array:
    return plgpu.broadcasted_iota(jnp.uint32, shape, dimension, layout=layout)


# The byte every FP8 NaN code is written as: CUDA's __nv_cvt_float_to_fp8 (TransformerEngine's
# cast) and Hopper's cvt.rn.satfinite give 0x7F; jax_qtrain's references do the same.
CANONICAL_FP8_NAN = 0x7F


def saturating_fp8(v: jax.Array, fp8_dtype) -> jax.Array:
    """RNE cast to FP8, saturating to ±max, NaN → NaN (Hopper's cvt.rn.satfinite; the clip makes
    the interpreter, which uses XLA's non-saturating cast, agree)."""
    limit = FP8_MAX[jnp.dtype(fp8_dtype)]
    return jnp.clip(v, -limit, limit).astype(fp8_dtype)


def store_line_bytes(dst_ref, values: jax.Array) -> None:
    """Store a (128·n, c) array held row-per-thread with the widest vectors that fit."""
    itemsize = jnp.dtype(values.dtype).itemsize
    vector = math.gcd(values.shape[1], max(1, 16 // itemsize))
    dst_ref[...] = plgpu.layout_cast(values, row_per_thread(vector))


def concat_columns(parts: list[jax.Array]) -> jax.Array:
    """(R, 1) arrays → (R, n), in RPT1 (a per-thread register regrouping)."""
    parts = [plgpu.layout_cast(p, RPT1) for p in parts]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def compiler_params() -> plgpu.CompilerParams:
    """Lane semantics and no automatic barriers, for kernels without shared-memory writes."""
    return plgpu.CompilerParams(
        lowering_semantics=plgpu.LoweringSemantics.Lane, unsafe_no_auto_barriers=True
    )


def pad_to(x: jax.Array, rows: int, cols: int) -> jax.Array:
    """Zero-pad a 2-D array up to (rows, cols); zeros never change a block amax."""
    pad_rows, pad_cols = rows - x.shape[0], cols - x.shape[1]
    if pad_rows == 0 and pad_cols == 0:
        return x
    return jnp.pad(x, ((0, pad_rows), (0, pad_cols)))


def crop(a: jax.Array, rows: int, cols: int) -> jax.Array:
    """a[:rows, :cols], bit-exact: sliced as unsigned integers, because XLA:CPU rewrites NaN
    payloads when it copies float8 arrays (an E5M2 0x7E comes back as 0x7F)."""
    if a.shape == (rows, cols):
        return a
    if jnp.issubdtype(a.dtype, jnp.floating):
        unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(a.dtype).itemsize]
        return lax.bitcast_convert_type(
            lax.bitcast_convert_type(a, unsigned)[:rows, :cols], a.dtype
        )
    return a[:rows, :cols]


def crop_codes(a: jax.Array, rows: int, cols: int, dtype) -> jax.Array:
    """Crop a uint8 code array and view it as `dtype` (a bitcast: no conversion)."""
    a = a[:rows, :cols] if a.shape != (rows, cols) else a
    return a if jnp.dtype(dtype) == jnp.uint8 else lax.bitcast_convert_type(a, dtype)


def as_bytes(codes: jax.Array) -> jax.Array:
    """FP8 codes as their uint8 bit patterns (kernels store bytes)."""
    return codes if codes.dtype == jnp.uint8 else lax.bitcast_convert_type(codes, jnp.uint8)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def check_input(x, name: str = "x") -> None:
    """Kernels read a 2-D bfloat16 or float32 array."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be a jax array, got {type(x).__name__}")
    if jnp.dtype(x.dtype) not in INPUT_DTYPES:
        raise TypeError(f"{name} must be bfloat16 or float32, got {x.dtype}")
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D (flatten leading dims first), got shape {x.shape}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{name} must not be empty, got shape {x.shape}")


def check_fp8_dtype(fp8_dtype, name: str = "fp8_dtype") -> jnp.dtype:
    try:
        dtype = jnp.dtype(fp8_dtype)
    except TypeError as err:
        raise TypeError(f"{name} must be float8_e4m3fn or float8_e5m2, got {fp8_dtype!r}") from err
    if dtype not in FP8_DTYPES:
        raise TypeError(f"{name} must be float8_e4m3fn or float8_e5m2, got {dtype}")
    return dtype


def check_copies(rowwise, columnwise) -> None:
    for name, flag in (("rowwise", rowwise), ("columnwise", columnwise)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    if not (rowwise or columnwise):
        raise ValueError("rowwise and columnwise are both False: ask for at least one copy")


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tiling shared by the quantize kernels.

    Attributes:
      tile_m: rows of x per tile (128 or 256: each of the warpgroup's threads owns tile_m / 128
        rows of the rowwise copy).
      tile_k: columns of x per tile (128 or 256: each thread owns tile_k / 128 rows of the
        transposed columnwise copy).
      steps_per_cta: consecutive tiles along K that one CTA handles. 1: one tile per CTA, and
        latency is hidden by running several CTAs per SM. More: the CTA streams its tiles
        through a TMA pipeline (`plgpu.emit_pipeline`), prefetching the next tiles while it
        quantizes one. Reduced to a divisor of the number of column tiles.
      steps_per_cta_m: consecutive tiles along M that one CTA handles (default 1): the CTA
        walks a block of steps_per_cta_m × steps_per_cta tiles through the pipeline, a row of
        tiles at a time. Any value above 1 makes the CTA pipelined. Reduced to a divisor of the
        number of row tiles. What `LineScaleConfig.stage_scales` needs for the columnwise copy.
      max_concurrent_steps: pipeline depth (shared-memory buffers) when steps_per_cta > 1.
      stage_outputs: write the codes of each tile into shared memory and copy them out with
        TMA (whole 128-byte lines), instead of storing each thread's row straight to global
        memory (16-byte pieces of 32 different lines per warp store). Scales are always stored
        directly (they are 1/16 to 1/32 of the codes).
      reuse_input_tile: stage the codes in the input tile's own shared memory (a `RefUnion`)
        instead of in buffers of their own. The codes wait in registers until every thread
        has read the tile (one warpgroup barrier), then go to shared memory and out by TMA.
        A CTA then needs only its input tile (bf16 128×128: 32 KiB instead of 66 KiB with
        both copies staged). One-tile CTAs with staged outputs only. On the H200 (stop 21,
        docs/benchmarks.md) ptxas then hoists the tile's loads and keeps it all live (249
        registers for MXFP8 row+col instead of 63), so occupancy does not rise; 1–3% faster
        in alternation, within run-to-run spread: not a default.
      stage_columnwise_in_input: stage the columnwise codes in the input tile's own memory,
        one 32-row slab at a time: the columnwise pass reads rows 32s..32s+31 of the tile (all
        threads), meets the others at a warpgroup barrier, and writes that slab's codes
        (tile_k lines × 32 bytes) over those rows; only the rowwise codes keep a buffer of
        their own. No code waits in registers (unlike `reuse_input_tile`), and a bf16
        128×128 row+col CTA needs 48 KiB of shared memory instead of 66: 4 CTAs per SM
        instead of 3. Only kernels whose columnwise pass reads the tile in 32-row slabs, in
        order, after the rowwise pass accept it (`reads_columnwise_in_slabs`: MXFP8 and the
        cast-transpose); one-tile CTAs with staged outputs only.
      band_tiles_m: the order in which CTAs take their tiles (blocks of tiles when
        pipelined). The GPU starts CTAs in the order of their index, and by default index
        i·(column tiles) + j takes tile row i, tile column j (Mosaic GPU makes the grid's last
        axis CUDA's x): consecutive CTAs walk along a whole row of tiles. With a band of b > 0
        tile rows they walk down b rows, then on to the band's next column, and the next band
        starts once this one is done: b × b consecutive CTAs cover a b × b square of tiles.
        What changes is only which tiles are in flight together (what the L2 sees at once),
        never a tile's outputs. 0 (or a band of at least the row tiles) keeps the grid order.
        On the H200 (docs/benchmarks.md, stop 32) every band tried was slower than the grid
        order (MXFP8 row+col 8192², 8 × 8: 78.2 against 75.8 µs for the kernel, the cast
        skeleton 77.0 against 74.0), but that run read the launch index as m fastest, so its
        CTAs did not take b × b squares; with the true order (stop 50, an H100) the squares
        were still slower (MXFP8 line-major scales 111.5 → 112.5 µs, tile-major 98.1 → 99.7).
    """

    # Whether the kernel's columnwise pass reads the tile in 32-row slabs, in order, after its
    # rowwise pass (what `stage_columnwise_in_input` relies on). Set by the kernels' configs.
    reads_columnwise_in_slabs: ClassVar[bool] = False

    tile_m: int = TILE
    tile_k: int = TILE
    steps_per_cta: int = 1
    steps_per_cta_m: int = 1
    max_concurrent_steps: int = 2
    stage_outputs: bool = True
    reuse_input_tile: bool = False
    stage_columnwise_in_input: bool = False
    band_tiles_m: int = 0

    def __post_init__(self):
        for name in (
            "tile_m",
            "tile_k",
            "steps_per_cta",
            "steps_per_cta_m",
            "max_concurrent_steps",
            "band_tiles_m",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {value!r}")
        for name in ("tile_m", "tile_k"):
            if getattr(self, name) not in (128, 256):
                raise ValueError(f"{name} must be 128 or 256, got {getattr(self, name)}")
        for name in ("steps_per_cta", "steps_per_cta_m"):
            if not 1 <= getattr(self, name) <= 64:
                raise ValueError(f"{name} must be in [1, 64], got {getattr(self, name)}")
        if self.band_tiles_m < 0:
            raise ValueError(f"band_tiles_m must be >= 0, got {self.band_tiles_m}")
        if not 1 <= self.max_concurrent_steps <= 4:
            raise ValueError(
                f"max_concurrent_steps must be in [1, 4], got {self.max_concurrent_steps}"
            )
        for name in ("stage_outputs", "reuse_input_tile", "stage_columnwise_in_input"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.reuse_input_tile and (self.pipelined or not self.stage_outputs):
            raise ValueError(
                "reuse_input_tile needs one-tile CTAs with staged outputs (steps_per_cta="
                f"steps_per_cta_m=1, stage_outputs=True), got steps_per_cta={self.steps_per_cta}, "
                f"steps_per_cta_m={self.steps_per_cta_m}, "
                f"stage_outputs={self.stage_outputs}"
            )
        if self.stage_columnwise_in_input:
            if not self.reads_columnwise_in_slabs:
                raise ValueError(
                    f"stage_columnwise_in_input is not supported by {type(self).__name__}: its "
                    "kernel does not read the columnwise copy in 32-row slabs after the rowwise "
                    "one"
                )
            if self.pipelined or not self.stage_outputs or self.reuse_input_tile:
                raise ValueError(
                    "stage_columnwise_in_input needs one-tile CTAs with staged outputs of their "
                    f"own (steps_per_cta=1, stage_outputs=True, reuse_input_tile=False), got "
                    f"steps_per_cta={self.steps_per_cta}, stage_outputs={self.stage_outputs}, "
                    f"reuse_input_tile={self.reuse_input_tile}"
                )

    def padded_shape(self, rows: int, cols: int) -> tuple[int, int]:
        return round_up(rows, self.tile_m), round_up(cols, self.tile_k)

    @property
    def pipelined(self) -> bool:
        """Whether a CTA may handle several tiles (then it streams them through a pipeline, even
        where a small input reduces its block of tiles to one)."""
        return self.steps_per_cta > 1 or self.steps_per_cta_m > 1

    def runs_pipeline(self, cols: int) -> bool:
        """Whether the CTAs of an input `cols` padded columns wide stream their tiles through
        the pipeline: several tiles along K, or any steps_per_cta_m > 1 (decided without the
        rows, which the scratch and compiler parameters do not know; a block of tiles that
        some input reduces to one is a one-step pipeline)."""
        return self.steps(cols) > 1 or self.steps_per_cta_m > 1

    def steps(self, cols: int) -> int:
        """Tiles per CTA along K for a padded width `cols`: the largest divisor of the number
        of column tiles that is at most steps_per_cta."""
        return _largest_divisor_at_most(cols // self.tile_k, self.steps_per_cta)

    def steps_m(self, rows: int) -> int:
        """Tiles per CTA along M for `rows` padded rows (as `steps`, with steps_per_cta_m)."""
        return _largest_divisor_at_most(rows // self.tile_m, self.steps_per_cta_m)

    def smem_bytes(self, dtype) -> int:
        return self.tile_m * self.tile_k * jnp.dtype(dtype).itemsize


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(limit, n) + 1) if n % d == 0)


@dataclasses.dataclass(frozen=True)
class LineScaleConfig(TileConfig):
    """`TileConfig` of the kernels that write one scale per block of each line (MXFP8, FP8
    block 1×128).

    Attributes (besides `TileConfig`'s):
      tile_major_scales (default True): write each tile's scales as one contiguous
        (lines, blocks per tile) piece of a tile-major array, (tiles, lines, blocks per
        tile), which the wrapper turns into the (lines, blocks) layout with one small XLA
        transpose. Stored straight into the (lines, blocks) layout (False), a tile's scales
        are 4 bytes per line (MXFP8; one float32 for 1×128), lines a whole row of scales
        apart: every thread's store is a partial 32-byte sector of its own, and the L2, the
        busiest unit of these kernels, takes one request per sector. Nsight Compute on the
        H200 (docs/benchmarks.md, 2026-12-02, 8192² row+col): L2 write sectors 5.24M →
        4.33M, kernel time 92.1 → 79.9 µs (MXFP8) and 92.8 → 77.9 µs (FP8 block 1×128).
      untile_kernel (default True): rearrange tile-major scales with the Pallas kernel of
        untile_scales.py, every copy in one launch, instead of one XLA transpose per copy
        (where the kernel cannot: tiles holding other than one 32-bit word per line, or
        counts of tiles not a multiple of 32).
      stage_scales (default False): collect the scales of all the CTA's tiles in shared
        memory and write them straight into the (lines, blocks) layout by TMA once the CTA is
        done, so no XLA transpose follows the kernel. A TMA box row must be a multiple of 16
        bytes, so a copy is staged only where the CTA's block of tiles gives each line that
        many bytes of scales: 4 tiles along the copy's blocks (MXFP8 and 1×128: 4 bytes per
        128-wide tile), i.e. steps_per_cta ≥ 4 for the rowwise copy and steps_per_cta_m ≥ 4
        for the columnwise one; a copy whose block of tiles is too small for it (a config or
        an input with fewer tiles) is written as `tile_major_scales` says. Bit-exact on the
        H200 but slower (docs/benchmarks.md, stop 31: MXFP8 row+col 8192² 86.0 µs with 4×4
        tiles per CTA, 83.1 with 4×8, against 79.0 with one-tile CTAs and the untile kernel):
        blocks of tiles balance worse over the SMs than one-tile CTAs.
    """

    tile_major_scales: bool = True
    untile_kernel: bool = True
    stage_scales: bool = False

    def __post_init__(self):
        super().__post_init__()
        for name in ("tile_major_scales", "untile_kernel", "stage_scales"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")


LINE_MAJOR, TILE_MAJOR, STAGED = "line-major", "tile-major", "staged"
TMA_ROW_BYTES = 16  # a TMA box's rows are whole multiples of 16 bytes
TMA_BOX_LINES = 256  # and it spans at most 256 elements along each dimension


@dataclasses.dataclass(frozen=True)
class LineScales:
    """How a kernel writes one copy's per-line block scales (see `LineScaleConfig`).

    `lines` × `blocks`: the padded copy's scales; `blocks_per_tile`: blocks of a line in one
    tile; `cta_lines` × `cta_blocks`: the part of them one CTA's block of tiles covers."""

    columnwise: bool
    layout: str
    lines: int
    blocks: int
    blocks_per_tile: int
    cta_lines: int
    cta_blocks: int
    dtype: jnp.dtype

    @property
    def out_shape(self) -> tuple:
        """The kernel's scale output: (lines, blocks), or (tiles, lines, blocks per tile)."""
        if self.layout == TILE_MAJOR:
            return (self.blocks // self.blocks_per_tile, self.lines, self.blocks_per_tile)
        return (self.lines, self.blocks)

    @property
    def stage_bytes(self) -> int:
        """Shared memory a staged copy's scales take per CTA (0 when not staged)."""
        return (
            self.cta_lines * self.cta_blocks * self.dtype.itemsize if self.layout == STAGED else 0
        )

    def out_type(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.out_shape, self.dtype)

    def scratch_types(self) -> list:
        """The shared-memory stage a staged copy needs (none otherwise)."""
        if self.layout != STAGED:
            return []
        return [plgpu.SMEM((self.cta_lines, self.cta_blocks), self.dtype)]


def line_scales(
    config: LineScaleConfig, shape: tuple[int, int], columnwise: bool, block: int, dtype
) -> LineScales:
    """`LineScales` of the rowwise or columnwise copy of an input padded to `shape`, with
    `block` elements per scale of type `dtype`."""
    rows, cols = shape
    steps_m, steps_k = config.steps_m(rows), config.steps(cols)
    if columnwise:
        lines, blocks, per_tile = cols, rows // block, config.tile_m // block
        cta_lines, cta_blocks = config.tile_k * steps_k, per_tile * steps_m
    else:
        lines, blocks, per_tile = rows, cols // block, config.tile_k // block
        cta_lines, cta_blocks = config.tile_m * steps_m, per_tile * steps_k
    dtype = jnp.dtype(dtype)
    if config.stage_scales and cta_blocks * dtype.itemsize % TMA_ROW_BYTES == 0:
        layout = STAGED
    else:
        layout = TILE_MAJOR if config.tile_major_scales else LINE_MAJOR
    return LineScales(columnwise, layout, lines, blocks, per_tile, cta_lines, cta_blocks, dtype)


def scale_stages(scales: list[LineScales]) -> list:
    """Shared-memory scratch of the staged copies among `scales`, in order."""
    return [stage for s in scales for stage in s.scratch_types()]


def split_scale_stages(refs, scales: list[LineScales]) -> tuple[tuple, list]:
    """(the other refs, the stage of each copy in `scales` or None): `run_tiles` appends the
    `scale_stages` after the tile scratch."""
    n = len(scale_stages(scales))
    stages = iter(refs[len(refs) - n :])
    return refs[: len(refs) - n], [next(stages) if s.layout == STAGED else None for s in scales]


@dataclasses.dataclass(frozen=True)
class LineScaleDest:
    """Where one copy's scales go in the kernel: its global output, or (staged) the CTA's
    shared-memory stage, whose (cta_lines, cta_blocks) start at line `line0`, block `block0`
    of the copy."""

    scales: LineScales
    gmem: object
    stage: object = None
    line0: object = 0
    block0: object = 0

    @classmethod
    def for_cta(cls, scales: LineScales, gmem, stage, position) -> LineScaleDest:
        """This CTA's destination (the CTA at `position` (i, j), from `cta_position`, covers
        x's rows from i·cta_rows, columns from j·cta_cols; the columnwise copy's lines are x's
        columns)."""
        if scales.layout != STAGED:
            return cls(scales, gmem)
        i, j = position
        line_cta, block_cta = (j, i) if scales.columnwise else (i, j)
        return cls(scales, gmem, stage, line_cta * scales.cta_lines, block_cta * scales.cta_blocks)

    def store(self, line0, lines: int, block0, values: jax.Array) -> None:
        """One tile's scales, `values` (lines, n) held row-per-thread: n blocks per line from
        block `block0` of the copy, lines from `line0`."""
        n = values.shape[1]
        if self.scales.layout == TILE_MAJOR:
            view = self.gmem.at[block0 // n, pl.ds(line0, lines), :]
        elif self.scales.layout == LINE_MAJOR:
            view = self.gmem.at[pl.ds(line0, lines), pl.ds(block0, n)]
        else:
            view = self.stage.at[pl.ds(line0 - self.line0, lines), pl.ds(block0 - self.block0, n)]
        store_line_bytes(view, values)

    def copy_out(self) -> None:
        """Issue the TMA copies of a staged CTA's scales (after `commit_smem`)."""
        if self.scales.layout != STAGED:
            return
        lines, blocks = self.scales.cta_lines, self.scales.cta_blocks
        for start in range(0, lines, TMA_BOX_LINES):
            n = min(TMA_BOX_LINES, lines - start)
            plgpu.copy_smem_to_gmem(
                self.stage.at[pl.ds(start, n)],
                self.gmem.at[pl.ds(self.line0 + start, n), pl.ds(self.block0, blocks)],
            )


def write_staged_scales(dests: list[LineScaleDest]) -> None:
    """After the CTA's last tile: copy the staged scales out and wait until they are read."""
    if all(d.scales.layout != STAGED for d in dests):
        return
    plgpu.commit_smem()  # every thread's scale stores, visible to the TMA
    for dest in dests:
        dest.copy_out()
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def tile_transforms(dtype) -> tuple:
    """Shared-memory transforms of an input tile: 32-column tiles, swizzled so that both the
    16-byte row loads (8 consecutive rows hit 8 distinct 16-byte bank groups) and the
    one-element column loads (32 consecutive elements of one row) are conflict-free."""
    elems = 32
    return (
        plgpu.TilingTransform((8, elems)),
        plgpu.SwizzleTransform(elems * jnp.dtype(dtype).itemsize),  # 64 B (16-bit), 128 B
    )


# Byte-wide code tiles in shared memory: 8×32-byte tiles with the 32-byte swizzle, so that the
# 16-byte row stores of 8 consecutive threads (rows) land in 8 distinct bank groups.
OUT_TRANSFORMS = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(32))


@dataclasses.dataclass(frozen=True)
class DataOutput:
    """A byte array of codes written one tile at a time: the rowwise copy (a tile_m × tile_k/d
    block) or the transposed columnwise copy (tile_k × tile_m/d), d = elements per byte."""

    columnwise: bool
    elements_per_byte: int = 1

    def block(self, config: TileConfig) -> tuple[int, int]:
        if self.columnwise:
            return config.tile_k, config.tile_m // self.elements_per_byte
        return config.tile_m, config.tile_k // self.elements_per_byte

    def block_index(self, i, jt):
        """Block coordinates of tile (i, jt) of x in this output."""
        return (jt, i) if self.columnwise else (i, jt)


def data_outputs(rowwise: bool, columnwise: bool, elements_per_byte: int = 1) -> list[DataOutput]:
    """The code arrays a kernel writes: the rowwise copy, then the columnwise one, if wanted."""
    return [
        DataOutput(columnwise=c, elements_per_byte=elements_per_byte)
        for c, wanted in ((False, rowwise), (True, columnwise))
        if wanted
    ]


@dataclasses.dataclass(frozen=True)
class TileDest:
    """Where a tile's codes go: a shared-memory tile buffer (origin 0, 0) or the global output
    at the tile's origin. `cols(start, width)` is the (lines, width) view at column `start`.

    `held`: with `TileConfig.reuse_input_tile` the buffer is the input tile's memory, which
    may not be written before every thread has read the tile; `cols` then returns a
    `HeldStore` that records the value in this list, and `for_each_tile` writes them all
    after the barrier."""

    ref: object
    line0: object
    col0: object
    lines: int
    held: list | None = None

    def cols(self, start: int, width: int):
        view = self.ref.at[pl.ds(self.line0, self.lines), pl.ds(self.col0 + start, width)]
        return view if self.held is None else HeldStore(view, self.held)


@dataclasses.dataclass(frozen=True)
class HeldStore:
    """A shared-memory view whose `view[...] = value` stores are held back: the value is kept
    (in registers) in `held` until `for_each_tile` writes it. Only plain stores are held, so
    a body must not store into it under `pl.when` (the value would escape the branch)."""

    view: object
    held: list

    def __setitem__(self, index, value) -> None:
        self.held.append((self.view, index, value))


# Rows of the input tile per slab of `stage_columnwise_in_input` (the MXFP8 block length).
SLAB_ROWS = 32


@dataclasses.dataclass(frozen=True)
class SlabDest:
    """Where a tile's columnwise codes go with `TileConfig.stage_columnwise_in_input`: slab s
    (the codes of input rows 32s..32s+31: output columns 32s..32s+31, all tile_k lines) lies
    over those rows of the input tile. `cols(32s, 32)` returns a store that first waits until
    every thread has read them."""

    slabs: tuple

    def cols(self, start: int, width: int):
        if start % SLAB_ROWS or width != SLAB_ROWS:
            raise ValueError(
                f"columnwise codes staged in the input tile are written one {SLAB_ROWS}-column "
                f"slab at a time, got columns {start}..{start + width}"
            )
        return StoreAfterBarrier(self.slabs[start // SLAB_ROWS])


@dataclasses.dataclass(frozen=True)
class StoreAfterBarrier:
    """A shared-memory view whose `view[...] = value` store waits at a warpgroup barrier first:
    the input rows it overwrites were loaded by every thread before (in program order) the
    barrier (`commit_smem`: a fence and a warpgroup barrier; the CTA is one warpgroup)."""

    view: object

    def __setitem__(self, index, value) -> None:
        plgpu.commit_smem()
        self.view[index] = value


def _staged(config: TileConfig, outputs) -> bool:
    return config.stage_outputs and bool(outputs)


def _reuses_input(config: TileConfig, outputs) -> bool:
    return config.reuse_input_tile and _staged(config, outputs)


def _slabbed(config: TileConfig, outputs) -> bool:
    """Whether the columnwise output (of `outputs`, `DataOutput`s) is staged in input slabs."""
    return (
        config.stage_columnwise_in_input
        and _staged(config, outputs)
        and any(out.columnwise for out in outputs)
    )


def _own_buffers(config: TileConfig, outputs) -> list:
    """The outputs that are staged in shared-memory buffers of their own."""
    if not _staged(config, outputs):
        return []
    if _slabbed(config, outputs):
        return [out for out in outputs if not out.columnwise]
    return list(outputs)


def _columnwise_slabs(config: TileConfig, dtype) -> list:
    """The columnwise codes' slabs, each (tile_k, 32) bytes, as one `RefUnion` group that puts
    slab s over input rows 32s..32s+31: the (8, 32)-tiled input tile keeps each 32-row slab
    contiguous (input_slab bytes from 32s · tile_k · itemsize), and a union group lays its refs
    out one after the other at 1024-byte alignment, so a filler after each slab (input_slab −
    code_slab bytes, a multiple of 1024) moves the next slab to the next input slab. The
    hardware tests catch any other placement (codes written over rows not yet read)."""
    input_slab = SLAB_ROWS * config.tile_k * jnp.dtype(dtype).itemsize
    code_slab = config.tile_k * SLAB_ROWS
    group = []
    for s in range(config.tile_m // SLAB_ROWS):
        if s:
            group.append(plgpu.SMEM((input_slab - code_slab,), jnp.uint8))
        group.append(plgpu.SMEM((config.tile_k, SLAB_ROWS), jnp.uint8, transforms=OUT_TRANSFORMS))
    return group


def tile_scratch(config: TileConfig, dtype, cols: int, outputs=()) -> tuple:
    """Scratch for `for_each_tile`: the input tile buffer and its barrier (one-tile CTAs; the
    pipeline allocates its own), then the staged output tiles; with `reuse_input_tile`, one
    `RefUnion` of the input tile and the staged output tiles, then the barrier; with
    `stage_columnwise_in_input`, one `RefUnion` of the input tile and the columnwise slabs,
    the barrier, then the rowwise output tile."""
    staged = [
        plgpu.SMEM(out.block(config), jnp.uint8, transforms=OUT_TRANSFORMS)
        for out in _own_buffers(config, outputs)
    ]
    if config.runs_pipeline(cols):
        return tuple(staged)
    smem = plgpu.SMEM((config.tile_m, config.tile_k), dtype, transforms=tile_transforms(dtype))
    if _reuses_input(config, outputs):
        return (plgpu.RefUnion(smem, staged), plgpu.Barrier())
    if _slabbed(config, outputs):
        union = plgpu.RefUnion(smem, _columnwise_slabs(config, dtype))
        return (union, plgpu.Barrier(), *staged)
    return (smem, plgpu.Barrier(), *staged)


H100_SMEM_BYTES = 227 * 1024  # per CTA on sm_90 (Hopper's opt-in maximum)


def check_smem(config: TileConfig, dtype, cols: int, outputs=(), extra_bytes: int = 0) -> None:
    """ValueError naming the config when its buffers (and `extra_bytes` of other scratch) do
    not fit in one SM's shared memory."""
    stages = config.max_concurrent_steps if config.runs_pipeline(cols) else 1
    needed = stages * config.smem_bytes(dtype)
    if _reuses_input(config, outputs):
        needed = max(needed, sum(math.prod(out.block(config)) for out in outputs))
    else:
        needed += sum(math.prod(out.block(config)) for out in _own_buffers(config, outputs))
    needed += extra_bytes
    if needed > H100_SMEM_BYTES - 4096:  # leave room for barriers and reduction scratch
        raise ValueError(
            f"config {config} needs {needed} bytes of shared memory for {jnp.dtype(dtype)} "
            f"input, more than the {H100_SMEM_BYTES} an sm_90 CTA has: use smaller tiles, "
            "fewer concurrent steps or stage_outputs=False"
        )


def split_refs(refs, config: TileConfig, cols: int, outputs=()) -> tuple[list, tuple]:
    """(output refs, scratch refs) of a kernel that used `tile_scratch`."""
    if _reuses_input(config, outputs):
        return list(refs[:-2]), tuple(refs[-2:])
    n_scratch = (0 if config.runs_pipeline(cols) else 2) + len(_own_buffers(config, outputs))
    if n_scratch == 0:
        return list(refs), ()
    return list(refs[:-n_scratch]), tuple(refs[-n_scratch:])


# Name of the warpgroup axis of kernels launched with several warpgroups per CTA.
WARPGROUP_AXIS = "wg"


def for_each_tile(
    x_gmem,
    scratch,
    config: TileConfig,
    cols: int,
    body,
    outputs=(),
    *,
    warpgroup_per_output: bool = False,
    before_wait=None,
) -> None:
    """Run `body(x_smem, m0, k0, dests)` on each of this CTA's tiles of x (first row m0, column
    k0) with the tile in shared memory (see `tile_transforms`). `outputs` pairs each global
    code array (uint8: FP8 codes are bitcast outside the kernel) with its `DataOutput`;
    `dests` gives the body one `TileDest` per output, staged in shared memory and copied out
    by TMA when `config.stage_outputs`.

    `before_wait()` (one-tile CTAs only) runs once the tile's load is issued and before the
    CTA waits for it: work that must precede the body and may overlap the load.

    `warpgroup_per_output`: the CTA has one warpgroup per output (launched by `run_tiles` with
    `warpgroups=len(outputs)`, one-tile CTAs only). Warpgroup 0 loads the tile; every warpgroup
    waits for it, then warpgroup w runs `body` with `dests[w]` only (the others are None) and
    stores output w itself, so the copies are quantized concurrently from one shared tile."""
    pipelined = config.runs_pipeline(cols)
    if before_wait is not None and (warpgroup_per_output or pipelined):
        raise ValueError("before_wait needs one-tile CTAs with one warpgroup (steps_per_cta=1)")
    if warpgroup_per_output:
        _for_each_tile_by_warpgroup(x_gmem, scratch, config, cols, body, outputs)
        return
    tm, tk = config.tile_m, config.tile_k
    staged = _staged(config, outputs)
    i, j = cta_position(config, x_gmem.shape[0], cols)
    reuse = _reuses_input(config, outputs)
    slabbed = _slabbed(config, [out for _, out in outputs])
    # Per output: its shared-memory tile, or (stage_columnwise_in_input) the columnwise slabs.
    if reuse:
        union, barrier = scratch
        x_smem, out_smems = union
    elif slabbed:
        union, barrier, *own = scratch
        x_smem, slab_group = union
        slabs = tuple(slab_group[0::2])  # between them: the fillers
        out_smems = [slabs if out.columnwise else own.pop(0) for _, out in outputs]
    elif not pipelined:
        x_smem, barrier, *out_smems = scratch
    else:
        out_smems = list(scratch)

    def run_body(x_smem, it, jt):
        """The body on tile (it, jt) of x."""
        m0, k0 = it * tm, jt * tk
        if not staged:
            dests = []
            for gmem, out in outputs:
                lines, _ = out.block(config)
                line0, col0 = (k0, m0) if out.columnwise else (m0, k0)
                dests.append(TileDest(gmem, line0, col0 // out.elements_per_byte, lines))
            body(x_smem, m0, k0, dests)
            return
        # The previous tile's output copies must have finished reading the buffers.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        held = [] if reuse else None
        dests = [
            SlabDest(smem)
            if isinstance(smem, tuple)
            else TileDest(smem, 0, 0, out.block(config)[0], held)
            for smem, (_, out) in zip(out_smems, outputs, strict=True)
        ]
        body(x_smem, m0, k0, dests)
        if reuse:
            # Every thread has read the input tile (a warpgroup barrier: the CTA is one
            # warpgroup) before any code overwrites it.
            plgpu.commit_smem()
            for view, index, value in held:
                view[index] = value
        plgpu.commit_smem()
        for smem, (gmem, out) in zip(out_smems, outputs, strict=True):
            rows, width = out.block(config)
            bi, bj = out.block_index(it, jt)
            if isinstance(smem, tuple):
                for s, slab in enumerate(smem):
                    column = bj * width + s * SLAB_ROWS
                    plgpu.copy_smem_to_gmem(
                        slab, gmem.at[pl.ds(bi * rows, rows), pl.ds(column, SLAB_ROWS)]
                    )
            else:
                plgpu.copy_smem_to_gmem(
                    smem, gmem.at[pl.ds(bi * rows, rows), pl.ds(bj * width, width)]
                )

    if not pipelined:
        plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(i * tm, tm), pl.ds(j * tk, tk)], x_smem, barrier)
        if before_wait is not None:
            before_wait()
        plgpu.barrier_wait(barrier)
        run_body(x_smem, i, j)
    else:
        steps_m, steps_k = config.steps_m(x_gmem.shape[0]), config.steps(cols)

        def tile_index(a, b):  # step (a, b) of the CTA's block of tiles → tile of x
            return i * steps_m + a, j * steps_k + b

        def step(indices, x_smem):
            run_body(x_smem, *tile_index(*indices))

        plgpu.emit_pipeline(
            step,
            grid=(steps_m, steps_k),
            in_specs=[
                plgpu.BlockSpec((tm, tk), tile_index, transforms=tile_transforms(x_gmem.dtype))
            ],
            max_concurrent_steps=min(config.max_concurrent_steps, steps_m * steps_k),
        )(x_gmem)
    if staged:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _for_each_tile_by_warpgroup(x_gmem, scratch, config: TileConfig, cols: int, body, outputs):
    if config.runs_pipeline(cols) or config.reuse_input_tile:
        raise ValueError(
            "one warpgroup per output needs one-tile CTAs (steps_per_cta=1) with their own "
            "output buffers (reuse_input_tile=False)"
        )
    tm, tk = config.tile_m, config.tile_k
    staged = _staged(config, outputs)
    i, j = cta_position(config, x_gmem.shape[0], cols)
    warpgroup = lax.axis_index(WARPGROUP_AXIS)
    x_smem, barrier, *out_smems = scratch
    m0, k0 = i * tm, j * tk

    # One warpgroup issues the load: in lane semantics all 128 threads of the issuing
    # warpgroup arrive on the barrier, which expects exactly one warpgroup's arrivals.
    @pl.when(warpgroup == 0)
    def _load():
        plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(m0, tm), pl.ds(k0, tk)], x_smem, barrier)

    # Waiting does not arrive, so every warpgroup can wait on the same barrier.
    plgpu.barrier_wait(barrier)
    for w, (gmem, out) in enumerate(outputs):

        @pl.when(warpgroup == w)
        def _quantize(w=w, gmem=gmem, out=out):
            rows, width = out.block(config)
            if staged:
                dest = TileDest(out_smems[w], 0, 0, rows)
            else:
                line0, col0 = (k0, m0) if out.columnwise else (m0, k0)
                dest = TileDest(gmem, line0, col0 // out.elements_per_byte, rows)
            body(x_smem, m0, k0, [dest if v == w else None for v in range(len(outputs))])
            if staged:
                # commit_smem fences and syncs this warpgroup only (a named barrier): the
                # copy is issued, and later waited for, by one thread of this warpgroup.
                plgpu.commit_smem()
                bi, bj = out.block_index(i, j)
                plgpu.copy_smem_to_gmem(
                    out_smems[w], gmem.at[pl.ds(bi * rows, rows), pl.ds(bj * width, width)]
                )
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def resolve_config(config, config_type: type) -> TileConfig:
    """`config`, or the kernel's defaults when None; a TypeError naming the expected type."""
    if config is None:
        return config_type()
    if not isinstance(config, config_type):
        raise TypeError(
            f"config must be None or of type {config_type.__name__}, got {type(config).__name__}"
        )
    return config


def run_tiles(
    kernel,
    xp,
    *inputs,
    out_types,
    config: TileConfig,
    outputs,
    interpret: bool,
    warpgroups: int = 1,
    extra_scratch: tuple = (),
    **options,
):
    """Launch a `for_each_tile` kernel on a tile-padded x (its first input; `inputs` follow)
    with the scratch, grid and compiler parameters of `config`. The kernel body is called with
    `config`, `cols` (x's padded width), `in_dtype` (x's dtype) and `options` as keywords.
    `warpgroups` > 1 launches that many warpgroups per CTA (axis `WARPGROUP_AXIS`; see
    `for_each_tile(warpgroup_per_output=True)`). `extra_scratch` follows the tile scratch in
    the kernel's refs (e.g. `scale_stages`). Returns the outputs as a list."""
    rows, cols = xp.shape
    body = functools.partial(kernel, config=config, cols=cols, in_dtype=xp.dtype, **options)
    threads = {} if warpgroups == 1 else dict(num_threads=warpgroups, thread_name=WARPGROUP_AXIS)
    launch = plgpu.kernel(
        body,
        out_type=tuple(out_types),
        # Named after the kernel's module (e.g. "quantize_nvfp4"), so profiler traces say which
        # kernel ran (otherwise every `functools.partial` body is "anonymous").
        kernel_name=kernel.__module__.rsplit(".", 1)[-1],
        scratch_types=(*tile_scratch(config, xp.dtype, cols, outputs), *extra_scratch),
        interpret=interpret_params(interpret),
        compiler_params=kernel_params(config, cols),
        **tile_grid(rows, cols, config),
        **threads,
    )
    return list(varying_like(launch(xp, *inputs), xp, *inputs))


def tile_grid(rows: int, cols: int, config: TileConfig) -> dict:
    """plgpu.kernel grid arguments for a (rows, cols) input padded to whole tiles."""
    return dict(
        grid=(
            rows // (config.tile_m * config.steps_m(rows)),
            cols // (config.tile_k * config.steps(cols)),
        ),
        grid_names=("m", "k"),
    )


def cta_position(config: TileConfig, rows: int, cols: int) -> tuple[jax.Array, jax.Array]:
    """(i, j): the tile row and column of this CTA's tile (of its block of tiles, pipelined) in
    `tile_grid(rows, cols, config)`, in the order `config.band_tiles_m` asks."""
    i, j = lax.axis_index("m"), lax.axis_index("k")
    grid_m, grid_k = tile_grid(rows, cols, config)["grid"]
    if config.band_tiles_m == 0 or config.band_tiles_m >= grid_m:
        return i, j
    # The launch index, re-read by bands. The GPU starts CTAs k fastest: Mosaic GPU reverses
    # the grid, so its last axis is CUDA's x (stops 32-49 took m as fastest here).
    return band_order(i * grid_k + j, grid_m, grid_k, config.band_tiles_m)


def band_order(linear, grid_m: int, grid_k: int, band: int):
    """The (row, column) that launch index `linear` takes in a (grid_m, grid_k) grid walked in
    bands of `band` rows (`TileConfig.band_tiles_m`): down a band's rows, then to its next
    column; the last band has the rows that are left. A permutation of the grid."""
    band_index, within = linear // (band * grid_k), linear % (band * grid_k)
    band_rows = jnp.minimum(band, grid_m - band_index * band)
    return band_index * band + within % band_rows, within // band_rows


def kernel_params(config: TileConfig, cols: int) -> plgpu.CompilerParams:
    """Lane semantics (layouts are chosen explicitly here, so Mosaic's layout inference, slow on
    these fully unrolled bodies, is not needed). One-tile CTAs only read shared memory that the
    TMA wrote, so they need no automatic barriers; the pipeline keeps them (it reuses buffers)."""
    return plgpu.CompilerParams(
        lowering_semantics=plgpu.LoweringSemantics.Lane,
        unsafe_no_auto_barriers=not config.runs_pipeline(cols),
    )
