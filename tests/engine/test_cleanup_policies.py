"""Registry hooks from a third-party plugin, the periodic hooks, and the built-in cleanup policies."""

from __future__ import annotations

import types

import trio

from lowwater import InterceptTable
from lowwater.cleanup import InterceptSweep, MallocTrim, RssSampling
from lowwater.hookspecs import hookimpl
from lowwater.memory import MemoryRecord
from lowwater.plugins import load


class ThirdParty:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.policy = types.SimpleNamespace(step_end=self._policy_step_end)

    async def _policy_step_end(self, step, shard_ids):
        self.calls.append(f"policy-step:{step}:{len(shard_ids)}")

    @hookimpl
    def register_protocols(self, register):
        register(types.SimpleNamespace(name="acme.chat", path="/v1/acme"))

    @hookimpl
    def register_runtimes(self, register):
        register("acme-sandbox", lambda config: None)

    @hookimpl
    def register_cleanup_policies(self, register):
        register("acme-drain", self.policy)

    @hookimpl
    async def step_end(self, step, shard_ids):
        self.calls.append(f"step:{step}")

    @hookimpl
    async def worker_tick(self, stats):
        self.calls.append(f"tick:{stats['in_flight']}")

    @hookimpl
    async def shutdown(self):
        self.calls.append("shutdown")


def test_third_party_registries_and_periodic_hooks():
    plugin = ThirdParty()
    p = load(disabled=(), extra=[("acme", plugin)])
    assert p.protocols["acme.chat"].path == "/v1/acme"
    assert "acme-sandbox" in p.runtimes and "acme-drain" in p.cleanup_policies
    info = next(i for i in p.infos if i.name == "acme")
    assert set(info.hooks) == {
        "register_protocols",
        "register_runtimes",
        "register_cleanup_policies",
        "step_end",
        "worker_tick",
        "shutdown",
    }

    async def main():
        await p.fire("step_end", step=3, shard_ids=["a", "b"])
        await p.fire("worker_tick", stats={"in_flight": 2, "rss_bytes": 1 << 20})
        await p.fire("shutdown")

    trio.run(main)
    assert plugin.calls == ["step:3", "policy-step:3:2", "tick:2", "shutdown"]


def test_intercept_sweep_discards_stale_intercepts_on_tick():
    table = InterceptTable()
    table.open_rollout("r")
    table.insert("q1", "r", b"x" * 100, protocol="openai.chat", stream=False)
    policy = InterceptSweep(stale_after_s=0.0)

    async def main():
        await trio.sleep(0.01)
        await policy.worker_tick({"intercept_table": table})

    trio.run(main)
    assert len(table) == 0 and policy.swept == 1


def test_builtin_policies_leave_rollout_structures_to_the_engine():
    # The engine is the one owner of slots and trajectories: no built-in
    # policy acts at rollout_end except the allocator trim.
    p = load(disabled=())
    acting = {name for name, policy in p.cleanup_policies.items() if callable(getattr(policy, "rollout_end", None))}
    assert acting == {"malloc-trim"}


def test_rss_sampling_and_bounded_record():
    record = MemoryRecord(baseline_bytes=100, max_samples=8)
    policy = RssSampling()

    async def main():
        for i in range(100):
            await policy.worker_tick({"memory_record": record, "rss_bytes": 1000 + i, "finished": i})

    trio.run(main)
    assert 4 <= len(record.samples) <= 8  # bounded, downsampled
    assert record.peak_bytes == 1099 and record.last_bytes == 1099
    assert record.summary()["rss_baseline_mb"] == round(100 / (1 << 20), 2)


def test_malloc_trim_policy_runs_off_loop_and_rate_limits():
    policy = MallocTrim(min_interval_s=3600)

    async def main():
        await policy.rollout_end(None)
        await policy.group_end(None)
        await policy.step_end(1, [])

    trio.run(main)
    from lowwater.memory import malloc_trim_available

    assert policy.trimmer.calls == (1 if malloc_trim_available() else 0)
    trio.run(policy.shutdown)  # shutdown always trims (no rate limit)
    assert policy.trimmer.calls == (2 if malloc_trim_available() else 0)
