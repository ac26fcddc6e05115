"""docs/plugins.md's worked examples run as written: each hook's example is
executed as a plugin module, registered, and exercised; the "Testing plugins"
example runs against lowwater's own pytest fixtures."""

from __future__ import annotations

import os
import re
import sys
import types
from pathlib import Path

import httpx
import numpy as np
import pytest
import trio

from lowwater import hookspecs
from lowwater.eval import EvalConfig, run_eval
from lowwater.eval.results import read_rows
from lowwater.hookspecs import ORDERED_HOOKS
from lowwater.http import handle, read_body, send_json
from lowwater.http import serve as serve_app
from lowwater.interception import InterceptionServer
from lowwater.plugins import load
from lowwater.runtime import RuntimeConfig
from lowwater.trainer.shards import ShardConsumer
from lowwater.trainer.transport import transport_factory
from lowwater.trajectory import Trajectory
from lowwater.upstream.client import ModelClient
from lowwater.workers.backend import open_backend
from lowwater.workers.config import PoolConfig
from lowwater.workers.contract import JobSpec

DOC = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"


def _sections() -> dict[str, list[str]]:
    """Heading line -> the ``python`` code blocks under it (before the next heading)."""
    out: dict[str, list[str]] = {}
    heading = ""
    for part in re.split(r"(^#{2,3} [^\n]*$|^```python\n.*?^```$)", DOC.read_text(), flags=re.M | re.S):
        if part.startswith("#"):
            heading = part.strip()
            out.setdefault(heading, [])
        elif part.startswith("```python"):
            out[heading].append(part.removeprefix("```python\n").removesuffix("```"))
    return out


SECTIONS = _sections()


def example(heading: str) -> str:
    (block, *_) = SECTIONS[heading]
    return block


def plugin_module(heading: str, name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(example(heading), f"docs/plugins.md: {heading}", "exec"), module.__dict__)
    return module


SPECS = sorted(name for name, fn in vars(hookspecs).items() if hasattr(fn, f"{hookspecs.PROJECT}_spec"))


@pytest.mark.parametrize("hook", SPECS)
def test_every_hook_has_a_worked_example(hook):
    """A hook's own section, or (lifecycle hooks) the section's shared example, implements it."""
    (heading,) = [h for h in SECTIONS if h.startswith(f"### `{hook}(")]
    sources = SECTIONS[heading] or SECTIONS["## Lifecycle hooks (async)"]
    assert any(re.search(rf"\bdef {hook}\(", block) for block in sources), f"no worked example of {hook}"


def test_register_runtimes_example():
    plugins = load(extra=[("nice", plugin_module("### `register_runtimes(register)`", "doc_nice"))])
    runtime = plugins.runtime("nice")(RuntimeConfig(kind="nice", options={"niceness": 5}))

    async def main():
        await runtime.start()
        try:
            return await runtime.run([sys.executable, "-c", "import os; print(os.nice(0))"])
        finally:
            await runtime.stop()

    result = trio.run(main)
    assert result.ok and int(result.stdout_text) == min(os.nice(0) + 5, 19)


def test_register_protocols_example():
    plugins = load(extra=[("text", plugin_module("### `register_protocols(register)`", "doc_text"))])

    async def completions(scope, receive, send):  # the upstream: vLLM's /v1/completions, in short
        prompt = (await read_body(scope, receive, 1 << 20)).decode()
        await send_json(send, 200, {"choices": [{"text": f"echo {len(prompt)}", "finish_reason": "stop"}]})

    async def upstream(scope, receive, send):
        await handle(scope, receive, send, completions)

    async def main():
        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve_app, upstream)
            async with ModelClient(f"http://{address}/v1", retries=0) as client, httpx.AsyncClient() as http:
                server = InterceptionServer(client, protocols=list(plugins.protocols.values()))
                await nursery.start(server.run)
                trajectory = Trajectory("r1")
                slot = server.register(trajectory)
                headers = {"authorization": f"Bearer {slot.secret}"}
                r = await http.post(
                    f"{slot.base_url}/completions", json={"model": "m", "prompt": "2+2="}, headers=headers
                )
                assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("echo ")
                # Checked by the plane from the protocol's wire declaration.
                r = await http.post(f"{slot.base_url}/completions", json={"model": "m", "prompt": 1}, headers=headers)
                assert r.status_code == 400 and "prompt" in r.json()["error"]["message"], r.text
                (turn,) = trajectory.turns
                assert turn.protocol == "openai.completions" and turn.request_delta == ["2+2="]
                server.unregister("r1")
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_cleanup_policy_and_lifecycle_examples(tmp_path):
    metrics = plugin_module("## Lifecycle hooks (async)", "doc_metrics")
    policy = plugin_module("### `register_cleanup_policies(register)`", "doc_gc")
    plugins = load(extra=[("metrics", metrics), ("gc", policy)])
    config = EvalConfig(rollouts=3, group_size=2, concurrency=2, out=tmp_path / "r.jsonl")
    report = trio.run(lambda: run_eval(config, plugins=plugins))
    assert report.summary["errors"] == 0
    assert metrics.COUNTS["ok"] == 6 and metrics.COUNTS["groups_all_correct"] == 3
    assert metrics.STARTED == {}  # popped at rollout_end: nothing per rollout outlives it
    assert plugins.cleanup_policies["gc-every-50-groups"].groups == 3

    async def more():
        await plugins.fire("worker_tick", stats={"rss_bytes": 300 << 20})
        await plugins.fire("step_end", step=0, shard_ids=["s"])

    trio.run(more)
    assert metrics.COUNTS["peak_rss_mib"] >= 300


def test_register_backends_example():
    plugins = load(extra=[("capped", plugin_module("### `register_backends(register)`", "doc_capped"))])
    backend = open_backend(plugins, "capped")
    spec = JobSpec("lowwater.eval.job:EvalJob")
    assert backend.pool(spec, PoolConfig(workers=1)).config.max_rss_mb == 2048  # nothing starts before run
    assert backend.pool(spec, PoolConfig(workers=1, max_rss_mb=512)).config.max_rss_mb == 512


def test_register_shard_transports_example():
    module = plugin_module("### `register_shard_transports(register)`", "doc_inprocess")
    plugins = load(extra=[("inprocess", module)])
    owner = transport_factory(plugins, "inprocess")()
    ref = owner.put("step0/g0/token_ids", np.arange(6, dtype=np.int64).tobytes(), dtype="int64", shape=(2, 3))
    assert ref.transport == "inprocess" and ref.nbytes == 48

    async def main():
        async with httpx.AsyncClient() as client:
            consumer = ShardConsumer(client, transports={"inprocess": transport_factory(plugins, "inprocess")()})
            (view,) = await consumer.fetch([ref])
            assert np.frombuffer(view, view.dtype).reshape(view.shape).tolist() == [[0, 1, 2], [3, 4, 5]]
            del view
            consumer.drain([ref.shard_id])
            assert await owner.remove([ref]) == 1
            await consumer.aclose()

    trio.run(main)
    assert module.SHARDS == {}


def test_interceptor_examples_and_the_fixtures_example(
    monkeypatch, lowwater_trio, lowwater_upstream, lowwater_interceptor, lowwater_runtime
):
    redact = plugin_module("### `intercept_request(call)`", "my_plugin")
    meter = plugin_module("### `intercept_response(call, response)`", "doc_meter")
    assert {"intercept_request"} <= set(vars(redact)) and ORDERED_HOOKS & set(vars(meter))
    monkeypatch.setitem(sys.modules, "my_plugin", redact)
    tests = types.ModuleType("doc_tests")
    exec(compile(example("## Testing plugins"), "docs/plugins.md: Testing plugins", "exec"), tests.__dict__)
    tests.test_the_model_answers(lowwater_upstream)
    tests.test_emails_never_reach_the_model(lowwater_interceptor)
    tests.test_a_program_in_the_runtime(lowwater_trio, lowwater_runtime)

    # The rejecting half of the intercept_request example, and the meter.
    lowwater_interceptor.server.interceptors = load(extra=[("mine", redact), ("meter", meter)]).interceptors()
    slot = lowwater_interceptor.open_rollout("r2")
    url, headers = f"{slot.base_url}/chat/completions", {"authorization": f"Bearer {slot.secret}"}
    ask = {"model": "scripted", "messages": [{"role": "user", "content": "what is 2 plus 2"}]}
    assert httpx.post(url, headers=headers, json=ask).status_code == 200
    assert meter.TOKENS["r2"] > 0
    r = httpx.post(url, headers=headers, json={**ask, "max_tokens": 5000})
    assert r.status_code == 400 and "max_tokens above 4096" in r.json()["error"]["message"]
    lowwater_interceptor.close_rollout("r2")


def test_environment_tutorial(tmp_path):
    tutorial = plugin_module("## Tutorial: an environment plugin in five minutes", "doc_doubling")
    plugins = load(extra=[("doubling", tutorial)])
    config = EvalConfig(env="doubling", rollouts=3, concurrency=2, out=tmp_path / "r.jsonl")
    report = trio.run(lambda: run_eval(config, plugins=plugins))
    # The scripted model has no script for these prompts: the run works end to end, the answers are wrong.
    assert report.summary["errors"] == 0 and report.summary["accuracy"] == 0.0
    _header, rows, _torn = read_rows(config.out)
    assert sorted(row["task_id"] for row in rows) == [0, 1, 2] and all(row["turns"] == 1 for row in rows)
