"""The benchmarks run end to end on tiny shapes (their numbers mean nothing on a CPU; the H200
runs them for real: benchmarks/h200.sh). Catches a benchmark broken by an API change before a
device call is spent on it."""

import dataclasses
import importlib
import json
import os
import shutil

import pytest

from benchmarks.run import benchmark_modules
from jax_qtrain.train.trainer import RunError


@pytest.mark.parametrize("name", benchmark_modules())
def test_every_benchmark_module_imports_and_has_main(name):
    module = importlib.import_module(f"benchmarks.{name}")
    assert callable(module.main)


@pytest.mark.slow
def test_moe_and_grouped_quantize_benchmarks_run_small(tmp_path):
    from benchmarks import bench_grouped_quantize, bench_moe

    text = bench_moe.main(
        str(tmp_path), small=True, config_names=["4 experts"], routings=("balanced",)
    )
    rows = json.loads((tmp_path / "bench_moe.json").read_text())
    assert [r["recipe"] for r in rows] == [
        "bf16 (lax.ragged_dot)",
        "bf16 (jax_qtrain)",
        "fp8",
        "fp8-block",
        "mxfp8",
        "nvfp4",
    ]
    assert all(r["fwd_bwd_ms"] > 0 and r["compile_s"] > 0 for r in rows) and "| 4 experts" in text
    with pytest.raises(ValueError, match="unknown configs"):
        bench_moe.main(str(tmp_path), small=True, config_names=["8 experts"])
    # A subset of the blocks is timed with the peer, whether or not it is named.
    bench_moe.main(
        str(tmp_path),
        small=True,
        config_names=["4 experts"],
        routings=("balanced",),
        block_names=["fp8"],
    )
    rows = json.loads((tmp_path / "bench_moe.json").read_text())
    assert [r["recipe"] for r in rows] == ["bf16 (lax.ragged_dot)", "fp8"]
    with pytest.raises(ValueError, match=r"unknown blocks \['fp8 block'\]"):
        bench_moe.main(str(tmp_path), small=True, block_names=["fp8 block"])

    bench_grouped_quantize.main(str(tmp_path), small=True, recipe_names=("fp8",))
    rows = json.loads((tmp_path / "bench_grouped_quantize.json").read_text())
    assert {r["case"] for r in rows} == {"copy floor: XLA x + 1", "fp8 grouped", "fp8 whole tensor"}


def test_dense_output_ab_runs_small(tmp_path):
    # Every output form computes the same product (on the CPU, the same bits).
    from benchmarks import dense_output_ab

    text = dense_output_ab.main(str(tmp_path), small=True)
    rows = json.loads((tmp_path / "dense_output_ab.json").read_text())
    assert [r["group"] for r in rows] == ["bf16"] * 4 + ["fp8"] * 3
    assert all(r["ms"] > 0 and r["max diff / max abs(first)"] < 1e-2 for r in rows)
    assert "| jq.dense(x, w), no recipe |" in text


def test_grouped_output_ab_runs_small(tmp_path):
    # Every form of the grouped layer, on the kernels in the interpreter: the same bits here
    # (the third, the opt-in wgrad group_scale, only for the recipes with per-group factors).
    from benchmarks import grouped_output_ab

    text = grouped_output_ab.main(str(tmp_path), small=True, recipe_names=["fp8"])
    rows = json.loads((tmp_path / "grouped_output_ab.json").read_text())
    assert [r["form"] for r in rows] == list(grouped_output_ab.FORMS)
    assert all(r["ms"] > 0 and r["max diff / max abs(first)"] == 0 for r in rows)
    assert "| fp8 | with the wgrad group_scale |" in text


def test_dense_benchmark_runs_small(tmp_path):
    from benchmarks import bench_dense

    text = bench_dense.main(str(tmp_path), small=True, shape_names=["128x256x512"])
    rows = json.loads((tmp_path / "bench_dense.json").read_text())
    assert [r["recipe"] for r in rows] == [bench_dense.PEER, *bench_dense.RECIPES]
    assert {r["shape"] for r in rows} == {"128x256x512"} and "| 128x256x512 | fp8 |" in text
    assert all(r["fwd_bwd_ms"] > 0 and r["forward_ms"] > 0 for r in rows)
    assert rows[0]["fwd_bwd_speedup_vs_peer"] == 1.0
    with pytest.raises(ValueError, match="unknown shapes"):
        bench_dense.main(str(tmp_path), small=True, shape_names=["8192x4096x4096"])


def test_train_benchmark_names_a_bad_recipe_list(tmp_path):
    from benchmarks import bench_train

    for recipes in (["fp16"], []):
        with pytest.raises(ValueError, match="recipes must be a non-empty subset"):
            bench_train.main(str(tmp_path), small=True, recipes=recipes)
    for seeds in ((), (0, 0), (-1,)):
        with pytest.raises(RunError, match="seed"):
            bench_train.main(str(tmp_path), small=True, seeds=seeds)


def test_train_benchmark_over_two_seeds(tmp_path):
    from benchmarks import bench_train

    text = bench_train.main(str(tmp_path), small=True, recipes=["bf16"], seeds=(0, 1))
    assert "seeds 0, 1" in text and "| recipe | final val loss, seeds 0 / 1 |" in text
    assert "seed 0:" in text and "seed 1:" in text
    assert (tmp_path / "bench_train" / "seed-1" / "bf16" / "summary.json").exists()


@pytest.mark.slow
def test_grouped_ab_runs_small(tmp_path):
    # The schedule set: the persistent pipeline and 2-CTA clusters in the interpreter, each
    # checked bit for bit against the first variant before it is timed.
    from benchmarks import grouped_ab

    text = grouped_ab.main(str(tmp_path), small=True, variants="schedule")
    rows = json.loads((tmp_path / "grouped_ab_schedule.json").read_text())
    variants = {(r["case"], r["variant"]) for r in rows}
    assert ("G8 balanced fwd bf16", "bf16 cluster 2 + persistent") in variants
    assert ("dense 256^3", "fp8 block persistent") in variants
    assert all(r["ms"] > 0 for r in rows) and "| dense 256^3 |" in text
    assert all(r["same_bits"] for r in rows if not r["variant"].startswith("XLA"))
    with pytest.raises(ValueError, match="variants must be one of"):
        grouped_ab.main(str(tmp_path), small=True, variants="tiles")


@pytest.mark.slow
def test_grouped_ab_cluster_m_runs_small(tmp_path):
    # The dense entry points with and without 2-CTA clusters along M, in the interpreter.
    from benchmarks import grouped_ab

    grouped_ab.main(str(tmp_path), small=True, variants="cluster_m")
    rows = json.loads((tmp_path / "grouped_ab_cluster_m.json").read_text())
    variants = {(r["case"], r["variant"]) for r in rows}
    assert ("dense 256^3 fp8 block", "fp8 block cluster_m 2, not persistent") in variants
    assert ("dense 256^3 bf16", "bf16 cluster_m 2, persistent") in variants
    assert ("dense 256^3 fp8 rowwise", "fp8 cluster_m 2") in variants
    assert all(r["ms"] > 0 for r in rows)
    assert all(r["same_bits"] for r in rows if not r["variant"].startswith("XLA"))


def test_grouped_ab_fp8_block_wgrad_runs_small(tmp_path):
    # Block FP8's MoE wgrad under every pipeline depth and grid order of the sweep, in the
    # interpreter, two groups and one (the dense layers' wgrad, its own variants with float32
    # out): the default's bits from each before any is timed.
    from benchmarks import grouped_ab

    grouped_ab.main(str(tmp_path), small=True, variants="fp8_block_wgrad")
    rows = json.loads((tmp_path / "grouped_ab_fp8_block_wgrad.json").read_text())
    kernels = [r for r in rows if not r["variant"].startswith("XLA")]
    for shape, expected in (
        ("G8 balanced", grouped_ab.fp8_block_wgrad_variants()),
        ("dense, one group, f32 out", grouped_ab.dense_fp8_block_wgrad_variants()),
    ):
        variants = {r["variant"] for r in kernels if r["case"] == f"{shape} wgrad block FP8"}
        assert variants == set(expected), shape
    assert all(r["ms"] > 0 and r["same_bits"] for r in kernels)


def test_grouped_ab_wgrad_stage_spot_runs_small(tmp_path):
    # The block-FP8 wgrad kernel at 2 to 5 stages on two groups and on one, in the
    # interpreter: the default's bits from each.
    from benchmarks import grouped_ab

    grouped_ab.main(str(tmp_path), small=True, variants="wgrad_stage_spot")
    rows = json.loads((tmp_path / "grouped_ab_wgrad_stage_spot.json").read_text())
    kernels = [r for r in rows if not r["variant"].startswith("XLA")]
    for case in ("G2, 1 step a tile", "one group, 2 steps a tile"):
        variants = {r["variant"] for r in kernels if r["case"] == f"{case} wgrad block FP8"}
        assert variants == set(grouped_ab.wgrad_stage_spot_variants()), case
    assert all(r["ms"] > 0 and r["same_bits"] for r in kernels)
    # The GPU shapes: 128-token steps a group that 4 divides, and one more.
    steps = [sizes[0] // 128 for *_, sizes in grouped_ab.WGRAD_STAGE_SPOT_SHAPES.values()]
    assert steps == [16, 17, 64, 65]


def test_grouped_ab_wgrad_persistent_runs_small(tmp_path):
    # Every wgrad the layers call (bf16 both layouts, per-tensor FP8, block FP8 grouped and
    # dense), its default against its per-tile pipeline in the interpreter: the same bits.
    from benchmarks import grouped_ab

    grouped_ab.main(str(tmp_path), small=True, variants="wgrad_persistent")
    rows = json.loads((tmp_path / "grouped_ab_wgrad_persistent.json").read_text())
    kernels = [r for r in rows if not r["variant"].startswith("XLA")]
    cases = {r["case"] for r in kernels}
    assert cases == {
        "G8 balanced wgrad bf16 token-major",
        "G8 balanced wgrad bf16 K-major",
        "G8 balanced wgrad FP8 K-major",
        "G8 balanced wgrad block FP8",
        "dense, one group wgrad dense block FP8",
    }
    for case in cases:
        variants = [r["variant"] for r in kernels if r["case"] == case]
        assert len(variants) == 2 and variants[0].endswith("persistent pipeline (default)")
        assert variants[1].endswith("a pipeline per tile"), case
    assert all(r["ms"] > 0 and r["same_bits"] for r in kernels)


def test_grouped_ab_fp8_wgrad_depth_runs_small(tmp_path):
    # The per-tensor FP8 wgrad at 3 and 4 stages on two groups and on one, in the
    # interpreter: the default's bits from each; the GPU shapes shrink the tokens a group.
    from benchmarks import grouped_ab

    grouped_ab.main(str(tmp_path), small=True, variants="fp8_wgrad_depth")
    rows = json.loads((tmp_path / "grouped_ab_fp8_wgrad_depth.json").read_text())
    kernels = [r for r in rows if not r["variant"].startswith("XLA")]
    for case in ("G2, 128 tokens a group", "one group of 256 tokens"):
        variants = [r["variant"] for r in kernels if r["case"] == f"{case} wgrad FP8 K-major"]
        assert variants == ["3 stages", "4 stages"], case
    assert all(r["ms"] > 0 and r["same_bits"] for r in kernels)
    tokens = [sizes[0] for *_, sizes in grouped_ab.FP8_WGRAD_DEPTH_SHAPES.values()]
    assert tokens == [2048, 1024, 512, 256, 512]


def test_wgrad_persistent_variants_are_the_defaults_neighbours_fitted_once():
    # The GPU sweep's variants (not run in the interpreter above): the default first, then
    # one change each, fitted to the shared memory, none twice.
    from benchmarks import grouped_ab
    from pallas_kernels.grouped_matmul_wgrad import (
        DEFAULT_BF16_WGRAD_CONFIG,
        DEFAULT_FP8_BLOCK_WGRAD_CONFIG,
        fit_to_shared_memory,
    )

    bf16 = grouped_ab.wgrad_persistent_variants(DEFAULT_BF16_WGRAD_CONFIG, (2, 2, 4), False)
    # (bf16 at 4 stages: 5 stages, or 2 epilogue buffers beside 4, fit back to the default.)
    assert list(bf16) == [
        "4 stages, 1 buffer, grid minor 1, persistent pipeline (default)",
        "4 stages, 1 buffer, grid minor 1, a pipeline per tile",
        "3 stages, 1 buffer, grid minor 1, persistent pipeline",
        "3 stages, 2 buffers, grid minor 1, persistent pipeline",
        "4 stages, 1 buffer, grid minor 0, persistent pipeline",
    ]
    block = grouped_ab.wgrad_persistent_variants(DEFAULT_FP8_BLOCK_WGRAD_CONFIG, (1, 1, 4), True)
    assert next(iter(block)).startswith("4 stages, 2 buffers") and len(block) == 7
    for config in block.values():
        assert fit_to_shared_memory(config, (1, 1, 4), True) == config
    # Float32 out at 6 stages does not fit: cut to a config already in the set, timed once.
    deep = dataclasses.replace(DEFAULT_FP8_BLOCK_WGRAD_CONFIG, max_concurrent_steps=6)
    assert len(grouped_ab.wgrad_persistent_variants(deep, (1, 1, 4), True)) < 7


def test_grouped_ab_dense_fp8_block_stages_runs_small(tmp_path):
    # The dense block-FP8 GEMM, forward (128x128 rhs blocks) and wgrad (1x128 blocks on both
    # operands), under its stage counts in the interpreter: the default's bits from each that
    # fits (5 stages cannot, with 2 K steps).
    from benchmarks import grouped_ab

    grouped_ab.main(str(tmp_path), small=True, variants="dense_fp8_block_stages")
    rows = json.loads((tmp_path / "grouped_ab_dense_fp8_block_stages.json").read_text())
    timed = [r for r in rows if r["ms"] is not None and not r["variant"].startswith("XLA")]
    stages = {"default (4 stages)", "2 stages", "3 stages"}
    for case, others in (
        ("dense 256^3 fwd block FP8", set()),
        ("dense 256^3 wgrad block FP8", {"MoE wgrad kernel, one group"}),
    ):
        variants = {r["variant"] for r in timed if r["case"] == case}
        assert variants == stages | others, case
    assert all(r["same_bits"] for r in timed)


def test_grouped_ab_weights_in_registers_runs_small(tmp_path):
    # The MXFP8 / NVFP4 in-register kernels' variants in the interpreter: every group runs,
    # and NVFP4's decodes and tiles give the same f32 bits (the interpreter's wgmma is one dot
    # per call, so MXFP8's 32- and 64-wide calls may differ here; on the GPU they may not).
    from benchmarks import grouped_ab

    grouped_ab.main(str(tmp_path), small=True, variants="weights_in_registers")
    rows = json.loads((tmp_path / "grouped_ab_weights_in_registers.json").read_text())
    cases = {r["case"] for r in rows}
    assert cases == {
        f"G8 balanced fwd {fmt} in registers, {out} out"
        for fmt in ("mxfp8", "nvfp4")
        for out in ("bfloat16", "float32")
    }
    assert all(r["ms"] > 0 for r in rows)
    nvfp4_f32 = [r for r in rows if r["case"].endswith("nvfp4 in registers, float32 out")]
    assert len(nvfp4_f32) == 4  # three tilings and the yardstick
    assert all(r["same_bits"] for r in nvfp4_f32 if not r["variant"].startswith("XLA"))
    # Two K steps a stage (stop 48) in every group: the same wgmma calls as each group's
    # first row, so the same bits even in the interpreter.
    two_steps = [r for r in rows if "two K steps a stage" in r["variant"]]
    assert {r["case"] for r in two_steps} == cases
    assert all(r["same_bits"] is True for r in two_steps)


def test_grouped_ab_block_tile_variants_fit_shared_memory():
    # The block_tiles set (timed on the H200 only: each interpreted variant costs CI minutes).
    import jax.numpy as jnp

    from benchmarks import grouped_ab
    from pallas_kernels import grouped_matmul_fwd as fwd

    for k in (4096, 8192):
        two_consumers = fwd.fp8_block_default_config(k, jnp.bfloat16, num_consumers=2)
        variants = grouped_ab.block_tile_variants(two_consumers, k)
        assert list(variants)[:2] == ["default", "default, persistent"]
        assert variants["default"].early_block_scales
        assert not variants["default, late scale loads"].early_block_scales
        for name, config in variants.items():
            assert (config.tile_m, config.tile_n) == ((128, 64) if "128x" in name else (64, 128))
            stage, scales = fwd._block_stage_bytes(config), fwd._block_scale_bytes(config, k)
            assert fwd._smem_bytes(config, stage, jnp.bfloat16, scales) <= fwd.SMEM_BYTES, name
        staggered = grouped_ab.stagger_variants(two_consumers, k)
        assert [c.stagger_consumers for c in staggered.values()] == [
            "staggered" in name for name in staggered
        ]
        assert staggered["default, staggered, persistent"].persistent_pipeline


def test_grouped_ab_three_consumer_variants_fit_shared_memory():
    # The three_consumers set (timed on the H200 only; `--small` refuses it by name).
    import jax.numpy as jnp

    from benchmarks import grouped_ab
    from pallas_kernels import grouped_matmul_fwd as fwd

    for kind in ("block", "block dense"):
        for k in (4096, 8192):
            variants = grouped_ab.three_consumer_variants(kind, k)
            assert variants["2 consumers (stop 42)"].num_consumers == 2
            assert variants["3 consumers"] == fwd.fp8_block_default_config(k, jnp.bfloat16)
            for name, config in variants.items():
                if name.startswith("3 consumers"):
                    assert (config.tile_m, config.num_consumers) == (192, 3), name
                if config.persistent_pipeline:
                    assert (k // 128) % config.max_concurrent_steps == 0, name
                stage = fwd._block_stage_bytes(config)
                prefetch = fwd._block_scale_bytes(config, k)
                smem = fwd._smem_bytes(config, stage, jnp.bfloat16, prefetch)
                assert smem <= fwd.SMEM_BYTES, (kind, k, name)
    with pytest.raises(ValueError, match="kind must be 'block' or 'block dense'"):
        grouped_ab.three_consumer_variants("bf16", 4096)
    with pytest.raises(ValueError, match="three_consumers' runs on the GPU only"):
        grouped_ab.main(None, small=True, variants="three_consumers")
    with pytest.raises(ValueError, match="dense_only applies to variants='three_consumers'"):
        grouped_ab.main(None, small=True, variants="schedule", dense_only=True)


# Sets timed on the H200 only: (variant function, number of variants, what every variant
# but the default has). wide_tiles: 64 x (2 x 256) CTA tiles; consumer_split: consumers that
# split the rows; wide_three_consumers: three consumers of 64 x 256 in 192 x (2 x 128) tiles.
GROUPED_AB_SETS = {
    "wide_tiles": (4, lambda c: (c.tile_m, c.tile_n) == (64, 256)),
    "consumer_split": (5, lambda c: c.consumer_split == "m"),
    "wide_three_consumers": (
        5,
        lambda c: (c.tile_m, c.tile_n, c.num_consumers, c.consumer_split) == (192, 128, 3, "m"),
    ),
}


@pytest.mark.parametrize("variant_set", sorted(GROUPED_AB_SETS))
def test_grouped_ab_variants_of_the_defaults_fit_shared_memory(variant_set):
    # Each variant of the bf16 and FP8 rowwise defaults is a valid config that fits in shared
    # memory with its scale vectors (FP8) and bf16 output.
    import jax.numpy as jnp

    from benchmarks import grouped_ab
    from pallas_kernels import grouped_matmul_fwd as fwd

    count, has_shape = GROUPED_AB_SETS[variant_set]
    for default, itemsize in ((fwd.DEFAULT_BF16_CONFIG, 2), (fwd.DEFAULT_FP8_CONFIG, 1)):
        variants = grouped_ab.VARIANT_SETS[variant_set](default)
        assert next(iter(variants)) == "default" and variants["default"] == default
        assert len(variants) == count
        for name, config in list(variants.items())[1:]:
            assert has_shape(config), name
            stage = config.tile_k * (config.tile_m + 2 * config.tile_n) * itemsize
            scales = fwd._vector_bytes(config) if itemsize == 1 else 0
            assert fwd._smem_bytes(config, stage, jnp.bfloat16, scales) <= fwd.SMEM_BYTES, name


def test_grouped_ab_stream_k_variants_fit_and_split_only_where_named():
    import jax.numpy as jnp

    from benchmarks import grouped_ab
    from pallas_kernels import grouped_matmul_fwd as fwd

    for default, itemsize in ((fwd.DEFAULT_BF16_CONFIG, 2), (fwd.DEFAULT_FP8_CONFIG, 1)):
        variants = grouped_ab.stream_k_variants(default)
        assert variants["default"] == default
        assert ("no wgmma in flight" in variants) == bool(default.wgmma_in_flight)
        for name, config in variants.items():
            assert config.stream_k == ("stream-K" in name), name
            if config.persistent_pipeline:  # K = 4096: whole rounds of stages
                assert (4096 // config.tile_k) % config.max_concurrent_steps == 0, name
            stage = config.tile_k * (config.tile_m + 2 * config.tile_n) * itemsize
            scales = fwd._vector_bytes(config) if itemsize == 1 else 0
            assert fwd._smem_bytes(config, stage, jnp.bfloat16, scales) <= fwd.SMEM_BYTES, name


@pytest.mark.slow
def test_grouped_ab_wgrad_runs_small(tmp_path):
    # The token-major wgrad configs and the K-major default in the interpreter, each checked
    # bit for bit against the token-major default before it is timed.
    from benchmarks import grouped_ab

    text = grouped_ab.main(str(tmp_path), small=True, variants="wgrad")
    rows = json.loads((tmp_path / "grouped_ab_wgrad.json").read_text())
    assert [r["variant"] for r in rows] == [*grouped_ab.wgrad_variants(), "XLA dense bf16"]
    assert "token-major 4 stages, 1 buffer, grid minor 0" in text
    assert all(r["case"] == "G8 balanced wgrad bf16" and r["ms"] > 0 for r in rows)
    assert all(r["same_bits"] for r in rows if not r["variant"].startswith("XLA"))


def test_grouped_matmul_benchmark_names_bad_sections(tmp_path):
    from benchmarks import bench_grouped_matmul

    for sections in (("g8", "fp4"), ()):
        with pytest.raises(ValueError, match="sections must be a non-empty subset"):
            bench_grouped_matmul.main(str(tmp_path), small=True, sections=sections)


@pytest.mark.slow
def test_grouped_matmul_benchmark_defaults_section_runs_small(tmp_path):
    # The opt-in "defaults" section in the interpreter: each default and its predecessor
    # checked against the f32 reference, then the dense block-FP8 default and its predecessor.
    from benchmarks import bench_grouped_matmul

    text = bench_grouped_matmul.main(str(tmp_path), small=True, sections=("defaults",))
    assert "persistent, stream-K" in text and "streamed scales" in text
    lines = (tmp_path / "bench_grouped_matmul.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    timed = [r for r in rows if r.get("status") == "ok" and r.get("shape") != "device"]
    # (In the interpreter: G8 balanced's four configs and the new dense block default.)
    assert len(timed) == 4 + 1, [(r.get("impl"), r.get("status")) for r in rows]


@pytest.mark.slow
def test_quantize_ab_runs_small(tmp_path):
    # MXFP8 variants in the interpreter: each checked bit for bit against the default config
    # (on NaN / Inf / tiny blocks too) before it is timed.
    from benchmarks import quantize_ab

    text = quantize_ab.main(str(tmp_path), small=True)
    rows = json.loads((tmp_path / "quantize_ab.json").read_text())
    assert {r["variant"] for r in rows} == {
        *quantize_ab.VARIANTS,
        *quantize_ab.STRUCTURE_CEILINGS,
    }
    assert all(
        r["bits"] == "identical"
        for r in rows
        if r["config"] and r["variant"] != quantize_ab.BASELINE
    )
    assert all(r["us"] > 0 for r in rows) and "| split_copies |" in text


def test_quantize_ab_nvfp4_amax_runs_small(tmp_path):
    # The separate amax kernel + quantize in the interpreter; the amax-in-kernel variants
    # (semaphores, which the interpreter lacks) are listed as GPU only, not run.
    from benchmarks import quantize_ab

    quantize_ab.main(str(tmp_path), small=True, kernel="nvfp4_amax")
    rows = json.loads((tmp_path / "quantize_ab_nvfp4_amax.json").read_text())
    variants = {r["variant"]: r for r in rows if r["variant"] in quantize_ab.NVFP4_AMAX_VARIANTS}
    assert set(variants) == set(quantize_ab.NVFP4_AMAX_VARIANTS)
    assert variants[quantize_ab.NVFP4_AMAX_BASELINE]["us"] > 0
    fused = [r for name, r in variants.items() if name != quantize_ab.NVFP4_AMAX_BASELINE]
    assert all(r["bits"] == "not run: GPU only" and r["us"] is None for r in fused)


def test_quantize_ab_nvfp4_weight_runs_small(tmp_path):
    # The 16×16 weight kernel's block-amax loads (per group or preloaded, from per-line copies
    # or, on the hardware only, the compact array): the same bits as the baseline's.
    from benchmarks import quantize_ab

    quantize_ab.main(str(tmp_path), small=True, kernel="nvfp4_weight")
    rows = json.loads((tmp_path / "quantize_ab_nvfp4_weight.json").read_text())
    variants = [r for r in rows if r["variant"] in quantize_ab.NVFP4_WEIGHT_VARIANTS]
    checked = [r for r in variants if r["variant"] != quantize_ab.NVFP4_WEIGHT_BASELINE]
    shapes = {r["shape"] for r in rows}
    assert len(checked) == (len(quantize_ab.NVFP4_WEIGHT_VARIANTS) - 1) * len(shapes)
    assert all(r["bits"] == "identical" for r in checked)
    assert all(r["us"] > 0 for r in rows)


def test_quantize_ab_nvfp4_nan_clamp_runs_small(tmp_path):
    # Stop 53's NaN blocks cleared by the clamp against the default: the same bits on the
    # timed input and on the one with NaN / Inf / zero / tiny blocks, then timed.
    from benchmarks import quantize_ab

    quantize_ab.main(str(tmp_path), small=True, kernel="nvfp4_nan_clamp")
    rows = json.loads((tmp_path / "quantize_ab_nvfp4_nan_clamp.json").read_text())
    checked = [r for r in rows if r["variant"] == "clamp_clears_nan_blocks"]
    assert checked and all(r["bits"] == "identical" and r["us"] > 0 for r in checked)


@pytest.mark.slow
def test_quantize_scale_split_runs_small(tmp_path):
    # In the interpreter: every quantizer's outputs equal its default's (Inf / NaN / tiny
    # values too) before it is timed; no GPU kernels to list on the CPU.
    from benchmarks import quantize_scale_split

    text = quantize_scale_split.main(str(tmp_path), small=True)
    rows = json.loads((tmp_path / "quantize_scale_split.json").read_text())
    cases = {r["case"] for r in rows}
    assert len(cases) == 14
    assert {
        "mxfp8 kernel alone (raw scales)",
        "mxfp8 line-major scales, band 4",
        "mxfp8 line-major scales, band 8",
        "cast skeleton, band 8",
    } <= cases
    assert all(r["bits"] is True for r in rows if r["bits"] is not None)
    # Every quantizer and skeleton but the raw kernel and `x + 1` is compared with its default.
    assert sum(r["bits"] is not None for r in rows) == 12
    assert all(r["wall_us"] > 0 for r in rows) and "| mxfp8 XLA untile |" in text


@pytest.mark.slow
def test_quantize_ablation_runs_small(tmp_path):
    # Every stage of both copies and the kernels themselves, in the interpreter; the script
    # first checks that its full-arithmetic stage equals quantize_mxfp8 bit for bit.
    from benchmarks import quantize_ablation

    text = quantize_ablation.main(str(tmp_path), small=True)
    rows = json.loads((tmp_path / "quantize_ablation.json").read_text())
    assert len(rows) == len(quantize_ablation.CASES) + 6
    assert all(r["us"] > 0 for r in rows) and "| row amax, col amax |" in text


@pytest.mark.slow
def test_quantize_ab_fp8_block_runs_small(tmp_path):
    # FP8 block exact arithmetic against lean_arithmetic (the default), bit for bit first, in
    # the interpreter.
    from benchmarks import quantize_ab

    text = quantize_ab.main(str(tmp_path), small=True, kernel="fp8_block_1x128")
    rows = json.loads((tmp_path / "quantize_ab_fp8_block_1x128.json").read_text())
    assert {r["variant"] for r in rows} == {
        *quantize_ab.FP8_BLOCK_VARIANTS,
        *quantize_ab.STRUCTURE_CEILINGS,
    }
    assert [r["bits"] for r in rows if r["variant"] == "lean_arithmetic (default)"] == ["identical"]
    assert all(r["us"] > 0 for r in rows) and "FP8 block 1x128" in text
    with pytest.raises(ValueError, match="kernel must be one of"):
        quantize_ab.main(str(tmp_path), small=True, kernel="fp8_block")


@pytest.mark.slow
def test_quantize_ab_nvfp4_runs_small(tmp_path):
    # NVFP4 with stochastic rounding: stops 26-33's kernel (integer division) and stops 34-35's
    # steps (native division, packed row amaxes, carry stochastic rounding, grid-min nearest
    # rounding: the default),
    # every one checked bit for bit against the first kernel (NaN / Inf / tiny blocks too)
    # before they are timed, in the interpreter.
    from benchmarks import quantize_ab

    text = quantize_ab.main(str(tmp_path), small=True, kernel="nvfp4_sr")
    rows = json.loads((tmp_path / "quantize_ab_nvfp4_sr.json").read_text())
    variants = [v for v in quantize_ab.NVFP4_VARIANTS if v != quantize_ab.NVFP4_BASELINE]
    assert len(variants) >= 3 and any(v.endswith("(default)") for v in variants)
    for variant in variants:
        assert [r["bits"] for r in rows if r["variant"] == variant] == ["identical"]
    assert all(r["us"] > 0 for r in rows) and "NVFP4 (Hadamard on col, stochastic" in text


def test_quantize_benchmark_runs_one_case_group_and_names_bad_ones(tmp_path):
    from benchmarks import bench_quantize

    with pytest.raises(ValueError, match="cases must be a non-empty subset"):
        bench_quantize.main(str(tmp_path), small=True, cases=("sweep", "all"))
    with pytest.raises(ValueError, match="cases must be a non-empty subset"):
        bench_quantize.main(str(tmp_path), small=True, cases=())


def test_count_quantize_ops_counts_the_lean_fp8_block_path():
    # The op-count proxy (cross-lowered for the H200, on the CPU): lean_arithmetic at least
    # halves the FP8 block 1×128 row+col arithmetic for bf16 input.
    import jax.numpy as jnp

    import pallas_kernels as pk
    from benchmarks import count_quantize_ops

    def row_col(config):
        return lambda x: pk.quantize_fp8_block(x, columnwise=True, config=config)

    exact = count_quantize_ops.per_element(
        row_col(pk.FP8BlockQuantizeConfig(lean_arithmetic=False)), jnp.bfloat16
    )
    lean = count_quantize_ops.per_element(row_col(None), jnp.bfloat16)
    assert 0 < 2 * lean < exact


def test_count_quantize_ops_counts_the_lean_nvfp4_stochastic_rounding():
    # NVFP4's lean arithmetic cuts the rowwise copy's stochastic rounding by more than 30%
    # (80.7 -> 52.8 counted on 2026-11-30).
    import jax.numpy as jnp

    import pallas_kernels as pk
    from benchmarks import count_quantize_ops

    def stochastic_row(lean):
        return lambda x: pk.quantize_nvfp4(
            x,
            rowwise_amax=jnp.float32(3.0),
            stochastic_rounding=True,
            rowwise_seed=jnp.uint32(1),
            config=pk.NVFP4QuantizeConfig(lean_arithmetic=lean),
        )

    exact = count_quantize_ops.per_element(stochastic_row(False), jnp.bfloat16)
    lean = count_quantize_ops.per_element(stochastic_row(True), jnp.bfloat16)
    assert 0 < lean < 0.7 * exact


def test_profile_grouped_summarizes_a_trace_and_runs_small(tmp_path):
    from benchmarks import profile_grouped

    # Two consumer tracks of one tile each: k_loop 0..8 µs, epilogue 8..10 µs, 1 µs gap on one.
    events = []
    for track, gap in ((1, 0.0), (2, 1.0)):
        for name, begin, end in (("k_loop", gap, 8.0 + gap), ("epilogue", 8.0 + gap, 10.0 + gap)):
            events.append(dict(name=name, ph="B", ts=begin, pid=1, tid=track))
            events.append(dict(name=name, ph="E", ts=end, pid=1, tid=track))
    events.append(dict(name="unrelated", ph="B", ts=-5.0, pid=1, tid=1))
    summary = profile_grouped.summarize_trace({"traceEvents": events})
    assert summary["consumer_tracks"] == 2
    assert summary["span_us"] == 10.0 and summary["k_loop_us"] == 8.0
    assert summary["epilogue_us"] == 2.0 and summary["epilogue_share"] == 0.2
    with pytest.raises(ValueError, match="no k_loop"):
        profile_grouped.summarize_trace({"traceEvents": []})

    # The interpreter writes no trace: the summary says so instead of failing.
    text = profile_grouped.main(str(tmp_path), small=True)
    assert "no trace written (interpreter)" in text


@pytest.mark.slow
def test_grouped_mx_ab_runs_small_with_its_ablations(tmp_path):
    # Every in-kernel MXFP8 variant equals the dequantize-then-GEMM path (interpreter); the
    # ablation kernels run and are reported as different.
    from benchmarks import grouped_mx_ab

    text = grouped_mx_ab.main(str(tmp_path), small=True, ablation=True)
    rows = json.loads((tmp_path / "grouped_mx_ab.json").read_text())
    diffs = {r["impl"]: r["max_rel_diff"] for r in rows}
    assert all(d == 0 for impl, d in diffs.items() if impl.startswith("in-kernel"))
    assert all(d > 0 for impl, d in diffs.items() if impl.startswith("ablation"))
    assert "XLA dense bf16" in diffs and "| G2 tiny" in text


def test_kernel_resources_reads_ptxas_reports():
    from benchmarks import kernel_resources

    report = """ptxas info    : Compiling entry function 'anonymous_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for anonymous_mosaic_gpu_kernel
    0 bytes stack frame, 200 bytes spill stores, 292 bytes spill loads
ptxas info    : Used 168 registers, used 2 barriers, 1 bytes smem"""
    assert kernel_resources.summarize(report) == ("168", "200/292")
    assert kernel_resources.summarize("nothing here") == ("?", "?")


def test_kernel_resources_shows_the_ptx_line_ptxas_refused(tmp_path):
    from benchmarks import kernel_resources

    error = (
        "loc(x): error: 'gpu.binary' op ptxas fatal   : (C7602) Insufficient registers (128) "
        "to compile instruction at line 5 in function k. Try to compile with register target "
        "of 154 or higher."
    )
    ptx = "\n".join([".version 8.8", ".target sm_90a", *(f"op{i}" for i in range(3, 12))])
    excerpt = kernel_resources.ptx_excerpt(error, ptx, context=1)
    assert excerpt.splitlines() == ["        4  op4", ">>      5  op5", "        6  op6"]
    assert kernel_resources.ptx_excerpt("no line named", ptx) is None
    # A case folder as the dump leaves it: the PTX found by its header, whatever its name.
    (tmp_path / "k.something").write_text(ptx)
    (tmp_path / "k.mlir").write_text("module {}")
    note = kernel_resources.record_ptxas_error(tmp_path, "noise\n" + error + "\nmore noise")
    assert note == "; ptxas refused it at PTX line 5 (ptxas_error.txt)"
    written = (tmp_path / "ptxas_error.txt").read_text()
    assert "C7602" in written and ">>      5  op5" in written and "noise" not in written
    assert kernel_resources.record_ptxas_error(tmp_path, "a compile error of another kind") == ""
    # Diagnostics printed to file descriptor 2 by the compiler are captured.
    log = tmp_path / "stderr.log"
    with kernel_resources.stderr_to(log):
        os.write(2, b"ptxas fatal : from C++\n")
    assert log.read_text() == "ptxas fatal : from C++\n"


def test_kernel_resources_wide_and_two_step_cases_pass_their_checks():
    # On the CPU the kernels themselves cannot run (Mosaic GPU needs the GPU or the
    # interpreter); their configs pass GroupedMatmulConfig's validation since stop 44.
    from benchmarks import kernel_resources

    cases = dict(kernel_resources.kernel_cases())
    for kind in ("bf16", "fp8 rowwise"):
        with pytest.raises(ValueError, match="Only interpret mode is supported on CPU"):
            cases[f"grouped {kind} G=8 3 consumers 64x256 parts"]()
    # Likewise the in-register kernels with two K steps a stage (stop 48): their config
    # passes the kernels' own checks (shared memory included) before Mosaic GPU refuses.
    for fmt in ("mxfp8", "nvfp4"):
        with pytest.raises(ValueError, match="Only interpret mode is supported on CPU"):
            cases[f"grouped {fmt} weights in registers two K steps a stage bfloat16"]()


@pytest.mark.skipif(
    shutil.which("ptxas") is None and not os.environ.get("PTXAS"), reason="needs ptxas"
)
def test_ptxas_wgmma_budget_finds_the_four_warpgroup_limit(tmp_path):
    # The rule _MAX_WGMMA_COLS encodes: with 512 threads one m64n256 is refused at 128
    # registers (it needs 154, stop 43's H200 refusal), two m64n128 compile.
    from benchmarks import ptxas_wgmma_budget

    table = ptxas_wgmma_budget.main(str(tmp_path / "budget.md"))
    rows = {
        tuple(line.split(" | ")[2:4]): line
        for line in table.splitlines()
        if line.startswith("| 512")
    }
    for operands in ("bf16", "e4m3"):
        assert "refused: C7602, budget 128, needs 154" in rows["m64n256", operands]
        assert "compiles (128 registers at entry)" in rows["m64n128 + m64n128", operands]
    assert "compiles" in rows["m64n200", "bf16"] and "refused" in rows["m64n208", "bf16"]
    assert (tmp_path / "budget.md").read_text() == table


def test_profile_step_sums_device_kernels_by_kind():
    from benchmarks import profile_step

    # A GPU process with one CUDA stream line and an "XLA Ops" line repeating the same time
    # (must not count twice), plus a host process whose events are not kernels.
    def meta(kind, pid, name, tid=None):
        event = dict(ph="M", pid=pid, name=kind, args=dict(name=name))
        return event if tid is None else {**event, "tid": tid}

    def kernel(pid, tid, name, dur, hlo_op="", op_path=None):
        args = dict(hlo_op=hlo_op) if op_path is None else dict(hlo_op=hlo_op, name=op_path)
        return dict(ph="X", pid=pid, tid=tid, ts=0.0, dur=dur, name=name, args=args)

    events = [
        meta("process_name", 1, "/device:GPU:0 NVIDIA H200"),
        meta("thread_name", 1, "Stream #13(Compute)", tid=13),
        meta("thread_name", 1, "XLA Ops", tid=2),
        meta("process_name", 7, "/host:CPU"),
        kernel(1, 13, "grouped_matmul_bf16", 3000.0),
        kernel(1, 13, "mosaic_gpu_kernel", 500.0, hlo_op="quantize_nvfp4"),
        # Without CUDA graphs a kernel's labels carry its jax op path ("name").
        kernel(1, 13, "sm90_xmma_gemm_bf16bf16", 1000.0, op_path="jit(step)/jvp()/dot_general"),
        kernel(1, 13, "loop_multiply_fusion", 250.0),
        kernel(1, 13, "loop_multiply_fusion", 250.0),
        kernel(1, 2, "fusion.3", 9999.0),
        kernel(7, 5, "PjitFunction(train_step)", 9999.0),
    ]
    found = profile_step.device_kernel_events({"traceEvents": events})
    assert len(found) == 5
    summary = profile_step.summarize_kernels(found, steps=2)
    assert summary["kernel_ms_per_step"] == 2.5
    assert summary["by_kind"] == {
        "Pallas GEMM (grouped / dense)": 1.5,
        "XLA GEMM (cuBLAS / cuDNN / Triton)": 0.5,
        "Pallas quantize / amax": 0.25,
        "XLA fusions and other kernels": 0.25,
    }
    fusion = [k for k in summary["top_kernels"] if k["name"] == "loop_multiply_fusion"]
    assert fusion == [
        dict(
            name="loop_multiply_fusion",
            kind="XLA fusions and other kernels",
            ms_per_step=0.25,
            launches_per_step=1.0,
            labels=dict(hlo_op=""),
        )
    ]
    rows = [
        dict(recipe="nvfp4", step_ms=74.0, compile_s=120.0, kernels=summary),
        dict(recipe="bf16", step_ms=1.0, compile_s=1.0, kernels=None),
    ]
    text = profile_step.markdown(rows)
    assert "| nvfp4 | 74.0 | 120 | 2.50 | 1.50 | 0.00 | 0.25 | 0.50 |" in text
    assert "no device kernels in the trace" in text and "`grouped_matmul_bf16`" in text
    gemm_row = "| `sm90_xmma_gemm_bf16bf16` | XLA GEMM (cuBLAS / cuDNN / Triton) | 0.500 | 0 |"
    assert f"{gemm_row} jit(step)/jvp()/dot_general |" in text
    with pytest.raises(ValueError, match="recipes must be"):
        profile_step.main(recipes=["fp16"])
    with pytest.raises(ValueError, match="steps must be"):
        profile_step.main(recipes=["bf16"], steps=0)


def test_profile_quantize_runs_small_and_names_bad_recipes(tmp_path):
    from benchmarks import profile_quantize

    with pytest.raises(ValueError, match="recipes must be a non-empty subset"):
        profile_quantize.main(str(tmp_path), recipes=("int4",), small=True)
    with pytest.raises(ValueError, match="backend must be 'auto' or 'pallas'"):
        profile_quantize.main(str(tmp_path), small=True, backend="reference")
    text = profile_quantize.main(str(tmp_path), recipes=("nvfp4",), calls=1, small=True)
    rows = json.loads((tmp_path / "profile_quantize.json").read_text())
    assert [(r["recipe"], r["case"]) for r in rows] == [
        ("nvfp4", "whole tensor"),
        ("nvfp4", "grouped (G=4)"),
    ]
    assert all(r["us"] > 0 for r in rows) and "### nvfp4, whole tensor" in text


def test_nvfp4_amax_ab_runs_small(tmp_path):
    # Mosaic GPU's interpreter on CPU: every variant matches the default's bits and is timed.
    from benchmarks import nvfp4_amax_ab

    text = nvfp4_amax_ab.main(str(tmp_path), small=True)
    rows = json.loads((tmp_path / "nvfp4_amax_ab.json").read_text())
    # Per Hadamard setting: the TMA kernel, the direct default, each direct size, XLA's max|x|.
    assert len(rows) == 2 * (2 + len(nvfp4_amax_ab.DIRECT_SIZES) + 1)
    assert all(r["bits"] in ("baseline", "identical", "—") for r in rows), rows
    assert all(r["us"] is not None for r in rows)
    assert "NVFP4 global amax" in text


def test_ncu_driver_runs_every_case_and_names_bad_ones():
    # benchmarks/h200.sh ncu runs each case under Nsight Compute on the H200; here each runs
    # once, tiny, in the interpreter.
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from benchmarks import ncu_cases

    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        for case in ncu_cases.CASES:
            ncu_cases.main(case, 1, size=256)
    with pytest.raises(ValueError, match=r"case must be one of .*got 'nvfp5'"):
        ncu_cases.main("nvfp5", 1)
    with pytest.raises(ValueError, match="calls must be at least 1, got 0"):
        ncu_cases.main("nvfp4", 0)


def test_ncu_source_reads_the_sass_table_and_names_bad_input():
    # Nsight Compute's --page source --csv output: log lines, the kernel's name, then the
    # SASS table (a few of its many columns here, as ncu 2025.3 names them).
    from benchmarks import ncu_source

    header = [
        "Address", "Source", ncu_source.SAMPLES, "Instructions Executed",
        "L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal", "stall_mio", "stall_short_sb",
        "stall_mio (Not Issued)",
    ]  # fmt: skip
    table = [
        ["0x10", "  LDS R157, [R161+0x28400]", "30", "1,048,576", "2,097,152", "1,048,576",
         "25", "0", "9"],
        ["0x20", "  FMUL R156, R157, R138", "60", "1,048,576", "0", "0", "0", "55", "0"],
        ["0x30", "  IADD3 R1, R2, R3, RZ", "10", "1,048,576", "0", "0", "0", "0", "0"],
    ]  # fmt: skip
    lines = ["==PROF== Connected to process 1", '"Kernel Name","grouped_matmul_wgrad"']
    lines += [",".join(f'"{cell}"' for cell in row) for row in [header, *table]]
    rows = ncu_source.read_instructions("\n".join(lines))
    report = ncu_source.summarize(rows, top=2)
    assert "| `LDS R157, [R161+0x28400]` | 1048576 | 2097152 | 1048576 | 30 |" in report
    assert "FMUL" not in report.split("stall samples in all")[0]  # touches no shared memory
    assert "stall samples in all: 100" in report
    assert "| `FMUL R156, R157, R138` | 60 | 60.0% | short_sb 55 |" in report
    assert "| `LDS R157, [R161+0x28400]` | 30 | 30.0% | mio 25 |" in report
    assert "IADD3" not in report  # third by samples, past top=2
    with pytest.raises(ValueError, match="no SASS table in the input"):
        ncu_source.read_instructions("==PROF== Disconnected")


@pytest.mark.slow
def test_scale_layout_ab_runs_small(tmp_path):
    # Quantize and the dense layer in both scale layouts (the interpreter): bits checked equal
    # before timing.
    from benchmarks import scale_layout_ab

    text = scale_layout_ab.main(str(tmp_path), small=True)
    rows = json.loads((tmp_path / "scale_layout_ab.json").read_text())
    assert len(rows) == 2 * 2 * len(scale_layout_ab.FORMATS)  # quantize and dense, two layouts
    assert {r["layout"] for r in rows} == {"lines", "tiles"}
    assert all(r["bits"] == "identical" and r["us"] > 0 for r in rows)
    assert "| dense fp8 block 1x128 fwd+bwd |" in text


def test_tile_traffic_gives_the_kernel_notes_numbers():
    # The hand-computed numbers of docs/kernels_grouped_matmul.md: 48 KB of lhs + rhs per K
    # step for 2.1 M products (the bf16 default) vs 56 KB for 3.1 M (three consumers), the
    # same shared-memory reads per product, a sixth less with the rows split.
    import dataclasses

    from benchmarks import tile_traffic
    from pallas_kernels import grouped_matmul_fwd as fwd

    default = tile_traffic.tile_traffic(fwd.DEFAULT_BF16_CONFIG, 2)
    assert (default.l2_bytes, default.multiply_adds) == (48 * 1024, 128 * 256 * 64)
    three = dataclasses.replace(
        fwd.DEFAULT_BF16_CONFIG, tile_m=192, consumer_split="m", num_consumers=3
    )
    wide = tile_traffic.tile_traffic(three, 2)
    assert (wide.l2_bytes, wide.multiply_adds) == (56 * 1024, 192 * 256 * 64)
    assert wide.smem_bytes_per_kmac == default.smem_bytes_per_kmac
    assert wide.wgmmas_per_k_slice == 2 and wide.accumulator_registers == 128
    rows_split = dataclasses.replace(fwd.DEFAULT_BF16_CONFIG, consumer_split="m")
    split = tile_traffic.tile_traffic(rows_split, 2)
    assert split.smem_read_bytes * 6 == default.smem_read_bytes * 5
    block = tile_traffic.tile_traffic(fwd.DEFAULT_FP8_BLOCK_CONFIG, 1, block_fp8=True)
    assert block.accumulator_registers == 128 and block.l2_bytes == 40 * 1024
    with pytest.raises(ValueError, match="itemsize must be 1"):
        tile_traffic.tile_traffic(fwd.DEFAULT_BF16_CONFIG, 4)
    assert "bf16 3 consumers 192 x (2 x 128) | 64 | 18.2 | 46.9 | 2 | 128 |" in tile_traffic.main()


def test_grid_fill_counts_visits_items_and_the_last_wave():
    # G8 balanced with 128-row tiles: 8 x 16 visits x 16 column tiles = 2048 items, 16 on the
    # busiest of 132 SMs (15.5 on average); 192-row tiles straddle the groups' starts.
    from benchmarks import tile_traffic
    from pallas_kernels import grouped_matmul_fwd as fwd

    sizes, cols = tile_traffic.SHAPES["G8 balanced"]
    default = tile_traffic.grid_fill(fwd.DEFAULT_BF16_CONFIG, sizes, cols)
    assert (default.items, default.items_per_sm, default.row_overhead) == (2048, 16, 1.0)
    assert default.fill == 2048 / (132 * 16)
    tall = tile_traffic.grid_fill(fwd.DEFAULT_FP8_BLOCK_CONFIG, sizes, cols)
    assert tall.row_overhead == 91 * 192 / 16384 and tall.items == 91 * 32
    # Stream-K: 1848 items whole (14 rounds), then 132 + 68 items x 64 K steps over 132 SMs:
    # the busiest runs 14 x 64 + 97 units of the 2048 x 64 / 132 = 992.97 on average.
    assert default.stream_k_fill == 2048 * 64 / (132 * (14 * 64 + 97))
    # Whole rounds: stream-K splits nothing.
    whole = tile_traffic.grid_fill(fwd.DEFAULT_BF16_CONFIG, [128 * 132], 256)
    assert whole.fill == whole.stream_k_fill == 1.0
    with pytest.raises(ValueError, match="need rows and columns"):
        tile_traffic.grid_fill(fwd.DEFAULT_BF16_CONFIG, [0, 0], 64)


def test_peers_ab_runs_small(tmp_path):
    # Our grouped and dense kernels (interpreted) against XLA in alternation; torch's peers
    # join only on a GPU.
    from benchmarks import peers_ab

    # (The layers from bf16 have a test of their own, below.)
    cases = tuple(c for c in peers_ab.CASE_GROUPS if c != "grouped_mx_layer")
    text = peers_ab.main(str(tmp_path), rounds=1, small=True, cases=cases)
    rows = json.loads((tmp_path / "peers_ab.json").read_text())
    assert {(r["case"], r["implementation"]) for r in rows} == {
        ("G2 small fwd bf16", "ours grouped_matmul bf16 (default)"),
        ("G2 small fwd bf16", "ours dense_matmul bf16 (same flops)"),
        ("G2 small fwd bf16", "XLA dense bf16 (same flops)"),
        ("G2 small fwd MXFP8", "ours: dequantize both + 16-bit kernel (library path)"),
        ("G2 small fwd MXFP8", "ours: dequantize tokens + MXFP8 weights in registers"),
        ("G2 small fwd MXFP8", "ours: the same, one wgmma per 64-wide K step"),
        ("G2 small fwd MXFP8", "ours: the same, two K steps a stage"),
        ("G2 small fwd MXFP8", "XLA dense bf16 (same flops)"),
        ("G2 small fwd MXFP8", "XLA scaled_matmul, dense (same flops)"),
        ("G2 small fwd NVFP4", "ours: dequantize both + 16-bit kernel (library path)"),
        ("G2 small fwd NVFP4", "ours: dequantize tokens (even/odd) + NVFP4 weights in registers"),
        ("G2 small fwd NVFP4", "ours: the same, codes decoded by byte permutes"),
        ("G2 small fwd NVFP4", "ours: the same by byte permutes, two K steps a stage"),
        ("G2 small fwd NVFP4", "XLA dense bf16 (same flops)"),
        ("G2 small fwd NVFP4", "XLA scaled_matmul, dense (same flops)"),
        ("G2 small fwd block FP8", "ours grouped_matmul_fp8_block (default)"),
        ("G2 small fwd block FP8", "XLA dense FP8, no block scales (same flops)"),
        ("G2 small wgrad block FP8", "ours grouped_matmul_wgrad, 1x128 block scales"),
        ("G2 small wgrad block FP8", "dequantized to bf16 + our 16-bit wgrad (before stop 53)"),
        ("G2 small wgrad block FP8", "XLA dense FP8, no block scales (same flops)"),
        ("dense 128^3 bf16", "ours dense_matmul bf16 (default)"),
        ("dense 128^3 bf16", "XLA dense bf16"),
        ("dense 128^3 block FP8", "ours dense_matmul_fp8_block (default)"),
        ("dense 128^3 block FP8", "XLA dense FP8, no block scales (ceiling)"),
        (
            "dense 128^3 block FP8, 1x128 rhs (wgrad)",
            "ours dense_matmul_fp8_block, rhs_block_rows=1",
        ),
        ("dense 128^3 block FP8, 1x128 rhs (wgrad)", "ours, MoE wgrad kernel, one group"),
        (
            "dense 128^3 block FP8, 1x128 rhs (wgrad)",
            "before: both dequantized to bf16 + XLA bf16 GEMM",
        ),
        ("dense 128^3 block FP8, 1x128 rhs (wgrad)", "XLA dense FP8, no block scales (ceiling)"),
    }
    assert all(r["ms"] > 0 and 0 < r["vs_fastest"] <= 1 for r in rows)
    # Checked against the library path (on the GPU both sum the same k16 products in order;
    # the interpreter's wgmma is one f32 dot per call, 32 vs 64 wide, so not here).
    (mx,) = [r for r in rows if r["implementation"].endswith("MXFP8 weights in registers")]
    assert isinstance(mx["same_bits"], bool)
    (permuted,) = [r for r in rows if r["implementation"].endswith("by byte permutes")]
    assert permuted["same_bits"] is True  # the interpreter runs the same integer steps
    # Two K steps a stage: the same wgmma calls as one step a stage. MXFP8's agrees with the
    # library path exactly when its one-step, 64-wide sibling does; NVFP4's always.
    rows_by_name = {r["implementation"]: r for r in rows}
    # The dense block-FP8 wgrad on either kernel: the same chunks promoted in the same order.
    assert rows_by_name["ours, MoE wgrad kernel, one group"]["same_bits"] is True
    assert (
        rows_by_name["ours: the same, two K steps a stage"]["same_bits"]
        is rows_by_name["ours: the same, one wgmma per 64-wide K step"]["same_bits"]
    )
    assert rows_by_name["ours: the same by byte permutes, two K steps a stage"]["same_bits"]
    assert "| dense 128^3 bf16 | XLA dense bf16 |" in text
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        peers_ab.main(str(tmp_path), rounds=0, small=True)
    with pytest.raises(ValueError, match="cases must be a non-empty subset"):
        peers_ab.main(str(tmp_path), rounds=1, small=True, cases=("dense",))


def _two_stand_in_candidates(label: str) -> dict:
    """Two cheap interleaved_seconds candidates, for tests of peers_ab's case dispatch."""
    import jax
    import jax.numpy as jnp

    add_one = jax.jit(lambda a: a + 1)
    return {f"{label} {i}": (add_one, [(jnp.ones(4),)]) for i in range(2)}


def test_peers_ab_grouped_mx_runs_the_mx_rows_alone(tmp_path, monkeypatch):
    # `--cases grouped_mx` builds the MXFP8 and NVFP4 cases only (cheap stand-ins here: the
    # full smoke run above interprets the real ones).
    from benchmarks import peers_ab

    def refuse(*args, **kwargs):
        raise AssertionError("grouped_mx must not build the bf16 / FP8 rowwise cases")

    built = []

    def stand_in(fmt):
        def make(g, m, k, n, sizes, small):
            built.append((fmt, g, m, small))
            return _two_stand_in_candidates(fmt), {}

        return make

    monkeypatch.setattr(peers_ab, "grouped_candidates", refuse)
    monkeypatch.setattr(peers_ab, "mxfp8_candidates", stand_in("MXFP8"))
    monkeypatch.setattr(peers_ab, "nvfp4_candidates", stand_in("NVFP4"))
    peers_ab.main(str(tmp_path), rounds=1, small=True, cases=("grouped_mx",))
    rows = json.loads((tmp_path / "peers_ab.json").read_text())
    assert {r["case"] for r in rows} == {"G2 small fwd MXFP8", "G2 small fwd NVFP4"}
    assert built == [("MXFP8", 2, 256, True), ("NVFP4", 2, 256, True)]


def test_peers_ab_grouped_mx_layer_runs_each_format_and_pass(tmp_path, monkeypatch):
    # `--cases grouped_mx_layer`: MXFP8 and NVFP4, forward (2 MKN flops) and forward +
    # backward (6 MKN), on the shape's equal groups (stand-ins here; the real candidates are
    # checked below).
    from benchmarks import peers_ab

    built = []

    def stand_in(mode, g, m, k, n, backward):
        built.append((mode, g, m, k, n, backward))
        return _two_stand_in_candidates(mode), {}

    monkeypatch.setattr(peers_ab, "mx_layer_candidates", stand_in)
    peers_ab.main(str(tmp_path), rounds=1, small=True, cases=("grouped_mx_layer",))
    rows = json.loads((tmp_path / "peers_ab.json").read_text())
    flops = {r["case"]: r["tflops"] * r["ms"] * 1e9 for r in rows}
    assert list(flops) == [
        "G2 small layer fwd MXFP8",
        "G2 small layer fwd+bwd MXFP8",
        "G2 small layer fwd NVFP4",
        "G2 small layer fwd+bwd NVFP4",
    ]
    assert [round(f / 256**3) for f in flops.values()] == [2, 6, 2, 6]
    assert built == [
        (mode, 2, 256, 256, 256, backward)
        for mode in ("mxfp8", "nvfp4")
        for backward in (False, True)
    ]


@pytest.mark.parametrize("mode", ["mxfp8", "nvfp4"])
def test_mx_layer_peer_is_jax_scaled_dot_general_on_the_same_layer(mode):
    # The peer issue 5 names, as a JAX user calls it: `jax.nn.scaled_dot_general` with jax's
    # own configs, from bf16, batched per expert. For CUDA it lowers to the block-scaled GEMM
    # (`__op$block_scaled_dot`) for all three MXFP8 GEMMs; jax 0.11.2's NVFP4 backward is two
    # bf16 `dot_general`s (only its forward is block-scaled). It computes our layer's
    # y, dx, dw: jax's MXFP8 quantizer gives our (TransformerEngine's) values here, NVFP4's
    # differs (no global amax, 1×16 weight blocks, no Hadamard transform or stochastic
    # rounding) by about its quantization noise.
    import jax

    from benchmarks import peers_ab

    candidates, differences = peers_ab.mx_layer_candidates(mode, 2, 128, 128, 64, backward=True)
    ours, xla, ours_bf16, xla_bf16 = candidates
    assert ours.startswith("ours: jax_qtrain.grouped_dense") and "scaled_dot_general" in xla
    # bf16 against the quantized layer: the quantization noise (~4% MXFP8, ~15% NVFP4).
    noise = differences[xla_bf16]
    assert 0.01 < noise < 0.5 and abs(differences[ours_bf16] - noise) < 0.01
    if mode == "mxfp8":
        assert differences[xla] < 1e-3, differences
    else:
        assert 0.01 < differences[xla] < 0.5, differences
    fn, (args,) = candidates[xla]
    target = "__op$block_scaled_dot"
    module = jax.export.export(
        fn, platforms=["cuda"], disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(target)]
    )(*args).mlir_module()
    assert f"custom_call @{target}" in module
    block_scaled_calls = module.count("call @_scaled_matmul")
    bf16_dots = module.count("stablehlo.dot_general")
    assert (block_scaled_calls, bf16_dots) == ((3, 0) if mode == "mxfp8" else (1, 2))
    with pytest.raises(ValueError, match=r"mode must be one of \('mxfp8', 'nvfp4'\), got 'fp8'"):
        peers_ab.mx_layer_candidates("fp8", 2, 128, 128, 64, backward=False)
    with pytest.raises(ValueError, match="m must split into g equal groups, got m=100, g=3"):
        peers_ab.mx_layer_candidates(mode, 3, 100, 128, 64, backward=False)


def _jnp_library_path(fmt: str) -> dict:
    """A candidates dict whose first entry is the library path's math in jnp (the formats'
    reference decode, one product per group) on MXFP8 / NVFP4 operands as peers_ab makes
    them: what `with_xla_block_scaled_peers` compares its peers with, without interpreting
    our kernels."""
    import jax
    import jax.numpy as jnp

    from jax_qtrain.formats import mxfp8, nvfp4

    g, m, k, n = 2, 256, 128, 128
    keys = jax.random.split(jax.random.key(5), 4)
    if fmt == "mxfp8":
        lhs = jax.random.normal(keys[0], (m, k)).astype(jnp.float8_e4m3fn)
        rhs = jax.random.normal(keys[1], (g, n, k)).astype(jnp.float8_e4m3fn)
        lhs_scale = jax.random.randint(keys[2], (m, k // 32), 120, 135).astype(jnp.uint8)
        rhs_scale = jax.random.randint(keys[3], (g, n, k // 32), 120, 135).astype(jnp.uint8)
        values = mxfp8.dequantize
    else:
        lhs = jax.random.randint(keys[0], (m, k // 2), 0, 256).astype(jnp.uint8)
        rhs = jax.random.randint(keys[1], (g, n, k // 2), 0, 256).astype(jnp.uint8)
        powers = jnp.exp2(jnp.arange(-3, 4, dtype=jnp.float32))
        lhs_scale = powers[jax.random.randint(keys[2], (m, k // 16), 0, 7)].astype(
            jnp.float8_e4m3fn
        )
        rhs_scale = powers[jax.random.randint(keys[3], (g, n, k // 16), 0, 7)].astype(
            jnp.float8_e4m3fn
        )

        def values(packed, scales):
            blocks = jnp.repeat(scales.astype(jnp.float32), 16, axis=1)
            return nvfp4.code_values(nvfp4.unpack_codes(packed)) * blocks

    def library_path(a, sa, b, sb, sizes):
        x = values(a, sa)
        w = values(b.reshape(g * n, -1), sb.reshape(g * n, -1)).reshape(g, n, k)
        return jnp.concatenate([x[:128] @ w[0].T, x[128:] @ w[1].T]).astype(jnp.bfloat16)

    operands = (lhs, lhs_scale, rhs, rhs_scale, jnp.asarray([128, 128], jnp.int32))
    return {"library path": (jax.jit(library_path), [operands])}


@pytest.mark.parametrize(
    "fmt, element_type", [("mxfp8", "f8E4M3FN"), ("nvfp4", "f4E2M1FN")], ids=["mxfp8", "nvfp4"]
)
def test_xla_block_scaled_peers_are_block_scaled_gemms_of_our_operands(fmt, element_type):
    # Stops 18-59 timed `jax.nn.scaled_dot_general` without `configs` as "XLA's MXFP8 GEMM":
    # that is a plain bf16 `lax.dot_general`. The peers now are XLA's block-scaled custom call
    # on our own codes and scales: lowered for CUDA, it takes the 8-bit / 4-bit operands
    # (not a bf16 dot), and it computes the library path's products.
    import jax
    import jax.numpy as jnp

    from benchmarks import peers_ab

    scale_dtype = jnp.float8_e8m0fnu if fmt == "mxfp8" else jnp.float8_e4m3fn
    element_dtype = jnp.float8_e4m3fn if fmt == "mxfp8" else jnp.float4_e2m1fn
    candidates, differences = peers_ab.with_xla_block_scaled_peers(
        _jnp_library_path(fmt), element_dtype, scale_dtype
    )
    batched = "XLA scaled_matmul, batched per expert (the same problem)"
    assert list(candidates) == ["library path", batched, "XLA scaled_matmul, dense (same flops)"]
    assert set(differences) == set(list(candidates)[1:])
    assert all(difference < 1e-3 for difference in differences.values()), differences
    fn, (args,) = candidates[batched]
    target = "__op$block_scaled_dot"
    exported = jax.export.export(
        fn, platforms=["cuda"], disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(target)]
    )(*args)
    module = exported.mlir_module()
    assert f"custom_call @{target}" in module
    assert f"tensor<2x128x128x{element_type}>" in module
    assert "dot_general" not in module
    # Unequal groups: no batched form, the dense one alone.
    library = _jnp_library_path(fmt)
    name = "library path"
    fn, [(lhs, lhs_scale, rhs, rhs_scale, _)] = library[name]
    library[name] = (fn, [(lhs, lhs_scale, rhs, rhs_scale, jnp.asarray([100, 156]))])
    _, differences = peers_ab.with_xla_block_scaled_peers(library, element_dtype, scale_dtype)
    assert list(differences) == ["XLA scaled_matmul, dense (same flops)"]


def test_peers_ab_block_fp8_operands_are_what_both_gemms_read():
    # The block-FP8 peer row is only meaningful if torch and our kernel read the same values:
    # our kernel on these operands must equal their dequantized product (the K-major lhs
    # scales, (K/128, M), are torch's outer-dim-major (M, K/128) seen transposed).
    import jax.numpy as jnp
    import numpy as np

    import pallas_kernels as pk
    from benchmarks import peers_ab

    lhs8, lhs_scale_k_major, rhs8, rhs_scale = peers_ab.block_fp8_operands(256, 256, 256)
    assert lhs_scale_k_major.shape == (2, 256) and rhs_scale.shape == (2, 2)
    scales = np.unique(np.asarray(jnp.concatenate([lhs_scale_k_major.ravel(), rhs_scale.ravel()])))
    assert set(np.log2(scales)) <= set(range(-3, 4)) and len(scales) > 1
    lhs = lhs8.astype(jnp.float32) * jnp.repeat(lhs_scale_k_major.T, 128, axis=1)
    rhs = rhs8.astype(jnp.float32) * jnp.repeat(jnp.repeat(rhs_scale, 128, 0), 128, 1)
    out = pk.dense_matmul_fp8_block(
        lhs8,
        lhs_scale_k_major,
        rhs8,
        rhs_scale,
        out_dtype=jnp.float32,
        config=peers_ab.SMALL_BLOCK_CONFIG,
        interpret=True,
        lhs_scale_k_major=True,
    )
    np.testing.assert_allclose(out, lhs @ rhs.T, rtol=1e-5, atol=1e-3)


def test_the_parts_of_a_test_selection_cover_it_once():
    # benchmarks/h200.sh's TEST_PART splits the `gpu` suite over device calls (stop 49: the whole
    # suite overran one 540 s call): the parts must be disjoint and cover the -m selection, so
    # the split must come after -m's deselection.
    import subprocess
    import sys
    from pathlib import Path

    def collected(*extra):
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
             "-m", "gpu and not slow", "tests/jax_qtrain/test_scale_layout.py", *extra],
            capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2],
        )  # fmt: skip
        return [line for line in result.stdout.splitlines() if "::" in line]

    whole, second_of_two = collected(), collected("--part", "2/2")
    assert len(whole) >= 3 and "test_gpu_" in second_of_two[0]
    assert sorted(whole)[1::2] == sorted(second_of_two)


@pytest.mark.parametrize("value", ["3/2", "0/2", "1", "a/b"])
def test_a_bad_part_is_refused_by_name(value):
    from tests.conftest import _part

    class Config:
        def getoption(self, name):
            assert name == "part"
            return value

    with pytest.raises(
        pytest.UsageError, match=f"--part must be I/N with 1 <= I <= N, got '{value}'"
    ):
        _part(Config())
