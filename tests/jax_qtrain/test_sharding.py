"""`jax_qtrain.sharding`: a split kernel gives the unsharded layer's bits, for every recipe and
backward override, with both gather strategies (8 virtual CPU devices, tests/conftest.py).

sharding_helpers.py explains the integer data that make every float32 sum exact."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_qtrain as jq
from jax_qtrain import sharding as jqs
from tests.jax_qtrain.lowered import fp8_gemm_precisions
from tests.jax_qtrain.sharding_helpers import (
    MODES,
    RECIPES,
    assert_bits_equal,
    bits,
    integer_tensor,
    kernel_shapes,
    layer_data,
    mesh_1d,
    mesh_2d,
    quantized_leaf_shapes,
    value_and_grads,
)

# (tokens, in_features, out_features) per recipe: 8 devices' tokens are whole blocks of the
# token-blocked copies (x's and dy's columnwise copies), and with a 4-way weight axis the shards
# are whole weight blocks along either kernel dim (128×128 for FP8 block, 32 for MXFP8, 16×16
# for NVFP4).
SHAPES = {
    "fp8": (64, 64, 32),
    "fp8_block": (1024, 512, 512),
    "mxfp8": (256, 128, 128),
    "nvfp4": (128, 64, 64),
    None: (64, 64, 32),
}
CASES = [(name, mode) for name in RECIPES for mode in MODES] + [(None, None)]


def _recipe(name, mode):
    return None if name is None else RECIPES[name].replace(backward_override=mode)


def _configurations(mode):
    """(label, sharding, x's rank) per mode: together they cover both strategies, both kernel
    dims, a 1-D mesh and a 2-D one (batch over data × fsdp, kernel over fsdp), 2-D and 3-D
    inputs, ordered (deterministic) reductions; the default mode, whose backward reads another
    copy than its forward, gets two."""
    two_d, one_d = mesh_2d(), mesh_1d()
    over_both = ("data", "fsdp")
    return {
        None: [
            (
                "quantize_then_gather, 2-D mesh, kernel_dim 0, 3-D x",
                jqs.WeightSharding(two_d, "fsdp", kernel_dim=0, batch_axes=over_both),
                3,
            ),
            (
                "gather_then_quantize, 1-D mesh, kernel_dim 1, deterministic",
                jqs.WeightSharding(
                    one_d,
                    "fsdp",
                    kernel_dim=1,
                    strategy="gather_then_quantize",
                    deterministic=True,
                ),
                2,
            ),
        ],
        "high_precision": [
            (
                "gather_then_quantize, 2-D mesh, kernel_dim 1",
                jqs.WeightSharding(
                    two_d,
                    "fsdp",
                    kernel_dim=1,
                    batch_axes=over_both,
                    strategy="gather_then_quantize",
                ),
                2,
            )
        ],
        "dequantized": [
            (
                "quantize_then_gather, 2-D mesh, batch over fsdp × data, kernel_dim 1",
                jqs.WeightSharding(two_d, "fsdp", kernel_dim=1, batch_axes=("fsdp", "data")),
                2,
            )
        ],
    }[mode]


@pytest.mark.parametrize("name, mode", CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_sharded_layer_equals_unsharded_bit_for_bit(name, mode):
    recipe = _recipe(name, mode)
    tokens, in_features, out_features = SHAPES[name]
    x, kernel, bias, dy = layer_data(name, (tokens, in_features), out_features)
    expected = value_and_grads(
        lambda x, k, b: jq.dense(x, k, b, recipe=recipe), x, kernel, bias, dy
    )
    for label, sharding, rank in _configurations(mode):
        # A 3-D x is the same rows: jax_qtrain.dense flattens leading dims.
        leading = (tokens // 4, 4) if rank == 3 else (tokens,)
        sharded = value_and_grads(
            lambda x, k, b, s=sharding: jqs.dense(x, k, b, sharding=s, recipe=recipe),
            x.reshape(*leading, in_features),
            kernel,
            bias,
            dy.reshape(*leading, out_features),
        )
        y, dx, dkernel, dbias = sharded
        flat = (y.reshape(tokens, out_features), dx.reshape(tokens, in_features), dkernel, dbias)
        assert_bits_equal(flat, expected, label)


def test_fast_fprop_accumulation_reaches_the_sharded_forward():
    recipe = jq.Float8CurrentScaling(fprop_split_accumulator=False)
    x, kernel, bias, dy = layer_data("fp8", (64, 128), 64)
    sharding = jqs.WeightSharding(mesh_1d(), "fsdp")

    def step(x, k, b, dy):
        y, vjp = jax.vjp(
            lambda x, k, b: jqs.dense(x, k, b, sharding=sharding, recipe=recipe), x, k, b
        )
        return y, vjp(dy)

    precisions = fp8_gemm_precisions(step, x, kernel, bias, dy)
    assert precisions == {"fprop": "DEFAULT", "dgrad": "HIGHEST", "wgrad": "HIGHEST"}


def test_a_local_amax_would_be_caught():
    """The data put the amax on one device: quantizing x with each device's own amax (what a
    missing amax reduction does) changes the output, so the equality above is meaningful."""
    x, _, _, _ = layer_data("fp8", (64, 64), 32)
    recipe = RECIPES["fp8"]
    whole = jq.quantize(x, recipe, "input").dequantize()
    first_device = jq.quantize(x[:8], recipe, "input").dequantize()
    other_device = jq.quantize(x[8:16], recipe, "input").dequantize()
    assert bool(jnp.all(first_device == whole[:8]))  # holds the amax
    assert not bool(jnp.all(other_device == whole[8:16]))


def test_random_data_forward_and_dgrad_exact_wgrad_within_summation_order():
    """On arbitrary data y and dx (per-row results) are still bit-exact; dW and db, sums over
    devices, agree up to float32 summation order."""
    kx, kw, kb, kdy = jax.random.split(jax.random.key(7), 4)
    x = jax.random.normal(kx, (256, 128), jnp.bfloat16)
    kernel = (jax.random.normal(kw, (128, 128)) * 0.05).astype(jnp.bfloat16)
    bias = jax.random.normal(kb, (128,), jnp.bfloat16)
    dy = jax.random.normal(kdy, (256, 128), jnp.bfloat16)
    recipe = RECIPES["nvfp4"]
    expected = value_and_grads(lambda *a: jq.dense(*a, recipe=recipe), x, kernel, bias, dy)
    sharding = jqs.WeightSharding(mesh_1d(), "fsdp")
    got = value_and_grads(
        lambda *a: jqs.dense(*a, sharding=sharding, recipe=recipe), x, kernel, bias, dy
    )
    assert_bits_equal(got[:2], expected[:2], "y, dx")
    for actual, reference in zip(got[2:], expected[2:], strict=True):
        np.testing.assert_allclose(
            np.asarray(actual, np.float32), np.asarray(reference, np.float32), rtol=2e-2, atol=1e-2
        )


# --- deterministic reductions ---------------------------------------------------------------------
def test_ordered_reductions_add_in_mesh_order():
    """ordered_psum / ordered_psum_scatter give, bit for bit, the left-to-right float32 sum of
    the devices' values in mesh order (on values where the order matters)."""
    from jax_qtrain.sharding.reductions import ordered_psum, ordered_psum_scatter

    mesh = mesh_1d(4)
    rng = np.random.default_rng(0)
    values = (rng.normal(size=(4, 8, 6)) * 10.0 ** rng.integers(-6, 6, (4, 8, 6))).astype(
        np.float32
    )
    expected = values[0]
    for device in range(1, 4):
        expected = expected + values[device]  # numpy float32, left to right

    def body(v):
        v = v[0]
        return ordered_psum(v, "fsdp")[None], ordered_psum_scatter(v, "fsdp", scatter_dimension=0)

    total, scattered = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=P("fsdp"),
            out_specs=(P("fsdp"), P("fsdp")),
        )
    )(jnp.asarray(values))
    for device in range(4):
        np.testing.assert_array_equal(bits(total[device]), bits(expected))
    np.testing.assert_array_equal(bits(scattered), bits(expected))
    assert not np.array_equal(expected, values[::-1].sum(0, dtype=np.float32))  # order matters


# --- the gathered quantized weight is the whole weight's quantization ----------------------------
@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("kernel_dim", [0, 1])
def test_quantized_shards_gather_to_the_whole_quantization(name, kernel_dim):
    """Strategy (b) in isolation: quantize shards (amax max-reduced over the axis), gather codes
    and scales; equal, bit for bit, to quantizing the whole kernel — both copies, every leaf."""
    recipe = RECIPES[name]
    shape = (512, 512) if name == "fp8_block" else (128, 128)
    kernel = jnp.asarray(
        integer_tensor(np.random.default_rng(3), shape, 21) * np.float32(0.37), jnp.float32
    )  # not exactly representable: the quantization really rounds
    mesh = mesh_1d(4)
    sharding = jqs.WeightSharding(mesh, "fsdp", kernel_dim=kernel_dim)

    def gathered(shard):
        return jqs.gather_and_quantize(
            shard,
            recipe,
            strategy="quantize_then_gather",
            axis_name="fsdp",
            kernel_dim=kernel_dim,
            rowwise=True,
            columnwise=True,
        )

    expected = jq.quantize(kernel, recipe, "weight", rowwise=True, columnwise=True)
    got = jax.jit(
        jax.shard_map(
            gathered,
            mesh=mesh,
            in_specs=sharding.kernel_spec(),
            out_specs=jax.sharding.PartitionSpec(),
            check_vma=False,
        )
    )(kernel)
    assert got.shape == expected.shape
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(bits(a), bits(b))


# --- what is saved for backward -----------------------------------------------------------------
OUT_FEATURES = 64


def _shard_rows(recipe) -> int:
    """Kernel rows per device: one weight block (128 for FP8 block, 32 for MXFP8, else 16)."""
    return {"fp8_block": 128, "mxfp8": 32}.get(None if recipe is None else recipe.name, 16)


def _per_device_residuals(recipe, strategy, *, policy=None):
    """Residuals of one device's fsdp_dense: x (32, in), kernel shard (rows, 64) of (8·rows, 64)
    on an 8-way axis."""
    rows = _shard_rows(recipe)

    def body(x, kernel_shard, bias):
        return jqs.fsdp_dense(
            x, kernel_shard, bias, axis_name="fsdp", strategy=strategy, recipe=recipe
        )

    fn = body if policy is None else jax.checkpoint(body, policy=policy)
    args = (
        jax.ShapeDtypeStruct((32, 8 * rows), jnp.bfloat16),
        jax.ShapeDtypeStruct((rows, OUT_FEATURES), jnp.bfloat16),
        jax.ShapeDtypeStruct((OUT_FEATURES,), jnp.bfloat16),
    )
    return jqs.per_device_saved_residuals(fn, mesh_1d(8), *args)


def _by_name(saved) -> dict[str, list]:
    by_name: dict[str, list] = {}
    for residual in saved:
        by_name.setdefault(residual.name, []).append((residual.shape, residual.dtype))
    return by_name


@pytest.mark.parametrize("name", [*sorted(RECIPES), None])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("strategy", jqs.STRATEGIES)
def test_residuals_are_named_and_the_kernel_residual_is_the_shard(name, mode, strategy):
    if name is None and mode is not None:
        pytest.skip("modes apply to quantized recipes")
    recipe = _recipe(name, mode)
    rows = _shard_rows(recipe)
    saved = _per_device_residuals(recipe, strategy)
    by_name = _by_name(saved)
    bf16 = jnp.dtype(jnp.bfloat16)

    # The kernel residual: the raw shard, or the quantized copy of the shard that backward
    # gathers.
    if strategy == "gather_then_quantize" or mode == "high_precision" or recipe is None:
        assert by_name[jq.ops.KERNEL] == [((rows, OUT_FEATURES), bf16)]
    else:
        usage = "rowwise" if mode is None else "columnwise"
        expected = quantized_leaf_shapes((rows, OUT_FEATURES), recipe, "weight", usage)
        assert by_name[jq.ops.KERNEL] == expected

    # The input residual: what jax_qtrain.dense saves for these rows.
    if recipe is None or mode == "high_precision":
        assert by_name[jq.ops.INPUT] == [((32, 8 * rows), bf16)]
    else:
        usage = "columnwise" if mode is None else "rowwise"
        assert by_name[jq.ops.INPUT] == quantized_leaf_shapes(
            (32, 8 * rows), recipe, "input", usage
        )

    # Nothing else, and never the gathered kernel in any form (the input residuals, checked
    # exactly above, may share a padded shape with it).
    assert set(by_name) == {jq.ops.INPUT, jq.ops.KERNEL}
    not_input = [r for r in saved if r.name != jq.ops.INPUT]
    assert not [
        r for r in not_input if r.shape in kernel_shapes((8 * rows, OUT_FEATURES), recipe)
    ], saved


# --- argument checks ----------------------------------------------------------------------------
def test_weight_sharding_rejects_bad_configuration():
    mesh = mesh_2d()
    with pytest.raises(ValueError, match="axis 'model' is not an axis of the mesh"):
        jqs.WeightSharding(mesh, "model")
    with pytest.raises(ValueError, match="batch_axes: 'pipe' is not an axis"):
        jqs.WeightSharding(mesh, "fsdp", batch_axes=("data", "pipe"))
    with pytest.raises(ValueError, match=r"batch_axes .* must include the kernel's axis 'fsdp'"):
        jqs.WeightSharding(mesh, "fsdp", batch_axes=("data",))
    with pytest.raises(ValueError, match="kernel_dim must be 0"):
        jqs.WeightSharding(mesh, "fsdp", kernel_dim=2)
    with pytest.raises(ValueError, match="strategy must be one of"):
        jqs.WeightSharding(mesh, "fsdp", strategy="gather")
    with pytest.raises(TypeError, match=r"mesh must be a jax\.sharding\.Mesh"):
        jqs.WeightSharding("mesh", "fsdp")
    with pytest.raises(ValueError, match="must not repeat"):
        jqs.WeightSharding(mesh, "fsdp", batch_axes=("fsdp", "fsdp"))


def test_unaligned_shard_is_a_clear_error_and_gather_then_quantize_handles_it():
    mesh = mesh_1d(8)
    x = jnp.ones((64, 128), jnp.bfloat16)
    kernel = jnp.ones((128, 64), jnp.bfloat16)  # shards of 16 rows: not whole 32-blocks
    recipe = RECIPES["mxfp8"]
    aligned_only = jqs.WeightSharding(mesh, "fsdp")
    with pytest.raises(ValueError, match=r"kernel_shard \(16, 64\).*block length 32.*gather_then"):
        jax.jit(lambda x, k: jqs.dense(x, k, sharding=aligned_only, recipe=recipe))(x, kernel)
    any_shard = jqs.WeightSharding(mesh, "fsdp", strategy="gather_then_quantize")
    got = jax.jit(lambda x, k: jqs.dense(x, k, sharding=any_shard, recipe=recipe))(x, kernel)
    np.testing.assert_array_equal(bits(got), bits(jq.dense(x, kernel, recipe=recipe)))


def test_mismatched_shapes_are_named():
    mesh = mesh_1d(8)
    sharding = jqs.WeightSharding(mesh, "fsdp")
    x = jnp.ones((64, 128), jnp.float32)
    kernel = jnp.ones((128, 32), jnp.float32)
    with pytest.raises(ValueError, match="x's last dim \\(128\\) must equal"):
        jqs.dense(x, jnp.ones((256, 32)), sharding=sharding)
    with pytest.raises(ValueError, match="bias must have the whole kernel's shape \\(32,\\)"):
        jqs.dense(x, kernel, jnp.ones((4,)), sharding=sharding)
    with pytest.raises(ValueError, match="x's batch dim \\(12\\) must be a multiple of 8"):
        jqs.dense(jnp.ones((12, 128)), kernel, sharding=sharding)
    with pytest.raises(ValueError, match="kernel \\(128, 12\\): dim 1 must be a multiple of 8"):
        jqs.dense(x, jnp.ones((128, 12)), sharding=jqs.WeightSharding(mesh, "fsdp", kernel_dim=1))
    with pytest.raises(ValueError, match="x must have a batch dim"):
        jqs.dense(jnp.ones((128,)), kernel, sharding=sharding)
    with pytest.raises(TypeError, match="sharding must be a WeightSharding"):
        jqs.dense(x, kernel, sharding=mesh)
    with pytest.raises(TypeError, match="kernel must be float32"):
        jqs.dense(x, kernel.astype(jnp.int32), sharding=sharding)


def test_fsdp_dense_outside_shard_map_names_the_axis():
    with pytest.raises(ValueError, match="axis_name: axis 'fsdp' is not bound"):
        jqs.fsdp_dense(jnp.ones((8, 16)), jnp.ones((2, 16)), axis_name="fsdp")
    with pytest.raises(ValueError, match=r"batch_axis_names .* must include axis_name 'fsdp'"):
        jqs.fsdp_dense(
            jnp.ones((8, 16)), jnp.ones((2, 16)), axis_name="fsdp", batch_axis_names="data"
        )


# --- bytes moved --------------------------------------------------------------------------------
def test_gather_bytes_are_exact():
    shape, p = (4096, 4096), 8
    elements = 4096 * 4096
    received = lambda nbytes: nbytes * (p - 1) // p
    raw = jqs.gather_bytes(
        shape, jnp.bfloat16, RECIPES["mxfp8"], strategy="gather_then_quantize", axis_size=p
    )
    assert (raw.forward, raw.backward) == (received(2 * elements),) * 2
    assert raw.grad_reduce_scatter == received(4 * elements)
    # MXFP8: one code byte plus one E8M0 byte per 32 elements, per copy.
    mx = jqs.gather_bytes(
        shape, jnp.bfloat16, RECIPES["mxfp8"], strategy="quantize_then_gather", axis_size=p
    )
    assert (mx.forward, mx.backward) == (received(elements + elements // 32),) * 2
    # NVFP4 weights: half a byte per element plus one E4M3 scale per 16×16 tile.
    nv = jqs.gather_bytes(
        shape, jnp.bfloat16, RECIPES["nvfp4"], strategy="quantize_then_gather", axis_size=p
    )
    assert nv.forward == received(elements // 2 + elements // 256)
    # high_precision reads the raw kernel in backward.
    hp = jqs.gather_bytes(
        shape,
        jnp.bfloat16,
        RECIPES["fp8"].replace(backward_override="high_precision"),
        strategy="quantize_then_gather",
        axis_size=p,
    )
    assert (hp.forward, hp.backward) == (received(elements), received(2 * elements))
    assert hp.total == hp.forward + hp.backward + hp.grad_reduce_scatter
