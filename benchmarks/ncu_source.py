"""Read Nsight Compute's per-instruction (SASS) counters of one kernel launch.

    ncu --kernel-name regex:matmul --launch-count 1 --section SourceCounters \
        --page source --print-source sass --csv python3 -m benchmarks.ncu_cases CASE > case.csv
    python3 -m benchmarks.ncu_source case.csv [--top 14]

prints, in program order, every instruction that touches shared memory through the LSU (its
executions, wavefronts against the ideal count, and the warp-stall samples taken on it), then
the instructions with the most stall samples and the reasons sampled. Stop 56 found with it
why the block-FP8 wgrad kernel runs slower at 4 stages than at 3: ptxas placed the row-scale
loads after the wgmma instructions, where they waited in the MIO queue, and the promotion's
multiply waited on them (`bash benchmarks/h200.sh ncu` with NCU_SOURCE=1 writes the CSVs).
"""

from __future__ import annotations

import argparse
import csv
import io
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
STALL_PREFIX = "stall_"


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_instructions(text: str) -> list[dict[str, str]]:
    """The rows of the CSV's SASS table (ncu prints its own log lines and a kernel-name line
    before the header, which starts with "Address")."""
    lines = text.splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if header is None:
        raise ValueError(
            "no SASS table in the input: expected ncu's --page source --print-source sass --csv"
            ' output, whose table header starts with "Address"'
        )
    return list(csv.DictReader(io.StringIO("\n".join(lines[header:]))))


def summarize(rows: list[dict[str, str]], top: int = 14) -> str:
    """Shared-memory instructions in program order, then the `top` most-sampled ones."""
    out = [
        "| SASS | executed | shared wavefronts | ideal | stall samples |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        wavefronts = _number(row.get("L1 Wavefronts Shared", "0"))
        if wavefronts:
            out.append(
                f"| `{row['Source'].strip()}` | {_number(row['Instructions Executed']):.0f} "
                f"| {wavefronts:.0f} | {_number(row.get('L1 Wavefronts Shared Ideal', '0')):.0f} "
                f"| {_number(row.get(SAMPLES, '0')):.0f} |"
            )
    total = sum(_number(row.get(SAMPLES, "0")) for row in rows)
    out += ["", f"stall samples in all: {total:.0f}", ""]
    out += ["| SASS | stall samples | share | reasons (samples) |", "|---|---:|---:|---|"]
    ranked = sorted(rows, key=lambda row: -_number(row.get(SAMPLES, "0")))[:top]
    for row in ranked:
        samples = _number(row.get(SAMPLES, "0"))
        reasons = {
            name.removeprefix(STALL_PREFIX): _number(value)
            for name, value in row.items()
            if name.startswith(STALL_PREFIX) and "(Not Issued)" not in name and _number(value)
        }
        main = ", ".join(
            f"{name} {count:.0f}" for name, count in sorted(reasons.items(), key=lambda r: -r[1])
        )
        share = samples / total if total else 0.0
        out.append(f"| `{row['Source'].strip()}` | {samples:.0f} | {share:.1%} | {main} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv_path", type=Path)
    parser.add_argument("--top", type=int, default=14)
    args = parser.parse_args()
    print(summarize(read_instructions(args.csv_path.read_text(errors="replace")), args.top))
