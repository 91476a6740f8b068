"""The ``tiershard`` command line: one module per subcommand, each with ``add_parser`` and ``run``."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module under tiershard.cli; each module defines add_parser(subparsers) and run(args) -> int
SUBCOMMANDS = {
    "train": "train",
    "plan": "plan",
    "probe": "probe",
    "cluster": "cluster",
    "bench": "bench",
    "convert": "convert",
}


class CliError(Exception):
    """A user error: printed as one line, exit code 2, no traceback."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tiershard", description="Tier-aware sharded data parallel training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name, module_name in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(f"tiershard.cli.{module_name}")
        except ModuleNotFoundError as err:
            if err.name == f"tiershard.cli.{module_name}":
                continue
            raise
        module.add_parser(sub)
        modules[name] = module
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(modules[args.command].run(args) or 0)
    except CliError as err:
        print(f"tiershard {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
