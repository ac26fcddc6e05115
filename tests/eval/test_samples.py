"""Transcripts: one line per rollout in the samples file, written as each
rollout finishes (in process and from env workers), none with
``--no-samples``, and the results file's summary line with the memory record."""

from __future__ import annotations

import orjson
import trio

from lowwater.eval import EvalConfig, run_eval
from lowwater.eval.results import read_rows, read_summary
from lowwater.eval.samples import SAMPLES_TYPE, index, read_sample, samples_path


def transcripts(path):
    lines = path.read_bytes().splitlines()
    assert orjson.loads(lines[0])["type"] == SAMPLES_TYPE
    return [orjson.loads(line) for line in lines[1:]]


def test_every_rollout_has_its_transcript(tmp_path):
    config = EvalConfig(rollouts=4, group_size=2, out=tmp_path / "r.jsonl")
    report = trio.run(run_eval, config)
    _, rows, _ = read_rows(config.out)
    samples = {s["rollout_id"]: s for s in transcripts(samples_path(config.out))}
    assert set(samples) == {r["rollout_id"] for r in rows} and len(samples) == 8
    for row in rows:
        s = samples[row["rollout_id"]]
        assert s["reward"] == row["reward"] and s["metrics"] == row["metrics"] and s["group_id"] == row["group_id"]
        assert len(s["turns"]) == row["turns"] >= 3
        assert s["task"]["prompt"] and s["task"]["answer"] and "final_text" in s["state"]
        first, last = s["turns"][0], s["turns"][-1]
        assert first["request_delta"][0]["role"] in ("system", "user")
        assert any(t["completion"].get("tool_calls") for t in s["turns"])  # the calculator calls
        assert any(m.get("role") == "tool" for t in s["turns"] for m in t["request_delta"])  # and their results
        assert last["usage"] and last["duration_s"] >= 0
    assert report.leftovers["trajectories"] == 0
    # the viewer's on-demand lookup
    where = index(samples_path(config.out))
    rid = rows[0]["rollout_id"]
    assert orjson.loads(read_sample(samples_path(config.out), where[rid]))["rollout_id"] == rid


def test_transcripts_from_env_workers(tmp_path):
    config = EvalConfig(rollouts=6, workers=2, concurrency=4, out=tmp_path / "w.jsonl")
    trio.run(run_eval, config)
    _, rows, _ = read_rows(config.out)
    samples = transcripts(samples_path(config.out))
    assert sorted(s["rollout_id"] for s in samples) == sorted(r["rollout_id"] for r in rows)
    assert all("sample" not in r for r in rows)  # carried from the worker, not written into the row


def test_no_samples_writes_no_file(tmp_path):
    config = EvalConfig(rollouts=2, samples=False, out=tmp_path / "r.jsonl")
    trio.run(run_eval, config)
    assert not samples_path(config.out).exists()
    header, _, _ = read_rows(config.out)
    assert header["samples"] is None


def test_summary_line_holds_the_memory_record_from_t0(tmp_path):
    config = EvalConfig(rollouts=8, out=tmp_path / "r.jsonl")
    report = trio.run(run_eval, config)
    line = read_summary(config.out)
    assert line["summary"] == report.summary and line["run_id"] == report.run_id
    samples = line["memory"]["samples"]
    assert samples[0] == [0.0, line["memory"]["baseline_bytes"], 0]  # the baseline at t = 0
    assert samples[-1][2] == 8  # and the end of the run
    assert len(samples) >= 3
