"""The generic program harness: any program as the agent (``--harness program --program 'CMD ARGS'``).

For each rollout the program runs in the rollout's runtime with

* the task on **stdin** as one JSON object ``{"id", "prompt", "metadata"}``
  (never the reference answer);
* ``OPENAI_BASE_URL`` (ends in ``/v1``), ``OPENAI_API_KEY``,
  ``ANTHROPIC_BASE_URL``, ``ANTHROPIC_API_KEY`` (the rollout's slot and its
  per-rollout key), ``LOWWATER_MODEL`` and ``LOWWATER_MAX_TURNS`` in its
  environment, so an agent written against either official SDK runs as is;

and the **last line of its stdout that parses as JSON** is its answer:
``rollout.state["answer"]`` for the environment's rubric (a string printed
with ``json.dumps`` or any JSON value).  A non-zero exit, or no JSON line,
fails the rollout as ``model``.

A program whose imports fail is a broken environment, not a bad model:
:func:`preflight` starts it once before the run (stdin empty,
``LOWWATER_PREFLIGHT=1``, no model reachable) and an ``ImportError`` /
``ModuleNotFoundError`` (or a command that does not exist) stops the run with
:class:`ProgramStartError` and the program's exact message.  An import that
fails later, inside a rollout, fails that rollout as ``environment`` with the
same message.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import orjson

from lowwater._native import LowwaterError
from lowwater.rollout import RolloutFailed

if TYPE_CHECKING:  # pragma: no cover
    from lowwater.environment import HarnessContext, Task

__all__ = ["PREFLIGHT_ENV", "ProgramStartError", "parse_program", "preflight", "run_program"]

PREFLIGHT_ENV = "LOWWATER_PREFLIGHT"
#: Seconds the preflight run may take; a program still running then imported fine.
PREFLIGHT_TIMEOUT_S = 30.0
#: Exit status of the stdin shim when the command cannot be executed (the shell's convention).
NOT_FOUND = 127

# Runtime.run has no stdin: the runtime's own interpreter opens the task file
# as fd 0 and execs the program, so any runtime that runs scripts runs this.
_STDIN_SHIM = (
    "import os, sys\n"
    "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
    "os.dup2(fd, 0)\n"
    "os.close(fd)\n"
    "try:\n"
    "    os.execvp(sys.argv[2], sys.argv[2:])\n"
    "except OSError as exc:\n"
    "    sys.stderr.write(f'lowwater: cannot run {sys.argv[2]!r}: {exc.strerror}\\n')\n"
    f"    sys.exit({NOT_FOUND})\n"
)
_IMPORT_ERROR = re.compile(r"^(?:ModuleNotFoundError|ImportError): .*$", re.M)
_NOT_FOUND_LINE = re.compile(r"^lowwater: cannot run .*$", re.M)


class ProgramStartError(LowwaterError, ValueError):
    """The agent program cannot start: its imports fail or the command does
    not exist.  An ``environment`` error of the whole run, raised before
    any rollout (``lowwater eval`` prints it as one line and exits 2)."""


def parse_program(text: str) -> tuple[str, ...]:
    """``--program`` text as argv (``shlex`` rules, no shell).

    Raises:
        ValueError: empty, or unbalanced quotes.
    """
    try:
        argv = tuple(shlex.split(text))
    except ValueError as exc:
        raise ValueError(f"--program {text!r}: {exc}") from None
    if not argv:
        raise ValueError("--program: give a command")
    return argv


def task_json(task: Task) -> bytes:
    """The stdin of a rollout's program: the task without its reference answer."""
    return orjson.dumps(
        {"id": task.id, "prompt": task.prompt, "metadata": dict(task.metadata)}, option=orjson.OPT_NON_STR_KEYS
    )


def last_json_line(stdout: str) -> tuple[bool, Any]:
    """``(True, value)`` for the last line of ``stdout`` that parses as JSON,
    ``(False, None)`` when none does (log lines before it are ignored)."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if not line:
            continue
        try:
            return True, orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
    return False, None


def start_failure(exit_code: int, stderr: str) -> str | None:
    """The exact message of a program that could not start (the last
    ``ImportError``/``ModuleNotFoundError`` line, or the shim's "cannot run"
    line), or ``None``."""
    if exit_code == 0:
        return None
    found = _IMPORT_ERROR.findall(stderr)
    if found:
        return found[-1].strip()
    if exit_code == NOT_FOUND:
        missing = _NOT_FOUND_LINE.findall(stderr)
        if missing:
            return missing[-1].removeprefix("lowwater: ").strip()
    return None


def shim_argv(python: str, task_file: str, argv: Sequence[str]) -> list[str]:
    """``argv`` run with ``task_file`` as its stdin, through ``python``."""
    return [python, "-c", _STDIN_SHIM, task_file, *argv]


async def run_program(ctx: HarnessContext, argv: Sequence[str], timeout_s: float | None = None) -> Any:
    """Run ``argv`` as the agent of ``ctx``'s rollout (module docstring); its answer,
    also left in ``ctx.rollout.state["answer"]``.

    Raises:
        RolloutFailed: ``environment`` when the program cannot start (its
            exact import error), ``model`` on a non-zero exit (the last
            stderr line, at most 300 characters) or no JSON line on stdout.
        lowwater.runtime.ProgramTimeout: ``timeout_s`` expired (``timeout``).
    """
    runtime = await ctx.runtime()
    task_file = runtime.workdir / "task.json"
    task_file.write_bytes(task_json(ctx.task))
    env = ctx.program_env() | {"LOWWATER_MODEL": ctx.model, "LOWWATER_MAX_TURNS": str(ctx.max_turns)}
    result = await runtime.run(shim_argv(runtime.config.python, str(task_file), argv), env=env, timeout=timeout_s)
    stderr = result.stderr_text
    if result.exit_code != 0:
        cannot = start_failure(result.exit_code, stderr)
        if cannot is not None:
            raise RolloutFailed("environment", f"agent program {argv[0]!r} cannot start: {cannot}")
        last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        raise RolloutFailed("model", f"agent program exited {result.exit_code}: {last[-300:]}")
    found, answer = last_json_line(result.stdout_text)
    if not found:
        raise RolloutFailed("model", "agent program printed no JSON line on stdout (its answer)")
    ctx.rollout.state["answer"] = answer
    return answer


async def preflight(plugins: Any, runtime_config: Any, argv: Sequence[str], model: str = "preflight") -> None:
    """Start ``argv`` once in a fresh runtime of ``runtime_config`` to catch a
    program that cannot start before any rollout runs.

    The program gets an empty stdin, ``LOWWATER_PREFLIGHT=1`` and SDK
    variables pointing at a closed port: it may exit at once when it sees
    the variable; whatever else it does (fail on the empty task, on the
    refused connection, run past :data:`PREFLIGHT_TIMEOUT_S`) is ignored.

    Raises:
        ProgramStartError: an ``ImportError``/``ModuleNotFoundError`` or a
            command that does not exist (the program's exact message).
        lowwater.runtime.RuntimeStartError: the runtime cannot start.
    """
    import trio

    from lowwater.runtime import ProgramTimeout

    config = attrs.evolve(runtime_config, persistent=False)
    runtime = plugins.runtime(config.kind)(config)
    async with runtime:
        task_file = runtime.workdir / "preflight.json"
        task_file.write_bytes(b"")
        closed = "http://127.0.0.1:9"
        env = {
            PREFLIGHT_ENV: "1",
            "OPENAI_BASE_URL": f"{closed}/v1",
            "OPENAI_API_KEY": "preflight",
            "ANTHROPIC_BASE_URL": closed,
            "ANTHROPIC_API_KEY": "preflight",
            "LOWWATER_MODEL": model,
            "LOWWATER_MAX_TURNS": "1",
        }
        try:
            result = await runtime.run(
                shim_argv(config.python, str(task_file), argv), env=env, timeout=PREFLIGHT_TIMEOUT_S
            )
        except (ProgramTimeout, trio.TooSlowError):
            return  # still running: it got past its imports
    cannot = start_failure(result.exit_code, result.stderr_text)
    if cannot is not None:
        raise ProgramStartError(f"environment error: agent program {shlex.join(argv)!r} cannot start: {cannot}")
