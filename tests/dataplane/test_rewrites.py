"""The data plane's request rewrites, per-rollout upstreams and ``GET /v1/models``:
the scripted upstream records each body it receives, compared with the body
the interception server has always forwarded (the model override, the
logprob fields of ``request_logprobs``, then ``sampling.apply``), written
out here as the oracle.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
import trio

from dataplane.test_binding import CHAT, Rig, run
from interception.upstream import Upstream
from lowwater._native import DataPlane, DataPlaneConfigError
from lowwater.http import serve
from lowwater.interception.dataplane import rewrites_for
from lowwater.interception.protocols import Protocol, builtin_protocols
from lowwater.interception.sampling import apply as apply_sampling
from lowwater.trajectory import Trajectory

PROTOCOLS = {p.name: p for p in builtin_protocols()}
PATHS = {"openai.chat": "/chat/completions", "openai.responses": "/responses", "anthropic.messages": "/messages"}
SAMPLING = {"max_tokens": 64, "temperature": 0.5}


def python_forwards(protocol: Protocol, body: dict[str, Any], *, model: str | None) -> dict[str, Any]:
    """The body the interception server forwards (request_logprobs on, SAMPLING)."""
    out = dict(body)
    if model is not None:
        out["model"] = model
    if protocol.name == "openai.chat":
        out.update(logprobs=True, return_token_ids=True)
    elif protocol.name == "openai.responses" and isinstance(out.get("include"), (list, type(None))):
        include = out.get("include") or []
        if "message.output_text.logprobs" not in include:
            out["include"] = [*include, "message.output_text.logprobs"]
    return apply_sampling(protocol.name, out, SAMPLING) or out


def open_rollout(r: Rig, rollout_id: str, secret: str, **options: Any) -> Trajectory:
    trajectory = Trajectory(rollout_id)
    r.trajectories[rollout_id] = trajectory
    r.plane.register(rollout_id, secret, **options)
    return trajectory


BODIES: list[tuple[str, dict[str, Any]]] = [
    ("openai.chat", {"model": "agent", "messages": [{"role": "user", "content": "hi"}]}),
    (
        "openai.chat",
        {"model": "agent", "messages": [{"role": "user", "content": "hi"}], "logprobs": False, "max_tokens": 5},
    ),
    ("openai.chat", {"model": "agent", "messages": [{"role": "user", "content": "hi"}], "temperature": None}),
    ("openai.responses", {"model": "agent", "input": "hi"}),
    ("openai.responses", {"model": "agent", "input": "hi", "include": ["x"], "max_output_tokens": 9}),
    ("openai.responses", {"model": "agent", "input": "hi", "include": None}),
    ("openai.responses", {"model": "agent", "input": "hi", "include": "not a list"}),
    ("anthropic.messages", {"model": "agent", "max_tokens": 7, "messages": [{"role": "user", "content": "hi"}]}),
]


@pytest.mark.parametrize("model", [None, "served", "agent"])
def test_the_upstream_gets_what_the_python_server_forwards(model: str | None) -> None:
    async def body(r: Rig) -> None:
        trajectory = open_rollout(r, "r1", "s1", model=model)
        for name, sent in BODIES:
            answer = await r.http.post(r.base_url + PATHS[name], json=sent, headers={"authorization": "Bearer s1"})
            assert answer.status_code == 200, answer.text
            path, headers, received = r.upstream.received[-1]
            assert received == python_forwards(PROTOCOLS[name], sent, model=model), (name, sent)
        while len(trajectory.turns) < len(BODIES):
            await trio.sleep(0.01)
        assert [t.model for t in trajectory.turns] == ["agent"] * len(BODIES), "the model the agent asked for"
        assert trajectory.turns[0].request_delta == BODIES[0][1]["messages"], "the agent's messages, not rewritten"

    run(body, rewrites=rewrites_for(SAMPLING, request_logprobs=True))


def test_without_rewrites_the_agents_body_is_forwarded() -> None:
    async def body(r: Rig) -> None:
        open_rollout(r, "r1", "s1")
        sent = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True}
        answer = await r.http.post(r.base_url + CHAT, json=sent, headers={"authorization": "Bearer s1"})
        assert answer.status_code == 200
        assert r.upstream.received[-1][2] == sent

    run(body)


def test_each_rollout_goes_to_its_own_upstream_with_its_own_key() -> None:
    async def body(r: Rig) -> None:
        other = Upstream()
        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve, other)
            open_rollout(r, "plain", "s0")
            open_rollout(r, "own", "s1", upstream=f"http://{address}/v1", api_key="other-key")
            open_rollout(r, "own-url", "s2", upstream=f"http://{address}/v1")
            open_rollout(r, "own-key", "s3", api_key="k3")
            for secret, upstream, key in [
                ("s0", r.upstream, "upstream-key"),
                ("s1", other, "other-key"),
                ("s2", other, "upstream-key"),
                ("s3", r.upstream, "k3"),
            ]:
                before = len(upstream.received)
                answer = await r.chat(secret, [{"role": "user", "content": secret}])
                assert answer.status_code == 200, answer.text
                path, headers, received = upstream.received[-1]
                assert len(upstream.received) == before + 1
                assert path == "/v1/chat/completions"
                assert headers["authorization"] == f"Bearer {key}"
                assert headers["x-api-key"] == key
                assert received["messages"] == [{"role": "user", "content": secret}]
            assert len(other.received) == 2 and len(r.upstream.received) == 2
            nursery.cancel_scope.cancel()

    run(body)


def python_models(name: str) -> dict[str, Any]:
    """``InterceptionServer._models``'s answer."""
    model = {
        "id": name,
        "object": "model",
        "type": "model",
        "created": 0,
        "owned_by": "lowwater",
        "display_name": name,
        "created_at": "1970-01-01T00:00:00Z",
    }
    return {"object": "list", "data": [model], "has_more": False, "first_id": name, "last_id": name}


def test_models_lists_the_rollouts_model() -> None:
    async def body(r: Rig) -> None:
        open_rollout(r, "plain", "s0")
        open_rollout(r, "named", "s1", model="qwen")
        url = r.base_url + "/models"
        for secret, name in [("s0", "lowwater-upstream"), ("s1", "qwen")]:
            answer = await r.http.get(url, headers={"authorization": f"Bearer {secret}"})
            assert answer.status_code == 200
            assert answer.headers["content-type"] == "application/json"
            assert answer.json() == python_models(name)
        assert (await r.http.get(url)).status_code == 401
        assert (await r.http.get(url, headers={"x-api-key": "nope"})).status_code == 401
        assert (await r.http.post(url, headers={"x-api-key": "s0"})).status_code == 405
        stats = await r.settled()
        assert stats["calls"] == 0 and not r.records, "listing models is not a call"

    run(body)


def test_the_openai_sdk_lists_the_model() -> None:
    async def body(r: Rig) -> None:
        open_rollout(r, "named", "s1", model="qwen")
        async with httpx.AsyncClient() as http:
            client = openai.AsyncOpenAI(base_url=r.base_url, api_key="s1", http_client=http)
            models = await client.models.list()
        assert [m.id for m in models.data] == ["qwen"]

    run(body)


@pytest.mark.parametrize(
    "rewrites",
    [
        {"openai.chat": {"set": {"logprobs": "tru"}}},
        {"openai.chat": {"defaults": {"max_tokens": ("", ("max_tokens",))}}},
        {"openai.chat": {"append": {"include": "[1"}}},
        {"openai.chat": {"replace": {"k": "1"}}},
        {"no.such.protocol": {"set": {"k": "1"}}},
    ],
)
def test_bad_rewrites_are_config_errors(rewrites: Any) -> None:
    with pytest.raises(DataPlaneConfigError):
        DataPlane("http://127.0.0.1:1/v1", rewrites=rewrites)


def test_misshapen_rewrites_are_type_errors() -> None:
    for rewrites in [["openai.chat"], {"openai.chat": {"set": {"k": 1}}}, {"openai.chat": {"defaults": {"k": "1"}}}]:
        with pytest.raises(TypeError):
            DataPlane("http://127.0.0.1:1/v1", rewrites=rewrites)


def test_bad_rollout_upstreams_are_config_errors() -> None:
    with DataPlane("http://127.0.0.1:1/v1") as plane:
        for options in [
            {"upstream": "ftp://host/v1"},
            {"upstream": "not a url"},
            {"api_key": "bad\nkey"},
        ]:
            with pytest.raises(DataPlaneConfigError):
                plane.register("r", "s", **options)
        assert plane.stats()["open_rollouts"] == 0
        plane.register("r", "s", upstream="http://127.0.0.1:2/v1", api_key="k", model="m")
        plane.register("r2", "s2", upstream="https://api.example.com/v1")  # TLS is built in
        assert plane.stats()["open_rollouts"] == 2


def test_rewrites_for_spells_each_protocols_keys() -> None:
    rules = rewrites_for({"max_tokens": 512, "seed": 1}, request_logprobs=True)
    aliases = ("max_tokens", "max_completion_tokens", "max_output_tokens")
    assert rules["openai.chat"] == {
        "set": {"logprobs": "true", "return_token_ids": "true"},
        "defaults": {"max_tokens": ("512", aliases), "seed": ("1", ("seed",))},
    }
    assert rules["openai.responses"]["defaults"]["max_output_tokens"] == ("512", aliases)
    assert rules["openai.responses"]["append"] == {"include": '"message.output_text.logprobs"'}
    assert "set" not in rules["anthropic.messages"] and "append" not in rules["anthropic.messages"]
    assert rewrites_for({}, request_logprobs=False) == {}
