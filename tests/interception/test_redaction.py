"""Credentials in the upstream URL never reach the proxy's startup line or a recorded turn."""

from __future__ import annotations

import os

import orjson
import trio

from ._harness import body
from ._proxy import proxy_process

SECRET = "s3cret-pw"


def test_upstream_credentials_are_redacted(tmp_path):
    async def main() -> bytes:
        listener = trio.socket.socket()
        await listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        listener.close()  # nothing listens: the call fails, and its error is recorded
        async with proxy_process(
            ["--upstream", f"http://user:{SECRET}@127.0.0.1:{port}/v1", "--out", str(tmp_path), "--retries", "0"],
            env={**os.environ, "LOWWATER_ADMIN_KEY": "k"},
        ) as proxy:
            r = await proxy.call(await proxy.open("r"), body("chat"))
            assert r.status_code == 502 and SECRET not in r.text
            assert (await proxy.http.delete(f"{proxy.url}/lowwater/rollouts/r")).status_code == 200
            await proxy.terminate()
        return proxy.stderr

    err = trio.run(main)
    assert b"http://***@127.0.0.1:" in err and SECRET.encode() not in err
    (line,) = (tmp_path / "trajectories.jsonl").read_bytes().splitlines()
    assert orjson.loads(line)["turns"][0]["error"] and SECRET.encode() not in line
