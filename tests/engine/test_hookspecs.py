"""Every hookspec is documented in docs/plugins.md and exercised by a test."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from lowwater import hookspecs

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted(
    name for name, fn in vars(hookspecs).items() if callable(fn) and hasattr(fn, f"{hookspecs.PROJECT}_spec")
)


def test_specs_found():
    assert {"register_runtimes", "register_protocols", "rollout_end", "shutdown"} <= set(SPECS)


@pytest.mark.parametrize("name", SPECS)
def test_spec_is_documented(name):
    doc = (ROOT / "docs" / "plugins.md").read_text()
    assert f"### `{name}(" in doc, f"docs/plugins.md has no section for {name}"
    assert inspect.getdoc(getattr(hookspecs, name)), f"{name} has no docstring"


@pytest.mark.parametrize("name", SPECS)
def test_spec_kind_matches_async_set(name):
    fn = getattr(hookspecs, name)
    assert inspect.iscoroutinefunction(fn) == (name in hookspecs.ASYNC_HOOKS)


@pytest.mark.parametrize("name", SPECS)
def test_spec_is_tested(name):
    # A hook counts as tested when a test module other than this one
    # implements or fires it by name.
    sources = [p.read_text() for p in (ROOT / "tests").rglob("test_*.py") if p.name != "test_hookspecs.py"]
    assert any(f"def {name}(" in s or f'"{name}"' in s for s in sources), f"no test exercises {name}"
