"""Session store: a Hypothesis state machine against a model, and the cleanup loop."""

from __future__ import annotations

import math
import os
import stat
import tempfile
from pathlib import Path

import hypothesis.strategies as st
import pytest
import trio
import trio.testing
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lowwater.trainer.sessions import (
    Interaction,
    SessionConfig,
    SessionConflict,
    SessionError,
    SessionStore,
    UnknownSession,
    load_dump,
)

TIMEOUT = 100.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SessionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.clock = Clock()
        self.freed: list[str] = []
        self.dump = True
        self.store = self._store()
        # model: session id -> {"key", "group", "items": [...], "reward", "active", "shards"}
        self.model: dict[str, dict] = {}
        self.revoked: list[str] = []
        self.counter = 0

    def _store(self) -> SessionStore:
        config = SessionConfig(
            session_timeout_s=TIMEOUT, cleanup_interval_s=1, dump_dir=Path(self.tmp.name) if self.dump else None
        )
        store = SessionStore(config, clock=self.clock, free_shards=lambda ids: self.freed.extend(ids) or len(ids))
        if hasattr(self, "store"):
            # Carry the sessions over (the same store object, new config).
            store._sessions, store._by_key = self.store._sessions, self.store._by_key
        return store

    def teardown(self) -> None:
        self.tmp.cleanup()

    @rule(group=st.sampled_from(["g0", "g1", None]))
    def start(self, group):
        self.counter += 1
        sid, key = self.store.start_session(group_id=group, session_id=f"s{self.counter}")
        assert sid == f"s{self.counter}"
        self.model[sid] = {
            "key": key,
            "group": group or sid,
            "items": [],
            "reward": None,
            "active": self.clock.now,
            "shards": set(),
        }

    @precondition(lambda self: self.model)
    @rule(data=st.data(), text=st.text(max_size=20), ntok=st.integers(0, 4))
    def chat(self, data, text, ntok):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        m = self.model[sid]
        tokens = list(range(ntok))
        if m["reward"] is not None:
            with pytest.raises(SessionConflict):
                self.store.add_interaction(sid, Interaction({"role": "user", "content": text}, {"content": text}))
            return
        assert self.store.session_for_key(m["key"]) == sid
        self.store.add_interaction(
            sid, Interaction({"role": "user", "content": text}, {"content": text[::-1]}, tokens, [-0.5] * ntok)
        )
        m["items"].append((text, tokens))
        m["active"] = self.clock.now
        if ntok:
            shard = f"{sid}/shard{len(m['items'])}"
            self.store.attach_shards(sid, [shard])
            m["shards"].add(shard)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), reward=st.sampled_from([0.0, 1.0, 0.5]), twice=st.booleans())
    def reward(self, data, reward, twice):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        m = self.model[sid]
        if m["reward"] is not None and m["reward"] != reward:
            with pytest.raises(SessionConflict):
                self.store.set_reward(sid, reward)
            return
        self.store.set_reward(sid, reward)
        if twice:
            self.store.set_reward(sid, reward)  # idempotent
        m["reward"] = reward
        m["active"] = self.clock.now

    @precondition(lambda self: any(m["reward"] is not None for m in self.model.values()))
    @rule(data=st.data(), discount=st.sampled_from([1.0, 0.9, 0.5]), style=st.sampled_from(["individual", "concat"]))
    def export(self, data, discount, style):
        ready = sorted(s for s, m in self.model.items() if m["reward"] is not None)
        chosen = data.draw(st.lists(st.sampled_from(ready), min_size=1, unique=True))
        out = self.store.export(chosen, discount=discount, style=style)
        expected_records = []
        for sid in chosen:
            m = self.model.pop(sid)
            self.revoked.append(m["key"])
            n = len(m["items"])
            if style == "concat":
                expected_records.append((sid, m["reward"], [t for _, toks in m["items"] for t in toks]))
            else:
                for k, (text, toks) in enumerate(m["items"]):
                    # The discount is applied exactly once, from the raw reward.
                    expected_records.append((sid, m["reward"] * discount ** (n - 1 - k), text, toks))
            assert set(m["shards"]) <= set(self.freed)
        if style == "concat":
            got = [(r["session_id"], r["reward"], r["token_ids"]) for r in out]
        else:
            got = [(r["session_id"], r["reward"], r["request"]["content"], r["token_ids"]) for r in out]
        assert len(got) == len(expected_records)
        for g, e in zip(got, expected_records):
            assert g[0] == e[0] and math.isclose(g[1], e[1]) and g[2:] == e[2:]

    @precondition(lambda self: any(m["reward"] is None for m in self.model.values()))
    @rule(data=st.data())
    def export_not_ready_is_refused(self, data):
        sid = data.draw(st.sampled_from(sorted(s for s, m in self.model.items() if m["reward"] is None)))
        with pytest.raises(SessionConflict):
            self.store.export([sid])
        assert sid in self.store

    @rule(dt=st.sampled_from([1.0, 40.0, 90.0, 150.0]))
    def advance(self, dt):
        self.clock.now += dt

    @rule()
    def toggle_dump(self):
        self.dump = not self.dump
        self.store = self._store()

    @rule()
    def stale_pass(self):
        report = trio.run(self.store.cleanup_pass)
        expected = sorted(s for s, m in self.model.items() if m["active"] < self.clock.now - TIMEOUT)
        assert sorted(report.removed) == expected
        for sid in expected:
            m = self.model.pop(sid)
            self.revoked.append(m["key"])
            assert set(m["shards"]) <= set(self.freed)
            if self.dump:
                dumped = load_dump(Path(self.tmp.name) / f"{sid}.json")
                assert [(i["request"]["content"], i["token_ids"]) for i in dumped["interactions"]] == m["items"]
                assert dumped["reward"] == m["reward"]
                mode = stat.S_IMODE(os.stat(Path(self.tmp.name) / f"{sid}.json").st_mode)
                assert mode == 0o600
        assert len(report.dumped) == (len(expected) if self.dump else 0)

    @invariant()
    def matches_model(self):
        assert len(self.store) == len(self.model)
        stats = self.store.stats()
        assert stats["sessions"] == stats["keys"] == len(self.model)
        assert stats["interactions"] == sum(len(m["items"]) for m in self.model.values())
        assert sorted(self.store.ready()) == sorted(s for s, m in self.model.items() if m["reward"] is not None)
        for key in self.revoked[-5:]:
            assert self.store.session_for_key(key) is None


TestSessionMachine = SessionMachine.TestCase
TestSessionMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_config_is_validated():
    with pytest.raises(ValueError, match="session_timeout_s"):
        SessionConfig(session_timeout_s=0)
    with pytest.raises(ValueError, match="cleanup_interval_s"):
        SessionConfig(cleanup_interval_s=-1)
    with pytest.raises(ValueError, match="cleanup_interval_s"):
        SessionConfig(cleanup_interval_s=float("nan"))


def test_dump_failure_still_frees_the_session(tmp_path):
    clock = Clock()
    freed = []
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the dump dir should be")
    store = SessionStore(
        SessionConfig(session_timeout_s=10, dump_dir=blocker),
        clock=clock,
        free_shards=lambda ids: freed.extend(ids) or len(ids),
    )
    sid, key = store.start_session()
    store.add_interaction(sid, Interaction({"content": "hi"}, {"content": "yo"}, [1, 2], [-1.0, -2.0]))
    store.attach_shards(sid, ["a", "b"])
    clock.now = 100
    report = trio.run(store.cleanup_pass)
    assert report.removed == (sid,) and report.dump_failures == (sid,) and report.dumped == ()
    assert report.shards_freed == 2 and sorted(freed) == ["a", "b"]
    assert len(store) == 0 and store.session_for_key(key) is None


def test_cleanup_loop_runs_on_schedule_and_survives_a_failing_pass(tmp_path, caplog):
    async def main():
        store = SessionStore(
            SessionConfig(session_timeout_s=0.01, cleanup_interval_s=0.01, dump_dir=tmp_path), clock=trio.current_time
        )
        calls = {"n": 0}
        real = store.cleanup_pass

        async def flaky():
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("disk on fire")
            return await real()

        store.cleanup_pass = flaky
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run_cleanup)
            sid, _ = store.start_session()
            with trio.fail_after(30):  # the retried pass must close it; fail here, not at pytest's 600 s
                while sid in store:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        assert calls["n"] >= 2
        assert (tmp_path / f"{sid}.json").exists()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert "disk on fire" in caplog.text


def test_bad_arguments():
    store = SessionStore()
    sid, _ = store.start_session()
    with pytest.raises(ValueError):
        store.set_reward(sid, float("inf"))
    store.set_reward(sid, 1.0)
    with pytest.raises(ValueError):
        store.export([sid], discount=0)
    with pytest.raises(ValueError):
        store.export([sid], style="zip")
    # Each refusal has its own class (the proxy answers 404 or 409 by class), all SessionErrors.
    for call in (
        lambda: store.export(["nope"]),
        lambda: store.set_reward("nope", 1.0),
        lambda: store.add_interaction("nope", Interaction({}, {})),
    ):
        with pytest.raises(UnknownSession):
            call()
    with pytest.raises(SessionConflict):
        store.start_session(session_id=sid)
    with pytest.raises(SessionConflict):
        store.set_reward(sid, 0.5)
    assert issubclass(UnknownSession, SessionError) and issubclass(SessionConflict, SessionError)
    assert store.export([sid]) == []
    assert len(store) == 0
