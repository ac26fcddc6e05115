"""Every flag of every ``lowwater`` subcommand is documented on its docs page
(a flag added without docs fails here, not in a user's terminal)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from lowwater.cli import build_parser

DOCS = Path(__file__).resolve().parents[1] / "docs"

#: subcommand -> the page that documents its flags.
PAGES = {
    "eval": "eval.md",
    "score": "eval.md",
    "view": "eval.md",
    "envs": "eval.md",
    "serve-model": "serve-model.md",
    "demo": "tables.md",
    "plugins": "plugins.md",
    "proxy": "interception.md",
}


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_subcommand_has_a_page() -> None:
    assert set(_subcommands()) == set(PAGES)


@pytest.mark.parametrize("command", sorted(PAGES))
def test_every_flag_is_on_the_commands_page(command: str) -> None:
    text = (DOCS / PAGES[command]).read_text()
    flags = {
        option
        for action in _subcommands()[command]._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }
    assert flags, command
    missing = sorted(f for f in flags if f not in text)
    assert not missing, f"docs/{PAGES[command]} does not mention {missing} of `lowwater {command}`"
