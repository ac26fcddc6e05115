"""Warm workers: import once, survive early return and SystemExit, honour env,
restart after a crash, die on cancellation, never leave a process behind."""

from __future__ import annotations

import functools
import os
import signal
import sys
from pathlib import Path

import psutil
import pytest
import trio

from lowwater.runtime import (
    OutputLimitExceeded,
    ProgramTimeout,
    RuntimeConfig,
    RuntimeStateError,
    ScriptError,
    SubprocessRuntime,
    WarmWorkerCrashed,
)

from ._procs import live_children

HANG_S = 60

SCRIPT = """\
import os, sys, time

IMPORTS = globals().get("IMPORTS", 0) + 1
CALLS = 0

def main(argv):
    global CALLS
    CALLS += 1
    cmd = argv[0] if argv else "info"
    if cmd == "info":
        return f"{os.getpid()} {IMPORTS} {CALLS}"
    if cmd == "early":
        if CALLS > 0:
            return "early"
        return "late"
    if cmd == "exit":
        sys.exit(int(argv[1]))
    if cmd == "raise":
        raise ValueError("bad " + argv[1])
    if cmd == "env":
        return ",".join(os.environ.get(k, "-") for k in argv[1:])
    if cmd == "setenv":
        os.environ["LEAK"] = "leaked"
        os.chdir("/")
        return "set"
    if cmd == "cwd":
        return os.getcwd()
    if cmd == "crash":
        os._exit(int(argv[1]))
    if cmd == "segv":
        import ctypes
        ctypes.string_at(0)
    if cmd == "sleep":
        open(argv[1], "w").write(str(os.getpid()))
        time.sleep(60)
    if cmd == "noise":
        print("x" * 200_000)
        os.write(1, b"raw fd write\\n")
        sys.stderr.write("to stderr\\n")
        return "quiet " + repr(sys.stdin.read())
    if cmd == "big":
        return "b" * int(argv[1])
    if cmd == "notstr":
        return 42
    if cmd == "argv":
        return "|".join(sys.argv[1:]) + "#" + "|".join(argv)
    if cmd == "sibling":
        import helper_mod
        return helper_mod.VALUE
    return "unknown"

if __name__ == "__main__":
    sys.stdout.write(main(sys.argv[1:]))
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "scripts" / "worker_script.py"
    path.parent.mkdir()
    path.write_text(SCRIPT)
    (path.parent / "helper_mod.py").write_text("VALUE = 'from sibling'\n")
    return path


def with_runtime(body, config: RuntimeConfig | None = None):
    async def main():
        async with SubprocessRuntime(config or RuntimeConfig(persistent=True)) as rt:
            result = await body(rt)
        assert live_children() == [], "stop must kill every warm worker"
        return result

    return trio.run(main)


async def info(rt, script) -> tuple[int, int, int]:
    pid, imports, calls = (await rt.run_script(script, ["info"], warm=True)).split()
    return int(pid), int(imports), int(calls)


def test_imports_once_and_answers_many_calls(script):
    async def body(rt):
        first = await info(rt, script)
        for _ in range(5):
            await rt.run_script(script, ["early"], warm=True)
        pid, imports, calls = await info(rt, script)
        assert (pid, imports) == (first[0], 1) and calls == 7
        assert pid != os.getpid() and psutil.pid_exists(pid)
        stats = rt.warm_workers.stats()
        assert stats["workers"] == 1 and stats["starts"] == 1 and stats["calls"] == 7

    with_runtime(body)


def test_warm_and_cold_give_the_same_result(script):
    async def body(rt):
        args = ["argv", "a b", "ünï", "", "--flag"]
        cold = await rt.run_script(script, args)
        warm = await rt.run_script(script, args, warm=True)
        assert cold == warm == "argv|a b|ünï||--flag#argv|a b|ünï||--flag"
        assert (
            await rt.run_script(script, ["sibling"])
            == await rt.run_script(script, ["sibling"], warm=True)
            == "from sibling"
        )
        assert await rt.run_script(script, ["cwd"], warm=True) == str(rt.workdir)

    with_runtime(body)


def test_system_exit_is_an_error_reply_and_the_worker_survives(script):
    async def body(rt):
        pid = (await info(rt, script))[0]
        for code in ("0", "3"):
            with pytest.raises(ScriptError) as err:
                await rt.run_script(script, ["exit", code], warm=True)
            assert err.value.exc_type == "SystemExit" and err.value.exit_code is None
        assert (await info(rt, script))[0] == pid

    with_runtime(body)


def test_exception_in_main_comes_back_with_its_traceback(script):
    async def body(rt):
        pid = (await info(rt, script))[0]
        with pytest.raises(ScriptError) as err:
            await rt.run_script(script, ["raise", "input"], warm=True)
        assert err.value.exc_type == "ValueError" and "bad input" in str(err.value)
        assert "Traceback" in err.value.traceback and "in main" in err.value.traceback
        with pytest.raises(ScriptError, match="returned int, not str"):
            await rt.run_script(script, ["notstr"], warm=True)
        assert (await info(rt, script))[0] == pid

    with_runtime(body)


def test_per_call_env_is_applied_for_that_call_only(script, monkeypatch):
    monkeypatch.setenv("HOST_API_KEY", "secret")
    monkeypatch.setenv("LW_PLAIN", "plain")

    async def body(rt):
        keys = ["env", "X", "HOST_API_KEY", "LW_PLAIN", "CFG", "LEAK"]
        assert await rt.run_script(script, keys, warm=True) == "-,-,plain,c,-"
        got = await rt.run_script(script, keys, env={"X": "1", "HOST_API_KEY": "given", "CFG": "over"}, warm=True)
        assert got == "1,given,plain,over,-"
        assert await rt.run_script(script, keys, warm=True) == "-,-,plain,c,-"
        # What a call does to its environment and directory is undone after it.
        assert await rt.run_script(script, ["setenv"], warm=True) == "set"
        assert await rt.run_script(script, keys, warm=True) == "-,-,plain,c,-"
        assert await rt.run_script(script, ["cwd"], warm=True) == str(rt.workdir)
        # Cold agrees.
        assert await rt.run_script(script, keys, env={"X": "1"}) == "1,-,plain,c,-"

    # LW_PLAIN is a host variable the runtime passes only when told (pass_env).
    with_runtime(body, RuntimeConfig(persistent=True, env={"CFG": "c"}, pass_env=("LW_PLAIN",)))


@pytest.mark.parametrize(
    ("args", "returncode"),
    [(["crash", "3"], 3), (["crash", "0"], 0), (["segv"], -signal.SIGSEGV)],
)
def test_a_crashed_worker_fails_the_call_and_is_restarted(script, args, returncode):
    async def body(rt):
        pid = (await info(rt, script))[0]
        with pytest.raises(WarmWorkerCrashed) as err:
            await rt.run_script(script, args, warm=True)
        assert err.value.returncode == returncode
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        new_pid, imports, calls = await info(rt, script)
        assert new_pid != pid and (imports, calls) == (1, 1)
        stats = rt.warm_workers.stats()
        assert stats["crashes"] == 1 and stats["starts"] == 2
        assert await rt.healthy()

    with_runtime(body)


def test_cancellation_kills_the_worker_and_the_next_call_restarts_it(script, tmp_path):
    async def body(rt):
        pidfile = tmp_path / "pid"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(rt.run_script, script, ["sleep", str(pidfile)], warm=True))
            with trio.fail_after(HANG_S):
                while not (pidfile.exists() and pidfile.read_text()):
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        assert live_children() == []
        assert rt.warm_workers.get(script).pid is None
        pid, imports, _ = await info(rt, script)
        assert pid != int(pidfile.read_text()) and imports == 1

    with_runtime(body)


def test_timeout_kills_the_worker(script, tmp_path):
    async def body(rt):
        with pytest.raises(ProgramTimeout) as err:
            await rt.run_script(script, ["sleep", str(tmp_path / "pid")], warm=True, timeout=1)
        assert isinstance(err.value, trio.TooSlowError) and err.value.result is None
        assert live_children() == []
        assert (await info(rt, script))[1] == 1

    with_runtime(body)


def test_prints_and_stdin_reads_cannot_corrupt_the_protocol(script):
    async def body(rt):
        assert await rt.run_script(script, ["noise"], warm=True) == "quiet ''"
        assert (await info(rt, script))[2] == 2

    with_runtime(body)


def test_result_cap_is_enforced_and_the_worker_survives(script):
    async def body(rt):
        pid = (await info(rt, script))[0]
        assert await rt.run_script(script, ["big", "1000"], warm=True) == "b" * 1000
        with pytest.raises(OutputLimitExceeded):
            await rt.run_script(script, ["big", "1001"], warm=True)
        with pytest.raises(OutputLimitExceeded):
            await rt.run_script(script, ["big", "1001"])
        assert (await info(rt, script))[0] == pid

    with_runtime(body, RuntimeConfig(persistent=True, max_output_bytes=1000))


def test_import_failure_and_missing_script(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_here\n")
    no_main = tmp_path / "no_main.py"
    no_main.write_text("X = 1\n")

    async def body(rt):
        with pytest.raises(ScriptError) as err:
            await rt.run_script(broken, [], warm=True)
        assert err.value.exc_type == "ModuleNotFoundError" and "no_such_module_here" in err.value.traceback
        with pytest.raises(ScriptError, match="main"):
            await rt.run_script(no_main, [], warm=True)
        with pytest.raises(ScriptError):
            await rt.run_script(tmp_path / "missing.py", [], warm=True)
        assert live_children() == []

    with_runtime(body)


def test_a_changed_script_is_imported_afresh(tmp_path):
    path = tmp_path / "v.py"

    async def body(rt):
        path.write_text("def main(argv):\n    return 'one'\n")
        assert await rt.run_script(path, [], warm=True) == "one"
        path.write_text("def main(argv):\n    return 'two, longer'\n")
        assert await rt.run_script(path, [], warm=True) == "two, longer"
        assert rt.warm_workers.stats()["retired"] == 1 and len(live_children(1)) == 1

    with_runtime(body)


def test_concurrent_calls_share_one_worker(script):
    async def body(rt):
        results = []

        async def one(i):
            results.append(await rt.run_script(script, ["argv", str(i)], warm=True))

        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(one, i)
        assert sorted(results) == sorted(f"argv|{i}#argv|{i}" for i in range(20))
        assert rt.warm_workers.stats()["starts"] == 1

    with_runtime(body)


def test_worker_cap_closes_the_least_recently_used(tmp_path):
    paths = []
    for name in "abc":
        p = tmp_path / f"{name}.py"
        p.write_text(f"import os\ndef main(argv):\n    return '{name}' + str(os.getpid())\n")
        paths.append(p)

    async def body(rt):
        a1 = await rt.run_script(paths[0], [], warm=True)
        await rt.run_script(paths[1], [], warm=True)
        assert await rt.run_script(paths[0], [], warm=True) == a1  # a is now most recent
        await rt.run_script(paths[2], [], warm=True)  # evicts b
        assert rt.warm_workers.get(paths[1]) is None and rt.warm_workers.get(paths[0]) is not None
        assert len(rt.warm_workers) == 2 and len(live_children(2)) == 2
        assert rt.warm_workers.stats()["retired"] == 1

    with_runtime(body, RuntimeConfig(persistent=True, max_warm_workers=2))


def test_reset_keeps_outside_workers_and_closes_workdir_ones(script):
    async def body(rt):
        pid = (await info(rt, script))[0]
        inside = rt.workdir / "inner.py"
        inside.write_text("def main(argv):\n    return 'inner'\n")
        assert await rt.run_script(inside, [], warm=True) == "inner"
        assert len(live_children(2)) == 2
        await rt.reset()
        assert rt.warm_workers.get(inside) is None and len(live_children(1)) == 1
        assert (await info(rt, script))[0] == pid
        # The worker's cwd survived the reset (same directory, emptied).
        assert await rt.run_script(script, ["cwd"], warm=True) == str(rt.workdir)

    with_runtime(body)


def test_warm_after_stop_is_refused(script):
    async def main():
        rt = SubprocessRuntime(RuntimeConfig(persistent=True))
        await rt.start()
        await info(rt, script)
        await rt.stop()
        assert live_children() == []
        with pytest.raises(RuntimeStateError):
            await rt.run_script(script, ["info"], warm=True)

    trio.run(main)


def test_worker_start_failure_is_a_crash(script, tmp_path):
    fake = tmp_path / "fakepython"
    fake.write_text("#!/bin/sh\necho 'no python here' >&2\nexit 5\n")
    fake.chmod(0o755)

    async def body(rt):
        with pytest.raises(WarmWorkerCrashed) as err:
            await rt.run_script(script, ["info"], warm=True)
        assert err.value.returncode == 5 and "no python here" in err.value.stderr_tail
        assert live_children() == []

    with_runtime(body, RuntimeConfig(persistent=True, python=str(fake)))


def test_worker_never_imports_lowwater(script, tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import sys\ndef main(argv):\n    return ','.join(sorted(m for m in sys.modules if m.startswith('lowwater')))\n"
    )

    async def body(rt):
        assert await rt.run_script(probe, [], warm=True) == ""

    with_runtime(body)


def test_worker_uses_the_configured_interpreter(script):
    async def body(rt):
        pid = (await info(rt, script))[0]
        assert psutil.Process(pid).cmdline()[:2] == [sys.executable, "-I"]

    with_runtime(body)


def _warm_worker_module():
    """The worker script as a module (stdlib only; importing it runs nothing)."""
    import importlib.util

    from lowwater.runtime.warm import WORKER_SCRIPT

    spec = importlib.util.spec_from_file_location("_warm_worker_under_test", WORKER_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_worker_scripts_framing_is_the_codecs():
    """The worker cannot import lowwater.framing; its copy must agree with it."""
    import io

    import orjson

    from lowwater import framing

    worker = _warm_worker_module()
    assert worker._HEADER.format == framing.HEADER.format == "<I"
    assert worker.MAX_REQUEST_BYTES == framing.MAX_FRAME_BYTES

    # client -> worker: the codec's frames, back to back, then end of input.
    requests = [{"argv": ["a", "é"], "env": None}, {"argv": [], "env": {"K": "v"}}]
    stream = io.BytesIO(b"".join(framing.encode_frame(orjson.dumps(r)) for r in requests))
    assert [orjson.loads(worker._recv(stream)) for _ in requests] == requests
    assert worker._recv(stream) is None
    too_long = framing.HEADER.pack(framing.MAX_FRAME_BYTES + 1)
    assert worker._recv(io.BytesIO(too_long)) is False

    # worker -> client: its frames, cut anywhere, decode with the codec.
    out = io.BytesIO()
    replies = [{"ready": True, "pid": 1}, {"ok": True, "result": "x" * 70_000}]
    for reply in replies:
        worker._send(out, reply)
    data = out.getvalue()
    decoder = framing.FrameDecoder()
    got = []
    for i in range(0, len(data), 4093):
        decoder.feed(data[i : i + 4093])
        while (payload := decoder.next_frame()) is not None:
            got.append(orjson.loads(payload))
    decoder.close()
    assert got == replies
