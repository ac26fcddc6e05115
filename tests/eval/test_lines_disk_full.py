"""Appends are whole lines or nothing, and files are private (0600).

A full disk is simulated with ``RLIMIT_FSIZE`` in a child process (SIGXFSZ
ignored): a write that crosses the limit is short, the next one fails with
``EFBIG``, which is what a filling disk does to an append (a short write,
then ``ENOSPC``).  Before the fix the short write left a partial line and the
next row was appended to it.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from lowwater.eval.results import ResultsFileError, ResultsWriter, prepare, read_rows
from lowwater.jsonl import LineFile, write_atomic

CHILD = r"""
import resource, signal, sys
from pathlib import Path
from lowwater.jsonl import LineFile, LineWriteError

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
path = Path(sys.argv[1])
f = LineFile(path)
f.append(b'{"row": 0}\n')
resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + 20, resource.RLIM_INFINITY))
errors = 0
for i in range(1, 4):
    try:
        f.append(b'{"row": %d, "pad": "%s"}\n' % (i, b"x" * 40))
    except LineWriteError as exc:
        errors += 1
        print("error:", exc, file=sys.stderr)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
f.append(b'{"row": 9}\n')
f.close()
print(errors)
"""


def _disk_full(*_args, **_kwargs):
    """Stands in for ``os.fsync`` on a full disk."""
    raise OSError(28, "No space left on device")


def _prepare(path: Path, run_id: str, *, resume: bool) -> None:
    """Start (or resume) a results file of an arithmetic run ``run_id``."""
    header = {"type": "lowwater.eval.header", "run_id": run_id, "env": "arithmetic"}
    prepare(path, header, resume=resume, group_size=1, max_attempts=3)


def test_failed_append_leaves_only_whole_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    out = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == 3 and "cannot append" in out.stderr
    lines = path.read_bytes().splitlines()
    assert [orjson.loads(line)["row"] for line in lines] == [0, 9]


def test_files_are_created_private(tmp_path):
    f = LineFile(tmp_path / "a.jsonl")
    f.append(b"{}\n")
    f.close()
    write_atomic(tmp_path / "b.jsonl", [b"{}\n"])
    for name in ("a.jsonl", "b.jsonl"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600


def test_existing_file_is_made_private(tmp_path):
    path = tmp_path / "old.jsonl"
    path.write_bytes(b"{}\n")
    os.chmod(path, 0o644)
    LineFile(path).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_atomic_write_failure_leaves_no_tmp_and_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"old": 1}\n')
    monkeypatch.setattr(os, "fsync", _disk_full)
    with pytest.raises(OSError):
        write_atomic(path, [b'{"new": 1}\n'])
    assert path.read_bytes() == b'{"old": 1}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["r.jsonl"]


def test_resume_on_a_full_disk_is_a_results_error_without_tmp(tmp_path, monkeypatch):
    path = tmp_path / "r.jsonl"
    _prepare(path, "a", resume=False)
    monkeypatch.setattr(os, "fsync", _disk_full)
    with pytest.raises(ResultsFileError, match="No space left"):
        _prepare(path, "b", resume=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]
    header, rows, torn = read_rows(path)
    assert header["run_id"] == "a" and rows == [] and not torn


def test_results_writer_file_mode(tmp_path):
    path: Path = tmp_path / "r.jsonl"
    _prepare(path, "a", resume=False)
    with ResultsWriter(path) as w:
        pass
    assert w.rows_written == 0 and stat.S_IMODE(path.stat().st_mode) == 0o600
