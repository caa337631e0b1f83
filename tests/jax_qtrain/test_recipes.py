import dataclasses

import jax.numpy as jnp
import pytest

import jax_qtrain as jq
from jax_qtrain.recipes import recipe_from_name

ALL_RECIPES = [
    jq.Float8CurrentScaling,
    jq.Float8BlockScaling,
    jq.MXFP8BlockScaling,
    jq.NVFP4BlockScaling,
]


@pytest.mark.parametrize("cls", ALL_RECIPES)
@pytest.mark.parametrize("mode", [None, "high_precision", "dequantized"])
def test_backward_override_is_kept(cls, mode):
    assert cls(backward_override=mode).backward_override == mode
    assert cls().backward_override is None


@pytest.mark.parametrize("cls", ALL_RECIPES)
def test_unknown_backward_override_names_the_field(cls):
    with pytest.raises(ValueError, match="backward_override"):
        cls(backward_override="fp32")


@pytest.mark.parametrize("cls", ALL_RECIPES)
def test_recipes_are_frozen_hashable_and_compare_by_value(cls):
    a, b = cls(), cls()
    assert a == b and hash(a) == hash(b)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.backward_override = "dequantized"
    assert a.replace(backward_override="dequantized") != a


@pytest.mark.parametrize(
    "cls, kwargs, field",
    [
        (jq.Float8CurrentScaling, {"fp8_format": "e5m2"}, "fp8_format"),
        (jq.Float8CurrentScaling, {"amax_epsilon": -1.0}, "amax_epsilon"),
        (jq.Float8CurrentScaling, {"power_2_scale": "yes"}, "power_2_scale"),
        (jq.Float8BlockScaling, {"x_block_scaling_dim": 3}, "x_block_scaling_dim"),
        (jq.Float8BlockScaling, {"x_block_scaling_dim": 2}, "x_block_scaling_dim"),
        (jq.Float8BlockScaling, {"grad_block_scaling_dim": 2}, "grad_block_scaling_dim"),
        (jq.MXFP8BlockScaling, {"fp8_format": "int8"}, "fp8_format"),
        (jq.NVFP4BlockScaling, {"disable_rht": 1}, "disable_rht"),
    ],
)
def test_invalid_options_name_the_field(cls, kwargs, field):
    with pytest.raises(ValueError, match=field):
        cls(**kwargs)


def test_fp8_current_scaling_specs():
    r = jq.Float8CurrentScaling()
    assert r.spec("input").dtype == jnp.float8_e4m3fn
    assert r.spec("weight").dtype == jnp.float8_e4m3fn
    assert r.spec("grad").dtype == jnp.float8_e5m2
    assert jq.Float8CurrentScaling(fp8_format="e4m3").spec("grad").dtype == jnp.float8_e4m3fn
    assert r.spec("input").block_shape is None


def test_fp8_block_specs():
    r = jq.Float8BlockScaling()
    assert r.spec("input").block_shape == (1, 128)
    assert r.spec("weight").block_shape == (128, 128)
    assert r.spec("grad").block_shape == (1, 128)
    assert r.spec("grad").dtype == jnp.float8_e4m3fn and r.spec("grad").power_2_scale
    assert not jq.Float8BlockScaling(power_2_scale=False).spec("input").power_2_scale
    two_d_inputs = jq.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1)
    assert two_d_inputs.spec("input").block_shape == (128, 128)


def test_mxfp8_specs():
    r = jq.MXFP8BlockScaling()
    assert all(r.spec(role).block_shape == (1, 32) for role in ("input", "weight", "grad"))
    assert r.spec("grad").dtype == jnp.float8_e4m3fn
    assert jq.MXFP8BlockScaling(fp8_format="hybrid").spec("grad").dtype == jnp.float8_e5m2


def test_nvfp4_specs_follow_te_defaults():
    r = jq.NVFP4BlockScaling()
    x, w, g = r.spec("input"), r.spec("weight"), r.spec("grad")
    assert (x.block_shape, x.hadamard_columnwise, x.stochastic_rounding) == ((1, 16), True, False)
    assert (w.block_shape, w.hadamard_columnwise, w.stochastic_rounding) == ((16, 16), False, False)
    assert (g.block_shape, g.hadamard_columnwise, g.stochastic_rounding) == ((1, 16), True, True)
    plain = jq.NVFP4BlockScaling(
        disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True
    )
    for role in ("input", "weight", "grad"):
        spec = plain.spec(role)
        assert spec.block_shape == (1, 16)
        assert not spec.hadamard_columnwise and not spec.stochastic_rounding


def test_unknown_role_names_the_argument():
    with pytest.raises(ValueError, match="role"):
        jq.MXFP8BlockScaling().spec("bias")


def test_recipe_from_name():
    assert recipe_from_name("fp8-block") == jq.Float8BlockScaling()
    assert recipe_from_name("nvfp4", disable_rht=True).disable_rht
    with pytest.raises(ValueError, match="unknown recipe"):
        recipe_from_name("int4")


def test_quantizer_spec_validation():
    with pytest.raises(ValueError, match="format"):
        jq.QuantizerSpec("int8", jnp.float8_e4m3fn, (1, 32))
    with pytest.raises(ValueError, match="dtype"):
        jq.QuantizerSpec("mxfp8", jnp.bfloat16, (1, 32))
    with pytest.raises(ValueError, match="block_shape"):
        jq.QuantizerSpec("fp8", jnp.float8_e4m3fn, (1, 32))
    with pytest.raises(ValueError, match="hadamard"):
        jq.QuantizerSpec("mxfp8", jnp.float8_e4m3fn, (1, 32), hadamard_columnwise=True)
