"""Dispatch from jax_qtrain to the Pallas kernels in `pallas_kernels` (which never imports us).

Quantize: `quantize` asks `quantize_kernel_applies` whether a kernel covers a spec and shape on
the current platform ("auto" backend) and calls `quantize` here to run it. A format with no
kernel registered in `_QUANTIZE_KERNELS` falls back to the jnp reference under "auto" and raises
under "pallas". A kernel path listed in `_AWAITING_GPU_VERIFICATION` runs under "pallas" only
("auto" keeps the reference until its `gpu` tests pass on the H200). The grouped per-tensor FP8
quantizer (ops/grouped_quantize.py) calls `fp8_cast_transpose` itself, the grouped NVFP4 one
`grouped_nvfp4_quantize` (when `grouped_nvfp4_kernel_applies`).

GEMMs: the ops (ops/gemm.py, ops/grouped_gemm.py) call the `*_gemm` adapters below when
`gemm_kernels_enabled()`; each returns None where no kernel covers the operands, and the op then
runs its reference. `gemm_backend("reference" | "pallas" | "auto")` sets that for a block of
code (a JAX config state, so jitted functions retrace when it changes); "auto" means the kernels
on GPU. The kernels accumulate in float32 like the references but in another order, so their
results equal the references' up to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from jax._src import config as jax_config  # pinned jax==0.11.2: config states keyed into jit

from jax_qtrain.formats import common
from jax_qtrain.formats.spec import QuantizerSpec

# format name -> (applies(spec, shape2d, dtype) -> bool, run(x2d, spec, **kw) -> fields dict)
_QUANTIZE_KERNELS: dict[str, tuple[Callable[..., bool], Callable[..., dict]]] = {}


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


# Kernel paths that pass the interpreter and the H200 cross-lowering but have not run on a GPU
# yet: backend="auto" leaves them to the reference (backend="pallas" runs them) until their
# `gpu` tests have passed on the H200. Entries are (format, block_shape) of `jq.quantize`'s
# kernels or (format + "_grouped", block_shape) of the grouped quantizer's per-group kernel
# paths (ops/grouped_quantize.py). Verified so far:
# NVFP4's 16×16 weight blocks (2026-11-30), NVFP4's grouped path (per-group global amaxes, seeds
# and positions as per-line / per-block inputs of the quantize kernel, 2026-12-01) and its
# per-group amaxes from `nvfp4_line_amax_bits` (2026-12-01, stop 25), bit for bit the reference
# (tests/jax_qtrain/test_grouped_quantize.py::test_gpu_nvfp4_groups_on_the_kernel_*,
# tests/pallas_kernels/test_quantize.py::test_gpu_nvfp4_grouped_bit_exact and
# ::test_gpu_nvfp4_line_amax_bits).
_AWAITING_GPU_VERIFICATION: set[tuple[str, tuple[int, int]]] = set()


def awaiting_gpu_verification(spec: QuantizerSpec, *, path: str = "") -> bool:
    """Whether the kernel path for `spec` still waits for its `gpu` tests on the H200 (see
    `_AWAITING_GPU_VERIFICATION`): `jq.quantize`'s kernel, or with `path` "grouped" the grouped
    quantizer's."""
    fmt = f"{spec.format}_{path}" if path else spec.format
    return (fmt, tuple(spec.block_shape)) in _AWAITING_GPU_VERIFICATION


def kernel_takes_position_offset(spec: QuantizerSpec) -> bool:
    """Whether the kernel runs stochastic rounding at a position offset (a shard of a larger
    tensor: `jq.quantize(..., position_offset=)`, the sharded layers' NVFP4 gradients). NVFP4's
    does, bit for bit the reference on the H200 since 2026-11-30."""
    return spec.format == "nvfp4"


def quantize_kernel_applies(spec: QuantizerSpec, shape2d: tuple[int, int], dtype) -> bool:
    """True when a GPU-verified Pallas kernel covers this spec and shape and we are on a GPU."""
    entry = _QUANTIZE_KERNELS.get(spec.format)
    return (
        entry is not None
        and on_gpu()
        and not awaiting_gpu_verification(spec)
        and entry[0](spec, shape2d, dtype)
    )


def weight_block_amax_bits(x2d: jax.Array, spec: QuantizerSpec) -> jax.Array | None:
    """NVFP4 16×16 blocks: every block's amax (float32 bits, (M16/16, K16/16) uint32) from one
    pass over x, which the quantize kernel needs and the global amax is the maximum of (so
    `tensor_amaxes` takes it from them instead of reading x again); None for other specs."""
    if spec.format == "nvfp4" and spec.block_shape == (16, 16):
        return _pallas().nvfp4_block_amax_bits(x2d)
    return None


def tensor_amaxes(
    x2d: jax.Array, spec: QuantizerSpec, usages, block_amax_bits: jax.Array | None = None
) -> dict:
    """Per-tensor amax of each requested copy, for formats that need one (FP8 current scaling,
    NVFP4's global scales; None for the block formats). NVFP4 gets both in one Pallas pass, the
    columnwise one after the Hadamard transform, instead of rotating xᵀ in jnp first; with
    16×16 blocks, from their amaxes (`weight_block_amax_bits`: the largest pattern is the
    largest |x|, NaN's above Inf's, as the amax kernel takes them)."""
    if block_amax_bits is not None:
        tensor_amax = common.f32_from_bits(jnp.max(block_amax_bits))
        return {u: tensor_amax for u in usages}
    if spec.format == "nvfp4":
        row_amax, col_amax = _pallas().nvfp4_amax(x2d, hadamard_columnwise=spec.hadamard_columnwise)
        return {u: row_amax if u == "rowwise" else col_amax for u in usages}
    if spec.format == "fp8":
        tensor_amax = common.amax(x2d)  # xᵀ has the same amax
        return {u: tensor_amax for u in usages}
    return {u: None for u in usages}


def require_quantize_kernel(spec: QuantizerSpec, shape2d: tuple[int, int], dtype) -> None:
    """What backend='pallas' checks before any kernel runs: a clear error when no kernel
    covers this spec, shape and dtype."""
    entry = _QUANTIZE_KERNELS.get(spec.format)
    if entry is None:
        raise NotImplementedError(
            f"backend='pallas': no Pallas quantize kernel for {spec.describe()} yet; "
            "use backend='reference' or 'auto'"
        )
    if not entry[0](spec, tuple(shape2d), dtype):
        raise ValueError(
            f"backend='pallas': the {spec.format} kernel does not cover {spec.describe()} of "
            f"shape {tuple(shape2d)} {jax.numpy.dtype(dtype)}; use backend='reference' or 'auto'"
        )


def quantize(
    x2d: jax.Array,
    spec: QuantizerSpec,
    *,
    input_dtype,
    amaxes: dict,
    seeds: dict,
    positions: dict | None = None,
    block_amax_bits: jax.Array | None = None,
    scale_layout: str = "lines",
) -> dict:
    """Run the quantize kernel for `spec`; returns QuantizedTensor fields for the copies named
    in `amaxes` (keys "rowwise" / "columnwise"; values are the reduced per-tensor amaxes or None).
    `positions`: each copy's uint32 (line, col) in a larger tensor, for stochastic rounding
    (NVFP4 only), or None. `block_amax_bits`: NVFP4 16×16 blocks' amaxes from
    `weight_block_amax_bits` (None: the kernel wrapper takes them itself). `scale_layout`:
    "tiles" keeps the MXFP8 / FP8 block 1×128 kernels' tile-major scales as they are.
    """
    require_quantize_kernel(spec, tuple(x2d.shape), x2d.dtype)
    run = _QUANTIZE_KERNELS[spec.format][1]
    if scale_layout != "lines":
        if spec.format not in ("mxfp8", "fp8_block"):
            raise ValueError(f"scale_layout={scale_layout!r}: not for {spec.describe()}")
        run = functools.partial(run, scale_layout=scale_layout)
    if block_amax_bits is not None:
        if spec.format != "nvfp4" or spec.block_shape != (16, 16):
            raise ValueError(f"block_amax_bits: NVFP4 16×16 blocks only, not {spec.describe()}")
        run = functools.partial(run, block_amax_bits=block_amax_bits)
    if positions is None:
        return run(x2d, spec, input_dtype=input_dtype, amaxes=amaxes, seeds=seeds)
    if not kernel_takes_position_offset(spec):
        raise ValueError(f"positions: only the NVFP4 kernel takes them, not {spec.format}'s")
    return run(x2d, spec, input_dtype=input_dtype, amaxes=amaxes, seeds=seeds, positions=positions)


# --- Pallas quantize kernels (issue 4) ----------------------------------------------------------
# pallas_kernels is imported lazily, when a kernel first runs. The kernels read bf16 / f32 2-D
# arrays of any shape (they zero-pad to whole 128×128 tiles themselves, an extra copy unless the
# dims are multiples of 128) and return the copies in the layouts.md layouts.

_KERNEL_INPUT_DTYPES = ("bfloat16", "float32")


def _pallas():
    import pallas_kernels

    return pallas_kernels


def _kernel_input(dtype) -> bool:
    return str(jax.numpy.dtype(dtype)) in _KERNEL_INPUT_DTYPES


def _copy_fields(out, amaxes: dict, scale_field: str, global_amax: bool = False) -> dict:
    fields = {}
    for usage in amaxes:
        fields[f"{usage}_data"] = getattr(out, f"{usage}_data")
        fields[f"{usage}_scale_inv"] = getattr(out, f"{usage}_{scale_field}")
        fields[f"{usage}_amax"] = amaxes[usage] if global_amax else None
    return fields


def _mxfp8_applies(spec: QuantizerSpec, shape2d, dtype) -> bool:
    return _kernel_input(dtype) and spec.block_shape == (1, 32)


def _mxfp8_run(
    x2d, spec: QuantizerSpec, *, input_dtype, amaxes: dict, seeds: dict, scale_layout="lines"
) -> dict:
    del input_dtype, seeds
    out = _pallas().quantize_mxfp8(
        x2d,
        rowwise="rowwise" in amaxes,
        columnwise="columnwise" in amaxes,
        fp8_dtype=spec.dtype,
        scale_layout=scale_layout,
    )
    return _copy_fields(out, amaxes, "scale")


def _nvfp4_applies(spec: QuantizerSpec, shape2d, dtype) -> bool:
    # 1×16 blocks (with or without the Hadamard transform), or 16×16 weight blocks (without).
    weight_blocks = spec.block_shape == (16, 16) and not spec.hadamard_columnwise
    return _kernel_input(dtype) and (spec.block_shape == (1, 16) or weight_blocks)


def _nvfp4_run(
    x2d,
    spec: QuantizerSpec,
    *,
    input_dtype,
    amaxes: dict,
    seeds: dict,
    positions=None,
    block_amax_bits=None,
) -> dict:
    del input_dtype
    positions = positions or {}
    out = _pallas().quantize_nvfp4(
        x2d,
        block_shape=spec.block_shape,
        block_amax_bits=block_amax_bits,
        rowwise="rowwise" in amaxes,
        columnwise="columnwise" in amaxes,
        rowwise_amax=amaxes.get("rowwise"),
        columnwise_amax=amaxes.get("columnwise"),
        hadamard_columnwise=spec.hadamard_columnwise,
        stochastic_rounding=spec.stochastic_rounding,
        rowwise_seed=seeds.get("rowwise"),
        columnwise_seed=seeds.get("columnwise"),
        rowwise_position=positions.get("rowwise"),
        columnwise_position=positions.get("columnwise"),
    )
    return _copy_fields(out, amaxes, "scale", global_amax=True)


def _grouped_nvfp4_covers(spec: QuantizerSpec, dtype) -> bool:
    return spec.format == "nvfp4" and _kernel_input(dtype) and spec.block_shape == (1, 16)


def grouped_nvfp4_kernel_applies(spec: QuantizerSpec, dtype) -> bool:
    """backend="auto": whether the grouped quantizer runs NVFP4's per-group copies on the
    quantize kernel (GPU, bf16 / f32 input, 1×16 blocks, path verified on the H200)."""
    return (
        _grouped_nvfp4_covers(spec, dtype)
        and on_gpu()
        and not awaiting_gpu_verification(spec, path="grouped")
    )


def nvfp4_line_amax_bits(aligned: jax.Array, spec: QuantizerSpec) -> tuple[jax.Array, jax.Array]:
    """Each token's amax bits (P,) and each 16-token block's columnwise (rotated) amax bits
    (P/16,) of a grouped tensor in the aligned layout, from one kernel pass."""
    _check_grouped_nvfp4_covers(spec, aligned.dtype)
    return _pallas().nvfp4_line_amax_bits(aligned, hadamard_columnwise=spec.hadamard_columnwise)


def _check_grouped_nvfp4_covers(spec: QuantizerSpec, dtype) -> None:
    if not _grouped_nvfp4_covers(spec, dtype):
        raise ValueError(
            f"backend='pallas': the grouped NVFP4 kernel path does not cover {spec.describe()} "
            f"of {jnp.dtype(dtype)} (bf16 / f32 input, 1×16 blocks); use "
            "backend='reference' or 'auto'"
        )


def grouped_nvfp4_quantize(aligned: jax.Array, spec: QuantizerSpec, usages, **per_group) -> dict:
    """{usage: (packed codes, block scales)} of NVFP4 copies of a grouped tensor in the aligned
    layout (P, K), from one kernel pass; `per_group` are `quantize_nvfp4`'s rowwise_line_* and
    columnwise_block_* arguments (per-token global amaxes, seeds and hashed positions)."""
    _check_grouped_nvfp4_covers(spec, aligned.dtype)
    out = _pallas().quantize_nvfp4(
        aligned,
        rowwise="rowwise" in usages,
        columnwise="columnwise" in usages,
        hadamard_columnwise=spec.hadamard_columnwise,
        stochastic_rounding=spec.stochastic_rounding,
        **per_group,
    )
    return {u: (getattr(out, f"{u}_data"), getattr(out, f"{u}_scale")) for u in usages}


def _fp8_block_applies(spec: QuantizerSpec, shape2d, dtype) -> bool:
    return _kernel_input(dtype) and spec.block_shape in ((1, 128), (128, 128))


def _fp8_block_run(
    x2d, spec: QuantizerSpec, *, input_dtype, amaxes: dict, seeds: dict, scale_layout="lines"
) -> dict:
    del seeds
    out = _pallas().quantize_fp8_block(
        x2d,
        scale_layout=scale_layout,
        block_shape=spec.block_shape,
        rowwise="rowwise" in amaxes,
        columnwise="columnwise" in amaxes,
        fp8_dtype=spec.dtype,
        power_2_scale=spec.power_2_scale,
        amax_epsilon=spec.amax_epsilon,
        input_dtype=input_dtype,
    )
    return _copy_fields(out, amaxes, "scale_inv")


def fp8_cast_transpose(scaled2d: jax.Array, fp8_dtype, usages) -> dict:
    """{usage: codes} of already-scaled float32 values (per-tensor FP8 after the multiply by
    its scale): the rowwise codes and / or the columnwise ones (of scaledᵀ), from one kernel
    pass that writes both layouts itself."""
    out = _pallas().cast_transpose_fp8(
        scaled2d,
        rowwise="rowwise" in usages,
        columnwise="columnwise" in usages,
        fp8_dtype=fp8_dtype,
    )
    return {usage: getattr(out, f"{usage}_data") for usage in usages}


_QUANTIZE_KERNELS.update(
    {
        "mxfp8": (_mxfp8_applies, _mxfp8_run),
        "nvfp4": (_nvfp4_applies, _nvfp4_run),
        "fp8_block": (_fp8_block_applies, _fp8_block_run),
    }
)


# --- Pallas GEMM kernels (issue 5) --------------------------------------------------------------
GEMM_BACKENDS = ("auto", "reference", "pallas")


def _validate_gemm_backend(value) -> None:
    if value not in GEMM_BACKENDS:
        raise ValueError(f"gemm backend must be one of {list(GEMM_BACKENDS)}, got {value!r}")


_gemm_backend = jax_config.string_or_object_state(
    name="jax_qtrain_gemm_backend",
    default="auto",
    help="Which GEMMs jax_qtrain's ops run: auto (Pallas kernels on GPU), reference, pallas.",
    validator=_validate_gemm_backend,
    include_in_jit_key=True,
    include_in_trace_context=True,
)


@contextlib.contextmanager
def gemm_backend(backend: str) -> Iterator[None]:
    """Run the ops' GEMMs on the Pallas kernels ("pallas", also in the interpreter), on the jnp
    references ("reference"), or on the kernels when on a GPU ("auto", the default)."""
    _validate_gemm_backend(backend)
    with _gemm_backend(backend):
        yield


def gemm_kernels_enabled() -> bool:
    backend = _gemm_backend.value
    return backend == "pallas" or (backend == "auto" and on_gpu())


# Opt-in GEMM kernel paths: under gemm_backend "auto" the ops keep their previous path, under
# "pallas" they take these. A path starts here while it has passed only the interpreter and the
# H200 cross-lowering, and leaves once its gpu tests pass and it is no slower. Verified and
# removed so far: the packed (token-order) output of the 16-bit and FP8 grouped kernels
# and of the block-FP8 one ("fp8_block_packed_output", stop 26), bits equal to the aligned output
# gathered (tests/pallas_kernels/test_grouped_matmul_gpu.py::test_gpu_*packed_output_*, 2026-12-01).
# Also verified: the block-FP8 GEMM reading the 1×128 scales of the dense layer's lhs in the
# "tiles" layout ("fp8_block_tiled_scales", ops/gemm.py::lhs_scale_layout), bits equal to the
# "lines" path (tests/jax_qtrain/test_scale_layout.py::test_gpu_*, 2026-12-03).
# Kept opt-in: the MXFP8 and NVFP4 fprop / dgrad with the weights dequantized in registers
# ("mxfp8_weights_in_registers", "nvfp4_weights_in_registers": pallas_kernels.
# grouped_matmul_mx_weights, stops 46-47). Verified on an H100 on 2026-12-05: their layer tests
# (test_gemm_kernels.py::test_gpu_*_weights_in_registers_*) and kernel tests passed. But they ran
# slower than the dequantize-then-GEMM path they would replace (docs/benchmarks.md, stop 47;
# stops 48-49: still 10-20% slower on an H200 and an H100, with every variant tried), so
# "auto" does not take them; "pallas" does.
# Also verified, stop 51 (an H100, 2026-12-05): the dense layers' block-FP8 wgrad on the FP8
# kernel with 1×128 blocks on both operands ("fp8_block_wgrad"; before it XLA's bf16 GEMM of
# the two dequantized copies): every element equal to cuBLASLt's two-1×128 GEMM
# (tests/pallas_kernels/test_block_fp8_vs_cublas_gpu.py), the layer test under "pallas"
# (test_gemm_kernels.py::test_dense_fp8_block_on_the_kernel_gpu), and 1.10-1.15x the
# path it replaces at 8192³ (722-744 vs 648-658 TFLOP/s; cuBLASLt 854), so "auto" takes it.
# Also verified, stop 53 (an H100, 2026-12-05): the grouped (MoE) block-FP8 wgrad on the FP8
# wgrad kernel with 1×128 token-block scales on both copies ("fp8_block_grouped_wgrad", built
# in stop 51; before it both copies were dequantized to bf16 for the 16-bit wgrad kernel):
# every element equal to one cuBLASLt two-1×128 GEMM per expert
# (test_block_fp8_vs_cublas_gpu.py), the layer test, and with its 3-stage default 1.34x the
# path it replaces (G8 balanced, 759 vs 568 TFLOP/s; cuBLASLt per expert 750, same call), so
# "auto" takes it.
# Also verified, stop 54 (an H100, 2026-12-06): the dense layers' block-FP8 wgrad on the MoE
# wgrad kernel with one group of every token ("fp8_block_wgrad_grouped_kernel", taking over
# from "fp8_block_wgrad"'s FP8 kernel with 1×128 rhs blocks): the same dW bits as that kernel
# (test_dense_fp8_block_wgrad_on_either_kernel_gpu; both equal cuBLASLt's), and 1.10-1.14x
# faster at 8192³ (855 vs 749 TFLOP/s in grouped_ab's alternation; 795-798 vs 721-725 beside
# cuBLASLt's 852-858 in peers_ab's), so "auto" takes it.
# Opt-in since stop 69, awaiting its gpu tests: the grouped wgrad kernel applying per-tensor
# FP8's per-group scales and NVFP4's S_dec in its epilogue ("wgrad_group_scale", the kernel's
# `group_scale`) and rounding its own bf16 output, instead of a float32 output that XLA scales
# and rounds (tests/pallas_kernels/test_grouped_matmul_gpu.py::
# test_gpu_fp8_wgrad_group_scale_is_applied_last_then_rounded_once, tests/jax_qtrain/
# test_gemm_kernels.py::test_grouped_dense_with_the_wgrad_group_scale_path_gpu; timed by
# benchmarks/grouped_output_ab.py).
_OPT_IN_GEMM_PATHS: set[str] = {
    "mxfp8_weights_in_registers",
    "nvfp4_weights_in_registers",
    "wgrad_group_scale",
}


def gemm_path_enabled(path: str) -> bool:
    """Whether the ops run the GEMM kernel path `path`: kernels enabled, and the path not
    opt-in (`_OPT_IN_GEMM_PATHS`: awaiting GPU verification, or verified and slower) or the
    backend "pallas"."""
    if not gemm_kernels_enabled():
        return False
    return _gemm_backend.value == "pallas" or path not in _OPT_IN_GEMM_PATHS


_FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


# The grouped GEMM adapters write float32 unless asked for bfloat16 (rounded once in the kernel's
# epilogue, after any scales it applies): ops/grouped_gemm.py asks where nothing is applied after.
_F32 = jnp.float32


def _is_fp8(*arrays) -> bool:
    return all(jnp.dtype(a.dtype) in _FP8 for a in arrays)


def grouped_fp8_gemm(lhs, lhs_row_scale, rhs, rhs_group_scale, group_sizes, *, out_dtype=_F32):
    """out[rows of g] = (lhs · rhs[g]ᵀ) · lhs_row_scale · rhs_group_scale[g]:
    lhs (M, K) FP8 with (M,) scales, rhs (G, N, K) FP8 with (G,) scales; in `out_dtype`
    (float32, or bfloat16 rounded once in the epilogue, after the scales)."""
    if not _is_fp8(lhs, rhs):
        return None
    return _pallas().grouped_matmul(
        lhs,
        rhs,
        group_sizes,
        lhs_scale=lhs_row_scale,
        rhs_scale=rhs_group_scale,
        out_dtype=out_dtype,
    )


def grouped_fp8_block_gemm(
    lhs, lhs_scale, rhs, rhs_scale, group_sizes, *, group_starts=None, out_rows=None, out_dtype=_F32
):
    """DeepSeek-style block-FP8 grouped GEMM: lhs (M, K) in 1×128 blocks with scales
    (M, K/128), rhs (G, N, K) in 128×128 blocks with scales (G, N/128, K/128); `group_starts`
    / `out_rows`: the kernel's packed output (see `grouped_half_gemm`); in `out_dtype`."""
    if not _is_fp8(lhs, rhs) or lhs.shape[1] % 128 or rhs.shape[1] % 128:
        return None
    return _pallas().grouped_matmul_fp8_block(
        lhs,
        lhs_scale,
        rhs,
        rhs_scale,
        group_sizes,
        out_dtype=out_dtype,
        group_starts=group_starts,
        out_rows=out_rows,
    )


def grouped_wgrad_gemm(
    lhs, rhs, group_sizes, *, group_scale=None, token_major: bool = False, out_dtype=_F32
):
    """(G, K, N) = lhs[:, tokens of g] · rhs[:, tokens of g]ᵀ, times each group's factors in
    `group_scale` ((F, G) or (G,) float32, or None) in turn, in `out_dtype` (rounded once,
    after them), lhs (K, M) and rhs (N, M) token-contiguous, both FP8 or both the same 16-bit
    dtype.
    `token_major`: lhs (M, K) and rhs (M, N) instead, 16-bit only (x and dy as stored, no
    transposes before the kernel)."""
    half = jnp.dtype(lhs.dtype) in _HALF and lhs.dtype == rhs.dtype
    if not (half or (_is_fp8(lhs, rhs) and not token_major)):
        return None
    return _pallas().grouped_matmul_wgrad(
        lhs,
        rhs,
        group_sizes,
        group_scale=group_scale,
        out_dtype=out_dtype,
        token_major=token_major,
    )


def grouped_fp8_block_wgrad_gemm(lhs, lhs_scale, rhs, rhs_scale, group_sizes, *, out_dtype=_F32):
    """(G, K, N) block-FP8 wgrad in `out_dtype`: lhs (K, M) and rhs (N, M) FP8 token-contiguous
    copies in 1×128 token blocks with scales (K, M/128) and (N, M/128), promoted per 128-token
    chunk."""
    if not _is_fp8(lhs, rhs) or lhs.shape[1] % 128:
        return None
    return _pallas().grouped_matmul_wgrad(
        lhs,
        rhs,
        group_sizes,
        lhs_block_scale=lhs_scale,
        rhs_block_scale=rhs_scale,
        out_dtype=out_dtype,
    )


def dense_fp8_block_wgrad_gemm(lhs, lhs_scale, rhs, rhs_scale, *, out_dtype=jnp.float32):
    """(K, N) block-FP8 wgrad lhs · rhsᵀ in `out_dtype` (float32 or bfloat16, rounded once in
    the epilogue) on the MoE wgrad kernel with one group of every token: lhs (K, M) and rhs
    (N, M) FP8 token-contiguous copies in 1×128 token blocks with scales (K, M/128) and
    (N, M/128)."""
    if not _is_fp8(lhs, rhs) or lhs.shape[1] % 128:
        return None
    return _pallas().dense_matmul_fp8_block_wgrad(
        lhs, lhs_scale, rhs, rhs_scale, out_dtype=out_dtype
    )


def grouped_half_gemm(
    lhs,
    rhs,
    group_sizes,
    *,
    rhs_layout: str,
    group_starts=None,
    out_rows: int | None = None,
    lhs_scale=None,
    rhs_scale=None,
    out_dtype=_F32,
):
    """Grouped GEMM of 16-bit operands in `out_dtype`: rhs (G, N, K) ("nk") or (G, K, N) ("kn").
    `group_starts` / `out_rows`: the kernel's packed output (groups read from their starts in
    lhs, written in order); `lhs_scale` (M,) / `rhs_scale` (G,): float32 factors its epilogue
    applies, lhs's first."""
    if jnp.dtype(lhs.dtype) not in _HALF or lhs.dtype != rhs.dtype:
        return None
    return _pallas().grouped_matmul(
        lhs,
        rhs,
        group_sizes,
        lhs_scale=lhs_scale,
        rhs_scale=rhs_scale,
        out_dtype=out_dtype,
        rhs_layout=rhs_layout,
        group_starts=group_starts,
        out_rows=out_rows,
    )


def grouped_mxfp8_weights_gemm(
    lhs, rhs_codes, rhs_scale_bytes, group_sizes, *, group_starts, out_rows: int, out_dtype=_F32
):
    """Grouped GEMM in `out_dtype` of bf16 tokens (P, K) and MXFP8 weights (G, N, K) codes with
    their (G, N, K/32) E8M0 bytes, the weights dequantized in the kernel's registers, written in
    the tokens' order (the packed output); None where the kernel does not cover the operands."""
    if lhs.dtype != jnp.bfloat16 or not _is_fp8(rhs_codes) or rhs_scale_bytes.dtype != jnp.uint8:
        return None
    k = lhs.shape[-1]
    if rhs_codes.ndim != 3 or rhs_codes.shape[-1] != k or k % 32:
        return None
    return _pallas().grouped_matmul_mxfp8_weights(
        lhs,
        rhs_codes,
        rhs_scale_bytes,
        group_sizes,
        out_dtype=out_dtype,
        group_starts=group_starts,
        out_rows=out_rows,
    )


def dequantize_bf16(
    spec: QuantizerSpec, data: jax.Array, scale_inv: jax.Array, *, column_order: str = "natural"
):
    """bfloat16 values of stored MXFP8 or NVFP4 copies on the Pallas dequantize kernels, or None
    where none covers them: data (..., R, C') and scale_inv (..., R/r, C/c) as stored, leading
    axes (the experts) batched into one launch. NVFP4 without its per-tensor factor S_dec;
    NVFP4 with `column_order="even_odd"`: each 64 columns' even-indexed values, then its odd
    ones (the token order of `grouped_nvfp4_weights_gemm`; C a multiple of 64).

    These are the operands the grouped GEMMs read (ops/grouped_gemm.py): the same bits as the
    reference's `(codes · scales).astype(bfloat16)` (e4m3·2^k and e2m1·e4m3 are exact in
    bfloat16), written in one pass instead of XLA's fusions."""
    if spec.format == "mxfp8" and tuple(spec.block_shape) == (1, 32) and column_order == "natural":
        values_per_byte, scale_cols, kernel = 1, 32, _pallas().dequantize_mxfp8
    elif spec.format == "nvfp4" and tuple(spec.block_shape) in ((1, 16), (16, 16)):
        values_per_byte, scale_cols = 2, 16
        kernel = functools.partial(
            _pallas().dequantize_nvfp4, global_amax=None, column_order=column_order
        )
        if column_order == "even_odd" and (data.shape[-1] * 2) % 64:
            return None
    else:
        return None
    if data.ndim < 2:
        return None
    block_rows = spec.block_shape[0]
    rows, cols = data.shape[-2], data.shape[-1] * values_per_byte
    if rows % block_rows or cols % scale_cols:
        return None
    if scale_inv.shape != (*data.shape[:-2], rows // block_rows, cols // scale_cols):
        return None
    # The kernels take one scale per row of values: a 16×16 block's scale serves 16 rows.
    scale_rows = jnp.repeat(scale_inv, block_rows, axis=-2) if block_rows > 1 else scale_inv
    values = kernel(
        data.reshape(-1, data.shape[-1]),
        scale_rows.reshape(-1, scale_rows.shape[-1]),
        out_dtype=jnp.bfloat16,
    )
    return values.reshape(*data.shape[:-2], rows, cols)


def grouped_nvfp4_weights_gemm(
    lhs, rhs_codes, rhs_scale, group_sizes, *, block_rows: int, group_starts, out_rows: int
):
    """float32 grouped GEMM of bf16 tokens (P, K) in the even/odd column order (see
    `dequantize_bf16`) and NVFP4 weights: (G, N, K/2) packed codes with their E4M3 scales,
    (G, N / block_rows, K/16) (block_rows 1 or 16), the weights dequantized in the kernel's
    registers, written in the tokens' order (the packed output); no per-tensor factors. None
    where the kernel does not cover the operands."""
    if lhs.dtype != jnp.bfloat16 or rhs_codes.dtype != jnp.uint8 or rhs_codes.ndim != 3:
        return None
    k = lhs.shape[-1]
    num_groups, num_cols, packed_k = rhs_codes.shape
    if packed_k * 2 != k or k % 64 or block_rows not in (1, 16) or num_cols % block_rows:
        return None
    if rhs_scale.shape != (num_groups, num_cols // block_rows, k // 16):
        return None
    if block_rows > 1:  # the kernel takes one scale per weight row
        rhs_scale = jnp.repeat(rhs_scale, block_rows, axis=1)
    return _pallas().grouped_matmul_nvfp4_weights(
        lhs,
        rhs_codes,
        rhs_scale,
        group_sizes,
        lhs_order="even_odd",
        out_dtype=jnp.float32,
        group_starts=group_starts,
        out_rows=out_rows,
    )


def dense_fp8_block_gemm(
    lhs,
    lhs_scale,
    rhs,
    rhs_scale,
    *,
    lhs_scale_k_major: bool = False,
    rhs_block_rows: int = 128,
    out_dtype=jnp.float32,
):
    """Block-FP8 lhs · rhsᵀ in `out_dtype` (float32 or bfloat16, rounded once in the
    epilogue): lhs (M, K) 1×128 blocks, rhs (N, K) 128×128 blocks with scales (N/128, K/128),
    or 1×128 blocks with scales (N, K/128) (``rhs_block_rows=1``: the wgrad of two
    token-direction copies); lhs_scale (M, K/128), or (K/128, M) with `lhs_scale_k_major` (the
    "tiles" layout)."""
    if not _is_fp8(lhs, rhs) or lhs.shape[1] % 128 or rhs.shape[0] % rhs_block_rows:
        return None
    return _pallas().dense_matmul_fp8_block(
        lhs,
        lhs_scale,
        rhs,
        rhs_scale,
        out_dtype=out_dtype,
        lhs_scale_k_major=lhs_scale_k_major,
        rhs_block_rows=rhs_block_rows,
    )
