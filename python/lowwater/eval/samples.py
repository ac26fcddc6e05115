"""The samples file: every rollout's transcript, one JSON line per rollout,
written as the rollout finishes, beside the results file.

A transcript is built from the rollout's trajectory while the engine still
holds it (the result sink runs before eviction), serialised, appended in a
worker thread and dropped: the samples file costs the run the bytes of one
rollout's line for the time of one write, not a growing history (the
30-worker evaluation that kept every result's conversation was OOM-killed:
docs/design.md#incidents).

Line 1 is a header (``{"type": "lowwater.eval.samples", "run_id": ...}``;
a resumed run appends its own); every other line is a transcript with the
keys listed in ``docs/eval.md#samples``.  The file is created with the
first transcript, so a run that fails before its first rollout leaves no
file behind.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import orjson
import trio

from lowwater.eval.results import ResultsFileError
from lowwater.jsonl import LineFile, LineWriteError
from lowwater.trajectory import turns_to_json

SAMPLES_TYPE = "lowwater.eval.samples"


def samples_path(results: Path) -> Path:
    """The samples file beside ``results``: ``runs/x.jsonl`` -> ``runs/x.samples.jsonl``."""
    stem = results.name.removesuffix(".jsonl")
    return results.with_name(f"{stem}.samples.jsonl")


def _jsonable(value: Any) -> Any:
    # Environment state may hold anything; a transcript keeps what JSON can say.
    try:
        orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        return repr(value)[:1000]
    return value


def transcript(rollout: Any) -> dict[str, Any]:
    """The transcript of a finished rollout (its trajectory must still be live).

    Keys: ``rollout_id``, ``task_id``, ``group_id``, ``attempt``, ``task``
    (``prompt``, ``answer``, ``metadata``), ``state`` (what the harness left
    for the rubric: :command:`lowwater score` re-scores from it), ``turns``
    (each turn's message delta, completion with tool calls, usage, token ids
    and logprobs when captured, timing, error, and the tools offered: ``tools``
    when they changed since the previous turn, ``tools_same`` when they did
    not, see :func:`lowwater.trajectory.turns_to_json`), ``reward``,
    ``metrics``, ``error``, ``timing``.
    """
    task = rollout.task
    trajectory = rollout.trajectory
    return {
        "rollout_id": rollout.rollout_id,
        "task_id": task.id,
        "group_id": rollout.group_id,
        "attempt": rollout.attempt,
        "task": {"prompt": task.prompt, "answer": task.answer, "metadata": _jsonable(dict(task.metadata))},
        "state": {k: _jsonable(v) for k, v in rollout.state.items()},
        "turns": [] if trajectory is None else [_turn(t) for t in turns_to_json(trajectory.turns)],
        "reward": rollout.reward,
        "metrics": _jsonable(rollout.metrics),
        "error": None if rollout.error is None else rollout.error.to_json(),
        "timing": rollout.timing,
    }


def _turn(out: dict[str, Any]) -> dict[str, Any]:
    out["completion"] = _jsonable(out.get("completion"))
    return out


def encode(sample: dict[str, Any]) -> bytes:
    """One line of the samples file."""
    return orjson.dumps(sample, option=orjson.OPT_NON_STR_KEYS, default=repr) + b"\n"


class SamplesWriter:
    """Appends transcripts to the samples file (0600, whole lines), creating
    it with its header on the first one.  Writes run in a worker thread.

    Args:
        path: the samples file.
        run_id: the run's id (in the header line).
        results: the results file's name (in the header line).
    """

    def __init__(self, path: Path, run_id: str, results: str) -> None:
        self.path = path
        self._header = orjson.dumps({"type": SAMPLES_TYPE, "run_id": run_id, "results": results}) + b"\n"
        self._file: LineFile | None = None
        # Appends run in worker threads: two first transcripts finishing
        # together each created the file and wrote the header (a second
        # header line in mid-file, found by CI).
        self._lock = threading.Lock()
        self.written = 0

    def _append(self, line: bytes) -> None:
        with self._lock:
            if self._file is None:
                self._file = LineFile(self.path)
                self._file.append(self._header)
            file = self._file
        file.append(line)

    async def write(self, line: bytes) -> None:
        """Append one encoded transcript (see :func:`encode`).

        Raises:
            ResultsFileError: the line could not be written (nothing of it is in the file).
        """
        try:
            await trio.to_thread.run_sync(self._append, line)
        except (LineWriteError, OSError) as exc:
            raise ResultsFileError(str(exc)) from exc
        self.written += 1

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def index(path: Path) -> dict[str, tuple[int, int]]:
    """``rollout_id -> (offset, length)`` of each transcript line in ``path``
    (the last line wins for a repeated id); a torn last line is skipped.
    Reads the file once, keeping only ids and offsets."""
    out: dict[str, tuple[int, int]] = {}
    offset = 0
    with open(path, "rb") as f:
        for line in f:
            if line.endswith(b"\n"):
                rid = _rollout_id(line)
                if rid is not None:
                    out[rid] = (offset, len(line))
            offset += len(line)
    return out


_KEY = b'"rollout_id":"'


def _rollout_id(line: bytes) -> str | None:
    # Transcripts are written with rollout_id first: find it without parsing
    # the whole line (a transcript can be megabytes).
    start = line.find(_KEY, 0, 200)
    if start < 0:
        return None
    start += len(_KEY)
    end = line.find(b'"', start)
    return line[start:end].decode() if end > 0 else None


def read_sample(path: Path, where: tuple[int, int]) -> bytes:
    """The raw JSON line at ``where`` (from :func:`index`)."""
    offset, length = where
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)
