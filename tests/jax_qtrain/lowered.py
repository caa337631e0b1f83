"""Reading a lowered program (StableHLO text) in tests (not collected)."""

from __future__ import annotations

import re

import jax


def fp8_gemm_precisions(step, *args) -> dict[str, str]:
    """{"fprop" | "dgrad" | "wgrad": precision} of the FP8 dots in `step`'s lowered program,
    told apart by their operand types (E4M3 × E4M3 forward; E5M2 dy in backward)."""
    gemms = {
        ("E4M3FN", "E4M3FN"): "fprop",
        ("E5M2", "E4M3FN"): "dgrad",
        ("E4M3FN", "E5M2"): "wgrad",
    }
    found = {}
    for line in jax.jit(step).lower(*args).as_text().splitlines():
        operands = tuple(re.findall(r"tensor<[0-9x]*xf8(E\w+)>", line)[:2])
        if "dot_general" in line and operands in gemms:
            found[gemms[operands]] = re.search(r"precision = \[(\w+)", line).group(1)
    return found
