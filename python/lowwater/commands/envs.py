"""``lowwater envs``: installed environments with their options and defaults.

Options come from each factory's ``options`` mapping
(:class:`lowwater.environment.EnvOption`); an environment that declares
none is listed as taking any ``--env-option``.  ``seed`` (``--seed``) is
passed to every environment.
"""

from __future__ import annotations

import argparse
from typing import Any

import orjson


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "envs",
        help="list installed environments with their options and defaults",
        description="List the environments `lowwater eval ENV` can run, with the --env-option keys each takes.",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)
    return p


def describe(plugins: Any) -> list[dict[str, Any]]:
    """``[{"name", "plugin", "summary", "options": [{"name", "default", "required", "help"}] | None}]``."""
    from lowwater.environment import declared_options

    out = []
    for name in sorted(plugins.environments):
        factory = plugins.environments[name]
        declared = declared_options(factory)
        doc = (getattr(factory, "__doc__", None) or "").strip().splitlines()
        options = None
        if declared is not None:
            options = [
                {"name": key, "default": _plain(o.default), "required": o.required, "help": o.help}
                for key, o in declared.items()
            ]
        out.append(
            {
                "name": name,
                "plugin": plugins._owners.get(("environments", name), ""),
                "summary": doc[0] if doc else "",
                "options": options,
            }
        )
    return out


def _plain(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def run(args: argparse.Namespace) -> int:
    from lowwater.plugins import load

    envs = describe(load())
    if args.json:
        print(orjson.dumps({"environments": envs}, option=orjson.OPT_INDENT_2).decode())
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="lowwater environments (options: --env-option KEY=VALUE; every one also gets --seed)")
    for column in ("environment", "plugin", "option", "default", "help"):
        table.add_column(column)
    for env in envs:
        if env["options"] is None:
            table.add_row(env["name"], env["plugin"], "(any)", "", "declares no options")
            continue
        if not env["options"]:
            table.add_row(env["name"], env["plugin"], "(none)", "", "")
        for i, o in enumerate(env["options"]):
            default = "required" if o["required"] else repr(o["default"])
            table.add_row(env["name"] if i == 0 else "", env["plugin"] if i == 0 else "", o["name"], default, o["help"])
    Console().print(table)
    return 0
