"""``lowwater proxy``: flags, the admin endpoints, writing trajectories, and a real process."""

from __future__ import annotations

import argparse
import os
import signal

import httpx
import orjson
import pytest
import trio

from lowwater import cli
from lowwater.commands import proxy
from lowwater.commands.proxy import config_from_args
from lowwater.http import serve
from lowwater.interception.proxy import ProxyConfig, serve_proxy

from ._harness import GUARD_S, body
from ._proxy import proxy_process
from .test_failures import until
from .upstream import Upstream


def args(tmp_path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    proxy.add_parser(parser.add_subparsers())
    return parser.parse_args(["proxy", "--upstream", "http://127.0.0.1:1/v1", "--out", str(tmp_path), *extra])


def test_flags_are_validated(tmp_path):
    config = config_from_args(args(tmp_path, "--listen", "127.0.0.1:0"), {})
    # No key given: one is generated at start (admin authentication is on by default).
    assert (config.host, config.port, config.admin_key, config.admin_auth) == ("127.0.0.1", 0, None, True)
    assert config_from_args(args(tmp_path, "--listen", "0.0.0.0:8700"), {}).admin_auth
    with pytest.raises(cli.UsageError, match="refusing to listen on 0.0.0.0 with --no-admin-auth"):
        config_from_args(args(tmp_path, "--listen", "0.0.0.0:8700", "--no-admin-auth"), {})
    config = config_from_args(args(tmp_path, "--no-admin-auth"), {"LOWWATER_ADMIN_KEY": "ignored"})
    assert (config.admin_key, config.admin_auth) == (None, False)
    config = config_from_args(args(tmp_path, "--listen", "0.0.0.0:8700", "--admin-key-env", "K"), {"K": "s3cret"})
    assert config.admin_key == "s3cret" and config.host == "0.0.0.0"
    config = config_from_args(args(tmp_path, "--admin-key-file", str(tmp_path / "k" / "proxy.key")), {})
    assert config.admin_key_file == tmp_path / "k" / "proxy.key"
    assert config_from_args(args(tmp_path, "--listen", "[::1]:5"), {}).host == "::1"
    assert config_from_args(args(tmp_path, "--listen", "localhost:5"), {}).host == "localhost"
    for bad, match in (
        (["--listen", "nope"], "HOST:PORT"),
        (["--listen", "h:99999"], "HOST:PORT"),
        (["--upstream", "ftp://x"], "http"),
        (["--upstream-key-env", "UNSET"], "UNSET"),
        (["--retries", "-1"], "retries"),
        (["--max-concurrency", "0"], "max-concurrency"),
        (["--out", "/proc/nope"], "--out"),
        (["--admin-key-file", "/proc/nope/k"], "--admin-key-file"),
    ):
        with pytest.raises(cli.UsageError, match=match):
            config_from_args(args(tmp_path, *bad), {})


def test_cli_reports_usage_errors(tmp_path, monkeypatch, capsys):
    assert "lowwater.commands.proxy" in cli.SUBCOMMANDS
    monkeypatch.delenv("LOWWATER_ADMIN_KEY", raising=False)
    argv = ["proxy", "--upstream", "http://127.0.0.1:1/v1", "--listen", "10.0.0.1:80", "--out", str(tmp_path)]
    code = cli.main([*argv, "--no-admin-auth"])
    assert code == 2 and "refusing to listen on 10.0.0.1" in capsys.readouterr().err


def test_a_data_plane_config_error_is_one_line(tmp_path, monkeypatch, capsys):
    # Raised inside the proxy's nurseries; the user gets its message, not their traceback.
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "missing.pem"))
    argv = ["proxy", "--upstream", "http://127.0.0.1:1/v1", "--listen", "127.0.0.1:0", "--out", str(tmp_path)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("lowwater proxy: error: TLS: SSL_CERT_FILE ") and "missing.pem" in err, err
    assert "Traceback" not in err and err.count("\n") == 1, err


async def _with_proxy(tmp_path, fn, admin_key: str | None = "adm"):
    upstream = Upstream()
    async with trio.open_nursery() as nursery:
        address = await nursery.start(serve, upstream)
        config = ProxyConfig(upstream=f"http://{address}/v1", port=0, out_dir=tmp_path, admin_key=admin_key, retries=0)
        url = await nursery.start(serve_proxy, config)
        async with httpx.AsyncClient(timeout=GUARD_S) as http:
            with trio.fail_after(GUARD_S):
                await fn(url, http, upstream)
        nursery.cancel_scope.cancel()


def lines(tmp_path) -> list[dict]:
    path = tmp_path / "trajectories.jsonl"
    return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


def test_admin_opens_records_and_closes_rollouts(tmp_path):
    admin = {"authorization": "Bearer adm"}

    async def fn(url, http, upstream):
        for headers in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": "nope"}):
            assert (await http.post(f"{url}/lowwater/rollouts", headers=headers)).status_code == 401
            assert (await http.get(f"{url}/lowwater/stats", headers=headers)).status_code == 401
        r = await http.post(f"{url}/lowwater/rollouts", json={"rollout_id": "a", "task_id": 7}, headers=admin)
        assert r.status_code == 200
        opened = r.json()
        assert opened["rollout_id"] == "a" and opened["base_url"] == f"{url}/v1" and opened["api_key"].startswith("lw-")
        assert (await http.post(f"{url}/lowwater/rollouts", json={"rollout_id": "a"}, headers=admin)).status_code == 409
        assert (await http.post(f"{url}/lowwater/rollouts", json=[1], headers=admin)).status_code == 400
        other = (await http.post(f"{url}/lowwater/rollouts", headers={"x-api-key": "adm"})).json()
        assert len(other["rollout_id"]) == 32
        # The admin key is not a rollout key, and a rollout key is not an admin key.
        assert (await http.post(f"{url}/v1/chat/completions", json=body("chat"), headers=admin)).status_code == 401
        assert (
            await http.get(f"{url}/lowwater/stats", headers={"authorization": f"Bearer {opened['api_key']}"})
        ).status_code == 401
        for kind, path in (("chat", "/chat/completions"), ("messages", "/messages")):
            r = await http.post(
                opened["base_url"] + path,
                json=body(kind, stream=kind == "chat"),
                headers={"authorization": f"Bearer {opened['api_key']}"},
            )
            assert r.status_code == 200
        stats = (await http.get(f"{url}/lowwater/stats", headers=admin)).json()
        assert stats["open_rollouts"] == 2 and stats["rss_bytes"] > 0
        assert stats["intercepts"]["inserts"] == 2 and stats["upstream"]["requests"] == 2
        assert (await http.get(f"{url}/lowwater/rollouts", headers=admin)).json() == {
            "rollouts": sorted(["a", other["rollout_id"]])
        }
        r = await http.delete(f"{url}/lowwater/rollouts/a", headers=admin)
        assert r.json() == {"rollout_id": "a", "turns": 2, "swept": 0}
        (line,) = lines(tmp_path)
        assert line["rollout_id"] == "a" and line["task_id"] == 7
        assert [t["protocol"] for t in line["turns"]] == ["openai.chat", "anthropic.messages"]
        assert line["turns"][0]["completion"]["content"] == "echo: what is 2 plus 2"
        assert (await http.delete(f"{url}/lowwater/rollouts/a", headers=admin)).status_code == 404
        r = await http.post(
            opened["base_url"] + "/chat/completions",
            json=body("chat"),
            headers={"authorization": f"Bearer {opened['api_key']}"},
        )
        assert r.status_code == 401  # closed: its key is forgotten
        assert (await http.put(f"{url}/lowwater/rollouts/x", headers=admin)).status_code == 405
        stats = (await http.get(f"{url}/lowwater/stats", headers=admin)).json()
        assert stats["open_rollouts"] == 1 and stats["intercepts"]["entries"] == 0 and stats["written"] == 1

    trio.run(_with_proxy, tmp_path, fn)
    # The rollout left open was written at shutdown.
    assert [line["rollout_id"] for line in lines(tmp_path)][0] == "a" and len(lines(tmp_path)) == 2


def test_admin_key_is_checked_before_the_route_table_answers(tmp_path):
    admin = {"x-api-key": "adm"}

    async def fn(url, http, upstream):
        # Without the key a stranger learns nothing, not even which paths exist.
        assert (await http.get(f"{url}/lowwater/nothing")).status_code == 401
        r = await http.get(f"{url}/lowwater/nothing", headers=admin)
        assert r.status_code == 404 and r.json() == {"error": "no endpoint GET /lowwater/nothing"}
        r = await http.get(f"{url}/lowwater/export", headers=admin)
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        r = await http.delete(f"{url}/lowwater/rollouts", headers=admin)
        assert r.status_code == 405 and r.headers["allow"] == "GET, POST"
        # A rollout id is the path segment as the server decoded it, once
        # ("x%2541" names "x%41", not an id; never "xA").
        r = await http.post(f"{url}/lowwater/rollouts", json={"rollout_id": "xA"}, headers=admin)
        assert r.status_code == 200
        assert (await http.delete(f"{url}/lowwater/rollouts/x%2541", headers=admin)).status_code == 400
        r = await http.delete(f"{url}/lowwater/rollouts/x%41", headers=admin)
        assert r.json() == {"rollout_id": "xA", "turns": 0, "swept": 0}

    trio.run(_with_proxy, tmp_path, fn)


def test_delete_resolves_a_waiting_call(tmp_path):
    async def fn(url, http, upstream):
        upstream.hang = True
        http.headers["x-api-key"] = "adm"
        opened = (await http.post(f"{url}/lowwater/rollouts", json={"rollout_id": "w"})).json()
        result = {}

        async def agent():
            result["r"] = await http.post(
                opened["base_url"] + "/responses",
                json=body("responses", stream=True),
                headers={"authorization": f"Bearer {opened['api_key']}"},
            )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(agent)
            await upstream.entered.wait()
            r = await http.delete(f"{url}/lowwater/rollouts/w")
            assert r.json() == {"rollout_id": "w", "turns": 0, "swept": 1}
        assert result["r"].status_code == 410
        await until(lambda: upstream.disconnects == 1)
        stats = (await http.get(f"{url}/lowwater/stats")).json()
        assert stats["intercepts"]["entries"] == 0 and stats["waiting_handlers"] == 0

    trio.run(_with_proxy, tmp_path, fn)


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_proxy_process_serves_and_writes_open_rollouts_on_interrupt(tmp_path, signum, code):
    async def main():
        upstream = Upstream()
        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve, upstream)
            async with proxy_process(
                ["--upstream", f"http://{address}/v1", "--out", str(tmp_path)],
                env={**os.environ, "LOWWATER_ADMIN_KEY": "k"},
            ) as child:
                opened = await child.open()
                assert (await child.call(opened, body("chat"))).status_code == 200
                assert await child.terminate(signum) == code
            nursery.cancel_scope.cancel()
        (line,) = lines(tmp_path)
        assert line["rollout_id"] == opened["rollout_id"] and len(line["turns"]) == 1

    trio.run(main)


@pytest.mark.parametrize("given", [None, "pymalloc"])
def test_the_proxy_process_runs_on_glibc_malloc_unless_told_otherwise(tmp_path, given):
    """``lowwater proxy`` re-executes itself (same pid) under
    ``PYTHONMALLOC=malloc`` (pymalloc's arenas kept a burst's memory:
    lowwater.commands.allocator); a ``PYTHONMALLOC`` the user set is kept."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "PYTHONMALLOC"}
    if given:
        env["PYTHONMALLOC"] = given
    argv = ["proxy", "--upstream", "http://127.0.0.1:1/v1", "--listen", "127.0.0.1:0", "--out", str(tmp_path)]
    proc = subprocess.Popen([sys.executable, "-m", "lowwater", *argv], env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        banner = proc.stderr.readline()  # printed once, by the re-executed process
        assert "listening on http://127.0.0.1:" in banner, banner
        proc_dir = Path(f"/proc/{proc.pid}")  # the Popen's pid: exec keeps it
        environ = proc_dir.joinpath("environ").read_bytes().decode().split("\0")
        assert dict(item.split("=", 1) for item in environ if "=" in item).get("PYTHONMALLOC") == (given or "malloc")
        assert proc_dir.joinpath("cmdline").read_bytes().split(b"\0")[1:3] == [b"-m", b"lowwater"]
        second = proc.stderr.readline()
        assert "protocols" in second and "listening" not in second  # no second start
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=GUARD_S)
        finally:
            if proc.poll() is None:
                proc.kill()
