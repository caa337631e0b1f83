"""A quantized dense layer whose kernel is split over a mesh axis (FSDP).

`fsdp_dense` runs inside `jax.shard_map` on one device's batch rows and kernel shard; `dense`
wraps it in the shard_map for global arrays. Per device:

  forward   gather the kernel's fprop copy (strategy: quantized shards, or raw shards then
            quantize), y = x · W (+ bias). Saved for backward: the same input residual as
            `jax_qtrain.dense`, and this device's *shard* of the kernel, never the gathered one.
  backward  re-gather the copy backward reads (the dgrad copy in the default mode, the raw kernel
            under "high_precision", the fprop copy under "dequantized"), dx = dy · Wᵀ, the
            weight gradient xᵀ · dy of the local rows in float32, reduce-scattered over the
            kernel's axis (and summed over the other batch axes) to the shard layout.

Everything else is `jax_qtrain.dense` (ops/dense.py, docs/overrides.md): the same recipes,
backward overrides, named residuals and GEMMs. The sharded layer computes what the unsharded one
computes on the whole batch: per-tensor amaxes of x and dy are max-reduced over the batch axes,
NVFP4's stochastic rounding of dy draws the bits of each row's global position from a key that
is the same on every device, and the bias gradient is summed over the batch axes. What can
differ is float32 summation order: the weight and bias gradients are sums over the batch, formed
per device and then reduced (tests use data on which every such sum is exact). With
`deterministic` the cross-device additions run in mesh order (reductions.py), so they no longer
depend on the collective implementation or the process layout.

Equality with the unsharded layer also needs each device's rows to be whole blocks of the
activation copies that are blocked along the tokens (x's and dy's columnwise copies: 128 rows
for FP8 block 1×128, 32 for MXFP8, 16 for NVFP4); otherwise blocks end at the device boundary,
as they do in TransformerEngine's data parallelism.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jax_qtrain.formats import common
from jax_qtrain.ops import residuals as names
from jax_qtrain.ops.context import resolve_recipe
from jax_qtrain.ops.dense import (
    _high_precision_dot,
    check_quantized_kernel_recipe,
    effective_save_original_input,
    rounded_once,
)
from jax_qtrain.ops.gemm import fprop_gemm, matmul_nt
from jax_qtrain.quantize import QuantizedTensor, quantize
from jax_qtrain.quantized_weight import QuantizedWeight, check_training_usages
from jax_qtrain.recipes import Recipe

from . import reductions
from .config import (
    DEFAULT_STRATEGY,
    GATHER_THEN_QUANTIZE,
    Strategy,
    WeightSharding,
    check_kernel_dim,
    check_strategy,
    laid_out,
    normalize_axes,
)
from .gather import Split
from .kept_weight import SplitKernelLayout

_NN = (((1,), (0,)), ((), ()))  # a (m, c), b (c, n) -> (m, n)
_NT = (((1,), (1,)), ((), ()))  # a (m, c), b (n, c) -> (m, n)
_TN = (((0,), (0,)), ((), ()))  # a (c, m), b (c, n) -> (m, n)


@dataclasses.dataclass(frozen=True)
class _FsdpDenseConfig:
    """Static configuration of one call (hashable: a nondiff argument of the custom_vjp)."""

    recipe: Recipe | None  # None: unquantized
    save_original_input: bool  # after the override forced it
    strategy: Strategy
    axis_name: str
    kernel_dim: int
    batch_axis_names: tuple[str, ...]
    in_features: int  # of the whole kernel
    deterministic: bool  # sum cross-device float partials in mesh order (reductions.py)
    x_dtype: np.dtype
    kernel_dtype: np.dtype
    bias_dtype: np.dtype | None
    out_dtype: np.dtype
    has_kernel: bool = True  # False: only kept quantized shards, no kernel gradient

    @property
    def mode(self) -> str | None:
        return None if self.recipe is None else self.recipe.backward_override

    @property
    def quantize_then_gather(self) -> bool:
        return self.strategy != GATHER_THEN_QUANTIZE

    @property
    def split(self) -> Split:
        return Split(self.axis_name, self.kernel_dim)

    def whole_kernel(self, kernel_shard: jax.Array) -> jax.Array:
        return self.split.gather_raw(kernel_shard)

    def gather(self, q_shard: QuantizedTensor) -> QuantizedTensor:
        return self.split.gather_quantized(q_shard)

    def row_offset(self, rows: int) -> jax.Array:
        """Index of this device's first row in the whole batch (the batch axes split rows in
        order, the first axis outermost, as PartitionSpec((a, b)) does)."""
        return lax.axis_index(self.batch_axis_names) * rows


def saved_input_operand(x, qx, mode: str | None, save_original_input: bool):
    """The input operand a layer's backward reads (te_semantics §1): x's quantized columnwise
    copy (mode None), the raw x (mode None with save_original_input, and "high_precision"), or
    the rowwise copy the forward GEMM read ("dequantized")."""
    if mode is None:
        return x if save_original_input else qx.restrict_to("columnwise")
    if mode == "high_precision":
        return x
    return qx.restrict_to("rowwise")


def _stochastic_rounding_key(key: jax.Array | None, dy: jax.Array, config) -> jax.Array:
    """`ops/dense.py::stochastic_rounding_key` for the whole batch's dy: without a key, the
    seed is the wrapping uint32 sum of a hash of every element of dy, which is the psum of the
    per-device sums (integer addition is associative, so this is exact)."""
    if key is not None:
        return key
    bits = lax.bitcast_convert_type(dy.astype(jnp.float32), jnp.uint32)
    local = jnp.sum(bits * jnp.uint32(0x9E3779B1) + jnp.uint32(0x7F4A7C15), dtype=jnp.uint32)
    return jax.random.key(lax.psum(local, config.batch_axis_names))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fsdp_dense(x2d, kernel_shard, bias, key, kept_shard, config: _FsdpDenseConfig):
    y, _ = _fsdp_dense_fwd(x2d, kernel_shard, bias, key, kept_shard, config)
    return y


def _fsdp_dense_fwd(x2d, kernel_shard, bias, key, kept_shard, config: _FsdpDenseConfig):
    """Forward. `kept_shard`: this device's shard of a kept quantized kernel (kept_weight.py),
    read instead of quantizing `kernel_shard` (which may then be None: no kernel gradient).

    Residuals: (saved_input, saved_kernel, key), named as `jax_qtrain.dense` names them, all of
    this device's size:

    - saved_input (INPUT): exactly what `jax_qtrain.dense` saves for these rows (the quantized
      columnwise copy, the raw x2d, or the forward's rowwise copy), or the raw x2d unquantized;
      None without a kernel to differentiate (only wgrad reads x);
    - saved_kernel (KERNEL): this device's kernel shard, never the gathered kernel: the raw
      shard (gather_then_quantize, "high_precision", unquantized), or with
      quantize_then_gather the quantized shard of the copy backward gathers (rowwise in the
      default mode, columnwise under "dequantized"), a view of `kept_shard` if given;
    - key (SR_KEY): the caller's stochastic-rounding key, or None.
    """
    rows = x2d.shape[0]
    if config.recipe is None:
        kernel = config.whole_kernel(kernel_shard)
        y = rounded_once(
            lambda dtype: _high_precision_dot(x2d, kernel, _NN, dtype), bias, config.out_dtype
        )
        saved_input, saved_kernel = x2d, kernel_shard
    else:
        recipe, mode = config.recipe, config.mode
        keep_x_columnwise = mode is None and not config.save_original_input and config.has_kernel
        qx = quantize(
            x2d,
            recipe,
            "input",
            rowwise=True,
            columnwise=keep_x_columnwise,
            amax_axis_name=config.batch_axis_names,
        )
        if config.quantize_then_gather:
            q_shard = kept_shard
            if q_shard is None:
                q_shard = config.split.quantize_shard(
                    kernel_shard, recipe, rowwise=mode is None, columnwise=True
                )
            qw = config.gather(q_shard.restrict_to("columnwise"))
            saved_kernel = {
                None: lambda: q_shard.restrict_to("rowwise"),
                "high_precision": lambda: kernel_shard,
                "dequantized": lambda: q_shard.restrict_to("columnwise"),
            }[mode]()
        else:
            kernel = config.whole_kernel(kernel_shard)
            qw = quantize(kernel, recipe, "weight", rowwise=False, columnwise=True)
            saved_kernel = kernel_shard  # backward re-gathers and re-quantizes
        y = rounded_once(
            lambda dtype: fprop_gemm(qx, qw, recipe, rows=rows, cols=qw.shape[1], out_dtype=dtype),
            bias,
            config.out_dtype,
        )
        saved_input = None  # without a kernel to differentiate: only wgrad reads x
        if config.has_kernel:
            saved_input = saved_input_operand(x2d, qx, mode, config.save_original_input)
    residuals = (
        checkpoint_name(saved_input, names.INPUT),
        checkpoint_name(saved_kernel, names.KERNEL),
        None if key is None else checkpoint_name(key, names.SR_KEY),
    )
    return y, residuals


def _backward_kernel_copy(saved_kernel, usage: str, config: _FsdpDenseConfig) -> QuantizedTensor:
    """The whole kernel's quantized `usage` copy, gathered again in backward."""
    if config.quantize_then_gather:
        return config.gather(saved_kernel)
    kernel = config.whole_kernel(saved_kernel)
    return quantize(
        kernel,
        config.recipe,
        "weight",
        rowwise=usage == "rowwise",
        columnwise=usage == "columnwise",
    )


def _fsdp_dense_bwd(config: _FsdpDenseConfig, residuals, dy):
    saved_input, saved_kernel, key = residuals
    recipe, mode = config.recipe, config.mode
    rows, out_features = dy.shape

    if recipe is not None and mode is None:
        spec = recipe.spec("grad")
        qdy = quantize(
            dy,
            recipe,
            "grad",
            rowwise=True,
            columnwise=True,
            key=_stochastic_rounding_key(key, dy, config) if spec.stochastic_rounding else None,
            amax_axis_name=config.batch_axis_names,
            position_offset=(config.row_offset(rows), 0) if spec.stochastic_rounding else None,
        )
        qw = _backward_kernel_copy(saved_kernel, "rowwise", config)
        dx = matmul_nt(
            qdy,
            "rowwise",
            qw,
            "rowwise",
            rows=rows,
            cols=config.in_features,
            out_dtype=config.x_dtype,
        )
        dw_partial = None
        if config.has_kernel:
            qx = saved_input
            if not isinstance(qx, QuantizedTensor):  # save_original_input: re-quantize
                qx = quantize(
                    qx,
                    recipe,
                    "input",
                    rowwise=False,
                    columnwise=True,
                    amax_axis_name=config.batch_axis_names,
                )
            dw_partial = matmul_nt(
                qx, "columnwise", qdy, "columnwise", rows=config.in_features, cols=out_features
            )
    else:  # unquantized, "high_precision" or "dequantized": GEMMs in the compute dtype
        compute_dtype = jnp.promote_types(config.x_dtype, config.kernel_dtype)
        if mode == "dequantized":
            qw = _backward_kernel_copy(saved_kernel, "columnwise", config)
            kernel_values = qw.dequantize("columnwise", compute_dtype)
        else:
            kernel_values = config.whole_kernel(saved_kernel)
        dy_c = dy.astype(compute_dtype)
        dx = _high_precision_dot(dy_c, kernel_values, _NT, config.x_dtype)
        dw_partial = None
        if config.has_kernel:
            x_values = saved_input
            if mode == "dequantized":
                x_values = saved_input.dequantize("rowwise", compute_dtype)
            dw_partial = _high_precision_dot(x_values, dy_c, _TN, jnp.float32)

    # float32 partial sums over this device's rows → the shard of the sum over all rows.
    deterministic = config.deterministic
    dw = None
    if dw_partial is not None:
        dw = reductions.psum_scatter(
            dw_partial,
            config.axis_name,
            scatter_dimension=config.kernel_dim,
            deterministic=deterministic,
        )
        other_batch_axes = tuple(a for a in config.batch_axis_names if a != config.axis_name)
        dw = reductions.psum(dw, other_batch_axes, deterministic=deterministic).astype(
            config.kernel_dtype
        )
    dbias = None
    if config.bias_dtype is not None:
        dbias = reductions.psum(
            jnp.sum(dy.astype(jnp.float32), axis=0),
            config.batch_axis_names,
            deterministic=deterministic,
        )
        dbias = dbias.astype(config.bias_dtype)
    return dx.astype(config.x_dtype), dw, dbias, None, None


_fsdp_dense.defvjp(_fsdp_dense_fwd, _fsdp_dense_bwd)


# --- argument checks ---------------------------------------------------------------------------
def _check_array(name: str, value) -> None:
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(value).__name__}")
    if jnp.dtype(value.dtype) not in common.SUPPORTED_INPUT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {value.dtype}")


def bound_axis_size(axis_name: str, argument: str, caller: str = "fsdp_dense") -> int:
    """The size of a mesh axis bound by an enclosing shard_map, or a ValueError naming `argument`
    and telling to call `caller` inside one."""
    try:
        return int(lax.axis_size(axis_name))
    except NameError:
        raise ValueError(
            f"{argument}: axis {axis_name!r} is not bound here; call {caller} inside "
            "jax.shard_map over a mesh with that axis (jax_qtrain.sharding.dense and the Sharded "
            "layers take global arrays)"
        ) from None


def _check_shapes(x, kernel_shard, bias, kernel_dim: int, axis_size: int) -> tuple[int, int]:
    """(in_features, out_features) of the whole kernel, after checking every shape.
    `kernel_shard` may be a kept quantized shard (a QuantizedTensor)."""
    _check_array("x", x)
    if not isinstance(kernel_shard, QuantizedTensor):
        _check_array("kernel_shard", kernel_shard)
    if x.ndim < 1:
        raise ValueError("x must have at least one dimension (..., in_features)")
    if len(kernel_shard.shape) != 2:
        raise ValueError(
            f"kernel_shard must have rank 2 (a shard of the (in_features, out_features) kernel), "
            f"got shape {tuple(kernel_shard.shape)}"
        )
    whole = list(kernel_shard.shape)
    whole[kernel_dim] *= axis_size
    in_features, out_features = whole
    if x.shape[-1] != in_features:
        raise ValueError(
            f"x's last dim ({x.shape[-1]}) must equal the whole kernel's in_features "
            f"({in_features} = kernel_shard {tuple(kernel_shard.shape)} with dim {kernel_dim} "
            f"times {axis_size} shards)"
        )
    if bias is not None:
        _check_array("bias", bias)
        if tuple(bias.shape) != (out_features,):
            raise ValueError(
                f"bias must have the whole kernel's shape ({out_features},) (it is replicated), "
                f"got {tuple(bias.shape)}"
            )
    return in_features, out_features


def check_kept_shard(
    kept,
    kernel_shard,
    recipe: Recipe | None,
    strategy: Strategy,
    *,
    argument: str = "quantized_kernel_shard",
    kernel_argument: str = "kernel_shard",
) -> None:
    """A kept quantized shard (`argument`) against the op's recipe, strategy and kernel shard;
    for a (G, K, N) stack of experts the kept tensor has one expert's (K, N) shape and leaves
    with a leading G axis."""
    if not isinstance(kept, QuantizedTensor):
        raise TypeError(
            f"{argument} must be a QuantizedTensor (this device's shard of a kept "
            f"QuantizedWeight), got {type(kept).__name__}"
        )
    check_quantized_kernel_recipe(
        kept, recipe, kernel_shard, argument=argument, kernel_argument=kernel_argument
    )
    if strategy == GATHER_THEN_QUANTIZE:
        raise ValueError(
            f"{argument}: a kept quantized shard is gathered as it is; it needs "
            "strategy='quantize_then_gather'"
        )
    if kernel_shard is not None:
        stacked = len(kernel_shard.shape) == 3
        kernel_shape = tuple(kernel_shard.shape[1:] if stacked else kernel_shard.shape)
        leading = {leaf.shape[0] for leaf in jax.tree.leaves(kept)} if stacked else set()
        if (
            kernel_shape != kept.shape
            or jnp.dtype(kernel_shard.dtype) != kept.dtype
            or leading - {kernel_shard.shape[0]}
        ):
            raise ValueError(
                f"{argument} must quantize {kernel_argument}: it has shape {kept.shape} and "
                f"dtype {kept.dtype}{' per expert' if stacked else ''}, {kernel_argument} "
                f"{tuple(kernel_shard.shape)} {kernel_shard.dtype}"
            )
    check_training_usages(kept, recipe, argument=argument)


def fsdp_dense(
    x: jax.Array,
    kernel_shard: jax.Array,
    bias: jax.Array | None = None,
    *,
    axis_name: str,
    kernel_dim: int = 0,
    batch_axis_names: str | tuple[str, ...] | None = None,
    strategy: Strategy = DEFAULT_STRATEGY,
    recipe: Recipe | None = None,
    save_original_input: bool = False,
    key: jax.Array | None = None,
    deterministic: bool = False,
    quantized_kernel_shard: QuantizedTensor | None = None,
) -> jax.Array:
    """`jax_qtrain.dense` on one device, inside `jax.shard_map`, with a split kernel.

    Args:
      x: this device's rows, (..., in_features).
      kernel_shard: this device's shard of the (in_features, out_features) kernel, split along
        `kernel_dim` over mesh axis `axis_name`. May be None with `quantized_kernel_shard` (no
        kernel gradient then).
      bias: the whole (out_features,) bias, replicated.
      axis_name: the mesh axis the kernel is split over.
      kernel_dim: 0 (in_features split) or 1 (out_features split).
      batch_axis_names: the mesh axes that split the rows of x (default: `axis_name`); must
        include `axis_name`.
      strategy: "quantize_then_gather" (default) or "gather_then_quantize" (config.py).
      recipe, save_original_input, key: as `jax_qtrain.dense` (the same key on every device).
      deterministic: see `WeightSharding`.
      quantized_kernel_shard: this device's shard of a kept quantized kernel (the leaves of a
        `QuantizedWeight` made with `SplitKernelLayout`, as `jax_qtrain.sharding.dense` passes
        them): the forward gathers it instead of quantizing `kernel_shard`. Needs `recipe`, the
        recipe it was quantized with, and strategy "quantize_then_gather".

    Returns: this device's rows of y, (..., out_features).
    """
    check_kernel_dim(kernel_dim)
    check_strategy(strategy)
    if not isinstance(axis_name, str):
        raise TypeError(f"axis_name must be a mesh axis name, got {axis_name!r}")
    batch_axis_names = normalize_axes(
        axis_name if batch_axis_names is None else batch_axis_names, "batch_axis_names"
    )
    if axis_name not in batch_axis_names:
        raise ValueError(
            f"batch_axis_names {batch_axis_names} must include axis_name {axis_name!r}: the "
            "kernel gradient is reduce-scattered over the axis that splits the batch"
        )
    axis_size = bound_axis_size(axis_name, "axis_name")
    for name in batch_axis_names:
        bound_axis_size(name, "batch_axis_names")
    if kernel_shard is None and quantized_kernel_shard is None:
        raise TypeError("kernel_shard must be an array (None only with quantized_kernel_shard)")
    in_features, out_features = _check_shapes(
        x,
        kernel_shard if kernel_shard is not None else quantized_kernel_shard,
        bias,
        kernel_dim,
        axis_size,
    )
    if not isinstance(save_original_input, bool):
        raise TypeError(f"save_original_input must be a bool, got {save_original_input!r}")
    recipe = resolve_recipe(recipe)
    if quantized_kernel_shard is not None:
        check_kept_shard(quantized_kernel_shard, kernel_shard, recipe, strategy)
    kernel_dtype = (kernel_shard if kernel_shard is not None else quantized_kernel_shard).dtype
    config = _FsdpDenseConfig(
        recipe=recipe,
        save_original_input=(
            False if recipe is None else effective_save_original_input(recipe, save_original_input)
        ),
        strategy=strategy,
        axis_name=axis_name,
        kernel_dim=kernel_dim,
        batch_axis_names=batch_axis_names,
        in_features=in_features,
        deterministic=bool(deterministic),
        x_dtype=jnp.dtype(x.dtype),
        kernel_dtype=jnp.dtype(kernel_dtype),
        bias_dtype=None if bias is None else jnp.dtype(bias.dtype),
        out_dtype=jnp.promote_types(x.dtype, kernel_dtype),
        has_kernel=kernel_shard is not None,
    )
    y2d = _fsdp_dense(
        x.reshape(-1, x.shape[-1]), kernel_shard, bias, key, quantized_kernel_shard, config
    )
    return y2d.reshape(*x.shape[:-1], out_features)


def dense(
    x: jax.Array,
    kernel: jax.Array | None,
    bias: jax.Array | None = None,
    *,
    sharding: WeightSharding,
    recipe: Recipe | None = None,
    save_original_input: bool = False,
    key: jax.Array | None = None,
    quantized_kernel: QuantizedWeight | None = None,
) -> jax.Array:
    """`jax_qtrain.dense` with `kernel` split over `sharding.axis` and x's batch over
    `sharding.batch_axes`: a `jax.shard_map` around `fsdp_dense`. Call it on global arrays,
    under `jax.jit`; arrays not already laid out that way are resharded.

    Args:
      x: (batch, ..., in_features); batch a multiple of the product of the batch axes' sizes.
      kernel: (in_features, out_features), its `sharding.kernel_dim` a multiple of the axis size.
        May be None with `quantized_kernel` (no kernel gradient then).
      bias: optional (out_features,), replicated.
      sharding: a `WeightSharding`.
      recipe, save_original_input, key: as `jax_qtrain.dense`.
      quantized_kernel: the kernel kept quantized and split
        (`quantize_weight(kernel, recipe, layout=SplitKernelLayout(sharding))`, what
        `ShardedLinear(quantized_weight=True)` keeps): each device gathers its shard's bytes
        instead of quantizing the kernel (sharding/kept_weight.py).
    """
    if not isinstance(sharding, WeightSharding):
        raise TypeError(f"sharding must be a WeightSharding, got {type(sharding).__name__}")
    check_kernel_dim(sharding.kernel_dim)  # "experts" splits grouped layers only
    kept = _kept_operands(quantized_kernel, kernel, sharding)
    if kernel is None and quantized_kernel is None:
        raise TypeError("kernel must be an array (None only together with quantized_kernel)")
    # Shape checks read the kernel, or the kept weight standing in for it.
    kernel_like = kernel if kernel is not None else quantized_kernel
    _check_array("x", x)
    if kernel is not None:
        _check_array("kernel", kernel)
    if x.ndim < 2:
        raise ValueError(
            f"x must have a batch dim to split: (batch, ..., in_features), got shape "
            f"{tuple(x.shape)}"
        )
    if len(kernel_like.shape) != 2:
        raise ValueError(
            f"kernel must have shape (in_features, out_features), got {tuple(kernel_like.shape)}"
        )
    if x.shape[0] % sharding.batch_size_divisor:
        raise ValueError(
            f"x's batch dim ({x.shape[0]}) must be a multiple of {sharding.batch_size_divisor}, "
            f"the number of shards of batch_axes {sharding.batch_axes}"
        )
    if kernel_like.shape[sharding.kernel_dim] % sharding.axis_size:
        raise ValueError(
            f"kernel {tuple(kernel_like.shape)}: dim {sharding.kernel_dim} must be a multiple of "
            f"{sharding.axis_size}, the size of mesh axis {sharding.axis!r}"
        )
    recipe = resolve_recipe(recipe)
    per_device = functools.partial(
        fsdp_dense,
        axis_name=sharding.axis,
        kernel_dim=sharding.kernel_dim,
        batch_axis_names=sharding.batch_axes,
        strategy=sharding.strategy,
        recipe=recipe,
        save_original_input=save_original_input,
        deterministic=sharding.deterministic,
    )
    replicated = jax.sharding.PartitionSpec()
    operands = {
        "x": x,
        "kernel_shard": kernel,
        "bias": bias,
        "key": key,
    }
    specs = {
        "x": sharding.batch_spec(),
        "kernel_shard": sharding.kernel_spec(),
        "bias": replicated,
        "key": replicated,
    }
    given = [name for name, value in operands.items() if value is not None]
    kept_leaves, kept_specs = ({}, {}) if kept is None else kept[1].operands(kept[0])

    def body(kept_leaves, *arrays):
        kept_shard = None if kept is None else kept[1].local(kept[0], kept_leaves)
        named = {"kernel_shard": None, **dict(zip(given, arrays, strict=True))}
        return per_device(**named, quantized_kernel_shard=kept_shard)

    return jax.shard_map(
        body,
        mesh=sharding.mesh,
        in_specs=(kept_specs, *(specs[name] for name in given)),
        out_specs=sharding.batch_spec(),
    )(
        {
            name: laid_out(leaf, kept_specs[name], sharding.mesh)
            for name, leaf in kept_leaves.items()
        },
        *(laid_out(operands[name], specs[name], sharding.mesh) for name in given),
    )


def _kept_operands(quantized_kernel, kernel, sharding: WeightSharding):
    """(the kept tensor, its SplitKernelLayout) of a `quantized_kernel` argument, or None,
    after checking it was kept split as `sharding` splits the kernel."""
    if quantized_kernel is None:
        return None
    if not isinstance(quantized_kernel, QuantizedWeight):
        raise TypeError(
            f"quantized_kernel must be a QuantizedWeight (jax_qtrain.quantize_weight with "
            f"layout=SplitKernelLayout(sharding)), got {type(quantized_kernel).__name__}"
        )
    layout = SplitKernelLayout(sharding)
    if quantized_kernel.layout != layout:
        held = quantized_kernel.layout
        raise ValueError(
            f"quantized_kernel must be kept split as sharding splits the kernel "
            f"({layout.describe()}), but it is "
            f"{'not split' if held is None else held.describe()}: make it with "
            "quantize_weight(kernel, recipe, layout=SplitKernelLayout(sharding))"
        )
    if kernel is not None and (
        tuple(kernel.shape) != quantized_kernel.shape
        or jnp.dtype(kernel.dtype) != quantized_kernel.dtype
    ):
        raise ValueError(
            f"quantized_kernel must be the quantization of kernel: it has shape "
            f"{quantized_kernel.shape} and dtype {quantized_kernel.dtype}, kernel "
            f"{tuple(kernel.shape)} {kernel.dtype}"
        )
    return quantized_kernel.tensor, layout
