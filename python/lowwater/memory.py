"""Process memory: current RSS, and giving freed heap pages back to the OS.

glibc keeps freed heap memory for reuse and returns it only when the top of a
heap exceeds its trim threshold, which itself rises with the dynamic mmap
threshold; an env worker in a peer system sat at 990 MB resting after a
1053 MB peak for that reason (docs/design.md#incidents).  :func:`malloc_trim`
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
    return int(psutil.Process().memory_info().rss)


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


class MemoryRecord:
    """RSS over a run: baseline, peak, resting, and a bounded sample series.

    Samples are ``(elapsed_s, rss_bytes, finished_rollouts)``.  The first
    is the baseline itself, at ``t = 0`` (a 64-rollout run used to plot two
    samples from 1.38 s on, missing its start), and :meth:`interval_s` says
    when the next one is due: often while the run is young, less often as it
    grows, so a run of two seconds and one of five hours both get a plot of
    a few hundred points.  The series is bounded: past ``max_samples`` every
    other sample (never the first) is dropped and the stride doubles, so a
    five-hour run keeps a few kilobytes, not a list that itself grows with
    the run.  ``peak_bytes`` counts every sample, dropped or not.

    Args:
        baseline_bytes: RSS before the run started work (default: now).
        max_samples: upper bound on kept samples (>= 2).
        min_interval_s: shortest wait :meth:`interval_s` asks for (seconds).
        target_samples: about how many samples :meth:`interval_s` spreads
            over the run so far.
    """

    def __init__(
        self,
        baseline_bytes: int | None = None,
        max_samples: int = 4096,
        *,
        min_interval_s: float = 0.05,
        target_samples: int = 256,
    ) -> None:
        if max_samples < 2:
            raise ValueError("max_samples must be >= 2")
        self.baseline_bytes = rss_bytes() if baseline_bytes is None else baseline_bytes
        self.peak_bytes = self.baseline_bytes
        self.last_bytes = self.baseline_bytes
        self.max_samples = max_samples
        self.min_interval_s = min_interval_s
        self.target_samples = target_samples
        self._start = time.monotonic()
        self.samples: list[tuple[float, int, int]] = [(0.0, self.baseline_bytes, 0)]
        self._stride = 1
        self._seen = 0

    def elapsed_s(self) -> float:
        """Seconds since the baseline sample."""
        return time.monotonic() - self._start

    def interval_s(self) -> float:
        """Seconds to wait before the next sample: ``min_interval_s``, or the
        run's age over ``target_samples`` once that is longer."""
        return max(self.min_interval_s, self.elapsed_s() / self.target_samples)

    def add(self, rss: int | None = None, finished: int = 0, *, keep: bool = False) -> int:
        """Record one sample (``rss`` in bytes, default: measure now); returns it.

        ``keep`` records it whatever the stride (the run's last sample).
        """
        rss = rss_bytes() if rss is None else rss
        self.last_bytes = rss
        self.peak_bytes = max(self.peak_bytes, rss)
        self._seen += 1
        if keep or self._seen % self._stride == 0:
            self.samples.append((self.elapsed_s(), rss, finished))
            if len(self.samples) > self.max_samples:
                del self.samples[1::2]  # the baseline (index 0) stays
                self._stride *= 2
        return rss

    def to_json(self) -> dict[str, object]:
        """``{"baseline_bytes", "peak_bytes", "samples": [[elapsed_s, rss_bytes, finished], ...]}``."""
        return {
            "baseline_bytes": self.baseline_bytes,
            "peak_bytes": self.peak_bytes,
            "samples": [[round(t, 3), rss, n] for t, rss, n in self.samples],
        }

    def summary(self, resting_bytes: int | None = None) -> dict[str, float]:
        """``rss_baseline_mb``, ``rss_peak_mb``, ``rss_resting_mb`` (MiB).

        ``resting_bytes`` is RSS after the run's drain (default: the last sample).
        """
        resting = self.last_bytes if resting_bytes is None else resting_bytes
        return {
            "rss_baseline_mb": round(self.baseline_bytes / MIB, 2),
            "rss_peak_mb": round(max(self.peak_bytes, resting) / MIB, 2),
            "rss_resting_mb": round(resting / MIB, 2),
        }
