"""``lowwater proxy --sessions``: rollouts as sessions of the session store,
rewards, export with a discount, and the scheduled stale cleanup (keys
revoked, dumped, rollout closed, nothing left)."""

from __future__ import annotations

import argparse
import stat

import orjson
import pytest
import trio

from lowwater import cli
from lowwater.commands import proxy
from lowwater.commands.proxy import config_from_args
from lowwater.trainer.sessions import SessionConfig, load_dump

from ._harness import body
from ._proxy import with_proxy
from .test_failures import until


async def _with_proxy(tmp_path, fn, sessions: SessionConfig | None):
    """``fn(url, http)`` against a proxy with ``sessions``; ``http`` sends the admin key on every
    request (a rollout's own key goes first, so model calls still use it)."""
    await with_proxy(tmp_path, fn, sessions=sessions)


async def _call(http, opened, text="what is 2 plus 2", history=None):
    r = await http.post(
        opened["base_url"] + "/chat/completions",
        json=body("chat", text, history=history),
        headers={"authorization": f"Bearer {opened['api_key']}"},
    )
    return r.status_code


def test_reward_and_export_with_discount(tmp_path):
    async def fn(url, http):
        opened = (await http.post(f"{url}/lowwater/rollouts", json={"rollout_id": "s1", "group_id": "g"})).json()
        assert await _call(http, opened, "first") == 200
        history = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "echo: first"}]
        assert await _call(http, opened, "second", history) == 200
        sessions = (await http.get(f"{url}/lowwater/sessions")).json()
        assert sessions["sessions"] == 1 and sessions["interactions"] == 2 and sessions["ready_ids"] == []
        # Not ready yet: refused, nothing removed.
        r = await http.post(f"{url}/lowwater/export", json={"session_ids": ["s1"]})
        assert r.status_code == 409 and "not ready" in r.json()["error"]
        assert (await http.post(f"{url}/lowwater/export", json={"session_ids": ["nope"]})).status_code == 404
        assert (await http.post(f"{url}/lowwater/export", json={"ids": []})).status_code == 400
        assert (await http.post(f"{url}/lowwater/sessions/s1/reward", json={"reward": 2.0})).status_code == 200
        assert (await http.post(f"{url}/lowwater/sessions/s1/reward", json={"reward": 2.0})).status_code == 200
        assert (await http.post(f"{url}/lowwater/sessions/s1/reward", json={"reward": 1.0})).status_code == 409
        assert (await http.post(f"{url}/lowwater/sessions/s1/reward", json={"reward": "x"})).status_code == 400
        assert (await http.post(f"{url}/lowwater/sessions/zz/reward", json={"reward": 1})).status_code == 404
        assert (await http.delete(f"{url}/lowwater/rollouts/s1")).status_code == 200
        r = await http.post(f"{url}/lowwater/export", json={"session_ids": ["s1"], "discount": 0.5})
        assert r.status_code == 200
        records = r.json()["records"]
        # The discount applied once: the call k steps before the last gets R * d**k.
        assert [rec["reward"] for rec in records] == [1.0, 2.0]
        assert [rec["request"][-1]["content"] for rec in records] == ["first", "second"]
        assert all(rec["group_id"] == "g" and rec["response"]["role"] == "assistant" for rec in records)
        sessions = (await http.get(f"{url}/lowwater/sessions")).json()
        assert sessions == {"sessions": 0, "keys": 0, "ready": 0, "interactions": 0, "ready_ids": []}
        stats = (await http.get(f"{url}/lowwater/stats")).json()
        assert stats["open_rollouts"] == 0 and stats["intercepts"]["entries"] == 0

    trio.run(_with_proxy, tmp_path, fn, SessionConfig())


def test_stale_session_is_revoked_dumped_closed_and_freed(tmp_path):
    dump = tmp_path / "dump"
    config = SessionConfig(session_timeout_s=0.3, cleanup_interval_s=0.1, dump_dir=dump)

    async def fn(url, http):
        opened = (await http.post(f"{url}/lowwater/rollouts", json={"rollout_id": "idle"})).json()
        assert await _call(http, opened) == 200
        # The agent goes away without closing its rollout: the cleanup loop,
        # scheduled at start, removes it.
        await until(lambda: (dump / "idle.json").exists())
        assert await _call(http, opened) == 401  # its key is revoked
        stats = (await http.get(f"{url}/lowwater/stats")).json()
        assert stats["open_rollouts"] == 0 and stats["sessions"]["sessions"] == 0 and stats["sessions"]["keys"] == 0

    trio.run(_with_proxy, tmp_path, fn, config)
    saved = load_dump(dump / "idle.json")
    assert saved["session_id"] == "idle" and len(saved["interactions"]) == 1
    assert stat.S_IMODE((dump / "idle.json").stat().st_mode) == 0o600
    # ...and its trajectory line was written as a DELETE would have.
    (line,) = [orjson.loads(x) for x in (tmp_path / "trajectories.jsonl").read_bytes().splitlines()]
    assert line["rollout_id"] == "idle" and len(line["turns"]) == 1


def test_sessions_off_by_default(tmp_path):
    async def fn(url, http):
        opened = (await http.post(f"{url}/lowwater/rollouts", json={"rollout_id": "t"})).json()
        assert await _call(http, opened) == 200
        r = await http.get(f"{url}/lowwater/sessions")
        assert r.status_code == 404 and "--sessions" in r.json()["error"]
        assert (await http.get(f"{url}/lowwater/stats")).json()["sessions"] is None

    trio.run(_with_proxy, tmp_path, fn, None)


def _args(tmp_path, *extra):
    parser = argparse.ArgumentParser()
    proxy.add_parser(parser.add_subparsers())
    return parser.parse_args(["proxy", "--upstream", "http://127.0.0.1:1/v1", "--out", str(tmp_path), *extra])


def test_session_flags_are_validated(tmp_path):
    config = config_from_args(
        _args(
            tmp_path,
            "--sessions",
            "--session-timeout-s",
            "5",
            "--cleanup-interval-s",
            "1",
            "--dump-dir",
            str(tmp_path / "d"),
        ),
        {},
    )
    assert config.sessions == SessionConfig(5.0, 1.0, tmp_path / "d") and (tmp_path / "d").is_dir()
    assert config_from_args(_args(tmp_path), {}).sessions is None
    for flag in ("--session-timeout-s", "--cleanup-interval-s"):
        for bad in ("0", "-1", "nan"):
            with pytest.raises(cli.UsageError, match=flag.removeprefix("--").replace("-", "[-_]")):
                config_from_args(_args(tmp_path, "--sessions", flag, bad), {})
