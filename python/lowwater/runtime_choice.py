"""Choosing the runtime a run's agent programs and scripts execute in.

``lowwater eval --runtime NAME --runtime-option KEY=VALUE`` and
``TrainerConfig(runtime=, runtime_options=)`` name a runtime registered
through ``register_runtimes``; an environment may declare the runtime it
needs (:attr:`lowwater.environment.Environment.runtime` and
``runtime_options``).  Rules (docs/plugins.md#choosing-a-runtime):

* nothing named anywhere: ``"subprocess"``;
* the environment names one and the caller none: the environment's;
* both name one: they must be the same, else :class:`ValueError` naming both
  (an environment that needs a container must not run in a bare subprocess);
* options: the environment's first, then the caller's, key by key (the
  caller's value wins for a key both give).

A runtime factory declares its options like an environment factory does
(an ``options`` attribute of name -> :class:`lowwater.environment.EnvOption`);
undeclared keys are refused with the closest declared one.  A factory that
declares nothing accepts any key.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from lowwater.environment import declared_options

DEFAULT_RUNTIME = "subprocess"

__all__ = ["DEFAULT_RUNTIME", "choose_runtime", "freeze", "parse_options"]


def parse_options(items: Iterable[str], flag: str = "--runtime-option", *, json: bool = True) -> dict[str, Any]:
    """``KEY=VALUE`` items (``--runtime-option``, ``-S``, ``--env-option``) as
    a dict; with ``json``, ``VALUE`` is JSON when it parses as JSON
    (``cpus=2`` is the int 2, ``image=python:3.12`` the string), else the
    string; without, always the string (an environment's factory converts
    its own options).

    Raises:
        ValueError: an item without ``=`` or with an empty key (names ``flag``).
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            hint = " (VALUE is JSON, else a string)" if json else ""
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE{hint}")
        if not json:
            out[key] = value
            continue
        try:
            out[key] = orjson.loads(value)
        except orjson.JSONDecodeError:
            out[key] = value
    return out


def freeze(value: Any) -> Any:
    """``value`` made hashable for :class:`lowwater.runtime.RuntimeConfig`
    (the pool keys runtimes by config): lists become tuples, mappings sorted
    ``(key, value)`` tuples."""
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), freeze(v)) for k, v in value.items()))
    return value


def choose_runtime(
    plugins: Any, requested: str | None, options: Mapping[str, Any], env: Any = None
) -> tuple[str, dict[str, Any]]:
    """The runtime name and options a run uses (rules in the module docstring).

    Args:
        plugins: the loaded :class:`lowwater.plugins.Plugins`.
        requested: the caller's runtime name (``--runtime``), or ``None``.
        options: the caller's options (``--runtime-option``).
        env: the built environment (its ``runtime``/``runtime_options``), or ``None``.

    Raises:
        lowwater.plugins.UnknownName: no plugin registered the name (the
            message lists the registered ones).
        ValueError: the caller's and the environment's runtime differ, or an
            option the runtime does not declare.
    """
    needed = getattr(env, "runtime", None)
    if requested and needed and requested != needed:
        name = getattr(env, "name", "") or type(env).__name__
        raise ValueError(
            f"--runtime {requested!r} conflicts with environment {name!r}, which needs runtime {needed!r} "
            f"(drop --runtime or give --runtime {needed})"
        )
    chosen = requested or needed or DEFAULT_RUNTIME
    merged = {**dict(getattr(env, "runtime_options", None) or {}), **dict(options)}
    if chosen == DEFAULT_RUNTIME and not plugins.runtimes and not requested and not merged:
        return chosen, merged  # runtime plugin disabled: in-process harnesses still run
    factory = plugins.runtime(chosen)
    declared = declared_options(factory)
    if declared is not None:
        for key in merged:
            if key in declared:
                continue
            # A prefix counts too: difflib misses "cpu" for "cpu_seconds".
            close = difflib.get_close_matches(key, list(declared), n=1) or sorted(
                d for d in declared if d.startswith(key)
            )
            hint = f"; did you mean {close[0]!r}?" if close else ""
            known = ", ".join(sorted(declared)) or "none"
            raise ValueError(
                f"runtime {chosen!r} has no option {key!r}{hint} (its options: {known}; see `lowwater plugins`)"
            )
        for key, option in declared.items():
            if option.required and key not in merged:
                raise ValueError(f"runtime {chosen!r} needs --runtime-option {key}=VALUE ({option.help})")
    return chosen, merged
