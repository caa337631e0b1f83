"""Our grouped and dense GEMMs against their peers, timed in alternation (issue 5).

`bench_grouped_matmul` times each implementation in a block of its own, one after another:
on the H200, whose SM clock idles at 345 MHz and ramps up under load, the rows timed first
ran slower, so its "ours vs torch" ratios mixed the clocks into the comparison (stop 45:
bf16 G8 balanced 683 against torch's 777, where stop 41 had 738 against 765). Here every
implementation of a case runs batch by batch in alternation
(`benchmarks.timing.interleaved_seconds`), torch's on the *same* operands (shared through
DLPack: a GEMM's power draw, and so its clock, depends on the data):

* G8 balanced and skewed, forward, bf16: our `grouped_matmul` default, `torch._grouped_mm`,
  jax's `ragged_dot_mgpu` (the Mosaic GPU kernel in the jax wheel), our `dense_matmul` and
  XLA's dense GEMM at the same M, K, N on the first expert's weight (same flops);
* the same, FP8 rowwise (E4M3, a scale per row and per output column):
  `torch._scaled_grouped_mm` and XLA's dense FP8 GEMM;
* G8 forward with MXFP8 tokens and weights: the library's path (both dequantized by the
  Pallas kernel, then the 16-bit kernel) against the weights dequantized in registers
  (`grouped_matmul_mxfp8_weights`, stop 46; one wgmma per MX block or per 64-wide K step,
  and two K steps a stage, stop 48), checked bit for bit against it first; XLA's dense
  bf16 GEMM of the same flops (issue 5's "≥ 0.95× XLA dense bf16") and XLA's own
  block-scaled GEMM (`jax.nn.scaled_matmul`) on the same codes and scales, batched per expert
  (balanced groups) and dense (stops 18-59 timed `scaled_dot_general` without `configs` here:
  a plain bf16 dot);
* the same with NVFP4 tokens and weights: the library's path against the weights dequantized
  in registers (`grouped_matmul_nvfp4_weights`, stop 47), its tokens dequantized in the
  kernel's even/odd column order (the same products summed in another order: not bit for bit),
  with either decode of the codes and with two K steps a stage (the three checked bit for
  bit against each other), and XLA's block-scaled GEMM on the same E2M1 codes and E4M3 scales;
* the G8 balanced layer from bf16, MXFP8 and NVFP4, forward and forward + backward (both
  operands quantized in every call): `jax_qtrain.grouped_dense` under the recipe against
  `jax.nn.scaled_dot_general` with jax's own MXFP8 / NVFP4 configs (batched per expert: the
  peer issue 5 names, used as a JAX user would), with our 16-bit layer and XLA's batched
  bf16 GEMM as yardsticks;
* dense 8192³ bf16: `dense_matmul`, XLA, and `torch.mm` (cuBLAS);
* dense 8192³ block FP8 (1×128 lhs, 128×128 rhs blocks, E4M3 codes, power-of-2 scales):
  `dense_matmul_fp8_block`'s default against `torch._scaled_mm` with the same block scales
  (cuBLASLt's block-scaled FP8 GEMM, CUDA ≥ 12.9: the GEMM TransformerEngine's
  Float8BlockScaling recipe calls on Hopper), its output checked against ours first (a
  different summation order, so close rather than bit for bit); XLA's dense FP8 GEMM without
  block scales as the ceiling; and the same with 1×128 blocks on both operands (a wgrad's
  two token-direction copies: `rhs_block_rows=1`) against the path the library took before
  (both dequantized to bf16, XLA's GEMM) and cuBLASLt's two-1×128 GEMM (TE's wgrad);
* G8 forward with block-FP8 tokens and weights: `grouped_matmul_fp8_block`'s default against
  one such `torch._scaled_mm` per expert (TransformerEngine's grouped GEMM on Hopper calls
  cuBLASLt per GEMM; only where every group's rows are a multiple of 4, cuBLASLt's rule);
* G8 balanced block-FP8 wgrad (two 1×128 token-block copies): the FP8 wgrad kernel with block
  scales (stop 51, opt-in in the library until timed here) against the library's current
  path (both dequantized to bf16, the 16-bit wgrad kernel) and one cuBLASLt GEMM per expert.

    python -m benchmarks.peers_ab [--out DIR] [--rounds N] [--small] [--cases NAME ...]

`--cases` picks groups of cases: `grouped` (the bf16, FP8 rowwise, MXFP8 and NVFP4 G8 rows),
`grouped_mx` (its MXFP8 and NVFP4 rows alone), `grouped_mx_layer` (the layers from bf16),
`grouped_fp8_block`, `grouped_fp8_block_wgrad` (G8 balanced only: whole 128-token groups),
`dense_bf16`, `dense_fp8_block` (default: all).

writes DIR/peers_ab.json and .md. `--small` runs tiny shapes, our kernels in the Pallas
interpreter and no torch (a smoke test; the numbers mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_kernels as pk
from benchmarks.bench_grouped_matmul import BF16, E4M3, JAX_RAGGED_DOT_CONFIGS, random_operands
from benchmarks.grouped_ab import DENSE_SIZE, SHAPES
from benchmarks.timing import (
    device_description,
    interleaved_seconds,
    relative_difference,
    report,
    same_bits_as_first,
)
from pallas_kernels.grouped_matmul_dense import dense_matmul, dense_matmul_fp8_block
from pallas_kernels.grouped_matmul_fwd import GroupedMatmulConfig, grouped_matmul
from pallas_kernels.grouped_matmul_mx_weights import (
    TWO_STEPS_WEIGHTS_CONFIG,
    grouped_matmul_mxfp8_weights,
    grouped_matmul_nvfp4_weights,
)

SMALL_SHAPES = {"G2 small": (2, 256, 256, 256, [100, 156])}
SMALL_CONFIG = GroupedMatmulConfig(tile_m=64, tile_n=64, tile_k=64, num_sms=2, epi_tile_n=64)
# (Block FP8 steps K by 128: its blocks.)
SMALL_BLOCK_CONFIG = dataclasses.replace(SMALL_CONFIG, tile_k=128)
SMALL_WGRAD_BLOCK_CONFIG = pk.GroupedWgradConfig(
    tile_m=128, tile_n=64, tile_t=128, max_concurrent_steps=2, epi_tile_n=32, num_sms=2
)
CASE_GROUPS = (
    "grouped",
    "grouped_mx",  # the MXFP8 and NVFP4 rows of "grouped" alone
    "grouped_mx_layer",  # from bf16: grouped_dense against jax.nn.scaled_dot_general
    "grouped_fp8_block",
    "grouped_fp8_block_wgrad",
    "dense_bf16",
    "dense_fp8_block",
)


def _two_steps(config: GroupedMatmulConfig | None) -> GroupedMatmulConfig:
    """The in-register kernels' config (None: their default) staged as the kernels' own
    two-K-steps-a-stage config (stop 48)."""
    two = TWO_STEPS_WEIGHTS_CONFIG
    if config is None:
        return two
    return dataclasses.replace(
        config, tile_k=two.tile_k, max_concurrent_steps=two.max_concurrent_steps
    )


# XLA's FP8 GEMM a @ bᵀ with no block scales (cuBLASLt's per-tensor FP8 path): the ceiling that
# the FP8 cases are measured against.
xla_fp8_nt = jax.jit(
    lambda a, b: lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=BF16)
)


class _TorchResult:
    """A torch output that `jax.block_until_ready` can wait for (it calls this method)."""

    def __init__(self, torch_module) -> None:
        self._torch = torch_module

    def block_until_ready(self) -> _TorchResult:
        self._torch.cuda.synchronize()
        return self


def _torch():
    """torch when it can run on this machine's GPU, else None (the peers are then skipped)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available() or jax.default_backend() != "gpu":
        return None
    return torch


def to_torch(torch, array: jax.Array):
    """A torch view of a jax GPU array (DLPack; FP8 as its bytes, viewed back as FP8, since
    DLPack's FP8 support varies between versions)."""
    fp8 = {jnp.dtype(jnp.float8_e4m3fn): "float8_e4m3fn", jnp.dtype(jnp.float8_e5m2): "float8_e5m2"}
    if array.dtype in fp8:
        as_bytes = torch.from_dlpack(lax.bitcast_convert_type(array, jnp.uint8))
        return as_bytes.view(getattr(torch, fp8[array.dtype]))
    return torch.from_dlpack(array)


def _torch_candidate(torch, fn, arg_sets) -> tuple:
    """An interleaved_seconds candidate running torch ``fn`` on jax arrays (via DLPack)."""
    torch_sets = [tuple(to_torch(torch, a) for a in args) for args in arg_sets]

    def call(*args):
        fn(*args)
        return _TorchResult(torch)

    return call, torch_sets


def grouped_candidates(sets, fp8: bool, small: bool) -> dict:
    """Every implementation of one grouped forward case (and its dense yardsticks)."""
    interpret = small
    config = SMALL_CONFIG if small else None
    sizes = sets[0]["sizes"]
    if fp8:
        ours = jax.jit(
            lambda a, b, s, sa, sb: grouped_matmul(
                a, b, s, lhs_scale=sa, rhs_scale=sb, config=config, interpret=interpret
            )
        )
        candidates = {
            "ours grouped_matmul FP8 rowwise (default)": (
                ours,
                [
                    (x["lhs8"], x["rhs8"], sizes, x["lhs_row_scale"], x["rhs_col_scale"])
                    for x in sets
                ],
            ),
            "XLA dense FP8 (same flops)": (
                xla_fp8_nt,
                [(x["lhs8"], x["rhs8"][0]) for x in sets],
            ),
        }
    else:
        candidates = {
            "ours grouped_matmul bf16 (default)": (
                jax.jit(
                    lambda a, b, s: grouped_matmul(a, b, s, config=config, interpret=interpret)
                ),
                [(x["lhs"], x["rhs"], sizes) for x in sets],
            ),
            "ours dense_matmul bf16 (same flops)": (
                jax.jit(lambda a, b: dense_matmul(a, b, config=config, interpret=interpret)),
                [(x["lhs"], x["rhs"][0]) for x in sets],
            ),
            "XLA dense bf16 (same flops)": (
                jax.jit(lambda a, b: a @ b.T),
                [(x["lhs"], x["rhs"][0]) for x in sets],
            ),
        }
        if not small:
            from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

            # One of bench_grouped_matmul's configs for it (its best were within ~1%).
            candidates["jax ragged_dot_mgpu bf16"] = (
                jax.jit(
                    lambda a, b, s: ragged_dot_mgpu.ragged_dot(
                        a, b, group_sizes=s, transpose_rhs=True, **JAX_RAGGED_DOT_CONFIGS[1]
                    )
                ),
                [(x["lhs"], x["rhs"], sizes) for x in sets],
            )
    torch = None if small else _torch()
    if torch is not None:
        offsets = jnp.cumsum(sizes).astype(jnp.int32)
        if fp8:
            candidates["torch._scaled_grouped_mm FP8 rowwise"] = _torch_candidate(
                torch,
                lambda a, b, sa, sb, offs: torch._scaled_grouped_mm(
                    a, b.transpose(-2, -1), sa, sb, offs=offs, out_dtype=torch.bfloat16
                ),
                [
                    (x["lhs8"], x["rhs8"], x["lhs_row_scale"], x["rhs_col_scale"], offsets)
                    for x in sets
                ],
            )
        else:
            candidates["torch._grouped_mm bf16"] = _torch_candidate(
                torch,
                lambda a, b, offs: torch._grouped_mm(a, b.transpose(-2, -1), offs=offs),
                [(x["lhs"], x["rhs"], offsets) for x in sets],
            )
    return candidates


def mxfp8_candidates(g: int, m: int, k: int, n: int, sizes, small: bool) -> tuple[dict, dict]:
    """(candidates, peer differences) of MXFP8 tokens and weights (random codes, scale bytes
    120..134): the library's path (both dequantized to bf16 by the Pallas kernel, then the
    16-bit grouped kernel) against the weights dequantized in registers
    (`grouped_matmul_mxfp8_weights`, the tokens still through the dequantize kernel), XLA's
    dense bf16 GEMM of the same flops (issue 5's "≥ 0.95× XLA dense bf16") and XLA's own MXFP8
    GEMM on the same codes and scales (`with_xla_block_scaled_peers`)."""
    keys = jax.random.split(jax.random.key(11), 4)
    lhs = jax.random.normal(keys[0], (m, k), jnp.float32).astype(E4M3)
    rhs = jax.random.normal(keys[1], (g, n, k), jnp.float32).astype(E4M3)
    lhs_scale = jax.random.randint(keys[2], (m, k // 32), 120, 135).astype(jnp.uint8)
    rhs_scale = jax.random.randint(keys[3], (g, n, k // 32), 120, 135).astype(jnp.uint8)
    sizes = jnp.asarray(sizes, jnp.int32)
    interpret = small
    config = SMALL_CONFIG if small else None
    weights_config = (
        dataclasses.replace(SMALL_CONFIG, tile_n=64, epilogue_buffers=1) if small else None
    )

    def tokens_bf16(a, sa):
        return pk.dequantize_mxfp8(a, sa, out_dtype=BF16, interpret=interpret)

    def library_path(a, sa, b, sb, s):
        weights = pk.dequantize_mxfp8(
            b.reshape(g * n, k), sb.reshape(g * n, k // 32), out_dtype=BF16, interpret=interpret
        ).reshape(g, n, k)
        return grouped_matmul(tokens_bf16(a, sa), weights, s, config=config, interpret=interpret)

    def weights_in_registers(a, sa, b, sb, s, wgmma_k=32, config=weights_config):
        return grouped_matmul_mxfp8_weights(
            tokens_bf16(a, sa),
            b,
            sb,
            s,
            config=config,
            wgmma_k=wgmma_k,
            interpret=interpret,
        )

    operands = [(lhs, lhs_scale, rhs, rhs_scale, sizes)]
    dense = (lhs.astype(BF16), rhs[0].astype(BF16))
    candidates = {
        "ours: dequantize both + 16-bit kernel (library path)": (
            jax.jit(library_path),
            operands,
        ),
        "ours: dequantize tokens + MXFP8 weights in registers": (
            jax.jit(weights_in_registers),
            operands,
        ),
        "ours: the same, one wgmma per 64-wide K step": (
            jax.jit(functools.partial(weights_in_registers, wgmma_k=64)),
            operands,
        ),
        "ours: the same, two K steps a stage": (
            jax.jit(
                functools.partial(
                    weights_in_registers, wgmma_k=64, config=_two_steps(weights_config)
                )
            ),
            operands,
        ),
        "XLA dense bf16 (same flops)": (jax.jit(lambda a, b: a @ b.T), [dense]),
    }
    return with_xla_block_scaled_peers(candidates, jnp.float8_e4m3fn, jnp.float8_e8m0fnu)


def with_xla_block_scaled_peers(candidates: dict, element_dtype, scale_dtype) -> tuple[dict, dict]:
    """(`candidates` and the peers below, {peer: max |peer - ours| / max |ours| over the rows
    both compute}). `candidates` comes first with the library path, on (lhs codes, lhs scales,
    rhs codes, rhs scales, group sizes). The peers are XLA's own block-scaled GEMM,
    `jax.nn.scaled_matmul` (the `__op$block_scaled_dot` custom call, which XLA lowers for the
    device it compiles for), on those codes and scales reinterpreted as `element_dtype` /
    `scale_dtype` (bitcasts outside the timing):

    * batched per expert, (G, M/G, K) by (G, N, K), where every group has M/G rows: the same
      problem as ours;
    * dense, (1, M, K) by the first expert's (1, N, K): the same flops, compared with ours on
      the first group's rows.

    (`jax.nn.scaled_dot_general` without `configs` is a plain `lax.dot_general`: the rows of
    stops 18-59 labelled "XLA scaled_dot_general MXFP8" timed XLA's bf16 GEMM.)"""
    library_path, (operands,) = next(iter(candidates.values()))
    lhs, lhs_scale, rhs, rhs_scale, sizes = operands
    sizes = [int(size) for size in sizes]
    g, m = rhs.shape[0], lhs.shape[0]

    def as_elements(codes):  # packed uint8 E2M1 pairs (low nibble first) -> (..., K)
        if codes.dtype == element_dtype:
            return codes
        unpacked = lax.bitcast_convert_type(codes, element_dtype)
        return unpacked.reshape(*codes.shape[:-1], -1)

    lhs, rhs = as_elements(lhs), as_elements(rhs)
    lhs_scale, rhs_scale = (
        s if s.dtype == scale_dtype else lax.bitcast_convert_type(s, scale_dtype)
        for s in (lhs_scale, rhs_scale)
    )
    matmul = jax.jit(
        lambda a, sa, b, sb: jax.nn.scaled_matmul(a, b, sa, sb, preferred_element_type=BF16)
    )
    mine = np.asarray(library_path(*operands).astype(jnp.float32))
    problems = {}
    if len(set(sizes)) == 1:
        rows = m // g
        problems["XLA scaled_matmul, batched per expert (the same problem)"] = (
            (lhs.reshape(g, rows, -1), lhs_scale.reshape(g, rows, -1), rhs, rhs_scale),
            slice(None),
        )
    problems["XLA scaled_matmul, dense (same flops)"] = (
        (lhs[None], lhs_scale[None], rhs[:1], rhs_scale[:1]),
        slice(0, sizes[0]),
    )
    candidates, differences = dict(candidates), {}
    for name, (args, rows) in problems.items():
        try:
            theirs = np.asarray(matmul(*args).astype(jnp.float32)).reshape(-1, mine.shape[1])
        except Exception as error:  # (a backend that cannot lower it: said so, not timed)
            print(f"{name}: not run ({type(error).__name__}: {str(error).splitlines()[0]})")
            continue
        differences[name] = relative_difference(theirs[rows], mine[rows])
        candidates[name] = (matmul, [args])
    return candidates, differences


def mx_layer_candidates(
    mode: str, g: int, m: int, k: int, n: int, backward: bool
) -> tuple[dict, dict]:
    """(candidates, differences from ours) of one MX layer from bf16, `mode` "mxfp8" or
    "nvfp4", forward or forward + backward (y, dx, dw for a random dy), on equal groups of
    m / g rows. Each quantizes both operands in every call, as a training step without kept
    weights does:

    * ours: `jax_qtrain.grouped_dense` under the MXFP8BlockScaling / NVFP4BlockScaling recipe
      (TransformerEngine's rules: NVFP4 with 16×16 weight blocks, global scales, the Hadamard
      transform on the wgrad operands and stochastic rounding of dy, which XLA's config
      lacks);
    * XLA: `jax.nn.scaled_dot_general` with `jax.nn.get_scaled_dot_general_config(mode)` for
      the forward and both backward GEMMs, batched per expert (the peer issue 5 names; it
      quantizes in XLA and calls the block-scaled GEMM, `__op$block_scaled_dot`; in jax
      0.11.2 its NVFP4 backward runs bf16 `dot_general`s instead, see
      tests/benchmarks/test_smoke.py);
    * the bf16 yardsticks: `grouped_dense` without a recipe (our 16-bit kernels) and XLA's
      batched bf16 GEMM.

    The differences are max |theirs - ours| / max |ours| over y (and dx, dw): two quantizers
    with their own rules, so near, not equal."""
    import jax_qtrain as jq  # (the library's public op; peers_ab otherwise times kernels)

    recipes = {"mxfp8": jq.MXFP8BlockScaling, "nvfp4": jq.NVFP4BlockScaling}
    if mode not in recipes:
        raise ValueError(f"mode must be one of {tuple(recipes)}, got {mode!r}")
    if g < 1 or m % g:
        raise ValueError(f"m must split into g equal groups, got m={m}, g={g}")
    recipe = recipes[mode]()
    xla_config = jax.nn.get_scaled_dot_general_config(mode)
    keys = jax.random.split(jax.random.key(13), 3)
    # (Random values: a GEMM's power draw, and so its clock, depends on the data.)
    x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(BF16)
    kernels = jax.random.normal(keys[1], (g, k, n), jnp.float32).astype(BF16)
    dy = jax.random.normal(keys[2], (m, n), jnp.float32).astype(BF16)
    sizes = jnp.full((g,), m // g, jnp.int32)
    per_expert = (((2,), (1,)), ((0,), (0,)))

    def batched(fn):  # (m, k) tokens -> (g, m / g, k) and the (g, m / g, n) result back
        return lambda a, w: fn(a.reshape(g, m // g, k), w).reshape(m, n)

    layers = {
        f"ours: jax_qtrain.grouped_dense, {type(recipe).__name__}": lambda a, w: jq.grouped_dense(
            a, w, sizes, recipe=recipe
        ),
        f"XLA jax.nn.scaled_dot_general, {mode} configs, batched": batched(
            lambda a, w: jax.nn.scaled_dot_general(
                a, w, per_expert, preferred_element_type=BF16, configs=[xla_config] * 3
            )
        ),
        "ours: jax_qtrain.grouped_dense, bf16 (no recipe)": lambda a, w: jq.grouped_dense(
            a, w, sizes
        ),
        "XLA bf16, batched": batched(
            lambda a, w: lax.dot_general(a, w, per_expert, preferred_element_type=BF16)
        ),
    }

    def training(layer):  # y, dx, dw
        def step(a, w, cotangent):
            y, vjp = jax.vjp(layer, a, w)
            return (y, *vjp(cotangent))

        return step

    if backward:
        arguments = [(x, kernels, dy)]
        candidates = {name: (jax.jit(training(f)), arguments) for name, f in layers.items()}
    else:
        candidates = {name: (jax.jit(f), [(x, kernels)]) for name, f in layers.items()}
    ours, (args,) = next(iter(candidates.values()))
    mine = [np.asarray(a.astype(jnp.float32)) for a in jax.tree.leaves(ours(*args))]
    differences = {}
    for name, (fn, (args,)) in list(candidates.items())[1:]:
        theirs = [np.asarray(a.astype(jnp.float32)) for a in jax.tree.leaves(fn(*args))]
        differences[name] = max(
            relative_difference(t, o) for t, o in zip(theirs, mine, strict=True)
        )
    return candidates, differences


def nvfp4_candidates(g: int, m: int, k: int, n: int, sizes, small: bool) -> tuple[dict, dict]:
    """(candidates, peer differences) of NVFP4 tokens and weights (random bytes, scales 2^-3 ..
    2^3; no global scales, which every path applies alike): the library's path (both
    dequantized to bf16, then the 16-bit kernel) against the weights dequantized in registers
    (`grouped_matmul_nvfp4_weights`, the tokens dequantized in its even/odd column order by the
    same kernel), XLA's dense bf16 GEMM of the same flops and XLA's own NVFP4 GEMM on the same
    codes and scales (`with_xla_block_scaled_peers`)."""
    keys = jax.random.split(jax.random.key(12), 4)
    lhs = jax.random.randint(keys[0], (m, k // 2), 0, 256).astype(jnp.uint8)
    rhs = jax.random.randint(keys[1], (g, n, k // 2), 0, 256).astype(jnp.uint8)
    scales = jnp.exp2(jnp.arange(-3, 4, dtype=jnp.float32))
    lhs_scale = scales[jax.random.randint(keys[2], (m, k // 16), 0, 7)].astype(E4M3)
    rhs_scale = scales[jax.random.randint(keys[3], (g, n, k // 16), 0, 7)].astype(E4M3)
    sizes = jnp.asarray(sizes, jnp.int32)
    interpret = small
    config = SMALL_CONFIG if small else None
    weights_config = (
        dataclasses.replace(SMALL_CONFIG, tile_n=64, epilogue_buffers=1) if small else None
    )

    def dequantize(a, sa, column_order="natural"):
        return pk.dequantize_nvfp4(
            a, sa, None, out_dtype=BF16, column_order=column_order, interpret=interpret
        )

    def library_path(a, sa, b, sb, s):
        weights = dequantize(b.reshape(g * n, k // 2), sb.reshape(g * n, k // 16))
        return grouped_matmul(
            dequantize(a, sa), weights.reshape(g, n, k), s, config=config, interpret=interpret
        )

    def weights_in_registers(a, sa, b, sb, s, e2m1_decode="float32", config=weights_config):
        return grouped_matmul_nvfp4_weights(
            dequantize(a, sa, "even_odd"),
            b,
            sb,
            s,
            lhs_order="even_odd",
            e2m1_decode=e2m1_decode,
            config=config,
            interpret=interpret,
        )

    operands = [(lhs, lhs_scale, rhs, rhs_scale, sizes)]
    # (Random values: a GEMM's power draw, and so its clock, depends on the data.)
    dense = (
        jax.random.normal(keys[0], (m, k), jnp.float32).astype(BF16),
        jax.random.normal(keys[1], (n, k), jnp.float32).astype(BF16),
    )
    candidates = {
        "ours: dequantize both + 16-bit kernel (library path)": (
            jax.jit(library_path),
            operands,
        ),
        "ours: dequantize tokens (even/odd) + NVFP4 weights in registers": (
            jax.jit(weights_in_registers),
            operands,
        ),
        "ours: the same, codes decoded by byte permutes": (
            jax.jit(functools.partial(weights_in_registers, e2m1_decode="byte_permute")),
            operands,
        ),
        "ours: the same by byte permutes, two K steps a stage": (
            jax.jit(
                functools.partial(
                    weights_in_registers,
                    e2m1_decode="byte_permute",
                    config=_two_steps(weights_config),
                )
            ),
            operands,
        ),
        "XLA dense bf16 (same flops)": (jax.jit(lambda a, b: a @ b.T), [dense]),
    }
    return with_xla_block_scaled_peers(candidates, jnp.float4_e2m1fn, jnp.float8_e4m3fn)


def dense_candidates(size: int, small: bool) -> dict:
    keys = jax.random.split(jax.random.key(8), 2)
    a, b = (jax.random.normal(key, (size, size), jnp.float32).astype(BF16) for key in keys)
    config = SMALL_CONFIG if small else None
    candidates = {
        "ours dense_matmul bf16 (default)": (
            jax.jit(lambda a, b: dense_matmul(a, b, config=config, interpret=small)),
            [(a, b)],
        ),
        "XLA dense bf16": (jax.jit(lambda a, b: a @ b.T), [(a, b)]),
    }
    torch = None if small else _torch()
    if torch is not None:
        candidates["torch.mm bf16 (cuBLAS)"] = _torch_candidate(
            torch, lambda a, b: torch.mm(a, b.t()), [(a, b)]
        )
    return candidates


def block_fp8_operands(m: int, k: int, n: int, seed: int = 10) -> tuple[jax.Array, ...]:
    """Block-FP8 operands of an (M, K) @ (N, K)ᵀ GEMM: lhs E4M3 codes and their 1x128 scales
    K-major, (K/128, M) (the quantize kernels' GEMM-ready "tiles" order, which is also the
    "outer-dim-major" order cuBLASLt wants); rhs (N, K) codes and (ceil(N/128), K/128)
    128x128 scales. The scales are powers of two from 2^-3 to 2^3, as the recipe's are."""
    keys = jax.random.split(jax.random.key(seed), 4)
    lhs8 = jax.random.normal(keys[0], (m, k), jnp.float32).astype(E4M3)
    rhs8 = jax.random.normal(keys[1], (n, k), jnp.float32).astype(E4M3)
    lhs_scale_k_major = _powers_of_two(keys[2], (k // 128, m))
    rhs_scale = _powers_of_two(keys[3], (-(-n // 128), k // 128))
    return lhs8, lhs_scale_k_major, rhs8, rhs_scale


def _powers_of_two(key, shape) -> jax.Array:
    """Block scales as the recipe's are: powers of two, here from 2^-3 to 2^3."""
    return 2.0 ** jax.random.randint(key, shape, -3, 4).astype(jnp.float32)


def _dequantize_1x128(codes: jax.Array, scale: jax.Array) -> jax.Array:
    """bfloat16 values (exact) of (rows, K) FP8 codes in 1x128 blocks with (rows, K/128)
    power-of-two scales: what the library feeds its 16-bit GEMMs before stop 51's kernels."""
    return (codes.astype(jnp.float32) * jnp.repeat(scale, 128, axis=1)).astype(BF16)


def torch_block_fp8_mm(torch):
    """``torch._scaled_mm`` on our block-FP8 operands: lhs (M, K) row-major, rhs (N, K) seen as
    the column-major (K, N) operand, the lhs scales (M, K/128) outer-dim-major (a transposed
    view of our K-major array) and the rhs scales (K/128, N/128). torch picks cuBLASLt's
    1x128 / 128x128 scale modes from these shapes (no fast accumulation there)."""

    def mm(lhs8, lhs_scale_k_major, rhs8, rhs_scale):
        return torch._scaled_mm(
            lhs8, rhs8.t(), lhs_scale_k_major.t(), rhs_scale.t(), out_dtype=torch.bfloat16
        )

    return mm


def torch_two_1x128_mm(torch):
    """``torch._scaled_mm`` with 1x128 blocks on both operands (cuBLASLt's two-1x128 mode,
    TE's block-FP8 wgrad): lhs (M, K) and rhs (N, K) codes, both scales K-major, (K/128, M)
    and (K/128, N), which torch reads as outer-dim-major (M, K/128) / (N, K/128)."""

    def mm(lhs8, lhs_scale_k_major, rhs8, rhs_scale_k_major):
        return torch._scaled_mm(
            lhs8, rhs8.t(), lhs_scale_k_major.t(), rhs_scale_k_major, out_dtype=torch.bfloat16
        )

    return mm


def _add_torch_peer(candidates, differences, name, first_output, timed, ours) -> None:
    """Adds the torch peer `name` (`timed`: its interleaved_seconds candidate) when its first
    output (`first_output()`, float32 numpy) runs, with its max difference from `ours()`
    relative to max |ours|; an older torch or CUDA that refuses it leaves it out, said so."""
    try:
        theirs = first_output()
    except RuntimeError as error:
        print(f"{name}: not run ({str(error).splitlines()[0]})")
        return
    mine = np.asarray(ours().astype(jnp.float32))
    differences[name] = relative_difference(theirs, mine)
    candidates[name] = timed


def dense_fp8_block_candidates(size: int, small: bool) -> tuple[dict, dict]:
    """(candidates, {peer name: max |peer - ours| / max |ours|}) of the dense block-FP8 case:
    each peer's output is compared with ours before timing, since a misread scale layout
    would make a fast peer meaningless."""
    lhs8, lhs_scale_k_major, rhs8, rhs_scale = block_fp8_operands(size, size, size)
    config = SMALL_BLOCK_CONFIG if small else None
    ours = jax.jit(
        lambda a, sa, b, sb: dense_matmul_fp8_block(
            a, sa, b, sb, config=config, interpret=small, lhs_scale_k_major=True
        )
    )
    args = (lhs8, lhs_scale_k_major, rhs8, rhs_scale)
    candidates = {
        "ours dense_matmul_fp8_block (default)": (ours, [args]),
        "XLA dense FP8, no block scales (ceiling)": (
            xla_fp8_nt,
            [(lhs8, rhs8)],
        ),
    }
    differences = {}
    torch = None if small else _torch()
    if torch is not None:
        mm = torch_block_fp8_mm(torch)
        call, torch_sets = _torch_candidate(torch, mm, [args])
        _add_torch_peer(
            candidates,
            differences,
            "torch._scaled_mm 1x128 / 128x128 (cuBLASLt)",
            lambda: mm(*torch_sets[0]).float().cpu().numpy(),
            (call, torch_sets),
            lambda: ours(*args),
        )
    return candidates, differences


def dense_fp8_block_wgrad_candidates(size: int, small: bool) -> tuple[dict, dict]:
    """(candidates, relative differences) of a wgrad-like dense block-FP8 GEMM, 1x128 blocks
    on both operands (the layers' dw of two token-direction copies): our FP8 kernel with
    ``rhs_block_rows=1`` (the library's path in stops 51-53) and our MoE wgrad kernel with one
    group (since stop 54) against what the library ran before both (both copies dequantized to
    bfloat16, exactly, and XLA's bf16 GEMM), cuBLASLt's two-1x128 block-scaled GEMM (TE's
    wgrad on Hopper) and XLA's FP8 GEMM without block scales."""
    lhs8, lhs_scale_k_major, rhs8, _ = block_fp8_operands(size, size, size)
    rhs_scale = block_fp8_operands(size, size, 4, seed=12)[1].T  # (N, K/128)
    config = SMALL_BLOCK_CONFIG if small else None
    ours = jax.jit(
        lambda a, sa, b, sb: dense_matmul_fp8_block(
            a, sa, b, sb, config=config, interpret=small, lhs_scale_k_major=True, rhs_block_rows=1
        )
    )

    def dequantized_bf16_gemm(a, sa, b, sb):
        a16, b16 = _dequantize_1x128(a, sa.T), _dequantize_1x128(b, sb)
        return lax.dot_general(a16, b16, (((1,), (1,)), ((), ())), preferred_element_type=BF16)

    wgrad_config = SMALL_WGRAD_BLOCK_CONFIG if small else None
    # The MoE wgrad kernel with one group of every token (the library's path
    # "fp8_block_wgrad_grouped_kernel" since stop 54): it takes (K, M/128) line scales.
    ours_on_wgrad_kernel = jax.jit(
        lambda a, sa, b, sb: pk.dense_matmul_fp8_block_wgrad(
            a, sa.T, b, sb, config=wgrad_config, interpret=small
        )
    )
    args = (lhs8, lhs_scale_k_major, rhs8, rhs_scale)
    candidates = {
        "ours dense_matmul_fp8_block, rhs_block_rows=1": (ours, [args]),
        "ours, MoE wgrad kernel, one group": (ours_on_wgrad_kernel, [args]),
        "before: both dequantized to bf16 + XLA bf16 GEMM": (
            jax.jit(dequantized_bf16_gemm),
            [args],
        ),
        "XLA dense FP8, no block scales (ceiling)": (
            xla_fp8_nt,
            [(lhs8, rhs8)],
        ),
    }
    differences = {}
    torch = None if small else _torch()
    if torch is not None:
        mm = torch_two_1x128_mm(torch)
        call, torch_sets = _torch_candidate(
            torch, mm, [(lhs8, lhs_scale_k_major, rhs8, rhs_scale.T)]
        )
        _add_torch_peer(
            candidates,
            differences,
            "torch._scaled_mm 1x128 / 1x128 (cuBLASLt)",
            lambda: mm(*torch_sets[0]).float().cpu().numpy(),
            (call, torch_sets),
            lambda: ours(*args),
        )
    return candidates, differences


def grouped_fp8_block_wgrad_candidates(g: int, m: int, k: int, n: int, sizes, small: bool):
    """(candidates, relative differences) of block FP8's MoE wgrad, dW[g] = x_gᵀ dy_g from the
    two columnwise copies in 1x128 token blocks: our FP8 wgrad kernel with the block scales
    (the library's path since stop 53) against the path before it (both copies dequantized
    to bf16, exactly, then our 16-bit wgrad kernel), one cuBLASLt two-1x128 GEMM per expert
    (TE's wgrad on Hopper; each expert's token slices copied out once, outside the timing) and
    XLA's dense FP8 GEMM of the same flops."""
    del g
    lhs8, lhs_scale_k_major, _, _ = block_fp8_operands(k, m, 4, seed=13)  # x columnwise (K, M)
    rhs8, rhs_scale_k_major, _, _ = block_fp8_operands(n, m, 4, seed=14)  # dy columnwise (N, M)
    lhs_scale, rhs_scale = lhs_scale_k_major.T, rhs_scale_k_major.T  # (K, M/128), (N, M/128)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    config = SMALL_WGRAD_BLOCK_CONFIG if small else None
    ours = jax.jit(
        lambda a, sa, b, sb, s: pk.grouped_matmul_wgrad(
            a,
            b,
            s,
            lhs_block_scale=sa,
            rhs_block_scale=sb,
            out_dtype=BF16,
            config=config,
            interpret=small,
        )
    )

    def dequantized_then_16_bit_kernel(a, sa, b, sb, s):
        a16, b16 = _dequantize_1x128(a, sa), _dequantize_1x128(b, sb)
        return pk.grouped_matmul_wgrad(a16, b16, s, out_dtype=BF16, config=config, interpret=small)

    args = (lhs8, lhs_scale, rhs8, rhs_scale, group_sizes)
    candidates = {
        "ours grouped_matmul_wgrad, 1x128 block scales": (ours, [args]),
        "dequantized to bf16 + our 16-bit wgrad (before stop 53)": (
            jax.jit(dequantized_then_16_bit_kernel),
            [args],
        ),
        "XLA dense FP8, no block scales (same flops)": (
            xla_fp8_nt,
            [(lhs8, rhs8)],
        ),
    }
    differences = {}
    torch = None if small else _torch()
    name = "torch._scaled_mm 1x128 / 1x128, one per expert (cuBLASLt)"
    if torch is not None and any(size % 128 for size in sizes):
        print(f"{name}: not run (group sizes {sizes} are not whole 128-token blocks)")
    elif torch is not None:
        bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        per_group = [
            tuple(
                to_torch(torch, part)
                for part in (
                    lhs8[:, start:stop],
                    lhs_scale_k_major[start // 128 : stop // 128],
                    rhs8[:, start:stop],
                    rhs_scale_k_major[start // 128 : stop // 128],
                )
            )
            for start, stop in itertools.pairwise(bounds)
        ]

        mm = torch_two_1x128_mm(torch)
        _add_torch_peer(
            candidates,
            differences,
            name,
            lambda: np.stack([mm(*operands).float().cpu().numpy() for operands in per_group]),
            (_torch_per_group(torch, mm, per_group), [()]),
            lambda: ours(*args),
        )
    return candidates, differences


def _torch_per_group(torch, mm, per_group):
    """An interleaved_seconds call running `mm` once per group's operands, as TE's grouped
    GEMM on Hopper does (no concatenation: TE writes each expert's rows in place)."""

    def call():
        for operands in per_group:
            mm(*operands)
        return _TorchResult(torch)

    return call


def grouped_fp8_block_candidates(
    g: int, m: int, k: int, n: int, sizes, small: bool
) -> tuple[dict, dict]:
    """(candidates, relative differences) of a grouped block-FP8 forward: our
    `grouped_matmul_fp8_block` default against one `torch._scaled_mm` per group (what
    TransformerEngine's grouped GEMM does on Hopper: a cuBLASLt call per expert), where every
    group's rows are a multiple of 4 (cuBLASLt's rule for these scales; otherwise the peer is
    left out, said so), and XLA's dense FP8 GEMM of the same flops as the ceiling."""
    lhs8, lhs_scale_k_major, _, _ = block_fp8_operands(m, k, n)
    keys = jax.random.split(jax.random.key(11), 2)
    rhs8 = jax.random.normal(keys[0], (g, n, k), jnp.float32).astype(E4M3)
    rhs_scale = _powers_of_two(keys[1], (g, -(-n // 128), k // 128))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    config = SMALL_BLOCK_CONFIG if small else None
    ours = jax.jit(
        lambda a, sa, b, sb, s: pk.grouped_matmul_fp8_block(
            a, sa, b, sb, s, config=config, interpret=small, lhs_scale_k_major=True
        )
    )
    args = (lhs8, lhs_scale_k_major, rhs8, rhs_scale, group_sizes)
    candidates = {
        "ours grouped_matmul_fp8_block (default)": (ours, [args]),
        "XLA dense FP8, no block scales (same flops)": (
            xla_fp8_nt,
            [(lhs8, rhs8[0])],
        ),
    }
    differences = {}
    torch = None if small else _torch()
    name = "torch._scaled_mm 1x128 / 128x128, one per group (cuBLASLt)"
    if torch is not None and any(size % 4 for size in sizes):
        print(f"{name}: not run (group sizes {sizes} are not all multiples of 4)")
    elif torch is not None:
        mm = torch_block_fp8_mm(torch)
        lhs_t, lhs_scale_t, rhs_t, rhs_scale_t = (
            to_torch(torch, a) for a in (lhs8, lhs_scale_k_major, rhs8, rhs_scale)
        )
        bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        # Each group's scales copied out once, outside the timing: a column slice of the
        # (K/128, M) array is not the contiguous outer-dim-major operand cuBLASLt takes.
        per_group = [
            (
                lhs_t[start:stop],
                lhs_scale_t[:, start:stop].contiguous(),
                rhs_t[group],
                rhs_scale_t[group],
            )
            for group, (start, stop) in enumerate(itertools.pairwise(bounds))
        ]

        _add_torch_peer(
            candidates,
            differences,
            name,
            lambda: torch.cat([mm(*operands) for operands in per_group]).float().cpu().numpy(),
            (_torch_per_group(torch, mm, per_group), [()]),
            lambda: ours(*args),
        )
    return candidates, differences


def main(
    out_dir: str | None = None,
    rounds: int = 15,
    small: bool = False,
    cases: tuple[str, ...] = CASE_GROUPS,
) -> str:
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    unknown = sorted(set(cases) - set(CASE_GROUPS))
    if unknown or not cases:
        raise ValueError(f"cases must be a non-empty subset of {CASE_GROUPS}, got {cases!r}")
    shapes, dense_size = (SMALL_SHAPES, 128) if small else (SHAPES, DENSE_SIZE)
    # (In the interpreter every call is a whole interpretation and the times mean nothing.)
    batch = dict(calls_per_batch=1, warmup_seconds=0.0, compile_first=False) if small else {}
    rows = []

    def run_case(case: str, flops: float, candidates: dict, same_bits=(), differences=None) -> None:
        # `same_bits`: names whose outputs must equal the first one's bit for bit (checked
        # before timing, reported in the table); `differences`: {name: relative difference
        # from the first one} where the sums are ordered differently.
        bits = {}
        if same_bits:
            bits = same_bits_as_first(candidates, same_bits)
            del bits[same_bits[0]]  # (the yardstick: no entry of its own)
        seconds = interleaved_seconds(candidates, rounds=rounds, **batch)
        fastest = min(seconds.values())
        for name, value in seconds.items():
            rows.append(
                dict(
                    case=case,
                    implementation=name,
                    ms=value * 1e3,
                    tflops=flops / value / 1e12,
                    vs_fastest=fastest / value,
                    same_bits=bits.get(name),
                    relative_difference=(differences or {}).get(name),
                )
            )
            print(f"{case:28s} {name:44s} {value * 1e3:8.3f} ms {flops / value / 1e12:7.1f}")

    # (format, its candidates, the names checked bit for bit: MXFP8's in-register kernels
    # against the library path; NVFP4's in-register decodes and stagings against each other.)
    mx_formats = (
        ("MXFP8", mxfp8_candidates, slice(0, 4)),
        ("NVFP4", nvfp4_candidates, slice(1, 4)),
    )
    grouped = {"grouped", "grouped_mx"} & set(cases)
    for shape, (g, m, k, n, sizes) in shapes.items() if grouped else ():
        if "grouped" in cases:
            sets = random_operands(jax.random.key(7), g, m, k, n, sizes)
            for fp8 in (False, True):
                if small and fp8:
                    continue  # the interpreter's FP8 path is the kernel tests' business
                kind = "FP8 rowwise" if fp8 else "bf16"
                candidates = grouped_candidates(sets, fp8, small)
                run_case(f"{shape} fwd {kind}", 2 * m * k * n, candidates)
            del sets
        for fmt, make_candidates, checked in mx_formats:
            candidates, differences = make_candidates(g, m, k, n, sizes, small)
            run_case(
                f"{shape} fwd {fmt}",
                2 * m * k * n,
                candidates,
                same_bits=list(candidates)[checked],
                differences=differences,
            )
            del candidates
    # The layer from bf16, equal groups (XLA's batched form): G8 balanced, or the smoke test's
    # two groups evened out.
    for shape, (g, m, k, n, sizes) in shapes.items() if "grouped_mx_layer" in cases else ():
        if len(set(sizes)) > 1 and not small:
            continue
        for mode, backward in itertools.product(("mxfp8", "nvfp4"), (False, True)):
            candidates, differences = mx_layer_candidates(mode, g, m, k, n, backward)
            passes = "fwd+bwd" if backward else "fwd"
            run_case(
                f"{shape} layer {passes} {mode.upper()}",
                (6 if backward else 2) * m * k * n,
                candidates,
                differences=differences,
            )
            del candidates
    for shape, (g, m, k, n, sizes) in shapes.items() if "grouped_fp8_block" in cases else ():
        block, differences = grouped_fp8_block_candidates(g, m, k, n, sizes, small)
        run_case(f"{shape} fwd block FP8", 2 * m * k * n, block, differences=differences)
        del block
    for shape, (g, m, k, n, sizes) in shapes.items() if "grouped_fp8_block_wgrad" in cases else ():
        if small:  # (the smoke test's groups, evened out to whole 128-token blocks)
            sizes = [m // g] * g
        if any(size % 128 for size in sizes):
            continue  # (the layer aligns every group to 128 tokens; skewed G8 is not)
        block, differences = grouped_fp8_block_wgrad_candidates(g, m, k, n, sizes, small)
        run_case(f"{shape} wgrad block FP8", 2 * m * k * n, block, differences=differences)
        del block
    if "dense_bf16" in cases:
        run_case(
            f"dense {dense_size}^3 bf16", 2 * dense_size**3, dense_candidates(dense_size, small)
        )
    if "dense_fp8_block" in cases:
        block, differences = dense_fp8_block_candidates(dense_size, small)
        run_case(
            f"dense {dense_size}^3 block FP8", 2 * dense_size**3, block, differences=differences
        )
        block, differences = dense_fp8_block_wgrad_candidates(dense_size, small)
        run_case(
            f"dense {dense_size}^3 block FP8, 1x128 rhs (wgrad)",
            2 * dense_size**3,
            block,
            same_bits=list(block)[:2],  # our two kernels
            differences=differences,
        )

    lines = [
        f"Device: {device_description()}; {rounds} alternating rounds per case "
        "(each a batch of back-to-back calls of every implementation).",
        "",
        "| case | implementation | ms | TFLOP/s | fastest / this | same bits as the case's first |",
        "|---|---|---:|---:|---:|---|",
        *(
            f"| {r['case']} | {r['implementation']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
            f"{r['vs_fastest']:.3f} | {_agreement(r)} |"
            for r in rows
        ),
    ]
    return report(out_dir, "peers_ab", rows, "\n".join(lines) + "\n")


def _agreement(row: dict) -> str:
    """The table's last column: bit equality, or the relative difference where the sums are
    ordered differently."""
    if row["same_bits"] is not None:
        return "yes" if row["same_bits"] else "**NO**"
    if row["relative_difference"] == 0:
        return "yes (every element equal)"
    if row["relative_difference"] is not None:
        return f"no: max diff {row['relative_difference']:.1e} of max |ours|"
    return ""


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--cases", nargs="+", choices=CASE_GROUPS, default=list(CASE_GROUPS))
    args = parser.parse_args()
    main(args.out, rounds=args.rounds, small=args.small, cases=tuple(args.cases))
