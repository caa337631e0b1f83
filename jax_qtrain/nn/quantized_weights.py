"""Quantized weights in Flax NNX: `QuantizedKernel`, `refresh_quantized_weights`, `Optimizer`.

A layer made with `quantized_weight=True` (e.g. `jax_qtrain.nn.Linear`) keeps its kernel's
quantized form, a `jax_qtrain.QuantizedWeight`, in a `QuantizedKernel` variable:

- next to the high-precision master `kernel` (an `nnx.Param`, trained as usual), by default.
  The forward reads the quantized copies instead of quantizing the kernel, so all microbatches of
  a step (and the eval steps in between) share one quantization, and the gradient flows to the
  master. After every optimizer update the quantized form is rebuilt from the new master:
  `jax_qtrain.nn.Optimizer` does it inside `update`; with a plain `nnx.Optimizer` (or any other
  write of the kernel: a checkpoint restore, `kernel[...] = ...`) call
  `refresh_quantized_weights(model)` right after.
- instead of the master (`keep_master_weight=False`): the weight is kept only in quantized form
  and frozen (inference, or a frozen base under trainable adapters); dx still flows through it.

`QuantizedKernel` is not an `nnx.Param`, so `nnx.grad(..., wrt=nnx.Param)` and
`nnx.Optimizer(..., wrt=nnx.Param)` leave it alone. Its value can only be replaced by a
`QuantizedWeight` of the same weight holding at least the usages it holds now: together with
`QuantizedWeight`'s own rules (made whole from the high-precision weight, never narrowed), a cached
copy that no longer matches the weight cannot be produced (docs/quantized_weights.md).

A layer opts in by implementing `refresh_quantized_weight(add_usages=())` (the
`QuantizedWeightLayer` protocol); `refresh_quantized_weights(model)` calls it on every such module.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import jax
from flax import nnx
from flax.typing import MISSING

from jax_qtrain.quantize import Usage
from jax_qtrain.quantized_weight import (
    QuantizedWeight,
    WeightLayout,
    needed_weight_usages,
    quantize_weight,
)
from jax_qtrain.recipes import Recipe


def _check_replacement(old: Any, new: Any) -> None:
    """A QuantizedKernel's new value: a QuantizedWeight of the same weight, usages ⊇ old's."""
    if not isinstance(new, QuantizedWeight):
        raise TypeError(
            f"a QuantizedKernel holds a QuantizedWeight, got {type(new).__name__}; make it with "
            "jax_qtrain.quantize_weight or QuantizedWeight.refresh"
        )
    if not isinstance(old, QuantizedWeight):
        return
    if new.shape != old.shape or new.recipe != old.recipe:
        raise ValueError(
            f"a QuantizedKernel's new value must quantize the same weight with the same recipe: "
            f"had shape {old.shape} ({type(old.recipe).__name__}), got {new.shape} "
            f"({type(new.recipe).__name__})"
        )
    if new.layout != old.layout:

        def describe(layout):
            return "not split" if layout is None else layout.describe()

        raise ValueError(
            f"a QuantizedKernel's new value must keep the weight's layout: had "
            f"{describe(old.layout)}, got {describe(new.layout)}"
        )
    dropped = [u for u in old.usages if u not in new.usages]
    if dropped:
        raise ValueError(
            f"usages are only ever added to a quantized weight: the new value drops {dropped} "
            f"(held {list(old.usages)}, new {list(new.usages)}); a step that reads fewer copies "
            "must still refresh all of them (QuantizedWeight.refresh keeps every usage)"
        )


def _check_if_weights(old: Any, new: Any) -> None:
    if isinstance(old, QuantizedWeight) and isinstance(new, QuantizedWeight):
        _check_replacement(old, new)


class QuantizedKernel(nnx.Variable):
    """A layer's kernel in quantized form: its value is a `QuantizedWeight`.

    Made by `QuantizedKernel.of(kernel, recipe)` and rebuilt by `refresh(kernel)`. Replacing the
    value any other way (`set_value`, `nnx.update` with another state, `copy_from`) checks that
    the new value quantizes the same weight with the same recipe and keeps every usage held now.
    """

    def __init__(self, value: QuantizedWeight, **metadata: Any):
        if not isinstance(value, QuantizedWeight):
            raise TypeError(
                f"QuantizedKernel takes a QuantizedWeight (jax_qtrain.quantize_weight), got "
                f"{type(value).__name__}"
            )
        super().__init__(value, **metadata)

    @classmethod
    def of(
        cls,
        kernel: jax.Array,
        recipe: Recipe | None,
        usages: Iterable[Usage] | None = None,
        *,
        layout: WeightLayout | None = None,
    ) -> QuantizedKernel:
        """`kernel` quantized by `recipe` for `usages` (default: what training reads). Pass the
        kernel in the dtype the layer computes in; refreshes keep that dtype (and `layout`, for
        a kernel split over devices)."""
        if recipe is None:
            raise ValueError(
                "quantized_weight=True needs recipe=: the weight is quantized once, ahead of the "
                "calls, so it cannot follow jax_qtrain.autocast"
            )
        if usages is None:
            usages = needed_weight_usages(recipe, training=True)
        return cls(quantize_weight(kernel, recipe, usages, layout=layout))

    def refresh(self, kernel: jax.Array, *, add_usages: Iterable[Usage] = ()) -> None:
        """Rebuild every copy (plus `add_usages`) from the high-precision `kernel`, cast to the
        dtype the kept copies were made from (`QuantizedWeight.refresh`)."""
        quantized = self.get_value()
        self.set_value(quantized.refresh(kernel.astype(quantized.dtype), add_usages=add_usages))

    def set_value(self, value: QuantizedWeight, *, index: Any = MISSING) -> None:
        if index is not MISSING and index is not Ellipsis:
            raise TypeError("a QuantizedKernel is replaced whole; index it only with [...]")
        _check_replacement(self.get_raw_value(), value)
        super().set_value(value)

    # NNX's own plumbing (jit outputs, nnx.update, merge) lands in the three methods below, also
    # with placeholders that are not weights; the rule is checked whenever both values are.
    def update_from_state(self, variable_state: nnx.Variable) -> None:
        _check_if_weights(self.get_raw_value(), variable_state.get_raw_value())
        super().update_from_state(variable_state)

    def set_raw_value(self, value: Any, *, _unsafe_bypass_check: bool = False) -> None:
        _check_if_weights(self.get_raw_value(), value)
        super().set_raw_value(value, _unsafe_bypass_check=_unsafe_bypass_check)

    def copy_from(self, other: nnx.Variable) -> None:
        _check_if_weights(self.get_raw_value(), other.get_raw_value())
        super().copy_from(other)


@runtime_checkable
class QuantizedWeightLayer(Protocol):
    """A module that keeps quantized weights and can rebuild them from its master weights."""

    def refresh_quantized_weight(self, add_usages: Iterable[Usage] = ()) -> None:
        """Rebuild every quantized weight of this module from its master, for every usage it
        holds plus `add_usages`. A weight kept without a master is frozen: nothing to rebuild,
        and a usage it does not hold cannot be added (ValueError)."""
        ...


def refresh_quantized_weights(model: nnx.Module, *, add_usages: Iterable[Usage] = ()) -> None:
    """Rebuild the quantized weights of every layer in `model` from its master weights.

    Call it after anything writes the master weights outside `jax_qtrain.nn.Optimizer.update`
    (a plain `nnx.Optimizer`, a checkpoint restore, a manual assignment). Works eagerly and
    inside `nnx.jit`. `add_usages` adds copies to every quantized weight (e.g. "rowwise" to
    train a model whose weights were quantized for inference only).
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"model must be an nnx.Module, got {type(model).__name__}")
    add_usages = (add_usages,) if isinstance(add_usages, str) else tuple(add_usages)
    for _, module in nnx.iter_modules(model):
        if isinstance(module, QuantizedWeightLayer):
            module.refresh_quantized_weight(add_usages)


class Optimizer(nnx.Optimizer):
    """`nnx.Optimizer` whose `update` also rebuilds the model's quantized weights from the
    updated masters, so the optimizer step is the one place that writes both.

    Same arguments as `nnx.Optimizer` (`wrt=nnx.Param`): `QuantizedKernel` variables are not
    parameters and get no optimizer state.
    """

    def update(self, model: nnx.Module, grads: Any, /, **kwargs: Any) -> Any:
        updates = super().update(model, grads, **kwargs)
        refresh_quantized_weights(model)
        return updates
