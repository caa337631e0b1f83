"""Grouped (MoE) GEMMs on quantized copies, and the public `grouped_matmul`.

As for dense (ops/gemm.py), every GEMM of a grouped linear layer is "NT", both operands stored
contiguous along the contraction. Activations are GroupedQuantizedTensors in the aligned layout
(ops/grouped_quantize.py), whose groups are `layout.aligned_sizes` rows long; the weights are
per-expert QuantizedTensors (leaves with a leading G axis):

  fprop  y[slots of g]  = x rowwise[slots of g] · (W_g columnwise)ᵀ     (P, K) · (G, N, K)ᵀ
  dgrad  dx[slots of g] = dy rowwise[slots of g] · (W_g rowwise)ᵀ       (P, N) · (G, K, N)ᵀ
  wgrad  dW_g = x columnwise[:, slots of g] · (dy columnwise[:, slots of g])ᵀ     → (G, K, N)

The reference runs `lax.ragged_dot_general` with float32 accumulation on exactly-dequantized
operands, as gemm.py does for dense: FP8 codes, MXFP8's e4m3·2^k, NVFP4's e2m1·e4m3 and
power-of-2 FP8-block values are exact in bfloat16 (FP8 block with float32 scales uses float32 and
HIGHEST precision), so only the accumulation order differs from a native GEMM; the per-tensor
factors (FP8 scale_inv, NVFP4's S_dec), one per group, multiply the output rows of their group
(fprop, dgrad) or the group's output (wgrad), in gemm.py's order. Off the GPU the 16-bit values
are widened to float32 before ragged_dot (`_ragged_dot`), so that a group's results do
not depend on which other groups share the call.

The Pallas grouped-matmul kernels (pallas_kernels/grouped_matmul*.py) take the same operands
(lhs (M, K) rows sorted by group, rhs (G, N, K), group_sizes (G,) int32 on the device; wgrad lhs
(K, M), rhs (N, M)). Where `kernels.gemm_kernels_enabled()` (on the GPU by default; see
`jax_qtrain.kernels.gemm_backend`) they replace the reference for per-tensor FP8 (fprop, dgrad,
wgrad), block FP8 with 1×128 activations and 128×128 weights (fprop, dgrad) and 16-bit
high-precision GEMMs. The other quantized GEMMs (MXFP8, NVFP4, block FP8's wgrad) run the 16-bit
kernels on the reference's exactly-dequantized bfloat16 operands, which the Pallas dequantize
kernels write in one pass (`kernels.dequantize_bf16`). A kernel that dequantizes MXFP8 tile by
tile inside the GEMM exists (`pallas_kernels.grouped_matmul_mxfp8`, bit-identical) but ran 2.4×
slower than this path on the H200 (docs/kernels_grouped_matmul.md), so it is not used here; only
FP8 block with float32 scales stays on ragged_dot. Kernel
results equal the reference's up to float32 rounding.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Literal, get_args

import jax
import jax.numpy as jnp
from jax import lax

from jax_qtrain import kernels as pallas_dispatch
from jax_qtrain.formats import fp8_block, mxfp8, nvfp4
from jax_qtrain.formats.spec import QuantizerSpec
from jax_qtrain.ops.gemm import kernel_out_dtype
from jax_qtrain.ops.grouped_quantize import (
    GroupedQuantizedTensor,
    GroupLayout,
    check_group_sizes,
    clamp_group_sizes,
    group_layout,
)
from jax_qtrain.quantize import QuantizedTensor, Usage

GroupedBackend = Literal["auto", "reference", "pallas"]
GROUPED_BACKENDS: tuple[str, ...] = get_args(GroupedBackend)

# out[m, n] = Σ_c lhs[m, c] · rhs[g, n, c]: ragged rows, rhs groups on axis 0.
_NT_RAGGED_ROWS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)
# out[m, n] = Σ_c lhs[m, c] · rhs[g, c, n] (lax.ragged_dot's form).
_NN_RAGGED_ROWS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (1,)), ((), ())),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)
# out[g, k, n] = Σ_{m in g} lhs[k, m] · rhs[n, m]: the groups split the contraction.
_NT_RAGGED_CONTRACTION = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (1,)), ((), ())),
    lhs_ragged_dimensions=[1],
    rhs_group_dimensions=[],
)
# out[g, k, n] = Σ_{m in g} lhs[m, k] · rhs[m, n].
_TN_RAGGED_CONTRACTION = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[],
)


def _exact_operand(
    spec: QuantizerSpec, data: jax.Array, scale_inv: jax.Array, amax: jax.Array | None
) -> tuple[jax.Array, jax.Array | None]:
    """(one copy's values, exact in their dtype; its per-tensor factor or None), as
    gemm._block_operand, plus FP8 per-tensor: codes as bfloat16, factor scale_inv. The factor
    has whatever shape the per-tensor field has (one per group for activations)."""
    fmt = spec.format
    if fmt == "fp8":
        return data.astype(jnp.bfloat16), scale_inv
    if fmt == "nvfp4":
        block_rows, block_cols = spec.block_shape
        codes = nvfp4.code_values(nvfp4.unpack_codes(data))
        scale = jnp.repeat(jnp.repeat(scale_inv.astype(jnp.float32), block_rows, 0), block_cols, 1)
        return (codes * scale).astype(jnp.bfloat16), nvfp4.global_decode_scale(amax)
    if fmt == "mxfp8":
        return mxfp8.dequantize(data, scale_inv).astype(jnp.bfloat16), None
    values = fp8_block.dequantize(data, scale_inv, spec)
    return (values if not spec.power_2_scale else values.astype(jnp.bfloat16)), None


def _kernel_exact_operand(
    spec: QuantizerSpec, data: jax.Array, scale_inv: jax.Array, amax: jax.Array | None
) -> tuple[jax.Array, jax.Array | None] | None:
    """_exact_operand's MXFP8 / NVFP4 values from the Pallas dequantize kernels (the same bits,
    one pass; leading expert axes allowed), or None where they do not apply."""
    if not pallas_dispatch.gemm_kernels_enabled():
        return None
    values = pallas_dispatch.dequantize_bf16(spec, data, scale_inv)
    if values is None:
        return None
    return values, (nvfp4.global_decode_scale(amax) if spec.format == "nvfp4" else None)


def _activation_operand(q: GroupedQuantizedTensor, usage: Usage):
    fields = q.copy(usage)
    on_kernel = _kernel_exact_operand(q.spec, *fields)
    return on_kernel if on_kernel is not None else _exact_operand(q.spec, *fields)


def _expert_operand(q: QuantizedTensor, usage: Usage):
    if not q.has_usage(usage):
        raise ValueError(f"usage={usage!r}: the experts' weights hold only {list(q.usages)}")
    fields = (getattr(q, f"{usage}_data"), q.line_scale_inv(usage), getattr(q, f"{usage}_amax"))
    on_kernel = _kernel_exact_operand(q.spec, *fields)  # all experts in one launch
    if on_kernel is not None:
        return on_kernel
    return jax.vmap(lambda d, s, a: _exact_operand(q.spec, d, s, a))(*fields)


def _factors_in_order(a_factor, b_factor, fmt: str) -> list[jax.Array]:
    """The per-group factors a product is multiplied by, in gemm.matmul_nt's order: FP8's is
    the product of its two scale_invs, the others' each factor in turn (none for formats
    without them)."""
    if fmt == "fp8":
        return [a_factor * b_factor]
    return [factor for factor in (a_factor, b_factor) if factor is not None]


def _apply_factors(out, a_factor, b_factor, spread, fmt: str):
    """Multiply by the per-group factors (`_factors_in_order`); `spread` maps (G,) factors
    onto `out`'s rows or groups."""
    for factor in _factors_in_order(a_factor, b_factor, fmt):
        out = out * spread(factor)
    return out


def _check_same_format(a_spec: QuantizerSpec, b_spec: QuantizerSpec) -> None:
    if a_spec.format != b_spec.format:
        raise ValueError(f"formats differ ({a_spec.format} vs {b_spec.format})")


def _kernel_nt(
    lhs: GroupedQuantizedTensor,
    lhs_usage: Usage,
    rhs: QuantizedTensor,
    rhs_usage: Usage,
    layout: GroupLayout,
    cols: int,
    token_order: bool,
    out_dtype,
) -> tuple[jax.Array, bool] | None:
    """grouped_matmul_nt on a native FP8 kernel: (out, whether out is in token order), or None
    where none covers the operands. The block-FP8 kernel writes the tokens' order itself when
    asked (its packed output) and that path is enabled; the others write the aligned layout.
    Both apply their scales in the epilogue, so they round to `out_dtype` there too."""
    if not rhs.has_usage(rhs_usage):
        return None
    a_data, a_scale_inv, _ = lhs.copy(lhs_usage)
    b_data = getattr(rhs, f"{rhs_usage}_data")
    b_scale_inv = rhs.line_scale_inv(rhs_usage)
    if a_data.shape[1] != b_data.shape[2]:
        return None
    fmt = lhs.spec.format
    packed = False
    if fmt == "fp8":  # per-group scales: one per row slot of lhs, one per expert of rhs
        out = pallas_dispatch.grouped_fp8_gemm(
            a_data,
            layout.per_slot(a_scale_inv),
            b_data,
            b_scale_inv,
            layout.aligned_sizes,
            out_dtype=kernel_out_dtype(out_dtype),
        )
    elif fmt == "fp8_block" and (lhs.spec.block_shape, rhs.spec.block_shape) == (
        (1, 128),
        (128, 128),
    ):
        packed = token_order and pallas_dispatch.gemm_path_enabled("fp8_block_packed_output")
        rows = dict(group_starts=layout.aligned_starts, out_rows=layout.num_rows) if packed else {}
        out = pallas_dispatch.grouped_fp8_block_gemm(
            a_data,
            a_scale_inv,
            b_data,
            b_scale_inv,
            layout.group_sizes if packed else layout.aligned_sizes,
            out_dtype=kernel_out_dtype(out_dtype),
            **rows,
        )
    else:
        return None
    return None if out is None else (out[:, :cols], packed)


def grouped_matmul_nt(
    lhs: GroupedQuantizedTensor,
    lhs_usage: Usage,
    rhs: QuantizedTensor,
    rhs_usage: Usage,
    layout: GroupLayout,
    *,
    cols: int,
    token_order: bool = False,
    out_dtype=jnp.float32,
) -> jax.Array:
    """fprop/dgrad GEMM in the aligned layout: (P, cols), row block g times expert g; with
    `token_order`, (M, cols) in the rows' original order instead (`layout.from_aligned` of
    that: rows past the groups are zero), which the 16-bit kernel writes directly.

    `lhs_usage`'s copy of lhs is (P, C'), `rhs_usage`'s copy of the experts is (G, N', C'');
    the contraction runs over the shorter padded length (padding is zeros). Accumulated in
    float32 and rounded once to `out_dtype`: by the kernel where nothing is applied after it
    (`kernel_out_dtype`), else after the per-group factors.
    """
    _check_same_format(lhs.spec, rhs.spec)
    return _grouped_nt_product(
        lhs, lhs_usage, rhs, rhs_usage, layout, cols, token_order, out_dtype
    ).astype(out_dtype)


def _grouped_nt_product(lhs, lhs_usage, rhs, rhs_usage, layout, cols, token_order, out_dtype):
    """grouped_matmul_nt's product, in `out_dtype` or in float32 for the caller to round."""

    def in_order(aligned_out):
        return layout.from_aligned(aligned_out) if token_order else aligned_out

    if pallas_dispatch.gemm_kernels_enabled():
        on_kernel = _kernel_nt(lhs, lhs_usage, rhs, rhs_usage, layout, cols, token_order, out_dtype)
        if on_kernel is not None:
            out, in_token_order = on_kernel
            return out if in_token_order else in_order(out)
    if token_order:
        out = _weights_in_registers_gemm(lhs, lhs_usage, rhs, rhs_usage, layout, cols, out_dtype)
        if out is not None:
            return out
    a_values, a_factor = _activation_operand(lhs, lhs_usage)
    b_values, b_factor = _expert_operand(rhs, rhs_usage)
    depth = min(a_values.shape[1], b_values.shape[2])
    a_values = a_values[:, :depth]
    b_values = b_values[:, :cols, :depth].astype(a_values.dtype)
    if token_order:
        out = _token_order_values_gemm(
            a_values, b_values, a_factor, b_factor, layout, lhs.spec, out_dtype
        )
        if out is not None:
            return out
    no_factors = a_factor is None and b_factor is None
    out = _exact_values_gemm(
        a_values,
        b_values,
        layout.aligned_sizes,
        _NT_RAGGED_ROWS,
        out_dtype=out_dtype if no_factors else jnp.float32,
    )
    out = _apply_factors(
        out, a_factor, b_factor, lambda f: layout.per_slot(f)[:, None], lhs.spec.format
    )
    return in_order(out)


# The weights-in-registers kernel paths (kernels.gemm_path_enabled names) and the weight
# blocks they cover.
_WEIGHTS_IN_REGISTERS = {
    "mxfp8": ("mxfp8_weights_in_registers", ((1, 32),)),
    "nvfp4": ("nvfp4_weights_in_registers", ((1, 16), (16, 16))),
}


def _weights_in_registers_gemm(
    lhs: GroupedQuantizedTensor,
    lhs_usage: Usage,
    rhs: QuantizedTensor,
    rhs_usage: Usage,
    layout: GroupLayout,
    cols: int,
    out_dtype,
):
    """MXFP8 / NVFP4 fprop / dgrad with the experts' weights dequantized inside the GEMM kernel
    (their codes and scale bytes as stored; the tokens' bf16 values from the dequantize
    kernel), written in token order: no bf16 copy of the weights. MXFP8: the values of
    `_token_order_values_gemm`. NVFP4: the tokens in the kernel's even/odd column order, so the
    same products summed in another order; the per-group factors (S_dec) applied to the f32
    output in `_apply_factors`' order (so float32 from the kernel; MXFP8 rounds to `out_dtype`
    in the kernel). None where the path is not enabled
    (kernels.gemm_path_enabled) or does not apply."""
    fmt = rhs.spec.format
    if fmt not in _WEIGHTS_IN_REGISTERS or lhs.spec.format != fmt:
        return None
    path, weight_blocks = _WEIGHTS_IN_REGISTERS[fmt]
    if tuple(rhs.spec.block_shape) not in weight_blocks or not rhs.has_usage(rhs_usage):
        return None  # (a missing copy is _expert_operand's error to raise)
    if not pallas_dispatch.gemm_path_enabled(path):
        return None
    codes = getattr(rhs, f"{rhs_usage}_data")  # (G, N', C'') (MXFP8) or (G, N', C''/2)
    scale_inv = rhs.line_scale_inv(rhs_usage)
    rows = dict(group_starts=layout.aligned_starts, out_rows=layout.num_rows)
    if fmt == "mxfp8":
        a_values, _ = _activation_operand(lhs, lhs_usage)
        if a_values.dtype != jnp.bfloat16:
            return None
        # (The padding is zeros; the adapter declines a depth that is not whole MX blocks.)
        depth = min(a_values.shape[1], codes.shape[2])
        return pallas_dispatch.grouped_mxfp8_weights_gemm(
            a_values[:, :depth],
            codes[:, :cols, :depth],
            scale_inv[:, :cols, : depth // 32],
            layout.group_sizes,
            out_dtype=kernel_out_dtype(out_dtype),
            **rows,
        )
    a_data, a_scale_inv, a_amax = lhs.copy(lhs_usage)
    block_rows = rhs.spec.block_shape[0]
    depth = min(2 * a_data.shape[1], 2 * codes.shape[2])  # two codes a byte
    if depth % 64 or (2 * a_data.shape[1]) % 64 or cols % block_rows:
        return None  # (the reordering needs whole 64-column runs of both operands)
    # The tokens' columns even/odd within each 64: the order the kernel contracts in.
    a_values = pallas_dispatch.dequantize_bf16(
        lhs.spec, a_data, a_scale_inv, column_order="even_odd"
    )
    if a_values is None:
        return None
    out = pallas_dispatch.grouped_nvfp4_weights_gemm(
        a_values[:, :depth],
        codes[:, :cols, : depth // 2],
        scale_inv[:, : cols // block_rows, : depth // 16],
        layout.group_sizes,
        block_rows=block_rows,
        **rows,
    )
    if out is None:
        return None
    a_factor = nvfp4.global_decode_scale(a_amax)
    b_factor = nvfp4.global_decode_scale(getattr(rhs, f"{rhs_usage}_amax"))
    return _apply_factors(out, a_factor, b_factor, lambda f: layout.per_row(f)[:, None], fmt)


def _token_order_values_gemm(a_values, b_values, a_factor, b_factor, layout, spec, out_dtype):
    """The 16-bit kernel on exactly-dequantized (bf16) operands, reading each group's rows
    from its aligned slots and writing them in token order (its packed output): no
    `from_aligned` gather of the float32 result. The per-group factors (NVFP4's S_dec) are
    applied in its epilogue, a's then b's as `_apply_factors` does, and then the rounding to
    `out_dtype` (`kernel_out_dtype`). None where it does not
    apply (kernels off, values that are not bf16, or FP8, whose reference multiplies by the
    product of its two factors rather than by one after the other)."""
    if a_values.dtype != jnp.bfloat16 or not pallas_dispatch.gemm_kernels_enabled():
        return None
    if spec.format == "fp8":
        return None
    return pallas_dispatch.grouped_half_gemm(
        a_values,
        b_values,
        layout.group_sizes,
        rhs_layout="nk",
        group_starts=layout.aligned_starts,
        out_rows=layout.num_rows,
        lhs_scale=None if a_factor is None else layout.per_slot(a_factor),
        rhs_scale=b_factor,
        out_dtype=kernel_out_dtype(out_dtype),
    )


def _fp8_block_wgrad_kernel(
    lhs: GroupedQuantizedTensor,
    rhs: GroupedQuantizedTensor,
    layout: GroupLayout,
    *,
    rows,
    cols,
    out_dtype,
) -> jax.Array | None:
    """The block-FP8 wgrad on the FP8 wgrad kernel (two 1×128 token-block copies with
    power-of-2 scales, promoted per 128-token chunk), where the path "fp8_block_grouped_wgrad"
    is on; None elsewhere."""
    token_blocks = all(
        spec.format == "fp8_block" and spec.block_shape == (1, 128) and spec.power_2_scale
        for spec in (lhs.spec, rhs.spec)
    )
    if not (token_blocks and pallas_dispatch.gemm_path_enabled("fp8_block_grouped_wgrad")):
        return None
    a_data, a_scale_inv, _ = lhs.copy("columnwise")
    b_data, b_scale_inv, _ = rhs.copy("columnwise")
    return pallas_dispatch.grouped_fp8_block_wgrad_gemm(
        a_data[:rows],
        a_scale_inv[:rows],
        b_data[:cols],
        b_scale_inv[:cols],
        layout.aligned_sizes,
        out_dtype=kernel_out_dtype(out_dtype),
    )


def grouped_matmul_wgrad(
    lhs: GroupedQuantizedTensor,
    rhs: GroupedQuantizedTensor,
    layout: GroupLayout,
    *,
    rows: int,
    cols: int,
    out_dtype=jnp.float32,
) -> jax.Array:
    """wgrad GEMM (G, rows, cols): the columnwise copies (K', P) and (N', P) contracted over
    each group's slots, accumulated in float32 and rounded once to `out_dtype` (by the kernel
    where nothing is applied after it, as in grouped_matmul_nt). Hadamard-rotated copies are
    rotated alike, so the rotation cancels."""
    _check_same_format(lhs.spec, rhs.spec)
    return _grouped_wgrad_product(lhs, rhs, layout, rows, cols, out_dtype).astype(out_dtype)


def _grouped_wgrad_product(lhs, rhs, layout, rows, cols, out_dtype):
    """grouped_matmul_wgrad's product, in `out_dtype` or in float32 for the caller to round."""
    out = _fp8_block_wgrad_kernel(lhs, rhs, layout, rows=rows, cols=cols, out_dtype=out_dtype)
    if out is not None:
        return out
    if lhs.spec.format == "fp8" and pallas_dispatch.gemm_kernels_enabled():
        a_data, a_scale_inv, _ = lhs.copy("columnwise")
        b_data, b_scale_inv, _ = rhs.copy("columnwise")
        factors = _factors_in_order(a_scale_inv, b_scale_inv, "fp8")
        out = _wgrad_kernel(a_data[:rows], b_data[:cols], layout.aligned_sizes, factors, out_dtype)
        if out is not None:
            return out
    a_values, a_factor = _activation_operand(lhs, "columnwise")
    b_values, b_factor = _activation_operand(rhs, "columnwise")
    return _exact_values_gemm(
        a_values[:rows],
        b_values[:cols].astype(a_values.dtype),
        layout.aligned_sizes,
        _NT_RAGGED_CONTRACTION,
        group_factors=_factors_in_order(a_factor, b_factor, lhs.spec.format),
        out_dtype=out_dtype,
    )


def _wgrad_kernel(lhs, rhs, group_sizes, group_factors, out_dtype) -> jax.Array | None:
    """The wgrad kernel's (G, K, N) product times the per-group factors in turn (`(G,)` each):
    applied in its epilogue (`group_scale`) and rounded there to `out_dtype`
    (`kernel_out_dtype`) where the path "wgrad_group_scale" is on, else after it, on its
    float32 output (for the caller to round). None where the kernel does not cover the
    operands."""
    in_kernel = not group_factors or pallas_dispatch.gemm_path_enabled("wgrad_group_scale")
    out = pallas_dispatch.grouped_wgrad_gemm(
        lhs,
        rhs,
        group_sizes,
        group_scale=jnp.stack(group_factors) if group_factors and in_kernel else None,
        out_dtype=kernel_out_dtype(out_dtype) if in_kernel else jnp.float32,
    )
    if out is None or in_kernel:
        return out
    for factor in group_factors:
        out = out * factor[:, None, None]
    return out


def _exact_values_gemm(
    lhs, rhs, group_sizes, dimension_numbers, *, group_factors=(), out_dtype=jnp.float32
) -> jax.Array:
    """Grouped GEMM of exactly-dequantized operands: ragged rows (lhs (P, C), rhs (G, N, C)) or
    a ragged contraction (wgrad: lhs (K, P), rhs (N, P)); in `out_dtype` from a kernel
    (`kernel_out_dtype`), float32 from ragged_dot. `group_factors` (the contraction only):
    (G,) factors each group's product is multiplied by in turn before the rounding (by the
    wgrad kernel: `_wgrad_kernel`; or after ragged_dot).

    bfloat16 values (every format but FP8 block with float32 scales) run on the Pallas 16-bit
    kernels where enabled: the same products (exact in bf16) accumulated in float32, only in
    another order, and ~7× faster than ragged_dot on Hopper; float32 values run ragged_dot at
    HIGHEST precision (16-bit values too, off the GPU: `_ragged_dot`)."""
    if lhs.dtype == jnp.bfloat16 and pallas_dispatch.gemm_kernels_enabled():
        if dimension_numbers is _NT_RAGGED_ROWS:
            out = pallas_dispatch.grouped_half_gemm(
                lhs, rhs, group_sizes, rhs_layout="nk", out_dtype=kernel_out_dtype(out_dtype)
            )
        else:
            out = _wgrad_kernel(lhs, rhs, group_sizes, group_factors, out_dtype)
        if out is not None:
            return out
    out = _ragged_dot(
        lhs, rhs, group_sizes, dimension_numbers, float32_precision=lax.Precision.HIGHEST
    )
    for factor in group_factors:
        out = out * factor[:, None, None]
    return out


def _ragged_dot(lhs, rhs, group_sizes, dimension_numbers, *, float32_precision=None) -> jax.Array:
    """`lax.ragged_dot_general` accumulating in float32; `float32_precision` applies when the
    operands are float32.

    Off the GPU, 16-bit operands are widened to float32 first (exact, and so are their
    products): XLA:CPU's bfloat16 ragged_dot sums in an order that depends on the number of
    groups (and on the host), so the same rows got other float32 bits when a device held only
    some of the experts (expert parallelism, 2026-12-04); its float32 ragged_dot does not."""
    if jnp.dtype(lhs.dtype).itemsize < 4 and not pallas_dispatch.on_gpu():
        lhs, rhs = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
    return lax.ragged_dot_general(
        lhs,
        rhs,
        group_sizes,
        dimension_numbers,
        precision=float32_precision if lhs.dtype == jnp.float32 else None,
        preferred_element_type=jnp.float32,
    )


# --- high-precision grouped GEMMs (no recipe, and the backward of the overrides) --------------
def _promote(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    dtype = jnp.promote_types(a.dtype, b.dtype)
    return a.astype(dtype), b.astype(dtype)


# 16-bit operands run on the Pallas kernels where enabled (ragged_dot is ~7x slower on Hopper).
# Each takes `out_dtype` (default float32): the float32 accumulator rounded once to it, by the
# kernel (`kernel_out_dtype`) or after ragged_dot.
def ragged_nn(
    x: jax.Array, kernels: jax.Array, group_sizes: jax.Array, *, out_dtype=jnp.float32
) -> jax.Array:
    """(M, N) in `out_dtype`: rows of group g times kernels[g] (G, K, N); rows past the groups
    are 0.

    Differentiable (the Pallas kernels have no autodiff rule): dx and dkernels come from
    ragged_nt and ragged_tn in the operands' promoted dtype, with the cotangent cast to it
    first."""
    return _ragged_nn(*_promote(x, kernels), group_sizes, jnp.dtype(out_dtype))


def _ragged_nn_forward(lhs, rhs, group_sizes, out_dtype):
    if pallas_dispatch.gemm_kernels_enabled():
        out = pallas_dispatch.grouped_half_gemm(
            lhs, rhs, group_sizes, rhs_layout="kn", out_dtype=kernel_out_dtype(out_dtype)
        )
        if out is not None:
            return out.astype(out_dtype)
    return _ragged_dot(lhs, rhs, group_sizes, _NN_RAGGED_ROWS).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ragged_nn(lhs, rhs, group_sizes, out_dtype):
    return _ragged_nn_forward(lhs, rhs, group_sizes, out_dtype)


def _ragged_nn_fwd(lhs, rhs, group_sizes, out_dtype):
    """Residuals: (lhs, rhs, group_sizes), the operands the two backward GEMMs read."""
    return _ragged_nn_forward(lhs, rhs, group_sizes, out_dtype), (lhs, rhs, group_sizes)


def _ragged_nn_bwd(out_dtype, residuals, cotangent):
    del out_dtype
    lhs, rhs, group_sizes = residuals
    cotangent = cotangent.astype(lhs.dtype)
    dlhs = ragged_nt(cotangent, rhs, group_sizes, out_dtype=lhs.dtype)
    drhs = ragged_tn(lhs, cotangent, group_sizes, out_dtype=rhs.dtype)
    return dlhs, drhs, None


_ragged_nn.defvjp(_ragged_nn_fwd, _ragged_nn_bwd)


def ragged_nt(
    dy: jax.Array, kernels: jax.Array, group_sizes: jax.Array, *, out_dtype=jnp.float32
) -> jax.Array:
    """(M, K) in `out_dtype`: rows of group g times kernels[g]ᵀ, kernels (G, K, N)."""
    lhs, rhs = _promote(dy, kernels)
    if pallas_dispatch.gemm_kernels_enabled():
        out = pallas_dispatch.grouped_half_gemm(
            lhs, rhs, group_sizes, rhs_layout="nk", out_dtype=kernel_out_dtype(out_dtype)
        )
        if out is not None:
            return out.astype(out_dtype)
    return _ragged_dot(lhs, rhs, group_sizes, _NT_RAGGED_ROWS).astype(out_dtype)


def ragged_tn(
    x: jax.Array, dy: jax.Array, group_sizes: jax.Array, *, out_dtype=jnp.float32
) -> jax.Array:
    """(G, K, N) in `out_dtype`: x[rows of g]ᵀ · dy[rows of g]."""
    lhs, rhs = _promote(x, dy)
    if pallas_dispatch.gemm_kernels_enabled():
        # x and dy as stored: the kernel reads them MN-major (no transposes, ~4 ms of a 44 ms
        # bf16 h200-preset step before it did, docs/benchmarks.md).
        out = pallas_dispatch.grouped_wgrad_gemm(
            lhs, rhs, group_sizes, token_major=True, out_dtype=kernel_out_dtype(out_dtype)
        )
        if out is not None:
            return out.astype(out_dtype)
    return _ragged_dot(lhs, rhs, group_sizes, _TN_RAGGED_CONTRACTION).astype(out_dtype)


# --- the public op ----------------------------------------------------------------------------
def _kernel_covers(lhs, rhs, transpose_rhs: bool) -> bool:
    """Whether a Pallas kernel runs grouped_matmul for these operands (see the module doc)."""
    if isinstance(lhs, GroupedQuantizedTensor):
        # Every format but FP8 block with float32 scales: native FP8 kernels, or the 16-bit
        # ones on the exactly-dequantized (bfloat16) values.
        return lhs.spec.format != "fp8_block" or (lhs.spec.power_2_scale and rhs.spec.power_2_scale)
    dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
    return dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def grouped_matmul(
    lhs: jax.Array | GroupedQuantizedTensor,
    rhs: jax.Array | QuantizedTensor,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = False,
    out_dtype=None,
    backend: GroupedBackend = "auto",
) -> jax.Array:
    """Grouped matmul: `out[rows of g] = lhs[rows of g] @ rhs[g]` (or `@ rhs[g]ᵀ`).

    Args:
      lhs: (M, K) rows sorted by group: a float array, or a GroupedQuantizedTensor from
        `grouped_quantize` with the same group_sizes (its rowwise copy is read).
      rhs: (G, K, N) (or (G, N, K) with `transpose_rhs`): a float array, or the per-expert
        QuantizedTensor of such weights (`quantize_per_expert`); the GEMM reads its columnwise
        copy, or with `transpose_rhs` its rowwise one. Quantized operands use the same format.
      group_sizes: (G,) int32 rows per group, a device array; clamped as described in
        ops/grouped_quantize.py (negative → 0, truncated at M). Rows past the groups give 0.
      transpose_rhs: contract rhs's last axis instead of its middle one.
      out_dtype: default the promoted float dtype (lhs's original dtype when quantized).
      backend: "auto" (the Pallas kernels on GPU where they apply, else the reference),
        "reference" (lax.ragged_dot on exactly-dequantized operands, float32 accumulation),
        "pallas" (an error when no kernel applies).

    Returns: (M, N).
    """
    if backend not in GROUPED_BACKENDS:
        raise ValueError(f"backend must be one of {list(GROUPED_BACKENDS)}, got {backend!r}")
    quantized = isinstance(lhs, GroupedQuantizedTensor)
    if quantized != isinstance(rhs, QuantizedTensor):
        raise TypeError(
            "lhs and rhs must both be quantized (GroupedQuantizedTensor and QuantizedTensor) or "
            f"both float arrays, got {type(lhs).__name__} and {type(rhs).__name__}"
        )
    if quantized:
        rows, depth = lhs.shape
        num_groups = jax.tree_util.tree_leaves(rhs)[0].shape[0]  # leaves are (G, ...)
        expert_rows, expert_cols = rhs.shape  # one expert's weight
        contract, cols = (expert_cols, expert_rows) if transpose_rhs else rhs.shape
        default_dtype = lhs.dtype
    else:
        for name, value in (("lhs", lhs), ("rhs", rhs)):
            if not hasattr(value, "shape") or not jnp.issubdtype(value.dtype, jnp.floating):
                raise TypeError(f"{name} must be a float array, got {type(value).__name__}")
        if lhs.ndim != 2 or rhs.ndim != 3:
            raise ValueError(
                f"lhs must be (M, K) and rhs (G, K, N), got {tuple(lhs.shape)} and "
                f"{tuple(rhs.shape)}"
            )
        rows, depth = lhs.shape
        num_groups = rhs.shape[0]
        contract, cols = (rhs.shape[2], rhs.shape[1]) if transpose_rhs else rhs.shape[1:]
        default_dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
    if contract != depth:
        raise ValueError(f"rhs's contraction size ({contract}) must equal lhs's last dim ({depth})")
    check_group_sizes(group_sizes, num_groups, num_rows=rows)
    out_dtype = default_dtype if out_dtype is None else jnp.dtype(out_dtype)

    if backend == "pallas" and not _kernel_covers(lhs, rhs, transpose_rhs):
        raise NotImplementedError(
            "backend='pallas': no Pallas grouped-matmul kernel covers these operands (bf16/f16 "
            "arrays, or quantized operands other than FP8 block with float32 scales); use "
            "backend='reference' or 'auto'"
        )
    gemms = contextlib.nullcontext() if backend == "auto" else pallas_dispatch.gemm_backend(backend)
    with gemms:
        if not quantized:
            plain_gemm = ragged_nt if transpose_rhs else ragged_nn
            return plain_gemm(lhs, rhs, clamp_group_sizes(group_sizes, rows), out_dtype=out_dtype)
        layout = group_layout(group_sizes, rows, lhs.align)
        out = grouped_matmul_nt(
            lhs,
            "rowwise",
            rhs,
            "rowwise" if transpose_rhs else "columnwise",
            layout,
            cols=cols,
            token_order=True,
            out_dtype=out_dtype,
        )
    return out
