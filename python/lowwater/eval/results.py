"""The results file: a JSONL header line, then one row per finished rollout.

Rows are written and flushed as each rollout finishes, in a worker thread
(file writes never run on the Trio loop), and nothing keeps them afterwards:
a peer's 30-worker evaluation kept its result history and a deep copy of the
run metadata per result and was OOM-killed after 5 h (docs/design.md#incidents).
Run metadata is the header line, written once; rows carry only ``run_id``.

Crash safety: each row is a single ``write`` of a whole line followed by a
flush, so a kill (even SIGKILL) can only leave a torn *last* line.
:func:`prepare` drops that line when resuming, keeps every finished task's
rows, drops the rows of tasks that will run again, and rewrites the file
atomically (temp file, fsync, rename) before new rows are appended: after
any number of kills and resumes the file holds exactly the final rows of
each task, no loss and no duplicates.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import attrs
import orjson
import trio

from lowwater._native import LowwaterError
from lowwater.eval.header import HEADER_TYPE, differences
from lowwater.jsonl import LineFile, LineWriteError, write_atomic

#: The last line of a finished run: its summary and memory record (see :func:`summary_line`).
SUMMARY_TYPE = "lowwater.eval.summary"


class ResultsFileError(LowwaterError):
    """The results file cannot be resumed: not a lowwater results file, a
    different run (the settings that differ are in the message), or a
    malformed line before the last one (its 1-based line number is in the
    message)."""


@attrs.define
class ResumeState:
    """What an existing results file says about a run.

    Attributes:
        done: task ids that need no further rollout.
        attempts: task id -> eval runs that attempted it so far.
        kept_rows: the rows kept from the file (to seed the summary).
        dropped_torn_line: whether a torn last line was removed.
        fresh: the file did not exist (or was empty) before this run.
    """

    done: set[Any] = attrs.field(factory=set)
    attempts: dict[Any, int] = attrs.field(factory=dict)
    kept_rows: list[dict[str, Any]] = attrs.field(factory=list)
    dropped_torn_line: bool = False
    fresh: bool = True


def read_rows(path: Path) -> tuple[dict[str, Any] | None, list[dict[str, Any]], bool]:
    """``(header, rows, torn)`` of a results file.

    A last line without its newline, or that does not parse, is a torn
    write and is reported as ``torn=True`` (not an error).  Summary lines
    (:data:`SUMMARY_TYPE`) are not rows; :func:`read_summary` reads them.

    Raises:
        ResultsFileError: a malformed line before the last one.
    """
    data = path.read_bytes()
    lines = data.split(b"\n")
    torn = False
    if lines and lines[-1] == b"":
        lines.pop()
    elif lines:
        torn = True  # no trailing newline: the last write did not finish
        lines.pop()
    header = None
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            if number == len(lines):
                torn = True
                break
            raise ResultsFileError(f"{path}: line {number} is not valid JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise ResultsFileError(f"{path}: line {number} is not a JSON object")
        kind = obj.get("type")
        if kind == HEADER_TYPE:
            header = header or obj
        elif kind != SUMMARY_TYPE:
            rows.append(obj)
    return header, rows, torn


def read_summary(path: Path) -> dict[str, Any] | None:
    """The summary line a finished run appended last (``None``: the run did
    not finish, or was resumed and has not finished since).  Reads only the
    file's tail: the summary is its last line."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(max(0, size - (4 << 20)))  # the memory record is bounded (a few hundred KiB at most)
        tail = f.read()
    lines = tail.rstrip(b"\n").rsplit(b"\n", 1)
    try:
        obj = orjson.loads(lines[-1])
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) and obj.get("type") == SUMMARY_TYPE else None


def prepare(path: Path, header: dict[str, Any], *, resume: bool, group_size: int, max_attempts: int) -> ResumeState:
    """Make ``path`` ready for appending rows of this run; returns what to skip.

    Without ``resume`` an existing file is refused (nothing is overwritten
    by accident).  With ``resume``: a task is done when it has
    ``group_size`` error-free rows, or when its last rows errored and it has
    been attempted ``max_attempts`` times; other tasks' rows are dropped and
    they run again.  The file is rewritten atomically with the header and
    the kept rows.

    Every check runs before anything is written: a refused resume leaves
    the file exactly as it was.

    Raises:
        ResultsFileError: the file exists without ``resume``, is not a
            results file, or was written by a run with different defining
            settings (:data:`lowwater.eval.header.DEFINING_KEYS`; the
            message lists each change as ``key old -> new``).
    """
    state = ResumeState()
    if path.exists() and path.stat().st_size > 0:
        if not resume:
            raise ResultsFileError(f"{path} exists; pass --resume to continue it or choose another --out")
        state.fresh = False
        old_header, rows, state.dropped_torn_line = read_rows(path)
        if old_header is None:
            raise ResultsFileError(f"{path} has no lowwater header line; not a results file")
        changed = differences(old_header, header)
        if changed:
            raise ResultsFileError(
                f"{path} was written by a different run ({'; '.join(changed)}); "
                "resume with its settings or choose another --out"
            )
        by_task: dict[Any, list[dict[str, Any]]] = defaultdict(list)
        for row in rows:
            by_task[row.get("task_id")].append(row)
        for task_id, task_rows in by_task.items():
            ok = [r for r in task_rows if r.get("error") is None]
            attempts = max(int(r.get("attempts", 1)) for r in task_rows)
            state.attempts[task_id] = attempts
            if len(ok) >= group_size:
                state.done.add(task_id)
                state.kept_rows.extend(ok[-group_size:])
            elif attempts >= max_attempts:
                state.done.add(task_id)
                state.kept_rows.extend(task_rows[-group_size:])
        header = {**header, "resumed_from": old_header.get("run_id")}
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, [header, *state.kept_rows])
    return state


def _atomic_write(path: Path, objects: list[dict[str, Any]]) -> None:
    try:
        write_atomic(path, [orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS) + b"\n" for obj in objects])
    except OSError as exc:
        raise ResultsFileError(f"cannot write {path}: {exc.strerror or exc}") from exc


class ResultsWriter:
    """Appends rows to a prepared results file (mode 0600), one whole line each.

    Writes run in a worker thread (``trio.to_thread.run_sync``); a failed
    write (a full disk) leaves the file at its last whole row and raises
    :class:`ResultsFileError`, so the file stays resumable.  Use as a
    context manager or call :meth:`close`.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = LineFile(path)

    @property
    def rows_written(self) -> int:
        """Rows appended by this writer."""
        return self._file.lines_written

    async def write(self, row: dict[str, Any]) -> None:
        """Serialise ``row`` (orjson) and append it as one line.

        Raises:
            ResultsFileError: the line could not be written (nothing of it is in the file).
        """
        line = orjson.dumps(row, option=orjson.OPT_NON_STR_KEYS) + b"\n"
        try:
            await trio.to_thread.run_sync(self._file.append, line)
        except LineWriteError as exc:
            raise ResultsFileError(str(exc)) from exc

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> ResultsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
