"""The fused grouped MLP (`jax_qtrain.grouped_mlp`): bit-exact against the unfused composition
(two grouped_dense calls around the activation, differentiated by JAX), and saving only what its
backward reads (seed 03: no rowwise data of saved NVFP4 inputs)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_qtrain as jq
from jax_qtrain.ops import (
    FC1_INPUT,
    FC1_KERNEL,
    FC2_INPUT,
    FC2_KERNEL,
    GROUP_SIZES,
    PRE_ACTIVATION,
    PROBS,
    SR_KEY,
)
from jax_qtrain.ops.activations import ACTIVATIONS, activate, is_gated
from jax_qtrain.ops.grouped_mlp import unfused_grouped_mlp
from jax_qtrain.ops.grouped_quantize import token_alignment

from .gpu_compare import REQUANTIZATION, assert_same_result, requantization_rtol
from .grouped_common import (
    RECIPES,
    assert_bits_equal,
    copy_bytes,
    padded_rows,
    residual_bytes_by_name,
)

NUM_ROWS, HIDDEN, FFN, GROUPS = 160, 64, 64, 4
SIZES = [40, 0, 56, 40]  # an empty expert and 24 rows past the groups
KEY = jax.random.key(3)
VARIANTS = {
    "default": (None, False),
    "save_original_input": (None, True),
    "high_precision": ("high_precision", False),
    "dequantized": ("dequantized", False),
}


def make_inputs(activation="swiglu", groups=GROUPS, seed=0):
    kx, k1, k2, kp, kg = jax.random.split(jax.random.key(seed), 5)
    fc1_out = 2 * FFN if is_gated(activation) else FFN
    x = jax.random.normal(kx, (NUM_ROWS, HIDDEN), jnp.bfloat16)
    fc1 = (jax.random.normal(k1, (groups, HIDDEN, fc1_out)) * 0.15).astype(jnp.bfloat16)
    fc2 = (jax.random.normal(k2, (groups, FFN, HIDDEN)) * 0.15).astype(jnp.bfloat16)
    probs = jax.random.uniform(kp, (NUM_ROWS,), jnp.float32)
    dy = jax.random.normal(kg, (NUM_ROWS, HIDDEN), jnp.bfloat16)
    return x, fc1, fc2, probs, dy


@functools.cache
def mlp_vjp(fused, recipe, save_original_input=False, activation="swiglu", with_probs=True):
    """Jitted (y, dx, dfc1, dfc2, dprobs) of the fused op or of the unfused composition."""
    op = jq.grouped_mlp if fused else unfused_grouped_mlp

    @jax.jit
    def run(x, fc1, fc2, probs, dy, group_sizes):
        def f(x, fc1, fc2, probs):
            return op(
                x,
                fc1,
                fc2,
                group_sizes,
                probs if with_probs else None,
                activation,
                recipe=recipe,
                save_original_input=save_original_input,
                key=KEY,
            )

        y, vjp = jax.vjp(f, x, fc1, fc2, probs)
        return (y, *vjp(dy))

    return run


CASES = {
    **{f"{name}-default": (name, "default") for name in RECIPES},
    **{f"{name}-dequantized": (name, "dequantized") for name in RECIPES},
    "fp8-save_original_input": ("fp8", "save_original_input"),
    "nvfp4-save_original_input": ("nvfp4", "save_original_input"),
    "mxfp8-high_precision": ("mxfp8", "high_precision"),
    "nvfp4-high_precision": ("nvfp4", "high_precision"),
}


def recipe_of(name, variant):
    mode, save_original_input = VARIANTS[variant]
    return RECIPES[name].replace(backward_override=mode), save_original_input


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_equals_the_unfused_composition(case):
    recipe, soi = recipe_of(*CASES[case])
    x, fc1, fc2, probs, dy = make_inputs()
    group_sizes = jnp.array(SIZES, jnp.int32)
    fused = mlp_vjp(True, recipe, soi)(x, fc1, fc2, probs, dy, group_sizes)
    unfused = mlp_vjp(False, recipe, soi)(x, fc1, fc2, probs, dy, group_sizes)
    for what, got, want in zip(("y", "dx", "dfc1", "dfc2", "dprobs"), fused, unfused, strict=True):
        # on the GPU, within a requantization step (tests/jax_qtrain/gpu_compare.py)
        assert_same_result(got, want, gpu_rtol=requantization_rtol(CASES[case][0]), what=what)
    y, dx, dfc1, _, dprobs = fused
    np.testing.assert_array_equal(y[136:], 0)
    np.testing.assert_array_equal(dx[136:], 0)
    np.testing.assert_array_equal(dprobs[136:], 0)
    np.testing.assert_array_equal(dfc1[1], 0)  # the empty expert
    # and the quantization error is what the format allows through two quantized layers
    # (measured: NVFP4 0.22-0.32, the FP8 formats 0.065-0.092)
    exact = mlp_vjp(True, None)(x, fc1, fc2, probs, dy, group_sizes)
    bound = 0.4 if CASES[case][0] == "nvfp4" else 0.12
    for got, want in zip(fused, exact, strict=True):
        error = jnp.linalg.norm((got - want).astype(jnp.float32)) / jnp.linalg.norm(
            want.astype(jnp.float32)
        )
        assert float(error) < bound


def test_without_probs():
    recipe = RECIPES["fp8"]
    x, fc1, fc2, probs, dy = make_inputs()
    group_sizes = jnp.array(SIZES, jnp.int32)
    fused = mlp_vjp(True, recipe, with_probs=False)(x, fc1, fc2, probs, dy, group_sizes)
    unfused = mlp_vjp(False, recipe, with_probs=False)(x, fc1, fc2, probs, dy, group_sizes)
    for got, want in zip(fused, unfused, strict=True):
        assert_same_result(got, want, gpu_rtol=REQUANTIZATION)
    np.testing.assert_array_equal(fused[-1], 0)  # probs unused: zero gradient


@pytest.mark.parametrize("activation", ["geglu", "clamped_swiglu", "srelu"])
def test_other_activations_fused_equal_unfused(activation):
    recipe = RECIPES["mxfp8"]
    x, fc1, fc2, probs, dy = make_inputs(activation)
    x = x * 4  # reach the clamps of clamped_swiglu
    group_sizes = jnp.array(SIZES, jnp.int32)
    fused = mlp_vjp(True, recipe, activation=activation)(x, fc1, fc2, probs, dy, group_sizes)
    unfused = mlp_vjp(False, recipe, activation=activation)(x, fc1, fc2, probs, dy, group_sizes)
    for got, want in zip(fused, unfused, strict=True):
        assert_same_result(got, want, gpu_rtol=REQUANTIZATION)


def test_activations_follow_their_definitions():
    h = np.linspace(-9.0, 9.0, 2 * 37, dtype=np.float32).reshape(1, -1)
    a, b = h[:, :37], h[:, 37:]

    def sigmoid(v):
        return 1.0 / (1.0 + np.exp(-v))

    def gelu_tanh(v):
        return 0.5 * v * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (v + 0.044715 * v**3)))

    a_c = np.minimum(a, 7.0)
    expected = {
        "swiglu": a * sigmoid(a) * b,
        "geglu": gelu_tanh(a) * b,
        "reglu": np.maximum(a, 0) * b,
        "sreglu": np.maximum(a, 0) ** 2 * b,
        "qgeglu": a * sigmoid(1.702 * a) * b,
        "clamped_swiglu": a_c * sigmoid(1.702 * a_c) * (np.clip(b, -7.0, 7.0) + 1.0),
        "gelu": gelu_tanh(h),
        "qgelu": h * sigmoid(1.702 * h),
        "relu": np.maximum(h, 0),
        "srelu": np.maximum(h, 0) ** 2,
        "silu": h * sigmoid(h),
    }
    assert set(expected) == set(ACTIVATIONS)
    for name, want in expected.items():
        got = np.asarray(activate(jnp.asarray(h), name))
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-5, err_msg=name)
        zeros = activate(jnp.zeros((1, 4), jnp.float32), name)
        np.testing.assert_array_equal(zeros, 0)  # padding slots stay zero


# --- what it saves --------------------------------------------------------------------------------
def residuals(recipe, soi=False, groups=GROUPS, fused=True):
    x, fc1, fc2, probs, _ = make_inputs(groups=groups)
    group_sizes = jnp.full((groups,), NUM_ROWS // groups, jnp.int32)
    op = jq.grouped_mlp if fused else unfused_grouped_mlp

    def f(x, fc1, fc2, probs):
        return op(x, fc1, fc2, group_sizes, probs, recipe=recipe, save_original_input=soi, key=KEY)

    return jq.saved_residuals(f, x, fc1, fc2, probs)


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_residuals_by_name_and_bytes(name, variant):
    recipe, soi = recipe_of(name, variant)
    aligned = padded_rows(NUM_ROWS, GROUPS, token_alignment(recipe))
    x_spec, w_spec = recipe.spec("input"), recipe.spec("weight")
    experts = dict(batch=GROUPS, per_tensor=GROUPS)
    raw_x, raw_fc1, raw_fc2 = (
        NUM_ROWS * HIDDEN * 2,
        GROUPS * HIDDEN * 2 * FFN * 2,
        GROUPS * FFN * HIDDEN * 2,
    )
    always = {
        PRE_ACTIVATION: NUM_ROWS * 2 * FFN * 2,  # h in bfloat16
        PROBS: NUM_ROWS * 4,
        GROUP_SIZES: 4 * GROUPS,
        SR_KEY: 8,
    }
    expected = {
        "default": {
            FC1_INPUT: copy_bytes(x_spec, HIDDEN, aligned, per_tensor=GROUPS),  # x col (K, P)
            FC1_KERNEL: copy_bytes(w_spec, HIDDEN, 2 * FFN, **experts),  # fc1 row
            FC2_INPUT: copy_bytes(x_spec, FFN, aligned, per_tensor=GROUPS),  # a col (F, P)
            FC2_KERNEL: copy_bytes(w_spec, FFN, HIDDEN, **experts),  # fc2 row
        },
        "save_original_input": {
            FC1_INPUT: raw_x,
            FC1_KERNEL: copy_bytes(w_spec, HIDDEN, 2 * FFN, **experts),
            FC2_KERNEL: copy_bytes(w_spec, FFN, HIDDEN, **experts),
        },
        "high_precision": {FC1_INPUT: raw_x, FC1_KERNEL: raw_fc1, FC2_KERNEL: raw_fc2},
        "dequantized": {
            FC1_INPUT: copy_bytes(x_spec, aligned, HIDDEN, per_tensor=GROUPS),  # x row (P, K)
            FC1_KERNEL: copy_bytes(w_spec, 2 * FFN, HIDDEN, **experts),  # fc1 col
            FC2_INPUT: copy_bytes(x_spec, aligned, FFN, per_tensor=GROUPS),  # a row (P, F)
            FC2_KERNEL: copy_bytes(w_spec, HIDDEN, FFN, **experts),  # fc2 col
        },
    }[variant]
    assert residual_bytes_by_name(residuals(recipe, soi)) == expected | always


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_fused_saves_less_than_the_unfused_composition(name):
    fused = sum(r.nbytes for r in residuals(RECIPES[name]))
    unfused = sum(r.nbytes for r in residuals(RECIPES[name], fused=False))
    assert fused < unfused


@pytest.mark.parametrize("groups", [1, 4])
def test_nvfp4_saves_one_fp4_data_and_one_scale_tensor_per_quantized_input(groups):
    """Seed 03's test_ops_grouped_mlp_nvfp4_saved_tensors: the rowwise data and scales of the
    saved inputs are pruned; what is left is the columnwise (wgrad) copy and its amaxes."""
    saved = residuals(RECIPES["nvfp4"], groups=groups)
    for name, features in ((FC1_INPUT, HIDDEN), (FC2_INPUT, FFN)):
        leaves = [r for r in saved if r.name == name]
        data = [r for r in leaves if r.dtype == np.uint8]
        scales = [r for r in leaves if r.dtype == jnp.float8_e4m3fn]
        amaxes = [r for r in leaves if r.dtype == np.float32]
        assert len(data) == 1 and len(scales) == 1 and len(amaxes) == 1 and len(leaves) == 3
        assert data[0].shape[0] == features  # the columnwise copy, stored (features, tokens/2)
        assert amaxes[0].shape == (groups,)  # one global amax per expert's tokens


# --- per-module recipes ---------------------------------------------------------------------------
def test_a_module_recipe_wins_over_the_global_autocast():
    """MXFP8 experts inside a global NVFP4 autocast stay MXFP8 (seed 03's per-module recipe)."""
    recipe = RECIPES["mxfp8"]
    x, fc1, fc2, probs, dy = make_inputs(seed=1)
    group_sizes = jnp.array(SIZES, jnp.int32)
    alone = mlp_vjp(True, recipe)(x, fc1, fc2, probs, dy, group_sizes)
    with jq.autocast(RECIPES["nvfp4"]):
        inside = mlp_vjp(True, recipe)(x, fc1, fc2, probs, dy, group_sizes)
        saved = jq.saved_residuals(
            lambda x: jq.grouped_mlp(x, fc1, fc2, group_sizes, probs, recipe=recipe), x
        )
    for got, want in zip(inside, alone, strict=True):
        assert_bits_equal(got, want)
    # x's saved copy is MXFP8's: E4M3 codes (K, P) with P aligned to 32, and E8M0 byte scales
    mxfp8_rows = padded_rows(NUM_ROWS, GROUPS, 32)
    assert [(r.shape, r.dtype) for r in saved if r.name == FC1_INPUT] == [
        ((HIDDEN, mxfp8_rows), jnp.float8_e4m3fn),
        ((HIDDEN, mxfp8_rows // 32), np.uint8),
    ]


def test_backward_uses_the_recipe_of_its_own_forward():
    """Seed 03: a backward after a second forward under NVFP4, and after one under no recipe,
    still uses the first forward's MXFP8 quantizers."""
    x, fc1, fc2, probs, dy = make_inputs(seed=2)
    group_sizes = jnp.array(SIZES, jnp.int32)

    @jax.jit
    def forward(x, fc1, fc2, probs):
        def f(x, fc1, fc2, probs):
            return jq.grouped_mlp(x, fc1, fc2, group_sizes, probs, key=KEY)

        return jax.vjp(f, x, fc1, fc2, probs)

    backward = jax.jit(lambda vjp, dy: vjp(dy))
    with jq.autocast(RECIPES["mxfp8"]):
        _, first = forward(x, fc1, fc2, probs)
    with jq.autocast(RECIPES["nvfp4"]):
        forward(x, fc1, fc2, probs)
        after_nvfp4 = backward(first, dy)
    forward(x, fc1, fc2, probs)  # no recipe
    after_none = backward(first, dy)
    want = mlp_vjp(True, RECIPES["mxfp8"])(x, fc1, fc2, probs, dy, group_sizes)[1:]
    for got in (after_nvfp4, after_none):
        for g, w in zip(got, want, strict=True):
            assert_bits_equal(g, w)


# --- bad input ------------------------------------------------------------------------------------
def test_bad_inputs_name_the_argument():
    x, fc1, fc2, probs, _ = make_inputs()
    gs = jnp.array(SIZES, jnp.int32)
    r = RECIPES["mxfp8"]
    cases = [
        (ValueError, "activation", lambda: jq.grouped_mlp(x, fc1, fc2, gs, activation="tanh")),
        (ValueError, "fc2 must have shape", lambda: jq.grouped_mlp(x, fc1, fc2[:, :8], gs)),
        (
            ValueError,
            "fc2 must have shape",
            lambda: jq.grouped_mlp(x, fc1, fc2, gs, activation="relu"),
        ),
        (ValueError, "must be even", lambda: jq.grouped_mlp(x, fc1[..., :7], fc2, gs)),
        (ValueError, "probs must have shape", lambda: jq.grouped_mlp(x, fc1, fc2, gs, probs[:5])),
        (ValueError, "the in_features of fc1", lambda: jq.grouped_mlp(x[:, :8], fc1, fc2, gs)),
        (ValueError, "group_sizes must have shape", lambda: jq.grouped_mlp(x, fc1, fc2, gs[:2])),
        (TypeError, "fc2 must be", lambda: jq.grouped_mlp(x, fc1, fc2.astype(jnp.int8), gs)),
        (TypeError, "recipe", lambda: jq.grouped_mlp(x, fc1, fc2, gs, recipe=r.name)),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()
