"""A ``LOWWATER_PLUGINS`` module for tests/interception/test_proxy_plugins.py:
redacts ``tok-`` session tokens from every message, refuses (403) a call whose
messages mention "forbidden", and appends ``ROLLOUT PROTOCOL FINISH`` to the
file ``PROXY_GUARD_LOG`` names for every answer (so a test sees the response
hook ran inside a ``lowwater proxy`` process)."""

from __future__ import annotations

import os
import re
from typing import Any

import trio

from lowwater.hookspecs import hookimpl
from lowwater.interception import Reject

TOKEN = re.compile(r"tok-[A-Za-z0-9]+")


@hookimpl
async def intercept_request(call: Any) -> None:
    messages = call.body.get("messages") or call.body.get("input") or []  # chat/anthropic; responses
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, str):
            continue
        if "forbidden" in content:
            raise Reject(403, "proxy_guard: this topic is forbidden")
        message["content"] = TOKEN.sub("<redacted>", content)


@hookimpl
async def intercept_response(call: Any, response: Any) -> None:
    path = os.environ.get("PROXY_GUARD_LOG")
    if path:
        line = f"{call.rollout_id} {call.protocol} {response.finish_reason}\n"
        await trio.to_thread.run_sync(_append, path, line)  # never blocking I/O on the proxy's loop


def _append(path: str, line: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
