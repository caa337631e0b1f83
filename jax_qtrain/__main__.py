"""Command line: `jax-qtrain` or `python -m jax_qtrain`, with subcommands

demo      quantize real arrays in every format; print error and bytes
train     train a small MoE byte-level language model with one recipe
compare   train once per recipe; plot and tabulate the losses
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from jax_qtrain.train import cli as train_cli

    parser = argparse.ArgumentParser(
        prog="jax-qtrain",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="quantize real arrays in every format; print error and bytes")
    train_cli.add_commands(commands)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from jax_qtrain.demo import main as demo_main

        return demo_main()
    if args.command == "train":
        return train_cli.run_train(args)
    if args.command == "compare":
        return train_cli.run_compare(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
