"""`autocast(recipe)`: the recipe used by ops and layers that were not given one.

The active recipe lives in a JAX config state that is part of the jit cache key and of the trace
context: a jitted function traced under one recipe is retraced, not reused, under another, and
the state is thread-local and nestable. A recipe passed to an op or layer always wins.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from jax._src import config as jax_config  # pinned jax==0.11.2: config states keyed into jit

from jax_qtrain.recipes import Recipe, check_recipe

_UNSET = "jax_qtrain:no-autocast"


def _validate(value) -> None:
    if value != _UNSET:
        check_recipe(value)


_active_recipe = jax_config.string_or_object_state(
    name="jax_qtrain_autocast_recipe",
    default=_UNSET,
    help="The jax_qtrain recipe set by jax_qtrain.autocast (internal).",
    validator=_validate,
    include_in_jit_key=True,
    include_in_trace_context=True,
)


@contextlib.contextmanager
def autocast(recipe: Recipe | None) -> Iterator[None]:
    """Quantize ops and layers without their own recipe with `recipe` inside this block.

    `autocast(None)` turns quantization off for them (high-precision compute). Nestable and
    thread-safe; jitted functions retrace when the active recipe changes.
    """
    _validate(recipe)
    with _active_recipe(recipe):
        yield


def current_recipe() -> Recipe | None:
    """The recipe set by the innermost `autocast`, or None."""
    value = _active_recipe.value
    return None if value == _UNSET else value


def resolve_recipe(recipe: Recipe | None) -> Recipe | None:
    """An op's or layer's own recipe if it has one, else the autocast recipe, else None."""
    if recipe is not None:
        check_recipe(recipe)
        return recipe
    return current_recipe()
