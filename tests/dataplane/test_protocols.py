"""Protocols as data: the Python declarations (:class:`Wire`) are what the
data plane serves, for the built-in three and for a plugin's protocol."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio
from tests.dataplane.test_binding import GUARD_S, Rig, run

from lowwater._native import DataPlane, DataPlaneConfigError
from lowwater.interception.protocols import AnthropicMessages, OpenAIChat, Protocol, Wire, builtin_protocols


class AcmeChat(Protocol):
    """A plugin's protocol: its own route, messages under ``turns``, a required field."""

    name = "acme.chat"
    path = "/v1/acme/chat"
    wire = Wire(
        messages="turns",
        roles=("user", "bot"),
        fields=(("model", "string", True), ("episode", "positive_integer", True)),
        tools=("actions",),
        terminal_data="[END]",
    )


def test_the_builtin_declarations_are_the_planes_builtin_table() -> None:
    with DataPlane("http://127.0.0.1:9/v1") as plane:
        assert plane.protocols == [p.data_plane_spec() for p in builtin_protocols()]


def test_a_plugin_protocol_is_routed_validated_and_recorded() -> None:
    async def fn(r: Rig) -> None:
        r.open("r0", "s0")
        url = f"http://{r.plane.address}/v1/acme/chat"
        auth = {"authorization": "Bearer s0"}

        async def post(body: dict[str, Any]) -> httpx.Response:
            return await r.http.post(url, json=body, headers=auth)

        # Validated by the plugin's declaration: its own required field, its own roles.
        missing = await post({"model": "m", "turns": [{"role": "user", "content": "hi"}]})
        assert missing.status_code == 400 and "episode" in missing.json()["error"]["message"]
        bad_role = await post({"model": "m", "episode": 1, "turns": [{"role": "system", "content": "x"}]})
        assert bad_role.status_code == 400
        # Forwarded to the same path under the upstream (which has no such route: its 404 is relayed).
        body = {"model": "m", "episode": 3, "turns": [{"role": "user", "content": "hi"}], "actions": [{"n": 1}]}
        answer = await post(body)
        assert answer.status_code == 404
        assert r.upstream.received[-1][0] == "/v1/acme/chat"
        with trio.fail_after(GUARD_S):
            while not r.records:
                await trio.sleep(0.01)
        (record,) = r.records
        assert (record.protocol, record.status, record.messages) == (
            "acme.chat",
            404,
            (b'{"role":"user","content":"hi"}',),
        )
        assert record.tools == b'{"actions":[{"n":1}]}'
        # The built-in routes are not served: the table is exactly the one given.
        chat = await r.chat("s0", [{"role": "user", "content": "hi"}])
        assert chat.status_code == 404
        r.close("r0")
        stats = await r.settled()
        assert (stats["in_flight"], stats["intercepts"], stats["awaiting_ack"]) == (0, 0, 0)

    run(fn, protocols=[AcmeChat().data_plane_spec()])


def test_bad_declarations_are_refused() -> None:
    with pytest.raises(ValueError, match="terminal"):
        Wire()
    with pytest.raises(ValueError, match="kind"):
        Wire(fields=(("model", "text", True),), terminal_data="[DONE]")
    with pytest.raises(ValueError, match="no wire format"):
        Protocol().data_plane_spec()
    spec = OpenAIChat().data_plane_spec()
    with pytest.raises(DataPlaneConfigError, match="flavour"):
        DataPlane("http://127.0.0.1:9/v1", protocols=[{**spec, "flavour": "acme"}])
    with pytest.raises(DataPlaneConfigError, match="twice"):
        DataPlane(
            "http://127.0.0.1:9/v1", protocols=[spec, {**AnthropicMessages().data_plane_spec(), "path": spec["path"]}]
        )
    with pytest.raises(DataPlaneConfigError, match="terminal"):
        DataPlane("http://127.0.0.1:9/v1", protocols=[{**spec, "terminal_types": ("x",)}])
