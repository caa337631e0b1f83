"""`dense`: a quantized linear op whose custom_vjp saves what TransformerEngine's Linear saves.

y = x @ kernel (+ bias), x of shape (..., K), kernel (K, N). What backward reads depends on the
recipe's `backward_override` (../shared/reference/te_semantics.md §1):

  None (default)    saves x's columnwise quantized copy only (or, with save_original_input, the
                    raw x, re-quantized in backward) and the kernel's rowwise quantized copy;
                    dy is quantized (E5M2 with HYBRID) and both backward GEMMs are quantized.
  "high_precision"  forces save_original_input=True: saves the raw x and the raw kernel; the
                    backward GEMMs run in the compute dtype on the raw dy.
  "dequantized"     forces save_original_input=False: saves the forward-quantized operands (x's
                    rowwise copy only, the kernel's columnwise copy), dequantizes them in
                    backward and runs the GEMMs in the compute dtype on the raw dy.

Under an override the forward quantizes only what it reads (x rowwise, the kernel columnwise).
The bias gradient is always the sum of the raw dy.

Pre-quantized kernels (`quantized_kernel=`, docs/quantized_weights.md): the op reads the given
copies instead of quantizing the kernel, and checks they are the ones it needs — the columnwise
copy for fprop and, when differentiated in the default mode, the rowwise copy for dgrad. The
gradient still flows to the high-precision `kernel`; with `kernel=None` (a weight kept only in
quantized form) the op gives no kernel gradient and skips the wgrad GEMM.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jax_qtrain.formats import common
from jax_qtrain.ops import residuals as names
from jax_qtrain.ops.context import resolve_recipe
from jax_qtrain.ops.gemm import accumulation_dtype, fprop_gemm, lhs_scale_layout, matmul_nt
from jax_qtrain.quantize import QuantizedTensor, quantize
from jax_qtrain.quantized_weight import QuantizedWeight, needed_weight_usages
from jax_qtrain.recipes import Recipe


@dataclasses.dataclass(frozen=True)
class _DenseConfig:
    """Static configuration of one dense call (hashable: a nondiff argument of the custom_vjp)."""

    recipe: Recipe
    save_original_input: bool  # after the override forced it
    x_dtype: np.dtype
    kernel_dtype: np.dtype
    bias_dtype: np.dtype | None
    out_dtype: np.dtype
    has_kernel: bool = True  # False: only a quantized kernel was given; no kernel gradient

    @property
    def mode(self) -> str | None:
        return self.recipe.backward_override


def effective_save_original_input(recipe: Recipe, save_original_input: bool) -> bool:
    """TE #3141: "high_precision" forces True, "dequantized" forces False."""
    if recipe.backward_override == "high_precision":
        return True
    if recipe.backward_override == "dequantized":
        return False
    return save_original_input


def _high_precision_dot(a: jax.Array, b: jax.Array, dimension_numbers, out_dtype) -> jax.Array:
    """A GEMM in the operands' (promoted) dtype with float32 accumulation, rounded once to
    `out_dtype`: by the GEMM itself for bfloat16 on the GPU (as `x @ w` there;
    ops/gemm.py `accumulation_dtype`), else afterwards."""
    dtype = jnp.promote_types(a.dtype, b.dtype)
    out = lax.dot_general(
        a.astype(dtype),
        b.astype(dtype),
        dimension_numbers,
        preferred_element_type=accumulation_dtype(dtype, out_dtype),
    )
    return out.astype(out_dtype)


def rounded_once(gemm: Callable[[jnp.dtype], jax.Array], bias, out_dtype) -> jax.Array:
    """`gemm(dtype) (+ bias)` rounded once to `out_dtype`: without a bias the GEMM rounds its own
    output (`gemm(out_dtype)`); a bias (anything that broadcasts against the product: a layer's
    (N,) bias, the grouped layers' per-row group biases) is added to its float32 product before
    that one rounding (as cuBLASLt's bias epilogue does)."""
    if bias is None:
        return gemm(out_dtype)
    return _add_bias(gemm(jnp.float32), bias, out_dtype)


_NT = (((1,), (1,)), ((), ()))  # a (m, c), b (n, c) -> (m, n)
_TN = (((0,), (0,)), ((), ()))  # a (c, m), b (c, n) -> (m, n)
_NN = (((1,), (0,)), ((), ()))  # a (m, c), b (c, n) -> (m, n)


def _add_bias(acc: jax.Array, bias: jax.Array | None, out_dtype) -> jax.Array:
    if bias is not None:
        acc = acc + bias.astype(jnp.float32)
    return acc.astype(out_dtype)


def stochastic_rounding_key(key: jax.Array | None, grad: jax.Array) -> jax.Array:
    """The key for rounding `grad` stochastically: the caller's, or, without one, a key seeded
    by a hash of the gradient's bits (reproducible, and different whenever the gradient is)."""
    if key is not None:
        return key
    bits = lax.bitcast_convert_type(grad.astype(jnp.float32), jnp.uint32)
    seed = jnp.sum(bits * jnp.uint32(0x9E3779B1) + jnp.uint32(0x7F4A7C15), dtype=jnp.uint32)
    return jax.random.key(seed)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _dense(x2d, kernel, bias, key, quantized_kernel, config: _DenseConfig):
    # Not differentiated: fprop only, so a given quantized kernel needs only its columnwise copy.
    y, _ = _forward(x2d, kernel, bias, key, quantized_kernel, config, differentiated=False)
    return y


def _dense_fwd(x2d, kernel, bias, key, quantized_kernel, config: _DenseConfig):
    """Forward. Residuals: (saved_input, saved_kernel, key), each named (ops/residuals.py):

    - saved_input (INPUT): QuantizedTensor with only the columnwise copy (mode None), the raw
      x2d (mode None with save_original_input, and "high_precision"), or the forward-quantized
      QuantizedTensor with only the rowwise copy ("dequantized"); None without a kernel (no
      wgrad to compute);
    - saved_kernel (KERNEL): QuantizedTensor with only the rowwise copy (mode None), the raw
      kernel ("high_precision"), or the forward-quantized columnwise copy ("dequantized"); with
      a `quantized_kernel` these are views of the given copies, not new quantizations;
    - key (SR_KEY): the caller's stochastic-rounding key, or None.
    """
    return _forward(x2d, kernel, bias, key, quantized_kernel, config, differentiated=True)


def _check_quantized_kernel_usages(
    quantized_kernel: QuantizedTensor, recipe: Recipe, differentiated: bool
) -> None:
    needed = needed_weight_usages(recipe, training=differentiated)
    missing = [u for u in needed if not quantized_kernel.has_usage(u)]
    if missing:
        what = (
            f"differentiating dense with backward_override={recipe.backward_override!r}"
            if differentiated
            else "the forward"
        )
        raise ValueError(
            f"quantized_kernel holds only {list(quantized_kernel.usages)}, but {what} reads "
            f"{list(needed)} (fprop reads the columnwise copy, dgrad the rowwise copy); quantize "
            f"the kernel with {missing} too, e.g. QuantizedWeight.refresh(kernel, "
            f"add_usages={tuple(missing)})"
        )


def _forward(x2d, kernel, bias, key, quantized_kernel, config: _DenseConfig, *, differentiated):
    recipe, mode = config.recipe, config.mode
    keep_x_columnwise = mode is None and not config.save_original_input and config.has_kernel
    qx = quantize(
        x2d,
        recipe,
        "input",
        rowwise=True,
        columnwise=keep_x_columnwise,
        scale_layout=lhs_scale_layout(recipe, "input", x2d.shape, x2d.dtype),
    )
    if quantized_kernel is None:
        qw = quantize(kernel, recipe, "weight", rowwise=mode is None, columnwise=True)
    else:
        _check_quantized_kernel_usages(quantized_kernel, recipe, differentiated)
        qw = quantized_kernel
    rows, cols = x2d.shape[0], qw.shape[1]
    y = rounded_once(
        lambda dtype: fprop_gemm(qx, qw, recipe, rows=rows, cols=cols, out_dtype=dtype),
        bias,
        config.out_dtype,
    )
    if not differentiated:
        return y, None

    if not config.has_kernel:
        saved_input = None  # only wgrad reads x
    elif mode is None:
        saved_input = x2d if config.save_original_input else qx.restrict_to("columnwise")
    elif mode == "high_precision":
        saved_input = x2d
    else:  # "dequantized": the copy the forward GEMM read
        saved_input = qx.restrict_to("rowwise")
    if mode is None:
        saved_kernel = qw.restrict_to("rowwise")
    elif mode == "high_precision":
        saved_kernel = kernel
    else:  # "dequantized": the copy the forward GEMM read
        saved_kernel = qw.restrict_to("columnwise")
    residuals = (
        None if saved_input is None else checkpoint_name(saved_input, names.INPUT),
        checkpoint_name(saved_kernel, names.KERNEL),
        None if key is None else checkpoint_name(key, names.SR_KEY),
    )
    return y, residuals


def _dense_bwd(config: _DenseConfig, residuals, dy):
    saved_input, saved_kernel, key = residuals
    recipe, mode = config.recipe, config.mode
    rows, in_features = dy.shape[0], saved_kernel.shape[0]
    out_features = dy.shape[1]

    if mode is None:
        qdy = quantize(
            dy,
            recipe,
            "grad",
            rowwise=True,
            columnwise=True,
            key=stochastic_rounding_key(key, dy)
            if recipe.spec("grad").stochastic_rounding
            else None,
            scale_layout=lhs_scale_layout(recipe, "grad", dy.shape, dy.dtype),
        )
        dx = matmul_nt(
            qdy,
            "rowwise",
            saved_kernel,
            "rowwise",
            rows=rows,
            cols=in_features,
            out_dtype=config.x_dtype,
        )
        dw = None
        if config.has_kernel:
            qx = saved_input
            if not isinstance(qx, QuantizedTensor):  # save_original_input: re-quantize
                qx = quantize(qx, recipe, "input", rowwise=False, columnwise=True)
            dw = matmul_nt(
                qx,
                "columnwise",
                qdy,
                "columnwise",
                rows=in_features,
                cols=out_features,
                out_dtype=config.kernel_dtype,
            )
    else:
        compute_dtype = jnp.promote_types(config.x_dtype, config.kernel_dtype)
        if mode == "high_precision":
            x_values, kernel_values = saved_input, saved_kernel
        else:  # "dequantized"
            x_values = None
            if config.has_kernel:
                x_values = saved_input.dequantize("rowwise", compute_dtype)
            kernel_values = saved_kernel.dequantize("columnwise", compute_dtype)
        dy_c = dy.astype(compute_dtype)
        dx = _high_precision_dot(dy_c, kernel_values, _NT, config.x_dtype)
        dw = None
        if config.has_kernel:
            dw = _high_precision_dot(x_values, dy_c, _TN, config.kernel_dtype)

    dbias = None
    if config.bias_dtype is not None:
        dbias = jnp.sum(dy.astype(jnp.float32), axis=0).astype(config.bias_dtype)
    dkernel = None if dw is None else dw.astype(config.kernel_dtype)
    # No cotangent for the quantized kernel: its gradient is the kernel's.
    return dx.astype(config.x_dtype), dkernel, dbias, None, None


_dense.defvjp(_dense_fwd, _dense_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _plain_dense(x2d, kernel, bias, out_dtype, bias_dtype):
    """Unquantized dense: GEMMs in the compute dtype with float32 accumulation. A custom_vjp so
    that the backward GEMMs also run in the compute dtype (JAX's own transpose of a float32-output
    dot would run them in float32), exactly as "high_precision" does."""
    return rounded_once(lambda dtype: _high_precision_dot(x2d, kernel, _NN, dtype), bias, out_dtype)


def _plain_dense_fwd(x2d, kernel, bias, out_dtype, bias_dtype):
    """Residuals: (x2d, kernel), what the two backward GEMMs read."""
    return _plain_dense(x2d, kernel, bias, out_dtype, bias_dtype), (x2d, kernel)


def _plain_dense_bwd(out_dtype, bias_dtype, residuals, dy):
    del out_dtype
    x2d, kernel = residuals
    dy_c = dy.astype(jnp.promote_types(x2d.dtype, kernel.dtype))
    dx = _high_precision_dot(dy_c, kernel, _NT, x2d.dtype)
    dw = _high_precision_dot(x2d, dy_c, _TN, kernel.dtype)
    dbias = None
    if bias_dtype is not None:
        dbias = jnp.sum(dy.astype(jnp.float32), axis=0).astype(bias_dtype)
    return dx, dw, dbias


_plain_dense.defvjp(_plain_dense_fwd, _plain_dense_bwd)


def _validate(x, kernel, bias, kernel_shape: tuple[int, ...]) -> None:
    """`kernel_shape`: the kernel's, or the quantized kernel's when no kernel is given."""
    arrays = (("x", x),) if kernel is None else (("x", x), ("kernel", kernel))
    for name, value in arrays:
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(value).__name__}")
        if jnp.dtype(value.dtype) not in common.SUPPORTED_INPUT_DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {value.dtype}")
    if x.ndim < 1:
        raise ValueError("x must have at least one dimension (..., in_features)")
    if len(kernel_shape) != 2:
        raise ValueError(
            f"kernel must have shape (in_features, out_features), got rank {len(kernel_shape)} "
            f"{tuple(kernel_shape)}"
        )
    if x.shape[-1] != kernel_shape[0]:
        raise ValueError(
            f"x's last dim ({x.shape[-1]}) must equal kernel's in_features ({kernel_shape[0]})"
        )
    if bias is not None:
        if not hasattr(bias, "shape") or tuple(bias.shape) != (kernel_shape[1],):
            got = tuple(bias.shape) if hasattr(bias, "shape") else type(bias).__name__
            raise ValueError(f"bias must have shape ({kernel_shape[1]},), got {got}")
        if jnp.dtype(bias.dtype) not in common.SUPPORTED_INPUT_DTYPES:
            raise TypeError(f"bias must be float32, bfloat16 or float16, got {bias.dtype}")


def _unwrap_quantized_kernel(quantized_kernel, kernel) -> QuantizedTensor:
    """The QuantizedTensor of a `quantized_kernel` argument, checked against `kernel`."""
    if isinstance(quantized_kernel, QuantizedWeight):
        if quantized_kernel.num_groups is not None:
            raise ValueError(
                f"quantized_kernel holds {quantized_kernel.num_groups} stacked expert kernels; "
                "dense takes one kernel (in_features, out_features)"
            )
        tensor = quantized_kernel.tensor
    elif isinstance(quantized_kernel, QuantizedTensor):
        tensor = quantized_kernel
    else:
        raise TypeError(
            f"quantized_kernel must be a QuantizedWeight or a QuantizedTensor, got "
            f"{type(quantized_kernel).__name__}"
        )
    data = tensor.columnwise_data if tensor.rowwise_data is None else tensor.rowwise_data
    if len(tensor.shape) != 2 or (data is not None and getattr(data, "ndim", 2) != 2):
        raise ValueError(
            f"quantized_kernel must quantize one kernel (in_features, out_features), got shape "
            f"{tensor.shape} with arrays of rank {getattr(data, 'ndim', None)}"
        )
    if kernel is not None and (
        tuple(kernel.shape) != tensor.shape or jnp.dtype(kernel.dtype) != tensor.dtype
    ):
        raise ValueError(
            f"quantized_kernel must be the quantization of kernel: it has shape {tensor.shape} "
            f"and dtype {tensor.dtype}, kernel {tuple(kernel.shape)} {kernel.dtype}"
        )
    return tensor


def check_quantized_kernel_recipe(
    tensor: QuantizedTensor,
    recipe: Recipe | None,
    kernel,
    *,
    argument: str = "quantized_kernel",
    kernel_argument: str = "kernel",
) -> None:
    """A pre-quantized kernel (`argument`) against the op's recipe: there is one, it quantizes
    weights as the kernel was quantized, and the high-precision kernel is given where backward
    reads it."""
    if recipe is None:
        raise ValueError(
            f"{argument} needs the recipe it was quantized with: pass recipe= (or use "
            "jax_qtrain.autocast); with no recipe dense runs in high precision"
        )
    if tensor.spec != recipe.spec("weight"):
        raise ValueError(
            f"{argument} was quantized as {tensor.spec.describe()}, but the recipe "
            f"{type(recipe).__name__} quantizes weights as {recipe.spec('weight').describe()}"
        )
    if kernel is None and recipe.backward_override == "high_precision":
        raise ValueError(
            f'{kernel_argument} is None, but backward_override="high_precision" reads the raw '
            f"kernel in backward; pass the high-precision {kernel_argument}"
        )


def dense(
    x: jax.Array,
    kernel: jax.Array | None,
    bias: jax.Array | None = None,
    *,
    recipe: Recipe | None = None,
    save_original_input: bool = False,
    key: jax.Array | None = None,
    quantized_kernel: QuantizedWeight | QuantizedTensor | None = None,
) -> jax.Array:
    """Quantized `x @ kernel + bias` with TransformerEngine's backward semantics.

    Args:
      x: (..., in_features) float array.
      kernel: (in_features, out_features), Flax's layout. May be None when `quantized_kernel`
        is given: a weight kept only in quantized form, which then gets no gradient.
      bias: optional (out_features,).
      recipe: the quantization recipe; None uses the active `autocast` recipe, and with none
        active the op is a plain high-precision dense layer.
      save_original_input: in the default mode, save the raw input and re-quantize it in
        backward instead of saving its columnwise copy (overridden by `backward_override`).
      key: jax.random key for stochastic rounding of the output gradient (NVFP4). Without one,
        the seed is a hash of the gradient itself.
      quantized_kernel: `kernel` already quantized by the recipe's weight quantizer (a
        `QuantizedWeight` from `jax_qtrain.quantize_weight`, or a `QuantizedTensor`). The op
        reads its copies instead of quantizing the kernel, e.g. once per optimizer step for all
        microbatches. It must hold the columnwise copy (fprop) and, to be differentiated in the
        default mode, the rowwise copy (dgrad); otherwise a ValueError says which is missing.
        The op cannot check that its values are `kernel`'s: `QuantizedWeight.refresh` and
        `jax_qtrain.nn.Linear(quantized_weight=True)` keep the two in step.

    Returns: (..., out_features) in the promoted dtype of x and kernel.
    """
    if kernel is None and quantized_kernel is None:
        raise TypeError("kernel must be an array (None only together with quantized_kernel)")
    if kernel is not None and not (hasattr(kernel, "shape") and hasattr(kernel, "dtype")):
        raise TypeError(f"kernel must be an array, got {type(kernel).__name__}")
    quantized_tensor = None
    if quantized_kernel is not None:
        quantized_tensor = _unwrap_quantized_kernel(quantized_kernel, kernel)
        kernel_shape, kernel_dtype = quantized_tensor.shape, quantized_tensor.dtype
    else:
        kernel_shape, kernel_dtype = tuple(kernel.shape), kernel.dtype
    _validate(x, kernel, bias, kernel_shape)
    if not isinstance(save_original_input, bool):
        raise TypeError(f"save_original_input must be a bool, got {save_original_input!r}")
    recipe = resolve_recipe(recipe)
    if quantized_tensor is not None:
        check_quantized_kernel_recipe(quantized_tensor, recipe, kernel)
    out_dtype = jnp.promote_types(x.dtype, kernel_dtype)
    x2d = x.reshape(-1, x.shape[-1])
    if recipe is None:
        bias_dtype = None if bias is None else jnp.dtype(bias.dtype)
        y2d = _plain_dense(x2d, kernel, bias, out_dtype, bias_dtype)
    else:
        config = _DenseConfig(
            recipe=recipe,
            save_original_input=effective_save_original_input(recipe, save_original_input),
            x_dtype=jnp.dtype(x.dtype),
            kernel_dtype=jnp.dtype(kernel_dtype),
            bias_dtype=None if bias is None else jnp.dtype(bias.dtype),
            out_dtype=out_dtype,
            has_kernel=kernel is not None,
        )
        y2d = _dense(x2d, kernel, bias, key, quantized_tensor, config)
    return y2d.reshape(*x.shape[:-1], kernel_shape[1])
