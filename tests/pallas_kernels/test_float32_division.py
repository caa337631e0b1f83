"""The integer-only float32 division that every scale rule uses, against NumPy's IEEE division."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.float32_division import _significand_quotient, divide


def _ieee(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return (a / b).view(np.uint32)  # NumPy divides on the host FPU: IEEE, subnormals kept


def _same_bits(got: np.ndarray, want: np.ndarray) -> None:
    got = np.asarray(got).view(np.uint32)
    both_nan = np.isnan(got.view(np.float32)) & np.isnan(want.view(np.float32))
    bad = np.flatnonzero((got != want) & ~both_nan)
    assert bad.size == 0, (
        f"{bad.size} quotients differ; first: got {got[bad[0]]:#x}, want {want[bad[0]]:#x}"
    )


@pytest.mark.parametrize("seed", range(3))
def test_random_bit_patterns_match_ieee_division(seed):
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    b = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    _same_bits(jax.jit(divide)(a, b), _ieee(a, b))


def test_scale_shaped_quotients_and_edge_cases_match():
    """The quotients the scale rules take (constants over amaxes and back), subnormal results,
    ties, and every special operand."""
    rng = np.random.default_rng(7)
    amax = np.exp2(rng.uniform(-149, 128, 100_000)).astype(np.float32)
    specials = np.array(
        [
            0.0,
            -0.0,
            np.inf,
            -np.inf,
            np.nan,
            1.0,
            3.0,
            2.0**-149,
            2.0**-126,
            2.0**127,
            np.finfo(np.float32).max,
            448.0,
            57344.0,
            2688.0,
            6.0,
        ],
        np.float32,
    )
    for numerator in (np.float32(448.0), np.float32(2688.0), np.float32(1.0)):
        _same_bits(jax.jit(divide)(numerator, amax), _ieee(numerator, amax))
        _same_bits(jax.jit(divide)(amax, numerator), _ieee(amax, numerator))
    a, b = np.meshgrid(specials, specials)
    _same_bits(jax.jit(divide)(a.ravel(), b.ravel()), _ieee(a.ravel(), b.ravel()))


def test_works_on_values_varying_over_a_shard_map_axis():
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    amax = np.linspace(1e-3, 10, 16, dtype=np.float32)

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x"))
    def per_shard(shard):
        return divide(jnp.float32(448.0), shard)

    sharded = jax.device_put(amax, jax.NamedSharding(mesh, jax.P("x")))
    _same_bits(jax.jit(per_shard)(sharded), _ieee(np.float32(448.0), amax))


def test_significand_quotient_is_the_long_division_quotient():
    rng = np.random.default_rng(5)
    a = rng.integers(2**23, 2**24, 200_000, dtype=np.uint64)
    b = rng.integers(2**23, 2**24, 200_000, dtype=np.uint64)
    edges = np.array([2**23, 2**23 + 1, 2**24 - 2, 2**24 - 1], np.uint64)
    a = np.concatenate([a, b[:1000], np.repeat(edges, 4)])  # includes a == b
    b = np.concatenate([b, b[:1000], np.tile(edges, 4)])
    got_quotient, got_sticky = jax.jit(_significand_quotient)(
        a.astype(np.uint32), b.astype(np.uint32)
    )
    np.testing.assert_array_equal(np.asarray(got_quotient), (a << np.uint64(26)) // b)
    np.testing.assert_array_equal(np.asarray(got_sticky), (a << np.uint64(26)) % b != 0)
