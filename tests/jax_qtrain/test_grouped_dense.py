"""`jax_qtrain.grouped_dense` (TE's GroupedLinear), after TE's test_backward_override.py.

Every test compiles its op once per (recipe, mode) and feeds group_sizes as a traced argument,
so the TE splits [32]*4, [64, 0, 32, 32], [1, 31, 0, 96] and [64, 192, 0, 128] all run through
one program (M = 384 rows; rows past sum(group_sizes) must come out as zeros).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_qtrain as jq
from jax_qtrain.ops import GROUP_SIZES, INPUT, KERNEL, SR_KEY
from jax_qtrain.ops.grouped_quantize import token_alignment

from .grouped_common import (
    RECIPES,
    assert_bits_equal,
    assert_equal_up_to_summation_order,
    copy_bytes,
    group_slices,
    padded_rows,
    reference_ragged_dot,
    residual_bytes_by_name,
)

NUM_ROWS, IN_FEATURES, OUT_FEATURES, GROUPS = 384, 128, 96, 4
TE_SPLITS = {
    "32x4": [32, 32, 32, 32],
    "64-0-32-32": [64, 0, 32, 32],
    "1-31-0-96": [1, 31, 0, 96],
    "64-192-0-128": [64, 192, 0, 128],
}
# Equal non-empty groups (one dense program serves them all), an empty one, 24 rows past them.
LOOP_SIZES = [120, 0, 120, 120]
KEY = jax.random.key(11)
# dy (M, N) · W_g (K, N)ᵀ per group, and x_gᵀ · dy_g (the groups split the contraction).
RAGGED_NT = lax.RaggedDotDimensionNumbers((((1,), (2,)), ((), ())), [0], [0])
RAGGED_TN = lax.RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), [0], [])
VARIANTS = {  # (backward_override, save_original_input)
    "default": (None, False),
    "save_original_input": (None, True),
    "high_precision": ("high_precision", False),
    "dequantized": ("dequantized", False),
}


def make_inputs(seed=0, dtype=jnp.bfloat16):
    kx, kw, kb, kg = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(kx, (NUM_ROWS, IN_FEATURES), dtype)
    w = (jax.random.normal(kw, (GROUPS, IN_FEATURES, OUT_FEATURES), jnp.float32) * 0.05).astype(
        dtype
    )
    b = jax.random.normal(kb, (GROUPS, OUT_FEATURES), dtype)
    dy = jax.random.normal(kg, (NUM_ROWS, OUT_FEATURES), dtype)
    return x, w, b, dy


def sizes_array(sizes):
    return jnp.array(sizes, jnp.int32)


@functools.cache
def grouped_vjp(recipe, save_original_input=False):
    """Jitted (y, dx, dw, db) of grouped_dense; group_sizes is traced."""

    @jax.jit
    def run(x, w, b, dy, group_sizes):
        def f(x, w, b):
            return jq.grouped_dense(
                x,
                w,
                group_sizes,
                b,
                recipe=recipe,
                save_original_input=save_original_input,
                key=KEY,
            )

        y, vjp = jax.vjp(f, x, w, b)
        return (y, *vjp(dy))

    return run


@functools.cache
def dense_vjp(recipe, save_original_input=False):
    @jax.jit
    def run(x, w, b, dy, key):
        def f(x, w, b):
            return jq.dense(
                x, w, b, recipe=recipe, save_original_input=save_original_input, key=key
            )

        y, vjp = jax.vjp(f, x, w, b)
        return (y, *vjp(dy))

    return run


def recipe_of(name, variant):
    mode, save_original_input = VARIANTS[variant]
    return RECIPES[name].replace(backward_override=mode), save_original_input


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


# --- against a loop of dense, one call per expert ------------------------------------------------
@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_a_loop_of_dense(name, variant):
    """Each group of x (and dy) is quantized as its own tensor and each expert's weight on its
    own, so every expert computes exactly what `dense` computes on its rows; NVFP4's stochastic
    rounding is keyed per group, fold_in(key, g)."""
    recipe, soi = recipe_of(name, variant)
    x, w, b, dy = make_inputs()
    y, dx, dw, db = grouped_vjp(recipe, soi)(x, w, b, dy, sizes_array(LOOP_SIZES))
    for g, rows in enumerate(group_slices(LOOP_SIZES)):
        if LOOP_SIZES[g] == 0:
            np.testing.assert_array_equal(dw[g], 0)
            np.testing.assert_array_equal(db[g], 0)
            continue
        want = dense_vjp(recipe, soi)(x[rows], w[g], b[g], dy[rows], jax.random.fold_in(KEY, g))
        for what, got, ref in zip(
            ("y", "dx", "dw", "db"), (y[rows], dx[rows], dw[g], db[g]), want, strict=True
        ):
            assert_equal_up_to_summation_order(got, ref, f"group {g} {what}")
    np.testing.assert_array_equal(y[360:], 0)  # rows past the groups
    np.testing.assert_array_equal(dx[360:], 0)

    # and the quantization error is what the format allows
    exact = grouped_vjp(None)(x, w, b, dy, sizes_array(LOOP_SIZES))
    bound = 0.25 if name == "nvfp4" else 0.07
    for got, ref in zip((y, dx, dw), exact[:3], strict=True):
        assert relative_error(got, ref) < bound


# --- TE: test_grouped_linear_backward_override_* --------------------------------------------------
def residuals_by_name(recipe, x, w, b, group_sizes, **kwargs):
    def f(x, w, b):
        return jq.grouped_dense(x, w, group_sizes, b, recipe=recipe, key=KEY, **kwargs)

    out = {}
    for r in jq.saved_residuals(f, x, w, b):
        out.setdefault(r.name, []).append(r)
    return out


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_grouped_linear_backward_override_dequantized_ignores_save_original_input(name):
    """TE splits [64, 64]: every saved input is the forward's rowwise-only quantized copy, and
    y, dx, dw, db are identical with save_original_input True and False."""
    recipe, _ = recipe_of(name, "dequantized")
    x, w, b, dy = make_inputs(seed=1)
    group_sizes = sizes_array([64, 64, 0, 0])
    plain = grouped_vjp(recipe, False)(x, w, b, dy, group_sizes)
    forced = grouped_vjp(recipe, True)(x, w, b, dy, group_sizes)
    for got, want in zip(forced, plain, strict=True):
        assert_bits_equal(got, want)
    saved = residuals_by_name(recipe, x, w, b, group_sizes, save_original_input=True)
    aligned = padded_rows(NUM_ROWS, GROUPS, token_alignment(recipe))
    data = saved[INPUT][0]
    assert data.dtype != x.dtype and data.shape[0] == aligned  # rowwise (P, K'), quantized
    assert sum(r.nbytes for r in saved[INPUT]) == copy_bytes(
        recipe.spec("input"), aligned, IN_FEATURES, per_tensor=GROUPS
    )


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_grouped_linear_backward_override_high_precision_forces_save_original_input(name):
    recipe, _ = recipe_of(name, "high_precision")
    x, w, b, _ = make_inputs()
    saved = residuals_by_name(recipe, x, w, b, sizes_array([64, 64, 0, 0]))
    assert [(r.shape, r.dtype) for r in saved[INPUT]] == [(x.shape, x.dtype)]  # the raw x
    assert [(r.shape, r.dtype) for r in saved[KERNEL]] == [(w.shape, w.dtype)]  # raw weights


@functools.cache
def dequantized_operands(recipe):
    """The forward-quantized operands, dequantized to bf16: x's rowwise copy per group, each
    expert's columnwise copy (what "dequantized" must run its backward GEMMs on)."""

    @jax.jit
    def run(x, w, group_sizes):
        layout = jq.group_layout(group_sizes, NUM_ROWS, token_alignment(recipe))
        qx = jq.grouped_quantize(x, recipe, "input", layout)
        qw = jq.quantize_per_expert(w, recipe, rowwise=False, columnwise=True)
        w_values = jax.vmap(lambda q: q.dequantize("columnwise", jnp.bfloat16))(qw)
        return qx.dequantize("rowwise", layout, jnp.bfloat16), w_values

    return run


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("mode", ["high_precision", "dequantized"])
def test_grouped_linear_backward_override_matches_reference(name, mode):
    """y equals the default mode's y; "high_precision" gives the unquantized layer's grads;
    "dequantized" gives per-group GEMMs on the dequantized saved operands."""
    recipe = RECIPES[name].replace(backward_override=mode)
    x, w, b, dy = make_inputs(seed=2)
    f32 = jnp.float32
    for split, sizes in TE_SPLITS.items():
        group_sizes = sizes_array(sizes)
        y, dx, dw, db = grouped_vjp(recipe)(x, w, b, dy, group_sizes)
        assert_bits_equal(y, grouped_vjp(RECIPES[name])(x, w, b, dy, group_sizes)[0], split)
        total = sum(sizes)
        np.testing.assert_array_equal(dx[total:], 0)
        if mode == "high_precision":
            _, *plain = grouped_vjp(None)(x, w, b, dy, group_sizes)
            for got, want in zip((dx, dw, db), plain, strict=True):
                assert_equal_up_to_summation_order(got, want, split)
            continue
        # GEMMs on the dequantized saved operands (the same ragged GEMMs: exact), and per-group
        # dense GEMMs on them (TE's general_gemm per group: up to summation order).
        x_values, w_values = dequantized_operands(RECIPES[name])(x, w, group_sizes)
        dx_ref = reference_ragged_dot(dy, w_values, group_sizes, RAGGED_NT).astype(x.dtype)
        dw_ref = reference_ragged_dot(x_values, dy, group_sizes, RAGGED_TN).astype(w.dtype)
        assert_bits_equal(dx, dx_ref, split)
        assert_bits_equal(dw, dw_ref, split)
        for g, rows in enumerate(group_slices(sizes)):
            if sizes[g] == 0:
                np.testing.assert_array_equal(dw[g], 0)
                continue
            per_group_dx = lax.dot_general(
                dy[rows], w_values[g], (((1,), (1,)), ((), ())), preferred_element_type=f32
            )
            assert_equal_up_to_summation_order(dx[rows], per_group_dx.astype(x.dtype), split)
            db_ref = jnp.sum(dy[rows].astype(f32), axis=0).astype(b.dtype)
            np.testing.assert_allclose(np.asarray(db[g], f32), np.asarray(db_ref, f32), rtol=1e-2)


# --- what each mode saves, by name and bytes ------------------------------------------------------
@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_residuals_by_name_and_bytes(name, variant):
    recipe, soi = recipe_of(name, variant)
    x, w, b, _ = make_inputs()
    saved = residuals_by_name(recipe, x, w, b, sizes_array(LOOP_SIZES), save_original_input=soi)
    aligned = padded_rows(NUM_ROWS, GROUPS, token_alignment(recipe))
    x_spec, w_spec = recipe.spec("input"), recipe.spec("weight")
    raw_x, raw_w = x.size * 2, w.size * 2
    experts = dict(batch=GROUPS, per_tensor=GROUPS)
    expected_input, expected_kernel = {
        "default": (
            copy_bytes(x_spec, IN_FEATURES, aligned, per_tensor=GROUPS),  # columnwise (K, P)
            copy_bytes(w_spec, IN_FEATURES, OUT_FEATURES, **experts),  # rowwise (G, K, N)
        ),
        "save_original_input": (raw_x, copy_bytes(w_spec, IN_FEATURES, OUT_FEATURES, **experts)),
        "high_precision": (raw_x, raw_w),
        "dequantized": (
            copy_bytes(x_spec, aligned, IN_FEATURES, per_tensor=GROUPS),  # rowwise (P, K)
            copy_bytes(w_spec, OUT_FEATURES, IN_FEATURES, **experts),  # columnwise (G, N, K)
        ),
    }[variant]
    assert residual_bytes_by_name([r for rs in saved.values() for r in rs]) == {
        INPUT: expected_input,
        KERNEL: expected_kernel,
        GROUP_SIZES: 4 * GROUPS,
        SR_KEY: 8,
    }
    if variant == "default":  # only the columnwise (wgrad) copy of x: stored (K, P)
        assert saved[INPUT][0].shape[0] == IN_FEATURES


def test_checkpoint_policies_select_the_named_residuals():
    recipe = RECIPES["mxfp8"]
    x, w, b, _ = make_inputs()
    group_sizes = sizes_array(LOOP_SIZES)

    def f(x, w, b):
        return jq.grouped_dense(x, w, group_sizes, b, recipe=recipe)

    remat = jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names(INPUT))
    names = {r.name for r in jq.saved_residuals(remat, x, w, b)}
    assert INPUT in names and KERNEL not in names and GROUP_SIZES not in names


# --- group sizes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_all_tokens_to_one_expert_and_no_tokens_at_all(name):
    recipe = RECIPES[name]
    x, w, b, dy = make_inputs(seed=3)
    y, dx, dw, db = grouped_vjp(recipe)(x, w, b, dy, sizes_array([0, NUM_ROWS, 0, 0]))
    want = dense_vjp(recipe)(x, w[1], b[1], dy, jax.random.fold_in(KEY, 1))
    for got, ref in zip((y, dx, dw[1], db[1]), want, strict=True):
        assert_equal_up_to_summation_order(got, ref)
    for g in (0, 2, 3):
        np.testing.assert_array_equal(dw[g], 0)
    for out in grouped_vjp(recipe)(x, w, b, dy, sizes_array([0, 0, 0, 0])):
        np.testing.assert_array_equal(out, 0)


def test_run_time_group_sizes_are_clamped():
    """Negative sizes count as 0 and a running sum past the rows is truncated (the values are a
    device array: nothing can check them at trace time)."""
    run = grouped_vjp(RECIPES["mxfp8"])
    x, w, b, dy = make_inputs(seed=4)
    clamped = run(x, w, b, dy, sizes_array([0, 100, 284, 0]))
    for got, want in zip(run(x, w, b, dy, sizes_array([-3, 100, 400, 5])), clamped, strict=True):
        assert_bits_equal(got, want)


# --- recipes are static config of the custom_vjp ------------------------------------------------
def test_backward_uses_the_recipe_of_its_own_forward():
    """A forward under MXFP8, then another forward under NVFP4, then the first backward: it
    still runs MXFP8 (the recipe is a nondiff argument of the custom_vjp, never read from the
    autocast state in backward)."""
    x, w, _, dy = make_inputs(seed=5)
    group_sizes = sizes_array(LOOP_SIZES)

    @jax.jit
    def forward(x, w):
        return jax.vjp(lambda x, w: jq.grouped_dense(x, w, group_sizes, key=KEY), x, w)

    backward = jax.jit(lambda vjp, dy: vjp(dy))
    with jq.autocast(RECIPES["mxfp8"]):
        _, mxfp8_vjp = forward(x, w)
    with jq.autocast(RECIPES["nvfp4"]):
        _, nvfp4_vjp = forward(x, w)
        grads = backward(mxfp8_vjp, dy)
        nvfp4_grads = backward(nvfp4_vjp, dy)
    _, want_dx, want_dw, _ = grouped_vjp(RECIPES["mxfp8"])(
        x, w, jnp.zeros_like(w[:, 0]), dy, group_sizes
    )
    assert_bits_equal(grads[0], want_dx)
    assert_bits_equal(grads[1], want_dw)
    assert not np.array_equal(np.asarray(grads[1]), np.asarray(nvfp4_grads[1]))


def test_without_a_recipe_it_is_plain_ragged_dot():
    x, w, b, _ = make_inputs(seed=6)
    group_sizes = sizes_array(TE_SPLITS["1-31-0-96"])
    y = jq.grouped_dense(x, w, group_sizes, b)
    acc = reference_ragged_dot(x, w, group_sizes)
    row_bias = jnp.concatenate(
        [
            jnp.repeat(b, jnp.array([1, 31, 0, 96]), axis=0, total_repeat_length=128),
            jnp.zeros((256, OUT_FEATURES), b.dtype),
        ]
    )
    assert_bits_equal(y, (acc + row_bias.astype(jnp.float32)).astype(x.dtype))


# --- the public grouped_matmul ------------------------------------------------------------------
def test_grouped_matmul_reference_and_options():
    x, w, _, dy = make_inputs(seed=7)
    group_sizes = sizes_array(TE_SPLITS["64-192-0-128"])
    plain = jq.grouped_matmul(x, w, group_sizes)
    want = reference_ragged_dot(x, w, group_sizes)
    assert_bits_equal(plain, want.astype(x.dtype))
    transposed = jq.grouped_matmul(x, jnp.swapaxes(w, 1, 2), group_sizes, transpose_rhs=True)
    assert_equal_up_to_summation_order(transposed, plain)
    assert jq.grouped_matmul(x, w, group_sizes, out_dtype=jnp.float32).dtype == jnp.float32

    recipe = RECIPES["mxfp8"]
    layout = jq.group_layout(group_sizes, NUM_ROWS, token_alignment(recipe))
    qx = jq.grouped_quantize(x, recipe, "input", layout)
    qw = jq.quantize_per_expert(w, recipe, rowwise=True, columnwise=True)
    quantized = jq.grouped_matmul(qx, qw, group_sizes, backend="reference")
    assert_bits_equal(quantized, jq.grouped_dense(x, w, group_sizes, recipe=recipe))
    qdy = jq.grouped_quantize(dy, recipe, "grad", layout)
    dgrad = jq.grouped_matmul(qdy, qw, group_sizes, transpose_rhs=True)
    exact = jq.grouped_matmul(dy, w, group_sizes, transpose_rhs=True, out_dtype=jnp.float32)
    assert dgrad.shape == (NUM_ROWS, IN_FEATURES)
    assert relative_error(dgrad, exact) < 0.07

    with pytest.raises(NotImplementedError, match="pallas"):  # no kernel for float32 operands
        jq.grouped_matmul(x.astype(jnp.float32), w, group_sizes, backend="pallas")
    with pytest.raises(ValueError, match="backend"):
        jq.grouped_matmul(x, w, group_sizes, backend="cuda")
    with pytest.raises(TypeError, match="both be quantized"):
        jq.grouped_matmul(qx, w, group_sizes)
    with pytest.raises(ValueError, match="contraction"):
        jq.grouped_matmul(x, w, group_sizes, transpose_rhs=True)
    with pytest.raises(TypeError, match="group_sizes"):
        jq.grouped_matmul(x, w, group_sizes.astype(jnp.float32))


# --- bad input ------------------------------------------------------------------------------------
def test_bad_inputs_name_the_argument():
    x, w, b, _ = make_inputs()
    gs = sizes_array(LOOP_SIZES)
    recipe = RECIPES["fp8"]
    cases = [
        (ValueError, "x must have shape", lambda: jq.grouped_dense(x[None], w, gs, recipe=recipe)),
        (
            ValueError,
            "kernels must have shape",
            lambda: jq.grouped_dense(x, w[0], gs, recipe=recipe),
        ),
        (ValueError, "in_features", lambda: jq.grouped_dense(x[:, :64], w, gs, recipe=recipe)),
        (
            ValueError,
            "bias must have shape",
            lambda: jq.grouped_dense(x, w, gs, b[0], recipe=recipe),
        ),
        (
            TypeError,
            "group_sizes must have dtype int32",
            lambda: jq.grouped_dense(x, w, gs.astype(jnp.uint32), recipe=recipe),
        ),
        (  # a list is not an array (as for jnp's functions); the error shows the one to pass
            TypeError,
            r"got list \(e\.g\. jnp\.array\(\[96, 96, 96, 96\], jnp\.int32\)\)",
            lambda: jq.grouped_dense(x, w, [96, 96, 96, 96], recipe=recipe),
        ),
        (
            ValueError,
            r"group_sizes must have shape \(4,\)",
            lambda: jq.grouped_dense(x, w, gs[:3], recipe=recipe),
        ),
        (
            TypeError,
            "x must be",
            lambda: jq.grouped_dense(x.astype(jnp.int32), w, gs, recipe=recipe),
        ),
        (
            TypeError,
            "save_original_input",
            lambda: jq.grouped_dense(x, w, gs, recipe=recipe, save_original_input=1),
        ),
        (TypeError, "recipe", lambda: jq.grouped_dense(x, w, gs, recipe="fp8")),
        (ValueError, "at least one row", lambda: jq.grouped_dense(x[:0], w, gs, recipe=recipe)),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()


def test_host_group_sizes_are_checked_and_device_ones_clamped():
    # A numpy array's values are on the host: a negative size or a sum past the rows is an
    # error. The same values in a jax array are not read (that would wait for the device):
    # they are clamped, as the module docstring of ops/grouped_quantize.py says.
    x, w, _, _ = make_inputs()
    fc1 = jnp.concatenate([w, w], axis=-1)  # a gated MLP over the same shapes
    fc2 = jnp.swapaxes(w, 1, 2)
    recipe = RECIPES["fp8"]
    calls = {
        "grouped_matmul": lambda gs: jq.grouped_matmul(x, w, gs),
        "grouped_dense": lambda gs: jq.grouped_dense(x, w, gs, recipe=recipe),
        "grouped_mlp": lambda gs: jq.grouped_mlp(x, fc1, fc2, gs, recipe=recipe),
        "group_layout": lambda gs: jq.group_layout(gs, NUM_ROWS, 16).group_sizes,
    }
    negative = [130, -10, 120, 120]
    too_many = [120, 10, 120, 160]  # 410 rows of 384
    for name, call in calls.items():
        with pytest.raises(ValueError, match=r"group_sizes must not be negative.*-10"):
            call(np.array(negative, np.int32))
        with pytest.raises(ValueError, match="group_sizes sum to 410, more than the 384 rows"):
            call(np.array(too_many, np.int32))
        # Host values that pass: the same result as the jax array of them.
        host, device = call(np.array(LOOP_SIZES, np.int32)), call(sizes_array(LOOP_SIZES))
        np.testing.assert_array_equal(np.asarray(host), np.asarray(device), err_msg=name)
    # On the device, the clamped sizes: negative counts as 0, the last group gets what is left.
    for sizes, clamped in ((negative, [130, 0, 120, 120]), (too_many, [120, 10, 120, 134])):
        np.testing.assert_array_equal(
            np.asarray(jq.grouped_matmul(x, w, sizes_array(sizes))),
            np.asarray(jq.grouped_matmul(x, w, sizes_array(clamped))),
        )


@pytest.mark.parametrize("contraction", ["rows", "wgrad"])
def test_exact_values_gemm_gives_a_groups_rows_the_same_bits_without_the_later_groups(contraction):
    # Expert parallelism relies on it: a device holding experts 0 and 1 only must compute their
    # rows (and weight gradients) bit for bit as the whole op does. XLA:CPU's bfloat16
    # ragged_dot did not (over a thousand of these 96 x 64 outputs differed on an Intel host,
    # 2026-12-04), so off the GPU the reference widens bfloat16 values to float32 first. On the
    # GPU the property comes from the Pallas kernels (the default there): XLA:GPU's ragged_dot
    # is group-count dependent in bfloat16 and float32 alike (2075 and 1498 of these 6144
    # outputs differed on the H200, stop 42), so the test runs the kernels there.
    from jax_qtrain import kernels
    from jax_qtrain.ops import grouped_gemm

    rng = np.random.default_rng(5)
    sizes = np.array([40, 56, 24, 0, 30, 10, 0, 32])
    rows, cols, depth = int(sizes.sum()), 64, 64
    lhs = jnp.asarray(rng.standard_normal((rows, depth)), jnp.bfloat16)
    gemm = grouped_gemm._exact_values_gemm
    with kernels.gemm_backend("auto"):  # the kernels on the GPU, the reference elsewhere
        if contraction == "rows":
            rhs = jnp.asarray(rng.standard_normal((len(sizes), cols, depth)), jnp.bfloat16)
            numbers = grouped_gemm._NT_RAGGED_ROWS
            whole = gemm(lhs, rhs, jnp.asarray(sizes), numbers)
            part = gemm(lhs[:96], rhs[:2], jnp.asarray(sizes[:2]), numbers)
            assert_bits_equal(part, whole[:96], "rows of experts 0 and 1")
        else:
            dy = jnp.asarray(rng.standard_normal((rows, cols)), jnp.bfloat16)
            numbers = grouped_gemm._NT_RAGGED_CONTRACTION
            whole = gemm(lhs.T, dy.T, jnp.asarray(sizes), numbers)
            part = gemm(lhs[:96].T, dy[:96].T, jnp.asarray(sizes[:2]), numbers)
            assert_bits_equal(part, whole[:2], "weight gradients of experts 0 and 1")
