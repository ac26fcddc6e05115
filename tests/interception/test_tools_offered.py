"""The tools an agent offers are recorded on each turn, held once per distinct
list in a trajectory (a repeated list is the earlier turn's object, not a
copy), written once per change, and read back; a protocol that does not
name its tools records none."""

from __future__ import annotations

import orjson
import pytest
import trio

from lowwater.hookspecs import hookimpl
from lowwater.interception import Protocol
from lowwater.interception.protocols import OpenAIChat
from lowwater.plugins import load
from lowwater.trainer.sessions import SessionConfig
from lowwater.trajectory import TOOL_LISTS_REMEMBERED, Trajectory, turns_from_json, turns_to_json

from ._harness import KINDS, body, read_sse, run
from .test_proxy_sessions import _with_proxy


def tool(kind: str, name: str) -> dict:
    """A function tool named ``name`` in ``kind``'s wire format."""
    schema = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}
    if kind == "chat":
        return {"type": "function", "function": {"name": name, "description": name, "parameters": schema}}
    if kind == "responses":
        return {"type": "function", "name": name, "description": name, "parameters": schema}
    return {"name": name, "description": name, "input_schema": schema}


async def offer(h, slot, kind, tools, *, stream=False):
    extra = {} if tools is None else {"tools": tools}
    r = await h.call(slot, kind, body(kind, "go", stream=stream, **extra))
    assert r.status_code == 200, r.text
    if stream:
        await read_sse(r)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", KINDS)
def test_each_turn_records_its_tools_once_per_distinct_list(kind, stream):
    a = [tool(kind, "search"), tool(kind, "open")]
    b = [tool(kind, "submit")]

    async def fn(h):
        slot, trajectory = h.open("r1")
        # Each request is encoded afresh: the server parses a new list every call.
        for tools in (a, a, b, None, a):
            await offer(h, slot, kind, tools, stream=stream)
        await h.assert_clean()
        turns = trajectory.turns
        assert [t.tools for t in turns] == [a, a, b, None, a]
        assert turns[1].tools is turns[0].tools and turns[4].tools is turns[0].tools  # held once
        assert turns[2].tools is not turns[0].tools
        # written once per change; read back as the same lists
        lines = trajectory.to_json()["turns"]
        assert [("tools" in t, t.get("tools_same", False)) for t in lines] == [
            (True, False),
            (False, True),
            (True, False),
            (True, False),
            (True, False),
        ]
        assert lines[0]["tools"] == a and lines[2]["tools"] == b and lines[3]["tools"] is None
        back = turns_from_json(lines)
        assert [t.tools for t in back] == [a, a, b, None, a] and back[1].tools is back[0].tools

    run(fn)


def test_an_empty_or_malformed_tools_field_is_no_tools():
    async def fn(h):
        slot, trajectory = h.open("r1")
        await offer(h, slot, "chat", [])
        await offer(h, slot, "messages", None)
        assert [t.tools for t in trajectory.turns] == [None, None]
        assert [t.get("tools", "absent") for t in turns_to_json(trajectory.turns)] == [None, None]

    run(fn)


def test_chat_functions_are_recorded_as_tools():
    function = {"name": "lookup", "parameters": {"type": "object", "properties": {}}}

    async def fn(h):
        slot, trajectory = h.open("r1")
        for _ in range(2):
            r = await h.call(slot, "chat", body("chat", "go", functions=[function]))
            assert r.status_code == 200
        first, second = trajectory.turns
        assert first.tools == [{"type": "function", "function": function}] and second.tools is first.tools

    run(fn)


class Plain(OpenAIChat):
    """A plugin protocol that does not override :meth:`Protocol.tools`."""

    name = "plain.chat"
    tools = Protocol.tools


def test_a_protocol_without_tools_records_none():
    async def fn(h):
        slot, trajectory = h.open("r1")
        await offer(h, slot, "chat", [tool("chat", "search")])
        (turn,) = trajectory.turns
        assert turn.protocol == "plain.chat" and turn.tools is None

    run(fn, protocols=[Plain()])


class RenameTools:
    @hookimpl
    async def intercept_request(self, call):
        for t in call.body.get("tools") or []:
            t["function"]["name"] = "renamed"


def test_the_turn_records_the_tools_an_interceptor_sent_upstream():
    async def fn(h):
        h.server.interceptors = load(disabled=_entry_points(), extra=[("rename", RenameTools())]).interceptors()
        slot, trajectory = h.open("r1")
        await offer(h, slot, "chat", [tool("chat", "search")])
        (turn,) = trajectory.turns
        assert [t["function"]["name"] for t in turn.tools] == ["renamed"]
        _, _, sent = h.upstream.received[-1]
        assert sent["tools"] == turn.tools

    run(fn)


def _entry_points():
    import importlib.metadata

    return {ep.name for ep in importlib.metadata.entry_points(group="lowwater")}


def test_intern_tools_remembers_a_few_distinct_lists():
    trajectory = Trajectory("r")
    lists = [[{"name": f"t{i}"}] for i in range(TOOL_LISTS_REMEMBERED + 1)]
    held = [trajectory.intern_tools(x) for x in lists]
    assert all(h is x for h, x in zip(held, lists))
    # the most recent ones are found again by value; the oldest was forgotten
    assert trajectory.intern_tools([{"name": f"t{TOOL_LISTS_REMEMBERED}"}]) is lists[-1]
    assert trajectory.intern_tools([{"name": "t1"}]) is lists[1]
    assert trajectory.intern_tools([{"name": "t0"}]) is not lists[0]
    assert trajectory.intern_tools([]) is None and trajectory.intern_tools({"tools": 1}) is None


def test_a_turn_copied_elsewhere_still_compares_by_value():
    # Turns built from parsed JSON (a rescore, a test) hold equal lists, not the same one.
    lines = [
        {"index": i, "protocol": "openai.chat", "model": "m", "request_delta": [], "completion": None, "tools": t}
        for i, t in enumerate(([{"name": "a"}], [{"name": "a"}]))
    ]
    compact = turns_to_json(turns_from_json(lines))
    assert compact[0]["tools"] == [{"name": "a"}] and compact[1].get("tools_same") and "tools" not in compact[1]


def test_lowwater_proxy_writes_and_exports_the_tools(tmp_path):
    """Trainer-facing: the proxy's trajectory line writes them once per change,
    and each exported session record carries its call's tools."""
    tools = [tool("chat", "search")]

    async def fn(url, http):
        opened = (await http.post(f"{url}/lowwater/rollouts", json={"rollout_id": "s1", "group_id": "g"})).json()
        for _ in range(2):
            r = await http.post(
                opened["base_url"] + "/chat/completions",
                json=body("chat", "go", tools=tools),
                headers={"authorization": f"Bearer {opened['api_key']}"},
            )
            assert r.status_code == 200
        assert (await http.post(f"{url}/lowwater/sessions/s1/reward", json={"reward": 1.0})).status_code == 200
        assert (await http.delete(f"{url}/lowwater/rollouts/s1")).status_code == 200
        records = (await http.post(f"{url}/lowwater/export", json={"session_ids": ["s1"]})).json()["records"]
        assert [rec["tools"] for rec in records] == [tools, tools]

    trio.run(_with_proxy, tmp_path, fn, SessionConfig())
    (line,) = (tmp_path / "trajectories.jsonl").read_bytes().splitlines()
    first, second = orjson.loads(line)["turns"]
    assert first["tools"] == tools and second["tools_same"] is True and "tools" not in second
