"""``lowwater eval``'s summary: the ``--summary-json`` keys, the running
:class:`Totals` (no result is kept) and the :class:`EvalReport` a run returns."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import attrs

from lowwater.eval import metrics
from lowwater.memory import MemoryRecord

#: The keys of ``--summary-json``, in order.
SUMMARY_KEYS = (
    "rollouts",
    "completed",
    "errors",
    "accuracy",
    "reward_mean",
    "turns_mean",
    "wall_s",
    "rollouts_per_s",
    "rss_baseline_mb",
    "rss_peak_mb",
    "rss_resting_mb",
    "leftovers",
    "accuracy_stderr",
    "accuracy_ci95",
    "tasks",
    "pass_at_k",
    "pass_hat_k",
    "error_rate",
    "top_errors",
)


class Totals:
    """Running totals for the summary (no result is kept).

    Args:
        group_size: rollouts per task; above 1, two ints per task are kept
            for pass@k and the clustered standard error.

    Attributes:
        planned: rollouts this invocation expects to run (``None``: unknown);
            the progress bar's total.
    """

    def __init__(self, group_size: int = 1) -> None:
        self.rollouts = 0
        self.completed = 0
        self.correct = 0
        self.reward_sum = 0.0
        self.turns_sum = 0
        self.errors: Counter[str] = Counter()
        self.messages = metrics.ErrorMessages()
        self.group_size = group_size
        self.tasks = metrics.TaskCounts() if group_size > 1 else None
        self.this_run = 0
        self.planned: int | None = None

    def add(self, row: dict[str, Any], *, this_run: bool) -> None:
        self.rollouts += 1
        self.this_run += this_run
        self.turns_sum += int(row.get("turns") or 0)
        error = row.get("error")
        correct = False
        if error:
            cls = error.get("class", "infra")
            self.errors[cls] += 1
            self.messages.add(cls, str(error.get("message") or ""))
        else:
            self.completed += 1
            self.reward_sum += float(row.get("reward") or 0.0)
            correct = bool((row.get("metrics") or {}).get("correct"))
            self.correct += correct
        if self.tasks is not None:
            self.tasks.add(row.get("task_id"), correct)

    @property
    def reward_mean(self) -> float:
        """Mean reward over completed rollouts so far (0 before any)."""
        return self.reward_sum / self.completed if self.completed else 0.0

    def summary(
        self, wall_s: float, memory: dict[str, float], leftovers: dict[str, int] | None = None
    ) -> dict[str, Any]:
        """The ``--summary-json`` figures (see :data:`SUMMARY_KEYS`).

        ``accuracy`` is correct rollouts over all rollouts (an errored
        rollout counts as wrong); ``reward_mean`` is over completed ones;
        ``rollouts_per_s`` counts this run's rollouts only.  See
        :mod:`lowwater.eval.metrics` for the standard error, the interval
        and pass@k / pass^k (``None`` with group size 1).
        """
        n = self.rollouts
        accuracy = self.correct / n if n else 0.0
        errors = sum(self.errors.values())
        if self.tasks is not None:
            stderr = self.tasks.stderr()
            k = self.group_size
            pass_at: dict[str, float | None] | None = {"1": self.tasks.pass_at(1), str(k): self.tasks.pass_at(k)}
            pass_hat: dict[str, float | None] | None = {"1": self.tasks.pass_hat(1), str(k): self.tasks.pass_hat(k)}
            tasks = len(self.tasks)
        else:
            stderr, pass_at, pass_hat, tasks = metrics.binary_stderr(n, self.correct), None, None, n
        return {
            "rollouts": n,
            "completed": self.completed,
            "errors": errors,
            "accuracy": accuracy,
            "reward_mean": self.reward_mean,
            "turns_mean": self.turns_sum / n if n else 0.0,
            "wall_s": round(wall_s, 3),
            "rollouts_per_s": round(self.this_run / wall_s, 3) if wall_s > 0 else 0.0,
            **memory,
            "leftovers": leftovers or {},
            "accuracy_stderr": None if stderr is None else round(stderr, 6),
            "accuracy_ci95": metrics.interval95(accuracy, stderr),
            "tasks": tasks,
            "pass_at_k": pass_at,
            "pass_hat_k": pass_hat,
            "error_rate": errors / n if n else 0.0,
            "top_errors": self.messages.top(5),
        }


@attrs.define
class EvalReport:
    """What :func:`run_eval` returns: the summary, errors by class, the
    memory record, the results path and the engine's final stats (all zero
    when nothing leaked).

    ``tasks_available`` is set when ``-n`` asked for more tasks than the
    taskset has: the number it has (all of which ran).  ``run_id`` is the
    header's.
    """

    summary: dict[str, Any]
    errors_by_class: dict[str, int]
    memory: MemoryRecord
    out: Path
    leftovers: dict[str, int]
    pool: dict[str, Any] | None = None
    tasks_available: int | None = None
    run_id: str = ""
