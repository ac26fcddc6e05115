"""``lowwater score``: a finished run's transcripts re-scored with the
environment's current rubric, no model involved (the run's model server is
gone by then); GSM8K's rubric runs its math-verify script on pooled runtimes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import trio

from lowwater import plugins as plugins_mod
from lowwater.environment import Score
from lowwater.envs.default import ArithmeticEnvironment
from lowwater.eval import EvalConfig, run_eval
from lowwater.eval.rescore import rescore
from lowwater.eval.results import ResultsFileError, read_rows, read_summary

GSM8K = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k"


class Stricter(ArithmeticEnvironment):
    """The rubric changed after the run: half a point for any answer."""

    async def score(self, rollout):
        assert rollout.trajectory is not None and rollout.trajectory.turns  # the transcript's turns are there
        return Score(0.5, {"correct": False, "answer": rollout.state.get("final_text", "")[-8:]})


def test_a_changed_rubric_rescores_every_rollout(tmp_path):
    out = tmp_path / "r.jsonl"
    trio.run(run_eval, EvalConfig(rollouts=3, group_size=2, out=out))
    plugins = plugins_mod.load()
    plugins.environments["arithmetic"] = lambda options: Stricter(int(options.get("seed", 0)))
    report = trio.run(lambda: rescore(out, plugins=plugins))
    assert report.rescored == 6 and report.changed == 6 and report.copied == 0
    assert report.before["accuracy"] == 1.0 and report.summary["accuracy"] == 0.0
    header, rows, _ = read_rows(report.out)
    assert header["rescored_from"] and all(r["reward"] == 0.5 and r["previous"]["reward"] == 1.0 for r in rows)
    assert read_summary(report.out)["summary"]["reward_mean"] == 0.5
    with pytest.raises(ResultsFileError, match="exists"):
        trio.run(lambda: rescore(out, report.out, plugins=plugins))


def test_cli_score_and_a_run_without_samples(tmp_path):
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "lowwater", *a], cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    assert run("eval", "-n", "3", "--out", "r.jsonl", "--no-progress").returncode == 0
    out = run("score", "r.jsonl")
    assert out.returncode == 0, out.stderr
    assert "rescored 3 rollouts (0 changed" in out.stdout and (tmp_path / "r.rescored.jsonl").exists()
    assert run("eval", "-n", "1", "--out", "n.jsonl", "--no-samples", "--no-progress").returncode == 0
    out = run("score", "n.jsonl")
    assert out.returncode == 2 and "--no-samples" in out.stderr


@pytest.mark.skipif(
    not (GSM8K / "test.jsonl").is_file(),
    reason="GSM8K data not found beside the checkout (../shared/data/gsm8k; see the README's GSM8K section)",
)
def test_gsm8k_rescore_agrees_with_the_run(tmp_path):
    plugins = plugins_mod.load()
    if "gsm8k" not in plugins.environments:
        pytest.skip("lowwater-gsm8k is not installed (pip install -e plugins/lowwater-gsm8k)")
    from lowwater.upstream.spec import ModelSpec

    config = EvalConfig(
        env="gsm8k",
        env_options={"data": str(GSM8K / "test.jsonl")},
        rollouts=12,
        concurrency=4,
        model=ModelSpec(
            "replay", "replay-x", replay_path=GSM8K / "example_model_solutions.jsonl", replay_column="175b_verification"
        ),
        out=tmp_path / "g.jsonl",
    )
    run = trio.run(lambda: run_eval(config, plugins=plugins))
    report = trio.run(lambda: rescore(config.out, plugins=plugins))
    assert report.rescored == 12 and report.changed == 0
    assert report.summary["accuracy"] == run.summary["accuracy"]
