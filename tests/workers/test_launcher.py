"""The lean forkserver launcher copies a private CPython method: its version guard."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest
import trio

from lowwater.workers import JobSpec, WorkerPool, launcher

from . import jobs

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_this_interpreter_is_supported():
    launcher.check_python()


@pytest.mark.parametrize("version", [(3, 10), (3, 14), (4, 0)])
def test_other_versions_are_refused_naming_the_supported_range(version):
    with pytest.raises(RuntimeError, match=r"checked on CPython >=3\.11,<3\.14 only") as info:
        launcher.check_python(version)
    assert f"{version[0]}.{version[1]}" in str(info.value)
    assert "start_method='spawn'" in str(info.value)


def test_other_implementations_are_refused():
    with pytest.raises(RuntimeError, match="this is pypy 3.11"):
        launcher.check_python((3, 11), "pypy")


def test_the_guard_reads_the_running_version(monkeypatch):
    monkeypatch.setattr(sys, "version_info", (3, 14, 0, "final", 0))
    with pytest.raises(RuntimeError, match="this is cpython 3.14"):
        launcher.check_python()


def test_pool_start_fails_before_any_worker_on_an_unchecked_python(monkeypatch):
    monkeypatch.setattr(launcher, "SUPPORTED_PYTHON", ((3, 0), (3, 1)))
    events = []
    pool = WorkerPool(JobSpec(jobs.FACTORY), workers=1, on_event=lambda name, fields: events.append(name))

    async def on_rows(rows, info):
        raise AssertionError("no task may run")

    with pytest.raises(RuntimeError, match=r"checked on CPython >=3\.0,<3\.1 only"):
        trio.run(pool.run, ["ok:1"], on_rows)
    assert events == []
    monkeypatch.undo()
    assert trio.run(pool.run, [], on_rows).workers_started == 0  # not left marked as running


def test_requires_python_pins_the_checked_range():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert project["requires-python"] == launcher.supported_range()
