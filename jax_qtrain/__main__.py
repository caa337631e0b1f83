"""Command line: `python -m jax_qtrain demo`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jax-qtrain", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="quantize real arrays in every format; print error and bytes")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from jax_qtrain.demo import main as demo_main

        return demo_main()
    return 2


if __name__ == "__main__":
    sys.exit(main())
