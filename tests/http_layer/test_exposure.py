"""Bind and advertise: servers bound beyond loopback need the admin key,
advertise a dialable address, and a remote backend refuses a model server
its workers cannot reach."""

from __future__ import annotations

import functools

import httpx
import pytest
import trio

from lowwater import plugins as plugins_mod
from lowwater.hookspecs import hookimpl
from lowwater.http.exposure import (
    ExposureError,
    advertised_host,
    check_bind,
    is_loopback,
    primary_address,
    require_reachable,
)
from lowwater.serve_model import ScriptedModel, serve_model
from lowwater.workers.backend import WorkerBackend


def test_loopback_and_advertised_hosts():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("[::1]") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.test")
    assert advertised_host("0.0.0.0") == primary_address()
    assert advertised_host("0.0.0.0", "node.test") == "node.test" and advertised_host("10.0.0.5") == "10.0.0.5"
    check_bind("x", "127.0.0.1", None)  # loopback: no key needed
    with pytest.raises(ExposureError, match="refusing to bind x to 0.0.0.0 .* LOWWATER_ADMIN_KEY"):
        check_bind("x", "0.0.0.0", None)
    check_bind("x", "0.0.0.0", "key")
    with pytest.raises(ExposureError, match="backend 'ray' runs env workers on other hosts"):
        require_reachable("the model server", "http://127.0.0.1:9/v1", "ray")
    require_reachable("the model server", "http://10.0.0.5:9/v1", "ray")


def test_serve_model_beyond_loopback_needs_and_checks_the_key():
    async def main():
        async with trio.open_nursery() as nursery, httpx.AsyncClient(timeout=10) as client:
            with pytest.raises(ExposureError):
                await nursery.start(serve_model, ScriptedModel(), "0.0.0.0")
            url = await nursery.start(
                functools.partial(serve_model, ScriptedModel(), "0.0.0.0", advertise="127.0.0.1", admin_key="k")
            )
            assert url.startswith("http://127.0.0.1:")
            assert (await client.get(f"{url}/v1/models")).status_code == 401
            ok = await client.get(f"{url}/v1/models", headers={"authorization": "Bearer k"})
            assert ok.status_code == 200
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_interception_server_advertises_and_needs_the_key_beyond_loopback():
    from lowwater.interception import InterceptionServer
    from lowwater.upstream.client import ModelClient

    async def main():
        async with ModelClient("http://127.0.0.1:9/v1") as upstream, trio.open_nursery() as nursery:
            with pytest.raises(ExposureError, match="the interception server"):
                await nursery.start(InterceptionServer(upstream).run, "0.0.0.0")
            server = InterceptionServer(upstream)
            url = await nursery.start(functools.partial(server.run, "0.0.0.0", advertise="agents.test", admin_key="k"))
            assert url.startswith("http://agents.test:") and server.url == url
            nursery.cancel_scope.cancel()

    trio.run(main)


class Remote(WorkerBackend):
    name = "remote"
    remote = True

    def pool(self, spec, config, *, on_event=None, pin_by=None):
        raise AssertionError("never reached: the model server is checked first")


class RemotePlugin:
    @hookimpl
    def register_backends(self, register):
        register("remote", Remote)


def test_a_remote_backend_refuses_a_loopback_model_server(tmp_path, monkeypatch):
    from lowwater.eval import EvalConfig, run_eval

    plugins = plugins_mod.load(extra=[("remote", RemotePlugin())])
    config = EvalConfig(rollouts=1, workers=1, backend="remote", out=tmp_path / "r.jsonl")
    with pytest.raises(ExposureError, match="cannot reach the model server at 127.0.0.1 .*--bind 0.0.0.0"):
        trio.run(lambda: run_eval(config, plugins=plugins))
    monkeypatch.delenv("LOWWATER_ADMIN_KEY", raising=False)
    exposed = EvalConfig(rollouts=1, workers=1, backend="remote", bind="0.0.0.0", out=tmp_path / "r.jsonl")
    with pytest.raises(ExposureError, match="refusing to bind the model server"):
        trio.run(lambda: run_eval(exposed, plugins=plugins))
    assert not (tmp_path / "r.jsonl").exists()


def test_an_eval_with_its_model_server_beyond_loopback(tmp_path, monkeypatch):
    """--bind 0.0.0.0 with the admin key: serve-model checks it, the workers send it."""
    from lowwater.eval import EvalConfig, run_eval

    monkeypatch.setenv("LOWWATER_ADMIN_KEY", "sesame")
    config = EvalConfig(rollouts=4, concurrency=2, workers=1, bind="0.0.0.0", out=tmp_path / "r.jsonl")
    report = trio.run(lambda: run_eval(config))
    assert report.summary["rollouts"] == 4 and report.summary["errors"] == 0
