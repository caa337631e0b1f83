"""Shared pieces of the sharding tests: meshes, exact-arithmetic data, bitwise comparison.

Why the data are integers: a sharded layer sums the weight and bias gradients per device and
then across devices, so float32 rounding may differ from the unsharded sum in the last bit. On
data whose every partial sum is exact, any bit that differs is a real bug (a wrong amax scope, a
block split across devices, a gather or scatter in the wrong order, stochastic rounding reading
the wrong position). The recipe-specific amax puts the per-tensor scales on powers of two, so the
dequantized operands are small integers (times a power of two) and all sums are exact; and the
amax occurs on **one** device only, so a device that used its local amax would get another scale
and different codes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_qtrain as jq

from .gpu_compare import bits

RECIPES = {
    "fp8": jq.Float8CurrentScaling(),
    "fp8_block": jq.Float8BlockScaling(),
    "mxfp8": jq.MXFP8BlockScaling(),
    "nvfp4": jq.NVFP4BlockScaling(),
}
MODES = (None, "high_precision", "dequantized")

# The whole tensors' amax per recipe: 448/14 = 32, 57344/14 = 4096 (FP8 current scaling) and
# 2688/21 = 128, 2688/84 = 32 (NVFP4 global scales; 84 = 4·21 is the amax after the Hadamard
# transform of the spike below) are powers of two.
_AMAX = {"fp8": 14, "fp8_block": 14, "mxfp8": 14, "nvfp4": 21, None: 14}
# TransformerEngine's Hadamard sign vector: a token chunk 21·s rotates to (84, 0, ..., 0).
_RHT_SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], np.float32)


def mesh_1d(size: int = 8):
    return jax.make_mesh((size,), ("fsdp",), axis_types=(AxisType.Auto,))


def mesh_2d():
    """data × fsdp = 2 × 4: the batch over both, the weight over fsdp."""
    return jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)


def integer_tensor(
    rng: np.random.Generator, shape, amax: int, *, spike_column: int | None = None
) -> np.ndarray:
    """Integers in [-(amax-1), amax-1], with the value `amax` only at element [0, ..., 0] (or,
    with `spike_column`, only in rows 0..15 of that column, as amax·s: a token chunk whose
    Hadamard rotation is 4·amax)."""
    values = rng.integers(-(amax - 1), amax, size=shape).astype(np.float32)
    if spike_column is None:
        values.flat[0] = amax
    else:
        flat = values.reshape(-1, shape[-1])
        flat[:16, spike_column] = amax * _RHT_SIGNS
    return values


def layer_data(recipe_name, x_shape, out_features, dtype=jnp.bfloat16, seed=0):
    """x, kernel, bias, dy for one layer (module docstring)."""
    amax = _AMAX[recipe_name]
    spike = 0 if recipe_name == "nvfp4" else None
    rng = np.random.default_rng(seed)
    in_features = x_shape[-1]
    x = integer_tensor(rng, x_shape, amax, spike_column=spike)
    kernel = integer_tensor(rng, (in_features, out_features), amax) / 16
    bias = integer_tensor(rng, (out_features,), amax)
    dy = integer_tensor(rng, (*x_shape[:-1], out_features), amax, spike_column=spike)
    return tuple(jnp.asarray(t, dtype) for t in (x, kernel, bias, dy))


def assert_bits_equal(actual, expected, what="") -> None:
    for i, (u, v) in enumerate(zip(actual, expected, strict=True)):
        if u is None and v is None:
            continue
        assert u.dtype == v.dtype and u.shape == v.shape, (what, i, u.dtype, v.dtype)
        np.testing.assert_array_equal(bits(u), bits(v), err_msg=f"{what} output {i}")


def value_and_grads(layer_fn, x, kernel, bias, dy):
    """(y, dx, dkernel, dbias) of `layer_fn(x, kernel, bias)` through jax.vjp, jitted."""

    @jax.jit
    def run(x, kernel, bias, dy):
        y, vjp = jax.vjp(layer_fn, x, kernel, bias)
        return (y, *vjp(dy))

    return run(x, kernel, bias, dy)


def module_value_and_grads(model, x, dy):
    """(y, dparams, dx) of an NNX module applied to x, through jax.vjp with cotangent dy, jitted."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def run(params, rest, x, dy):
        y, vjp = jax.vjp(lambda p, x: nnx.merge(graphdef, p, rest, copy=True)(x), params, x)
        return y, *vjp(dy)

    return run(params, rest, x, dy)


def replicate_uncommitted(graph, mesh) -> None:
    """Replicate on `mesh` the arrays of an NNX graph's state that live uncommitted on one device
    (sown MoE statistics, an optimizer's step count), as a jitted step over its sharded
    parameters returns them. Otherwise the step's second call sees other input shardings and
    compiles it all again (seconds per sharded training step on the CPU); the values, and so
    every result, are the same."""
    replicated = NamedSharding(mesh, P())

    def put(a):
        if a.committed:
            return a
        value = np.asarray(a)  # the same in every process: this also works on a multi-process mesh
        return jax.make_array_from_callback(a.shape, replicated, lambda index: value[index])

    nnx.update(graph, jax.tree.map(put, nnx.state(graph)))


def quantized_leaf_shapes(shape, recipe, role, usage) -> list[tuple[tuple[int, ...], np.dtype]]:
    """(shape, dtype) of each leaf of `shape`'s quantized `usage` copy, as quantize orders them."""
    q = jax.eval_shape(
        lambda a: jq.quantize(
            a, recipe, role, rowwise=usage == "rowwise", columnwise=usage == "columnwise"
        ),
        jax.ShapeDtypeStruct(shape, jnp.bfloat16),
    )
    return [(tuple(leaf.shape), jnp.dtype(leaf.dtype)) for leaf in jax.tree.leaves(q)]


def kernel_shapes(shape, recipe) -> set[tuple[int, ...]]:
    """Every 2-D shape a (K, N) kernel or one of its quantized copies has: what a gathered
    kernel saved for backward would look like."""
    shapes = {tuple(shape), tuple(shape)[::-1]}
    if recipe is not None:
        for usage in ("rowwise", "columnwise"):
            shapes |= {s for s, _ in quantized_leaf_shapes(shape, recipe, "weight", usage) if s}
    return shapes
