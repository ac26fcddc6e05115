"""The scripted model without HTTP: it solves the embedded default's problems from their text alone."""

from __future__ import annotations

import pytest

from lowwater.envs.arithmetic import problem
from lowwater.serve_model import ModelError, ScriptedModel, tokens
from lowwater.serve_model.scripted import arithmetic_solution


def test_recognises_every_generated_problem():
    # All four templates occur many times over these 2,000 problems.
    for seed in (0, 1, 7, 2**31):
        for index in range(500):
            p = problem(seed, index)
            assert arithmetic_solution(p.question) == p.solution, p


def test_walks_a_problem_to_its_answer_with_calculator_calls():
    model = ScriptedModel()
    for index in range(40):
        p = problem(3, index)
        message = "You have a calculator tool.\n\n" + p.question + "\nAnswer with 'A: N'."
        turns = []
        while not turns or turns[-1].tool_call:
            turns.append(model.reply(message, len(turns)))
        assert [t.tool_call.expression for t in turns[:-1]] == list(p.steps)
        assert turns[-1].text.splitlines()[-1] == f"A: {p.answer}"
        assert "".join(t.text + (t.annotation or "") for t in turns) == p.solution
        with pytest.raises(ModelError):
            model.reply(message, len(turns))


def test_near_misses_fall_back_to_filler():
    p = problem(0, 0)
    assert p.question.startswith("Ines bakes 15 trays")
    decoys = [
        p.question.replace("Ines", "Zed"),  # a name the generator never uses
        p.question.replace("15 trays", "16 trays"),  # out of the generator's range (3..15)
        p.question.replace("full bags", "bags"),  # another template
        p.question.replace(" ", "")[:40],
    ]
    model = ScriptedModel(completion_tokens=7)
    for decoy in decoys:
        assert arithmetic_solution(decoy) is None, decoy
        reply = model.reply(decoy, 0)
        assert reply.tool_call is None and tokens.count(reply.text) == 7
        # The filler ignores the conversation: any number of tool results is fine.
        assert model.reply(decoy, 3) == reply


def test_filler_has_the_configured_token_count():
    for n in (1, 16, 1000):
        text = ScriptedModel(completion_tokens=n).reply("hello", 0).text
        assert tokens.count(text) == n == len(tokens.split(text))
    with pytest.raises(ValueError):
        ScriptedModel(completion_tokens=0)


def test_registry_is_consulted_first():
    model = ScriptedModel(solutions={"What is  2+2?": "Two and two: <<2+2=4>>4\nA: 4"})
    first = model.reply("Please answer.\n\nWhat is 2+2?", 0)
    assert first.text == "Two and two: " and first.tool_call.expression == "2+2"
    assert model.reply("What is 2+2?", 1).text == "4\nA: 4"
    # Without a calculator tool the solution comes whole.
    assert model.reply("What is 2+2?", 0, tools=False).text == "Two and two: <<2+2=4>>4\nA: 4"


def test_fake_tokens_are_deterministic():
    text = "Janet’s ducks lay 16 eggs.\n"
    assert "".join(tokens.split(text)) == text
    assert tokens.ids(text) == tokens.ids(text) and all(0 <= i < tokens.VOCAB for i in tokens.ids(text))
    assert all(-2 < tokens.logprob(t) <= 0 for t in tokens.split(text))
    entry = tokens.logprob_entry("eggs", top=3, as_ids=True)
    assert entry["token"] == f"token_id:{tokens.token_id('eggs')}"
    assert [e["logprob"] for e in entry["top_logprobs"]] == sorted(
        (e["logprob"] for e in entry["top_logprobs"]), reverse=True
    )
    assert tokens.logprob_entry("\ud800x")["bytes"]  # a lone surrogate from JSON does not crash
    assert tokens.prompt_count(0) == 1 and tokens.prompt_count(400) == 100
