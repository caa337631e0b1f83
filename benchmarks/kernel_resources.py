"""Registers, spills and shared memory of our Mosaic GPU kernels, as ptxas reports them.

Occupancy decides how much latency a one-warpgroup quantize CTA can hide: a CTA of 128 threads
using R registers each fits min(64K / (128 R), 227 KiB / smem) times on an SM. This compiles
each kernel once on the GPU with Mosaic GPU's dump switches (read when jax starts, so this
script sets them before importing jax) and collects ptxas's "Used N registers" lines.

    PYTHONPATH=. python3 benchmarks/kernel_resources.py OUT_DIR [NAME_PART]

writes OUT_DIR/kernel_resources.md (one row per kernel whose name contains NAME_PART, default
all) and leaves the raw dumps in OUT_DIR/mosaic_dump/. A kernel that ptxas refuses gets the
PTX lines around the instruction it names in its dump folder (ptxas_error.txt), the error
text included (captured from stderr, where Mosaic GPU prints it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import sys
import tempfile
from pathlib import Path

# Three consumer warpgroups, each 64 x 128 of a 192 x (2 x 64) CTA tile (GroupedMatmulConfig).
THREE_CONSUMERS = dict(tile_m=192, tile_n=64, consumer_split="m", num_consumers=3)
PTXAS_LINE = re.compile(r"Used (\d+) registers")
# "ptxas fatal   : (C7602) Insufficient registers (128) to compile instruction at line 660 …"
PTXAS_ERROR_LINE = re.compile(r"ptxas fatal\s*:.*? at line (\d+)")
SPILL_LINE = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def summarize(ptxas_text: str) -> tuple[str, str]:
    """(registers per thread, spill stores / loads in bytes) of every function ptxas reports,
    comma / semicolon separated; "?" where the dump has no such line."""
    regs = ", ".join(PTXAS_LINE.findall(ptxas_text)) or "?"
    spills = "; ".join("/".join(pair) for pair in SPILL_LINE.findall(ptxas_text)) or "?"
    return regs, spills


def ptx_excerpt(error_text: str, ptx_text: str, context: int = 12) -> str | None:
    """The PTX lines around the one a ptxas error names (marked ">>"), or None if it names
    none."""
    match = PTXAS_ERROR_LINE.search(error_text)
    if match is None:
        return None
    line = int(match.group(1))
    lines = ptx_text.splitlines()
    first, last = max(0, line - 1 - context), min(len(lines), line + context)
    return "\n".join(
        f"{'>>' if i + 1 == line else '  '} {i + 1:6d}  {lines[i]}" for i in range(first, last)
    )


@contextlib.contextmanager
def stderr_to(path: Path):
    """Redirects file descriptor 2 (where the compiler's diagnostics go) to `path`."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def kernel_cases():
    """(name, thunk) for each kernel whose resources we want; imported after the env is set."""
    import jax
    import jax.numpy as jnp

    import pallas_kernels as pk
    from benchmarks.bench_quantize import nvfp4_fixed_amax
    from pallas_kernels.grouped_matmul_mx_weights import TWO_STEPS_WEIGHTS_CONFIG

    x = jax.random.normal(jax.random.key(0), (1024, 1024), jnp.float32).astype(jnp.bfloat16)
    # Grouped GEMMs: the same GEMM compiled for several G (the group count used to change the
    # kernel's scalar code; since the visit table it should not).
    reuse = dict(reuse_input_tile=True)
    lhs = x[:, :512]
    x8 = lhs.astype(jnp.float8_e4m3fn)
    row_scale = jnp.ones((1024,), jnp.float32)

    def grouped(g: int, fp8: bool, config=None):
        rhs = jnp.ones((g, 512, 512), jnp.bfloat16)
        sizes = jnp.full((g,), 1024 // g, jnp.int32)
        if not fp8:
            return lambda: pk.grouped_matmul(lhs, rhs, sizes, config=config)
        return lambda: pk.grouped_matmul(
            x8,
            rhs.astype(jnp.float8_e4m3fn),
            sizes,
            lhs_scale=row_scale,
            rhs_scale=jnp.ones((g, 512), jnp.float32),
            config=config,
        )

    def wgrad(g: int):
        sizes = jnp.full((g,), 1024 // g, jnp.int32)
        return lambda: pk.grouped_matmul_wgrad(lhs.T, x[:, :256].T, sizes)

    # Block FP8 (K = 512): the default tile and the variants timed slower on the H200 (a
    # wgmma in flight keeps a third f32 tile live; 128 x (2 x 64) tiles), and the dense entry
    # point in clusters along M.
    block_lhs_scale = jnp.ones((1024, 4), jnp.float32)
    block_rhs = jnp.ones((1, 512, 512), jnp.float8_e4m3fn)
    block_rhs_scale = jnp.ones((1, 4, 4), jnp.float32)
    block_default = pk.GroupedMatmulConfig(
        tile_m=64, tile_n=128, tile_k=128, max_concurrent_steps=4, epi_tile_n=64
    )

    def block(**changes):
        config = dataclasses.replace(block_default, **changes)
        sizes = jnp.full((1,), 1024, jnp.int32)
        return lambda: pk.grouped_matmul_fp8_block(
            x8, block_lhs_scale, block_rhs, block_rhs_scale, sizes, config=config
        )

    block_cases = [
        ("block fp8 gemm default", block()),
        ("block fp8 gemm 1 in flight", block(wgmma_in_flight=1)),
        ("block fp8 gemm 128x(2x64)", block(tile_m=128, tile_n=64)),
        ("block fp8 gemm 128x(2x64) 1 in flight", block(tile_m=128, tile_n=64, wgmma_in_flight=1)),
        ("block fp8 gemm cluster_m 2", block(cluster_m=2)),
        # Three consumers of 64 rows (192 x (2 x 64) tiles): 512 threads, 128 registers each.
        ("block fp8 gemm 3 consumers", block(**THREE_CONSUMERS)),
        (
            "block fp8 gemm 3 consumers streamed scales",
            block(**THREE_CONSUMERS, stream_lhs_scales=True),
        ),
    ]
    three_consumers = dataclasses.replace(
        pk.GroupedMatmulConfig(), **THREE_CONSUMERS, max_concurrent_steps=3, epilogue_buffers=1
    )
    grouped_cases = [(f"grouped wgrad bf16 G={g}", wgrad(g)) for g in (1, 8, 64)] + [
        (f"grouped {'fp8 rowwise' if fp8 else 'bf16'} G={g}", grouped(g, fp8))
        for fp8 in (False, True)
        for g in (1, 8, 64)
    ]
    grouped_cases += [
        (
            f"grouped {'fp8 rowwise' if fp8 else 'bf16'} G=8 3 consumers",
            grouped(8, fp8, dataclasses.replace(three_consumers, tile_k=128 if fp8 else 64)),
        )
        for fp8 in (False, True)
    ]

    # 64 x 256 parts (192 x (2 x 128) CTA tiles): one m64n256 wgmma per consumer was refused
    # in stop 43 (C7602, benchmarks/ptxas_wgmma_budget.py); since stop 44 two m64n128 each.
    grouped_cases += [
        (
            f"grouped {'fp8 rowwise' if fp8 else 'bf16'} G=8 3 consumers 64x256 parts",
            grouped(8, fp8, dataclasses.replace(three_consumers, tile_n=128, tile_k=tile_k)),
        )
        for fp8, tile_k in ((False, 64), (True, 128))
    ]
    # The weights dequantized in registers (stops 46-47; RS wgmma, f32 packed output as the
    # library calls them): registers and spills are what decide whether the conversions fit.
    codes = jnp.ones((8, 512, 512), jnp.float8_e4m3fn)
    e8m0 = jnp.full((8, 512, 16), 127, jnp.uint8)
    packed = jnp.full((8, 512, 256), 0x21, jnp.uint8)
    e4m3 = jnp.ones((8, 512, 32), jnp.float8_e4m3fn)
    sizes8 = jnp.full((8,), 128, jnp.int32)
    # Two K steps a stage (stop 48): the second step's A registers live beside the first's
    # wgmmas.
    two_steps = TWO_STEPS_WEIGHTS_CONFIG
    bf16, f32 = jnp.bfloat16, jnp.float32
    mxfp8_variants = {
        f"wgmma_k={wgmma_k} {out.__name__}": dict(wgmma_k=wgmma_k, out_dtype=out)
        for wgmma_k, out in ((32, bf16), (64, bf16), (32, f32))
    } | {"two K steps a stage bfloat16": dict(config=two_steps)}
    nvfp4_variants = {
        f"{decode} {out.__name__}": dict(e2m1_decode=decode, out_dtype=out)
        for decode, out in (("float32", bf16), ("byte_permute", bf16), ("float32", f32))
    } | {"two K steps a stage bfloat16": dict(config=two_steps)}
    grouped_cases += [
        (
            f"grouped mxfp8 weights in registers {name}",
            functools.partial(pk.grouped_matmul_mxfp8_weights, lhs, codes, e8m0, sizes8, **kw),
        )
        for name, kw in mxfp8_variants.items()
    ] + [
        (
            f"grouped nvfp4 weights in registers {name}",
            functools.partial(
                pk.grouped_matmul_nvfp4_weights,
                lhs,
                packed,
                e4m3,
                sizes8,
                lhs_order="even_odd",
                **kw,
            ),
        )
        for name, kw in nvfp4_variants.items()
    ]
    return [
        *block_cases,
        *grouped_cases,
        ("mxfp8 row+col", lambda: pk.quantize_mxfp8(x, rowwise=True, columnwise=True)),
        ("mxfp8 row", lambda: pk.quantize_mxfp8(x, rowwise=True, columnwise=False)),
        (
            "mxfp8 row+col reuse_input_tile",
            lambda: pk.quantize_mxfp8(x, columnwise=True, config=pk.MXFP8QuantizeConfig(**reuse)),
        ),
        (
            "mxfp8 row+col stage_columnwise_in_input",
            lambda: pk.quantize_mxfp8(
                x,
                columnwise=True,
                config=pk.MXFP8QuantizeConfig(stage_columnwise_in_input=True),
            ),
        ),
        (
            "fp8 block 1x128 row+col",
            lambda: pk.quantize_fp8_block(x, block_shape=(1, 128), rowwise=True, columnwise=True),
        ),
        (
            "fp8 block 128x128 row+col",
            lambda: pk.quantize_fp8_block(x, block_shape=(128, 128), rowwise=True, columnwise=True),
        ),
        *[
            (
                f"nvfp4 row+col rht{' sr' if sr else ''}{' lean' if lean else ''}",
                functools.partial(
                    nvfp4_fixed_amax,
                    x,
                    stochastic=sr,
                    config=pk.NVFP4QuantizeConfig(lean_arithmetic=lean),
                ),
            )
            for sr in (False, True)
            for lean in (False, True)
        ],
        (
            "fp8 block 128x128 row+col reuse_input_tile",
            lambda: pk.quantize_fp8_block(
                x,
                block_shape=(128, 128),
                columnwise=True,
                config=pk.FP8BlockQuantizeConfig(**reuse),
            ),
        ),
    ]


def record_ptxas_error(case_dir: Path, diagnostics: str) -> str:
    """Writes case_dir/ptxas_error.txt (ptxas's lines of `diagnostics` and the PTX around the
    line they name) when ptxas refused the kernel; returns a note for the table row."""
    errors = [line for line in diagnostics.splitlines() if "ptxas" in line]
    if not errors:
        return ""
    # The dump's file names are Mosaic GPU's (C++); its PTX is the file with a PTX header.
    dumps = [p.read_text(errors="replace") for p in case_dir.rglob("*") if p.is_file()]
    ptx = max((text for text in dumps if "\n.target sm_" in text), key=len, default=None)
    excerpt = ptx_excerpt(diagnostics, ptx) if ptx is not None else None
    (case_dir / "ptxas_error.txt").write_text(
        "\n".join(errors) + "\n\n" + (excerpt or "(no PTX dump, or no line named)") + "\n"
    )
    match = PTXAS_ERROR_LINE.search(diagnostics)
    where = f" at PTX line {match.group(1)}" if match else ""
    return f"; ptxas refused it{where} (ptxas_error.txt)"


def main(out_dir: str, only: str = "") -> str:
    """ptxas's registers and spills of every case whose name contains `only`."""
    out = Path(out_dir)
    dump = out / "mosaic_dump"
    rows = [
        "| kernel | registers / thread | spill stores / loads (bytes) | dump files |",
        "|---|---:|---|---|",
    ]
    import jax

    for name, thunk in kernel_cases():
        if only not in name:
            continue
        case_dir = dump / re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
        case_dir.mkdir(parents=True, exist_ok=True)
        os.environ["MOSAIC_GPU_DUMP_TO"] = str(case_dir)
        print(f"=== compiling {name}", file=sys.stderr, flush=True)
        diagnostics = Path(tempfile.mkstemp(suffix=".log")[1])
        try:
            with stderr_to(diagnostics):
                jax.block_until_ready(thunk())
        except Exception as e:  # record and go on
            note = record_ptxas_error(case_dir, diagnostics.read_text(errors="replace"))
            rows.append(f"| {name} | error {type(e).__name__}: {str(e)[:80]}{note} | | |")
            print(rows[-1], flush=True)
            continue
        finally:
            sys.stderr.write(diagnostics.read_text(errors="replace"))
            diagnostics.unlink()
        text = "\n".join(
            p.read_text(errors="replace") for p in sorted(case_dir.rglob("*")) if p.is_file()
        )
        regs, spill_text = summarize(text)
        files = len(list(case_dir.rglob("*")))
        rows.append(f"| {name} | {regs} | {spill_text} | {files} |")
        print(rows[-1], flush=True)
    table = "\n".join(rows) + "\n"
    (out / "kernel_resources.md").write_text(table)
    return table


if __name__ == "__main__":
    # Read by Mosaic GPU at compile time; set before jax starts.
    os.environ.setdefault("MOSAIC_GPU_DUMP_PTXAS", "1")
    os.environ.setdefault("MOSAIC_GPU_DUMP_PTX", "1")
    os.environ.setdefault("MOSAIC_GPU_DUMP_SASS", "1")
    os.environ.setdefault("MOSAIC_GPU_DUMP_RESOURCES", "1")
    print(main(*(sys.argv[1:3] if len(sys.argv) > 1 else ["bench_out"])))
