"""The results file's header: everything that defines a run, and the check
that a resumed file was written by the same run.

``--resume`` with a different seed and model once kept the old run's rows,
ran the rest with the new settings and rewrote the header to claim the new
ones; resuming a group-size-4 file with group size 1 shrank it from 40 rows
to 10.  Rows of two runs must never be mixed: :func:`differences` names
every defining setting that changed, and :func:`lowwater.eval.results.prepare`
refuses the resume (leaving the file untouched) when there is any.
"""

from __future__ import annotations

import importlib.metadata
import time
from typing import Any

from lowwater.redact import redact_url

HEADER_TYPE = "lowwater.eval.header"

#: Header keys that define a run: resuming with any of them different is refused.
#: Task selection (``-n``, ``--limit``, ``--task-ids``) and execution settings
#: (concurrency, workers, attempts) are recorded but may change on resume:
#: they decide which tasks run and how fast, not what a row means.
DEFINING_KEYS = (
    "env",
    "env_options",
    "model",
    "model_kind",
    "model_url",
    "model_source",
    "sampling",
    "seed",
    "group_size",
    "harness",
    "runtime",
    "program",
    "max_turns",
    "timeout_s",
)


def lowwater_version() -> str:
    """The installed lowwater distribution's version (``"unknown"`` when not installed)."""
    try:
        return importlib.metadata.version("lowwater")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_header(config: Any, run_id: str) -> dict[str, Any]:
    """The header line of a run of ``config`` (an :class:`~lowwater.eval.EvalConfig`).

    Environment options are recorded as strings (how the command line gives
    them), so a resumed run compares equal whether an option came from
    ``--data`` or ``--env-option data=``.
    """
    model = config.model
    source = None
    if model.kind == "replay":
        source = f"{model.replay_path}#{model.replay_column}"
    return {
        "type": HEADER_TYPE,
        "run_id": run_id,
        "lowwater_version": lowwater_version(),
        "env": config.env,
        "env_options": {k: str(v) for k, v in sorted(config.env_options.items())},
        "model": model.name,
        "model_kind": model.kind,
        "model_url": redact_url(model.url) if model.url else model.url,  # never a password into the results
        "model_source": source,
        "sampling": dict(sorted(config.sampling.items())),
        "seed": config.seed,
        "group_size": config.group_size,
        "harness": config.harness,
        "runtime": runtime(config),
        "program": getattr(config, "program", None),
        "max_turns": config.max_turns,
        "timeout_s": config.timeout_s,
        "tasks": selection(config),
        "samples": config.samples_path.name if config.samples_path is not None else None,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def runtime(config: Any) -> dict[str, Any]:
    """The runtime the rows ran in: ``kind``, ``persistent``, ``pass_env`` and,
    when any was given, ``options`` (absent otherwise, so a file written before
    runtimes had options resumes with none)."""
    out: dict[str, Any] = {
        "kind": getattr(config, "runtime", None) or "subprocess",
        "persistent": config.persistent,
        "pass_env": sorted(config.pass_env),
    }
    options = getattr(config, "runtime_options", None)
    if options:
        out["options"] = dict(sorted(options.items()))
    return out


def selection(config: Any) -> dict[str, Any]:
    """Which tasks the run takes: ``{"start": i, "count": n | None}`` or ``{"ids": [...]}``."""
    if config.task_ids is not None:
        return {"ids": list(config.task_ids)}
    return {"start": config.start, "count": config.rollouts}


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The defining settings that differ between two headers, as ``key old -> new``.

    A key the old header lacks (written by an older lowwater) is not compared.
    Mappings are compared key by key (``env_options.size '4' -> '8'``).
    """
    out: list[str] = []
    for key in DEFINING_KEYS:
        if key not in old:
            continue
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            for sub in sorted(set(a) | set(b), key=str):
                if a.get(sub, _ABSENT) != b.get(sub, _ABSENT):
                    out.append(f"{key}.{sub} {_show(a.get(sub, _ABSENT))} -> {_show(b.get(sub, _ABSENT))}")
        elif _normal(a) != _normal(b):
            out.append(f"{key} {_show(a)} -> {_show(b)}")
    return out


_ABSENT = object()


def _normal(value: Any) -> Any:
    # JSON turns tuples into lists and may write 600 for 600.0.
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _show(value: Any) -> str:
    return "(unset)" if value is _ABSENT else repr(value)
