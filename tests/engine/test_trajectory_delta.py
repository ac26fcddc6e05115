"""Trajectory.message_delta: what a turn records of the history an agent resends."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lowwater.trajectory import Trajectory

message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool"]), "content": st.text(max_size=3)}
)


@st.composite
def histories(draw):
    """Successive requests of one agent: appends, truncations, one message
    rewritten, and sliding windows of the same length."""
    history = draw(st.lists(message, max_size=4))
    out = [history]
    for _ in range(draw(st.integers(1, 8))):
        op = draw(st.sampled_from(["append", "truncate", "rewrite", "window", "same"]))
        if op == "append":
            history = history + draw(st.lists(message, min_size=1, max_size=3))
        elif op == "truncate":
            history = history[: draw(st.integers(0, len(history)))]
        elif op == "rewrite" and history:
            i = draw(st.integers(0, len(history) - 1))
            history = [*history[:i], draw(message), *history[i + 1 :]]
        elif op == "window" and history:
            history = [*history[1:], draw(message)]
        out.append([dict(m) for m in history])  # parsed afresh per request, as the proxy does
    return out


@given(histories())
def test_each_request_is_rebuilt_from_the_turns(requests):
    t = Trajectory("r")
    previous: list = []
    for request in requests:
        start, delta = t.message_delta(request)
        assert 0 <= start <= len(previous)
        assert previous[:start] + delta == request
        if start:  # appended: only the new messages are recorded
            assert len(delta) == len(request) - len(previous)
        previous = request


def test_a_rewrite_of_equal_length_is_recorded_whole():
    t = Trajectory("r")
    first = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert t.message_delta(first) == (0, first)
    window = [{"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert t.message_delta(window) == (0, window)  # length alone said (2, [])
    grown = [*window, {"role": "assistant", "content": "d"}, {"role": "user", "content": "e"}]
    assert t.message_delta(grown) == (2, grown[2:])
    assert t.message_delta(list(grown)) == (4, [])  # the same request again
    assert t.message_delta([]) == (0, [])
    assert t.message_delta(first) == (0, first)
