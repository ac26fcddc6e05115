"""The ``lowwater`` command.

Each subcommand lives in its own module under :mod:`lowwater.commands` and
exposes ``add_parser(subparsers) -> argparse.ArgumentParser`` (which sets
``func=run`` via ``set_defaults``) and ``run(args) -> int``.  Bad input is a
one-line error on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in the order ``lowwater --help`` lists them.  Imported
# lazily so ``lowwater demo`` never pays for the HTTP stack.
SUBCOMMANDS = [
    "lowwater.commands.eval",
    "lowwater.commands.serve_model",
    "lowwater.commands.demo",
    "lowwater.commands.plugins",
    "lowwater.commands.proxy",
]


class UsageError(Exception):
    """Bad input from the command line: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lowwater",
        description="Rollouts of LLM agents with memory that returns to its low-water mark.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"lowwater {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lowwater {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
