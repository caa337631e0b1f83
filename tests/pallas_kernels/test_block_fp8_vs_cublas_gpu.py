"""Our dense block-FP8 GEMM against cuBLASLt's, through torch, on the GPU (`-m gpu`).

TransformerEngine's Float8BlockScaling recipe runs its GEMMs on Hopper through cuBLASLt's
block-scaled FP8 mode (1x128 activation blocks, 128x128 weight blocks: CUDA >= 12.9), which
`torch._scaled_mm` exposes. Both GEMMs multiply each 128-wide K block on the FP8 tensor cores
and add it, times its two scales, into an f32 sum, so they should agree bit for bit where
cuBLAS does not split K; the stop-51 benchmark run found every element of the 8192³ product
equal. These tests pin that down on shapes with partial row and column tiles, and say how far
apart the two are where they are not equal. They are skipped without torch's CUDA build (the
CPU CI) or where torch refuses block scales (an older torch or CUDA: the skip says why).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.peers_ab import (
    block_fp8_operands,
    to_torch,
    torch_block_fp8_mm,
    torch_two_1x128_mm,
)
from pallas_kernels.grouped_matmul_dense import dense_matmul_fp8_block, dense_matmul_fp8_block_wgrad
from pallas_kernels.grouped_matmul_fwd import fp8_block_default_config, grouped_matmul_fp8_block
from pallas_kernels.grouped_matmul_wgrad import (
    DEFAULT_FP8_BLOCK_WGRAD_CONFIG,
    grouped_matmul_wgrad,
)

pytestmark = pytest.mark.gpu

# (M, K, N): cuBLASLt wants M a multiple of 4 and K / 128 a multiple of 4 for these scales.
SHAPES = {
    "8192^3": (8192, 8192, 8192),
    "partial row tile": (1000, 2048, 1536),
    "partial column block": (2048, 1024, 1472),
    "long K": (512, 7168, 2048),
}


def _torch_or_skip():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    return torch


def _cublas_or_skip(torch, mm, *operands):
    """float32 numpy output of the peers_ab torch GEMM `mm(torch)` on jax `operands`; a skip,
    saying why, where this torch or CUDA refuses those block scales."""
    try:
        out = mm(torch)(*(to_torch(torch, a) for a in operands))
    except RuntimeError as error:
        pytest.skip(f"torch._scaled_mm refuses these block scales: {error}")
    return out.float().cpu().numpy()


def _assert_equal_to_cublas(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert np.isfinite(ours).all() and np.abs(ours).max() > 0
    differing = np.count_nonzero(ours != theirs)
    relative = np.abs(ours - theirs).max() / np.abs(ours).max()
    assert differing == 0, (
        f"{differing} of {ours.size} elements differ from cuBLASLt's, by at most "
        f"{relative:.1e} of max |out|"
    )


@pytest.mark.parametrize("shape", list(SHAPES))
def test_gpu_dense_fp8_block_equals_cublas_block_scaled_gemm(shape):
    torch = _torch_or_skip()
    operands = block_fp8_operands(*SHAPES[shape])
    ours = dense_matmul_fp8_block(*operands, lhs_scale_k_major=True)
    theirs = _cublas_or_skip(torch, torch_block_fp8_mm, *operands)
    _assert_equal_to_cublas(np.asarray(ours.astype(jnp.float32)), theirs)


def test_gpu_dense_fp8_block_with_scales_before_the_mma_equals_cublas():
    # Stop 56's option on the forward: the same bits with each K step's scale loads issued
    # ahead of the wgmma, with the entry point's streamed lhs scales and with the tile's
    # prefetched scale table.
    torch = _torch_or_skip()
    operands = block_fp8_operands(*SHAPES["partial row tile"])
    theirs = _cublas_or_skip(torch, torch_block_fp8_mm, *operands)
    k = SHAPES["partial row tile"][1]
    for streamed in (True, False):
        config = fp8_block_default_config(
            k, jnp.bfloat16, persistent_pipeline=True, stream_lhs_scales=streamed
        )
        config = dataclasses.replace(config, block_scales_before_mma=True)
        ours = dense_matmul_fp8_block(*operands, lhs_scale_k_major=True, config=config)
        _assert_equal_to_cublas(np.asarray(ours.astype(jnp.float32)), theirs)


def test_gpu_grouped_fp8_block_equals_cublas_per_group():
    # TransformerEngine's grouped GEMM on Hopper is one cuBLASLt GEMM per expert: each group's
    # rows of our grouped kernel must be that GEMM's bits (an empty group included).
    torch = _torch_or_skip()
    sizes, k, n = [1000, 0, 2048, 512], 1024, 1536
    lhs8, lhs_scale_k_major, _, _ = block_fp8_operands(sum(sizes), k, n)
    rhs_operands = [block_fp8_operands(4, k, n, seed=group)[2:] for group in range(len(sizes))]
    rhs8 = jnp.stack([rhs for rhs, _ in rhs_operands])
    rhs_scale = jnp.stack([scale for _, scale in rhs_operands])
    ours = grouped_matmul_fp8_block(
        lhs8,
        lhs_scale_k_major,
        rhs8,
        rhs_scale,
        jnp.asarray(sizes, jnp.int32),
        lhs_scale_k_major=True,
    )
    ours = np.asarray(ours.astype(jnp.float32))
    start = 0
    for size, (rhs, scale) in zip(sizes, rhs_operands, strict=True):
        if size:
            rows = slice(start, start + size)
            theirs = _cublas_or_skip(
                torch, torch_block_fp8_mm, lhs8[rows], lhs_scale_k_major[:, rows], rhs, scale
            )
            _assert_equal_to_cublas(ours[rows], theirs)
        start += size


@pytest.mark.parametrize("shape", ["partial row tile", "long K"])
def test_gpu_dense_fp8_block_with_1x128_rhs_equals_cublas(shape):
    # A wgrad's two token-direction copies: 1x128 blocks on both operands, which TE's
    # Float8BlockScaling wgrad hands to cuBLASLt as two 1x128 scale vectors. torch wants the
    # rhs scales (N, K/128) outer-dim-major, so they go over as a (K/128, N) array.
    torch = _torch_or_skip()
    m, k, n = SHAPES[shape]
    lhs8, lhs_scale_k_major, rhs8, _ = block_fp8_operands(m, k, n)
    rhs_scale = block_fp8_operands(n, k, 4, seed=12)[1].T  # (N, K/128) powers of two
    ours = dense_matmul_fp8_block(
        lhs8, lhs_scale_k_major, rhs8, rhs_scale, lhs_scale_k_major=True, rhs_block_rows=1
    )
    theirs = _cublas_or_skip(torch, torch_two_1x128_mm, lhs8, lhs_scale_k_major, rhs8, rhs_scale.T)
    _assert_equal_to_cublas(np.asarray(ours.astype(jnp.float32)), theirs)
    # The dense layers' wgrad entry (the MoE wgrad kernel, one group, its own default).
    on_wgrad_kernel = dense_matmul_fp8_block_wgrad(lhs8, lhs_scale_k_major.T, rhs8, rhs_scale)
    _assert_equal_to_cublas(np.asarray(on_wgrad_kernel.astype(jnp.float32)), theirs)


@pytest.mark.parametrize(
    "config",
    [
        None,
        dataclasses.replace(
            DEFAULT_FP8_BLOCK_WGRAD_CONFIG, max_concurrent_steps=3, block_scales_before_mma=False
        ),
    ],
    ids=["default", "3 stages, scales after the MMA"],
)
def test_gpu_grouped_wgrad_with_1x128_block_scales_equals_cublas_per_group(config):
    # The MoE wgrad of block FP8 (the path "fp8_block_grouped_wgrad", the default since stop
    # 53): each expert's dW is TE's cuBLASLt GEMM of its tokens' two 1x128 copies. The layer
    # aligns every group to 128 tokens, so each group's scale blocks are its own (an empty
    # group included). The default loads the scales ahead of the wgmma (since stop 57); also
    # with stop 53's order and depth, the scales after it.
    torch = _torch_or_skip()
    sizes, k, n = [1024, 0, 384, 640], 512, 768
    lhs8, lhs_scale_k_major, _, _ = block_fp8_operands(k, sum(sizes), 4, seed=13)
    rhs8, rhs_scale_k_major, _, _ = block_fp8_operands(n, sum(sizes), 4, seed=14)
    lhs_scale, rhs_scale = lhs_scale_k_major.T, rhs_scale_k_major.T  # (K, M/128), (N, M/128)
    ours = grouped_matmul_wgrad(
        lhs8,
        rhs8,
        jnp.asarray(sizes, jnp.int32),
        lhs_block_scale=lhs_scale,
        rhs_block_scale=rhs_scale,
        out_dtype=jnp.bfloat16,
        config=config,
    )
    ours = np.asarray(ours.astype(jnp.float32))
    start = 0
    for group, size in enumerate(sizes):
        tokens, blocks = slice(start, start + size), slice(start // 128, (start + size) // 128)
        start += size
        if not size:
            assert not ours[group].any()
            continue
        theirs = _cublas_or_skip(
            torch,
            torch_two_1x128_mm,
            lhs8[:, tokens],
            lhs_scale[:, blocks].T,
            rhs8[:, tokens],
            rhs_scale[:, blocks].T,
        )
        _assert_equal_to_cublas(ours[group], theirs)
