"""Dispatch from jax_qtrain to the Pallas kernels in `pallas_kernels` (which never imports us).

`quantize` asks `quantize_kernel_applies` whether a kernel covers a spec and shape on the current
platform ("auto" backend) and calls `quantize` here to run it. A format with no kernel registered
in `_QUANTIZE_KERNELS` falls back to the jnp reference under "auto" and raises under "pallas".
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jax_qtrain.formats.spec import QuantizerSpec

# format name -> (applies(spec, shape2d, dtype) -> bool, run(x2d, spec, **kw) -> fields dict)
_QUANTIZE_KERNELS: dict[str, tuple[Callable[..., bool], Callable[..., dict]]] = {}


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def quantize_kernel_applies(spec: QuantizerSpec, shape2d: tuple[int, int], dtype) -> bool:
    """True when a Pallas kernel covers this spec and shape and we are on a GPU."""
    entry = _QUANTIZE_KERNELS.get(spec.format)
    return entry is not None and on_gpu() and entry[0](spec, shape2d, dtype)


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
