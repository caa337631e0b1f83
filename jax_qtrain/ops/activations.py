"""The activations of the grouped MLP, in TransformerEngine's forms (te_semantics §4).

Gated activations split FC1's output h (…, 2F) into halves a = h[..., :F] and b = h[..., F:] and
return act(a)·b, as TE's `te.ops.SwiGLU` & co. (TE's fused Blackwell grouped-MLP kernel
interleaves the halves in 32-column chunks instead; that is a permutation of FC1's output
columns, not different math.) Plain activations map (…, F) to (…, F). All compute in float32.

  swiglu          silu(a)·b
  geglu           gelu(a)·b                 gelu: tanh approximation, as TE's GELU
  reglu           relu(a)·b
  sreglu          relu(a)²·b
  qgeglu          a·σ(1.702·a)·b            "quick" GELU
  clamped_swiglu  a_c·σ(1.702·a_c)·(clip(b, ±7) + 1), a_c = min(a, 7)   (TE's ClampedSwiGLU /
                  ScaledClampedQGeGLU, GPT-OSS)
  gelu, qgelu, relu, srelu (relu²), silu    plain
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

_QUICK_GELU_ALPHA = 1.702
_CLAMP_LIMIT = 7.0


def _gelu(x):
    return jax.nn.gelu(x, approximate=True)


def _qgelu(x):
    return x * jax.nn.sigmoid(_QUICK_GELU_ALPHA * x)


def _srelu(x):
    return jnp.square(jax.nn.relu(x))


PLAIN: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": _gelu,
    "qgelu": _qgelu,
    "relu": jax.nn.relu,
    "srelu": _srelu,
    "silu": jax.nn.silu,
}


def _clamped_swiglu(a, b):
    a = jnp.minimum(a, _CLAMP_LIMIT)
    return _qgelu(a) * (jnp.clip(b, -_CLAMP_LIMIT, _CLAMP_LIMIT) + 1.0)


GATED: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "swiglu": lambda a, b: jax.nn.silu(a) * b,
    "geglu": lambda a, b: _gelu(a) * b,
    "reglu": lambda a, b: jax.nn.relu(a) * b,
    "sreglu": lambda a, b: _srelu(a) * b,
    "qgeglu": lambda a, b: _qgelu(a) * b,
    "clamped_swiglu": _clamped_swiglu,
}

ACTIVATIONS: tuple[str, ...] = (*GATED, *PLAIN)


def check_activation(activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, got {activation!r}")


def is_gated(activation: str) -> bool:
    check_activation(activation)
    return activation in GATED


def activate(h: jax.Array, activation: str) -> jax.Array:
    """float32 activation of h (…, 2F) for gated activations, (…, F) for plain ones."""
    h = h.astype(jnp.float32)
    if is_gated(activation):
        a, b = jnp.split(h, 2, axis=-1)
        return GATED[activation](a, b)
    return PLAIN[activation](h)


def scaled_activation(h: jax.Array, probs: jax.Array | None, activation: str, dtype) -> jax.Array:
    """act(h) · probs[:, None] in float32, rounded once to `dtype` (the FC2 input)."""
    out = activate(h, activation)
    if probs is not None:
        out = out * probs.astype(jnp.float32)[:, None]
    return out.astype(dtype)
