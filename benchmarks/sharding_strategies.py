"""The two ways to gather a split weight (jax_qtrain.sharding): bytes moved and CPU time.

Bytes are exact, from shapes (`jax_qtrain.sharding.gather_bytes`): what one device receives per
training step for one (K, N) kernel split 8 ways — the forward gather, the backward re-gather and
the float32 gradient reduce-scatter (ring collectives: (P-1)/P of the array per device).

Time is the median forward+backward of one `jax_qtrain.sharding.dense` call. Where JAX sees
GPUs (the device tool's `nvidia-h200-x2`) it runs on all of them over NCCL, at a size worth
splitting (x 16384×4096, kernel 4096×4096); elsewhere on 8 virtual CPU devices
(`--xla_force_host_platform_device_count=8`, x 4096×1024, kernel 1024×1024), which is NOT a
communication measurement: the "devices" share one host's memory and cores, a collective is a
memory copy, and the time is mostly the quantization and GEMM work of 8 devices on the host.

    python -m benchmarks.sharding_strategies [--bytes-only] [--out table.md]
"""

from __future__ import annotations

import argparse
import os
import traceback

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax
import jax.numpy as jnp

import jax_qtrain as jq
from benchmarks.timing import median_seconds
from jax_qtrain import sharding as jqs

RECIPES = {
    "unquantized": None,
    "FP8 current": jq.Float8CurrentScaling(),
    "FP8 block": jq.Float8BlockScaling(),
    "MXFP8": jq.MXFP8BlockScaling(),
    "NVFP4": jq.NVFP4BlockScaling(),
}
STRATEGY_NAMES = {
    "gather_then_quantize": "(a) gather, then quantize",
    "quantize_then_gather": "(b) quantize, then gather",
}
MIB = 2**20


def bytes_markdown(features: int = 4096, shards: int = 8) -> str:
    """Per-device MiB per step for a features×features kernel, bf16 and float32 parameters."""
    lines = [
        f"Bytes one device receives per training step for one {features}×{features} kernel "
        f"split {shards} ways (default backward mode; MiB = 2^20 bytes).",
        "",
        "| recipe | params | strategy | forward gather | backward gather | grad reduce-scatter "
        "| total |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for dtype_name, dtype in (("bf16", jnp.bfloat16), ("fp32", jnp.float32)):
        for recipe_name, recipe in RECIPES.items():
            strategies = (
                STRATEGY_NAMES if recipe is not None else {"gather_then_quantize": "gather"}
            )
            for strategy, strategy_name in strategies.items():
                moved = jqs.gather_bytes(
                    (features, features), dtype, recipe, strategy=strategy, axis_size=shards
                )
                lines.append(
                    f"| {recipe_name} | {dtype_name} | {strategy_name} | "
                    f"{moved.forward / MIB:.2f} | {moved.backward / MIB:.2f} | "
                    f"{moved.grad_reduce_scatter / MIB:.2f} | {moved.total / MIB:.2f} |"
                )
    return "\n".join(lines) + "\n"


def timing_markdown(iters: int = 10) -> str:
    """Median ms of a jitted forward+backward of one split-kernel dense layer per strategy, on
    every GPU of the host, or on 8 virtual CPU devices where there is none."""
    on_gpu = jax.default_backend() == "gpu"
    devices = jax.device_count() if on_gpu else 8
    tokens, features = (16384, 4096) if on_gpu else (4096, 1024)
    mesh = jax.make_mesh((devices,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (tokens, features), jnp.bfloat16)
    kernel = (jax.random.normal(keys[1], (features, features)) * 0.02).astype(jnp.bfloat16)
    dy = jax.random.normal(keys[2], (tokens, features), jnp.bfloat16)
    where = (
        f"{devices}× {jax.devices()[0].device_kind}, jax {jax.__version__}"
        if on_gpu
        else f"8 virtual CPU devices ({os.cpu_count()} host cores). CPU time, not "
        "communication time"
    )
    lines = [
        f"Forward+backward of one split-kernel layer, x {tokens}×{features} bf16 (rows split "
        f"over the devices), kernel {features}×{features} bf16, {where}; median of {iters} (ms).",
        "",
        "| recipe | (a) gather, then quantize | (b) quantize, then gather |",
        "|---|---:|---:|",
    ]
    for recipe_name, recipe in RECIPES.items():
        if recipe is None:
            continue
        cells = []
        for strategy in STRATEGY_NAMES:
            sharding = jqs.WeightSharding(mesh, "fsdp", strategy=strategy)
            x_s, kernel_s, dy_s = sharding.shard_batch(x), sharding.shard_kernel(kernel), dy

            @jax.jit
            def step(x, kernel, dy, sharding=sharding, recipe=recipe):
                _, vjp = jax.vjp(
                    lambda x, k: jqs.dense(x, k, sharding=sharding, recipe=recipe), x, kernel
                )
                return vjp(dy)

            try:
                seconds = median_seconds(step, [(x_s, kernel_s, dy_s)], warmup=2, iters=iters)
            except Exception as error:  # a failing cell is a table entry, not the end of the run
                traceback.print_exc()
                cells.append(f"failed: {type(error).__name__}")
                continue
            cells.append(f"{seconds * 1e3:.1f}")
        lines.append(f"| {recipe_name} | {' | '.join(cells)} |")
        print(lines[-1], flush=True)  # a run cut at its time limit keeps the rows it finished
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bytes-only", action="store_true")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    text = bytes_markdown()
    if not args.bytes_only:
        text += "\n" + timing_markdown(iters=args.iters)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
