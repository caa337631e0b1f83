"""Names of the residuals our custom_vjp rules save, and `saved_residuals` to list them.

Every residual leaf is tagged with `jax.ad_checkpoint.checkpoint_name`, so remat and offload
policies can select them, e.g.
`jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names(INPUT))` or
`save_and_offload_only_these_names(names_which_can_be_saved=[KERNEL],
names_which_can_be_offloaded=[INPUT], offload_src="device", offload_dst="pinned_host")`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from jax._src import ad_checkpoint as _ad_checkpoint  # pinned jax==0.11.2

# What a layer's backward reads. A quantized residual's codes, scales and amaxes share its name.
INPUT = "qtrain/input"  # the layer input x: raw, or its quantized copy
KERNEL = "qtrain/kernel"  # the weight: raw, or its quantized copy
SR_KEY = "qtrain/sr_key"  # the key for stochastic rounding of the output gradient
GROUP_SIZES = "qtrain/group_sizes"  # rows per group of a grouped (MoE) op
# The fused grouped MLP (ops/grouped_mlp.py): FC1 -> activation x probs -> FC2.
FC1_INPUT = "qtrain/fc1_input"  # x: raw, or its quantized copy
FC1_KERNEL = "qtrain/fc1_kernel"
PRE_ACTIVATION = "qtrain/pre_activation"  # FC1's output h, in the compute dtype
PROBS = "qtrain/probs"  # the router probabilities that scale each row
FC2_INPUT = "qtrain/fc2_input"  # the activation's quantized copy (absent when recomputed)
FC2_KERNEL = "qtrain/fc2_kernel"
RESIDUAL_NAMES = (
    INPUT,
    KERNEL,
    SR_KEY,
    GROUP_SIZES,
    FC1_INPUT,
    FC1_KERNEL,
    PRE_ACTIVATION,
    PROBS,
    FC2_INPUT,
    FC2_KERNEL,
)


@dataclasses.dataclass(frozen=True)
class Residual:
    """One saved array: its checkpoint name (or where it came from), shape, dtype and bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int


_NAMED = re.compile(r"named '([^']+)'")


def saved_residuals(fn: Callable, *args, **kwargs) -> list[Residual]:
    """The arrays `jax.vjp(fn, *args)` keeps for the backward pass.

    Named residuals report their checkpoint name; anything else reports JAX's description (e.g.
    "from the argument x"). Useful to check what a layer really saves and how many bytes.
    """
    out = []
    for aval, source in _ad_checkpoint.saved_residuals(fn, *args, **kwargs):
        match = _NAMED.search(source)
        dtype = np.dtype(aval.dtype) if not hasattr(aval.dtype, "_rules") else aval.dtype
        itemsize = jnp.dtype(aval.dtype).itemsize if not hasattr(aval.dtype, "_rules") else 8
        shape = tuple(aval.shape)
        out.append(
            Residual(
                name=match.group(1) if match else source,
                shape=shape,
                dtype=dtype,
                nbytes=int(np.prod(shape, dtype=np.int64)) * itemsize,
            )
        )
    return out
