"""Registers the ``testdist-limited`` runtime: the subprocess runtime with a
CPU-time limit and a start log, configured by ``--runtime-option``."""

from __future__ import annotations

from typing import Any

import trio

from lowwater.environment import EnvOption
from lowwater.hookspecs import hookimpl
from lowwater.runtime import SubprocessRuntime


class LimitedRuntime(SubprocessRuntime):
    """Subprocesses with ``RLIMIT_CPU`` set to ``cpu_seconds``; each start
    appends ``label`` to ``log`` (so a test can see the runtime was chosen)."""

    options = {
        "cpu_seconds": EnvOption(60, "CPU seconds per program (RLIMIT_CPU)"),
        "label": EnvOption("", "written to the start log"),
        "log": EnvOption(None, "file each start appends its label to"),
    }

    async def start(self) -> None:
        await super().start()
        log = self.config.option("log")
        if log:
            line = f"{self.config.option('label', '')} cpu={self.config.option('cpu_seconds', 60)}\n"
            await trio.to_thread.run_sync(_append, log, line)

    async def run(self, argv: Any, *, env: Any = None, timeout: float | None = None) -> Any:
        # Set in a child before exec: the limit reaches the program without
        # touching this process (preexec_fn is not the runtime's to give).
        seconds = int(self.config.option("cpu_seconds", 60))
        argv = [
            self.config.python,
            "-c",
            "import os, resource, sys; resource.setrlimit(resource.RLIMIT_CPU, (int(sys.argv[1]),) * 2); "
            "os.execvp(sys.argv[2], sys.argv[2:])",
            str(seconds),
            *argv,
        ]
        return await super().run(argv, env=env, timeout=timeout)


def _append(path: str, line: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)


@hookimpl
def register_runtimes(register: Any) -> None:
    register("testdist-limited", LimitedRuntime)
