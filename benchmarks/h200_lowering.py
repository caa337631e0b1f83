"""Our kernels lowered for an H200 on any host (the CPU machines have no GPU).

`jax.export` lowers a call for the "cuda" platform under an abstract one-device mesh of an
H200, so Mosaic GPU builds each kernel's module as it would on the device: layout and
shared-memory errors show up here, and the module text can be read (wgmma shapes, op counts).
What runs after that on the device (Mosaic GPU's passes to PTX, ptxas) does not:
benchmarks/kernel_resources.py and benchmarks/ptxas_wgmma_budget.py cover those.
"""

from __future__ import annotations

import jax
from jax._src import mesh as mesh_lib
from jax.experimental.mosaic.gpu import core as mgpu_core

_CAPTURED: list[str] = []


def export_for_h200(fn, *avals: jax.ShapeDtypeStruct) -> jax.export.Exported:
    """`jax.jit(fn)` exported for one H200 at `avals` (shapes and dtypes)."""
    device = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.export.export(jax.jit(fn), platforms=["cuda"])(*avals)


def _install_capture() -> None:
    """Records each Mosaic GPU module as it is serialized into its custom call."""
    original = mgpu_core._run_serde_pass
    if getattr(original, "_captures", False):
        return

    def capture(module, *, serialize, ir_version=None):
        if serialize:
            _CAPTURED.append(str(module))
        return original(module, serialize=serialize, ir_version=ir_version)

    capture._captures = True
    mgpu_core._run_serde_pass = capture


def mosaic_modules(fn, *avals: jax.ShapeDtypeStruct) -> list[str]:
    """The Mosaic GPU module texts of the kernels `fn` launches, lowered for an H200 (as Mosaic
    GPU serializes them, before the device-side passes and ptxas)."""
    _install_capture()
    _CAPTURED.clear()
    jax.clear_caches()  # a cached lowering would not reach the capture
    export_for_h200(fn, *avals)
    return list(_CAPTURED)
