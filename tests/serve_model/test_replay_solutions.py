"""Replay without HTTP: cutting annotated solutions into turns, the question index, loading errors."""

from __future__ import annotations

import pytest

from lowwater.serve_model import ModelError, ReplayDataError, ReplayModel, UnknownQuestion
from lowwater.serve_model.replay import annotation_matches, normalize, solution_turn

from ._client import SOLUTIONS, gsm8k_rows, replay_model, requires_data

COLUMNS = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")


def offline_walk(model: ReplayModel, question: str) -> list:
    """Call the model's turn function as a stateless server would, one more tool result each time."""
    turns = []
    while True:
        turn = model.reply(question, len(turns))
        turns.append(turn)
        if turn.tool_call is None:
            return turns
        assert len(turns) < 1000


@requires_data
def test_every_175b_verification_solution_is_rebuilt_exactly():
    model = replay_model("175b_verification")
    rows = gsm8k_rows()
    assert len(rows) == 1319 and len(model.solutions) == 1319
    steps_seen = 0
    for row in rows:
        recorded = row["175b_verification"]["solution"]
        turns = offline_walk(model, row["question"])
        assert "".join(t.text + (t.annotation or "") for t in turns) == recorded
        marks = annotation_matches(recorded)
        assert len(turns) == len(marks) + 1
        for turn, mark in zip(turns, marks):
            assert turn.tool_call.name == "calculator"
            assert turn.tool_call.expression == mark.group(1).split("=", 1)[0]
            assert turn.annotation == mark.group(0)
        assert turns[-1].text.splitlines()[-1] == recorded.splitlines()[-1]
        steps_seen += len(marks)
        # Past the last turn, more tool results are a client error, not a crash.
        with pytest.raises(ModelError, match="calculator steps"):
            model.reply(row["question"], len(turns))
    assert steps_seen > 2 * len(rows)


@requires_data
def test_other_columns_and_ground_truth_are_rebuilt_too():
    rows = gsm8k_rows()
    for column in (*COLUMNS[:3], "ground_truth"):
        model = replay_model(column)
        for row in rows:
            recorded = row[column] if column == "ground_truth" else row[column]["solution"]
            turns = offline_walk(model, row["question"])
            assert "".join(t.text + (t.annotation or "") for t in turns) == recorded, column


def test_turns_are_cut_at_annotations():
    solution = "Half is 48/2 = <<48/2=24>>24.\nThen <<24+1=25>><<25*2=50>>50.\nA: 50"
    turns = [solution_turn(solution, k, "id_") for k in range(4)]
    assert [t.text for t in turns] == ["Half is 48/2 = ", "24.\nThen ", "", "50.\nA: 50"]
    assert [t.tool_call.expression for t in turns[:3]] == ["48/2", "24+1", "25*2"]
    assert [t.tool_call.id for t in turns[:3]] == ["id_0", "id_1", "id_2"]
    assert turns[0].tool_call.arguments == '{"expression":"48/2"}'
    assert turns[3].tool_call is None
    with pytest.raises(ModelError):
        solution_turn(solution, 4, "id_")


def test_odd_annotations():
    # No annotation: one turn.  A "<<" never closed (a truncated recording) is text.
    assert solution_turn("It is 5.\nA: 5", 0, "x").text == "It is 5.\nA: 5"
    cut = "So 3/440 = <<3/440=0.0068181818"
    assert solution_turn(cut, 0, "x").text == cut and solution_turn(cut, 0, "x").tool_call is None
    # No "=" inside: the whole content is the expression.
    turn = solution_turn("about <<83.33>>83", 0, "x")
    assert turn.tool_call.expression == "83.33" and turn.annotation == "<<83.33>>"
    # Without a calculator tool the whole recording is one turn, verbatim.
    solution = "a <<1+1=2>>2\nA: 2"
    assert solution_turn(solution, 0, "x", tools=False).text == solution
    with pytest.raises(ModelError, match="offers no calculator"):
        solution_turn(solution, 1, "x", tools=False)


@requires_data
def test_question_lookup():
    model = replay_model()
    row = gsm8k_rows()[5]
    question, solution = row["question"], row["175b_verification"]["solution"]
    assert model.solution(question) == solution
    assert model.solution("  " + question.replace(" ", "\n  ") + "\n") == solution  # whitespace
    assert model.solution("Solve it; end with 'A: N'.\n\nThink.\n \n" + question) == solution  # instruction prefix
    with pytest.raises(UnknownQuestion, match="unknown question"):
        model.solution(question + " And one more thing?")
    with pytest.raises(UnknownQuestion):
        model.reply("What is the airspeed of an unladen swallow?", 0)
    # Tool call ids are stable per question and turn, and differ between questions.
    first = model.reply(question, 0).tool_call.id
    assert first == model.reply(question, 0).tool_call.id != model.reply(gsm8k_rows()[6]["question"], 0).tool_call.id


@requires_data
def test_index_holds_one_column_only():
    model = replay_model()
    assert model.name == "replay:175b_verification"
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in model.solutions.items())
    row = gsm8k_rows()[0]
    assert model.solutions[normalize(row["question"])] == row["175b_verification"]["solution"]


@requires_data
def test_bad_files(tmp_path):
    with pytest.raises(ReplayDataError, match="cannot read"):
        ReplayModel.from_jsonl(tmp_path / "missing.jsonl", "x")
    with pytest.raises(ReplayDataError, match=r"unknown column 'nope' \(columns: ground_truth, 6b_finetuning"):
        ReplayModel.from_jsonl(SOLUTIONS, "nope")
    cases = {
        '{"question": "q", "a": "s"}\n\n{"question": "r", "a": \n': r":3: malformed JSON line",
        '{"question": "q", "a": "s"}\n[1, 2]\n': r":2: a line must be a JSON object",
        '{"q": "q", "a": "s"}\n': r':1: no "question" string',
        '{"question": "q", "a": {"is_correct": true}}\n': r":1: column 'a' is neither",
        '{"question": "q", "b": "s"}\n': r":1: unknown column 'a' \(columns: b\)",
        "\n\n": "no rows",
    }
    for i, (text, message) in enumerate(cases.items()):
        path = tmp_path / f"case{i}.jsonl"
        path.write_text(text)
        with pytest.raises(ReplayDataError, match=message) as info:
            ReplayModel.from_jsonl(path, "a")
        assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_blank_lines_and_repeats(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('{"question": "Q  one?", "a": "first"}\n\n{"question": "Q one?", "a": "second"}\n')
    model = ReplayModel.from_jsonl(path, "a", latency_s=0.5, payload_bytes=7)
    assert model.solutions == {"Q one?": "first"}
    assert (model.latency_s, model.payload_bytes) == (0.5, 7)
    assert model.reply("Q one?", 0).text == "first"
