"""``lowwater proxy --out`` on a full disk: whole lines or nothing, a 507 naming the rollout.

A full disk is simulated with ``RLIMIT_FSIZE`` on the proxy process (SIGXFSZ
ignored, as tests/eval/test_lines_disk_full.py does): the append that
crosses the limit is short.  Before, that left a partial line, the next
rollout's line was appended to it (a good rollout became unparseable) and
the DELETE answered 500.
"""

from __future__ import annotations

import os
import resource
import signal
import stat
import subprocess
import sys

import httpx
import orjson
import trio

from lowwater.http import serve

from ._harness import GUARD_S, body
from .upstream import Upstream

MAIN = "import sys; from lowwater import cli; sys.exit(cli.main(sys.argv[1:]))"
LIMIT_BYTES = 4096


def _small_disk() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT_BYTES, resource.RLIM_INFINITY))


def test_a_full_disk_is_a_507_and_the_file_keeps_whole_lines(tmp_path):
    statuses: dict[str, int] = {}

    async def main() -> bytes:
        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve, Upstream())
            process = await trio.lowlevel.open_process(
                [sys.executable, "-c", MAIN, "proxy", "--upstream", f"http://{address}/v1"]
                + ["--listen", "127.0.0.1:0", "--out", str(tmp_path)],
                stderr=subprocess.PIPE,
                env={**os.environ, "LOWWATER_ADMIN_KEY": "k"},
                preexec_fn=_small_disk,
            )
            err = b""
            try:
                with trio.fail_after(GUARD_S):
                    while b"\n" not in err:
                        err += await process.stderr.receive_some()
                    url = err.split(b"listening on ")[1].split(b" ")[0].decode()
                    async with httpx.AsyncClient(timeout=GUARD_S, headers={"x-api-key": "k"}) as http:
                        for rollout_id, size in (("a", 10), ("big", 2 * LIMIT_BYTES), ("b", 10)):
                            opened = (
                                await http.post(f"{url}/lowwater/rollouts", json={"rollout_id": rollout_id})
                            ).json()
                            r = await http.post(
                                opened["base_url"] + "/chat/completions",
                                json=body("chat", "x" * size),
                                headers={"authorization": f"Bearer {opened['api_key']}"},
                            )
                            assert r.status_code == 200
                            r = await http.delete(f"{url}/lowwater/rollouts/{rollout_id}")
                            statuses[rollout_id] = r.status_code
                            if rollout_id == "big":
                                assert "rollout big" in r.json()["error"] and "disk is full" in r.json()["error"]
                        stats = (await http.get(f"{url}/lowwater/stats")).json()
                        assert stats["open_rollouts"] == 0 and stats["written"] == 2
                    process.send_signal(signal.SIGTERM)
                    assert await process.wait() == 143
                    while chunk := await process.stderr.receive_some():
                        err += chunk
            finally:
                if process.returncode is None:
                    process.kill()
                await process.stderr.aclose()
            nursery.cancel_scope.cancel()
        return err

    err = trio.run(main)
    assert statuses == {"a": 200, "big": 507, "b": 200}
    assert b"rollout big" in err
    path = tmp_path / "trajectories.jsonl"
    assert [orjson.loads(line)["rollout_id"] for line in path.read_bytes().splitlines()] == ["a", "b"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
