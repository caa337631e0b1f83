"""Tile-major scales → the (lines, blocks) layout: every copy's scales in one Hopper kernel.

The MXFP8 and FP8 block 1×128 quantize kernels write each tile's scales as one contiguous
(lines, blocks per tile) piece of a (tiles, lines, blocks per tile) array
(`quantize_common.LineScaleConfig.tile_major_scales`): whole sectors, where the (lines, blocks)
layout would take 4 bytes per line and a partial sector per store. Something then has to put
them in the (lines, blocks) layout the formats define. With a tile's scales 4 bytes per line
(MXFP8 at 128-wide tiles: four E8M0 bytes; 1×128: one float32), that is a transpose of 32-bit
words: (tiles, lines) → (lines, tiles).

`untile_line_scales` is the XLA reference (one transpose per copy: ~3 µs each for an 8192²
input's 2 MiB of scales on the H200, docs/benchmarks.md) and `untile_line_scales_all` the
kernel: one launch for all copies, each CTA moving a (32 tiles, 128 lines) block of words through
shared memory (TMA in; thread t reads line t's 32 words, a column of the block; writes them as
a row of the swizzled output block; TMA out in whole 128-byte rows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import quantize_common as qc
from pallas_kernels.manual_axes import varying_like

TILES_PER_CTA = 32  # 32 words = one 128-byte output row per line
LINES_PER_CTA = qc.LINES_PER_WARPGROUP


def untile_line_scales(scales: jax.Array) -> jax.Array:
    """A scale output of `LineScales.out_shape` in the (lines, blocks) layout, by XLA (the
    reference of `untile_line_scales_all`). Byte scales move as 32-bit words (4 bytes of a line
    stay together): XLA transposes words faster than bytes."""
    if scales.ndim == 2:
        return scales
    tiles, lines, per_tile = scales.shape
    if scales.dtype.itemsize == 1 and per_tile % 4 == 0:
        words = lax.bitcast_convert_type(scales.reshape(tiles, lines, per_tile // 4, 4), jnp.uint32)
        moved = lax.bitcast_convert_type(words.transpose(1, 0, 2), jnp.uint8)
        return moved.reshape(lines, tiles * per_tile)
    return scales.transpose(1, 0, 2).reshape(lines, tiles * per_tile)


SCALE_LAYOUTS = ("lines", "tiles")
TILE = 128  # the "tiles" layout's tiles: 128 elements of a line


def check_scale_layout(scale_layout, shape: tuple[int, int]) -> None:
    """The wrappers' `scale_layout` argument: "lines", or "tiles" for whole 128×128 tiles."""
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"scale_layout must be one of {list(SCALE_LAYOUTS)}, got {scale_layout!r}")
    if scale_layout == "tiles" and any(n % TILE for n in shape):
        raise ValueError(
            f"scale_layout='tiles' needs x of whole {TILE}×{TILE} tiles, got shape {tuple(shape)}"
        )


def tiled_line_scales(scales: jax.Array, lines: int, blocks: int, block: int) -> jax.Array:
    """A kernel's scale output (either layout) as the "tiles" layout of a copy of `lines` ×
    `blocks` scales of `block` elements: (blocks / per_tile, lines, per_tile), per_tile the
    blocks of a 128-wide tile. The kernel's own tile-major output is that already when its
    tiles are 128 wide and unpadded (the default configs on whole tiles); any other is put in
    the (lines, blocks) layout and rearranged by XLA."""
    per_tile = TILE // block
    tiles_shape = (blocks // per_tile, lines, per_tile)
    if scales.shape == tiles_shape:
        return scales
    line_major = untile_line_scales(scales)[:lines, :blocks]
    return line_major.reshape(lines, blocks // per_tile, per_tile).transpose(1, 0, 2)


def as_words(scales: jax.Array) -> jax.Array | None:
    """A tile-major scale output whose tiles hold one 32-bit word per line as (tiles, lines)
    uint32 (a bitcast), when the kernel can move it: None otherwise."""
    if scales.ndim != 3 or scales.shape[2] * scales.dtype.itemsize != 4:
        return None
    tiles, lines, _ = scales.shape
    if tiles % TILES_PER_CTA or lines % LINES_PER_CTA:
        return None
    if scales.dtype.itemsize == 4:
        return lax.bitcast_convert_type(scales.reshape(tiles, lines), jnp.uint32)
    return lax.bitcast_convert_type(scales, jnp.uint32)


def from_words(words: jax.Array, like: jax.Array) -> jax.Array:
    """(lines, tiles) uint32 words back in `like`'s dtype: (lines, blocks) (a bitcast)."""
    lines, tiles = words.shape
    if like.dtype.itemsize == 4:
        return lax.bitcast_convert_type(words, like.dtype)
    return lax.bitcast_convert_type(words, like.dtype).reshape(lines, tiles * like.shape[2])


def untile_line_scales_all(
    scale_outputs: list[jax.Array], *, kernel: bool = True, interpret: bool = False
) -> list[jax.Array]:
    """Each of `scale_outputs` (a quantize kernel's, any layout) in the (lines, blocks) layout:
    the tile-major ones the kernel can move in one launch (`kernel`), the others by XLA."""
    if not isinstance(kernel, bool):
        raise TypeError(f"kernel must be a bool, got {kernel!r}")
    for s in scale_outputs:
        if getattr(s, "ndim", None) not in (2, 3):
            raise ValueError(
                "scale_outputs must be (lines, blocks) or (tiles, lines, blocks per tile) "
                f"arrays, got {getattr(s, 'shape', type(s).__name__)}"
            )
    movable = [as_words(s) if kernel else None for s in scale_outputs]
    words = [w for w in movable if w is not None]
    if not words:
        return [untile_line_scales(s) for s in scale_outputs]
    moved = iter(_transpose_words(words, interpret))
    return [
        untile_line_scales(s) if w is None else from_words(next(moved), s)
        for s, w in zip(scale_outputs, movable, strict=True)
    ]


def _transpose_words(words: list[jax.Array], interpret: bool) -> list[jax.Array]:
    """(tiles, lines) uint32 arrays → (lines, tiles), one kernel launch for all of them."""
    # CTAs [starts[a], starts[a] + counts[a]) move array a, a (line block, tile chunk) each.
    counts = [(w.shape[1] // LINES_PER_CTA) * (w.shape[0] // TILES_PER_CTA) for w in words]
    starts = [sum(counts[:a]) for a in range(len(words))]
    out = plgpu.kernel(
        functools.partial(_kernel, starts=tuple(starts), counts=tuple(counts)),
        out_type=tuple(jax.ShapeDtypeStruct(w.shape[::-1], jnp.uint32) for w in words),
        kernel_name="untile_scales",
        scratch_types=(
            plgpu.SMEM((TILES_PER_CTA, LINES_PER_CTA), jnp.uint32),
            plgpu.SMEM((LINES_PER_CTA, TILES_PER_CTA), jnp.uint32, transforms=_OUT_TRANSFORMS),
            plgpu.Barrier(),
        ),
        interpret=qc.interpret_params(interpret),
        compiler_params=qc.compiler_params(),
        grid=(sum(counts),),
        grid_names=("cta",),
    )(*words)
    return list(varying_like(out, *words))


# 32-word rows, 128-byte swizzle: the 16-byte row stores of 8 consecutive threads (lines) land
# in 8 distinct bank groups.
_OUT_TRANSFORMS = (plgpu.TilingTransform((8, TILES_PER_CTA)), plgpu.SwizzleTransform(128))


def _kernel(*refs, starts, counts):
    n = len(starts)
    words_in, words_out = refs[:n], refs[n : 2 * n]
    block_in, block_out, barrier = refs[2 * n :]
    cta = lax.axis_index("cta")
    for a in range(n):

        @pl.when(jnp.logical_and(cta >= starts[a], cta < starts[a] + counts[a]))
        def _move(a=a):
            chunks = words_in[a].shape[0] // TILES_PER_CTA
            line_block, chunk = (cta - starts[a]) // chunks, (cta - starts[a]) % chunks
            lines = pl.ds(line_block * LINES_PER_CTA, LINES_PER_CTA)
            tiles = pl.ds(chunk * TILES_PER_CTA, TILES_PER_CTA)
            plgpu.copy_gmem_to_smem(words_in[a].at[tiles, lines], block_in, barrier)
            plgpu.barrier_wait(barrier)
            # Thread t: line t's word of each tile (a column of the block: each warp reads
            # 32 consecutive words per tile, no bank conflicts), stored as row t.
            line_words = plgpu.load(block_in.T, layout=qc.RPT1)
            block_out[...] = plgpu.layout_cast(line_words, qc.row_per_thread(4))
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(block_out, words_out[a].at[lines, tiles])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
