"""Which wgmma accumulators ptxas accepts in a warp-specialized kernel, on any host with ptxas.

    python3 benchmarks/ptxas_wgmma_budget.py [OUT.md]

Stop 43's three-consumer kernel (four warpgroups, 512 threads) with 64 x 256 consumer parts
was refused on the H200: "ptxas fatal: (C7602) Insufficient registers (128) to compile
instruction ... Try to compile with register target of 154 or higher", though the consumers
raise their budget to 160 with `setmaxnreg` (Mosaic GPU declares `.maxntid` and
`.minnctapersm 1`, so ptxas honours it: SASS shows USETMAXREG). This script writes minimal
kernels of the same shape in PTX by hand (a producer warpgroup that gives registers back, the
others looping over wgmmas into f32 accumulators that live across the loop and are stored at
the end) and asks ptxas for each: no GPU, no Mosaic GPU, only the CUDA toolkit's ptxas
(`$PTXAS`, else the one on PATH; ptxas 13.0 on the CPU machines here).

What it showed (ptxas 13.0, sm_90a, 2026-12-04): each instruction must fit the kernel's entry
budget, 65536 / threads (168 for three warpgroups, 128 for four), while the registers live at
once may use what `setmaxnreg` grants. A wgmma of N f32 columns needs N / 2 + 26: m64n256
needs 154, so with four warpgroups it is refused (the same C7602 line as the H200's), m64n200
is the widest that compiles, and two m64n128 accumulators (128 registers together) compile
without spills under `setmaxnreg.inc 160`. `grouped_matmul_fwd._MAX_WGMMA_COLS` follows it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# (threads, registers the consumers ask for, wgmma widths N of one consumer's accumulators,
# operand type: bf16 wgmmas take K = 16 a slice, e4m3 ones K = 32)
CASES = [
    (384, 232, (256,), "bf16"),
    (384, 232, (256, 128), "bf16"),
    (512, 160, (256,), "bf16"),
    (512, 160, (200,), "bf16"),
    (512, 160, (208,), "bf16"),
    (512, 160, (128, 128), "bf16"),
    (512, 160, (192, 64), "bf16"),
    (512, 160, (256,), "e4m3"),
    (512, 160, (128, 128), "e4m3"),
]
_WGMMA_SHAPES = {"bf16": "k16.f32.bf16.bf16", "e4m3": "k32.f32.e4m3.e4m3"}
PRODUCER_REGISTERS = {384: 40, 512: 24}
RESULT = re.compile(
    r"Used (\d+) registers|C7602\) Insufficient registers \((\d+)\).*?(\d+) or higher"
)
SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def kernel_ptx(
    threads: int, consumer_registers: int, widths: tuple[int, ...], operands: str = "bf16"
) -> str:
    """A 1-producer + (threads / 128 - 1)-consumer kernel whose consumers accumulate
    m64n{width} wgmmas of `operands` into one f32 accumulator per width over a K loop."""
    accumulators = [[f"%a{j}_{i}" for i in range(width // 2)] for j, width in enumerate(widths)]
    declarations = "\n".join(f"  .reg .f32 %a{j}_<{len(a)}>;" for j, a in enumerate(accumulators))
    zeros = "\n".join(f"  mov.f32 {r}, 0f00000000;" for acc in accumulators for r in acc)
    wgmmas = "\n".join(
        f"  wgmma.mma_async.sync.aligned.m64n{width}{_WGMMA_SHAPES[operands]} "
        f"{{{','.join(acc)}}}, %rd1, %rd2, 1, 1, 1{', 0, 0' if operands == 'bf16' else ''};"
        for width, acc in zip(widths, accumulators, strict=True)
    )
    stores = "\n".join(
        f"  st.global.f32 [%rd5+{4 * i}], {r};"
        for i, r in enumerate(r for acc in accumulators for r in acc)
    )
    producer = threads // 128 - 1
    return f""".version 8.7
.target sm_90a
.address_size 64
.visible .entry k(.param .u64 out, .param .u64 desc_a, .param .u64 desc_b, .param .u32 steps)
.maxntid {threads}, 1, 1
.minnctapersm 1
{{
  .reg .pred %p<4>;
  .reg .b32 %r<8>;
  .reg .b64 %rd<8>;
{declarations}
  mov.u32 %r1, %tid.x;
  shr.u32 %r2, %r1, 7;
  ld.param.u64 %rd1, [desc_a];
  ld.param.u64 %rd2, [desc_b];
  ld.param.u32 %r3, [steps];
  ld.param.u64 %rd3, [out];
  mul.wide.u32 %rd4, %r1, 2048;
  add.u64 %rd5, %rd3, %rd4;
  setp.eq.u32 %p1, %r2, {producer};
  @%p1 bra PRODUCER;
  setmaxnreg.inc.sync.aligned.u32 {consumer_registers};
{zeros}
  mov.u32 %r4, 0;
K_LOOP:
  wgmma.fence.sync.aligned;
{wgmmas}
  wgmma.commit_group.sync.aligned;
  wgmma.wait_group.sync.aligned 0;
  add.u32 %r4, %r4, 1;
  setp.lt.u32 %p2, %r4, %r3;
  @%p2 bra K_LOOP;
{stores}
  bra DONE;
PRODUCER:
  setmaxnreg.dec.sync.aligned.u32 {PRODUCER_REGISTERS[threads]};
DONE:
  ret;
}}
"""


def ptxas_result(ptxas: str, ptx: str) -> str:
    """ptxas's verdict on one kernel, as a table cell."""
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "k.ptx"
        source.write_text(ptx)
        run = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", str(source), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
        )
    log = run.stdout + run.stderr
    match = RESULT.search(log)
    if match is None:
        return f"ptxas exit {run.returncode}: {log.strip()[:120]}"
    if match.group(1):
        spills = SPILLS.search(log)
        spilled = spills is not None and spills.groups() != ("0", "0")
        spill_text = f", spills {spills.group(1)} / {spills.group(2)} bytes" if spilled else ""
        return f"compiles ({match.group(1)} registers at entry{spill_text})"
    return f"refused: C7602, budget {match.group(2)}, needs {match.group(3)}"


def main(out: str | None = None) -> str:
    ptxas = os.environ.get("PTXAS") or shutil.which("ptxas")
    if ptxas is None:
        raise SystemExit("ptxas not found: put the CUDA toolkit's bin on PATH or set $PTXAS")
    version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
    rows = [
        f"ptxas: {version.strip().splitlines()[-1]}",
        "",
        "| threads | consumer setmaxnreg | wgmmas per consumer (f32 columns) | operands | ptxas |",
        "|---:|---:|---|---|---|",
    ]
    for threads, registers, widths, operands in CASES:
        verdict = ptxas_result(ptxas, kernel_ptx(threads, registers, widths, operands))
        shapes = " + ".join(f"m64n{w}" for w in widths)
        rows.append(f"| {threads} | {registers} | {shapes} | {operands} | {verdict} |")
    table = "\n".join(rows) + "\n"
    if out:
        Path(out).write_text(table)
    return table


if __name__ == "__main__":
    print(main(*sys.argv[1:2]))
