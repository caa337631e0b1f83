"""`QuantizedWeight`: a weight's quantized form that keeps every usage it ever had.

A weight's copies are read by different GEMMs (docs/design/layouts.md): fprop reads the
columnwise copy of the (K, N) kernel, dgrad the rowwise copy. TransformerEngine once quantized a
cached weight for the usages of the *current* step only (#2929): an inference step refreshed the
fprop copy and skipped the dgrad copy, so the next training step read a dgrad copy made from an
older weight. Here that cannot happen, by construction:

1. A `QuantizedWeight` is made in exactly two ways, `quantize_weight(weight, recipe, usages)` and
   `qw.refresh(weight, add_usages=...)`. Both quantize **every** copy they hold from the one
   high-precision weight they are given. Nothing derives one copy from another, and nothing
   replaces a single copy.
2. `refresh` keeps every usage the weight already holds and may add more; no method returns a
   `QuantizedWeight` with fewer usages. A GEMM that reads one copy takes a `QuantizedTensor` view
   (`qw.tensor.restrict_to(...)`), which is not a `QuantizedWeight` and cannot be stored as one.
3. The usages are part of the pytree structure (a copy it does not hold is a None child), so
   jit, scan, `tree_map` and NNX state plumbing carry them unchanged.

A weight split over devices (FSDP, `jax_qtrain.sharding.ShardedLinear(quantized_weight=True)`)
keeps its copies split the same way: the `QuantizedWeight` carries a `WeightLayout` that
quantizes each device's shard as part of the whole weight, and `refresh` reuses it, so the kept
copies stay split and equal, bit for bit, the whole weight's quantization.

Stacked expert weights (G, K, N) are quantized per expert, as the grouped ops quantize them
(`quantize_per_expert`: each expert its own scales and, for per-tensor formats, its own amax):
the tensor's arrays get a leading G axis, its metadata (`tensor.shape`) is one expert's (K, N),
and `qw.expert(g)` is expert g's `QuantizedTensor`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from jax_qtrain.formats.spec import QuantizerSpec
from jax_qtrain.quantize import USAGES, QuantizedTensor, Usage, quantize
from jax_qtrain.recipes import Recipe, check_recipe

_WEIGHT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def needed_weight_usages(recipe: Recipe, *, training: bool) -> tuple[str, ...]:
    """The copies of a kernel that `jax_qtrain.dense` reads under `recipe`.

    Inference (a forward that is not differentiated) reads the columnwise copy (fprop). Training
    in the default mode also reads the rowwise copy (dgrad); under "dequantized" the backward
    dequantizes the columnwise copy and under "high_precision" it reads the raw kernel, so
    training there needs only the columnwise copy.
    """
    check_recipe(recipe, allow_none=False)
    if training and recipe.backward_override is None:
        return ("rowwise", "columnwise")
    return ("columnwise",)


def _canonical_usages(usages: Iterable[str], argument: str) -> tuple[str, ...]:
    if isinstance(usages, str):
        usages = (usages,)
    usages = tuple(usages)
    for usage in usages:
        if usage not in USAGES:
            raise ValueError(f"{argument} must name usages from {list(USAGES)}, got {usage!r}")
    return tuple(u for u in USAGES if u in usages)


def _check_weight(weight: Any, argument: str = "weight") -> None:
    if not hasattr(weight, "shape") or not hasattr(weight, "dtype"):
        raise TypeError(f"{argument} must be an array, got {type(weight).__name__}")
    if jnp.dtype(weight.dtype) not in _WEIGHT_DTYPES:
        raise TypeError(
            f"{argument} must be float32, bfloat16 or float16 (a high-precision weight), "
            f"got {weight.dtype}"
        )
    if weight.ndim not in (2, 3):
        raise ValueError(
            f"{argument} must be a kernel (in_features, out_features) or stacked expert kernels "
            f"(groups, in_features, out_features), got shape {tuple(weight.shape)}"
        )


@runtime_checkable
class WeightLayout(Hashable, Protocol):
    """Where a `QuantizedWeight`'s copies live, for weights split over devices. Hashable (it is
    static metadata of the weight) and compared by value. Implemented by
    `jax_qtrain.sharding.SplitKernelLayout`."""

    def quantize_copies(
        self, weight: jax.Array, recipe: Recipe, *, rowwise: bool, columnwise: bool
    ) -> QuantizedTensor:
        """The whole weight's quantized copies (bit for bit `quantize(weight, recipe,
        "weight", ...)`), laid out this layout's way."""
        ...

    def describe(self) -> str:
        """A short description for reprs and error messages."""
        ...


def _quantize_copies(
    weight: jax.Array, recipe: Recipe, usages: tuple[str, ...], layout: WeightLayout | None
):
    """Every copy in `usages`, quantized from `weight` in one call (per expert if stacked)."""
    if layout is not None:
        return layout.quantize_copies(
            weight, recipe, rowwise="rowwise" in usages, columnwise="columnwise" in usages
        )
    if weight.ndim == 2:
        return quantize(
            weight,
            recipe,
            "weight",
            rowwise="rowwise" in usages,
            columnwise="columnwise" in usages,
        )
    # Exactly what the grouped ops quantize in every call. Imported here: jax_qtrain.ops
    # imports this module (ops/dense.py).
    from jax_qtrain.ops.grouped_quantize import quantize_per_expert

    return quantize_per_expert(
        weight,
        recipe,
        rowwise="rowwise" in usages,
        columnwise="columnwise" in usages,
    )


@jax.tree_util.register_pytree_node_class
class QuantizedWeight:
    """A weight's quantized copies, all made from one high-precision weight.

    Made only by `quantize_weight(...)` and `refresh(...)` (module docstring). Immutable.

    Attributes:
      tensor: the `QuantizedTensor` (stacked per expert for a (G, K, N) weight).
      recipe: the recipe whose weight quantizer made it.
      shape, dtype: the high-precision weight's.
      usages: the copies held, e.g. ("rowwise", "columnwise").
      layout: the `WeightLayout` of a weight split over devices, or None.
    """

    __slots__ = ("_layout", "_recipe", "_shape", "_tensor")

    def __init__(self, *args, **kwargs):
        del args, kwargs
        raise TypeError(
            "QuantizedWeight is made by jax_qtrain.quantize_weight(weight, recipe, usages) or by "
            "QuantizedWeight.refresh(weight); it is never assembled from copies"
        )

    @classmethod
    def _make(
        cls, tensor: Any, recipe: Recipe, shape: tuple[int, ...], layout: WeightLayout | None
    ) -> QuantizedWeight:
        self = object.__new__(cls)
        object.__setattr__(self, "_tensor", tensor)
        object.__setattr__(self, "_recipe", recipe)
        object.__setattr__(self, "_shape", tuple(shape))
        object.__setattr__(self, "_layout", layout)
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"QuantizedWeight is immutable (tried to set {name!r}); make a new one with "
            "refresh(weight)"
        )

    # --- pytree: the tensor's arrays are the leaves; usages live in its structure -------------
    def tree_flatten(self):
        return (self._tensor,), (self._recipe, self._shape, self._layout)

    @classmethod
    def tree_unflatten(cls, aux, children):
        recipe, shape, layout = aux
        (tensor,) = children
        return cls._make(tensor, recipe, shape, layout)

    # --- reading -------------------------------------------------------------------------------
    @property
    def tensor(self) -> QuantizedTensor:
        return self._tensor

    @property
    def recipe(self) -> Recipe:
        return self._recipe

    @property
    def spec(self) -> QuantizerSpec:
        return self._recipe.spec("weight")

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def layout(self) -> WeightLayout | None:
        return self._layout

    @property
    def dtype(self) -> jnp.dtype:
        return self._tensor.dtype

    @property
    def num_groups(self) -> int | None:
        """G for stacked expert weights (G, K, N), None for a single kernel."""
        return self._shape[0] if len(self._shape) == 3 else None

    @property
    def usages(self) -> tuple[str, ...]:
        return self._tensor.usages

    def has_usage(self, usage: Usage) -> bool:
        return self._tensor.has_usage(usage)

    @property
    def nbytes(self) -> int:
        return self._tensor.nbytes

    def expert(self, group: int) -> QuantizedTensor:
        """Expert `group`'s `QuantizedTensor` (stacked weights only)."""
        if self.num_groups is None:
            raise ValueError("expert(): this QuantizedWeight holds a single kernel, not experts")
        return jax.tree_util.tree_map(lambda leaf: leaf[group], self._tensor)

    def dequantize(self, usage: Usage = "rowwise", dtype: Any = None) -> jax.Array:
        """One copy's values in the weight's shape ((K, N) or (G, K, N))."""
        if self.num_groups is None:
            return self._tensor.dequantize(usage, dtype)
        return jax.vmap(lambda q: q.dequantize(usage, dtype))(self._tensor)

    # --- the only way to a new one ---------------------------------------------------------------
    def refresh(self, weight: jax.Array, *, add_usages: Iterable[Usage] = ()) -> QuantizedWeight:
        """The quantization of `weight` (the current high-precision weight) for every usage this
        one holds plus `add_usages`, all copies made from `weight` in one call.

        Call it whenever the weight changes (after each optimizer update). A usage once held is
        kept for good: a step that reads fewer copies still gets all of them refreshed. A split
        weight is re-quantized with its own layout (it stays split).
        """
        _check_weight(weight)
        if tuple(weight.shape) != self._shape or jnp.dtype(weight.dtype) != self.dtype:
            raise ValueError(
                f"weight must have this QuantizedWeight's shape {self._shape} and dtype "
                f"{self.dtype}, got {tuple(weight.shape)} {weight.dtype}"
            )
        usages = _canonical_usages((*self.usages, *_as_tuple(add_usages)), "add_usages")
        return QuantizedWeight._make(
            _quantize_copies(weight, self._recipe, usages, self._layout),
            self._recipe,
            self._shape,
            self._layout,
        )

    def __repr__(self) -> str:
        experts = "" if self.num_groups is None else f", {self.num_groups} experts"
        layout = "" if self._layout is None else f", {self._layout.describe()}"
        return (
            f"QuantizedWeight({self.spec.describe()}, shape={self._shape}, dtype={self.dtype}, "
            f"usages={list(self.usages)}{experts}{layout}, nbytes={self.nbytes:,})"
        )


def _as_tuple(usages: Iterable[str]) -> tuple[str, ...]:
    return (usages,) if isinstance(usages, str) else tuple(usages)


def quantize_weight(
    weight: jax.Array,
    recipe: Recipe,
    usages: Iterable[Usage] = ("rowwise", "columnwise"),
    *,
    layout: WeightLayout | None = None,
) -> QuantizedWeight:
    """Quantize a kernel (K, N), or stacked expert kernels (G, K, N) per expert, with `recipe`'s
    weight quantizer, producing the copies named in `usages` (default both; see
    `needed_weight_usages`).

    Pass the kernel in the dtype the layer computes in: the quantization depends on it (FP8
    block's overflow rule and the rounding of a wider weight). `layout`: for a kernel split over
    devices, e.g. `jax_qtrain.sharding.SplitKernelLayout(sharding)`; kept for every refresh.
    """
    check_recipe(recipe, allow_none=False)
    _check_weight(weight)
    usages = _canonical_usages(usages, "usages")
    if not usages:
        raise ValueError("usages is empty: name at least one of 'rowwise', 'columnwise'")
    if layout is not None and not isinstance(layout, WeightLayout):
        raise TypeError(
            f"layout must be a WeightLayout (e.g. jax_qtrain.sharding.SplitKernelLayout) or "
            f"None, got {type(layout).__name__}"
        )
    return QuantizedWeight._make(
        _quantize_copies(jnp.asarray(weight), recipe, usages, layout),
        recipe,
        tuple(weight.shape),
        layout,
    )


def check_kept_weight(
    quantized: Any, weight: jax.Array, recipe: Recipe, *, argument: str
) -> QuantizedTensor:
    """The `QuantizedTensor` of a kept `QuantizedWeight` passed to an op as `argument`, checked
    against the op's high-precision `weight` and `recipe`: same shape and dtype, the recipe's
    weight quantizer, and every copy training reads (`needed_weight_usages`)."""
    if not isinstance(quantized, QuantizedWeight):
        raise TypeError(
            f"{argument} must be a QuantizedWeight (jax_qtrain.quantize_weight), got "
            f"{type(quantized).__name__}"
        )
    if quantized.shape != tuple(weight.shape) or quantized.dtype != jnp.dtype(weight.dtype):
        raise ValueError(
            f"{argument} must be the quantization of its weight: it has shape {quantized.shape} "
            f"and dtype {quantized.dtype}, the weight {tuple(weight.shape)} {weight.dtype}"
        )
    if quantized.spec != recipe.spec("weight"):
        raise ValueError(
            f"{argument} was quantized as {quantized.spec.describe()}, but the recipe "
            f"{type(recipe).__name__} quantizes weights as {recipe.spec('weight').describe()}"
        )
    check_training_usages(quantized, recipe, argument=argument)
    return quantized.tensor


def check_training_usages(held: Any, recipe: Recipe, *, argument: str) -> None:
    """ValueError unless a kept weight (or its tensor, or a shard of it) `held` holds every copy
    a training step reads under `recipe` (`needed_weight_usages`)."""
    needed = needed_weight_usages(recipe, training=True)
    missing = [u for u in needed if not held.has_usage(u)]
    if missing:
        raise ValueError(
            f"{argument} holds only {list(held.usages)}, but this op reads {list(needed)} "
            f"(fprop the columnwise copies, dgrad the rowwise ones); refresh it with "
            f"add_usages={tuple(missing)}"
        )
