"""Runtimes: where agent programs and scoring scripts execute.

* :class:`Runtime` — the contract (``start``, ``stop``, ``reset``, ``run``,
  ``run_script``, ``workdir``, ``healthy``); plugins subclass it and register
  a factory through ``register_runtimes``.
* :class:`SubprocessRuntime` — the built-in one (``"subprocess"``).
* :class:`RuntimePool` — persistent runtimes keyed by resolved config.
* Warm workers (:mod:`lowwater.runtime.warm`) — ``run_script(warm=True)``.
* :mod:`lowwater.testing.runtime` — the conformance state machine for
  runtime plugins (imports Hypothesis; not imported here).

See ``docs/runtimes.md``.
"""

from lowwater.runtime.base import (
    DEFAULT_ENV_ALLOW,
    OutputLimitExceeded,
    PoolClosed,
    ProgramResult,
    ProgramTimeout,
    Runtime,
    RuntimeConfig,
    RuntimeFailure,
    RuntimeStartError,
    RuntimeStateError,
    ScriptError,
    WarmWorkerCrashed,
    build_env,
)
from lowwater.runtime.pool import RuntimePool
from lowwater.runtime.subprocess import SubprocessRuntime

__all__ = [
    "DEFAULT_ENV_ALLOW",
    "OutputLimitExceeded",
    "PoolClosed",
    "ProgramResult",
    "ProgramTimeout",
    "Runtime",
    "RuntimeConfig",
    "RuntimeFailure",
    "RuntimePool",
    "RuntimeStartError",
    "RuntimeStateError",
    "ScriptError",
    "SubprocessRuntime",
    "WarmWorkerCrashed",
    "build_env",
]
