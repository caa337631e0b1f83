"""Dispatch from jax_qtrain to the Pallas kernels in `pallas_kernels` (which never imports us).

`quantize` asks `quantize_kernel_applies` whether a kernel covers a spec and shape on the current
platform ("auto" backend) and calls `quantize` here to run it. A format with no kernel registered
in `_QUANTIZE_KERNELS` falls back to the jnp reference under "auto" and raises under "pallas".
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jax_qtrain.formats import common
from jax_qtrain.formats.spec import QuantizerSpec

# format name -> (applies(spec, shape2d, dtype) -> bool, run(x2d, spec, **kw) -> fields dict)
_QUANTIZE_KERNELS: dict[str, tuple[Callable[..., bool], Callable[..., dict]]] = {}


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def quantize_kernel_applies(spec: QuantizerSpec, shape2d: tuple[int, int], dtype) -> bool:
    """True when a Pallas kernel covers this spec and shape and we are on a GPU."""
    entry = _QUANTIZE_KERNELS.get(spec.format)
    return entry is not None and on_gpu() and entry[0](spec, shape2d, dtype)


def tensor_amaxes(x2d: jax.Array, spec: QuantizerSpec, usages) -> dict:
    """Per-tensor amax of each requested copy, for formats that need one (FP8 current scaling,
    NVFP4's global scales; None for the block formats). NVFP4 gets both in one Pallas pass, the
    columnwise one after the Hadamard transform, instead of rotating xᵀ in jnp first."""
    if spec.format == "nvfp4":
        row_amax, col_amax = _pallas().nvfp4_amax(x2d, hadamard_columnwise=spec.hadamard_columnwise)
        return {u: row_amax if u == "rowwise" else col_amax for u in usages}
    if spec.format == "fp8":
        tensor_amax = common.amax(x2d)  # xᵀ has the same amax
        return {u: tensor_amax for u in usages}
    return {u: None for u in usages}


def quantize(
    x2d: jax.Array, spec: QuantizerSpec, *, input_dtype, amaxes: dict, seeds: dict
) -> dict:
    """Run the quantize kernel for `spec`; returns QuantizedTensor fields for the copies named
    in `amaxes` (keys "rowwise" / "columnwise"; values are the reduced per-tensor amaxes or None).
    """
    entry = _QUANTIZE_KERNELS.get(spec.format)
    if entry is None:
        raise NotImplementedError(
            f"backend='pallas': no Pallas quantize kernel for {spec.describe()} yet; "
            "use backend='reference' or 'auto'"
        )
    applies, run = entry
    if not applies(spec, tuple(x2d.shape), x2d.dtype):
        raise ValueError(
            f"backend='pallas': the {spec.format} kernel does not cover shape {tuple(x2d.shape)} "
            f"{x2d.dtype}; use backend='reference' or 'auto'"
        )
    return run(x2d, spec, input_dtype=input_dtype, amaxes=amaxes, seeds=seeds)


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


def _mxfp8_run(x2d, spec: QuantizerSpec, *, input_dtype, amaxes: dict, seeds: dict) -> dict:
    del input_dtype, seeds
    out = _pallas().quantize_mxfp8(
        x2d,
        rowwise="rowwise" in amaxes,
        columnwise="columnwise" in amaxes,
        fp8_dtype=spec.dtype,
    )
    return _copy_fields(out, amaxes, "scale")


def _nvfp4_applies(spec: QuantizerSpec, shape2d, dtype) -> bool:
    # 16×16 weight blocks have no kernel yet: the reference handles them.
    return _kernel_input(dtype) and spec.block_shape == (1, 16)


def _nvfp4_run(x2d, spec: QuantizerSpec, *, input_dtype, amaxes: dict, seeds: dict) -> dict:
    del input_dtype
    out = _pallas().quantize_nvfp4(
        x2d,
        rowwise="rowwise" in amaxes,
        columnwise="columnwise" in amaxes,
        rowwise_amax=amaxes.get("rowwise"),
        columnwise_amax=amaxes.get("columnwise"),
        hadamard_columnwise=spec.hadamard_columnwise,
        stochastic_rounding=spec.stochastic_rounding,
        rowwise_seed=seeds.get("rowwise"),
        columnwise_seed=seeds.get("columnwise"),
    )
    return _copy_fields(out, amaxes, "scale", global_amax=True)


def _fp8_block_applies(spec: QuantizerSpec, shape2d, dtype) -> bool:
    return _kernel_input(dtype) and spec.block_shape in ((1, 128), (128, 128))


def _fp8_block_run(x2d, spec: QuantizerSpec, *, input_dtype, amaxes: dict, seeds: dict) -> dict:
    del seeds
    out = _pallas().quantize_fp8_block(
        x2d,
        block_shape=spec.block_shape,
        rowwise="rowwise" in amaxes,
        columnwise="columnwise" in amaxes,
        fp8_dtype=spec.dtype,
        power_2_scale=spec.power_2_scale,
        amax_epsilon=spec.amax_epsilon,
        input_dtype=input_dtype,
    )
    return _copy_fields(out, amaxes, "scale_inv")


_QUANTIZE_KERNELS.update(
    {
        "mxfp8": (_mxfp8_applies, _mxfp8_run),
        "nvfp4": (_nvfp4_applies, _nvfp4_run),
        "fp8_block": (_fp8_block_applies, _fp8_block_run),
    }
)
