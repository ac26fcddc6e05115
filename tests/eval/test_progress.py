"""The progress bar shows done/total, percent, ETA and the running reward mean."""

from __future__ import annotations

import io
import re

from rich.console import Console

from lowwater.commands.eval import _Progress
from lowwater.eval.runner import Totals


def test_progress_bar_columns():
    console = Console(file=io.StringIO(), force_terminal=True, width=200, color_system=None)
    progress = _Progress(console)
    totals = Totals()
    totals.planned = 40
    for i in range(10):
        totals.add({"reward": 1.0 if i % 2 else 0.0, "metrics": {}, "turns": 1}, this_run=True)
    progress.update(totals, 50 << 20)
    with console.capture() as capture:
        console.print(progress.progress.get_renderable())
    line = capture.get()
    assert "10/40" in line and "25%" in line and "ETA" in line
    assert "reward 0.500" in line and "RSS 50 MiB" in line
    assert re.search(r"ETA\s+(-:--:--|\d+:\d\d:\d\d)", line)


def test_planned_total_counts_the_selection_minus_done(tmp_path):
    from lowwater.envs.default import ArithmeticEnvironment
    from lowwater.eval import EvalConfig
    from lowwater.eval.runner import TaskFeed

    env = ArithmeticEnvironment(size=64)
    assert TaskFeed(env, EvalConfig(), set()).planned_tasks() == 64
    assert TaskFeed(env, EvalConfig(rollouts=10, start=60), set()).planned_tasks() == 4
    assert TaskFeed(env, EvalConfig(rollouts=10), {0, 1, 50}).planned_tasks() == 8
    assert TaskFeed(env, EvalConfig(task_ids=(3, 4)), {4}).planned_tasks() == 1
