"""The results file: header once, flushed rows, torn-line recovery, compaction on resume."""

from __future__ import annotations

import orjson
import pytest
import trio

from lowwater.eval.results import ResultsFileError, ResultsWriter, prepare, read_rows

HEADER = {"type": "lowwater.eval.header", "run_id": "run1", "env": "arithmetic"}


def row(task_id, error=None, attempts=1, rollout="r"):
    return {
        "task_id": task_id,
        "rollout_id": f"{rollout}{task_id}",
        "reward": 1.0 if error is None else None,
        "error": error,
        "attempts": attempts,
        "metrics": {},
        "turns": 1,
    }


def write(path, objs, torn=b""):
    path.write_bytes(b"".join(orjson.dumps(o) + b"\n" for o in objs) + torn)


def test_fresh_file_gets_header_and_rows(tmp_path):
    path = tmp_path / "runs" / "out.jsonl"
    state = prepare(path, HEADER, resume=False, group_size=1, max_attempts=3)
    assert state.done == set()

    async def main():
        with ResultsWriter(path) as writer:
            async with trio.open_nursery() as nursery:
                for i in range(50):
                    nursery.start_soon(writer.write, row(i))

    trio.run(main)
    header, rows, torn = read_rows(path)
    assert header == HEADER and not torn
    assert sorted(r["task_id"] for r in rows) == list(range(50))  # no interleaved lines


def test_existing_file_is_not_overwritten_without_resume(tmp_path):
    path = tmp_path / "out.jsonl"
    write(path, [HEADER, row(0)])
    before = path.read_bytes()
    with pytest.raises(ResultsFileError, match="--resume"):
        prepare(path, HEADER, resume=False, group_size=1, max_attempts=3)
    assert path.read_bytes() == before


def test_resume_drops_torn_line_and_reruns_errors(tmp_path):
    path = tmp_path / "out.jsonl"
    err = {"class": "model", "message": "500"}
    write(path, [HEADER, row(0), row(1, err), row(2), row(2)], torn=b'{"task_id": 3, "rollo')
    state = prepare(path, {**HEADER, "run_id": "run2"}, resume=True, group_size=1, max_attempts=3)
    assert state.dropped_torn_line
    assert state.done == {0, 2} and state.attempts == {0: 1, 1: 1, 2: 1}
    header, rows, torn = read_rows(path)
    assert not torn and header["run_id"] == "run2" and header["resumed_from"] == "run1"
    # Exactly one row per finished task; the errored task's row is gone (it re-runs).
    assert [r["task_id"] for r in rows] == [0, 2]


def test_errored_task_stops_at_max_attempts(tmp_path):
    path = tmp_path / "out.jsonl"
    err = {"class": "model", "message": "500"}
    write(path, [HEADER, row(0, err, attempts=3)])
    state = prepare(path, HEADER, resume=True, group_size=1, max_attempts=3)
    assert state.done == {0}
    assert [r["error"] for r in read_rows(path)[1]] == [err]


def test_groups_need_all_members(tmp_path):
    path = tmp_path / "out.jsonl"
    write(path, [HEADER, row(0), row(0), row(1)])
    state = prepare(path, HEADER, resume=True, group_size=2, max_attempts=3)
    assert state.done == {0}
    assert [r["task_id"] for r in read_rows(path)[1]] == [0, 0]


def test_malformed_middle_line_names_its_number(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(orjson.dumps(HEADER) + b"\n" + b"{not json\n" + orjson.dumps(row(0)) + b"\n")
    with pytest.raises(ResultsFileError, match="line 2"):
        prepare(path, HEADER, resume=True, group_size=1, max_attempts=3)


def test_other_environment_or_no_header_refused(tmp_path):
    path = tmp_path / "out.jsonl"
    write(path, [{**HEADER, "env": "gsm8k"}, row(0)])
    with pytest.raises(ResultsFileError, match="gsm8k"):
        prepare(path, HEADER, resume=True, group_size=1, max_attempts=3)
    write(path, [row(0)])
    with pytest.raises(ResultsFileError, match="header"):
        prepare(path, HEADER, resume=True, group_size=1, max_attempts=3)
