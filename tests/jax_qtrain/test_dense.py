"""`jax_qtrain.dense` and its overrides, after TE's tests/pytorch/test_backward_override.py.

Every comparison of y, dx, dw, db is bit-exact (uint views), like TE's
`assert_close(rtol=0, atol=0)`.
"""

import importlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import jax_qtrain as jq
from jax_qtrain.ops import INPUT, KERNEL
from jax_qtrain.ops.dense import stochastic_rounding_key
from jax_qtrain.ops.gemm import matmul_nt

from .gpu_compare import assert_same_result
from .lowered import fp8_gemm_precisions

RECIPES = {
    "fp8": jq.Float8CurrentScaling(),
    "fp8_block": jq.Float8BlockScaling(),
    "mxfp8": jq.MXFP8BlockScaling(),
    "nvfp4": jq.NVFP4BlockScaling(),
}
MODES = [None, "high_precision", "dequantized"]


def make_inputs(shape=(2, 48, 128), out_features=96, dtype=jnp.bfloat16, seed=0):
    kx, kw, kb, kg = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(kx, shape, dtype)
    w = (jax.random.normal(kw, (shape[-1], out_features), jnp.float32) * 0.05).astype(dtype)
    b = jax.random.normal(kb, (out_features,), dtype)
    dy = jax.random.normal(kg, (*shape[:-1], out_features), dtype)
    return x, w, b, dy


def run(x, w, b, dy, recipe, **kwargs):
    """y and (dx, dw, db) through jax.vjp, jitted."""

    @jax.jit
    def f(x, w, b, dy):
        y, vjp = jax.vjp(lambda x, w, b: jq.dense(x, w, b, recipe=recipe, **kwargs), x, w, b)
        return y, vjp(dy)

    y, grads = f(x, w, b, dy)
    return (y, *grads)


def assert_bits_equal(a, b):
    for u, v in zip(a, b, strict=True):
        if u is None and v is None:
            continue
        assert u.dtype == v.dtype and u.shape == v.shape
        np.testing.assert_array_equal(
            np.asarray(u).view(np.uint8 if u.dtype.itemsize == 1 else f"u{u.dtype.itemsize}"),
            np.asarray(v).view(np.uint8 if v.dtype.itemsize == 1 else f"u{v.dtype.itemsize}"),
        )


# --- TE: dequantized ignores save_original_input --------------------------------------------------
@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("use_bias", [False, True])
def test_dequantized_ignores_save_original_input(name, use_bias):
    x, w, b, dy = make_inputs()
    b = b if use_bias else None
    recipe = RECIPES[name].replace(backward_override="dequantized")
    plain = run(x, w, b, dy, recipe, save_original_input=False)
    forced = run(x, w, b, dy, recipe, save_original_input=True)
    assert_bits_equal(plain, forced)


# --- TE: what each mode saves ---------------------------------------------------------------------
def residuals_by_name(recipe, x, w, b, **kwargs):
    res = jq.saved_residuals(lambda x, w, b: jq.dense(x, w, b, recipe=recipe, **kwargs), x, w, b)
    out = {}
    for r in res:
        out.setdefault(r.name, []).append(r)
    return out


def _dot_output_dtypes(fn, *args) -> list[str]:
    """The result dtypes of the dot_generals in `fn`'s jaxpr (custom_vjp rules included)."""
    text = str(jax.make_jaxpr(fn)(*args))
    return [
        line.split("=")[0].split(":")[-1].split("[")[0].strip()
        for line in text.splitlines()
        if "dot_general[" in line
    ]


def _trace_as_on(platform: str, monkeypatch) -> None:
    """Trace GEMMs as on `platform`: on the GPU a bf16 GEMM rounds its own output
    (ops/gemm.py `_gemm_rounds_its_output`, read at trace time)."""
    gemm = importlib.import_module("jax_qtrain.ops.gemm")
    monkeypatch.setattr(gemm, "_gemm_rounds_its_output", lambda: platform == "gpu")


@pytest.mark.parametrize("platform", ["gpu", "cpu"])
@pytest.mark.parametrize("mode", [None, "high_precision", "dequantized"])
def test_bf16_gemms_round_their_own_output_on_the_gpu(mode, platform, monkeypatch):
    # On the GPU the unquantized layer's bf16 GEMMs, the overrides' backward GEMMs and MXFP8's
    # return bf16 from the GEMM instead of a float32 product rounded in a second pass, which XLA
    # wrote and re-read: 1.13-1.18x the GEMM's time on an H100 (benchmarks/dense_output_ab.py).
    # The CPU keeps the float32 product, rounded explicitly (ops/gemm.py says why).
    x, w, b, dy = make_inputs()
    recipe = None if mode is None else RECIPES["mxfp8"].replace(backward_override=mode)

    def loss(x, w):
        return jnp.sum(jq.dense(x, w, recipe=recipe).astype(jnp.float32) * dy)

    _trace_as_on(platform, monkeypatch)
    rounded_by_the_gemm = "bf16" if platform == "gpu" else "f32"
    assert _dot_output_dtypes(jax.grad(loss, argnums=(0, 1)), x, w) == [rounded_by_the_gemm] * 3
    if mode is None:
        # A bias is added to the float32 product, then rounded once.
        assert _dot_output_dtypes(lambda x, w, b: jq.dense(x, w, b), x, w, b) == ["f32"]
        # A float32 operand makes it a float32 GEMM.
        assert _dot_output_dtypes(jq.dense, x.astype(jnp.float32), w) == ["f32"]


@pytest.mark.parametrize("platform", ["gpu", "cpu"])
def test_nvfp4_gemms_keep_the_float32_product_for_its_global_scales(platform, monkeypatch):
    # NVFP4's global scales multiply the float32 product before the rounding (matmul_nt).
    x, w, _, dy = make_inputs()

    def loss(x, w):
        return jnp.sum(jq.dense(x, w, recipe=RECIPES["nvfp4"]).astype(jnp.float32) * dy)

    _trace_as_on(platform, monkeypatch)
    assert _dot_output_dtypes(jax.grad(loss, argnums=(0, 1)), x, w) == ["f32"] * 3


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("save_original_input", [False, True])
def test_high_precision_saves_raw_operands(name, save_original_input):
    x, w, b, _ = make_inputs()
    recipe = RECIPES[name].replace(backward_override="high_precision")
    saved = residuals_by_name(recipe, x, w, b, save_original_input=save_original_input)
    assert set(saved) == {INPUT, KERNEL}
    [inp], [ker] = saved[INPUT], saved[KERNEL]
    assert (inp.shape, inp.dtype) == ((96, 128), x.dtype)  # the raw x, as (M, K)
    assert (ker.shape, ker.dtype) == (w.shape, w.dtype)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_dequantized_saves_forward_quantized_rowwise_only(name):
    x, w, b, _ = make_inputs()
    recipe = RECIPES[name].replace(backward_override="dequantized")
    saved = residuals_by_name(recipe, x, w, b, save_original_input=True)
    q = jq.quantize(x.reshape(-1, 128), recipe, "input")  # the forward's rowwise copy
    expected = [(leaf.shape, leaf.dtype) for leaf in jax.tree_util.tree_leaves(q)]
    assert [(r.shape, r.dtype) for r in saved[INPUT]] == expected
    assert all(r.dtype.itemsize <= 4 for r in saved[INPUT])
    assert saved[INPUT][0].dtype != x.dtype  # codes, not the raw input
    qw = jq.quantize(w, recipe, "weight", rowwise=False, columnwise=True)
    assert [(r.shape, r.dtype) for r in saved[KERNEL]] == [
        (leaf.shape, leaf.dtype) for leaf in jax.tree_util.tree_leaves(qw)
    ]


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_default_saves_the_columnwise_copy_only(name):
    x, w, b, _ = make_inputs()
    recipe = RECIPES[name]
    saved = residuals_by_name(recipe, x, w, b)
    q = jq.quantize(x.reshape(-1, 128), recipe, "input", rowwise=False, columnwise=True)
    assert [(r.shape, r.dtype) for r in saved[INPUT]] == [
        (leaf.shape, leaf.dtype) for leaf in jax.tree_util.tree_leaves(q)
    ]
    data = saved[INPUT][0]
    assert data.shape[0] == 128  # transposed: (K, M)
    # With save_original_input the raw x is saved instead.
    raw = residuals_by_name(recipe, x, w, b, save_original_input=True)[INPUT]
    assert [(r.shape, r.dtype) for r in raw] == [((96, 128), x.dtype)]


# --- TE: results against references written from the formulas -----------------------------------
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_dequantized_matches_gemms_on_dequantized_saved_operands(name):
    x, w, b, dy = make_inputs()
    recipe = RECIPES[name].replace(backward_override="dequantized")
    y, dx, dw, db = run(x, w, b, dy, recipe)

    x2d, dy2d = x.reshape(-1, 128), dy.reshape(-1, 96)
    qx = jq.quantize(x2d, recipe, "input")
    qw = jq.quantize(w, recipe, "weight", rowwise=False, columnwise=True)
    x_dq = qx.dequantize("rowwise", jnp.bfloat16)
    w_dq = qw.dequantize("columnwise", jnp.bfloat16)
    f32 = jnp.float32
    dx_ref = lax.dot_general(dy2d, w_dq, (((1,), (1,)), ((), ())), preferred_element_type=f32)
    dw_ref = lax.dot_general(x_dq, dy2d, (((0,), (0,)), ((), ())), preferred_element_type=f32)
    db_ref = dy2d.astype(f32).sum(0)
    assert_same_result(
        (dx, dw, db),
        (dx_ref.astype(x.dtype).reshape(x.shape), dw_ref.astype(w.dtype), db_ref.astype(b.dtype)),
    )
    # The forward is the default mode's forward.
    assert_bits_equal((y,), (run(x, w, b, dy, RECIPES[name])[0],))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_high_precision_grads_equal_the_unquantized_layer(name):
    x, w, b, dy = make_inputs()
    y, dx, dw, db = run(x, w, b, dy, RECIPES[name].replace(backward_override="high_precision"))
    _, *plain_grads = run(x, w, b, dy, None)  # no recipe, no autocast: high precision
    assert_bits_equal((dx, dw, db), plain_grads)
    assert_bits_equal((y,), (run(x, w, b, dy, RECIPES[name])[0],))


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("save_original_input", [False, True])
def test_default_mode_matches_a_reference_built_from_the_quantizers(name, save_original_input):
    x, w, b, dy = make_inputs()
    recipe = RECIPES[name]
    y, dx, dw, db = run(x, w, b, dy, recipe, save_original_input=save_original_input)

    @jax.jit  # jitted like the op, so XLA fuses (e.g. scale · acc + bias into an FMA) alike
    def reference(x, w, b, dy):
        x2d, dy2d = x.reshape(-1, 128), dy.reshape(-1, 96)
        m, k, n = 96, 128, 96
        qx = jq.quantize(x2d, recipe, "input", rowwise=True, columnwise=True)
        qw = jq.quantize(w, recipe, "weight", rowwise=True, columnwise=True)
        sr = recipe.spec("grad").stochastic_rounding
        key = stochastic_rounding_key(None, dy2d) if sr else None
        qdy = jq.quantize(dy2d, recipe, "grad", rowwise=True, columnwise=True, key=key)
        y_ref = matmul_nt(qx, "rowwise", qw, "columnwise", rows=m, cols=n) + b.astype(jnp.float32)
        dx_ref = matmul_nt(qdy, "rowwise", qw, "rowwise", rows=m, cols=k)
        dw_ref = matmul_nt(qx, "columnwise", qdy, "columnwise", rows=k, cols=n)
        return (
            y_ref.astype(x.dtype).reshape(y.shape),
            dx_ref.astype(x.dtype).reshape(x.shape),
            dw_ref.astype(w.dtype),
            dy2d.astype(jnp.float32).sum(0).astype(b.dtype),
        )

    assert_bits_equal((y, dx, dw, db), reference(x, w, b, dy))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_quantized_gradients_are_close_to_exact(name):
    x, w, b, dy = make_inputs(dtype=jnp.float32)
    exact = run(x, w, b, dy, None)
    for mode in MODES:
        got = run(x, w, b, dy, RECIPES[name].replace(backward_override=mode))
        for g, e in zip(got, exact, strict=True):
            rel = float(jnp.linalg.norm(g - e) / jnp.linalg.norm(e))
            assert rel < (0.25 if name == "nvfp4" else 0.06), (mode, rel)


def test_modes_differ_where_they_should():
    x, w, b, dy = make_inputs(dtype=jnp.float32)
    recipe = RECIPES["mxfp8"]
    default, high, deq = (run(x, w, b, dy, recipe.replace(backward_override=m)) for m in MODES)
    assert not np.array_equal(np.asarray(high[1]), np.asarray(deq[1]))
    assert not np.array_equal(np.asarray(default[1]), np.asarray(deq[1]))
    np.testing.assert_array_equal(np.asarray(high[0]), np.asarray(deq[0]))  # same forward


# --- FP8 GEMM accumulation (docs/design/gemm_accumulation.md) -----------------------------------
@pytest.mark.parametrize("split", [True, False])
def test_fprop_split_accumulator_sets_only_the_forward_gemm(split):
    x, w, b, dy = make_inputs()
    recipe = jq.Float8CurrentScaling(fprop_split_accumulator=split)

    def step(x, w, b, dy):
        y, vjp = jax.vjp(lambda x, w, b: jq.dense(x, w, b, recipe=recipe), x, w, b)
        return y, vjp(dy)

    assert fp8_gemm_precisions(step, x, w, b, dy) == {
        "fprop": "HIGHEST" if split else "DEFAULT",  # DEFAULT: cuBLASLt fast accumulation
        "dgrad": "HIGHEST",
        "wgrad": "HIGHEST",
    }
    # The CPU computes both alike; on the GPU fast accumulation moves y by ~1e-3 of its norm.
    default = run(x, w, b, dy, RECIPES["fp8"])
    y, *grads = run(x, w, b, dy, recipe)
    assert_same_result(y, default[0], gpu_rtol=5e-3, what="y")
    assert_same_result(tuple(grads), tuple(default[1:]), what="grads")
    with pytest.raises(ValueError, match="fprop_split_accumulator"):
        jq.Float8CurrentScaling(fprop_split_accumulator="yes")


# --- no stale traces -----------------------------------------------------------------------------
def test_switching_the_override_between_calls_gives_the_new_behaviour():
    x, w, b, dy = make_inputs()
    recipes = [RECIPES["fp8"].replace(backward_override=m) for m in (None, "dequantized", None)]

    @jax.jit
    def grads_under_autocast(x, w, b, dy):
        return jax.vjp(lambda x, w, b: jq.dense(x, w, b), x, w, b)[1](dy)

    results = []
    for recipe in recipes:
        with jq.autocast(recipe):
            results.append(grads_under_autocast(x, w, b, dy))
            # Another program than the explicit-recipe one: bit-exact on CPU, summation bound on
            # GPU (a stale trace of the other override lands percents away: E5M2 vs bf16 dy).
            assert_same_result(
                results[-1], run(x, w, b, dy, recipe)[1:], what=str(recipe.backward_override)
            )
    assert_bits_equal(results[0], results[2])  # the same compiled program
    assert not np.array_equal(np.asarray(results[0][0]), np.asarray(results[1][0]))


# --- jit, grad, vmap ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("mode", MODES)
def test_jit_grad_vmap(name, mode):
    recipe = RECIPES[name].replace(backward_override=mode)
    x, w, b, _ = make_inputs(shape=(3, 32, 64), out_features=32, dtype=jnp.float32)

    def loss(x, w, b):
        return jnp.sum(jq.dense(x, w, b, recipe=recipe) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    batched = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(0, None, None)))(x, w, b)
    for i in range(3):
        single = grad(x[i], w, b)
        for got, want in zip(batched, single, strict=True):
            got, want = np.asarray(got[i]), np.asarray(want)
            if name == "fp8" and jax.default_backend() == "gpu":
                # XLA's autotuner picks the batched and the single FP8 GEMM's cuBLASLt algorithm
                # on its own, from timings: on the H200 they agreed to 2e-5 in one run of the suite
                # (2026-11-29) and differed by up to 4.4e-3 (values near 10) in another (11-30).
                # Both are the same math summed differently; a wrong operand or scale is O(1).
                assert np.linalg.norm(got - want) <= 2e-3 * np.linalg.norm(want)
            else:
                # Batched and single GEMMs sum in different orders.
                np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_checkpoint_policies_select_named_residuals():
    x, w, b, dy = make_inputs(dtype=jnp.float32)
    recipe = RECIPES["mxfp8"]

    def f(x, w, b):
        return jq.dense(x, w, b, recipe=recipe)

    policy = jax.checkpoint_policies.save_only_these_names(INPUT)
    remat = jax.checkpoint(f, policy=policy)
    names = {r.name for r in jq.saved_residuals(remat, x, w, b)}
    assert INPUT in names and KERNEL not in names
    assert_same_result(run(x, w, b, dy, recipe)[1:], jax.vjp(remat, x, w, b)[1](dy))


# --- autocast -------------------------------------------------------------------------------------
def test_autocast_nesting_and_layer_recipe_wins():
    assert jq.current_recipe() is None
    with jq.autocast(RECIPES["nvfp4"]):
        assert jq.current_recipe() == RECIPES["nvfp4"]
        with jq.autocast(RECIPES["mxfp8"]):
            assert jq.current_recipe() == RECIPES["mxfp8"]
        with jq.autocast(None):
            assert jq.current_recipe() is None
        assert jq.current_recipe() == RECIPES["nvfp4"]
    assert jq.current_recipe() is None
    x, w, b, dy = make_inputs()
    own = run(x, w, b, dy, RECIPES["mxfp8"])
    with jq.autocast(RECIPES["nvfp4"]):
        assert_bits_equal(run(x, w, b, dy, RECIPES["mxfp8"]), own)


def test_autocast_is_thread_local():
    seen = {}
    barrier = threading.Barrier(2)

    def worker(name):
        with jq.autocast(RECIPES[name]):
            barrier.wait()
            seen[name] = jq.current_recipe()

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("fp8", "mxfp8")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"fp8": RECIPES["fp8"], "mxfp8": RECIPES["mxfp8"]}


# --- Flax -----------------------------------------------------------------------------------------
def _train(model, steps=30):
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (256, 64), jnp.float32)
    target = jnp.tanh(x @ jax.random.normal(ky, (64, 32), jnp.float32) * 0.2)

    @nnx.jit
    def step(model, optimizer):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    return [float(step(model, optimizer)) for _ in range(steps)]


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_stock_nnx_linear_with_injected_dot_general_trains(name):
    model = nnx.Linear(64, 32, dot_general=jq.dot_general(RECIPES[name]), rngs=nnx.Rngs(0))
    losses = _train(model)
    assert losses[-1] < 0.5 * losses[0]


def test_nn_linear_matches_stock_linear_with_dot_general():
    x = jax.random.normal(jax.random.key(3), (4, 64), jnp.bfloat16)
    ours = jq.nn.Linear(64, 32, recipe=RECIPES["fp8_block"], dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    stock = nnx.Linear(
        64,
        32,
        dot_general=jq.dot_general(RECIPES["fp8_block"]),
        dtype=jnp.bfloat16,
        rngs=nnx.Rngs(0),
    )
    assert_bits_equal((ours(x),), (stock(x),))
    assert ours.kernel[...].dtype == jnp.float32  # param_dtype stays float32
    assert ours(x).dtype == jnp.bfloat16
    losses = _train(jq.nn.Linear(64, 32, recipe=RECIPES["nvfp4"], rngs=nnx.Rngs(0)))
    assert losses[-1] < 0.5 * losses[0]


def test_nnx_einsum_with_quantized_einsum_op():
    layer = nnx.Einsum(
        "bhd,hdk->bhk", (4, 16, 8), einsum_op=jq.einsum(RECIPES["mxfp8"]), rngs=nnx.Rngs(0)
    )
    x = jax.random.normal(jax.random.key(1), (5, 4, 16), jnp.float32)
    exact = jnp.einsum("bhd,hdk->bhk", x, layer.kernel[...])
    assert layer(x).shape == exact.shape
    assert float(jnp.linalg.norm(layer(x) - exact) / jnp.linalg.norm(exact)) < 0.06
    with pytest.raises(ValueError, match="summed over one operand"):
        jq.einsum(RECIPES["mxfp8"])("ab,cd->ac", x[0], x[0])


def test_nnx_linear_general_with_quantized_dot_general():
    # Two contracting axes flattened into K and two output axes into N: jq.dense on the
    # flattened operands, bit for bit (LinearGeneral adds its zero bias after the dot). Batch
    # axes take the vmap path that the einsum test above covers.
    recipe = RECIPES["mxfp8"]
    x = jax.random.normal(jax.random.key(0), (2, 4, 2, 32), jnp.float32)
    layer = nnx.LinearGeneral(
        (2, 32), (2, 16), axis=(-2, -1), dot_general=jq.dot_general(recipe), rngs=nnx.Rngs(0)
    )
    kernel = layer.kernel[...].reshape(64, 32)
    expected = jq.dense(x.reshape(8, 64), kernel, recipe=recipe).reshape(2, 4, 2, 16)
    assert_bits_equal((layer(x),), (expected,))
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(layer)
    assert grads.kernel[...].shape == (2, 32, 2, 16)
    assert bool(jnp.all(jnp.isfinite(grads.kernel[...]))) and bool(jnp.any(grads.kernel[...] != 0))


def test_the_factories_passed_as_the_op_say_how_to_call_them():
    # `dot_general=jq.dot_general` reads like `dot_general=lax.dot_general`; Flax then calls the
    # factory with (inputs, kernel, dims, precision=...).
    x = jnp.ones((2, 8))
    with pytest.raises(TypeError, match=r"Pass dot_general=jax_qtrain\.dot_general\(recipe\)"):
        nnx.Linear(8, 4, dot_general=jq.dot_general, rngs=nnx.Rngs(0))(x)
    einsum_layer = nnx.Einsum("bd,dh->bh", (8, 4), einsum_op=jq.einsum, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"Pass einsum_op=jax_qtrain\.einsum\(recipe\)"):
        einsum_layer(x)
    with pytest.raises(TypeError, match="called as the op itself"):
        jq.nn.dot_general(x)  # one array, no dims
    # Called as factories they still take the recipe by position or name.
    assert jq.dot_general(recipe=RECIPES["fp8"], save_original_input=True) == (
        jq.nn.QuantizedDotGeneral(RECIPES["fp8"], save_original_input=True)
    )
    assert nnx.Linear(8, 4, dot_general=jq.dot_general(), rngs=nnx.Rngs(0))(x).shape == (2, 4)


# --- bad input ------------------------------------------------------------------------------------
def test_bad_inputs_are_rejected_with_clear_errors():
    x, w, b, _ = make_inputs()
    with pytest.raises(ValueError, match="kernel must have shape"):
        jq.dense(x, w[None], recipe=RECIPES["fp8"])
    with pytest.raises(ValueError, match="in_features"):
        jq.dense(x, w[:64], recipe=RECIPES["fp8"])
    with pytest.raises(ValueError, match="bias must have shape"):
        jq.dense(x, w, b[:5], recipe=RECIPES["fp8"])
    with pytest.raises(TypeError, match="x must be"):
        jq.dense(x.astype(jnp.int32), w, recipe=RECIPES["fp8"])
    # A recipe's name is the likeliest wrong recipe: the error says how to make one from it.
    with pytest.raises(TypeError, match=r"got str; jax_qtrain\.recipe_from_name\('fp8'\)"):
        jq.dense(x, w, recipe="fp8")
    with pytest.raises(ValueError, match="backward_override"):
        RECIPES["fp8"].replace(backward_override="fp64")
    with pytest.raises(TypeError, match=r"recipe_from_name\('mxfp8'\)"):
        with jq.autocast("mxfp8"):
            pass
    # The layer refuses empty or non-int sizes as GroupedLinear and MoE do (nnx.Linear itself
    # would build a (0, 32) kernel).
    with pytest.raises(ValueError, match="in_features must be a positive int, got 0"):
        jq.nn.Linear(0, 32, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"out_features must be a positive int, got 2\.0"):
        jq.nn.Linear(64, 2.0, rngs=nnx.Rngs(0))
    assert jq.nn.Linear(np.int64(64), 32, rngs=nnx.Rngs(0)).kernel.shape == (64, 32)
