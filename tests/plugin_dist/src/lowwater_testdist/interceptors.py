"""Two interceptors: one redacts ``tok-`` session tokens from every message,
one refuses every call when ``LOWWATER_TESTDIST_REJECT=1`` in the eval's
environment.  Enabled with ``LOWWATER_PLUGINS=lowwater_testdist.interceptors``."""

from __future__ import annotations

import os
import re
from typing import Any

from lowwater.hookspecs import hookimpl
from lowwater.interception import Reject

TOKEN = re.compile(r"tok-[A-Za-z0-9]+")
SEEN: list[Any] = []


@hookimpl
async def intercept_request(call: Any) -> None:
    if os.environ.get("LOWWATER_TESTDIST_REJECT") == "1":
        raise Reject(403, "testdist: this eval refuses every call")
    messages = call.body.get("messages") or call.body.get("input") or []
    for message in messages if isinstance(messages, list) else []:
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            message["content"] = TOKEN.sub("<redacted>", message["content"])


@hookimpl
async def intercept_response(call: Any, response: Any) -> None:
    SEEN.append((call.protocol, response.usage))
