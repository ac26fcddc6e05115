"""The built-in subprocess runtime: workdir, process groups, env filtering, caps, timeouts, cancellation."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
import trio

from lowwater.rollout import classify
from lowwater.runtime import (
    OutputLimitExceeded,
    ProgramTimeout,
    RuntimeConfig,
    RuntimeStartError,
    RuntimeStateError,
    ScriptError,
    SubprocessRuntime,
)

from ._procs import live_children

PY = sys.executable
# Hang guard for tests that wait on something external; never a timing assertion.
HANG_S = 60


def gone(pid: int, settle_s: float = 10.0) -> bool:
    """True once ``pid`` is dead or a zombie (polled: SIGKILL is asynchronous)."""
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.01)
    return False


def with_runtime(body, config: RuntimeConfig | None = None):
    async def main():
        async with SubprocessRuntime(config or RuntimeConfig()) as rt:
            return await body(rt)

    return trio.run(main)


async def wait_for_file(path: Path) -> str:
    with trio.fail_after(HANG_S):
        while not (path.exists() and path.read_text().strip()):
            await trio.sleep(0.01)
    return path.read_text().strip()


def test_run_captures_output_exit_code_and_starts_in_workdir():
    async def body(rt):
        r = await rt.run([PY, "-c", "import os, sys; print(os.getcwd()); sys.stderr.write('err'); sys.exit(3)"])
        assert r.exit_code == 3 and not r.ok
        assert r.stdout == f"{rt.workdir}\n".encode() and r.stderr == b"err"
        assert isinstance(r.stdout, bytes) and r.stdout_text == f"{rt.workdir}\n"
        assert not r.stdout_truncated and not r.stderr_truncated and r.duration_s >= 0
        assert rt.workdir.is_absolute() and rt.workdir.is_dir()

    with_runtime(body)


def test_stdin_is_empty():
    async def body(rt):
        r = await rt.run([PY, "-c", "import sys; print(repr(sys.stdin.read()))"])
        assert r.stdout == b"''\n"

    with_runtime(body)


def test_host_credentials_are_not_inherited_unless_passed(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-host")
    monkeypatch.setenv("GH_TOKEN", "ghp-host")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-host")
    # Names a deny-list of *KEY*/*TOKEN*/*SECRET*/*PASSWORD* patterns let through.
    leaky = (
        "LOWWATER_ADMIN_KEY",
        "AWS_ACCESS_KEY_ID",
        "DATABASE_URL",
        "OPENAI_KEY",
        "AZURE_OPENAI_KEY",
        "GITHUB_PAT",
        "SSH_AUTH_SOCK",
    )
    for name in leaky:
        monkeypatch.setenv(name, "host-secret")
    monkeypatch.setenv("LW_PLAIN", "plain")
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    show = [PY, "-c", "import json, os; print(json.dumps(dict(os.environ)))"]

    async def body(rt):
        import json

        env = json.loads((await rt.run(show)).stdout)
        assert "OPENAI_API_KEY" not in env and "GH_TOKEN" not in env and "AWS_SECRET_ACCESS_KEY" not in env
        assert not [name for name in leaky if name in env]
        # Allowed: what a program needs; not allowed: anything else of the host's.
        assert env["PATH"] == os.environ["PATH"] and env["LC_ALL"] == "C.UTF-8" and "LW_PLAIN" not in env
        assert env["FROM_CONFIG_TOKEN"] == "c"
        env = json.loads((await rt.run(show, env={"OPENAI_API_KEY": "sk-rollout"})).stdout)
        assert env["OPENAI_API_KEY"] == "sk-rollout"
        # The explicit env is per call.
        assert "OPENAI_API_KEY" not in json.loads((await rt.run(show)).stdout)

    with_runtime(body, RuntimeConfig(env={"FROM_CONFIG_TOKEN": "c"}))


def test_pass_env_adds_host_variables_but_never_the_admin_key(monkeypatch):
    monkeypatch.setenv("LW_PLAIN", "plain")
    monkeypatch.setenv("LW_EXTRA_1", "one")
    monkeypatch.setenv("LOWWATER_ADMIN_KEY", "admin")
    show = [PY, "-c", "import json, os; print(json.dumps(dict(os.environ)))"]

    async def body(rt):
        import json

        env = json.loads((await rt.run(show)).stdout)
        assert env["LW_PLAIN"] == "plain" and env["LW_EXTRA_1"] == "one"
        assert "LOWWATER_ADMIN_KEY" not in env

    with_runtime(body, RuntimeConfig(pass_env=("LW_PLAIN", "LW_EXTRA_*", "LOWWATER_ADMIN_KEY")))


def test_inherit_env_false_starts_empty(monkeypatch):
    monkeypatch.setenv("LW_PLAIN", "plain")

    async def body(rt):
        import json

        env = json.loads(
            (await rt.run([PY, "-c", "import json, os; print(json.dumps(dict(os.environ)))"], env={"B": "2"})).stdout
        )
        assert "LW_PLAIN" not in env and env["A"] == "1" and env["B"] == "2"

    with_runtime(body, RuntimeConfig(inherit_env=False, env={"A": "1"}))


def test_env_values_must_be_strings():
    async def body(rt):
        with pytest.raises(TypeError):
            await rt.run([PY, "-c", "pass"], env={"A": 1})

    with_runtime(body)


def test_output_is_capped_and_flagged_without_blocking_the_program():
    async def body(rt):
        code = (
            "import sys; sys.stdout.write('x' * 5_000_000); sys.stderr.write('y' * 10); print('done', file=sys.stderr)"
        )
        r = await rt.run([PY, "-c", code])
        assert r.exit_code == 0
        assert r.stdout == b"x" * 1000 and r.stdout_truncated
        assert r.stderr == b"y" * 10 + b"done\n" and not r.stderr_truncated
        # stderr keeps its end: where a traceback's message is.
        r = await rt.run([PY, "-c", "import sys; sys.stderr.write('y' * 5_000_000 + 'END')"])
        assert r.stderr == b"y" * 997 + b"END" and r.stderr_truncated and not r.stdout_truncated

    with_runtime(body, RuntimeConfig(max_output_bytes=1000))


def test_timeout_kills_the_whole_tree_and_keeps_partial_output():
    async def body(rt):
        code = (
            "import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(60)"
        )
        with pytest.raises(ProgramTimeout) as info:
            await rt.run([PY, "-c", code], timeout=2)
        exc = info.value
        assert isinstance(exc, trio.TooSlowError) and exc.timeout_s == 2
        assert exc.result is not None and exc.result.exit_code == -signal.SIGKILL
        grandchild = int(exc.result.stdout.split()[0])
        assert gone(grandchild)
        assert live_children() == []
        assert classify(exc).cls == "timeout"

    with_runtime(body)


def test_cancellation_kills_the_process_group():
    async def body(rt):
        pidfile = rt.workdir / "pids"
        code = (
            "import subprocess, sys, time, os\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "open('pids', 'w').write(f'{os.getpid()} {child.pid}')\n"
            "time.sleep(60)"
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rt.run, [PY, "-c", code])
            pids = [int(p) for p in (await wait_for_file(pidfile)).split()]
            assert all(psutil.pid_exists(p) for p in pids)
            nursery.cancel_scope.cancel()
        assert all(gone(p) for p in pids)
        assert live_children() == []

    with_runtime(body)


def test_background_children_die_when_the_program_exits():
    async def body(rt):
        code = "import subprocess, sys\nc = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\nprint(c.pid)"
        r = await rt.run([PY, "-c", code])
        assert r.exit_code == 0
        assert gone(int(r.stdout))
        assert live_children() == []

    with_runtime(body)


def test_killed_by_signal_reports_negative_exit_code():
    async def body(rt):
        r = await rt.run([PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
        assert r.exit_code == -signal.SIGKILL
        assert await rt.healthy()

    with_runtime(body)


def test_missing_executable_raises_oserror():
    async def body(rt):
        with pytest.raises(FileNotFoundError):
            await rt.run(["/nonexistent/program"])
        assert classify(FileNotFoundError("x")).cls == "infra"

    with_runtime(body)


def test_reset_empties_the_workdir_and_keeps_its_path():
    async def body(rt):
        before = rt.workdir
        await rt.run(
            [
                PY,
                "-c",
                "import os; os.makedirs('a/b'); open('a/b/f', 'w').write('x'); open('g', 'w').write('y'); os.symlink('/etc', 'link')",
            ]
        )
        assert sorted(os.listdir(rt.workdir)) == ["a", "g", "link"]
        await rt.reset()
        assert rt.workdir == before and os.listdir(rt.workdir) == []
        assert os.path.isdir("/etc")  # the symlink was removed, not followed
        assert (await rt.run([PY, "-c", "print('again')"])).stdout == b"again\n"

    with_runtime(body)


def test_stop_removes_the_directory_and_is_final():
    async def main():
        rt = SubprocessRuntime()
        with pytest.raises(RuntimeStateError):
            rt.workdir
        with pytest.raises(RuntimeStateError):
            await rt.run([PY, "-c", "pass"])
        assert not await rt.healthy()
        await rt.start()
        with pytest.raises(RuntimeStateError):
            await rt.start()
        root = rt.workdir.parent
        assert await rt.healthy()
        await rt.stop()
        await rt.stop()
        assert not root.exists() and not await rt.healthy()
        for call in (rt.start(), rt.reset(), rt.run([PY]), rt.run_script("x.py", [])):
            with pytest.raises(RuntimeStateError):
                await call

    trio.run(main)


def test_stop_of_a_never_started_runtime_is_a_no_op():
    trio.run(SubprocessRuntime().stop)


def test_start_failure_is_a_runtime_start_error(tmp_path):
    async def main():
        rt = SubprocessRuntime(RuntimeConfig(root=str(tmp_path / "missing")))
        with pytest.raises(RuntimeStartError):
            await rt.start()
        assert classify(RuntimeStartError("x")).cls == "infra"

    trio.run(main)


def test_cold_script_errors(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(
        "import sys\n"
        "def main(argv):\n"
        "    if argv[0] == 'raise':\n"
        "        raise ValueError('bad input')\n"
        "    return argv[0] * int(argv[1])\n"
        "if __name__ == '__main__':\n"
        "    sys.stdout.write(main(sys.argv[1:]))\n"
    )

    async def body(rt):
        assert await rt.run_script(script, ["ab", "2"]) == "abab"
        with pytest.raises(ScriptError) as info:
            await rt.run_script(script, ["raise"])
        assert info.value.exit_code == 1 and info.value.exc_type == "ExitStatus"
        assert "ValueError: bad input" in info.value.traceback and "bad input" in str(info.value)
        with pytest.raises(OutputLimitExceeded):
            await rt.run_script(script, ["x", "200"])
        with pytest.raises(ProgramTimeout):
            await rt.run_script(tmp_path / "s.py", ["x", "1"], timeout=0)

    with_runtime(body, RuntimeConfig(max_output_bytes=100))


def test_config_is_frozen_hashable_and_resolves(tmp_path, monkeypatch):
    a = RuntimeConfig(env={"B": "2", "A": "1"}, options={"image": "x"})
    b = RuntimeConfig(env=[("A", "1"), ("B", "2")], options={"image": "x"})
    assert a == b and hash(a) == hash(b) and a.env == (("A", "1"), ("B", "2"))
    assert a.option("image") == "x" and a.option("missing", 5) == 5
    with pytest.raises(AttributeError):
        a.kind = "other"  # type: ignore[misc]
    monkeypatch.chdir(tmp_path)
    rel = RuntimeConfig(root=".").resolved()
    assert rel.root == str(tmp_path) and rel == RuntimeConfig(root=str(tmp_path)).resolved()
    assert os.path.isabs(RuntimeConfig(python="python3").resolved().python)
    with pytest.raises(RuntimeStartError):
        RuntimeConfig(python="no-such-python-here").resolved()
    with pytest.raises(ValueError):
        RuntimeConfig(max_output_bytes=0)
