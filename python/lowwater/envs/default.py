"""The embedded default environment: seeded multi-step arithmetic with a calculator.

No network and no data files: tasks come from :mod:`lowwater.envs.arithmetic`
(a pure function of ``(seed, index)``), the agent solves them over several
turns with the ``calculator`` tool, and the rubric compares the final
``A: N`` line with the reference numerically.  Both harnesses are offered:
in-process (:mod:`lowwater.envs.agent`) and program
(:mod:`lowwater.envs.agent_program`, run inside the rollout's runtime).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lowwater.environment import Environment, HarnessContext, Score, Task
from lowwater.envs import agent
from lowwater.envs.answers import final_answer, same_number
from lowwater.envs.arithmetic import problem
from lowwater.rollout import Rollout, RolloutFailed

AGENT_PROGRAM = Path(__file__).with_name("agent_program.py")


async def run_program_agent(ctx: HarnessContext, timeout_s: float | None = None) -> str:
    """Run :mod:`lowwater.envs.agent_program` in the rollout's runtime; its final text.

    On a persistent runtime the program runs in the runtime's warm worker
    (its ``main(argv)``, with the slot's ``OPENAI_*``/``ANTHROPIC_*``
    variables applied for the call): the SDK is imported once per runtime,
    not once per rollout.  On an ephemeral runtime it is a fresh process,
    as a third-party agent CLI would be.

    Raises:
        RolloutFailed: ``model`` class when the program fails.
    """
    from lowwater.runtime import ScriptError

    runtime = await ctx.runtime()
    question_file = runtime.workdir / "question.txt"
    question_file.write_text(ctx.task.prompt, encoding="utf-8")
    env = ctx.program_env() | {"LOWWATER_MODEL": ctx.model, "LOWWATER_MAX_TURNS": str(ctx.max_turns)}
    if getattr(getattr(runtime, "config", None), "persistent", False):
        try:
            return await runtime.run_script(
                str(AGENT_PROGRAM), [str(question_file)], env=env, warm=True, timeout=timeout_s
            )
        except ScriptError as exc:
            raise RolloutFailed("model", f"agent program failed: {str(exc)[-300:]}") from None
    result = await runtime.run([sys.executable, str(AGENT_PROGRAM), str(question_file)], env=env, timeout=timeout_s)
    stdout = result.stdout.decode() if isinstance(result.stdout, bytes) else result.stdout
    if result.exit_code != 0:
        stderr = result.stderr.decode(errors="replace") if isinstance(result.stderr, bytes) else result.stderr
        raise RolloutFailed("model", f"agent program exited {result.exit_code}: {stderr.strip()[-300:]}")
    return stdout


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

    def task(self, task_id: str | int) -> Task:
        """Direct lookup: a task is a pure function of ``(seed, index)``."""
        index = int(task_id)
        if not 0 <= index < self.size:
            raise KeyError(f"arithmetic has no task {task_id!r} (size {self.size})")
        p = problem(self.seed, index)
        return Task(index, p.question, p.answer, {"env_task_id": p.task_id})

    async def harness(self, ctx: HarnessContext) -> None:
        if ctx.harness == "program":
            text = await run_program_agent(ctx)
        else:
            text = await agent.chat_tool_loop(
                ctx.http, ctx.base_url, ctx.api_key, ctx.task.prompt, model=ctx.model, max_turns=ctx.max_turns
            )
        ctx.rollout.state["final_text"] = text

    async def score(self, rollout: Rollout) -> Score:
        answer = final_answer(rollout.state.get("final_text"))
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
