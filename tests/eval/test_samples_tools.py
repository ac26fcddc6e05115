"""The tools an agent offers reach the samples file, through each of the
three protocols: written on the first turn and on each change, marked
``tools_same`` on a turn that offered them again, read back by
``lowwater score``; and the trajectories are gone after the run."""

from __future__ import annotations

import orjson
import pytest
import trio

from lowwater import plugins as plugins_mod
from lowwater.environment import Score
from lowwater.envs.default import ArithmeticEnvironment
from lowwater.eval import EvalConfig, run_eval
from lowwater.eval.rescore import rescore
from lowwater.eval.results import read_rows
from lowwater.eval.samples import SAMPLES_TYPE, samples_path

SCHEMA = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
# Each protocol's own spelling of a function tool, and where its requests go.
TOOLS = {
    "chat": [{"type": "function", "function": {"name": "calculator", "parameters": SCHEMA}}],
    "responses": [{"type": "function", "name": "calculator", "parameters": SCHEMA}],
    "messages": [{"name": "calculator", "input_schema": SCHEMA}],
}
SUBMIT = {
    "chat": [{"type": "function", "function": {"name": "submit", "parameters": SCHEMA}}],
    "responses": [{"type": "function", "name": "submit", "parameters": SCHEMA}],
    "messages": [{"name": "submit", "input_schema": SCHEMA}],
}
PROTOCOL = {"chat": "openai.chat", "responses": "openai.responses", "messages": "anthropic.messages"}


def request(kind: str, model: str, prompt: str, tools: list | None, stream: bool) -> tuple[str, dict]:
    messages = [{"role": "user", "content": prompt}]
    out: dict = {"model": model, "stream": stream}
    if kind == "chat":
        path, out["messages"] = "/chat/completions", messages
    elif kind == "responses":
        path, out["input"] = "/responses", messages
    else:
        path, out["messages"], out["max_tokens"] = "/messages", messages, 256
    if tools is not None:
        out["tools"] = tools
    return path, out


class ToolsAgent(ArithmeticEnvironment):
    """Four calls through one protocol: the calculator, the calculator again
    (streamed), a different tool, no tools.  The rubric reads the tools back."""

    def __init__(self, kind: str) -> None:
        super().__init__(size=4)
        self.kind = kind

    async def harness(self, ctx):
        plan = [(TOOLS[self.kind], False), (TOOLS[self.kind], True), (SUBMIT[self.kind], False), (None, False)]
        for tools, stream in plan:
            path, payload = request(self.kind, ctx.model, ctx.task.prompt, tools, stream)
            response = await ctx.http.post(
                ctx.base_url + path, content=orjson.dumps(payload), headers={"authorization": f"Bearer {ctx.api_key}"}
            )
            assert response.status_code == 200, response.text
        ctx.rollout.state["final_text"] = "done"

    async def score(self, rollout):
        turns = rollout.trajectory.turns
        ok = [t.tools for t in turns] == [TOOLS[self.kind], TOOLS[self.kind], SUBMIT[self.kind], None]
        return Score(1.0 if ok else 0.0, {"correct": ok, "tools_seen": ok})


def transcripts(path):
    lines = path.read_bytes().splitlines()
    assert orjson.loads(lines[0])["type"] == SAMPLES_TYPE
    return [orjson.loads(line) for line in lines[1:]]


@pytest.mark.parametrize("kind", ["chat", "responses", "messages"])
def test_the_samples_line_has_the_tools_offered(tmp_path, kind):
    plugins = plugins_mod.load()
    plugins.environments["tools-agent"] = lambda options: ToolsAgent(kind)
    config = EvalConfig(env="tools-agent", rollouts=3, out=tmp_path / "r.jsonl")
    report = trio.run(lambda: run_eval(config, plugins=plugins))
    assert report.leftovers["trajectories"] == 0 and report.leftovers["intercepts"] == 0
    _, rows, _ = read_rows(config.out)
    assert [r["error"] for r in rows] == [None] * 3
    assert all(r["metrics"]["tools_seen"] for r in rows)  # the rubric saw each turn's tools
    samples = transcripts(samples_path(config.out))
    assert len(samples) == 3
    for s in samples:
        turns = s["turns"]
        assert [t["protocol"] for t in turns] == [PROTOCOL[kind]] * 4
        assert turns[0]["tools"] == TOOLS[kind] and "tools_same" not in turns[0]
        assert turns[1].get("tools_same") is True and "tools" not in turns[1] and turns[1]["streamed"]
        assert turns[2]["tools"] == SUBMIT[kind]
        assert "tools" in turns[3] and turns[3]["tools"] is None
    # lowwater score rebuilds the turns, each with its tools again
    rescored = trio.run(lambda: rescore(config.out, plugins=plugins))
    assert rescored.rescored == 3 and rescored.changed == 0
