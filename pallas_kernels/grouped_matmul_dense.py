"""Dense (one-group) NT GEMMs on Hopper through the grouped kernels.

``out = lhs @ rhsᵀ`` with ``lhs (M, K)`` and ``rhs (N, K)`` both K-major, i.e. the
grouped kernels with ``G = 1`` and ``group_sizes = [M]`` (the kernels loop over the
group's row tiles only), so there is no separate dense kernel to maintain.
``jax_qtrain.dense`` uses these on GPU. The 16-bit and FP8 rowwise GEMMs take
`grouped_matmul`'s default (stream-K over the persistent pipeline where the K steps allow
it); the block-FP8 GEMM's default streams its lhs scales with the K steps and keeps its
pipeline running across tiles (``persistent_pipeline``) where the K steps allow it, measured
faster for dense shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import grouped_matmul_common as common
from pallas_kernels.grouped_matmul_fwd import (
    GroupedMatmulConfig,
    fp8_block_default_config,
    grouped_matmul,
    grouped_matmul_fp8_block,
)
from pallas_kernels.grouped_matmul_wgrad import (
    DENSE_FP8_BLOCK_WGRAD_CONFIG,
    GroupedWgradConfig,
    fit_to_shared_memory,
    grouped_matmul_wgrad,
)


def _single_group(num_rows: int) -> jax.Array:
    return jnp.full((1,), num_rows, jnp.int32)


def dense_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    *,
    lhs_scale: jax.Array | None = None,
    rhs_scale: jax.Array | None = None,
    out_dtype: jnp.dtype = jnp.bfloat16,
    config: GroupedMatmulConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``out = (lhs @ rhsᵀ) * scales``; bf16/f16 or FP8 operands, f32 accumulation.

    Args:
      lhs: (M, K) bf16/f16 or FP8.
      rhs: (N, K) same dtype family (two FP8 dtypes may mix).
      lhs_scale: optional f32, () per-tensor or (M,) per-row.
      rhs_scale: optional f32, () per-tensor or (N,) per-column.
      out_dtype: bfloat16 or float32.
      config: tiling of the grouped kernel.
      interpret: run the Pallas interpreter.
    """
    common.check_rank("lhs", lhs, 2)
    common.check_rank("rhs", rhs, 2)
    if rhs_scale is not None:
        common.check_dtype("rhs_scale", rhs_scale, (jnp.float32,))
        if rhs_scale.shape not in ((), (rhs.shape[0],)):
            raise ValueError(
                f"rhs_scale must have shape () or ({rhs.shape[0]},), got {tuple(rhs_scale.shape)}"
            )
        rhs_scale = rhs_scale.reshape((1, *rhs_scale.shape))
    return grouped_matmul(
        lhs,
        rhs[None],
        _single_group(lhs.shape[0]),
        lhs_scale=lhs_scale,
        rhs_scale=rhs_scale,
        out_dtype=out_dtype,
        config=config,
        interpret=interpret,
    )


def dense_matmul_fp8_block(
    lhs: jax.Array,
    lhs_scale: jax.Array,
    rhs: jax.Array,
    rhs_scale: jax.Array,
    *,
    out_dtype: jnp.dtype = jnp.bfloat16,
    config: GroupedMatmulConfig | None = None,
    interpret: bool = False,
    lhs_scale_k_major: bool = False,
    rhs_block_rows: int = 128,
) -> jax.Array:
    """Block-scaled FP8 ``out = lhs @ rhsᵀ``: lhs 1x128 blocks, rhs 128x128 blocks (or 1x128
    with ``rhs_block_rows=1``: a wgrad ``dyᵀ x`` of two token-direction copies).

    Args:
      lhs: (M, K) FP8; K a multiple of 128.
      lhs_scale: (M, K/128) f32, or (K/128, M) with `lhs_scale_k_major` (the order the
        kernel reads, as the quantize kernels' "tiles" layout gives it: no transpose).
      rhs: (N, K) FP8.
      rhs_scale: (ceil(N/128), K/128) f32, or (N, K/128) with ``rhs_block_rows=1``.
      out_dtype: bfloat16 or float32.
      config: tiling (block FP8's rules: `grouped_matmul_fp8_block`); None: the block-FP8
        default for K with the lhs scales streamed and the persistent pipeline where the K
        steps allow it.
      interpret: run the Pallas interpreter.
      lhs_scale_k_major: see `grouped_matmul_fp8_block`.
      rhs_block_rows: 128 (128x128 rhs blocks) or 1 (1x128 rhs blocks).
    """
    common.check_rank("lhs", lhs, 2)
    common.check_rank("rhs", rhs, 2)
    common.check_rank("rhs_scale", rhs_scale, 2)
    k = lhs.shape[1]
    if config is None and jnp.dtype(out_dtype) in common.OUT_DTYPES and k > 0 and k % 128 == 0:
        # Bad arguments fall through to the grouped wrapper's checks and messages. The lhs
        # scales streamed with the K steps keep four stages and the persistent pipeline for
        # three consumers: on the H200 8192³ 1107 -> 1216 TFLOP/s in alternation (stop 45,
        # XLA's dense FP8 1291 in the same run; stop 43: 1089 -> 1206), the same bits.
        config = fp8_block_default_config(
            k,
            out_dtype,
            persistent_pipeline=True,
            stream_lhs_scales=True,
            rhs_block_rows=rhs_block_rows,
        )
    return grouped_matmul_fp8_block(
        lhs,
        lhs_scale,
        rhs[None],
        rhs_scale[None],
        _single_group(lhs.shape[0]),
        out_dtype=out_dtype,
        config=config,
        interpret=interpret,
        lhs_scale_k_major=lhs_scale_k_major,
        rhs_block_rows=rhs_block_rows,
    )


def dense_matmul_fp8_block_wgrad(
    lhs: jax.Array,
    lhs_scale: jax.Array,
    rhs: jax.Array,
    rhs_scale: jax.Array,
    *,
    out_dtype: jnp.dtype = jnp.bfloat16,
    config: GroupedWgradConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Block-scaled FP8 wgrad ``out = lhs @ rhsᵀ`` of two token-contiguous copies in 1x128
    token blocks: the wgrad kernel (`grouped_matmul_wgrad`) with every token in one group.

    It computes what ``dense_matmul_fp8_block(..., rhs_block_rows=1)`` does, promoting the
    same 128-token chunks in the same order (the same bits), on the wgrad kernel's own tiles:
    1.10-1.14x faster at 8192³ on an H100 (stop 54), with 3 stages (then the MoE default); its own
    default (`DENSE_FP8_BLOCK_WGRAD_CONFIG`) is the MoE default since stop 57, with one epilogue
    buffer since stop 59 (+8% at 8192³, two H100 calls).

    Args:
      lhs: (K, M) FP8, M tokens.
      lhs_scale: (K, ceil(M/128)) f32 scale_inv of each 1x128 token block.
      rhs: (N, M) FP8.
      rhs_scale: (N, ceil(M/128)) f32.
      out_dtype: bfloat16 or float32.
      config: tiling of the wgrad kernel (tile_t=128); None: `DENSE_FP8_BLOCK_WGRAD_CONFIG`,
        fitted to the shared memory for out_dtype.
      interpret: run the Pallas interpreter.

    Returns:
      (K, N) array of out_dtype.
    """
    common.check_rank("lhs", lhs, 2)
    common.check_rank("rhs", rhs, 2)
    # The wgrad kernel checks these too, under its own names (lhs_block_scale, ...).
    token_blocks = common.round_up(lhs.shape[1], 128) // 128
    for name, scale, operand in (("lhs_scale", lhs_scale, lhs), ("rhs_scale", rhs_scale, rhs)):
        common.check_dtype(name, scale, (jnp.float32,))
        common.check_shape(name, scale, (operand.shape[0], token_blocks))
    if config is None:
        sizes = (lhs.dtype.itemsize, rhs.dtype.itemsize, jnp.dtype(out_dtype).itemsize)
        config = fit_to_shared_memory(DENSE_FP8_BLOCK_WGRAD_CONFIG, sizes, block_scaled=True)
    return grouped_matmul_wgrad(
        lhs,
        rhs,
        _single_group(lhs.shape[1]),
        lhs_block_scale=lhs_scale,
        rhs_block_scale=rhs_scale,
        out_dtype=out_dtype,
        config=config,
        interpret=interpret,
    )[0]
