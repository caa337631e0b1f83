"""Quantization recipes: TransformerEngine's recipe classes as frozen dataclasses.

A recipe says how each tensor role of a linear layer is quantized: `spec("input")`,
`spec("weight")` and `spec("grad")` return the `QuantizerSpec` used for x, W and dy. Recipes are
hashable and compare by value, so they can be static arguments of jitted functions and
attributes of Flax modules.

`backward_override` (every recipe) chooses what the backward pass of a layer reads:
  None              quantized operands (TransformerEngine's default);
  "high_precision"  the raw input and weight, GEMMs in the compute dtype, dy unquantized;
  "dequantized"     the forward-quantized operands, dequantized, GEMMs in the compute dtype.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Literal, get_args

import jax.numpy as jnp

from jax_qtrain.formats.spec import QuantizerSpec

Role = Literal["input", "weight", "grad"]
ROLES: tuple[str, ...] = get_args(Role)
BackwardOverride = Literal["high_precision", "dequantized"] | None
BACKWARD_OVERRIDES: tuple[str | None, ...] = (None, "high_precision", "dequantized")


class Format(enum.StrEnum):
    """FP8 format choice, as TransformerEngine's `Format`: E4M3 everywhere, or HYBRID (E4M3 for
    inputs and weights, E5M2 for gradients)."""

    E4M3 = "e4m3"
    HYBRID = "hybrid"


def _check_choice(recipe, field: str, allowed) -> None:
    value = getattr(recipe, field)
    if value not in allowed:
        raise ValueError(
            f"{type(recipe).__name__}.{field} must be one of {list(allowed)}, got {value!r}"
        )


def _coerce_format(recipe, field: str = "fp8_format") -> None:
    value = getattr(recipe, field)
    try:
        object.__setattr__(recipe, field, Format(value))
    except ValueError:
        raise ValueError(
            f"{type(recipe).__name__}.{field} must be one of "
            f"{[f.value for f in Format]} (E5M2 is not a forward format), got {value!r}"
        ) from None


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role must be one of {list(ROLES)}, got {role!r}")


def _fp8_code_dtype(fmt: Format, role: str) -> jnp.dtype:
    if fmt is Format.HYBRID and role == "grad":
        return jnp.dtype(jnp.float8_e5m2)
    return jnp.dtype(jnp.float8_e4m3fn)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    """Base class. Subclasses define `spec(role)` and `name`."""

    backward_override: BackwardOverride = None

    def __post_init__(self):
        _check_choice(self, "backward_override", BACKWARD_OVERRIDES)

    name = "recipe"

    def spec(self, role: Role) -> QuantizerSpec:
        raise NotImplementedError  # every concrete recipe overrides it

    def replace(self, **changes) -> Recipe:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Float8CurrentScaling(Recipe):
    """FP8 with one scale per tensor from its current amax (numerics.md §1).

    Attributes:
      fp8_format: Format.HYBRID (default: E4M3 forward, E5M2 gradients) or Format.E4M3.
      power_2_scale: round scales down to powers of two.
      amax_epsilon: lower bound on the amax before the scale is computed.
      fprop_split_accumulator: True (default): the forward GEMM accumulates as dgrad and wgrad
        do, without cuBLASLt's FP8 fast accumulation (TransformerEngine's
        `use_split_accumulator=True`). False: fast accumulation for the forward GEMM, TE's own
        default (`fp8_gemm_fprop=MMParams(use_split_accumulator=False)`): on the H200 up to 15%
        faster forward GEMMs, 6.5× larger GEMM error, and results that depend on which cuBLASLt
        algorithm XLA picks for a program, so a vmapped or rematerialized step can differ from
        the plain one (docs/design/gemm_accumulation.md). dgrad and wgrad always split.
    """

    fp8_format: Format = Format.HYBRID
    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    fprop_split_accumulator: bool = True

    name = "fp8"

    def __post_init__(self):
        super().__post_init__()
        _coerce_format(self)
        _check_bool(self, "power_2_scale")
        _check_bool(self, "fprop_split_accumulator")
        _check_epsilon(self)

    def spec(self, role: Role) -> QuantizerSpec:
        _check_role(role)
        return QuantizerSpec(
            "fp8",
            _fp8_code_dtype(self.fp8_format, role),
            power_2_scale=self.power_2_scale,
            amax_epsilon=self.amax_epsilon,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Float8BlockScaling(Recipe):
    """FP8 with one scale per 1×128 or 128×128 block (DeepSeek-V3; numerics.md §2).

    Attributes:
      fp8_format: Format.E4M3 (default) or Format.HYBRID (E5M2 gradients).
      power_2_scale: power-of-2 scales (default True; TE's NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1
        is power_2_scale=False).
      amax_epsilon: lower bound on each block's amax.
      x_block_scaling_dim, w_block_scaling_dim, grad_block_scaling_dim: 1 for 1×128 blocks, 2
        for 128×128 blocks (defaults 1, 2, 1). No GEMM may pair two 2-D operands.
    """

    fp8_format: Format = Format.E4M3
    power_2_scale: bool = True
    amax_epsilon: float = 0.0
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1

    name = "fp8_block"

    def __post_init__(self):
        super().__post_init__()
        _coerce_format(self)
        _check_bool(self, "power_2_scale")
        _check_epsilon(self)
        for field in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            _check_choice(self, field, (1, 2))
        dims = {
            "x": self.x_block_scaling_dim,
            "w": self.w_block_scaling_dim,
            "grad": self.grad_block_scaling_dim,
        }
        for a, b in (("x", "w"), ("grad", "w"), ("x", "grad")):
            if dims[a] == 2 and dims[b] == 2:
                raise ValueError(
                    f"Float8BlockScaling.{a}_block_scaling_dim and {b}_block_scaling_dim are both "
                    "2: a GEMM of two 128x128-blocked operands is not supported"
                )

    def spec(self, role: Role) -> QuantizerSpec:
        _check_role(role)
        dim = {
            "input": self.x_block_scaling_dim,
            "weight": self.w_block_scaling_dim,
            "grad": self.grad_block_scaling_dim,
        }[role]
        return QuantizerSpec(
            "fp8_block",
            _fp8_code_dtype(self.fp8_format, role),
            block_shape=(1, 128) if dim == 1 else (128, 128),
            power_2_scale=self.power_2_scale,
            amax_epsilon=self.amax_epsilon,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8: E4M3 codes with an E8M0 (power-of-2, rounded up) scale per 32 elements (§3).

    Attributes:
      fp8_format: Format.E4M3 (default, gradients included) or Format.HYBRID (E5M2 gradients).
    """

    fp8_format: Format = Format.E4M3

    name = "mxfp8"

    def __post_init__(self):
        super().__post_init__()
        _coerce_format(self)

    def spec(self, role: Role) -> QuantizerSpec:
        _check_role(role)
        return QuantizerSpec("mxfp8", _fp8_code_dtype(self.fp8_format, role), block_shape=(1, 32))


@dataclasses.dataclass(frozen=True, kw_only=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 codes, an E4M3 scale per 16 elements, a float32 global scale per copy (§4).

    Defaults as TransformerEngine: inputs 1×16 with the random Hadamard transform on their
    columnwise (wgrad) copy; weights in 16×16 tiles; gradients 1×16 with the Hadamard transform
    on the columnwise copy and stochastic rounding.

    Attributes:
      disable_rht: no Hadamard transform (TE's NVTE_NVFP4_DISABLE_RHT).
      disable_stochastic_rounding: round gradients to nearest even too.
      disable_2d_quantization: 1×16 blocks for weights too.
    """

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False

    name = "nvfp4"

    def __post_init__(self):
        super().__post_init__()
        for field in ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"):
            _check_bool(self, field)

    def spec(self, role: Role) -> QuantizerSpec:
        _check_role(role)
        weight_2d = role == "weight" and not self.disable_2d_quantization
        return QuantizerSpec(
            "nvfp4",
            jnp.float4_e2m1fn,
            block_shape=(16, 16) if weight_2d else (1, 16),
            hadamard_columnwise=role != "weight" and not self.disable_rht,
            stochastic_rounding=role == "grad" and not self.disable_stochastic_rounding,
        )


def _check_bool(recipe, field: str) -> None:
    if not isinstance(getattr(recipe, field), bool):
        raise ValueError(
            f"{type(recipe).__name__}.{field} must be a bool, got {getattr(recipe, field)!r}"
        )


def _check_epsilon(recipe) -> None:
    eps = recipe.amax_epsilon
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps >= 0:
        raise ValueError(f"{type(recipe).__name__}.amax_epsilon must be a float >= 0, got {eps!r}")
    object.__setattr__(recipe, "amax_epsilon", float(eps))


RECIPES_BY_NAME: dict[str, type[Recipe]] = {
    cls.name: cls
    for cls in (Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling)
}


def recipe_from_name(name: str, **options) -> Recipe:
    """`"fp8"`, `"fp8-block"`/`"fp8_block"`, `"mxfp8"`, `"nvfp4"` → a recipe with defaults."""
    key = name.replace("-", "_").lower()
    if key not in RECIPES_BY_NAME:
        raise ValueError(f"unknown recipe {name!r}; expected one of {sorted(RECIPES_BY_NAME)}")
    return RECIPES_BY_NAME[key](**options)


def check_recipe(recipe: object, *, allow_none: bool = True, or_also: str = "") -> None:
    """Raises TypeError unless `recipe` is a Recipe (or None where `allow_none`).

    A recipe's name (`"mxfp8"`) is the commonest wrong value, so the error shows how to make a
    recipe from it. `or_also` names another accepted type for the message (quantize's
    QuantizerSpec), which the caller has checked already.
    """
    if isinstance(recipe, Recipe) or (allow_none and recipe is None):
        return
    alternatives = [name for name in (or_also, "None" if allow_none else "") if name]
    expected = " or ".join(["a jax_qtrain recipe (e.g. MXFP8BlockScaling())", *alternatives])
    hint = (
        f"; jax_qtrain.recipe_from_name({recipe!r}) makes one from its name"
        if isinstance(recipe, str)
        else ""
    )
    raise TypeError(f"recipe must be {expected}, got {type(recipe).__name__}{hint}")
