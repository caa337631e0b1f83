"""GEMMs on quantized copies.

With the stored layouts (docs/design/layouts.md) every GEMM of a linear layer is "NT":
`out[i, j] = Σ_c A[i, c] · B[j, c]`, both copies contiguous along the contraction c:

  fprop  y  = x rowwise  · (W columnwise)ᵀ      (M, K) · (N, K)ᵀ
  dgrad  dx = dy rowwise · (W rowwise)ᵀ         (M, N) · (K, N)ᵀ
  wgrad  dW = x columnwise · (dy columnwise)ᵀ   (K, M) · (N, M)ᵀ

Per-tensor FP8 runs as XLA's FP8 dot_general (cuBLASLt on the GPU) with the two scales applied
to the float32 result, at `Precision.HIGHEST`: XLA then turns off cuBLASLt's FP8 fast
accumulation, which is TransformerEngine's `use_split_accumulator=True`. TE uses that for dgrad
and wgrad and fast accumulation for fprop; here fprop uses it too by default, because on the H200
the fast mode's error (8.5e-4 of the norm at K=4096, against 1.3e-4) depended on which cuBLASLt
algorithm a program got, so a vmapped, rematerialized or cached-weight step gave other results
than the plain one (measured 2026-11-29, docs/design/gemm_accumulation.md). A recipe with
`fprop_split_accumulator=False` gets TE's fast fprop (`split_accumulator=False` here, at
`Precision.DEFAULT`).

The block formats run as a high-precision dot on exactly-dequantized operands with float32
accumulation: MXFP8's e4m3·2^k, NVFP4's e2m1·e4m3 and power-of-2 FP8-block values are exact in
bfloat16, so products are exact and only the accumulation order differs from
a native block-scaled GEMM; NVFP4's two global scales multiply the result. FP8-block with float32
scales dequantizes to float32 and uses a float32 (HIGHEST) dot.

Where a Pallas kernel covers the operands and `kernels.gemm_kernels_enabled()` (on the GPU by
default), block FP8's fprop and dgrad run on it instead (equal up to float32 rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_qtrain import kernels
from jax_qtrain.formats import nvfp4
from jax_qtrain.quantize import QuantizedTensor, Usage

_NT = (((1,), (1,)), ((), ()))


def _gemm_rounds_its_output() -> bool:
    """Whether a bfloat16 GEMM returns bfloat16 itself here (read at trace time): on the GPU.

    There, asking XLA for the float32 product and rounding it in a second pass wrote and re-read
    it, 1.13-1.18x the time of the GEMM at 16384x8192x8192 and 16384x4096x14336 on an H100, for
    the same bits (benchmarks/dense_output_ab.py, 2026-12-07); XLA sums split-K partial products
    in float32 (its default `--xla_gpu_triton_gemm_disable_reduced_precision_reduction=true`).
    On the CPU, XLA computes a bfloat16 dot in float32 anyway, so there is nothing to save, and a
    bfloat16-result dot let its excess-precision rule (`xla_allow_excess_precision`, on by
    default) drop the rounding of weight gradients that are cast back to float32 parameters,
    which moved the `cpu` preset's validation loss (2.7349 to 2.7468): the CPU keeps the float32
    product, rounded explicitly."""
    return kernels.on_gpu()


def accumulation_dtype(operand_dtype, out_dtype) -> jnp.dtype:
    """The `preferred_element_type` of a float32-accumulating GEMM on `operand_dtype` operands
    whose result is rounded once to `out_dtype` with nothing applied in between: `out_dtype`
    for bfloat16 on bfloat16 where the GEMM rounds its own output (`_gemm_rounds_its_output`),
    float32 otherwise (the caller rounds)."""
    out_dtype = jnp.dtype(out_dtype)
    bf16 = jnp.dtype(jnp.bfloat16)
    if jnp.dtype(operand_dtype) == out_dtype == bf16 and _gemm_rounds_its_output():
        return bf16
    return jnp.dtype(jnp.float32)


def kernel_out_dtype(out_dtype) -> jnp.dtype:
    """What a Pallas GEMM kernel (the dense block-FP8 ones, the grouped ones) is asked to write
    for a result rounded once to `out_dtype` with nothing applied after the kernel: bfloat16,
    rounded in its epilogue after any scales it applies itself, rather than a float32 result
    written, re-read and rounded in another pass; float32 otherwise (the kernels write only
    these two), for the caller to finish and round."""
    bf16 = jnp.dtype(jnp.bfloat16)
    return bf16 if jnp.dtype(out_dtype) == bf16 else jnp.dtype(jnp.float32)


def _copy(q: QuantizedTensor, usage: Usage):
    """(codes, scale_inv in the (lines, blocks) layout, global amax) of one stored copy."""
    if usage == "rowwise":
        return q.rowwise_data, q.line_scale_inv(usage), q.rowwise_amax
    return q.columnwise_data, q.line_scale_inv(usage), q.columnwise_amax


def _block_operand(q: QuantizedTensor, usage: Usage) -> tuple[jax.Array, jax.Array | None]:
    """(operand values exact in their dtype, float32 factor for the output or None)."""
    spec = q.spec
    if spec.format == "nvfp4":
        data, block_scale, amax = _copy(q, usage)
        br, bc = spec.block_shape
        codes = nvfp4.code_values(nvfp4.unpack_codes(data))
        scale = jnp.repeat(jnp.repeat(block_scale.astype(jnp.float32), br, 0), bc, 1)
        # e2m1 · e4m3 has at most 6 significant bits: exact in bfloat16.
        return (codes * scale).astype(jnp.bfloat16), nvfp4.global_decode_scale(amax)
    values = q.dequantize_stored(usage)
    if spec.format == "fp8_block" and not spec.power_2_scale:
        return values, None  # fp32 scales: values are not bf16-exact
    return values.astype(jnp.bfloat16), None


def lhs_scale_layout(recipe, role: str, shape2d: tuple[int, int], dtype) -> str:
    """The scale layout to quantize a layer's GEMM lhs in (x for fprop, dy for dgrad; `dtype`
    is its dtype), for whole 128×128 tiles:

    - "tiles" where the block-FP8 GEMM kernel reads it (1×128 blocks against 128×128 weight
      blocks, the kernel path on), so the quantize kernel's tile-major scales reach the GEMM
      as written instead of being rearranged and transposed back (docs/design/layouts.md);
    - "tiles" for MXFP8 where the quantize kernel writes it (on the GPU): the GEMMs dequantize
      through XLA, which reads the tiles through a transposed index as cheaply as the lines
      (the dense layer's step within 0.5% either way, stop 39), and the quantize kernel skips
      its untile pass (3.44 → 3.61 TB/s row+col, 8192²);
    - "lines" elsewhere."""
    spec = recipe.spec(role)
    if any(n % 128 for n in shape2d):
        return "lines"
    if (
        spec.format == "fp8_block"
        and spec.block_shape == (1, 128)
        and recipe.spec("weight").block_shape == (128, 128)
        and kernels.gemm_path_enabled("fp8_block_tiled_scales")
    ):
        return "tiles"
    if spec.format == "mxfp8" and kernels.quantize_kernel_applies(spec, shape2d, dtype):
        return "tiles"
    return "lines"


def _fp8_block_kernel(
    a, a_usage, b, b_usage, *, rows: int, cols: int, out_dtype
) -> jax.Array | None:
    """The Pallas block-FP8 GEMM (DeepSeek-V3 style: FP8 wgmma, float32 promotion every 128 of
    K) for a 1×128-blocked A and a 128×128-blocked B (fprop and dgrad), or two 1×128-blocked
    copies (wgrad: the path "fp8_block_wgrad"; since stop 54 on the MoE wgrad kernel with one
    group, "fp8_block_wgrad_grouped_kernel", 1.10-1.14x faster, the same bits); None where it
    does not apply. A bfloat16 `out_dtype` is rounded in the kernel's epilogue, not written as
    float32 and rounded in another pass (the dense kernel's bf16 output equals cuBLASLt's
    block-scaled GEMM bit for bit: tests/pallas_kernels/test_block_fp8_vs_cublas_gpu.py)."""
    kernel_dtype = kernel_out_dtype(out_dtype)
    if a.spec.block_shape != (1, 128):
        return None
    if b.spec.block_shape == (128, 128):
        rhs_block_rows = 128
    elif b.spec.block_shape == (1, 128) and kernels.gemm_path_enabled("fp8_block_wgrad"):
        rhs_block_rows = 1
    else:
        return None
    b_data, b_scale_inv, _ = _copy(b, b_usage)
    a_data = a.rowwise_data if a_usage == "rowwise" else a.columnwise_data
    if rhs_block_rows == 1 and kernels.gemm_path_enabled("fp8_block_wgrad_grouped_kernel"):
        out = kernels.dense_fp8_block_wgrad_gemm(
            a_data[:rows],
            a.line_scale_inv(a_usage)[:rows],
            b_data,
            b_scale_inv,
            out_dtype=kernel_dtype,
        )
        if out is not None:
            return out[:, :cols]
    if a.scale_layout == "tiles" and a_data.shape[0] == rows:
        # (K/128, rows, 1): each K block's scales for consecutive rows, the order the kernel
        # reads, so neither the quantize kernel nor this GEMM rearranges them.
        tiled_scales = a.rowwise_scale_inv if a_usage == "rowwise" else a.columnwise_scale_inv
        out = kernels.dense_fp8_block_gemm(
            a_data,
            tiled_scales[..., 0],
            b_data,
            b_scale_inv,
            lhs_scale_k_major=True,
            rhs_block_rows=rhs_block_rows,
            out_dtype=kernel_dtype,
        )
    else:
        a_scale_inv = a.line_scale_inv(a_usage)
        out = kernels.dense_fp8_block_gemm(
            a_data[:rows],
            a_scale_inv[:rows],
            b_data,
            b_scale_inv,
            rhs_block_rows=rhs_block_rows,
            out_dtype=kernel_dtype,
        )
    return None if out is None else out[:, :cols]


def matmul_nt(
    a: QuantizedTensor,
    a_usage: Usage,
    b: QuantizedTensor,
    b_usage: Usage,
    *,
    rows: int,
    cols: int,
    split_accumulator: bool = True,
    out_dtype=jnp.float32,
) -> jax.Array:
    """`A · Bᵀ` of two stored copies, cropped to (rows, cols) (the copies may be padded),
    accumulated in float32 and rounded once to `out_dtype`.

    Both tensors must use the same format. Padding along the contraction is zeros (or, for two
    Hadamard-rotated copies, the same rotated length), so it adds nothing. `split_accumulator`
    (per-tensor FP8 only): False lets cuBLASLt use FP8 fast accumulation (module docstring).
    On the GPU a bfloat16 `out_dtype` on bfloat16 operands with no factor to apply afterwards
    (MXFP8, power-of-2 FP8 block off the kernel) is the GEMM's own output
    (`accumulation_dtype`).
    """
    if a.spec.format != b.spec.format:
        raise ValueError(f"matmul_nt: formats differ ({a.spec.format} vs {b.spec.format})")
    if a.spec.format == "fp8":
        a_data, a_scale_inv, _ = _copy(a, a_usage)
        b_data, b_scale_inv, _ = _copy(b, b_usage)
        out = lax.dot_general(
            a_data,
            b_data,
            _NT,
            # HIGHEST: the split accumulator; DEFAULT: fast accumulation (module docstring)
            precision=lax.Precision.HIGHEST if split_accumulator else lax.Precision.DEFAULT,
            preferred_element_type=jnp.float32,
        )
        # XLA folds the scales and the rounding into cuBLASLt's FP8 GEMM (dense_output_ab.py).
        return (out[:rows, :cols] * (a_scale_inv * b_scale_inv)).astype(out_dtype)

    if a.spec.format == "fp8_block" and kernels.gemm_kernels_enabled():
        out = _fp8_block_kernel(a, a_usage, b, b_usage, rows=rows, cols=cols, out_dtype=out_dtype)
        if out is not None:
            return out.astype(out_dtype)

    a_values, a_factor = _block_operand(a, a_usage)
    b_values, b_factor = _block_operand(b, b_usage)
    depth = min(a_values.shape[1], b_values.shape[1])
    if a_values.shape[1] != b_values.shape[1] and (
        a.spec.hadamard_columnwise or b.spec.hadamard_columnwise
    ):
        raise ValueError("rotated copies must have the same padded contraction length")
    precision = lax.Precision.HIGHEST if a_values.dtype == jnp.float32 else None
    no_factors = a_factor is None and b_factor is None
    accumulated = accumulation_dtype(a_values.dtype, out_dtype) if no_factors else jnp.float32
    out = lax.dot_general(
        a_values[:rows, :depth],
        b_values[:cols, :depth].astype(a_values.dtype),
        _NT,
        precision=precision,
        preferred_element_type=accumulated,
    )
    for factor in (a_factor, b_factor):
        if factor is not None:
            out = out * factor
    return out.astype(out_dtype)


def fprop_gemm(
    qx: QuantizedTensor,
    qw: QuantizedTensor,
    recipe,
    *,
    rows: int,
    cols: int,
    out_dtype=jnp.float32,
) -> jax.Array:
    """A linear layer's forward GEMM `y = x · W` (x's rowwise copy, W's columnwise copy) in
    `out_dtype`, split accumulator or not as the recipe says (only per-tensor FP8 can opt out,
    `Float8CurrentScaling.fprop_split_accumulator`)."""
    return matmul_nt(
        qx,
        "rowwise",
        qw,
        "columnwise",
        rows=rows,
        cols=cols,
        split_accumulator=getattr(recipe, "fprop_split_accumulator", True),
        out_dtype=out_dtype,
    )
