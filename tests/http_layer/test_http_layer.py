"""``lowwater.http``: the body reader, responses, keys and the route table, driven as plain ASGI calls.

(The directory is not called ``http``: pytest puts ``tests/`` on ``sys.path``,
and a package of that name would shadow the standard library's.)
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
import trio

from lowwater.http import (
    HTTPError,
    Router,
    handle,
    read_body,
    request_keys,
    require_key,
    send_bytes,
)

Message = dict[str, Any]


def scope(method: str = "POST", path: str = "/", headers: dict[str, str] | None = None) -> dict[str, Any]:
    raw = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    return {"type": "http", "method": method, "path": path, "headers": raw}


class Peer:
    """The client side of one request: queued body messages in, sent messages out."""

    def __init__(self, *chunks: bytes, disconnect: bool = False) -> None:
        self.incoming: list[Message] = [
            {"type": "http.request", "body": c, "more_body": i + 1 < len(chunks)} for i, c in enumerate(chunks)
        ]
        if disconnect:
            self.incoming[-1]["more_body"] = True
            self.incoming.append({"type": "http.disconnect"})
        self.received = 0
        self.sent: list[Message] = []

    async def receive(self) -> Message:
        await trio.lowlevel.checkpoint()
        if self.incoming:
            self.received += 1
            return self.incoming.pop(0)
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int:
        return self.sent[0]["status"]

    @property
    def headers(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.sent[0]["headers"]}

    def json(self) -> Any:
        return orjson.loads(b"".join(bytes(m.get("body", b"")) for m in self.sent[1:]))


def read(peer: Peer, limit: int, headers: dict[str, str] | None = None) -> bytes | bytearray:
    async def main() -> bytes | bytearray:
        return await read_body(scope(headers=headers), peer.receive, limit)

    return trio.run(main)


def test_a_declared_length_is_read_into_one_preallocated_buffer():
    peer = Peer(b"abc", b"def", b"g")
    body = read(peer, 100, {"content-length": "7"})
    assert isinstance(body, bytearray) and body == b"abcdefg"


def test_without_a_length_one_chunk_is_returned_as_is_and_several_are_joined():
    assert read(Peer(b"only"), 100) == b"only"
    assert read(Peer(b"ab", b"cd"), 100) == b"abcd"
    assert read(Peer(b""), 100) == b""


def test_over_the_limit_is_413_after_draining_the_rest():
    # Declared too large: refused before reading, the body drained so the client reads the 413.
    peer = Peer(b"x" * 10, b"x" * 10)
    with pytest.raises(HTTPError) as err:
        read(peer, 15, {"content-length": "20"})
    assert err.value.status == 413 and "limit of 15 bytes" in err.value.reason and not peer.incoming
    # Undeclared (chunked): found while reading, the rest drained too.
    peer = Peer(b"x" * 10, b"x" * 10, b"x")
    with pytest.raises(HTTPError) as err:
        read(peer, 15)
    assert err.value.status == 413 and not peer.incoming
    # More bytes than the declared length: 413, not a buffer overrun.
    with pytest.raises(HTTPError) as err:
        read(Peer(b"x" * 8), 100, {"content-length": "4"})
    assert err.value.status == 413


def test_short_or_abandoned_bodies_are_400():
    with pytest.raises(HTTPError, match="shorter than its content-length") as err:
        read(Peer(b"abc"), 100, {"content-length": "5"})
    assert err.value.status == 400
    with pytest.raises(HTTPError, match="disconnected") as err:
        read(Peer(b"abc", disconnect=True), 100)
    assert err.value.status == 400


def test_request_keys_and_the_admin_key():
    s = scope(headers={"authorization": "Bearer  tok ", "x-api-key": "k2"})
    assert request_keys(s) == ["tok", "k2"]
    assert request_keys(scope(headers={"authorization": "Basic abc", "x-api-key": " "})) == []
    require_key(s, None)  # no admin key: open
    require_key(s, "tok")  # the bearer token is the key checked
    require_key(scope(headers={"x-api-key": "k2"}), "k2")
    for headers in ({}, {"x-api-key": "nope"}, {"authorization": "Bearer k2x"}):
        with pytest.raises(HTTPError) as err:
            require_key(scope(headers=headers), "k2")
        assert err.value.status == 401
    with pytest.raises(HTTPError):
        require_key(s, "k2")  # a wrong bearer token is not rescued by a right x-api-key


async def _ok(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send_bytes(send, 200, orjson.dumps({"params": scope["path_params"]}), "application/json")


def call(app: Any, method: str, path: str) -> Peer:
    peer = Peer(b"")
    trio.run(app, scope(method, path), peer.receive, peer.send)
    return peer


def test_router_matches_patterns_and_answers_404_and_405_itself():
    router = Router()
    router.add("GET", "/things/stats", _ok)
    router.add("GET", "/things/{thing_id:path}", _ok)
    router.add("DELETE", "/things/{thing_id}", _ok)
    router.add("POST", "/things/{thing_id}/touch", _ok)
    assert call(router, "GET", "/things/stats").json() == {"params": {}}
    assert call(router, "GET", "/things/a/b").json() == {"params": {"thing_id": "a/b"}}
    # The path is taken as the server decoded it, never decoded twice.
    assert call(router, "GET", "/things/x%41").json() == {"params": {"thing_id": "x%41"}}
    assert call(router, "DELETE", "/things/a/").json() == {"params": {"thing_id": "a"}}
    assert call(router, "POST", "/things/a/touch").json() == {"params": {"thing_id": "a"}}
    peer = call(router, "PUT", "/things/a")
    assert peer.status == 405 and peer.headers["allow"] == "GET, DELETE"
    assert peer.json() == {"error": "/things/a takes GET or DELETE, not PUT"}
    peer = call(router, "GET", "/nothing")
    assert peer.status == 404 and peer.json() == {"error": "no endpoint GET /nothing"}
    with pytest.raises(ValueError, match="must end the pattern"):
        router.add("GET", "/{rest:path}/x", _ok)


def test_router_mounts_error_shapes_and_handler_errors():
    async def refuse(scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise HTTPError(409, "taken", headers={"retry-after": "1"}, who="me")

    inner = Router()
    inner.add("*", "/admin/{what}", _ok)
    router = Router(error_body=lambda scope, err: {"message": err.reason, "path": scope["path"]})
    router.mount("/admin/", inner)
    router.add("POST", "/refuse", refuse)
    assert call(router, "PATCH", "/admin/x").json() == {"params": {"what": "x"}}
    # The mounted app answers its own 404, in its own shape.
    assert call(router, "GET", "/admin").json() == {"error": "no endpoint GET /admin"}
    assert call(router, "GET", "/administer").json()["path"] == "/administer"  # not under the mount
    peer = call(router, "POST", "/refuse")
    assert peer.status == 409 and peer.headers["retry-after"] == "1"
    assert peer.json() == {"message": "taken", "path": "/refuse"}
    # handle(): the default shape carries the extra fields.
    peer = Peer(b"")
    trio.run(handle, scope("POST", "/refuse"), peer.receive, peer.send, refuse)
    assert peer.status == 409 and peer.json() == {"error": "taken", "who": "me"}


def test_lifespan_is_answered():
    sent: list[Message] = []
    incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]

    async def receive() -> Message:
        return incoming.pop(0)

    async def send(message: Message) -> None:
        sent.append(message)

    trio.run(Router(), {"type": "lifespan"}, receive, send)
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


def test_send_bytes_counts_a_memoryview_in_bytes():
    peer = Peer()
    data = memoryview(bytearray(24)).cast("q")  # 3 items, 24 bytes
    trio.run(send_bytes, peer.send, 200, data, "application/octet-stream")
    assert peer.headers["content-length"] == "24"
