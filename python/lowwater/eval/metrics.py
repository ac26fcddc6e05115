"""Summary statistics of an eval: accuracy with its standard error and 95 %
interval, pass@k and pass^k over groups, and the most common error messages.

pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large
Language Models Trained on Code", eq. 1): with ``n`` samples of a task of
which ``c`` are correct, ``1 - C(n-c, k) / C(n, k)``, computed as a product
so large ``n`` neither overflows nor loses precision.  pass^k (Yao et al.
2024, tau-bench) is the chance that ``k`` samples are *all* correct,
``C(c, k) / C(n, k)``; pass^1 equals pass@1, the mean per-task success.

The standard error treats tasks as clusters (a task's samples are not
independent of each other): the sample standard deviation of per-task mean
correctness over the square root of the number of tasks.  With one sample
per task this is the familiar ``sqrt(p (1 - p) / (n - 1))``.  The 95 %
interval is ``accuracy +- 1.96 SE``, clipped to [0, 1].
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from typing import Any

#: Distinct error messages counted; later ones are counted together (the
#: counter must not grow with the run: messages often embed ids).
MAX_MESSAGES = 256
#: Characters of a message kept (the rest is rarely what tells errors apart).
MESSAGE_CHARS = 200
OTHER = "(other messages)"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task: ``n`` samples, ``c`` correct.

    Raises:
        ValueError: ``k > n``, ``c > n`` or a negative count.
    """
    _check(n, c, k)
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_hat_k(n: int, c: int, k: int) -> float:
    """pass^k of one task: the chance that ``k`` of its ``n`` samples, drawn
    without replacement, are all correct (``c`` correct).

    Raises:
        ValueError: ``k > n``, ``c > n`` or a negative count.
    """
    _check(n, c, k)
    if c < k:
        return 0.0
    return math.prod((c - i) / (n - i) for i in range(k))


def _check(n: int, c: int, k: int) -> None:
    if min(n, c, k) < 0 or c > n or k > n or k < 1:
        raise ValueError(f"need 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")


def clustered_stderr(means: Iterable[float]) -> float | None:
    """Standard error of the mean of per-task means (``None`` under two tasks)."""
    values = list(means)
    t = len(values)
    if t < 2:
        return None
    mean = sum(values) / t
    variance = sum((v - mean) ** 2 for v in values) / (t - 1)
    return math.sqrt(variance / t)


def binary_stderr(n: int, correct: int) -> float | None:
    """Standard error of a proportion over ``n`` independent samples (``None`` under two)."""
    if n < 2:
        return None
    p = correct / n
    return math.sqrt(p * (1 - p) / (n - 1))


def interval95(mean: float, stderr: float | None) -> list[float] | None:
    """``[low, high]``: ``mean +- 1.96 stderr`` clipped to [0, 1] (``None`` without a stderr)."""
    if stderr is None:
        return None
    return [round(max(0.0, mean - 1.96 * stderr), 6), round(min(1.0, mean + 1.96 * stderr), 6)]


class TaskCounts:
    """Samples and correct samples per task (two ints each): what pass@k
    and the clustered standard error need, kept only for groups."""

    def __init__(self) -> None:
        self.counts: dict[Any, list[int]] = {}

    def add(self, task_id: Any, correct: bool) -> None:
        entry = self.counts.setdefault(task_id, [0, 0])
        entry[0] += 1
        entry[1] += bool(correct)

    def pass_at(self, k: int) -> float | None:
        """Mean pass@k over tasks with at least ``k`` samples (``None``: none has)."""
        scores = [pass_at_k(n, c, k) for n, c in self.counts.values() if n >= k]
        return sum(scores) / len(scores) if scores else None

    def pass_hat(self, k: int) -> float | None:
        """Mean pass^k over tasks with at least ``k`` samples (``None``: none has)."""
        scores = [pass_hat_k(n, c, k) for n, c in self.counts.values() if n >= k]
        return sum(scores) / len(scores) if scores else None

    def stderr(self) -> float | None:
        return clustered_stderr(c / n for n, c in self.counts.values())

    def __len__(self) -> int:
        return len(self.counts)


class ErrorMessages:
    """The most common error messages by class, in bounded memory."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()

    def add(self, cls: str, message: str) -> None:
        key = (cls, (message or "").strip()[:MESSAGE_CHARS])
        if key not in self.counts and len(self.counts) >= MAX_MESSAGES:
            key = (cls, OTHER)
        self.counts[key] += 1

    def top(self, n: int = 5) -> list[dict[str, Any]]:
        """The ``n`` most common as ``{"class", "message", "count"}``."""
        return [{"class": c, "message": m, "count": k} for (c, m), k in self.counts.most_common(n)]
