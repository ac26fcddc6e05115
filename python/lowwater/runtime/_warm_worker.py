"""Warm worker process: import one script once, then answer calls to its ``main``.

Run as ``python -I _warm_worker.py SCRIPT MAX_RESULT_BYTES STDERR_CAP_BYTES``
by :mod:`lowwater.runtime.warm`.  Stdlib only and never imports lowwater, so
it starts as fast as the script itself allows and runs inside any sandbox
that has a Python.

Protocol (the worker's original stdin/stdout): frames of
:mod:`lowwater.framing` (a 4-byte unsigned little-endian length followed by
that many bytes), each holding UTF-8 JSON.  This script cannot import
lowwater, so ``_HEADER`` and ``MAX_REQUEST_BYTES`` below are copies of the
codec's ``HEADER`` and ``MAX_FRAME_BYTES``; ``tests/runtime/test_warm.py``
checks that they agree and that frames cross in both directions.

* worker -> client, once: ``{"ready": true, "pid": N}`` after the import, or
  ``{"ready": false, "type", "message", "traceback"}`` (then it exits 1).
* client -> worker: ``{"argv": [str, ...], "env": {str: str} | null}``.
* worker -> client: ``{"ok": true, "result": str}`` or
  ``{"ok": false, "type", "message", "traceback"}``.

End of input makes the worker exit 0.  The protocol fds are private
duplicates: fd 0 is reopened on /dev/null and fd 1 on stderr, so a script
that reads stdin or prints (from Python or C) cannot corrupt the frames.
"""

import json
import os
import struct
import sys
import traceback

#: = lowwater.framing.HEADER: 4-byte unsigned little-endian length prefix.
_HEADER = struct.Struct("<I")
#: = lowwater.framing.MAX_FRAME_BYTES: a longer request ends the worker (exit 2).
MAX_REQUEST_BYTES = 64 << 20
TRACEBACK_CHARS = 32 << 10


def _error(exc, message=None):
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {
        "ok": False,
        "ready": False,
        "type": type(exc).__name__,
        "message": message if message is not None else str(exc)[:4096],
        "traceback": tb[-TRACEBACK_CHARS:],
    }


def _read_exact(stream, n):
    data = stream.read(n)
    if data is None or len(data) < n:
        return None
    return data


def _send(stream, obj):
    data = json.dumps(obj, ensure_ascii=False).encode("utf-8")
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def _recv(stream):
    """The next request's payload; ``None`` at end of input; ``False`` if its
    length exceeds ``MAX_REQUEST_BYTES``."""
    header = _read_exact(stream, _HEADER.size)
    if header is None:
        return None
    (length,) = _HEADER.unpack(header)
    if length > MAX_REQUEST_BYTES:
        return False
    return _read_exact(stream, length)


def _load(script):
    import importlib.util

    # As `python SCRIPT` would: the script's directory first, then PYTHONPATH
    # (which -I ignored), so warm and cold runs import the same modules.
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[1:1] = extra
    # Not "__main__": the script's `if __name__ == "__main__":` block is its
    # cold entry point and must not run here.
    spec = importlib.util.spec_from_file_location("__lowwater_script__", script)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {script!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    if not callable(getattr(module, "main", None)):
        raise AttributeError(f"{script} has no callable main(argv)")
    return module


def _call(module, script, request, max_result):
    argv = [str(a) for a in request.get("argv") or []]
    overlay = request.get("env") or {}
    saved_env = dict(os.environ)
    saved_argv = sys.argv
    saved_cwd = os.getcwd()
    try:
        os.environ.update(overlay)
        sys.argv = [script, *argv]
        result = module.main(argv)
        if not isinstance(result, str):
            return {
                "ok": False,
                "type": "TypeError",
                "message": f"main returned {type(result).__name__}, not str",
                "traceback": "",
            }
        if len(result.encode("utf-8")) > max_result:
            return {
                "ok": False,
                "type": "OutputLimitExceeded",
                "message": f"result larger than {max_result} bytes",
                "traceback": "",
            }
        return {"ok": True, "result": result}
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit too: a script's exit must not end the worker
        return _error(exc)
    finally:
        # Restore what the call may have changed, so the next call (and the
        # next rollout on a pooled runtime) starts from the same state.
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv = saved_argv
        try:
            os.chdir(saved_cwd)
        except OSError:
            pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass


def _cap_stderr(cap):
    # The client opened our stderr file with O_APPEND: after truncation the
    # next write lands at offset 0, so the file stays bounded over a long run.
    try:
        if os.fstat(2).st_size > cap:
            os.ftruncate(2, 0)
    except OSError:
        pass


def main():
    script, max_result, stderr_cap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    proto_in = os.fdopen(os.dup(0), "rb")
    proto_out = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    try:
        module = _load(script)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        _send(proto_out, _error(exc))
        return 1
    _send(proto_out, {"ready": True, "pid": os.getpid()})
    while True:
        body = _recv(proto_in)
        if body is None:
            return 0
        if body is False:
            return 2
        try:
            request = json.loads(body)
        except ValueError as exc:
            reply = _error(exc)
        else:
            reply = _call(module, script, request, max_result)
        try:
            _send(proto_out, reply)
        except (TypeError, ValueError, UnicodeEncodeError) as exc:  # e.g. lone surrogates in the result
            _send(proto_out, _error(exc, f"reply not encodable: {exc}"))
        _cap_stderr(stderr_cap)


if __name__ == "__main__":
    sys.exit(main())
