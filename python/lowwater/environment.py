"""Tasks, environments and the harness context.

An **environment** is a plugin (``register_environments``) that supplies a
taskset (tasks yielded lazily, never a whole dataset per worker), a harness
(how the agent runs: an in-process coroutine or a program inside a runtime)
and a rubric (a per-rollout score, optionally a group reward).

Environments use these types, :class:`lowwater.rollout.Rollout` and the
helpers of :mod:`lowwater.harness`; nothing else of lowwater's runtime.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:  # pragma: no cover
    import os

    import httpx

    from lowwater.rollout import Group, Rollout
    from lowwater.runtime import Runtime

HARNESSES = ("inprocess", "program")


@attrs.frozen
class Task:
    """One dataset row.

    Attributes:
        id: stable id: the 0-based row index of the dataset file, or the
            environment's own id.  Results and ``--resume`` key on it.
        prompt: what the agent is asked.
        answer: the reference answer the rubric compares with.
        metadata: anything else the environment needs (read-only).
    """

    id: str | int
    prompt: str
    answer: str = ""
    metadata: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class EnvOption:
    """One option an environment factory takes (``--env-option NAME=VALUE``).

    A factory declares its options with an ``options`` attribute mapping
    each name to an :class:`EnvOption`; ``lowwater envs`` lists them and
    ``lowwater eval`` refuses ``--env-option`` keys not declared (the
    ``seed`` every run passes is always accepted).  Factories without an
    ``options`` attribute accept any key, as before::

        def make(options):
            return MyEnvironment(int(options.get("size", 10)))

        make.options = {"size": EnvOption(10, "number of tasks")}

    Attributes:
        default: the value used when the option is not given (``None``: none).
        help: one line saying what the option does, with its unit.
        required: the factory refuses to build without it.
    """

    default: Any = None
    help: str = ""
    required: bool = False


def declared_options(factory: Any) -> Mapping[str, EnvOption] | None:
    """The options ``factory`` declares (its ``options`` attribute), or
    ``None`` when it declares none (any key is then accepted)."""
    options = getattr(factory, "options", None)
    return options if isinstance(options, Mapping) else None


@attrs.frozen
class Score:
    """A rubric's verdict on one rollout: ``reward`` (float) and ``metrics``
    (JSON-serialisable values, such as ``{"correct": True}``)."""

    reward: float
    metrics: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.define(eq=False)
class HarnessContext:
    """What a harness gets for one rollout.

    Attributes:
        task: the task.
        base_url: the rollout's interception slot, ending in ``/v1``.
        api_key: the slot's secret (send as ``Authorization: Bearer``).
        model: the model name to put in requests (the interceptor may map it).
        max_turns: upper bound on model calls the harness should make.
        harness: ``"inprocess"`` or ``"program"``.
        http: the engine's shared ``httpx.AsyncClient`` for in-process calls.
        rollout: the rollout (its ``trajectory`` fills as calls are made).
    """

    task: Task
    base_url: str
    api_key: str
    model: str
    max_turns: int
    harness: str
    http: httpx.AsyncClient
    rollout: Rollout

    async def runtime(self) -> Runtime:
        """The rollout's runtime, acquired on first use and released at close
        (:meth:`lowwater.rollout.Rollout.runtime`).

        Raises:
            lowwater.runtime.RuntimeStartError: it could not be provisioned.
            lowwater.rollout.RolloutFailed: the rollout has no runtime.
        """
        return await self.rollout.runtime()

    async def run_script(
        self,
        script: str | os.PathLike[str],
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> str:
        """Run a script's ``main(argv) -> str`` in the rollout's runtime, warm
        on a persistent runtime: :meth:`lowwater.rollout.Rollout.run_script`."""
        return await self.rollout.run_script(script, args, env=env, timeout=timeout)

    def program_env(self) -> dict[str, str]:
        """Environment variables pointing an agent program at this slot
        (OpenAI and Anthropic SDK conventions)."""
        root = self.base_url.removesuffix("/v1")
        return {
            "OPENAI_BASE_URL": self.base_url,
            "OPENAI_API_KEY": self.api_key,
            "ANTHROPIC_BASE_URL": root,
            "ANTHROPIC_API_KEY": self.api_key,
        }


class Environment:
    """Base class of environments; subclasses override what they provide.

    Methods that are not overridden raise :class:`NotImplementedError`,
    except :meth:`group_reward` (no group reward by default).
    """

    name: str = ""
    #: The runtime this environment's programs and scripts need (a
    #: ``register_runtimes`` name), or ``None``: whatever the run chooses
    #: (``--runtime``; default ``"subprocess"``).  A run naming a different
    #: runtime is refused (:func:`lowwater.runtime_choice.choose_runtime`).
    runtime: str | None = None
    #: Options for that runtime; ``--runtime-option`` overrides them key by key.
    runtime_options: Mapping[str, Any] = MappingProxyType({})

    def tasks(self) -> Iterator[Task]:
        """Yield the taskset lazily, in a stable order."""
        raise NotImplementedError

    def task_count(self) -> int | None:
        """How many tasks :meth:`tasks` yields, when that is known without
        reading the taskset (progress bars show a total then); ``None``
        (the default) when it is not."""
        return None

    def task(self, task_id: str | int) -> Task:
        """The task with ``task_id`` (used to re-run a task from its id alone:
        a worker pool keeps ids, not payloads).  The default scans
        :meth:`tasks`; override it when lookup can be direct.

        Raises:
            KeyError: no such task.
        """
        for task in self.tasks():
            if task.id == task_id:
                return task
        raise KeyError(f"environment {self.name!r} has no task {task_id!r}")

    async def harness(self, ctx: HarnessContext) -> None:
        """Run the agent for ``ctx.task`` until it answers or ``ctx.max_turns``.

        Model calls go through ``ctx.base_url`` and are recorded as turns of
        ``ctx.rollout.trajectory`` by the interception server; the harness
        stores whatever the rubric needs (such as the final answer) in
        ``ctx.rollout.state``, which belongs to the environment alone.
        :mod:`lowwater.harness` has ready-made agents.
        """
        raise NotImplementedError

    async def score(self, rollout: Rollout) -> Score:
        """Score one finished rollout."""
        raise NotImplementedError

    async def group_reward(self, group: Group) -> list[float] | None:
        """Optionally replace the members' rewards once all have been scored
        (for example group-relative advantages).  Return one float per member
        in ``group.rollouts`` order, or ``None`` to keep the rewards."""
        return None

    async def aclose(self) -> None:
        """Release anything the environment holds (called once at run end)."""
