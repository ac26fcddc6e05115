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

import orjson
import trio

from lowwater.http import serve

from ._harness import body
from ._proxy import proxy_process
from .upstream import Upstream

LIMIT_BYTES = 4096


def _small_disk() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT_BYTES, resource.RLIM_INFINITY))


def test_a_full_disk_is_a_507_and_the_file_keeps_whole_lines(tmp_path):
    statuses: dict[str, int] = {}

    async def main() -> bytes:
        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve, Upstream())
            async with proxy_process(
                ["--upstream", f"http://{address}/v1", "--out", str(tmp_path)],
                env={**os.environ, "LOWWATER_ADMIN_KEY": "k"},
                preexec_fn=_small_disk,
            ) as proxy:
                for rollout_id, size in (("a", 10), ("big", 2 * LIMIT_BYTES), ("b", 10)):
                    r = await proxy.call(await proxy.open(rollout_id), body("chat", "x" * size))
                    assert r.status_code == 200
                    r = await proxy.http.delete(f"{proxy.url}/lowwater/rollouts/{rollout_id}")
                    statuses[rollout_id] = r.status_code
                    if rollout_id == "big":
                        assert "rollout big" in r.json()["error"] and "disk is full" in r.json()["error"]
                stats = (await proxy.http.get(f"{proxy.url}/lowwater/stats")).json()
                assert stats["open_rollouts"] == 0 and stats["written"] == 2
                assert await proxy.terminate() == 143
            nursery.cancel_scope.cancel()
        return proxy.stderr

    err = trio.run(main)
    assert statuses == {"a": 200, "big": 507, "b": 200}
    assert b"rollout big" in err
    path = tmp_path / "trajectories.jsonl"
    assert [orjson.loads(line)["rollout_id"] for line in path.read_bytes().splitlines()] == ["a", "b"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
