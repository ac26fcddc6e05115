"""Resolving ``--model`` to an upstream URL, and running ``serve-model`` for a run.

``--model scripted`` and ``--model replay:PATH#COLUMN`` start ``lowwater
serve-model`` as a real local HTTP server in a child process for the run
(so its memory is not counted as the eval's) and stop it afterwards;
``--model NAME --model-url URL`` uses any OpenAI-compatible server.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from lowwater._native import LowwaterError
from lowwater.redact import redact_url

_URL = re.compile(rb"https?://[\w.\-\[\]:]+")


class UpstreamError(LowwaterError):
    """The model server could not be started or reached; the message says why."""


@attrs.frozen
class ModelSpec:
    """A resolved ``--model``: ``kind`` is ``"scripted"``, ``"replay"`` or
    ``"url"``; ``name`` is what requests ask for; ``url`` the server's base
    (``/v1`` included) for ``"url"``; ``replay_path``/``replay_column`` for replay."""

    kind: str
    name: str
    url: str | None = None
    api_key: str | None = None
    replay_path: Path | None = None
    replay_column: str | None = None


def parse_model(model: str, model_url: str | None = None, api_key_env: str | None = None) -> ModelSpec:
    """Resolve the ``--model`` / ``--model-url`` / ``--api-key-env`` flags.

    Raises:
        UpstreamError: a replay spec without ``#COLUMN`` or whose file does
            not exist, a replay spec given with a URL, or an unset key variable.
    """
    api_key = None
    if api_key_env:
        api_key = os.environ.get(api_key_env)
        if not api_key:
            raise UpstreamError(f"environment variable {api_key_env} (from --api-key-env) is not set")
    if model_url:
        # With a URL, --model is the served model's name ("scripted" and
        # "replay:COLUMN" are what serve-model serves); only a replay *spec*
        # (PATH#COLUMN) is a mistake: lowwater serves that itself.
        if model.startswith("replay:") and "#" in model:
            raise UpstreamError(
                f"--model {model} is served in-process by lowwater (a serve-model child) and takes no --model-url; "
                "with --model-url, --model names the model that server serves (see its GET /v1/models)"
            )
        return ModelSpec("url", model, model_url.rstrip("/"), api_key)
    if model == "scripted":
        return ModelSpec("scripted", "scripted")
    if model.startswith("replay:"):
        path_text, _, column = model.removeprefix("replay:").partition("#")
        if not column:
            raise UpstreamError(f"--model {model}: name the column to replay as replay:PATH#COLUMN")
        path = Path(path_text)
        if not path.is_file():
            raise UpstreamError(f"--model {model}: no such file: {path}")
        return ModelSpec("replay", f"replay-{column}", replay_path=path, replay_column=column)
    raise UpstreamError(f"--model {model!r}: use scripted, replay:PATH#COLUMN, or NAME with --model-url URL")


def serve_model_argv(
    spec: ModelSpec, *, latency_ms: float = 0.0, host: str = "127.0.0.1", advertise: str | None = None
) -> list[str]:
    """The command that serves ``spec`` on ``host`` (loopback by default) on an OS-chosen port."""
    argv = [sys.executable, "-m", "lowwater", "serve-model", "--host", host, "--port", "0"]
    if advertise:
        argv += ["--advertise", advertise]
    if spec.kind == "scripted":
        argv += ["--scripted"]
    else:
        argv += ["--replay", f"{spec.replay_path}#{spec.replay_column}"]
    if latency_ms:
        argv += ["--latency-ms", str(latency_ms)]
    return argv


@asynccontextmanager
async def model_server(
    spec: ModelSpec, *, start_timeout_s: float = 60.0, host: str = "127.0.0.1", advertise: str | None = None
) -> AsyncIterator[str]:
    """Yield the base URL (ending in ``/v1``) of the model ``spec`` names.

    For ``scripted`` and ``replay`` a ``serve-model`` child process runs
    for the duration of the block and is terminated (then killed) after it,
    bound to ``host`` and advertising ``advertise`` (beyond loopback it
    needs ``LOWWATER_ADMIN_KEY`` in the environment, and ``spec.api_key``
    must be that key for calls to get through).
    For ``url`` the server is probed once with ``GET /models``.

    Raises:
        UpstreamError: the child exited or printed no URL within
            ``start_timeout_s`` (its stderr tail is in the message), the
            child exited while the block ran (the block is cancelled), or
            the URL is unreachable.
    """
    if spec.kind == "url":
        await probe(spec.url or "", spec.api_key)
        yield spec.url or ""
        return
    # stderr goes to a file, not a pipe: a pipe nobody reads would fill and
    # block the server mid-run; the file gives the reason if it fails.
    # The child exits when the read end of this pipe reaches EOF: when this
    # block ends or this process dies, even by SIGKILL (the kernel closes the
    # write end).  PR_SET_PDEATHSIG, used before, fires when the *thread*
    # that forked the child exits, and Trio forks in a worker thread that
    # exits after 10 s idle: serve-model was stopped 10 s into runs.
    alive_r, alive_w = os.pipe()  # neither end is inherited by other children
    with tempfile.TemporaryFile() as errfile, _closing_fd(alive_w):
        process = await trio.lowlevel.open_process(
            serve_model_argv(spec, host=host, advertise=advertise),
            stdout=subprocess.PIPE,
            stderr=errfile,
            env={**os.environ, "PYTHONUNBUFFERED": "1", PARENT_FD_ENV: str(alive_r)},
            pass_fds=(alive_r,),
        )
        os.close(alive_r)
        try:
            async with trio.open_nursery() as nursery:
                url = await _read_url(process, start_timeout_s, errfile)
                nursery.start_soon(_watch, process, errfile)
                yield url + "/v1"
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await _stop(process)


#: Environment variable naming the pipe fd a ``serve-model`` child watches:
#: it stops when the fd reaches EOF (its parent ended the block or died).
PARENT_FD_ENV = "LOWWATER_PARENT_FD"


@contextmanager
def _closing_fd(fd: int) -> Iterator[None]:
    try:
        yield
    finally:
        os.close(fd)


async def _drain(process: trio.Process) -> None:
    assert process.stdout is not None
    while await process.stdout.receive_some(65536):
        pass


async def _watch(process: trio.Process, errfile: Any) -> None:
    """Drain the child's stdout; if the child exits while the run still uses
    it, fail the run at once.  A serve-model that died mid-run left every
    remaining rollout to fail with 502s, each retried three times, for
    minutes, before the run ended.

    Raises:
        UpstreamError: the child exited (its status and last stderr line).
    """
    await _drain(process)
    await process.wait()
    errfile.seek(0)
    tail = errfile.read()[-65536:].decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
    raise UpstreamError(f"serve-model exited mid-run (status {process.returncode}): {tail[0]}")


async def _read_url(process: trio.Process, timeout_s: float, errfile: Any) -> str:
    buffer = b""
    assert process.stdout is not None
    with trio.move_on_after(timeout_s):
        while True:
            chunk = await process.stdout.receive_some(4096)
            if not chunk:
                break
            buffer += chunk
            match = _URL.search(buffer)
            if match and b"\n" in buffer[match.end() :]:
                return match.group(0).decode().rstrip("/").removesuffix("/v1")
    with trio.move_on_after(2):
        await process.wait()
    errfile.seek(0)
    stderr = errfile.read()[-65536:]
    tail = stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
    raise UpstreamError(f"serve-model did not start: {tail[0]}")


async def _stop(process: trio.Process) -> None:
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
        with trio.move_on_after(5):
            await process.wait()
    if process.returncode is None:
        process.kill()
        await process.wait()
    if process.stdout is not None:
        await process.stdout.aclose()


async def probe(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> None:
    """Check that an OpenAI-compatible server answers at ``url`` *on its API routes*.

    ``GET {url}/models`` is tried first; a 404 there is checked further,
    since a base URL pasted without ``/v1`` reaches the server but every
    call then fails with 404 (retried three times per rollout, every rollout
    of the run an error): if ``{url}/v1/models`` answers, the error says
    ``did you mean {url}/v1?``; if the chat route
    (``POST {url}/chat/completions`` with an empty body) is missing too, the
    base URL is wrong.  A server without ``/models`` whose chat route exists
    (it answers the empty body with a 4xx other than 404) passes.

    Raises:
        UpstreamError: it cannot be connected to, or has no API route at ``url``.
    """
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            answer = await client.get(f"{url}/models", headers=headers)
            if answer.status_code != 404:
                return
            if not url.rstrip("/").endswith("/v1"):
                nested = await _status(client, "GET", f"{url}/v1/models", headers)
                if nested is not None and nested < 400:
                    raise UpstreamError(
                        redact_url(
                            f"model server {url} has no route GET {url}/models (HTTP 404); did you mean {url}/v1?"
                        )
                    )
            chat = await _status(client, "POST", f"{url}/chat/completions", headers)
            if chat == 404:
                raise UpstreamError(
                    redact_url(
                        f"model server {url} answers 404 to GET {url}/models and POST {url}/chat/completions: "
                        "--model-url must be the OpenAI base URL (it usually ends in /v1)"
                    )
                )
    except httpx.HTTPError as exc:
        raise UpstreamError(redact_url(f"model server {url} is unreachable: {type(exc).__name__}: {exc}")) from None


async def _status(client: httpx.AsyncClient, method: str, url: str, headers: dict[str, str]) -> int | None:
    try:
        answer = await client.request(method, url, headers=headers, json={} if method == "POST" else None)
    except httpx.HTTPError:
        return None
    return answer.status_code
