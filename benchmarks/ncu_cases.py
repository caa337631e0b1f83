"""A driver for Nsight Compute: run one of our kernels a few times on an 8192² input.

    ncu --kernel-name regex:"quantize|matmul" --launch-skip 1 --launch-count 1 --section ... \
        python3 -m benchmarks.ncu_cases CASE [--calls N]

CASE is one of `CASES`: the NVFP4 quantize kernel alone (row + Hadamard col, fixed global
amaxes, as `bench_quantize.nvfp4_fixed_amax`), with and without stochastic rounding, and each
copy alone; MXFP8 row+col (a memory-bound kernel of the same tiles, for comparison); the
dense block-FP8 GEMM, 8192³ (`dense_matmul_fp8_block`, bf16 output); and the NVFP4 dequantize
kernel to bf16, with the float16 decode (the default) and with the integer one
(`DequantizeConfig(scaled_e2m1_decode=False)`).
`GROUPED_CASES` run issue 5's G8 balanced bf16 forward (16384 x 4096 x 4096, 8 groups of
2048 rows) through our `grouped_matmul` default and through its peer `torch._grouped_mm`
(CUTLASS) on the same operands, so that the two kernels' pipe, shared-memory and stall
figures can be read side by side (`--kernel-name regex:"matmul|cutlass|gemm"`), and the same
shape with MXFP8 / NVFP4 weights dequantized in registers (stops 46-47: `mxfp8_weights`,
`nvfp4_weights`, `nvfp4_weights_permute`; do the conversions fit beside the MMAs?), and the
block-FP8 MoE wgrad (G8 balanced, dW (8, 4096, 4096) bf16) at 2 to 6 pipeline stages
(`fp8_block_wgrad_3_stages` ...; `..._scales_first`: with `block_scales_before_mma`):
4 stages run 0.78-0.87x of 3 and 5 on every shape timed. Stop 56 read why from
`--section SourceCounters --page source --print-source sass`: ptxas put the row-scale loads
after the wgmma instructions at 4 stages, before them at 3 (`block_scales_before_mma`
now asks for before, the default since stop 57); `..._persistent`: with
`persistent_pipeline`, the default since stop 58 (the others keep a pipeline per tile).
`bash benchmarks/h200.sh ncu` profiles each. ncu locks the SM clock (~1.48 GHz on the H200), so
its durations are longer than CUPTI's: read its pipe, issue and stall figures, not its times.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from benchmarks.bench_quantize import nvfp4_fixed_amax
from pallas_kernels.grouped_matmul_fwd import fp8_block_default_config
from pallas_kernels.grouped_matmul_wgrad import DEFAULT_FP8_BLOCK_WGRAD_CONFIG, fit_to_shared_memory

SIZE = 8192


def _fp8_block_gemm(x: jax.Array, stagger_consumers: bool = False) -> jax.Array:
    k = x.shape[1]
    codes = x.astype(jnp.float8_e4m3fn)
    lhs_scale = jnp.full((x.shape[0], k // 128), 2.0**-3, jnp.float32)
    rhs_scale = jnp.full((x.shape[0] // 128, k // 128), 2.0**-3, jnp.float32)
    config = None
    if stagger_consumers:
        default = fp8_block_default_config(
            k, jnp.bfloat16, persistent_pipeline=True, num_consumers=2
        )
        config = dataclasses.replace(default, stagger_consumers=True)
    return pk.dense_matmul_fp8_block(codes, lhs_scale, codes, rhs_scale, config=config)


def _nvfp4_dequantize(x: jax.Array, config: pk.DequantizeConfig | None = None) -> jax.Array:
    rows, cols = x.shape
    codes = jnp.full((rows, cols // 2), 0x9B, jnp.uint8)  # codes 11 and 9 (-1.5, -0.5)
    scales = jnp.full((rows, cols // 16), 2.0, jnp.float8_e4m3fn)
    return pk.dequantize_nvfp4(
        codes, scales, jnp.float32(8.0), out_dtype=jnp.bfloat16, config=config
    )


CASES = {
    "nvfp4": functools.partial(nvfp4_fixed_amax, stochastic=False),
    "nvfp4_sr": functools.partial(nvfp4_fixed_amax, stochastic=True),
    "nvfp4_row": functools.partial(nvfp4_fixed_amax, columnwise=False),
    "nvfp4_col": functools.partial(nvfp4_fixed_amax, rowwise=False),
    "mxfp8": functools.partial(pk.quantize_mxfp8, rowwise=True, columnwise=True),
    "fp8_block_gemm": _fp8_block_gemm,
    "fp8_block_gemm_staggered": functools.partial(_fp8_block_gemm, stagger_consumers=True),
    "nvfp4_dequantize": _nvfp4_dequantize,
    "nvfp4_dequantize_integer": functools.partial(
        _nvfp4_dequantize, config=pk.DequantizeConfig(scaled_e2m1_decode=False)
    ),
}


def _g8_balanced_bf16() -> tuple[jax.Array, jax.Array, jax.Array]:
    """lhs (16384, 4096), rhs (8, 4096, 4096) (G, N, K), group sizes 8 x 2048."""
    keys = jax.random.split(jax.random.key(0), 2)
    lhs = jax.random.normal(keys[0], (16384, 4096), jnp.float32).astype(jnp.bfloat16)
    rhs = jax.random.normal(keys[1], (8, 4096, 4096), jnp.float32).astype(jnp.bfloat16)
    return lhs, rhs, jnp.full((8,), 2048, jnp.int32)


def _ours_bf16_grouped(calls: int) -> None:
    lhs, rhs, sizes = _g8_balanced_bf16()
    fn = jax.jit(pk.grouped_matmul)
    for _ in range(calls):
        jax.block_until_ready(fn(lhs, rhs, sizes))


def _torch_bf16_grouped(calls: int) -> None:
    import torch  # the H200 image has it; the CPU CI does not run this case

    lhs, rhs, sizes = _g8_balanced_bf16()
    offsets = jnp.cumsum(sizes).astype(jnp.int32)
    a, w, offs = (torch.from_dlpack(t) for t in (lhs, rhs, offsets))
    for _ in range(calls):
        torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
    torch.cuda.synchronize()


def _weights_in_registers(calls: int, fmt: str, e2m1_decode: str = "float32") -> None:
    """The same G8 shape with the weights dequantized in registers (stops 46-47), bf16 tokens
    (as from the dequantize kernel) and MXFP8 or NVFP4 weights, f32 packed output as the
    library calls it."""
    lhs, rhs, sizes = _g8_balanced_bf16()
    keys = jax.random.split(jax.random.key(1), 2)
    groups, n, k = rhs.shape
    if fmt == "mxfp8":
        codes = rhs.astype(jnp.float8_e4m3fn)
        scales = jax.random.randint(keys[0], (groups, n, k // 32), 120, 135).astype(jnp.uint8)
        fn = jax.jit(functools.partial(pk.grouped_matmul_mxfp8_weights, out_dtype=jnp.float32))
    else:
        codes = jax.random.randint(keys[0], (groups, n, k // 2), 0, 256).astype(jnp.uint8)
        scales = jnp.exp2(
            jax.random.randint(keys[1], (groups, n, k // 16), -3, 4).astype(jnp.float32)
        ).astype(jnp.float8_e4m3fn)
        fn = jax.jit(
            functools.partial(
                pk.grouped_matmul_nvfp4_weights,
                lhs_order="even_odd",
                e2m1_decode=e2m1_decode,
                out_dtype=jnp.float32,
            )
        )
    del rhs
    for _ in range(calls):
        jax.block_until_ready(fn(lhs, codes, scales, sizes))


def _fp8_block_wgrad(
    calls: int, stages: int, scales_first: bool = False, persistent: bool = False
) -> None:
    """dW[g] = x_gᵀ dy_g over G8 balanced groups from the columnwise copies (4096, 16384) with
    their 1x128 token-block scales, bf16 out, the MoE default config at `stages` stages
    (`scales_first`: with `block_scales_before_mma`; `persistent`: with
    `persistent_pipeline`)."""
    from benchmarks.peers_ab import block_fp8_operands

    lhs8, lhs_scale_k_major, _, _ = block_fp8_operands(4096, 16384, 4, seed=13)
    rhs8, rhs_scale_k_major, _, _ = block_fp8_operands(4096, 16384, 4, seed=14)
    config = dataclasses.replace(
        DEFAULT_FP8_BLOCK_WGRAD_CONFIG,
        max_concurrent_steps=stages,
        block_scales_before_mma=scales_first,
        persistent_pipeline=persistent,
    )
    config = fit_to_shared_memory(config, (1, 1, 2), block_scaled=True)
    fn = jax.jit(
        lambda a, sa, b, sb, s: pk.grouped_matmul_wgrad(
            a, b, s, lhs_block_scale=sa, rhs_block_scale=sb, out_dtype=jnp.bfloat16, config=config
        )
    )
    sizes = jnp.full((8,), 2048, jnp.int32)
    for _ in range(calls):
        jax.block_until_ready(fn(lhs8, lhs_scale_k_major.T, rhs8, rhs_scale_k_major.T, sizes))


GROUPED_CASES = {
    "bf16_grouped": _ours_bf16_grouped,
    "torch_bf16_grouped": _torch_bf16_grouped,
    "mxfp8_weights": functools.partial(_weights_in_registers, fmt="mxfp8"),
    "nvfp4_weights": functools.partial(_weights_in_registers, fmt="nvfp4"),
    "nvfp4_weights_permute": functools.partial(
        _weights_in_registers, fmt="nvfp4", e2m1_decode="byte_permute"
    ),
    **{
        f"fp8_block_wgrad_{stages}_stages": functools.partial(_fp8_block_wgrad, stages=stages)
        for stages in (2, 3, 4, 5, 6)
    },
    **{
        f"fp8_block_wgrad_{stages}_stages_scales_first": functools.partial(
            _fp8_block_wgrad, stages=stages, scales_first=True
        )
        for stages in (3, 4)
    },
    # The MoE default (4 stages, scales first, since stop 57) with one pipeline from tile to
    # tile: do the consumers still wait on the TMA barriers at every tile's start?
    "fp8_block_wgrad_4_stages_scales_first_persistent": functools.partial(
        _fp8_block_wgrad, stages=4, scales_first=True, persistent=True
    ),
}


def main(case: str, calls: int, size: int = SIZE) -> None:
    if case not in CASES and case not in GROUPED_CASES:
        names = sorted(CASES) + sorted(GROUPED_CASES)
        raise ValueError(f"case must be one of {names}, got {case!r}")
    if calls < 1:
        raise ValueError(f"calls must be at least 1, got {calls}")
    if case in GROUPED_CASES:
        GROUPED_CASES[case](calls)
        return
    x = jax.random.normal(jax.random.key(0), (size, size), jnp.float32).astype(jnp.bfloat16)
    fn = jax.jit(CASES[case])
    for _ in range(calls):
        jax.block_until_ready(fn(x))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("case", choices=sorted(CASES) + sorted(GROUPED_CASES))
    parser.add_argument("--calls", type=int, default=2)
    args = parser.parse_args()
    main(args.case, args.calls)
