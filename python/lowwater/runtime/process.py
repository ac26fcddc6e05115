"""Process helpers shared by the subprocess runtime and its warm workers:
killing a process group, waiting without reaping, reaping under
cancellation, and capped output readers."""

from __future__ import annotations

import os
import signal

import trio

#: After a program's group is killed, how long readers may take to hit EOF
#: before the pipes are closed anyway (a process that left the group may
#: still hold them).
PIPE_GRACE_S = 2.0
#: Bound on reaping a SIGKILLed process during cleanup (seconds).
REAP_TIMEOUT_S = 10.0


def kill_group(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads; no error if it is gone."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def wait_exited(proc: trio.Process) -> None:
    """Return once ``proc`` has exited, **without reaping it**.

    While the exited leader is an unreaped zombie its pid, and so its
    process-group id, cannot be reused: killing the group right after this
    returns cannot hit an unrelated process.  Falls back to ``proc.wait()``
    (which reaps) where ``pidfd_open`` is missing.
    """
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        await proc.wait()
        return
    try:
        await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)


async def reap(proc: trio.Process) -> None:
    """Kill ``proc``'s group if it still runs, close its pipes and reap it.

    Shielded and bounded: safe in ``finally`` blocks of cancelled tasks.
    """
    with trio.CancelScope(shield=True):
        if proc.returncode is None:
            kill_group(proc.pid)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                await stream.aclose()
        with trio.move_on_after(REAP_TIMEOUT_S):
            await proc.wait()


class Capped:
    """Reads a stream to EOF, keeping at most ``limit`` bytes: the first ones
    (``tail=False``, for results) or the last ones (``tail=True``, for
    stderr, where the error is).  Reading continues past the cap, so a
    chatty program never blocks on a full pipe."""

    def __init__(self, limit: int, *, tail: bool = False) -> None:
        self.limit = limit
        self.tail = tail
        self.buf = bytearray()
        self.truncated = False

    async def drain(self, stream: trio.abc.ReceiveStream, done: trio.Event) -> None:
        try:
            while True:
                data = await stream.receive_some(65536)
                if not data:
                    return
                if self.tail:
                    self.buf += data
                    if len(self.buf) > 2 * self.limit:  # trim in batches: amortized O(1)
                        del self.buf[: len(self.buf) - self.limit]
                        self.truncated = True
                else:
                    room = self.limit - len(self.buf)
                    if len(data) > room:
                        self.truncated = True
                        data = data[:room]
                    self.buf += data
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return
        finally:
            done.set()

    def value(self) -> bytes:
        if len(self.buf) > self.limit:
            self.truncated = True
            return bytes(self.buf[-self.limit :])
        return bytes(self.buf)
