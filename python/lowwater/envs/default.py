"""The embedded default environment: seeded multi-step arithmetic with a calculator.

No network and no data files: tasks come from :mod:`lowwater.envs.arithmetic`
(a pure function of ``(seed, index)``), the agent solves them over several
turns with the ``calculator`` tool, and the rubric compares the final
``A: N`` line with the reference numerically.  Both harnesses are offered,
through the public helpers of :mod:`lowwater.harness` that any plugin may
use (the GSM8K plugin does): in-process and program.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lowwater.environment import Environment, EnvOption, HarnessContext, Score, Task
from lowwater.envs.arithmetic import problem
from lowwater.harness import final_answer, run_calculator_agent, same_number
from lowwater.rollout import Rollout


class ArithmeticEnvironment(Environment):
    """Seeded arithmetic word problems solved with a calculator tool.

    Args:
        seed: the taskset's seed (tasks are reproducible from it).
        size: number of tasks.
    """

    name = "arithmetic"

    def __init__(self, seed: int = 0, size: int = 64) -> None:
        if size < 1:
            raise ValueError("size must be >= 1")
        self.seed = seed
        self.size = size

    def tasks(self) -> Iterator[Task]:
        for index in range(self.size):
            yield self.task(index)

    def task_count(self) -> int:
        return self.size

    def task(self, task_id: str | int) -> Task:
        """Direct lookup: a task is a pure function of ``(seed, index)``."""
        index = int(task_id)
        if not 0 <= index < self.size:
            raise KeyError(f"arithmetic has no task {task_id!r} (size {self.size})")
        p = problem(self.seed, index)
        return Task(index, p.question, p.answer, {"env_task_id": p.task_id})

    async def harness(self, ctx: HarnessContext) -> None:
        ctx.rollout.state["final_text"] = await run_calculator_agent(ctx)

    async def score(self, rollout: Rollout) -> Score:
        # --program agents leave their last JSON line in state["answer"]: a
        # final text ("... A: 42"), or the bare answer ("42", 42).
        text = rollout.state.get("final_text")
        if text is None and "answer" in rollout.state:
            given = rollout.state["answer"]
            text = given if isinstance(given, str) and final_answer(given) else f"A: {given}"
        answer = final_answer(text)
        if answer is None:
            return Score(0.0, {"correct": False, "answer": None})
        correct = same_number(answer, rollout.task.answer)
        return Score(1.0 if correct else 0.0, {"correct": correct, "answer": answer})


def make(options: dict[str, Any]) -> ArithmeticEnvironment:
    """Factory for ``register_environments``: options ``seed`` and ``size`` (ints).

    Raises:
        ValueError: an option is not an int, or ``size < 1``.
    """
    return ArithmeticEnvironment(int(options.get("seed", 0)), int(options.get("size", 64)))


# A function attribute is how a factory declares its options (docs/plugins.md); mypy does not model those.
make.options = {  # type: ignore[attr-defined]
    "seed": EnvOption(0, "the taskset's seed: tasks are a pure function of (seed, index)"),
    "size": EnvOption(64, "number of tasks in the taskset"),
}
