"""Per-group quantization in the aligned layout (ops/grouped_quantize.py).

The claim: group g of `grouped_quantize(x, ...)` holds bit for bit what `jq.quantize(x_g, ...)`
gives (TransformerEngine's split_quantize), for every format and role, both copies, including
NVFP4's Hadamard transform and stochastic rounding (group g keyed by fold_in(key, g)).
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import jax_qtrain as jq
from jax_qtrain import kernels
from jax_qtrain.ops.grouped_quantize import (
    clamp_group_sizes,
    quantize_aligned,
    token_alignment,
)

from .adversarial import adversarial_matrix
from .grouped_common import (
    ON_GPU,
    RECIPES,
    assert_bits_equal,
    bits,
    group_slices,
    padded_rows,
)

SIZES = [1, 31, 0, 96]  # unaligned, an empty group, and 12 rows past the groups
NUM_ROWS, FEATURES = 140, 96


def test_layout_puts_every_group_on_an_aligned_offset():
    layout = jq.group_layout(jnp.array(SIZES, jnp.int32), NUM_ROWS, 32)
    assert layout.padded_rows == padded_rows(NUM_ROWS, 4, 32) == 288
    np.testing.assert_array_equal(layout.aligned_starts, [0, 32, 64, 64])
    np.testing.assert_array_equal(layout.aligned_sizes, [32, 32, 0, 96])
    rows = np.arange(NUM_ROWS)
    expected_slot = np.concatenate([[0], 32 + np.arange(31), 64 + np.arange(96), [288] * 12])
    np.testing.assert_array_equal(layout.row_slot, expected_slot)
    np.testing.assert_array_equal(
        layout.row_group, np.minimum(np.searchsorted([1, 32, 32, 128], rows, "right"), 4)
    )
    x = jnp.arange(NUM_ROWS * 3, dtype=jnp.float32).reshape(NUM_ROWS, 3) + 1
    aligned = layout.to_aligned(x)
    assert int(jnp.sum(aligned != 0)) == 128 * 3  # rows past the groups are not copied
    back = layout.from_aligned(aligned)
    np.testing.assert_array_equal(back[:128], x[:128])
    np.testing.assert_array_equal(back[128:], 0)


@pytest.mark.parametrize("sizes", [SIZES, [-5, 50, 200, 7], [0, 0, 0, 0]])
def test_layout_with_align_1_is_the_identity_up_to_the_rows_past_the_groups(sizes):
    """FP8 per-tensor scaling's layout (align 1) masks instead of gathering: the same bits as
    the gathers through slot_source and row_slot, -0.0 and NaN rows included."""
    layout = jq.group_layout(jnp.array(sizes, jnp.int32), NUM_ROWS, 1)
    assert layout.padded_rows == NUM_ROWS
    x = jax.random.normal(jax.random.key(3), (NUM_ROWS, 2, 3), jnp.bfloat16)
    x = x.at[0].set(-0.0).at[1].set(jnp.nan)
    gathered = jnp.take(x, layout.slot_source, axis=0, mode="fill", fill_value=0)
    assert_bits_equal(layout.to_aligned(x), gathered)
    read_back = jnp.take(gathered, layout.row_slot, axis=0, mode="fill", fill_value=0)
    assert_bits_equal(layout.from_aligned(gathered), read_back)


def test_layout_clamps_run_time_group_sizes():
    """Values cannot be checked at trace time: negative sizes count as 0, sizes past the rows
    are truncated, as the Pallas kernels do."""
    sizes = jnp.array([-5, 50, 200, 7], jnp.int32)
    np.testing.assert_array_equal(clamp_group_sizes(sizes, 100), [0, 50, 50, 0])
    layout = jq.group_layout(sizes, 100, 16)
    np.testing.assert_array_equal(layout.group_sizes, [0, 50, 50, 0])
    np.testing.assert_array_equal(layout.aligned_starts, [0, 0, 64, 128])
    assert layout.padded_rows == padded_rows(100, 4, 16)


CASES = {
    **{
        f"{name}-{role}": (recipe, role)
        for name, recipe in RECIPES.items()
        for role in ("input", "grad")
    },
    "fp8_block_2d-input": (
        jq.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1),
        "input",
    ),
    "nvfp4_no_rht-grad": (jq.NVFP4BlockScaling(disable_rht=True), "grad"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_group_is_quantized_as_its_own_tensor(case):
    recipe, role = CASES[case]
    spec = recipe.spec(role)
    key = jax.random.key(7) if spec.stochastic_rounding else None
    x = jax.random.normal(jax.random.key(0), (NUM_ROWS, FEATURES), jnp.bfloat16) * 3
    # Rows past the groups hold huge values: they must not reach any group's amax.
    x = x.at[128:].set(1e4)
    group_sizes = jnp.array(SIZES, jnp.int32)

    @jax.jit
    def grouped(x, group_sizes):
        layout = jq.group_layout(group_sizes, NUM_ROWS, token_alignment(recipe))
        q = jq.grouped_quantize(x, recipe, role, layout, rowwise=True, columnwise=True, key=key)
        return q, layout, q.dequantize("rowwise", layout), q.dequantize("columnwise", layout)

    q, layout, rowwise_values, columnwise_values = grouped(x, group_sizes)
    assert q.usages == ("rowwise", "columnwise")
    packing = 2 if spec.format == "nvfp4" else 1
    for g, rows in enumerate(group_slices(SIZES)):
        if SIZES[g] == 0:
            continue
        group_key = None if key is None else jax.random.fold_in(key, g)
        own = jq.quantize(x[rows], recipe, role, rowwise=True, columnwise=True, key=group_key)
        start = int(layout.aligned_starts[g])
        # rowwise copy: the group's rows (+ its own row padding for 2-D blocks)
        assert_bits_equal(
            q.rowwise_data[start : start + own.rowwise_data.shape[0]], own.rowwise_data
        )
        assert_bits_equal(
            q.columnwise_data[
                :, start // packing : start // packing + own.columnwise_data.shape[1]
            ],
            own.columnwise_data,
        )
        if spec.format == "fp8":  # one scale per group, as the per-tensor scale of x_g
            assert_bits_equal(q.rowwise_scale_inv[g], own.rowwise_scale_inv)
            assert_bits_equal(q.columnwise_scale_inv[g], own.columnwise_scale_inv)
        else:
            block_rows, block_cols = spec.block_shape
            for usage, axis, block in (("rowwise", 0, block_rows), ("columnwise", 1, block_cols)):
                ours = getattr(q, f"{usage}_scale_inv")
                theirs = getattr(own, f"{usage}_scale_inv")
                first = start // block
                window = (
                    ours[first : first + theirs.shape[0]]
                    if axis == 0
                    else ours[:, first : first + theirs.shape[1]]
                )
                assert_bits_equal(window, theirs, usage)
        if spec.format == "nvfp4":
            assert_bits_equal(q.rowwise_amax[g], own.rowwise_amax)
            assert_bits_equal(q.columnwise_amax[g], own.columnwise_amax)
        assert_bits_equal(rowwise_values[rows], own.dequantize("rowwise"))
        assert_bits_equal(columnwise_values[rows], own.dequantize("columnwise"))
    np.testing.assert_array_equal(rowwise_values[128:], 0)


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_one_group_with_every_row_equals_quantizing_the_tensor(name):
    recipe = RECIPES[name]
    x = jax.random.normal(jax.random.key(1), (64, 48), jnp.float32)

    @jax.jit
    def grouped(x):
        layout = jq.group_layout(jnp.array([0, 64, 0], jnp.int32), 64, token_alignment(recipe))
        q = jq.grouped_quantize(x, recipe, "input", layout, rowwise=True, columnwise=True)
        return q, q.dequantize("columnwise", layout)

    q, columnwise_values = grouped(x)
    whole = jq.quantize(x, recipe, "input", rowwise=True, columnwise=True)
    assert_bits_equal(q.rowwise_data[:64], whole.rowwise_data)
    assert_bits_equal(q.columnwise_data[:, : whole.columnwise_data.shape[1]], whole.columnwise_data)
    assert_bits_equal(columnwise_values, whole.dequantize("columnwise"))


def test_no_rows_in_any_group_gives_zeros():
    recipe = RECIPES["nvfp4"]
    x = jax.random.normal(jax.random.key(2), (32, 32), jnp.float32)

    @jax.jit
    def grouped(x):
        layout = jq.group_layout(jnp.zeros((3,), jnp.int32), 32, token_alignment(recipe))
        q = jq.grouped_quantize(
            x, recipe, "grad", layout, rowwise=True, columnwise=True, key=jax.random.key(0)
        )
        return q, q.dequantize("rowwise", layout)

    q, values = grouped(x)
    np.testing.assert_array_equal(bits(q.rowwise_data), 0)
    np.testing.assert_array_equal(bits(q.columnwise_data), 0)
    np.testing.assert_array_equal(q.rowwise_amax, 0)
    np.testing.assert_array_equal(values, 0)


def test_aligned_producers_quantize_like_grouped_quantize():
    """quantize_aligned (the fused MLP writes its activation straight into the layout)."""
    recipe = RECIPES["fp8_block"]
    x = jax.random.normal(jax.random.key(3), (NUM_ROWS, 64), jnp.float32)
    layout = jq.group_layout(jnp.array(SIZES, jnp.int32), NUM_ROWS, token_alignment(recipe))
    a = jq.grouped_quantize(x, recipe, "input", layout, rowwise=True, columnwise=True)
    b = quantize_aligned(
        layout.to_aligned(x), recipe, "input", layout, rowwise=True, columnwise=True
    )
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        assert_bits_equal(u, v)
    assert a.restrict_to("columnwise").usages == ("columnwise",)
    assert a.restrict_to("columnwise").nbytes < a.nbytes


def test_bad_arguments_are_named():
    recipe = RECIPES["mxfp8"]
    x = jnp.ones((16, 32), jnp.float32)
    layout = jq.group_layout(jnp.array([8, 8], jnp.int32), 16, 32)
    with pytest.raises(ValueError, match="x must have shape"):
        jq.grouped_quantize(x[:8], recipe, "input", layout)
    with pytest.raises(ValueError, match="align"):
        jq.group_layout(jnp.array([8, 8], jnp.int32), 16, 24)
    with pytest.raises(ValueError, match="token block"):
        jq.grouped_quantize(
            x, recipe, "input", jq.group_layout(jnp.array([8, 8], jnp.int32), 16, 16)
        )
    with pytest.raises(ValueError, match="key is required"):
        nv_layout = jq.group_layout(jnp.array([8, 8], jnp.int32), 16, 16)
        jq.grouped_quantize(x, RECIPES["nvfp4"], "grad", nv_layout)
    with pytest.raises(ValueError, match="usage"):
        jq.grouped_quantize(x, recipe, "input", layout).copy("columnwise")


# --- FP8 per-tensor groups on the cast-transpose kernel ----------------------------------------
def _fp8_groups(x, sizes, recipe, role, backend, rowwise, columnwise):
    @jax.jit
    def run(x, group_sizes):
        layout = jq.group_layout(group_sizes, x.shape[0], token_alignment(recipe))
        q = jq.grouped_quantize(
            x, recipe, role, layout, rowwise=rowwise, columnwise=columnwise, backend=backend
        )
        return jax.tree_util.tree_leaves(q)

    return run(x, jnp.array(sizes, jnp.int32))


def _kernels_run_here():
    """On the GPU the kernels run as they are; on the CPU in Mosaic GPU's interpreter (unwritten
    outputs come back NaN there, so a missed tile cannot pass)."""
    if ON_GPU:
        return contextlib.nullcontext()
    return plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(uninitialized_memory="nan"))


def _assert_kernel_matches_reference(x, sizes, recipe, role):
    for rowwise, columnwise in ((True, True), (True, False), (False, True)):
        want = _fp8_groups(x, sizes, recipe, role, "reference", rowwise, columnwise)
        # On the GPU "auto" is the kernel; on CPU "pallas" runs it in the interpreter (unwritten
        # outputs come back NaN there, so a missed tile cannot pass).
        with _kernels_run_here():
            got = _fp8_groups(
                x, sizes, recipe, role, "auto" if ON_GPU else "pallas", rowwise, columnwise
            )
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_bits_equal(g, w, f"rowwise={rowwise} columnwise={columnwise}")


@pytest.mark.skipif(ON_GPU, reason="interpreter test; the gpu twin below runs it compiled")
@pytest.mark.parametrize("role", ["input", "grad"])  # E4M3 and E5M2
def test_fp8_groups_on_the_cast_transpose_kernel_equal_the_reference(role):
    """Per-group FP8 codes from the Pallas cast-transpose kernel (interpreted here): the same
    bits as the jnp reference for each copy alone and both, with NaN / ±Inf / huge rows (a group
    whose amax is NaN or Inf keeps scale 1), an empty group and rows past the groups."""
    x = np.asarray(jax.random.normal(jax.random.key(4), (NUM_ROWS, 160), jnp.float32)) * 50
    x[2, 3], x[40, 7], x[41, 8], x[100, 9] = np.nan, np.inf, -np.inf, 3e38
    _assert_kernel_matches_reference(jnp.asarray(x, jnp.bfloat16), SIZES, RECIPES["fp8"], role)


def test_fp8_groups_of_no_rows_quantize_on_every_backend():
    # The kernel needs at least one tile: "auto" keeps an empty input on the reference.
    layout = jq.group_layout(jnp.zeros((2,), jnp.int32), 0, 1)
    x = jnp.zeros((0, 64), jnp.bfloat16)
    q = jq.grouped_quantize(x, RECIPES["fp8"], "input", layout, rowwise=True, columnwise=True)
    assert q.rowwise_data.shape == (0, 64) and q.columnwise_data.shape == (64, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("role", ["input", "grad"])
def test_gpu_fp8_groups_on_the_cast_transpose_kernel_equal_the_reference(role):
    x = adversarial_matrix(4000, 1000, 5, block=128, subnormals=True)  # pads to whole tiles
    sizes = [1000, 0, 1717, 1200, 3]  # 80 rows past the groups
    _assert_kernel_matches_reference(jnp.asarray(x, jnp.bfloat16), sizes, RECIPES["fp8"], role)


# --- NVFP4 groups on the quantize kernel ---------------------------------------------------------
# Per-group global amaxes, seeds and positions as per-line (rowwise) and per-16-token-block
# (columnwise) kernel inputs. backend="auto" runs it on GPU since its gpu test below passed on
# the H200 (2026-12-01; kernels._AWAITING_GPU_VERIFICATION).
def _nvfp4_groups(x, sizes, role, backend, rowwise=True, columnwise=True):
    recipe = RECIPES["nvfp4"]
    key = jax.random.key(11) if recipe.spec(role).stochastic_rounding else None

    @jax.jit
    def run(x, group_sizes):
        layout = jq.group_layout(group_sizes, x.shape[0], token_alignment(recipe))
        q = jq.grouped_quantize(
            x,
            recipe,
            role,
            layout,
            rowwise=rowwise,
            columnwise=columnwise,
            key=key,
            backend=backend,
        )
        return jax.tree_util.tree_leaves(q)

    return run(x, jnp.array(sizes, jnp.int32))


def _assert_nvfp4_kernel_matches_reference(
    x, sizes, role, copies=((True, True),), gpu_backend="auto"
):
    for rowwise, columnwise in copies:
        want = _nvfp4_groups(x, sizes, role, "reference", rowwise, columnwise)
        with _kernels_run_here():
            # On the GPU through "auto" by default, so the dispatch to the kernel is tested too.
            backend = gpu_backend if ON_GPU else "pallas"
            got = _nvfp4_groups(x, sizes, role, backend, rowwise, columnwise)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_bits_equal(g, w, f"{role} rowwise={rowwise} columnwise={columnwise}")


@pytest.mark.skipif(ON_GPU, reason="interpreter test; the gpu twin below runs it compiled")
@pytest.mark.parametrize("role", ["input", "grad"])  # Hadamard; + stochastic rounding
def test_nvfp4_groups_on_the_kernel_equal_the_reference(role):
    """backend="pallas" (the kernel, interpreted here) gives the reference's bits: 3 groups, one
    empty, padding slots, rows past the groups (huge values that must reach no group), NaN and
    Inf in one group, groups at different scales."""
    x = np.asarray(jax.random.normal(jax.random.key(5), (64, 48), jnp.float32)) * 3
    x[20:57] *= 2.0**12
    x[30, 5], x[40, 17] = np.nan, -np.inf
    x[57:] = 1e30
    _assert_nvfp4_kernel_matches_reference(jnp.asarray(x, jnp.bfloat16), [20, 0, 37], role)


def test_nvfp4_groups_run_the_kernel_under_auto_on_gpu_only():
    spec = RECIPES["nvfp4"].spec("grad")
    assert not kernels.awaiting_gpu_verification(spec, path="grouped")  # verified on the H200
    assert kernels.grouped_nvfp4_kernel_applies(spec, jnp.bfloat16) == ON_GPU
    assert not kernels.grouped_nvfp4_kernel_applies(spec, jnp.float16)
    with pytest.raises(ValueError, match="grouped NVFP4 kernel path does not cover"):
        _nvfp4_groups(jnp.ones((32, 32), jnp.float16), [16, 16], "input", "pallas")


@functools.cache
def _gpu_nvfp4_matrix():
    return adversarial_matrix(16384, 512, 6, block=16, specials=False)


@pytest.mark.gpu
@pytest.mark.parametrize("role", ["input", "grad"])
@pytest.mark.parametrize("backend", ["auto", "pallas"])
def test_gpu_nvfp4_groups_on_the_kernel_equal_the_reference(role, backend):
    # 8 uneven groups (one empty) of 16384 tokens × 512 features, 166 tokens past the groups.
    # Both backends run the per-group amaxes on the line-amax kernel (on "auto" since this and
    # test_gpu_nvfp4_line_amax_bits passed on the H200, 2026-12-01).
    x = _gpu_nvfp4_matrix().copy()
    sizes = [3000, 1, 0, 2500, 4100, 17, 2900, 3700]
    x[sum(sizes) :] = 1e30
    x[5, 7], x[4000, 100] = np.nan, np.inf
    copies = ((True, True), (True, False), (False, True))
    _assert_nvfp4_kernel_matches_reference(
        jnp.asarray(x, jnp.bfloat16), sizes, role, copies, gpu_backend=backend
    )
