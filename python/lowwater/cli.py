"""The ``lowwater`` command.

Each subcommand lives in its own module under :mod:`lowwater.commands` and
exposes ``add_parser(subparsers) -> argparse.ArgumentParser`` (which sets
``func=run`` via ``set_defaults``) and ``run(args) -> int``.  Bad input is a
one-line error on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from typing import Any

# Subcommand modules, in the order ``lowwater --help`` lists them.  Imported
# lazily so ``lowwater demo`` never pays for the HTTP stack.
SUBCOMMANDS = [
    "lowwater.commands.eval",
    "lowwater.commands.score",
    "lowwater.commands.view",
    "lowwater.commands.envs",
    "lowwater.commands.serve_model",
    "lowwater.commands.demo",
    "lowwater.commands.plugins",
    "lowwater.commands.proxy",
]


class UsageError(Exception):
    """Bad input from the command line: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """An argument parser that never accepts an abbreviated flag (``--harnes
    program`` silently ran the program harness): every parser of the command,
    subcommands included, is built with ``allow_abbrev=False``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def _version() -> str:
    from lowwater.eval.header import lowwater_version

    return lowwater_version()


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="lowwater",
        description="Rollouts of LLM agents with memory that returns to its low-water mark.",
    )
    parser.add_argument("--version", action="version", version=f"lowwater {_version()}", help="print the version")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name in SUBCOMMANDS:
        importlib.import_module(name).add_parser(sub)
    return parser


def suggest(unknown: str, parser: argparse.ArgumentParser) -> str | None:
    """The flag of ``parser`` closest to ``unknown`` (``--modle`` -> ``--model``), if any is close."""
    flag = unknown.split("=", 1)[0]
    if not flag.startswith("-"):
        return None
    options = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    close = difflib.get_close_matches(flag, options, n=1, cutoff=0.7)
    return close[0] if close else None


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        # One line per unknown argument, with the closest flag when there is one.
        target = _subparser(parser, getattr(args, "command", None))
        unknown = next((e for e in extras if e.startswith("-")), extras[0])
        hint = suggest(unknown, target)
        advice = f"did you mean {hint}?" if hint else f"see {target.prog} --help"
        print(f"{target.prog}: error: unrecognized arguments: {' '.join(extras)} ({advice})", file=sys.stderr)
        return 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if argv is None and getattr(args, "glibc_malloc", False):
        # Only this process's own command line (argv None): a caller that
        # runs main() inside its own program keeps its process.
        from lowwater.commands.allocator import reexec_on_glibc_malloc

        reexec_on_glibc_malloc()
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"lowwater {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lowwater {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        # The data plane refusing its configuration (an SSL_CERT_FILE that
        # cannot be read, a bad upstream) is the user's setting, not a bug:
        # one line, not the traceback of the nurseries it surfaced through.
        config_error = _data_plane_config_error(exc)
        if config_error is None:
            raise
        print(f"lowwater {args.command}: error: {config_error}", file=sys.stderr)
        return 2


def _data_plane_config_error(exc: BaseException) -> BaseException | None:
    """The ``DataPlaneConfigError`` that ``exc`` is or holds (in Trio's
    exception groups), if any."""
    from lowwater._native import DataPlaneConfigError

    if isinstance(exc, DataPlaneConfigError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        group = exc.subgroup(DataPlaneConfigError)
        return None if group is None else _data_plane_config_error(group.exceptions[0])
    return None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
