"""One entry point for every benchmark: `python -m benchmarks.run [--only NAME ...] --out DIR`.

Runs each `benchmarks/bench_*.py` module's `main(out_dir)` in turn (kernels and layers against
their peers, measured in the same process), keeps going when one fails, and writes
`summary.md` with each module's table or error. Meant for the H200 (`docs/benchmarks.md`
quotes its output); `--small` runs tiny shapes anywhere as a smoke test.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import traceback
from pathlib import Path

import benchmarks


def benchmark_modules() -> list[str]:
    return sorted(
        info.name
        for info in pkgutil.iter_modules(benchmarks.__path__)
        if info.name.startswith("bench_")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--only", nargs="*", default=None, help="module names, e.g. bench_dense")
    parser.add_argument("--small", action="store_true", help="tiny shapes (smoke test)")
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    sections, failures = [], 0
    for name in benchmark_modules():
        if args.only and name not in args.only:
            continue
        print(f"=== {name}", flush=True)
        try:
            module = importlib.import_module(f"benchmarks.{name}")
            kwargs = (
                {"small": True}
                if args.small and "small" in inspect.signature(module.main).parameters
                else {}
            )
            text = module.main(str(out_dir), **kwargs)
            sections.append(f"## {name}\n\n{text or '(no table returned)'}\n")
        except Exception:
            failures += 1
            sections.append(f"## {name}\n\nFAILED:\n```\n{traceback.format_exc()}```\n")
            traceback.print_exc()
    (out_dir / "summary.md").write_text("\n".join(sections))
    print(f"wrote {out_dir / 'summary.md'} ({failures} failed)")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
