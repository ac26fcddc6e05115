"""Admission control by memory: high/low-water hysteresis per worker and
for the whole pool against the machine or cgroup memory limit.

The 30-worker evaluation incident (docs/design.md#incidents) was an OOM kill
after hours of slow growth; recycling alone reacts only after a worker is
already big, and a pool of workers that each stay under their own limit can
still exceed the machine's.  Admission holds new tasks back while memory is
high and lets them in again once it is back under a lower mark, so the pool
breathes instead of crossing the limit.  The gap between the marks is the
hysteresis: a single threshold would admit and hold on alternate samples.
"""

from __future__ import annotations

from pathlib import Path

import psutil

MIB = 1 << 20

# cgroup v1 reports "no limit" as a page-rounded LONG_MAX; anything at or
# above the machine's memory is no limit in practice.
_V1_UNLIMITED = 1 << 62


class Hysteresis:
    """Held at or above ``high``; released at or below ``low``; unchanged between.

    Args:
        high: the high-water mark (any unit, usually bytes).
        low: the low-water mark, ``<= high``.

    Raises:
        ValueError: ``low > high`` or either is negative.
    """

    def __init__(self, high: float, low: float) -> None:
        if low < 0 or high < 0 or low > high:
            raise ValueError(f"need 0 <= low <= high, got low={low}, high={high}")
        self.high = high
        self.low = low
        self.held = False
        self.holds = 0

    def update(self, value: float) -> bool:
        """Feed a new sample; returns whether new work is held back now."""
        if not self.held and value >= self.high:
            self.held = True
            self.holds += 1
        elif self.held and value <= self.low:
            self.held = False
        return self.held


def _read_int(path: Path) -> int | None:
    try:
        raw = path.read_text().strip()
    except OSError:
        return None
    if raw == "max":
        return None
    try:
        return int(raw)
    except ValueError:
        return None


def _cgroup_paths(proc_self_cgroup: Path) -> dict[str, str]:
    """``{"v2": path, "memory": path}`` from ``/proc/self/cgroup``."""
    out: dict[str, str] = {}
    try:
        lines = proc_self_cgroup.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            out["v2"] = path
        elif "memory" in controllers.split(","):
            out["memory"] = path
    return out


def memory_limit_bytes(root: Path = Path("/sys/fs/cgroup"), proc: Path = Path("/proc")) -> tuple[int, str]:
    """The memory the pool lives within, in bytes, and where it came from.

    Checks the process's own cgroup first (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``), then the cgroup root (inside a container
    that is the container's cgroup), and takes the smallest of those and
    the machine's total memory (``psutil.virtual_memory().total``).  The
    source is ``"cgroup-v2:<file>"``, ``"cgroup-v1:<file>"`` or ``"machine"``.
    Never raises: unreadable files are skipped.
    """
    total = psutil.virtual_memory().total
    best, source = total, "machine"
    paths = _cgroup_paths(proc / "self" / "cgroup")
    candidates: list[tuple[Path, str]] = []
    if "v2" in paths:
        candidates.append((root / paths["v2"].lstrip("/") / "memory.max", "cgroup-v2"))
    candidates.append((root / "memory.max", "cgroup-v2"))
    if "memory" in paths:
        candidates.append((root / "memory" / paths["memory"].lstrip("/") / "memory.limit_in_bytes", "cgroup-v1"))
    candidates.append((root / "memory" / "memory.limit_in_bytes", "cgroup-v1"))
    candidates.append((root / "memory.limit_in_bytes", "cgroup-v1"))
    for path, kind in candidates:
        value = _read_int(path)
        if value is None or value <= 0 or value >= _V1_UNLIMITED:
            continue
        if value < best:
            best, source = value, f"{kind}:{path}"
    return best, source


class PoolAdmission:
    """Admission state of a pool: one :class:`Hysteresis` per worker (when
    per-worker marks are set) and one for the pool's total RSS.

    Args:
        worker_high_bytes, worker_low_bytes: per-worker marks (``None``: no
            per-worker admission).  ``worker_low_bytes`` defaults to 80 % of
            the high mark.
        limit_bytes: the memory the pool lives within (see :func:`memory_limit_bytes`).
        pool_high_fraction, pool_low_fraction: the pool's marks as fractions
            of ``limit_bytes`` (``0 < low <= high <= 1``).

    Raises:
        ValueError: inconsistent marks.
    """

    def __init__(
        self,
        *,
        worker_high_bytes: float | None,
        worker_low_bytes: float | None,
        limit_bytes: int,
        pool_high_fraction: float = 0.85,
        pool_low_fraction: float = 0.75,
    ) -> None:
        if not 0 < pool_low_fraction <= pool_high_fraction <= 1:
            raise ValueError(
                f"need 0 < pool_low_water_fraction <= pool_high_water_fraction <= 1, "
                f"got {pool_low_fraction} and {pool_high_fraction}"
            )
        if worker_high_bytes is None and worker_low_bytes is not None:
            raise ValueError("low_water_mb needs high_water_mb")
        if worker_high_bytes is not None:
            if worker_low_bytes is None:
                worker_low_bytes = 0.8 * worker_high_bytes
            if not 0 < worker_low_bytes <= worker_high_bytes:
                raise ValueError(
                    f"need 0 < low_water_mb <= high_water_mb, got {worker_low_bytes / MIB} and {worker_high_bytes / MIB}"
                )
        self.worker_high = worker_high_bytes
        self.worker_low = worker_low_bytes
        self.limit_bytes = limit_bytes
        self.pool = Hysteresis(pool_high_fraction * limit_bytes, pool_low_fraction * limit_bytes)
        self._workers: dict[int, Hysteresis] = {}
        self.pool_bytes = 0
        self._retired_holds = 0

    def worker(self, wid: int, rss: int) -> tuple[bool, bool]:
        """Feed worker ``wid``'s RSS (bytes); returns ``(held, changed)``."""
        high, low = self.worker_high, self.worker_low
        if high is None or low is None:  # both or neither: __init__ fills low from high
            return False, False
        h = self._workers.get(wid)
        if h is None:
            h = self._workers[wid] = Hysteresis(high, low)
        before = h.held
        held = h.update(rss)
        return held, held != before

    def worker_held(self, wid: int) -> bool:
        h = self._workers.get(wid)
        return h is not None and h.held

    def update_pool(self, total_rss: int) -> tuple[bool, bool]:
        """Feed the pool's total RSS (bytes); returns ``(held, changed)``."""
        self.pool_bytes = total_rss
        before = self.pool.held
        held = self.pool.update(total_rss)
        return held, held != before

    @property
    def worker_holds(self) -> int:
        """Times any worker went from admitted to held, retired workers included."""
        return sum(h.holds for h in self._workers.values()) + self._retired_holds

    def retire(self, wid: int) -> None:
        """Forget worker ``wid`` but keep its hold count for the report."""
        h = self._workers.pop(wid, None)
        if h is not None:
            self._retired_holds += h.holds
