"""The official ``openai`` and ``anthropic`` SDKs (sync, in a worker thread) against serve-model.

The SDKs' streaming helpers accumulate the events themselves, so they check
that each protocol's event format is the real one.
"""

from __future__ import annotations

import anthropic
import openai
import trio

from _sdk_agents import AGENTS
from lowwater.envs.arithmetic import problem
from lowwater.serve_model import ScriptedModel

from ._client import PROTOCOLS, gsm8k_rows, replay_model, requires_data, run_with_server


def in_thread(model, fn):
    async def body(url, client):
        return await trio.to_thread.run_sync(fn, url)

    return run_with_server(model, body)


def all_agents(url: str, question: str) -> list[tuple[str, int]]:
    """Every SDK agent, streamed and not, on ``question`` against serve-model at ``url``."""
    return [
        AGENTS[protocol](url if protocol == "messages" else url + "/v1", "unused", question, stream)
        for protocol in PROTOCOLS
        for stream in (False, True)
    ]


def test_sdks_solve_a_scripted_problem_streamed_and_not():
    p = problem(4, 9)
    for text, calls in in_thread(ScriptedModel(), lambda url: all_agents(url, p.question)):
        assert text.splitlines()[-1] == f"A: {p.answer}" and calls == len(p.steps)


@requires_data
def test_sdks_replay_a_gsm8k_row_streamed_and_not():
    row = gsm8k_rows()[17]
    recorded = row["175b_finetuning"]["solution"]
    for text, calls in in_thread(replay_model("175b_finetuning"), lambda url: all_agents(url, row["question"])):
        assert text.splitlines()[-1] == recorded.splitlines()[-1] and calls == recorded.count(">>")


@requires_data
def test_sdk_errors_carry_the_reason():
    def ask(url):
        out = []
        try:
            openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Who are you?"}]
            )
        except openai.BadRequestError as exc:
            out.append(str(exc))
        try:
            anthropic.Anthropic(base_url=url, api_key="k", max_retries=0).messages.create(
                model="m", max_tokens=10, messages=[{"role": "user", "content": "Who are you?"}]
            )
        except anthropic.BadRequestError as exc:
            out.append(str(exc))
        models = openai.OpenAI(base_url=url + "/v1", api_key="k").models.list()
        out.append([m.id for m in models])
        return out

    chat_error, messages_error, models = in_thread(replay_model(), ask)
    assert "unknown question" in chat_error and "unknown question" in messages_error
    assert models == ["replay:175b_verification"]
