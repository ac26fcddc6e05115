"""Every lowwater hook, documented in one place.

lowwater is one pluggy project, ``"lowwater"``, with one entry-point group,
``lowwater``.  Its own runtime, protocols, environments and cleanup policies
are ordinary plugins registered through that group (as pytest's built-in
features are), so plugin discovery runs on every start.

A plugin is a module (or object) with functions decorated by
:data:`hookimpl` whose names and parameters match the specs below; a plugin
may accept any subset of a spec's parameters.  ``docs/plugins.md`` is the
tutorial; ``tests/engine/test_hookspecs.py`` fails for a spec that is not
documented there or not tested.

Two kinds of hooks:

* **Registries** (sync): called once when the plugin manager is built; the
  plugin calls ``register(...)`` for each thing it provides.
* **Lifecycle hooks** (async): awaited by the engine at a lifecycle point.
  Every implementation of one point runs concurrently in a Trio nursery; an
  exception in one is logged with the plugin's name and does not stop the
  others or the rollout (cleanup must not be skipped because a sibling
  failed).  A sync implementation of an async spec, or an async
  implementation of a sync spec, is refused at registration with
  :class:`lowwater.plugins.PluginError`.
* **Interceptors** (async, :data:`ORDERED_HOOKS`): awaited on every
  intercepted model call, one after another in registration order (each may
  change what the next sees), never concurrently; see
  :mod:`lowwater.interception.hooks`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable

PROJECT = "lowwater"

hookspec = pluggy.HookspecMarker(PROJECT)
#: Decorator for a plugin's hook implementations.
hookimpl = pluggy.HookimplMarker(PROJECT)

#: Names of the specs whose implementations must be ``async def``.
ASYNC_HOOKS = frozenset(
    {
        "rollout_start",
        "rollout_end",
        "group_end",
        "step_end",
        "worker_tick",
        "shutdown",
        "intercept_request",
        "intercept_response",
    }
)
#: Async specs awaited in registration order, one at a time, on each model call
#: (:meth:`lowwater.plugins.Plugins.interceptors`), not through ``fire``.
ORDERED_HOOKS = frozenset({"intercept_request", "intercept_response"})


# --- registries -------------------------------------------------------------


@hookspec
def register_runtimes(register: Callable[[str, Any], None]) -> None:
    """Provide runtime factories.

    Call ``register(name, factory)`` for each runtime, where ``factory`` is
    called as ``factory(config: lowwater.runtime.RuntimeConfig)`` and returns
    a :class:`lowwater.runtime.Runtime`.  A name registered twice raises
    :class:`lowwater.plugins.PluginError` naming both plugins.
    Built in: ``"subprocess"``.
    """


@hookspec
def register_protocols(register: Callable[[Any], None]) -> None:
    """Provide wire protocols for the interception server.

    Call ``register(protocol)`` with a
    :class:`lowwater.interception.protocols.Protocol` instance; its ``name``
    must be unique and its ``path`` (such as ``"/v1/chat/completions"``)
    is routed to it.  Built in: ``openai.chat``, ``openai.responses``,
    ``anthropic.messages``.
    """


@hookspec
def register_environments(register: Callable[[str, Any], None]) -> None:
    """Provide environments for ``lowwater eval ENV`` and the trainer API.

    Call ``register(name, factory)`` where ``factory(options: dict[str, Any])``
    returns a :class:`lowwater.environment.Environment` (taskset, harness,
    rubric).  Built in: ``"arithmetic"`` (the embedded default).
    """


@hookspec
def register_cleanup_policies(register: Callable[[str, Any], None]) -> None:
    """Provide cleanup policies.

    Call ``register(name, policy)`` where ``policy`` is an object whose
    ``async`` methods named after lifecycle hooks (``rollout_end``,
    ``group_end``, ``step_end``, ``worker_tick``, ``shutdown``) are awaited at
    those points with the same keyword arguments as the hooks below, after
    the hooks and after the engine evicted the rollout's or group's
    trajectories (policies never evict what the engine owns).
    Built in: ``"intercept-sweep"`` (stale intercepts), ``"malloc-trim"``,
    ``"rss-sampling"``.
    """


@hookspec
def register_backends(register: Callable[[str, Any], None]) -> None:
    """Provide worker backends: where a job's tasks run.

    Call ``register(name, factory)`` where ``factory(options:
    lowwater.workers.backend.BackendOptions)`` returns a
    :class:`lowwater.workers.backend.WorkerBackend`.  ``lowwater eval
    --backend NAME`` and ``TrainerConfig(backend=NAME)`` look it up.
    Built in: ``"local"`` (the :class:`lowwater.workers.WorkerPool` on this
    machine).
    """


@hookspec
def register_shard_transports(register: Callable[[str, Any], None]) -> None:
    """Provide shard transports: how a shard moves from its owner to consumers.

    Call ``register(name, factory)`` where ``factory()`` returns a
    :class:`lowwater.trainer.transport.ShardTransport` for this process; a
    :class:`lowwater.trainer.shards.ShardRef` whose ``transport`` is
    ``name`` is fetched and drained through it.  Built in: ``"http"``.
    """


# --- lifecycle hooks (async) -------------------------------------------------


@hookspec
async def rollout_start(rollout: Any) -> None:
    """A rollout has been admitted and opened (runtime taken, slot registered).

    ``rollout`` is the :class:`lowwater.rollout.Rollout`; its ``trajectory``
    is empty.  Runs before the harness's first turn.
    """


@hookspec
async def rollout_end(rollout: Any) -> None:
    """A rollout has ended, on every exit path (success, error, cancellation,
    deadline), after its own cleanup and after its result row was written.

    ``rollout.error`` is ``None`` or a :class:`lowwater.rollout.RolloutError`.
    Runs shielded under the cleanup deadline: do not block.
    """


@hookspec
async def group_end(group: Any) -> None:
    """Every rollout of a group has ended and the group reward has run.

    ``group`` is the :class:`lowwater.rollout.Group`; its members'
    trajectories are still readable here and are evicted right after.
    """


@hookspec
async def step_end(step: int, shard_ids: list[str]) -> None:
    """A trainer step has ended (trainer API): ``shard_ids`` were cleared.

    Cleanup policies drain per-step state here (fetch buffers, allocator).
    """


@hookspec
async def worker_tick(stats: dict[str, Any]) -> None:
    """Periodic tick of an env worker or of the eval process (about once per
    second).  ``stats`` has ``rss_bytes`` (current RSS), ``in_flight`` and
    ``finished`` (rollouts), ``intercepts`` (the intercept table's stats),
    and the live objects ``intercept_table``
    (:class:`lowwater.InterceptTable`) and ``memory_record``
    (:class:`lowwater.memory.MemoryRecord`) for policies that act on them.
    """


@hookspec
async def shutdown() -> None:
    """The run is ending: tear down pools and release everything held."""


# --- interceptors (async, ordered) ----------------------------------------------


@hookspec
async def intercept_request(call: Any) -> None:
    """An agent's model call, before it is forwarded upstream.

    ``call`` is a :class:`lowwater.interception.hooks.InterceptedCall`:
    ``rollout_id``, ``protocol`` (``"openai.chat"``, ...), ``body``, the
    parsed request as a mutable dict, and ``headers``, the agent's request
    headers as a read-only mapping (lower-case names; never the rollout's
    secret).  Change ``body`` in place (redact,
    add sampling parameters, ask for logprobs): what the last interceptor
    leaves is what is sent upstream and recorded as the turn.  Raise
    :class:`lowwater.interception.Reject` ``(status, message)`` to refuse the
    call: the agent gets that status with an error body of the call's
    protocol.  Any other exception refuses it with 500 naming the plugin
    (fail closed: a redactor that crashed must not let the call through).
    Awaited in registration order, one at a time.
    """


@hookspec
async def intercept_response(call: Any, response: Any) -> None:
    """A model call's complete answer (for a stream: accumulated), before the
    agent receives its end.

    ``response`` is a read-only
    :class:`lowwater.interception.hooks.InterceptedResponse` (``completion``,
    ``finish_reason``, ``usage``, ``token_ids``, ``logprobs`` when present).
    ``call`` is the request's :class:`~lowwater.interception.hooks.InterceptedCall`.
    For metering and logging: an exception is logged with the plugin's name
    and the answer is delivered.  Not called when the upstream failed.
    """
