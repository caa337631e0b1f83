"""Grouped (MoE) weight-gradient GEMM on Hopper: groups along the contraction.

``out[g] = lhs[:, tokens of g] @ rhs[:, tokens of g]ᵀ`` with ``lhs (K, M)`` and
``rhs (N, M)`` both contiguous along the token axis ``M`` (the columnwise copies
of x and dy, docs/design/layouts.md), ``group_sizes (G,) int32`` on the device and
``out (G, K, N)``. Groups without tokens get zeros.

``token_major=True`` takes 16-bit operands as they come out of the forward pass instead,
``lhs (M, K)`` and ``rhs (M, N)`` (x and dy themselves): the SMEM tiles are then
``(tile_t, tile_m)`` and ``(tile_t, 2*tile_n)`` and wgmma reads them MN-major (its transpose
bits, which Hopper has for 16-bit operands only), so no XLA transpose of x and dy runs before
the kernel. FP8 operands must be token-contiguous (wgmma reads 8-bit operands K-major only).

Structure: a persistent grid of one CTA per SM walks (group, row tile, column tile)
with a TMA producer warpgroup and two wgmma consumer warpgroups (each owns half of
the CTA's columns), each tile through its own pipeline or, with ``persistent_pipeline``,
all of a CTA's tiles through one. The token axis of a group is cut into ``tile_t`` chunks aligned
to multiples of ``tile_t`` in the global token index, so the first and last chunk of
a group may hold tokens of its neighbours. On those boundary chunks the foreign
tokens are zeroed in SMEM in both operands before the wgmma (each consumer zeroes
its rhs half and half of the shared lhs rows, then the two meet at a barrier).
Zeroing both keeps non-finite values of neighbouring groups (or of unused rows past
``sum(group_sizes)``) out of the result.

Operand types: bf16/f16, or FP8 e4m3/e5m2 (mixed allowed) with optional f32 scales
applied to the f32 accumulator: lhs ``()`` or ``(K,)`` and rhs ``()`` or ``(N,)``
(per-tensor, or per row of the stored operand — scales that are constant along
the contraction), and ``group_scale`` ``(G,)`` or ``(F, G)``: F factors per group applied
after them, one after another (a grouped per-tensor FP8 wgrad's two per-group scales,
multiplied; NVFP4's two global decode scales in turn): the output then leaves the kernel
final, in bf16 if asked, with no XLA pass over the float32 result. Or FP8 with 1x128 block
scales along the tokens on both operands (``lhs_block_scale (K, M/128)``, ``rhs_block_scale
(N, M/128)``: the block-FP8 recipe's columnwise copies of x and dy): each 128-token chunk is
one scale block, its wgmma goes into a fresh accumulator and is promoted into the f32 sum as
``main += chunk * (lhs_scale[row] * rhs_scale[col])``, the forward block-FP8 kernel's split
accumulator with the rhs scale per column (both scale stages stream with the chunks).
Run-time group sizes are clamped as in the forward kernels: negative sizes count as 0 and the
running sum is truncated at ``M``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import grouped_matmul_common as common
from pallas_kernels.manual_axes import varying_like

SMEM_BYTES = common.SMEM_BYTES
_PRODUCER_REGISTERS = 40
_NUM_CONSUMERS = 2
_MAX_ACC_ELEMS_PER_WG = 128 * 192


@dataclasses.dataclass(frozen=True)
class GroupedWgradConfig:
    """Tiling of the ragged-contraction (wgrad) kernel.

    tile_m: output rows (of K) per CTA tile: 128 or 256 (each consumer zeroes half of
      the lhs tile's rows on boundary chunks, in 64-row wgmma layouts).
    tile_n: output columns (of N) per consumer warpgroup; the CTA tile is
      tile_m x 2*tile_n.
    tile_t: tokens per pipeline step (64 suits 16-bit, 128 suits FP8: 128 bytes).
    max_concurrent_steps: SMEM pipeline depth.
    epi_tile_n: columns per epilogue store (divides tile_n).
    grid_minor_dim / grid_tile_width: planar-snake walk of one group's tiles.
    num_sms: persistent CTAs; None = the device's SM count.
    epilogue_buffers: SMEM staging buffers per consumer for the output stores (1 or 2).
    block_scales_before_mma: 1x128 block scales only: load each chunk's row and column
      scales from shared memory before its wgmma is issued (True) instead of right after
      (False, the default). The same arithmetic and bits. Why: Nsight Compute's per-instruction
      counters on an H100 (stop 56) showed ptxas placing the row-scale loads after the
      wgmma instructions at 4 stages, where they wait in the MIO queue behind the MMA and
      the promotion's multiply waits on them (MIO and short-scoreboard stalls; 4 stages run
      0.78-0.87x of 3), but before them at 3 stages; 2 stages show 4's stall ratios. Issuing
      them first takes that choice away from ptxas: on an H100 (stop 57) 4 stages then run
      1.3x faster and the MoE default (`DEFAULT_FP8_BLOCK_WGRAD_CONFIG`) has it.
    persistent_pipeline: one TMA pipeline from tile to tile: the producer loads the next
      tile's first token steps while the consumers finish the current tile and store it
      (`_persistent_tiles`), instead of a pipeline started empty at every tile. Why: at
      stop 56's 3 stages about 23% of the consumers' stall samples waited on the TMA
      barriers, with the pipeline restarting every 16 token steps at G8. The same bits
      (interpreter, and an H100 in stop 58), and faster wherever timed there (stop 58,
      `grouped_ab --variants fp8_block_wgrad` / `wgrad`): block FP8 G8 845 against 757
      TFLOP/s, G64 small experts 652 against 519, bf16 token-major G8 601 against 564. Every
      default config below has it; the field's own default stays False (a config built by
      hand gets the per-tile pipeline, the simpler of the two, unless it asks).
    """

    tile_m: int = 128
    tile_n: int = 128
    tile_t: int = 64
    max_concurrent_steps: int = 4
    epi_tile_n: int = 64
    grid_minor_dim: int = 1
    grid_tile_width: int = 4
    num_sms: int | None = None
    epilogue_buffers: int = 2
    block_scales_before_mma: bool = False
    persistent_pipeline: bool = False

    def __post_init__(self):
        if self.tile_m not in (128, 256):
            raise ValueError(f"tile_m must be 128 or 256, got {self.tile_m}")
        if self.tile_n < 64 or self.tile_n % 64 or self.tile_n > 256:
            raise ValueError(f"tile_n must be 64, 128, 192 or 256, got {self.tile_n}")
        if self.tile_t not in (32, 64, 128, 256):
            raise ValueError(f"tile_t must be 32, 64, 128 or 256, got {self.tile_t}")
        if not 1 <= self.max_concurrent_steps <= 8:
            raise ValueError(
                f"max_concurrent_steps must be in [1, 8], got {self.max_concurrent_steps}"
            )
        if self.epi_tile_n < 8 or self.tile_n % self.epi_tile_n:
            raise ValueError(
                f"epi_tile_n must be >= 8 and divide tile_n={self.tile_n}, got {self.epi_tile_n}"
            )
        if self.grid_minor_dim not in (0, 1):
            raise ValueError(f"grid_minor_dim must be 0 or 1, got {self.grid_minor_dim}")
        if self.grid_tile_width < 1:
            raise ValueError(f"grid_tile_width must be >= 1, got {self.grid_tile_width}")
        if self.num_sms is not None and self.num_sms < 1:
            raise ValueError(f"num_sms must be >= 1 or None, got {self.num_sms}")
        if self.tile_m * self.tile_n > _MAX_ACC_ELEMS_PER_WG:
            raise ValueError(
                f"tile_m * tile_n = {self.tile_m * self.tile_n} exceeds the register budget of "
                f"one consumer warpgroup ({_MAX_ACC_ELEMS_PER_WG} f32 accumulators)"
            )

        if self.epilogue_buffers not in (1, 2):
            raise ValueError(f"epilogue_buffers must be 1 or 2, got {self.epilogue_buffers}")
        if not isinstance(self.block_scales_before_mma, bool):
            raise TypeError(
                f"block_scales_before_mma must be a bool, got {self.block_scales_before_mma!r}"
            )
        if not isinstance(self.persistent_pipeline, bool):
            raise TypeError(f"persistent_pipeline must be a bool, got {self.persistent_pipeline!r}")

    def smem_bytes(self, lhs_itemsize: int, rhs_itemsize: int, out_itemsize: int) -> int:
        stage = self.tile_t * (self.tile_m * lhs_itemsize + 2 * self.tile_n * rhs_itemsize)
        epilogue = (
            _NUM_CONSUMERS * self.epilogue_buffers * self.tile_m * self.epi_tile_n * out_itemsize
        )
        return self.max_concurrent_steps * stage + epilogue


# Defaults: the fastest configs of the H200 sweep (2026-11-29, G=8, M=16384, K=N=4096):
# bf16 601 TFLOP/s, FP8 (e4m3 x e5m2) 1112 TFLOP/s, f32 outputs. Every default runs one
# pipeline from tile to tile (`persistent_pipeline`) since stop 58: on an H100, in
# alternation, token-major bf16 601 against 564 TFLOP/s at G8 and 393 against 355 at G64
# small experts; K-major bf16 591 against 558 and per-tensor FP8 1023 against 937 at G8
# (`grouped_ab --variants wgrad_persistent`, a second call); block FP8 below.
# Since stop 59, one epilogue buffer, which at bf16 frees the shared memory for a 4th
# stage: `grouped_ab --variants wgrad_persistent`, float32 out, two calls on two H100s
# (stop 58's second, stop 59's first), in alternation, the same bits. bf16 4 stages, one
# buffer, against 3 stages, two: token-major G8 603 / 615 against 587 / 601, G64 415 / 407
# against 397 / 394; K-major G8 617 / 623 against 591 / 584, G64 400 / 391 against 376 / 378.
# Per-tensor FP8 3 stages, one buffer, against two: G64 529 / 523 against 494 / 482, G8
# level (1015 / 1024 against 1023 / 1013). (4 stages won at G8, 1047 / 1057, but lost 12% at
# G64, 435 / 429: since stop 60 the depth follows the tokens a group, `DEEP_FP8_WGRAD_CONFIG`.)
DEFAULT_BF16_WGRAD_CONFIG = GroupedWgradConfig(
    tile_m=128,
    tile_n=128,
    tile_t=64,
    max_concurrent_steps=4,
    epi_tile_n=32,
    epilogue_buffers=1,
    persistent_pipeline=True,
)
DEFAULT_FP8_WGRAD_CONFIG = GroupedWgradConfig(
    tile_m=128,
    tile_n=128,
    tile_t=128,
    max_concurrent_steps=3,
    epi_tile_n=32,
    epilogue_buffers=1,
    persistent_pipeline=True,
)
# Per-tensor FP8 with many tokens a group: one stage more. Stop 60's `grouped_ab --variants
# fp8_wgrad_depth` (an H100, in alternation, the same bits, float32 out) at 16384 x 4096 x
# 4096: 4 stages against 3 at 2048 tokens a group 1047 / 1001 TFLOP/s, at 1024 871 / 795,
# at 512 510 / 513, at 256 280 / 281; at G64 small experts (512 tokens, K 2048, N 1408) 432 /
# 525. So 4 stages from 1024 tokens a group (8 steps a tile), 3 below.
FP8_WGRAD_DEEP_MIN_TOKENS_PER_GROUP = 1024
DEEP_FP8_WGRAD_CONFIG = dataclasses.replace(DEFAULT_FP8_WGRAD_CONFIG, max_concurrent_steps=4)
# Block FP8: a main and a chunk accumulator per consumer, so half the columns (64 registers
# each a thread); one 128-token scale block a step. 4 stages with each chunk's scales loaded
# before its wgmma is issued (`block_scales_before_mma`), from stop 57's sweeps on an H100
# (`grouped_ab --variants wgrad_stage_spot` and `fp8_block_wgrad`, in alternation, the same
# bits): G8 balanced 801 / 804 / 780 / 774 / 768 TFLOP/s against 752 / 766 / 757 / 752 / 742
# with stop 53's 3 stages and the scales loaded after the wgmma (five sweeps over three
# calls). Loaded after it, 4 stages were the slow spot (607):
# ptxas then put the scale loads behind the MMA in the MIO queue (stop 56's Nsight Compute).
# With the persistent pipeline (stop 58, H100, bfloat16 out): G8 845 against 757, G64 small
# experts 652 against 519 (5 stages 679, one call).
DEFAULT_FP8_BLOCK_WGRAD_CONFIG = GroupedWgradConfig(
    tile_m=128,
    tile_n=64,
    tile_t=128,
    max_concurrent_steps=4,
    epi_tile_n=32,
    block_scales_before_mma=True,
    persistent_pipeline=True,
)
# The dense layers' block-FP8 wgrad (one group of every token, `dense_matmul_fp8_block_wgrad`,
# float32 out): the MoE default with one epilogue buffer. Stop 57's sweeps on an H100
# (`grouped_ab --variants fp8_block_wgrad`, its one-group 8192³ case, three calls, the same
# bits) made it the MoE default: 783 / 783 / 790 TFLOP/s against 766 / 756 / 753 with stop
# 55's 5 stages (one epilogue buffer, the scales loaded after the wgmma). With the persistent
# pipeline (stop 58, H100, two calls): 811 against 743, then 741 against 748. One epilogue
# buffer instead of two (stop 59; `grouped_ab --variants wgrad_persistent`, two calls on two
# H100s, in alternation): 800 / 794 against 741 / 736, the same bits. The MoE wgrad keeps two
# (G8: 711 / 734 with one against 738 / 754).
DENSE_FP8_BLOCK_WGRAD_CONFIG = dataclasses.replace(
    DEFAULT_FP8_BLOCK_WGRAD_CONFIG, epilogue_buffers=1
)


def _smem_needed(
    config: GroupedWgradConfig, sizes: tuple[int, int, int], block_scaled: bool
) -> int:
    """The config's SMEM, with the streamed 1x128 block scales if `block_scaled` (per stage,
    f32 scales of the tile's lhs rows and rhs columns)."""
    scales = config.max_concurrent_steps * 4 * (config.tile_m + 2 * config.tile_n)
    return config.smem_bytes(*sizes) + (scales if block_scaled else 0)


def default_wgrad_config(
    is_fp8: bool, block_scaled: bool, num_tokens: int, num_groups: int
) -> GroupedWgradConfig:
    """The wgrad default for operands of this kind and shape (before `fit_to_shared_memory`):
    block FP8's, per-tensor FP8's (one stage deeper from
    `FP8_WGRAD_DEEP_MIN_TOKENS_PER_GROUP` tokens a group on average), or 16-bit's."""
    if num_tokens < 0 or num_groups < 1:
        raise ValueError(
            f"num_tokens must be >= 0 and num_groups >= 1, got {num_tokens} and {num_groups}"
        )
    if block_scaled:
        return DEFAULT_FP8_BLOCK_WGRAD_CONFIG
    if not is_fp8:
        return DEFAULT_BF16_WGRAD_CONFIG
    if num_tokens >= FP8_WGRAD_DEEP_MIN_TOKENS_PER_GROUP * num_groups:
        return DEEP_FP8_WGRAD_CONFIG
    return DEFAULT_FP8_WGRAD_CONFIG


def fit_to_shared_memory(
    config: GroupedWgradConfig, sizes: tuple[int, int, int], block_scaled: bool
) -> GroupedWgradConfig:
    """`config`, its epilogue tile, then its epilogue buffers, then its stages cut until it fits
    the shared memory for operands of (lhs, rhs, out) itemsizes `sizes`."""
    if not isinstance(config, GroupedWgradConfig):
        raise TypeError(f"config must be a GroupedWgradConfig, got {type(config).__name__}")
    if len(sizes) != 3 or not all(isinstance(n, int) and n > 0 for n in sizes):
        raise ValueError(
            f"sizes must be the (lhs, rhs, out) itemsizes, three positive ints, got {sizes!r}"
        )
    while _smem_needed(config, sizes, block_scaled) > SMEM_BYTES:
        if config.epi_tile_n > 32:
            config = dataclasses.replace(config, epi_tile_n=config.epi_tile_n // 2)
        elif config.epilogue_buffers > 1:
            config = dataclasses.replace(config, epilogue_buffers=1)
        elif config.max_concurrent_steps > 2:
            config = dataclasses.replace(
                config, max_concurrent_steps=config.max_concurrent_steps - 1
            )
        else:
            break
    return config


def grouped_matmul_wgrad(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    lhs_scale: jax.Array | None = None,
    rhs_scale: jax.Array | None = None,
    group_scale: jax.Array | None = None,
    out_dtype: jnp.dtype = jnp.float32,
    token_major: bool = False,
    config: GroupedWgradConfig | None = None,
    interpret: bool = False,
    lhs_block_scale: jax.Array | None = None,
    rhs_block_scale: jax.Array | None = None,
) -> jax.Array:
    """``out[g] = (lhs[:, tokens of g] @ rhs[:, tokens of g]ᵀ) * scales`` for every group,
    rounded once to ``out_dtype`` after the last scale.

    Args:
      lhs: (K, M) bf16/f16 or FP8, token-contiguous (columnwise copy of x); (M, K) bf16/f16
        when ``token_major``.
      rhs: (N, M) same dtype family, token-contiguous (columnwise copy of dy); (M, N) when
        ``token_major``.
      group_sizes: (G,) int32 tokens per group; tokens are sorted by group.
      lhs_scale: optional f32 scale of lhs, () or (K,).
      rhs_scale: optional f32 scale of rhs, () or (N,).
      group_scale: optional f32 factors of each group's output, (G,) or (F, G) for F of them,
        applied after lhs_scale and rhs_scale, the first first; not with the block scales.
      out_dtype: float32 (default) or bfloat16.
      token_major: the operands' token axis is their first (major) one: x and dy as the
        forward pass stores them, 16-bit only.
      config: tiling; None: `default_wgrad_config` for the operands' kind and shape.
      interpret: run the Pallas interpreter (CPU) instead of compiling for the GPU.
      lhs_block_scale, rhs_block_scale: f32 scale_inv of each 1x128 token block, (K,
        ceil(M/128)) and (N, ceil(M/128)), FP8 token-contiguous operands only, both or
        neither and not with lhs_scale / rhs_scale; the config's tile_t must be 128.

    Returns:
      (G, K, N) array of out_dtype.
    """
    common.check_rank("lhs", lhs, 2)
    common.check_rank("rhs", rhs, 2)
    common.check_dtype("lhs", lhs, common.HALF_DTYPES + common.FP8_DTYPES)
    common.check_dtype("rhs", rhs, common.HALF_DTYPES + common.FP8_DTYPES)
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in common.OUT_DTYPES:
        raise TypeError(f"out_dtype must be bfloat16 or float32, got {out_dtype.name}")
    is_fp8 = jnp.dtype(lhs.dtype) in common.FP8_DTYPES
    if is_fp8 != (jnp.dtype(rhs.dtype) in common.FP8_DTYPES) or (
        not is_fp8 and lhs.dtype != rhs.dtype
    ):
        raise TypeError(
            f"lhs and rhs dtypes must match (two FP8 dtypes may mix), got "
            f"{jnp.dtype(lhs.dtype).name} and {jnp.dtype(rhs.dtype).name}"
        )
    if not isinstance(token_major, bool):
        raise TypeError(f"token_major must be a bool, got {token_major!r}")
    if token_major and is_fp8:
        raise TypeError(
            "token_major operands must be 16-bit (Hopper's wgmma reads FP8 operands K-major "
            f"only: pass the token-contiguous copies), got {jnp.dtype(lhs.dtype).name}"
        )
    token_axis = 0 if token_major else 1
    num_tokens, num_out_rows = lhs.shape[token_axis], lhs.shape[1 - token_axis]
    num_tokens_rhs, num_out_cols = rhs.shape[token_axis], rhs.shape[1 - token_axis]
    if num_tokens_rhs != num_tokens:
        raise ValueError(
            f"rhs token count {num_tokens_rhs} does not match lhs token count {num_tokens}"
        )
    num_groups = common.check_group_sizes(group_sizes, None)
    if lhs_scale is not None:
        common.check_dtype("lhs_scale", lhs_scale, (jnp.float32,))
        if lhs_scale.shape not in ((), (num_out_rows,)):
            raise ValueError(
                f"lhs_scale must have shape () or ({num_out_rows},), got {tuple(lhs_scale.shape)}"
            )
    if rhs_scale is not None:
        common.check_dtype("rhs_scale", rhs_scale, (jnp.float32,))
        if rhs_scale.shape not in ((), (num_out_cols,)):
            raise ValueError(
                f"rhs_scale must have shape () or ({num_out_cols},), got {tuple(rhs_scale.shape)}"
            )
    if group_scale is not None:
        common.check_dtype("group_scale", group_scale, (jnp.float32,))
        if group_scale.ndim not in (1, 2) or group_scale.shape[-1] != num_groups:
            raise ValueError(
                f"group_scale must have shape ({num_groups},) or (F, {num_groups}), got "
                f"{tuple(group_scale.shape)}"
            )
        group_scale = group_scale.reshape(-1, num_groups)
    block_scaled = lhs_block_scale is not None or rhs_block_scale is not None
    if block_scaled:
        _check_block_scales(
            lhs,
            rhs,
            lhs_block_scale,
            rhs_block_scale,
            (lhs_scale, rhs_scale, group_scale),
            token_major,
        )
    sizes = (lhs.dtype.itemsize, rhs.dtype.itemsize, out_dtype.itemsize)
    if config is None:
        default = default_wgrad_config(is_fp8, block_scaled, num_tokens, num_groups)
        config = fit_to_shared_memory(default, sizes, block_scaled)
    if not isinstance(config, GroupedWgradConfig):
        raise TypeError(f"config must be a GroupedWgradConfig, got {type(config).__name__}")
    if config.block_scales_before_mma and not block_scaled:
        raise ValueError(
            "config.block_scales_before_mma applies to 1x128 block scales only "
            "(lhs_block_scale / rhs_block_scale)"
        )
    if block_scaled and config.tile_t != 128:
        raise ValueError(f"config: 1x128 block scales need tile_t=128, got {config.tile_t}")
    if block_scaled and 2 * config.tile_m * config.tile_n > _MAX_ACC_ELEMS_PER_WG:
        raise ValueError(
            f"config: 1x128 block scales keep a main and a chunk accumulator of tile_m x "
            f"tile_n per consumer, 2 * {config.tile_m} * {config.tile_n} f32 > "
            f"{_MAX_ACC_ELEMS_PER_WG}; use tile_n=64 with tile_m=128"
        )
    needed = _smem_needed(config, sizes, block_scaled)
    if needed > SMEM_BYTES:
        raise ValueError(
            f"config needs {needed} bytes of shared memory, more than "
            f"{SMEM_BYTES}; lower max_concurrent_steps, tile sizes or epi_tile_n"
        )

    tile_m, tile_n, tile_t = config.tile_m, config.tile_n, config.tile_t

    # Zero padding (a copy, only for shapes that need it) to whole TMA tiles: every extent
    # to at least one tile, the operands' minor axis (tokens, or K and N when token_major)
    # to whole swizzle atoms and the major one to multiples of 8. Padded tokens belong to no
    # group; padded rows and columns are sliced off. (lhs and rhs have the same item size.)
    def padded(extent: int, tile: int, minor: bool) -> int:
        multiple = common.swizzle_elems(tile, lhs.dtype) if minor else 8
        return common.round_up(max(extent, tile), multiple)

    rows_p = padded(num_out_rows, tile_m, minor=token_major)
    cols_p = padded(num_out_cols, 2 * tile_n, minor=token_major)
    tokens_p = padded(num_tokens, tile_t, minor=not token_major)
    lhs_p = common.pad_axis(common.pad_axis(lhs, 1 - token_axis, rows_p), token_axis, tokens_p)
    rhs_p = common.pad_axis(common.pad_axis(rhs, 1 - token_axis, cols_p), token_axis, tokens_p)
    operands = [lhs_p, rhs_p]
    lhs_scale_kind = rhs_scale_kind = None
    if lhs_scale is not None:
        lhs_scale_kind = "tensor" if lhs_scale.ndim == 0 else "row"
        operands.append(
            lhs_scale.reshape(1)
            if lhs_scale.ndim == 0
            else common.pad_axis(lhs_scale, 0, common.round_up(rows_p, tile_m))
        )
    if rhs_scale is not None:
        rhs_scale_kind = "tensor" if rhs_scale.ndim == 0 else "col"
        operands.append(
            rhs_scale.reshape(1)
            if rhs_scale.ndim == 0
            else common.pad_axis(rhs_scale, 0, common.round_up(cols_p, 2 * tile_n))
        )
    if group_scale is not None:
        operands.append(group_scale)

    if block_scaled:
        # (M/128, K) and (M/128, N): one token block's scales for consecutive rows, one TMA
        # row a step; padded token blocks hold zero codes, so their scales are irrelevant.
        token_blocks = tokens_p // 128
        for block_scale, extent in ((lhs_block_scale, rows_p), (rhs_block_scale, cols_p)):
            operands.append(
                common.pad_axis(common.pad_axis(block_scale.T, 0, token_blocks), 1, extent)
            )

    out = _wgrad_call(
        group_sizes,
        operands,
        num_groups=num_groups,
        num_out_rows=rows_p,
        num_out_cols=cols_p,
        num_tokens=tokens_p,
        valid_tokens=num_tokens,
        lhs_scale_kind=lhs_scale_kind,
        rhs_scale_kind=rhs_scale_kind,
        num_group_factors=0 if group_scale is None else group_scale.shape[0],
        block_scaled=block_scaled,
        out_dtype=out_dtype,
        token_major=token_major,
        config=config,
        interpret=interpret,
    )
    if (rows_p, cols_p) != (num_out_rows, num_out_cols):
        out = out[:, :num_out_rows, :num_out_cols]
    return out


def _check_block_scales(
    lhs, rhs, lhs_block_scale, rhs_block_scale, other_scales, token_major
) -> None:
    if lhs_block_scale is None or rhs_block_scale is None:
        raise ValueError("lhs_block_scale and rhs_block_scale go together: got only one")
    if any(scale is not None for scale in other_scales):
        raise ValueError(
            "lhs_scale / rhs_scale / group_scale do not combine with 1x128 block scales"
        )
    if token_major or jnp.dtype(lhs.dtype) not in common.FP8_DTYPES:
        raise TypeError(
            "1x128 block scales need FP8 token-contiguous operands, got "
            f"{jnp.dtype(lhs.dtype).name} with token_major={token_major}"
        )
    token_blocks = pl.cdiv(lhs.shape[1], 128)
    for name, block_scale, operand in (
        ("lhs_block_scale", lhs_block_scale, lhs),
        ("rhs_block_scale", rhs_block_scale, rhs),
    ):
        common.check_dtype(name, block_scale, (jnp.float32,))
        common.check_shape(name, block_scale, (operand.shape[0], token_blocks))


@dataclasses.dataclass(frozen=True)
class _Tile:
    """One output tile of the CTA loop (traced values): group, first row, this consumer's
    first column, the tile's column index, the group's token range [tok_begin, tok_end),
    the first token chunk and the number of token steps (0 for an empty group)."""

    group: jax.Array
    row0: jax.Array
    col0: jax.Array
    col_tile: jax.Array
    tok_begin: jax.Array
    tok_end: jax.Array
    first_chunk: jax.Array
    num_steps: jax.Array


# Registers a thread the consumers raise themselves to beside the producer's 40 (as
# `emit_pipeline_warp_specialized` does for its compute warpgroups): 232.
_CONSUMER_REGISTERS = int(min(256, (512 - _PRODUCER_REGISTERS) / _NUM_CONSUMERS)) // 8 * 8


def _persistent_tiles(
    wg, num_tiles, tile_at, step_windows, run_tile, compute_step, store_zeros, allocations, stages
) -> None:
    """The CTA's tiles through one TMA pipeline that runs from tile to tile
    (`GroupedWgradConfig.persistent_pipeline`): the producer loads the next tile's first
    token steps while the consumers finish the current tile and store it, where the per-tile
    pipeline (`emit_pipeline_warp_specialized`, whose pipeline of pipelines needs a static
    step count) starts each tile empty. A global step count, carried by both sides'
    tile loops, picks each step's stage (count mod `stages`); the stages, their shared-memory
    buffers and their barriers are the per-tile pipeline's own allocations."""
    # (The keys of `emit_pipeline_warp_specialized(...).get_allocations`, jax 0.11.2: a test
    # lowers and runs this path, so a renamed key fails there.)
    stage_smem = allocations["flat_in_smem_refs"]
    [produced] = allocations["flat_produced_barrier_refs"]  # one arrival per copy of a step
    [consumed] = allocations["flat_consumed_barrier_refs"]  # one arrival per consumer

    @pl.when(wg == _NUM_CONSUMERS)
    def _producer():
        plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")

        @plgpu.nd_loop(num_tiles, collective_axes="sm", init_carry=jnp.int32(0))
        def steps_issued(loop_info: plgpu.NDLoopInfo, carry):
            tile = tile_at(loop_info.index[0])

            def load_step(t, issued):
                slot = lax.rem(issued, stages)

                @pl.when(issued >= stages)
                def _wait_for_release():  # of the step `stages` earlier in this slot
                    plgpu.barrier_wait(consumed.at[slot])

                for window, smem in zip(step_windows(tile, t), stage_smem, strict=True):
                    plgpu.copy_gmem_to_smem(window, smem.at[slot], produced.at[slot])
                return issued + 1

            return lax.fori_loop(0, tile.num_steps, load_step, carry)

        # The releases of the last steps, not yet waited for: every barrier ends balanced,
        # as the per-tile pipeline leaves it.
        @pl.loop(lax.max(steps_issued - stages, 0), steps_issued)
        def _drain(step):
            plgpu.barrier_wait(consumed.at[lax.rem(step, stages)])

    @pl.when(wg < _NUM_CONSUMERS)
    def _consumers():
        plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")

        @plgpu.nd_loop(num_tiles, collective_axes="sm", init_carry=jnp.int32(0))
        def _tile_loop(loop_info: plgpu.NDLoopInfo, carry):
            tile = tile_at(loop_info.index[0])

            def run_steps(acc):
                def step(t, acc):
                    slot = lax.rem(carry + t, stages)
                    plgpu.barrier_wait(produced.at[slot])
                    acc = compute_step(tile, t, *(smem.at[slot] for smem in stage_smem), acc)
                    plgpu.barrier_arrive(consumed.at[slot])
                    return acc

                return lax.fori_loop(0, tile.num_steps, step, acc)

            @pl.when(tile.num_steps > 0)
            def _matmul_tile():
                run_tile(tile, run_steps)

            @pl.when(tile.num_steps == 0)
            def _empty_group():
                store_zeros(tile)

            return carry + tile.num_steps


def _wgrad_call(
    group_sizes,
    operands,
    *,
    num_groups,
    num_out_rows,
    num_out_cols,
    num_tokens,
    valid_tokens,
    lhs_scale_kind,
    rhs_scale_kind,
    num_group_factors,
    block_scaled,
    out_dtype,
    token_major,
    config: GroupedWgradConfig,
    interpret,
):
    tile_m, tile_n, tile_t = config.tile_m, config.tile_n, config.tile_t
    epi_tile_n = config.epi_tile_n
    num_epi_chunks = tile_n // epi_tile_n
    num_buffers = config.epilogue_buffers
    stores_in_flight = 1 if num_buffers == 2 and num_epi_chunks % 2 == 0 else 0
    lhs_dtype, rhs_dtype = operands[0].dtype, operands[1].dtype
    lhs_reg_layout = (
        plgpu.Layout.WGMMA_8BIT if jnp.dtype(lhs_dtype) in common.FP8_DTYPES else plgpu.Layout.WGMMA
    )
    rhs_reg_layout = (
        plgpu.Layout.WGMMA_8BIT if jnp.dtype(rhs_dtype) in common.FP8_DTYPES else plgpu.Layout.WGMMA
    )
    num_row_tiles = pl.cdiv(num_out_rows, tile_m)
    num_col_tiles = pl.cdiv(num_out_cols, 2 * tile_n)
    tiles_per_group = num_row_tiles * num_col_tiles
    out_transforms = common.smem_transforms(epi_tile_n, out_dtype)
    token_axis = 0 if token_major else 1

    def at_tokens(ref, tokens, others):
        """`ref` indexed by a token range and a range of its other (K or N) axis."""
        return ref.at[tokens, others] if token_major else ref.at[others, tokens]

    def operand_spec(extent: int, dtype) -> plgpu.BlockSpec:
        """An operand's (tokens, extent) tiles, read MN-major by wgmma when token_major,
        else its (extent, tokens) tiles, K-major."""
        shape, index = ((tile_t, extent), lambda t: (t, 0))
        if not token_major:
            shape, index = ((extent, tile_t), lambda t: (0, t))
        return plgpu.BlockSpec(shape, index, transforms=common.smem_transforms(shape[1], dtype))

    in_specs = (operand_spec(tile_m, lhs_dtype), operand_spec(2 * tile_n, rhs_dtype))
    if block_scaled:  # each chunk's 1x128 scales of the tile's lhs rows and rhs columns
        in_specs += (
            plgpu.BlockSpec((1, tile_m), lambda t: (t, 0)),
            plgpu.BlockSpec((1, 2 * tile_n), lambda t: (t, 0)),
        )

    def body(group_bounds_gmem, *refs):
        lhs_gmem, rhs_gmem = refs[0], refs[1]
        scale_refs = list(refs[2:-1])
        out_gmem = refs[-1]
        lhs_scale_ref = scale_refs.pop(0) if lhs_scale_kind else None
        rhs_scale_ref = scale_refs.pop(0) if rhs_scale_kind else None
        group_scale_ref = scale_refs.pop(0) if num_group_factors else None
        block_scale_refs = tuple(scale_refs) if block_scaled else ()

        def make_pipeline(step_fn, compute_context, num_steps):
            return plgpu.emit_pipeline_warp_specialized(
                step_fn,
                grid=(num_steps,),
                memory_registers=_PRODUCER_REGISTERS,
                in_specs=in_specs,
                wg_axis="wg",
                num_compute_wgs=_NUM_CONSUMERS,
                max_concurrent_steps=config.max_concurrent_steps,
                compute_context=compute_context,
            )

        ignore = lambda *_, **__: None

        @functools.partial(
            pl.run_scoped,
            pipeline_allocs=make_pipeline(
                ignore, ignore, config.max_concurrent_steps
            ).get_allocations(lhs_gmem, rhs_gmem, *block_scale_refs),
            out_smem=plgpu.SMEM(
                (_NUM_CONSUMERS, num_buffers, tile_m, epi_tile_n),
                out_dtype,
                transforms=out_transforms,
            ),
            row_vec_smem=plgpu.SMEM((_NUM_CONSUMERS, tile_m), jnp.float32),
            col_vec_smem=plgpu.SMEM((_NUM_CONSUMERS, tile_n), jnp.float32),
            vec_barriers=plgpu.Barrier(num_barriers=2 * _NUM_CONSUMERS),
            mask_barrier=plgpu.Barrier(num_arrivals=_NUM_CONSUMERS),
            collective_axes="wg",
        )
        def _scope(
            pipeline_allocs, out_smem, row_vec_smem, col_vec_smem, vec_barriers, mask_barrier
        ):
            wg = lax.axis_index("wg")

            def tile_at(linear) -> _Tile:
                """The output tile of the CTA loop's `linear` index, with its group's tokens."""
                group = lax.div(linear, jnp.int32(tiles_per_group))
                row_tile, col_tile = plgpu.planar_snake(
                    lax.rem(linear, jnp.int32(tiles_per_group)),
                    (num_row_tiles, num_col_tiles),
                    config.grid_minor_dim,
                    config.grid_tile_width,
                )
                # Token range of the group, from the bounds XLA computed before the launch
                # (all groups' bounds kept in registers and picked by an unrolled select
                # chain made the forward kernels spill: see grouped_matmul_common).
                tok_begin = group_bounds_gmem[group, 0]
                tok_end = group_bounds_gmem[group, 1]
                first_chunk = lax.div(tok_begin, jnp.int32(tile_t))
                num_steps = jnp.where(
                    tok_end > tok_begin,
                    lax.div(tok_end + tile_t - 1, jnp.int32(tile_t)) - first_chunk,
                    jnp.int32(0),
                )
                return _Tile(
                    group=group,
                    row0=row_tile * tile_m,
                    col0=col_tile * (2 * tile_n) + wg * tile_n,
                    col_tile=col_tile,
                    tok_begin=tok_begin,
                    tok_end=tok_end,
                    first_chunk=first_chunk,
                    num_steps=num_steps,
                )

            def store_tile(tile: _Tile, values):
                out_rows = out_gmem.at[tile.group, pl.ds(tile.row0, tile_m)]
                for chunk in range(num_epi_chunks):
                    slot = chunk % num_buffers
                    plgpu.wait_smem_to_gmem(stores_in_flight, wait_read_only=True)
                    out_smem[wg, slot] = values[
                        :, chunk * epi_tile_n : (chunk + 1) * epi_tile_n
                    ].astype(out_dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(
                        out_smem.at[wg, slot],
                        out_rows.at[:, pl.ds(tile.col0 + chunk * epi_tile_n, epi_tile_n)],
                    )

            def scale(tile: _Tile, values):
                if lhs_scale_kind == "tensor":
                    values = values * lhs_scale_ref[0]
                elif lhs_scale_kind == "row":
                    plgpu.barrier_wait(vec_barriers.at[wg])
                    row_scale = plgpu.load(row_vec_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
                    values = values * lax.broadcast_in_dim(row_scale, values.shape, [0])
                if rhs_scale_kind == "tensor":
                    values = values * rhs_scale_ref[0]
                elif rhs_scale_kind == "col":
                    plgpu.barrier_wait(vec_barriers.at[_NUM_CONSUMERS + wg])
                    col_scale = plgpu.load(col_vec_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(0))
                    values = values * lax.broadcast_in_dim(col_scale, values.shape, [1])
                for factor in range(num_group_factors):
                    values = values * group_scale_ref[factor, tile.group]
                return values

            def prefetch_vectors(tile: _Tile):
                if lhs_scale_kind == "row":
                    plgpu.copy_gmem_to_smem(
                        lhs_scale_ref.at[pl.ds(tile.row0, tile_m)],
                        row_vec_smem.at[wg],
                        vec_barriers.at[wg],
                    )
                if rhs_scale_kind == "col":
                    plgpu.copy_gmem_to_smem(
                        rhs_scale_ref.at[pl.ds(tile.col0, tile_n)],
                        col_vec_smem.at[wg],
                        vec_barriers.at[_NUM_CONSUMERS + wg],
                    )

            def run_tile(tile: _Tile, run_steps):
                """This consumer's part of `tile`: `run_steps(carry)` runs its token steps over
                the carry (the promoted sum, or the accumulator ref), then the scales and the
                stores."""
                if block_scaled:  # the promoted sum is the carry
                    zeros = plgpu.layout_cast(
                        jnp.zeros((tile_m, tile_n), jnp.float32), plgpu.Layout.WGMMA
                    )
                    store_tile(tile, run_steps(zeros))
                    return
                prefetch_vectors(tile)

                def with_acc(acc_ref):
                    run_steps(acc_ref)
                    return acc_ref[...]

                values = pl.run_scoped(with_acc, plgpu.ACC((tile_m, tile_n), jnp.float32))
                store_tile(tile, scale(tile, values))

            def compute_step(tile: _Tile, t, lhs_smem, rhs_smem, *scale_stages_and_carry):
                """Token step `t` of `tile` on the stage in shared memory: the foreign tokens of
                a boundary chunk zeroed, then this consumer's wgmma into the carry."""
                *scale_stages, carry = scale_stages_and_carry
                token0 = (tile.first_chunk + t) * tile_t
                on_boundary = (token0 < tile.tok_begin) | (token0 + tile_t > tile.tok_end)
                # This consumer's columns of rhs, and its half of lhs to zero.
                all_tokens = slice(None)
                rhs_half = at_tokens(rhs_smem, all_tokens, pl.ds(wg * tile_n, tile_n))
                lhs_half = at_tokens(lhs_smem, all_tokens, pl.ds(wg * (tile_m // 2), tile_m // 2))

                def zero_foreign_tokens(ref, layout):
                    tokens = token0 + plgpu.broadcasted_iota(
                        jnp.int32, ref.shape, token_axis, layout=layout
                    )
                    keep = (tokens >= tile.tok_begin) & (tokens < tile.tok_end)
                    values = plgpu.load(ref, layout=layout)
                    if values.dtype.itemsize == 1:
                        # Mosaic GPU does no arithmetic on 8-bit values, only bit
                        # operations: AND the FP8 bytes with an all-ones/zero mask.
                        bits = lax.bitcast_convert_type(values, jnp.int8)
                        mask = jnp.where(keep, jnp.int32(-1), jnp.int32(0)).astype(jnp.int8)
                        values = lax.bitcast_convert_type(bits & mask, values.dtype)
                    else:
                        values = jnp.where(keep, values, jnp.zeros_like(values))
                    ref[...] = values

                @pl.when(on_boundary)
                def _mask_boundary_chunk():
                    # Each consumer zeroes its own rhs half and half of the shared
                    # lhs tile, then both meet at a barrier before either reads lhs.
                    zero_foreign_tokens(rhs_half, rhs_reg_layout)
                    zero_foreign_tokens(lhs_half, lhs_reg_layout)
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(mask_barrier)
                    plgpu.barrier_wait(mask_barrier)

                if block_scaled:
                    return promoted_chunk(lhs_smem, rhs_half, *scale_stages, carry)
                acc_ref = carry
                if token_major:  # MN-major A and B: wgmma's transpose bits
                    plgpu.wgmma(acc_ref, lhs_smem.transpose((1, 0)), rhs_half)
                else:
                    plgpu.wgmma(acc_ref, lhs_smem, rhs_half.transpose((1, 0)))
                # Keeping a step in flight (delay_release=1) tripped the interpreter's
                # barrier-phase check with the dynamic per-group step count; not used.
                plgpu.wgmma_wait(0)
                return acc_ref

            def promoted_chunk(lhs_smem, rhs_half, lhs_scales, rhs_scales, main):
                """main + this chunk's products times its block scales: the wgmma into a
                fresh accumulator (never sharing the tensor core's adder with earlier
                chunks), the scales loaded while it runs (asked for just before or just
                after its issue: block_scales_before_mma)."""

                def load_scales():
                    row_scale = plgpu.load(lhs_scales.at[0], layout=plgpu.Layout.WGMMA.reduce(1))
                    col_scale = plgpu.load(
                        rhs_scales.at[0, pl.ds(wg * tile_n, tile_n)],
                        layout=plgpu.Layout.WGMMA.reduce(0),
                    )
                    return row_scale, col_scale

                def product(chunk_ref):
                    if config.block_scales_before_mma:
                        row_scale, col_scale = load_scales()
                    plgpu.wgmma(chunk_ref, lhs_smem, rhs_half.transpose((1, 0)))
                    if not config.block_scales_before_mma:
                        row_scale, col_scale = load_scales()
                    plgpu.wgmma_wait(0)
                    chunk = chunk_ref[...]
                    scale = lax.broadcast_in_dim(row_scale, chunk.shape, [0])
                    scale = scale * lax.broadcast_in_dim(col_scale, chunk.shape, [1])
                    return main + chunk * scale

                return pl.run_scoped(product, plgpu.ACC((tile_m, tile_n), jnp.float32))

            def store_zeros(tile: _Tile):
                zeros = plgpu.layout_cast(
                    jnp.zeros((tile_m, tile_n), jnp.float32), plgpu.Layout.WGMMA
                )
                store_tile(tile, zeros)

            def tile_windows(tile: _Tile):
                """The global-memory windows of `tile`'s operands, in in_specs' order, from its
                first token chunk on: in_specs' blocks of token step t lie at t in them."""
                window = pl.ds(tile.first_chunk * tile_t, num_tokens)
                cols = pl.ds(tile.col_tile * (2 * tile_n), 2 * tile_n)
                scale_windows = ()
                if block_scaled:  # (tile_t = 128: one scale block per chunk)
                    blocks = pl.ds(tile.first_chunk, num_tokens // tile_t)
                    lhs_block_scales, rhs_block_scales = block_scale_refs
                    scale_windows = (
                        lhs_block_scales.at[blocks, pl.ds(tile.row0, tile_m)],
                        rhs_block_scales.at[blocks, cols],
                    )
                return (
                    at_tokens(lhs_gmem, window, pl.ds(tile.row0, tile_m)),
                    at_tokens(rhs_gmem, window, cols),
                    *scale_windows,
                )

            def step_windows(tile: _Tile, t):
                """Token step `t`'s blocks of `tile_windows`, as the per-tile pipeline cuts
                them (each spec's block at its index map's block index)."""
                return [
                    window.at[
                        tuple(
                            pl.ds(i * size, size)
                            for i, size in zip(spec.index_map(t), spec.block_shape, strict=True)
                        )
                    ]
                    for window, spec in zip(tile_windows(tile), in_specs, strict=True)
                ]

            num_tiles = (num_groups * tiles_per_group,)
            if config.persistent_pipeline:
                _persistent_tiles(
                    wg,
                    num_tiles,
                    tile_at,
                    step_windows,
                    run_tile,
                    compute_step,
                    store_zeros,
                    pipeline_allocs,
                    config.max_concurrent_steps,
                )
            else:

                @plgpu.nd_loop(num_tiles, collective_axes="sm")
                def _tile_loop(loop_info: plgpu.NDLoopInfo):
                    (linear,) = loop_info.index
                    tile = tile_at(linear)

                    def step_fn(idxs, *stage_refs_and_carry):
                        (t,) = idxs
                        return compute_step(tile, t, *stage_refs_and_carry)

                    @pl.when(tile.num_steps > 0)
                    def _matmul_tile():
                        make_pipeline(
                            step_fn,
                            lambda run_pipeline: run_tile(tile, run_pipeline),
                            tile.num_steps,
                        )(*tile_windows(tile), allocations=pipeline_allocs)

                    @pl.when((tile.num_steps == 0) & (wg < _NUM_CONSUMERS))
                    def _empty_group():
                        store_zeros(tile)

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num_groups, num_out_rows, num_out_cols), out_dtype),
        grid=(config.num_sms or common.num_sms_default(),),
        grid_names=("sm",),
        num_threads=_NUM_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=common.interpret_params(interpret),
        kernel_name="grouped_matmul_wgrad",
    )
    bounds = common.group_bounds(group_sizes, valid_tokens)
    return varying_like(kernel(bounds, *operands), group_sizes, *operands)
