"""Admin authentication is on by default: without a configured key ``lowwater
proxy`` generates one and writes it to a file only its user can read.

Before, a proxy started without ``LOWWATER_ADMIN_KEY`` left its admin
endpoints open to every local process, the agent under evaluation included:
it could set its own reward, export other sessions and close other rollouts.
"""

from __future__ import annotations

import functools
import os
import stat

import httpx
import trio

from lowwater.http import serve
from lowwater.interception.proxy import ProxyConfig, admin_key_file, read_admin_key, serve_proxy

from ._harness import GUARD_S
from ._proxy import proxy_process
from .upstream import Upstream


async def _in_process(tmp_path, fn, **config):
    async with trio.open_nursery() as nursery:
        address = await nursery.start(serve, Upstream())
        proxy_config = ProxyConfig(upstream=f"http://{address}/v1", port=0, out_dir=tmp_path / "out", **config)
        (tmp_path / "out").mkdir(exist_ok=True)
        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as proxy_nursery:
                url = await proxy_nursery.start(serve_proxy, proxy_config)
                async with httpx.AsyncClient(timeout=GUARD_S) as http:
                    await fn(url, http, proxy_config)
                proxy_nursery.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


async def _check_key_file(url, http, path):
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = read_admin_key(path)
    assert len(key) >= 32
    for headers in ({}, {"x-api-key": "guess"}):
        assert (await http.post(f"{url}/lowwater/rollouts", headers=headers)).status_code == 401
        assert (await http.get(f"{url}/lowwater/stats", headers=headers)).status_code == 401
    r = await http.post(f"{url}/lowwater/rollouts", headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 200


def test_a_key_is_generated_into_the_given_file_and_removed_at_shutdown(tmp_path):
    path = tmp_path / "keys" / "proxy.key"

    async def fn(url, http, config):
        assert admin_key_file(config, url) == path
        await _check_key_file(url, http, path)

    trio.run(functools.partial(_in_process, tmp_path, fn, admin_key_file=path))
    assert not path.exists()


def test_the_default_key_file_is_in_the_users_runtime_dir_else_beside_the_output(tmp_path, monkeypatch):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    seen = []

    async def fn(url, http, config):
        path = admin_key_file(config, url)
        seen.append(path)
        assert path.name == f"proxy-{url.rsplit(':', 1)[1]}.key"
        await _check_key_file(url, http, path)

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    trio.run(_in_process, tmp_path, fn)
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    trio.run(_in_process, tmp_path, fn)
    assert seen[0].parent == runtime / "lowwater" and seen[1].parent == tmp_path / "out"
    assert not any(p.exists() for p in seen)


def test_a_given_key_writes_no_file_and_no_auth_is_open(tmp_path):
    async def given(url, http, config):
        assert admin_key_file(config, url) is None
        assert (await http.get(f"{url}/lowwater/stats")).status_code == 401
        assert (await http.get(f"{url}/lowwater/stats", headers={"x-api-key": "adm"})).status_code == 200

    async def open_(url, http, config):
        assert admin_key_file(config, url) is None
        assert (await http.get(f"{url}/lowwater/stats")).status_code == 200

    trio.run(functools.partial(_in_process, tmp_path, given, admin_key="adm"))
    trio.run(functools.partial(_in_process, tmp_path, open_, admin_auth=False))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["trajectories.jsonl"]


async def _run_cli(tmp_path, extra, env, fn):
    async with trio.open_nursery() as nursery:
        address = await nursery.start(serve, Upstream())
        args = ["--upstream", f"http://{address}/v1", "--out", str(tmp_path / "out"), *extra]
        async with proxy_process(args, env) as child:
            await fn(child.url, child.http, child.stderr.decode())
            assert await child.terminate() == 143
        nursery.cancel_scope.cancel()


def test_the_command_prints_the_key_file_never_the_key(tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if k != "LOWWATER_ADMIN_KEY"} | {"XDG_RUNTIME_DIR": str(runtime)}
    found = []

    async def fn(url, http, banner):
        (path,) = (runtime / "lowwater").iterdir()
        found.append(path)
        assert f"admin key in {path}" in banner and read_admin_key(path) not in banner
        await _check_key_file(url, http, path)

    trio.run(_run_cli, tmp_path, [], env, fn)
    assert not found[0].exists()


def test_no_admin_auth_warns_loudly(tmp_path):
    async def fn(url, http, banner):
        assert "WARNING: --no-admin-auth" in banner and "NO admin authentication" in banner
        assert (await http.get(f"{url}/lowwater/stats")).status_code == 200

    trio.run(_run_cli, tmp_path, ["--no-admin-auth"], dict(os.environ), fn)
