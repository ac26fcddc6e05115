"""lowwater.harness, the public helpers environments share: the chat tool loop,
answer extraction, and the program agent on persistent and ephemeral runtimes."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import httpx
import orjson
import pytest
import trio

from lowwater import harness
from lowwater.eval import EvalConfig, run_eval
from lowwater.eval.results import read_rows
from lowwater.rollout import RolloutFailed

GSM8K_PLUGIN = Path(__file__).resolve().parents[2] / "plugins" / "lowwater-gsm8k" / "src" / "lowwater_gsm8k"


def test_final_answer_and_numbers():
    assert harness.final_answer("work\nA: 1,050.\n") == "1,050."
    assert harness.final_answer("A: 1\n#### 2") == "2"  # the last marker line
    assert harness.final_answer("no marker") is None and harness.final_answer(None) is None
    assert harness.same_number("$1,050.", "1050") and harness.same_number("0.5", "1/2")
    assert not harness.same_number("none", "1") and harness.to_number("x") is None


def _model(replies: list[dict]) -> tuple[httpx.AsyncClient, list[dict]]:
    """A client whose transport answers chat calls with ``replies`` in order."""
    bodies: list[dict] = []

    def handle(request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == "Bearer key"
        bodies.append(orjson.loads(request.content))
        reply = replies[len(bodies) - 1]
        if "status" in reply:
            return httpx.Response(reply["status"], text="upstream down")
        return httpx.Response(200, json={"choices": [{"message": reply}]})

    return httpx.AsyncClient(transport=httpx.MockTransport(handle)), bodies


def _call(expression: str) -> dict:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "calculator", "arguments": orjson.dumps({"expression": expression}).decode()},
            }
        ],
    }


def test_chat_tool_loop_answers_tool_calls_then_returns_the_final_text():
    http, bodies = _model([_call("6*7"), {"role": "assistant", "content": "A: 42"}])

    async def main():
        async with http:
            return await harness.chat_tool_loop(http, "http://m/v1", "key", "q?", model="m", max_turns=4)

    assert trio.run(main) == "A: 42"
    assert bodies[0]["tools"] == [harness.CALCULATOR_TOOL]
    assert bodies[0]["messages"][0] == {"role": "system", "content": harness.SYSTEM_PROMPT}
    assert bodies[1]["messages"][-1] == {"role": "tool", "tool_call_id": "c1", "content": "42"}


@pytest.mark.parametrize(
    ("replies", "error_class"),
    [([{"status": 500}], "model"), ([_call("1+1")] * 2, "environment")],
)
def test_chat_tool_loop_failures_are_classified(replies, error_class):
    http, _ = _model(replies)

    async def main():
        async with http:
            await harness.chat_tool_loop(http, "http://m/v1", "key", "q?", model="m", max_turns=2)

    with pytest.raises(RolloutFailed) as info:
        trio.run(main)
    assert info.value.error_class == error_class


def test_run_calculator_never_raises():
    assert harness.run_calculator('{"expression": "2**10"}') == "1024"
    assert harness.run_calculator("not json").startswith("error:")
    assert harness.run_calculator('{"expression": "__import__(1)"}').startswith("error:")


@pytest.mark.parametrize("persistent", [True, False])
def test_program_agent_on_persistent_and_ephemeral_runtimes(tmp_path, persistent):
    config = EvalConfig(rollouts=2, concurrency=2, harness="program", persistent=persistent, out=tmp_path / "r.jsonl")
    report = trio.run(run_eval, config)
    _, rows, _ = read_rows(config.out)
    assert [r["error"] for r in rows] == [None, None], rows
    assert all(r["metrics"]["correct"] and r["turns"] >= 2 for r in rows)
    assert report.leftovers["trajectories"] == 0 and report.leftovers["runtimes"] == 0


def test_old_paths_warn_and_alias_the_public_helpers():
    import importlib
    import sys

    for name in ("lowwater.envs.agent", "lowwater.envs.answers"):
        sys.modules.pop(name, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(name)
        assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    assert module.final_answer is harness.final_answer


def test_gsm8k_plugin_uses_public_lowwater_modules_only():
    """The plugin is the model third-party plugin: nothing from lowwater.envs,
    no private names, no runtime internals."""
    public = {"lowwater.environment", "lowwater.harness", "lowwater.hookspecs", "lowwater.rollout"}
    for source in GSM8K_PLUGIN.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            # Whether a runtime is persistent is the engine's business (Rollout.run_script).
            assert not (isinstance(node, ast.Attribute) and node.attr == "config"), source.name
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lowwater."):
                assert node.module in public, (source.name, node.module)
                assert not any(alias.name.startswith("_") for alias in node.names), (source.name, node.module)
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("lowwater.") for a in node.names), source.name
