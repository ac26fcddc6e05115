"""``lowwater proxy`` loads plugins as ``lowwater eval`` does: interceptor hooks
(a redacting and a rejecting one, from a ``LOWWATER_PLUGINS`` module) apply to
every call through the proxy and to what it writes, a rejected call gets the
protocol's error body and its 4xx, plugin protocols are routed, and the
startup lines name the interceptors (never the admin key)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import orjson
import pytest
import trio

from lowwater import cli
from lowwater.hookspecs import hookimpl
from lowwater.http import serve
from lowwater.interception.protocols import OpenAIChat
from lowwater.interception.proxy import ProxyConfig, plugin_summary, serve_proxy
from lowwater.plugins import load

from ._harness import GUARD_S, KINDS, PATHS, body
from ._proxy import proxy_process
from .upstream import Upstream

PLUGINS = Path(__file__).parent / "plugins"
ADMIN = {"x-api-key": "adm"}
SECRET_TEXT = "my session is tok-S3CR3T; what is 2 plus 2"


def lines(tmp_path: Path) -> list[dict]:
    path = tmp_path / "trajectories.jsonl"
    return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


async def _with_proxy(tmp_path: Path, fn, plugins=None) -> None:
    upstream = Upstream()
    async with trio.open_nursery() as nursery:
        address = await nursery.start(serve, upstream)
        config = ProxyConfig(upstream=f"http://{address}/v1", port=0, out_dir=tmp_path, admin_key="adm", retries=0)
        url = await nursery.start(lambda task_status: serve_proxy(config, plugins=plugins, task_status=task_status))
        async with httpx.AsyncClient(timeout=GUARD_S) as http:
            with trio.fail_after(GUARD_S):
                await fn(url, http, upstream)
        nursery.cancel_scope.cancel()


async def _call(http: httpx.AsyncClient, opened: dict, kind: str, payload: dict) -> httpx.Response:
    path = opened["base_url"] + PATHS[kind].removeprefix("/v1")
    return await http.post(path, json=payload, headers={"authorization": f"Bearer {opened['api_key']}"})


@pytest.fixture
def guard(monkeypatch, tmp_path):
    """``LOWWATER_PLUGINS=proxy_guard``, importable, logging its answers to a file."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.setenv("LOWWATER_PLUGINS", "proxy_guard")
    log = tmp_path / "answers.log"
    monkeypatch.setenv("PROXY_GUARD_LOG", str(log))
    return log


def test_interceptors_from_lowwater_plugins_redact_and_reject_through_the_proxy(tmp_path, guard):
    async def fn(url, http, upstream):
        opened = (await http.post(f"{url}/lowwater/rollouts", json={"rollout_id": "r1"}, headers=ADMIN)).json()
        for kind in KINDS:
            r = await _call(http, opened, kind, body(kind, SECRET_TEXT, stream=kind == "chat"))
            assert r.status_code == 200, r.text
            _path, _headers, sent = upstream.received[-1]
            assert b"tok-S3CR3T" not in orjson.dumps(sent) and b"<redacted>" in orjson.dumps(sent)
        sent_before = len(upstream.received)
        for kind in KINDS:
            r = await _call(http, opened, kind, body(kind, "tell me something forbidden"))
            assert r.status_code == 403, r.text
            error = r.json()
            if kind == "messages":  # Anthropic's shape, so its SDK raises PermissionDeniedError
                assert error["type"] == "error" and error["error"]["type"] == "api_error"
            else:  # OpenAI's
                assert error["error"]["code"] == 403
            assert error["error"]["message"] == "proxy_guard: this topic is forbidden"
        assert len(upstream.received) == sent_before  # nothing refused went upstream
        stats = (await http.get(f"{url}/lowwater/stats", headers=ADMIN)).json()
        assert stats["intercepts"]["entries"] == 0  # a rejected call never entered the table
        r = await http.delete(f"{url}/lowwater/rollouts/r1", headers=ADMIN)
        assert r.json()["turns"] == len(KINDS)  # rejected calls record no turn

    trio.run(_with_proxy, tmp_path, fn)  # plugins=None: serve_proxy loads them, LOWWATER_PLUGINS included
    ((line),) = lines(tmp_path)
    assert b"tok-S3CR3T" not in orjson.dumps(line)
    # The turns show what was sent (the later calls repeat the first message: their deltas are empty).
    assert line["turns"][0]["request_delta"][0]["content"] == "my session is <redacted>; what is 2 plus 2"
    answers = guard.read_text().splitlines()
    assert sorted(a.split()[1] for a in answers) == sorted(["openai.chat", "openai.responses", "anthropic.messages"])
    assert all(a.startswith("r1 ") for a in answers)


def test_plugin_protocols_are_routed_by_the_proxy(tmp_path):
    class CustomChat(OpenAIChat):
        name = "custom.chat"

    class Plugin:
        @hookimpl
        def register_protocols(self, register):
            register(CustomChat())

    # The built-in protocols disabled: the plugin's own owns the chat path.
    plugins = load(disabled={"protocols"}, extra=[("custom", Plugin())])

    async def fn(url, http, upstream):
        opened = (await http.post(f"{url}/lowwater/rollouts", json={"rollout_id": "p"}, headers=ADMIN)).json()
        assert (await _call(http, opened, "chat", body("chat"))).status_code == 200
        assert (await _call(http, opened, "messages", body("messages"))).status_code == 404  # not routed now
        await http.delete(f"{url}/lowwater/rollouts/p", headers=ADMIN)

    trio.run(_with_proxy, tmp_path, fn, plugins)
    ((line),) = lines(tmp_path)
    assert [t["protocol"] for t in line["turns"]] == ["custom.chat"]


def test_plugin_summary_names_interceptors_in_call_order():
    class Meter:
        @hookimpl
        async def intercept_response(self, call, response):
            pass

    class Redact:
        @hookimpl
        async def intercept_request(self, call):
            pass

    plugins = load(extra=[("meter", Meter()), ("redact", Redact())])
    summary = plugin_summary(plugins)
    assert summary.startswith("protocols openai.chat, openai.responses, anthropic.messages; ")
    assert summary.endswith("interceptors in call order: intercept_request: redact; intercept_response: meter")
    assert plugin_summary(load()).endswith("; no interceptors")


def test_a_plugin_that_cannot_be_imported_stops_the_proxy_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LOWWATER_PLUGINS", "no_such_module_lowwater")
    code = cli.main(["proxy", "--upstream", "http://127.0.0.1:1/v1", "--listen", "127.0.0.1:0", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "LOWWATER_PLUGINS: cannot import 'no_such_module_lowwater'" in err


def test_lowwater_proxy_process_applies_interceptors_and_names_them_at_start(tmp_path):
    key = "adm-0123456789-not-in-the-banner"
    log = tmp_path / "answers.log"

    async def main():
        upstream = Upstream()
        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve, upstream)
            env = {
                **os.environ,
                "LOWWATER_ADMIN_KEY": key,
                "LOWWATER_PLUGINS": "proxy_guard",
                "PYTHONPATH": os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")]),
                "PROXY_GUARD_LOG": str(log),
            }
            args = ["--upstream", f"http://{address}/v1", "--out", str(tmp_path)]
            # The banner: the address line, then the plugins line.
            async with proxy_process(args, env, banner_lines=2) as child:
                text = child.stderr.decode()
                assert "intercept_request: proxy_guard; intercept_response: proxy_guard" in text
                assert key not in text
                opened = await child.open()
                r = await _call(child.http, opened, "chat", body("chat", SECRET_TEXT))
                assert r.status_code == 200
                r = await _call(child.http, opened, "messages", body("messages", "something forbidden"))
                assert r.status_code == 403 and r.json()["type"] == "error"
                assert r.json()["error"]["message"] == "proxy_guard: this topic is forbidden"
                assert await child.terminate() == 128 + signal.SIGTERM
            nursery.cancel_scope.cancel()
        assert len(upstream.received) == 1
        assert b"tok-S3CR3T" not in orjson.dumps(upstream.received[0][2])

    trio.run(main)
    ((line),) = lines(tmp_path)  # the open rollout, written at shutdown
    assert len(line["turns"]) == 1 and "<redacted>" in orjson.dumps(line).decode()
    assert "tok-S3CR3T" not in orjson.dumps(line).decode()
    assert log.read_text().split()[1:] == ["openai.chat", "stop"]
