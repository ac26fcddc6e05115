"""attrs validators shared by the config classes (one way to validate a config).

Each names the setting as its user typed it (a CLI flag's name, or the
attribute's), so ``EvalConfig(concurrency=0)`` and ``lowwater eval -c 0``
both say ``concurrency must be >= 1, not 0``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

Validator = Callable[[Any, Any, Any], None]


def _label(attribute: Any, label: str | None) -> str:
    return label if label is not None else attribute.name


def at_least(minimum: int, label: str | None = None) -> Validator:
    """An integer ``>= minimum`` (``ValueError`` otherwise)."""

    def check(_instance: Any, attribute: Any, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{_label(attribute, label)} must be >= {minimum}, not {value!r}")

    return check


def positive(label: str | None = None, unit: str = "") -> Validator:
    """A finite number ``> 0`` (``ValueError`` otherwise); ``unit`` is named in the message."""

    def check(_instance: Any, attribute: Any, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            suffix = f" {unit}" if unit else ""
            raise ValueError(f"{_label(attribute, label)} must be > 0{suffix}, not {value!r}")

    return check


def str_tuple(value: Iterable[str]) -> tuple[str, ...]:
    """Converter: any iterable of strings to a tuple (typed, unlike ``converter=tuple``)."""
    return tuple(value)


def optional(validator: Validator) -> Validator:
    """``validator`` unless the value is ``None``."""

    def check(instance: Any, attribute: Any, value: Any) -> None:
        if value is not None:
            validator(instance, attribute, value)

    return check


def one_of(choices: tuple[str, ...], label: str | None = None) -> Validator:
    """One of ``choices`` (``ValueError`` naming them otherwise)."""

    def check(_instance: Any, attribute: Any, value: Any) -> None:
        if value not in choices:
            raise ValueError(f"{_label(attribute, label)} must be one of {', '.join(choices)}, not {value!r}")

    return check


def program_needs_harness(instance: Any, _attribute: Any, value: Any) -> None:
    """A ``program`` (``--program``) only with ``harness="program"`` (``ValueError`` otherwise)."""
    if value is None:
        return
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"program must be a non-empty command line, not {value!r}")
    if instance.harness != "program":
        raise ValueError("--program runs the agent as a program: give --harness program with it")


def backend_needs_workers(backend: str, workers: str) -> Validator:
    """A worker backend other than ``"local"`` only with ``workers >= 1`` (a
    ``ValueError`` otherwise); ``backend`` is how the message names the
    setting (``{}`` stands for its value), ``workers`` how it asks for workers."""

    def check(instance: Any, _attribute: Any, value: Any) -> None:
        if value != "local" and instance.workers < 1:
            named = backend.format(value)
            raise ValueError(f"{named} runs env workers: give {workers} (worker processes per node)")

    return check
