"""One session that cannot be written is reported; the others are exported or dumped.

A session whose interactions nest deeper than orjson writes (255 levels)
made an export fail after every session it named had been removed, and made
the stale pass stop, leaving the sessions popped after it undumped.
"""

from __future__ import annotations

import orjson
import pytest
import trio

from lowwater.trainer.sessions import Interaction, SessionConfig, SessionStore, load_dump


def _deep(levels: int) -> list:
    value: list = []
    for _ in range(levels - 1):
        value = [value]
    return value


def _store(**config) -> tuple[SessionStore, dict]:
    clock = {"now": 0.0}
    store = SessionStore(SessionConfig(**config), clock=lambda: clock["now"])
    for sid in ("good-1", "bad", "good-2"):
        store.start_session(group_id="g", session_id=sid)
        content = _deep(300) if sid == "bad" else f"hello from {sid}"
        store.add_interaction(sid, Interaction([{"role": "user", "content": content}], {"content": "ok"}))
    return store, clock


def test_export_removes_exactly_the_sessions_it_returns():
    store, _ = _store()
    for sid in ("good-1", "bad", "good-2"):
        store.set_reward(sid, 1.0)
    result = store.export_encoded(["good-1", "bad", "good-2", "good-1"], 0.5, "individual")
    assert result.exported == ("good-1", "good-2")
    assert list(result.failed) == ["bad"] and "Recursion" in result.failed["bad"]
    assert [orjson.loads(r)["session_id"] for r in result.records] == ["good-1", "good-2"]
    # The failing session is back, ready, with its key; the exported ones are gone.
    assert "bad" in store and "good-1" not in store and "good-2" not in store
    assert store.ready() == ["bad"] and store.stats()["keys"] == 1


@pytest.mark.parametrize("discount", ["x", None, [1], True, float("nan"), 0, 1.5, {"a": 1}])
def test_export_refuses_a_mistyped_discount_with_value_error(discount):
    store, _ = _store()
    store.set_reward("good-1", 1.0)
    with pytest.raises(ValueError, match="discount"):
        store.export(["good-1"], discount)
    assert "good-1" in store


@pytest.mark.parametrize("style", [None, 1, ["individual"], {"a": 1}, "zip"])
def test_export_refuses_a_mistyped_style_with_value_error(style):
    store, _ = _store()
    store.set_reward("good-1", 1.0)
    with pytest.raises(ValueError, match="style"):
        store.export(["good-1"], 1.0, style)


def test_stale_pass_dumps_every_session_it_can(tmp_path):
    store, clock = _store(session_timeout_s=10, dump_dir=tmp_path)
    clock["now"] = 100.0
    report = trio.run(store.cleanup_pass)
    assert report.removed == ("good-1", "bad", "good-2") and report.dump_failures == ("bad",)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good-1.json", "good-2.json"]
    assert load_dump(tmp_path / "good-2.json")["session_id"] == "good-2"
    assert len(store) == 0
