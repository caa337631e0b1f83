"""`dot_general(recipe=...)`: quantized `lax.dot_general` / `jnp.einsum` drop-ins for stock Flax.

    layer = nnx.Linear(1024, 4096, dot_general=jq.dot_general(recipe), rngs=rngs)
    proj = nnx.Einsum("btd,dnh->btnh", (512, 8, 64), einsum_op=jq.einsum(recipe), rngs=rngs)

The right-hand operand is treated as the weight, the left-hand one as the input. Contracting
dimensions are flattened into K, the rhs free dimensions into N, and batch dimensions are
vmapped, so every call lowers to `jax_qtrain.dense` and inherits its custom_vjp.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import string

import jax
import jax.numpy as jnp
import numpy as np

from jax_qtrain.ops.dense import dense
from jax_qtrain.recipes import Recipe, check_recipe


@dataclasses.dataclass(frozen=True)
class QuantizedDotGeneral:
    """A callable with `lax.dot_general`'s signature that quantizes like `jax_qtrain.dense`.

    `recipe=None` uses the active `autocast` recipe at trace time. `precision` and
    `preferred_element_type` are accepted for signature compatibility; the quantized GEMMs
    always accumulate in float32 and return the promoted input dtype (or
    `preferred_element_type` when given).
    """

    recipe: Recipe | None = None
    save_original_input: bool = False

    def __call__(
        self,
        lhs: jax.Array,
        rhs: jax.Array,
        dimension_numbers,
        precision=None,
        preferred_element_type=None,
        out_sharding=None,
    ) -> jax.Array:
        del precision, out_sharding
        (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
        lhs_contract, rhs_contract = tuple(lhs_contract), tuple(rhs_contract)
        lhs_batch, rhs_batch = tuple(lhs_batch), tuple(rhs_batch)
        if len(lhs_contract) != len(rhs_contract) or len(lhs_batch) != len(rhs_batch):
            raise ValueError(f"dimension_numbers are inconsistent: {dimension_numbers}")
        lhs_free = [d for d in range(lhs.ndim) if d not in lhs_contract + lhs_batch]
        rhs_free = [d for d in range(rhs.ndim) if d not in rhs_contract + rhs_batch]
        # Bring lhs to (batch..., free..., contract...) and rhs to (batch..., contract..., free...).
        lhs_t = jnp.transpose(lhs, (*lhs_batch, *lhs_free, *lhs_contract))
        rhs_t = jnp.transpose(rhs, (*rhs_batch, *rhs_contract, *rhs_free))
        n_batch = len(lhs_batch)
        contract = math.prod(lhs.shape[d] for d in lhs_contract)
        lhs_free_shape = tuple(lhs.shape[d] for d in lhs_free)
        rhs_free_shape = tuple(rhs.shape[d] for d in rhs_free)
        batch_shape = tuple(lhs.shape[d] for d in lhs_batch)
        lhs_m = lhs_t.reshape(*batch_shape, math.prod(lhs_free_shape), contract)
        rhs_m = rhs_t.reshape(*batch_shape, contract, math.prod(rhs_free_shape))

        def one(x, w):
            return dense(x, w, recipe=self.recipe, save_original_input=self.save_original_input)

        for _ in range(n_batch):
            one = jax.vmap(one)
        out = one(lhs_m, rhs_m).reshape(*batch_shape, *lhs_free_shape, *rhs_free_shape)
        if preferred_element_type is not None:
            out = out.astype(preferred_element_type)
        return out

    def einsum(
        self,
        subscripts: str,
        lhs: jax.Array,
        rhs: jax.Array,
        *,
        precision=None,
        preferred_element_type=None,
        out_sharding=None,
        **unused,
    ) -> jax.Array:
        """`jnp.einsum(subscripts, lhs, rhs)` for two operands, quantized."""
        del unused
        lhs_labels, rhs_labels, out_labels = _parse_einsum(subscripts, lhs.ndim, rhs.ndim)
        for label in set(lhs_labels) | set(rhs_labels):
            if label not in out_labels and (label in lhs_labels) != (label in rhs_labels):
                raise ValueError(
                    f"einsum {subscripts!r}: label {label!r} is summed over one operand only; "
                    "the quantized einsum supports contractions between the two operands only"
                )
        contract = [c for c in lhs_labels if c in rhs_labels and c not in out_labels]
        batch = [c for c in lhs_labels if c in rhs_labels and c in out_labels]
        dims = (
            (
                tuple(lhs_labels.index(c) for c in contract),
                tuple(rhs_labels.index(c) for c in contract),
            ),
            (tuple(lhs_labels.index(c) for c in batch), tuple(rhs_labels.index(c) for c in batch)),
        )
        out = self(lhs, rhs, dims, precision, preferred_element_type, out_sharding)
        produced = (
            batch
            + [c for c in lhs_labels if c not in rhs_labels]
            + [c for c in rhs_labels if c not in lhs_labels]
        )
        return jnp.transpose(out, tuple(produced.index(c) for c in out_labels))


def _parse_einsum(subscripts: str, lhs_ndim: int, rhs_ndim: int) -> tuple[str, str, str]:
    subscripts = subscripts.replace(" ", "")
    if "->" not in subscripts or subscripts.count(",") != 1:
        raise ValueError(f"einsum subscripts must be explicit 'ab,bc->ac', got {subscripts!r}")
    inputs, out = subscripts.split("->")
    lhs, rhs = inputs.split(",")
    if "..." in subscripts:
        spare = [c for c in string.ascii_letters if c not in subscripts]
        n_ellipsis = max(
            lhs_ndim - (len(lhs) - 3) if "..." in lhs else 0,
            rhs_ndim - (len(rhs) - 3) if "..." in rhs else 0,
        )
        fill = "".join(spare[:n_ellipsis])
        lhs, rhs, out = (s.replace("...", fill) for s in (lhs, rhs, out))
    if len(lhs) != lhs_ndim or len(rhs) != rhs_ndim:
        raise ValueError(
            f"einsum {subscripts!r} does not match operand ranks {lhs_ndim} and {rhs_ndim}"
        )
    return lhs, rhs, out


def _factory(flax_argument: str):
    """Refuses, with the fix, a factory passed where Flax wants the op itself (`flax_argument`).

    `nnx.Linear(dot_general=jax_qtrain.dot_general)` reads naturally (`lax.dot_general` is passed
    that way) but hands Flax the factory: its call `(inputs, kernel, dims, precision=...)` would
    otherwise fail with a bare "unexpected keyword argument".
    """

    def decorate(make):
        name = f"jax_qtrain.{make.__name__}"

        @functools.wraps(make)
        def checked(*args, **kwargs):
            called_as_op = len(args) > 1 or not set(kwargs) <= {"recipe", "save_original_input"}
            if called_as_op or (args and isinstance(args[0], jax.Array | np.ndarray)):
                raise TypeError(
                    f"{name}(recipe) makes the quantized op; it was called as the op itself. "
                    f"Pass {flax_argument}={name}(recipe) (or {name}() to follow autocast), "
                    f"not {flax_argument}={name}"
                )
            return make(*args, **kwargs)

        return checked

    return decorate


@_factory("dot_general")
def dot_general(
    recipe: Recipe | None = None, *, save_original_input: bool = False
) -> QuantizedDotGeneral:
    """A quantized `dot_general` for `nnx.Linear(dot_general=...)` / `nnx.LinearGeneral`."""
    check_recipe(recipe)
    return QuantizedDotGeneral(recipe=recipe, save_original_input=save_original_input)


@_factory("einsum_op")
def einsum(recipe: Recipe | None = None, *, save_original_input: bool = False):
    """A quantized two-operand `jnp.einsum` for `nnx.Einsum(einsum_op=...)`."""
    return dot_general(recipe, save_original_input=save_original_input).einsum
