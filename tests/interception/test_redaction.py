"""Credentials in the upstream URL never reach the proxy's startup line or a recorded turn."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import orjson
import trio

from ._harness import GUARD_S, body

MAIN = "import sys; from lowwater import cli; sys.exit(cli.main(sys.argv[1:]))"
SECRET = "s3cret-pw"


def test_upstream_credentials_are_redacted(tmp_path):
    async def main() -> bytes:
        listener = trio.socket.socket()
        await listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        listener.close()  # nothing listens: the call fails, and its error is recorded
        process = await trio.lowlevel.open_process(
            [sys.executable, "-c", MAIN, "proxy", "--upstream", f"http://user:{SECRET}@127.0.0.1:{port}/v1"]
            + ["--listen", "127.0.0.1:0", "--out", str(tmp_path), "--retries", "0"],
            stderr=subprocess.PIPE,
            env={**os.environ, "LOWWATER_ADMIN_KEY": "k"},
        )
        err = b""
        try:
            with trio.fail_after(GUARD_S):
                while b"\n" not in err:
                    err += await process.stderr.receive_some()
                url = err.split(b"listening on ")[1].split(b" ")[0].decode()
                async with httpx.AsyncClient(timeout=GUARD_S, headers={"x-api-key": "k"}) as http:
                    opened = (await http.post(f"{url}/lowwater/rollouts", json={"rollout_id": "r"})).json()
                    r = await http.post(
                        opened["base_url"] + "/chat/completions",
                        json=body("chat"),
                        headers={"authorization": f"Bearer {opened['api_key']}"},
                    )
                    assert r.status_code == 502 and SECRET not in r.text
                    assert (await http.delete(f"{url}/lowwater/rollouts/r")).status_code == 200
                process.send_signal(signal.SIGTERM)
                await process.wait()
                while chunk := await process.stderr.receive_some():
                    err += chunk
        finally:
            if process.returncode is None:
                process.kill()
            await process.stderr.aclose()
        return err

    err = trio.run(main)
    assert b"http://***@127.0.0.1:" in err and SECRET.encode() not in err
    (line,) = (tmp_path / "trajectories.jsonl").read_bytes().splitlines()
    assert orjson.loads(line)["turns"][0]["error"] and SECRET.encode() not in line
