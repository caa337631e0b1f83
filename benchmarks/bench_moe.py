"""MoE expert block forward and forward+backward: `jax_qtrain.grouped_mlp` per recipe against the
same block in plain JAX (`lax.ragged_dot` in bfloat16, differentiated by JAX).

The block is what an MoE layer runs after routing: x (tokens, hidden) sorted by expert, FC1
(E, hidden, 2·ffn) → SwiGLU × router probabilities → FC2 (E, ffn, hidden), bf16 activations and
weights. Group sizes are balanced (tokens / E each) or skewed (expert e gets a share ∝ 1/(e+1)).
TFLOP/s counts the GEMMs only: 6·T·H·F forward, 18·T·H·F forward+backward, including the
quantization work inside the op (the layer's effective rate). "saved MiB" is what one call keeps
for its backward (`jq.saved_residuals`). The grouped GEMMs run on whatever
`jax_qtrain.ops.grouped_gemm` dispatches to: on the GPU the Pallas grouped kernels (native FP8
for per-tensor FP8 and block FP8's fprop/dgrad, the 16-bit ones for bf16 and for the dequantized
MXFP8, NVFP4 and block-FP8 wgrad operands). `bench_grouped_quantize` times the quantizers alone.
The blocks of one configuration and routing are timed in alternation
(`timing.interleaved_seconds`), the plain-JAX peer among them, so the GPU's clock drift falls on
all of them alike. A run on the GPU is long, and nothing is timed until every block has
compiled (each block's forward and forward+backward build their own Pallas kernels; on an H100,
2026-12-07, the 8-expert configuration's eight blocks had printed nothing after 500 s, and stop
18's run was cut by its time limit too): each block's first call (its compilation) is timed and
printed as it finishes, and `--blocks` times a subset, always with the peer, so that a run can
be split over device calls.

    python -m benchmarks.bench_moe [--small] [--out DIR] [--configs "8 experts" ...]
                                   [--routings balanced] [--budget SECONDS] [--blocks fp8 ...]
writes DIR/bench_moe.json and DIR/bench_moe.md and prints the table.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_qtrain as jq
from benchmarks.timing import (
    SMOKE_TIMING,
    device_description,
    interleaved_seconds,
    named_subset,
    report,
)

RECIPES = {
    "fp8": jq.Float8CurrentScaling(),
    "fp8-block": jq.Float8BlockScaling(),
    "mxfp8": jq.MXFP8BlockScaling(),
    "nvfp4": jq.NVFP4BlockScaling(),
}
CONFIGS = {  # name: (tokens, hidden, experts, ffn)
    "8 experts": (16384, 4096, 8, 1792),
    "64 small experts": (32768, 2048, 64, 1408),
}
SMALL_CONFIGS = {"4 experts": (256, 128, 4, 64), "16 small experts": (512, 64, 16, 32)}


def plain_jax_block(x, fc1, fc2, group_sizes, probs):
    """The reference block, written with lax.ragged_dot alone."""
    h = lax.ragged_dot(x, fc1, group_sizes, preferred_element_type=jnp.float32)
    a, b = jnp.split(h.astype(x.dtype).astype(jnp.float32), 2, axis=-1)
    act = (jax.nn.silu(a) * b * probs[:, None]).astype(x.dtype)
    y = lax.ragged_dot(act, fc2, group_sizes, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def quantized_block(recipe, gemm_backend: str | None = None):
    """The block under `recipe`; `gemm_backend="pallas"` also takes the opt-in GEMM paths
    (jax_qtrain.kernels._OPT_IN_GEMM_PATHS)."""

    def block(x, fc1, fc2, group_sizes, probs):
        return jq.grouped_mlp(x, fc1, fc2, group_sizes, probs, "swiglu", recipe=recipe)

    if gemm_backend is None:
        return block

    def under_backend(*args):
        with jq.kernels.gemm_backend(gemm_backend):  # read while tracing: part of the jit key
            return block(*args)

    return under_backend


def group_sizes_for(tokens: int, experts: int, routing: str) -> jax.Array:
    if routing == "balanced":
        sizes = np.full(experts, tokens // experts)
    else:  # skewed: shares ∝ 1/(e+1)
        shares = 1.0 / np.arange(1, experts + 1)
        sizes = np.floor(tokens * shares / shares.sum()).astype(np.int64)
    sizes[0] += tokens - sizes.sum()
    return jnp.asarray(sizes, jnp.int32)


def make_arguments(tokens, hidden, experts, ffn, routing, sets=2):
    out = []
    for i in range(sets):
        kx, k1, k2, kp, kg = jax.random.split(jax.random.key(i), 5)
        x = jax.random.normal(kx, (tokens, hidden), jnp.bfloat16)
        fc1 = (jax.random.normal(k1, (experts, hidden, 2 * ffn)) * hidden**-0.5).astype(
            jnp.bfloat16
        )
        fc2 = (jax.random.normal(k2, (experts, ffn, hidden)) * ffn**-0.5).astype(jnp.bfloat16)
        probs = jax.random.uniform(kp, (tokens,), jnp.float32)
        dy = jax.random.normal(kg, (tokens, hidden), jnp.bfloat16)
        out.append((x, fc1, fc2, group_sizes_for(tokens, experts, routing), probs, dy))
    return out


def compiled(block):
    """(forward, forward+backward) of `block` under jit, on the arguments of make_arguments."""
    forward = jax.jit(lambda x, w1, w2, gs, p, dy: block(x, w1, w2, gs, p))

    @jax.jit
    def train(x, w1, w2, gs, p, dy):
        y, vjp = jax.vjp(lambda x, w1, w2, p: block(x, w1, w2, gs, p), x, w1, w2, p)
        return y, vjp(dy)

    return forward, train


def saved_bytes(block, argument_set) -> int:
    """What one call of `block` keeps for its backward pass."""
    x, w1, w2, gs, p, _ = argument_set
    saved = jq.saved_residuals(lambda x, w1, w2, p: block(x, w1, w2, gs, p), x, w1, w2, p)
    return sum(r.nbytes for r in saved)


ROUTINGS = ("balanced", "skewed")


PEER = "bf16 (lax.ragged_dot)"


def blocks_to_time(names=None) -> dict:
    """{row label: block} for every configuration: the peer, bf16 and each recipe; with `names`,
    the peer and those blocks (a ValueError names any unknown one)."""
    blocks = {
        PEER: plain_jax_block,
        # jax_qtrain without a recipe: bf16 GEMMs on the Pallas grouped kernels (GPU)
        "bf16 (jax_qtrain)": quantized_block(None),
    }
    blocks |= {name: quantized_block(recipe) for name, recipe in RECIPES.items()}
    if jax.default_backend() == "gpu":
        # MXFP8 / NVFP4 fprop and dgrad with the weights dequantized in the GEMM kernel (stops
        # 46-47): opt-in, slower than the default path in stop 47's kernel timing.
        blocks["mxfp8 (weights in registers)"] = quantized_block(
            RECIPES["mxfp8"], gemm_backend="pallas"
        )
        blocks["nvfp4 (weights in registers)"] = quantized_block(
            RECIPES["nvfp4"], gemm_backend="pallas"
        )
    if not names:
        return blocks
    return {PEER: blocks[PEER]} | named_subset(blocks, [n for n in names if n != PEER], "blocks")


def run(
    configs: dict,
    timing: dict,
    budget_s: float | None = None,
    routings=ROUTINGS,
    blocks: dict | None = None,
) -> list[dict]:
    """One row per (config, routing, block); the blocks of one (config, routing) are timed in
    alternation (`timing.interleaved_seconds`), so clock drift falls on all of them alike. No
    new config starts after `budget_s`. `blocks`: those of `blocks_to_time` (default all)."""
    blocks = blocks_to_time() if blocks is None else blocks
    start = time.perf_counter()
    rows = []
    for config, (tokens, hidden, experts, ffn) in configs.items():
        for routing in routings:
            if budget_s is not None and time.perf_counter() - start > budget_s:
                print(f"time budget spent: skipping {config} {routing}", flush=True)
                continue
            argument_sets = make_arguments(tokens, hidden, experts, ffn, routing)
            head = {
                "config": config,
                "routing": routing,
                "shape": f"T={tokens} H={hidden} E={experts} F={ffn}",
            }
            forward, train, out_of_memory, compile_s = {}, {}, set(), {}
            for name, block in blocks.items():
                fwd, fwd_bwd = compiled(block)
                compile_start = time.perf_counter()
                try:  # one call of each first: it compiles, and finds what does not fit
                    jax.block_until_ready((fwd(*argument_sets[0]), fwd_bwd(*argument_sets[0])))
                except jax.errors.JaxRuntimeError as error:
                    # lax.ragged_dot's backward materializes a dense per-group operand: with
                    # 64 experts it asks for 55 GiB more than the H200's 141 GB hold.
                    if "RESOURCE_EXHAUSTED" not in str(error):
                        raise
                    out_of_memory.add(name)
                    print(f"{config} {routing}: {name} is out of memory", flush=True)
                    continue
                compile_s[name] = time.perf_counter() - compile_start
                print(
                    f"{config} {routing}: {name} compiled and run once in {compile_s[name]:.1f} s",
                    flush=True,
                )
                forward[name] = (fwd, argument_sets)
                train[name] = (fwd_bwd, argument_sets)
            forward_s = interleaved_seconds(forward, **timing)
            train_s = interleaved_seconds(train, **timing)
            baseline = train_s.get(PEER)
            flops = 6 * tokens * hidden * ffn
            for name, block in blocks.items():
                if name in out_of_memory:
                    rows.append(head | {"recipe": name, "error": "out of memory"})
                else:
                    rows.append(
                        head
                        | {
                            "recipe": name,
                            "forward_ms": forward_s[name] * 1e3,
                            "forward_tflops": flops / forward_s[name] / 1e12,
                            "fwd_bwd_ms": train_s[name] * 1e3,
                            "fwd_bwd_tflops": 3 * flops / train_s[name] / 1e12,
                            "speedup_vs_bf16": baseline / train_s[name] if baseline else None,
                            "saved_mib": saved_bytes(block, argument_sets[0]) / 2**20,
                            "compile_s": compile_s[name],
                        }
                    )
                print(rows[-1], flush=True)
    return rows


def _table_row(r: dict) -> str:
    head = f"| {r['config']} ({r['shape']}) | {r['routing']} | {r['recipe']} | "
    if "error" in r:
        return head + f"{r['error']} | | | | | |"
    speedup = "-" if r["speedup_vs_bf16"] is None else f"{r['speedup_vs_bf16']:.2f}"
    return head + (
        f"{r['forward_ms']:.3f} | {r['forward_tflops']:.0f} | {r['fwd_bwd_ms']:.3f} | "
        f"{r['fwd_bwd_tflops']:.0f} | {speedup} | {r['saved_mib']:.1f} |"
    )


def markdown(rows: list[dict]) -> str:
    lines = [
        f"MoE expert block (SwiGLU, router probs), bf16 in/out, {device_description()}",
        "",
        "| config | routing | recipe | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s "
        "| × bf16 | saved MiB |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [_table_row(r) for r in rows]
    return "\n".join(lines) + "\n"


def main(
    out_dir: str | None = None,
    small: bool = False,
    budget_s: float | None = None,
    config_names: list[str] | None = None,
    routings=ROUTINGS,
    block_names: list[str] | None = None,
) -> str:
    configs = named_subset(SMALL_CONFIGS if small else CONFIGS, config_names, "configs")
    blocks = blocks_to_time(block_names)  # unknown names fail here, before anything compiles
    timing = SMOKE_TIMING if small else dict(rounds=10, calls_per_batch=5)
    rows = run(configs, timing, budget_s, routings, blocks)
    text = markdown(rows)
    return report(out_dir, "bench_moe", rows, text)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--small", action="store_true", help="tiny shapes (runs on the CPU)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--configs", nargs="*", help=f"some of {list(CONFIGS)} (default: all)")
    parser.add_argument("--routings", nargs="*", choices=ROUTINGS, default=list(ROUTINGS))
    parser.add_argument("--budget", type=float, default=None, help="seconds; no new config after")
    parser.add_argument(
        "--blocks",
        nargs="*",
        help="time only these blocks (row labels, e.g. fp8 mxfp8), always with the peer "
        f"{PEER!r} (default: all)",
    )
    args = parser.parse_args()
    main(args.out, args.small, args.budget, args.configs, tuple(args.routings), args.blocks)
