"""Process memory: current RSS, and giving freed heap pages back to the OS.

glibc keeps freed heap memory for reuse and returns it only when the top of a
heap exceeds its trim threshold, which itself rises with the dynamic mmap
threshold; an env worker in a peer system sat at 990 MB resting after a
1053 MB peak for that reason (DESIGN.md section 1).  :func:`malloc_trim`
releases free pages of every arena.  It is guarded: the symbol does not exist
on musl (``AttributeError``), the C library may not load (``OSError``), and it
is pointless under jemalloc or tcmalloc (``LD_PRELOAD``).  It walks every
arena, so callers run it off the event loop (``trio.to_thread.run_sync``:
ctypes releases the GIL for the call) and not on every request.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import threading
import time
from collections.abc import Callable

import psutil

MIB = 1 << 20


def rss_bytes() -> int:
    """Current resident set size of this process in bytes (not a peak counter)."""
    return psutil.Process().memory_info().rss


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    preload = os.environ.get("LD_PRELOAD", "")
    if "jemalloc" in preload or "tcmalloc" in preload or "mimalloc" in preload:
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim  # AttributeError on musl
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def malloc_trim_available() -> bool:
    """True when glibc's ``malloc_trim`` can be called in this process."""
    return _malloc_trim() is not None


class Trimmer:
    """Rate-limited, guarded ``malloc_trim(0)``.

    Args:
        min_interval_s: calls closer together than this (seconds) are skipped;
            trimming walks every arena, so it belongs at quiescent points
            (step end, rollout close), not on every request.
        clock: monotonic time source (seconds).
    """

    def __init__(self, min_interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._last = -float("inf")
        self._lock = threading.Lock()
        self.calls = 0

    def __call__(self) -> bool:
        """Trim now unless unavailable or rate-limited; True if a trim ran.

        Blocking: call it from a worker thread, never on the Trio loop.
        """
        fn = _malloc_trim()
        if fn is None:
            return False
        with self._lock:
            now = self._clock()
            if now - self._last < self.min_interval_s:
                return False
            self._last = now
        fn(0)
        self.calls += 1
        return True
