"""A response started before the request body was read says ``connection: close``.

The interception server answers 401 before reading a stranger's body; the
server then drops the connection, and a client that reused it (nothing told
it not to) got "Server disconnected without sending a response" on its next
request.  Found by tests/interception/test_proxy_fuzz.py.
"""

from __future__ import annotations

import httpx
import trio

from lowwater.http import HTTPError, Router, read_body, send_json, serve


def _app() -> Router:
    router = Router()

    async def refuse(scope, receive, send):
        raise HTTPError(401, "no")  # before the body is read

    async def echo(scope, receive, send):
        body = await read_body(scope, receive, 1 << 20)
        await send_json(send, 200, {"bytes": len(body)})

    router.add("POST", "/refuse", refuse)
    router.add("POST", "/echo", echo)
    router.add("GET", "/ok", lambda scope, receive, send: send_json(send, 200, {}))
    return router


def test_a_body_left_unread_closes_the_connection_and_the_next_request_works():
    async def main():
        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve, _app())

            def client():
                out = []
                with httpx.Client(timeout=20) as http:
                    for size in (10, 300_000):
                        r = http.post(f"http://{address}/refuse", content=b"x" * size)
                        out.append((r.status_code, r.headers.get("connection")))
                        r = http.post(f"http://{address}/echo", content=b"y" * size)
                        out.append((r.status_code, r.headers.get("connection")))
                        out.append((http.get(f"http://{address}/ok").status_code, None))
                return out

            out = await trio.to_thread.run_sync(client)
            nursery.cancel_scope.cancel()
        return out

    assert trio.run(main) == [(401, "close"), (200, None), (200, None)] * 2
