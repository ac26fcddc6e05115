"""Hypothesis strategies for plugin authors: tasks, turns and request bodies.

Request bodies come in the three built-in wire protocols and include the
awkward cases a proxy must survive: multimodal content with base64 images,
tool calls and tool results, unicode, empty strings and streaming flags.
Use :func:`malformed_bodies` for inputs that must be refused with a 4xx.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import orjson
from hypothesis import strategies as st

from lowwater.environment import Task
from lowwater.trajectory import Turn

PROTOCOLS = ("openai.chat", "openai.responses", "anthropic.messages")

_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=200)
_ids = st.from_regex(r"[a-z0-9]{1,12}", fullmatch=True)


def tasks(ids: st.SearchStrategy[Any] | None = None) -> st.SearchStrategy[Task]:
    """:class:`lowwater.environment.Task` with int or str ids, any prompt text."""
    return st.builds(
        Task,
        id=ids if ids is not None else st.one_of(st.integers(0, 10**6), _ids),
        prompt=_text,
        answer=st.integers(-(10**6), 10**6).map(str),
        metadata=st.dictionaries(_ids, st.integers() | _text, max_size=3),
    )


def images(max_bytes: int = 4096) -> st.SearchStrategy[str]:
    """A ``data:image/png;base64,...`` URL of random bytes (size up to ``max_bytes``)."""
    return st.binary(min_size=1, max_size=max_bytes).map(
        lambda b: "data:image/png;base64," + base64.b64encode(b).decode()
    )


#: Sizes of the large images :func:`large_images` draws (bytes before base64):
#: around the tables' default 1 MiB mmap threshold, so request bodies cross
#: from heap to their own mapping (a path small bodies never reach).
LARGE_IMAGE_BYTES = (768 << 10, (1 << 20) - 1, 1 << 20, 3 << 19)


def large_images() -> st.SearchStrategy[str]:
    """A data URL of one of :data:`LARGE_IMAGE_BYTES` pseudo-random bytes
    (seeded by Hypothesis, so failures shrink and replay)."""
    return st.tuples(st.sampled_from(LARGE_IMAGE_BYTES), st.integers(0, 2**32 - 1)).map(
        lambda ns: "data:image/png;base64," + base64.b64encode(random.Random(ns[1]).randbytes(ns[0])).decode()
    )


def chat_messages(max_size: int = 8) -> st.SearchStrategy[list[dict[str, Any]]]:
    """OpenAI chat ``messages``: system/user/assistant/tool, text or multimodal parts."""
    user_content = st.one_of(
        _text,
        st.lists(
            st.one_of(
                st.builds(lambda t: {"type": "text", "text": t}, _text),
                st.builds(lambda u: {"type": "image_url", "image_url": {"url": u}}, images()),
                # Rarely (one draw in ten of a part): a body past the mmap threshold.
                st.builds(
                    lambda u: {"type": "image_url", "image_url": {"url": u}},
                    st.one_of(*[images()] * 9, large_images()),
                ),
            ),
            min_size=1,
            max_size=3,
        ),
    )
    message = st.one_of(
        st.builds(lambda c: {"role": "user", "content": c}, user_content),
        st.builds(lambda c: {"role": "system", "content": c}, _text),
        st.builds(lambda c: {"role": "assistant", "content": c}, _text),
        st.builds(lambda i, c: {"role": "tool", "tool_call_id": i, "content": c}, _ids, _text),
    )
    return st.lists(message, min_size=1, max_size=max_size).map(
        lambda ms: ms if ms[-1]["role"] != "assistant" else ms + [{"role": "user", "content": "go on"}]
    )


def request_bodies(protocol: str | None = None) -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
    """``(protocol, body)`` pairs of well-formed requests (streamed or not)."""
    stream = st.booleans()
    chat = st.builds(lambda m, s: ("openai.chat", {"model": "m", "messages": m, "stream": s}), chat_messages(), stream)
    responses = st.builds(
        lambda t, s: ("openai.responses", {"model": "m", "input": t, "stream": s}),
        st.one_of(_text, st.lists(st.builds(lambda c: {"role": "user", "content": c}, _text), min_size=1, max_size=4)),
        stream,
    )
    messages = st.builds(
        lambda m, s, n: ("anthropic.messages", {"model": "m", "max_tokens": n, "messages": m, "stream": s}),
        st.lists(st.builds(lambda c: {"role": "user", "content": c}, _text), min_size=1, max_size=4),
        stream,
        st.integers(1, 4096),
    )
    by_name = {"openai.chat": chat, "openai.responses": responses, "anthropic.messages": messages}
    return by_name[protocol] if protocol else st.one_of(*by_name.values())


def malformed_bodies() -> st.SearchStrategy[bytes]:
    """Bodies a proxy must answer with a 4xx: not JSON, not an object, wrong types, missing fields."""
    return st.one_of(
        st.binary(max_size=64).filter(lambda b: not _is_json(b)),
        st.sampled_from(
            [
                b"[]",
                b"null",
                b"42",
                b'"text"',
                b"{}",
                b'{"model": 3}',
                b'{"messages": "hi"}',
                b'{"model": "m", "messages": [{"role": 5}]}',
                b'{"model": "m", "messages": [1]}',
                b'{"model": "m", "messages": [], "stream": "yes"}',
                b'{"model": "m", "messages"',
            ]
        ),
    )


def _is_json(data: bytes) -> bool:
    try:
        orjson.loads(data)
    except orjson.JSONDecodeError:
        return False
    return True


def turns(index: int = 0) -> st.SearchStrategy[Turn]:
    """:class:`lowwater.trajectory.Turn` with optional token ids and matching logprobs."""
    tokens = st.lists(st.integers(0, 2**31 - 1), max_size=32)
    return tokens.flatmap(
        lambda ids: st.builds(
            Turn,
            index=st.just(index),
            protocol=st.sampled_from(PROTOCOLS),
            model=st.just("m"),
            request_delta=chat_messages(3),
            completion=st.builds(lambda t: {"role": "assistant", "content": t}, _text),
            usage=st.just({"completion_tokens": len(ids)}),
            token_ids=st.just(ids) | st.none(),
            logprobs=st.lists(st.floats(-30, 0), min_size=len(ids), max_size=len(ids)) | st.none(),
            streamed=st.booleans(),
        )
    )
