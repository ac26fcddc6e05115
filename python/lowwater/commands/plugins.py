"""``lowwater plugins``: installed plugins, their distribution and version,
the hooks each implements, what the registries hold, and any plugin that
failed to load (by name, with a one-line reason)."""

from __future__ import annotations

import argparse
from typing import Any

import orjson


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("plugins", help="list installed plugins and the hooks they implement")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)
    return p


def runtime_options(plugins: Any) -> dict[str, list[dict[str, Any]] | None]:
    """Each runtime's declared options (``--runtime-option``), as ``lowwater envs``
    lists an environment's: ``None`` for a runtime that declares none."""
    from lowwater.commands.envs import _plain
    from lowwater.environment import declared_options

    out: dict[str, list[dict[str, Any]] | None] = {}
    for name in sorted(plugins.runtimes):
        declared = declared_options(plugins.runtimes[name])
        out[name] = (
            None
            if declared is None
            else [
                {"name": key, "default": _plain(o.default), "required": o.required, "help": o.help}
                for key, o in declared.items()
            ]
        )
    return out


def run(args: argparse.Namespace) -> int:
    from lowwater.plugins import disabled_names, load

    plugins = load(strict=False)  # list every clash instead of stopping at the first
    data: dict[str, Any] = {
        "plugins": [
            {"name": i.name, "dist": i.dist, "version": i.version, "hooks": list(i.hooks)} for i in plugins.infos
        ],
        "failed": [{"name": f.name, "dist": f.dist, "reason": f.reason} for f in plugins.failures],
        "clashes": list(plugins.clashes),
        "disabled": sorted(disabled_names()),
        "runtimes": sorted(plugins.runtimes),
        "protocols": sorted(plugins.protocols),
        "environments": sorted(plugins.environments),
        "cleanup_policies": sorted(plugins.cleanup_policies),
        "backends": sorted(plugins.backends),
        "shard_transports": sorted(plugins.shard_transports),
        "runtime_options": runtime_options(plugins),
    }
    # Non-zero with clashes: every eval would fail on them (a CI check can run this).
    status = 1 if plugins.clashes else 0
    if args.json:
        print(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
        return status
    from rich.console import Console
    from rich.table import Table

    table = Table(title="lowwater plugins")
    for column in ("plugin", "distribution", "version", "hooks"):
        table.add_column(column)
    for p in data["plugins"]:
        table.add_row(p["name"], p["dist"], p["version"], ", ".join(p["hooks"]))
    console = Console()
    console.print(table)
    for kind in ("runtimes", "protocols", "environments", "cleanup_policies", "backends", "shard_transports"):
        console.print(f"{kind.replace('_', ' ')}: {', '.join(data[kind]) or 'none'}")
    for name, options in data["runtime_options"].items():
        if options is None:
            console.print(f"runtime {name}: declares no options (--runtime-option takes any KEY=VALUE)")
            continue
        if not options:
            console.print(f"runtime {name}: takes no --runtime-option")
        for o in options:
            default = "required" if o["required"] else f"default {o['default']!r}"
            console.print(f"runtime {name}: --runtime-option {o['name']} ({default}) {o['help']}".rstrip())
    for f in data["failed"]:
        console.print(f"[red]failed[/red] {f['name']} ({f['dist'] or 'no distribution'}): {f['reason']}")
    if data["disabled"]:
        console.print(f"disabled: {', '.join(data['disabled'])}")
    for clash in data["clashes"]:
        console.print(f"[red]clash[/red] {clash}: every run refuses to start until one plugin is disabled")
    return status
