"""``lowwater eval``'s configuration: :class:`EvalConfig`, validated with attrs
validators (docs/eval.md lists every field's flag)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from lowwater import _validate as v
from lowwater.assembly import EngineConfig
from lowwater.eval.samples import samples_path


def _tuple(items: Any) -> tuple[Any, ...]:
    return tuple(items)


@attrs.frozen
class EvalConfig(EngineConfig):
    """Everything ``lowwater eval`` takes; the CLI flags map one to one.

    The engine's settings are :class:`~lowwater.assembly.EngineConfig`'s
    fields, inherited (one declaration, one validation); this class adds the
    run's own.

    Attributes:
        env: environment name (``register_environments``).
        env_options: options for the environment's factory (``--data`` ...).
        model: the resolved ``--model``.
        sampling: sampling arguments added to every model call the agent
            makes (``--temperature``, ``--top-p``, ``--max-tokens``, ``-S``);
            a key the agent's request sets itself is left as the agent set it.
        rollouts: tasks to run (``None``: all from ``start`` on).
        start: 0-based position in the taskset of the first task to run
            (``--limit START-END``).
        task_ids: run exactly these tasks, looked up by id (``--task-ids``);
            excludes ``rollouts`` and ``start``.
        group_size: rollouts per task (a group when > 1).
        concurrency: rollouts in flight at once.
        max_turns: model calls per rollout.
        timeout_s: whole-rollout deadline (seconds).
        harness: ``"inprocess"`` or ``"program"``.
        persistent: take runtimes from a pool (reset between uses).
        out: the JSONL results file.
        resume: continue ``out`` instead of refusing to touch it.
        max_attempts: eval runs that may attempt an errored task (``--resume``).
        seed: recorded in the header; environments take it from ``env_options``.
        tick_s: worker-tick cadence (seconds): RSS samples, stale sweeps.
        workers: env worker processes (``--workers``); 0 runs every rollout
            in this process.  With workers, each runs its own interception
            server and engine (see :mod:`lowwater.eval.job`) and the model
            server is shared.
        max_tasks_per_worker, max_rss_mb, high_water_mb: recycling and
            admission settings of the worker pool (see
            :class:`lowwater.workers.WorkerPool`).
        backend: the worker backend the workers run on (``--backend``;
            ``register_backends``): ``"local"`` (this machine) or a
            plugin's (``"ray"``: ``workers`` per node).
        address: the cluster the backend joins (``--address``; ``ray``:
            ``auto`` or ``HOST:PORT``).
        bind, advertise: where the model server this run starts (scripted,
            replay) binds and the host its URL names (``--bind``,
            ``--advertise``); beyond loopback it needs ``LOWWATER_ADMIN_KEY``,
            which the workers then send.  A remote backend (``ray``) refuses
            a model server its workers cannot reach.
        pass_env: host variables passed to agent programs and scripts beyond
            the runtime's allow-list (``--pass-env``).
        samples: write every rollout's transcript to :attr:`samples_path`
            (``--no-samples`` turns it off).
        max_error_rate: the share of rollouts (0 to 1) that may end in an
            error before ``lowwater eval`` exits non-zero.
        runtime: the runtime's registered name (``--runtime``; ``None``: the
            environment's, else ``"subprocess"``; :mod:`lowwater.runtime_choice`).
        runtime_options: its options (``--runtime-option KEY=VALUE``).
        program: the agent program's command line with ``harness="program"``
            (``--program``; :mod:`lowwater.program_harness`).

    Raises:
        ValueError: a setting out of range (the message names its flag).
    """

    rollouts: int | None = attrs.field(default=None, validator=v.optional(v.at_least(0, "rollouts")))
    start: int = attrs.field(default=0, validator=v.at_least(0, "limit start"))
    task_ids: tuple[Any, ...] | None = attrs.field(default=None, converter=attrs.converters.optional(_tuple))
    out: Path = Path("runs/results.jsonl")
    resume: bool = False
    max_attempts: int = attrs.field(default=3, validator=v.at_least(1, "max-attempts"))
    seed: int = 0
    tick_s: float = attrs.field(default=1.0, validator=v.positive("tick", "seconds"))
    workers: int = attrs.field(default=0, validator=v.at_least(0))
    backend: str = attrs.field(default="local", validator=v.backend_needs_workers("--backend {}", "--workers K"))
    address: str | None = None
    bind: str = "127.0.0.1"
    advertise: str | None = None
    max_tasks_per_worker: int | None = attrs.field(
        default=500, validator=v.optional(v.at_least(1, "max-tasks-per-worker"))
    )
    max_rss_mb: float | None = attrs.field(default=None, validator=v.optional(v.positive("max-rss-mb")))
    high_water_mb: float | None = attrs.field(default=None, validator=v.optional(v.positive("high-water-mb")))
    samples: bool = True
    max_error_rate: float = attrs.field(default=0.0)

    @max_error_rate.validator
    def _check_rate(self, _attribute: Any, value: float) -> None:
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"max-error-rate must be between 0 and 1, not {value!r}")

    @property
    def samples_path(self) -> Path | None:
        """The samples file beside :attr:`out` (``None`` with ``samples=False``)."""
        return samples_path(self.out) if self.samples else None

    def engine(self) -> EngineConfig:
        """The settings that define this run's engines (here or in each worker):
        the :class:`EngineConfig` fields this config inherits, already validated."""
        return EngineConfig(**{f.name: getattr(self, f.name) for f in attrs.fields(EngineConfig)})
