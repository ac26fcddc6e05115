"""``serve-model``: a local OpenAI- and Anthropic-compatible model server for demos, tests and benchmarks.

Two models, both stateless and deterministic:

* :class:`ScriptedModel` solves the embedded default's arithmetic problems
  with ``calculator`` tool calls over several turns (anything else gets a
  fixed filler answer);
* :class:`ReplayModel` serves recorded solutions (one column of a JSONL file
  such as GSM8K's ``example_model_solutions.jsonl``), keyed by question text,
  with calculator annotations turned into tool calls.

Run one inside a Trio nursery::

    url = await nursery.start(serve_model, ScriptedModel())   # "http://127.0.0.1:PORT"
    # OpenAI SDK: base_url=url + "/v1"; Anthropic SDK: base_url=url

or from the shell with ``lowwater serve-model``.  See ``docs/serve-model.md``.
"""

from __future__ import annotations

import trio

from lowwater.excgroups import sole_error
from lowwater.http.server import open_server
from lowwater.serve_model.app import Model, build_app
from lowwater.serve_model.replay import ModelError, ReplayDataError, ReplayModel, Reply, ToolCall, UnknownQuestion
from lowwater.serve_model.scripted import ScriptedModel

__all__ = [
    "Model",
    "ModelError",
    "ReplayDataError",
    "ReplayModel",
    "Reply",
    "ScriptedModel",
    "ToolCall",
    "UnknownQuestion",
    "build_app",
    "serve_model",
]

#: The model server's listen backlog (uvicorn's default, which vLLM's
#: OpenAI server inherits): every rollout of a group calls at once, and the
#: 256 concurrent agents of benches/interception.py overflowed hypercorn's
#: 100, so handshakes were dropped or reset (502s through the proxy).
MODEL_BACKLOG = 2048


async def serve_model(
    model: Model,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    advertise: str | None = None,
    admin_key: str | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``model`` until cancelled; ``task_status.started`` gets ``"http://HOST:PORT"``.

    Port 0 lets the OS choose.  ``HOST`` is ``advertise`` when given (the
    address others dial; for a ``0.0.0.0`` bind, this host's primary
    address).  Beyond loopback an ``admin_key`` is required, and every
    request must then carry it.

    Raises:
        lowwater.http.exposure.ExposureError: ``host`` is beyond loopback
            and no ``admin_key`` was given.
        OSError: the address cannot be bound or resolved (the bare error,
            not Trio's nested exception groups around it).
    """
    started = False
    bind_error: OSError | None = None
    server = open_server(
        "serve-model",
        build_app(model, admin_key=admin_key),
        host,
        port,
        advertise=advertise,
        admin_key=admin_key,
        backlog=MODEL_BACKLOG,
    )
    try:
        async with server as (_, address):
            started = True
            task_status.started(f"http://{address}")
    except* OSError as group:
        bind_error = None if started else sole_error(group)
        if bind_error is None:
            raise
    if bind_error is not None:
        raise bind_error from None
