"""Allocator hygiene for worker processes.

The 30-worker evaluation incident (docs/design.md#incidents) ran workers whose
RSS never came back down: glibc keeps freed memory in per-thread arenas (up
to 8 x cores of them) and, once a large block is freed, raises its dynamic
mmap threshold so later large blocks come from arenas that are rarely
returned.  Two settings bound that:

* ``M_ARENA_MAX`` (environment ``MALLOC_ARENA_MAX``), default 2 here: fewer
  arenas, less memory stranded in idle ones;
* ``M_TRIM_THRESHOLD`` (environment ``MALLOC_TRIM_THRESHOLD_``), default
  128 KiB: free memory at the top of a heap beyond this is returned; setting
  it also switches off glibc's dynamic mmap/trim thresholds.

**The subtlety.**  glibc reads those variables once, when the process starts
(its tunables are parsed by the dynamic loader from the initial environment
before ``malloc`` is first used).  A forkserver child is a ``fork()`` of an
already running interpreter: it inherits the forkserver's initialised
allocator, so setting the variables in the child's ``os.environ`` changes
nothing for the child itself.  :func:`apply` therefore calls ``mallopt`` in
the child (which takes effect at once: a lower arena maximum applies to
arenas created afterwards, and the worker creates its threads later) *and*
exports the variables, so processes the worker executes (runtimes, agent
programs, scoring scripts) start with them.

Everything is guarded: ``mallopt`` does not exist (or does nothing) outside
glibc, and an ``LD_PRELOAD``-ed jemalloc/tcmalloc/mimalloc ignores it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import re
import tempfile
from collections.abc import Mapping, MutableMapping
from typing import Any

import attrs

#: glibc ``mallopt`` parameter numbers (``malloc.h``).
M_TRIM_THRESHOLD = -1
M_ARENA_MAX = -8

ARENA_MAX_ENV = "MALLOC_ARENA_MAX"
TRIM_THRESHOLD_ENV = "MALLOC_TRIM_THRESHOLD_"

DEFAULT_ARENA_MAX = 2
DEFAULT_TRIM_THRESHOLD = 128 * 1024


@attrs.frozen
class AllocatorSettings:
    """What a worker applies; ``None`` leaves a setting alone.

    Attributes:
        arena_max: maximum number of malloc arenas (>= 1).
        trim_threshold: bytes of free heap top kept before trimming (>= 0).
    """

    arena_max: int | None = DEFAULT_ARENA_MAX
    trim_threshold: int | None = DEFAULT_TRIM_THRESHOLD

    def __attrs_post_init__(self) -> None:
        if self.arena_max is not None and self.arena_max < 1:
            raise ValueError(f"arena_max must be >= 1, not {self.arena_max}")
        if self.trim_threshold is not None and self.trim_threshold < 0:
            raise ValueError(f"trim_threshold must be >= 0, not {self.trim_threshold}")

    def environ(self) -> dict[str, str]:
        """The environment variables that carry these settings to exec'd processes."""
        out = {}
        if self.arena_max is not None:
            out[ARENA_MAX_ENV] = str(self.arena_max)
        if self.trim_threshold is not None:
            out[TRIM_THRESHOLD_ENV] = str(self.trim_threshold)
        return out


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        return int(raw.strip(), 0)
    except ValueError:
        raise ValueError(f"{name}={raw!r} in the environment is not an integer") from None


#: Passed for a setting, leaves glibc's own behaviour for it alone.
OFF = "off"


def resolve(
    arena_max: int | str | None = None,
    trim_threshold: int | str | None = None,
    environ: Mapping[str, str] | None = None,
) -> AllocatorSettings:
    """The settings for workers, by precedence: an explicit argument, then a
    value already in the environment (the operator's choice), then the
    default.  :data:`OFF` (``"off"``) leaves that setting to glibc.

    Leaving the trim threshold alone keeps glibc's dynamic mmap threshold,
    which is faster for churning large buffers (they are reused from the
    heap instead of mapped and faulted in afresh) and slower to give memory
    back: see ``docs/workers.md`` for the measured trade-off.

    Raises:
        ValueError: a value in the environment is not an integer, or a value is
            out of range.
    """
    environ = os.environ if environ is None else environ
    if arena_max is None:
        arena_max = _env_int(environ, ARENA_MAX_ENV) or DEFAULT_ARENA_MAX
    if trim_threshold is None:
        env = _env_int(environ, TRIM_THRESHOLD_ENV)
        trim_threshold = DEFAULT_TRIM_THRESHOLD if env is None else env
    return AllocatorSettings(_setting("malloc_arena_max", arena_max), _setting("malloc_trim_threshold", trim_threshold))


def _setting(name: str, value: int | str) -> int | None:
    """``value`` as an int, or ``None`` for ``"off"``; raises ``ValueError`` for any other string."""
    if isinstance(value, str):
        if value != OFF:
            raise ValueError(f"{name} must be an integer, None or {OFF!r}, not {value!r}")
        return None
    return value


@functools.cache
def _libc() -> Any | None:
    """glibc, or ``None`` when another allocator is in charge or none loads."""
    preload = os.environ.get("LD_PRELOAD", "")
    if any(name in preload for name in ("jemalloc", "tcmalloc", "mimalloc")):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        # AttributeError where the symbol does not exist; gnu_get_libc_version
        # is glibc only (musl's mallopt is a stub that does nothing).
        for symbol in ("mallopt", "gnu_get_libc_version"):
            getattr(libc, symbol)
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


def mallopt_available() -> bool:
    """True when glibc's ``mallopt`` can be called in this process."""
    return _libc() is not None


def apply(settings: AllocatorSettings, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Apply ``settings`` to this process and export them for its children.

    Call it early in the worker, before threads start.  Returns a report:
    ``{"env": {...exported...}, "mallopt": {"M_ARENA_MAX": 1, ...}}`` where
    a ``mallopt`` value is glibc's return code (1 = applied, 0 = refused)
    or ``None`` when ``mallopt`` is unavailable.  Never raises for a missing
    or foreign allocator.
    """
    target: MutableMapping[str, str] = os.environ if environ is None else environ
    exported = settings.environ()
    target.update(exported)
    libc = _libc()
    results: dict[str, int | None] = {}
    for name, param, value in (
        ("M_ARENA_MAX", M_ARENA_MAX, settings.arena_max),
        ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, settings.trim_threshold),
    ):
        if value is None:
            continue
        if libc is None:
            results[name] = None
            continue
        try:
            results[name] = int(libc.mallopt(param, min(value, 2**31 - 1)))
        except (OSError, AttributeError):
            results[name] = None
    return {"env": exported, "mallopt": results}


def arena_count() -> int | None:
    """Number of malloc arenas in this process (glibc ``malloc_info``), or ``None``.

    For tests and benchmarks: it locks every arena and writes XML to a
    temporary file, so it is not for hot paths.
    """
    libc = _libc()
    if libc is None:
        return None
    try:
        malloc_info = libc.malloc_info
        fopen, fclose = libc.fopen, libc.fclose
    except AttributeError:
        return None
    fopen.restype = ctypes.c_void_p
    fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    fclose.argtypes = [ctypes.c_void_p]
    malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    with tempfile.NamedTemporaryFile("rb", prefix="lowwater-malloc-info-") as tmp:
        fp = fopen(tmp.name.encode(), b"w")
        if not fp:
            return None
        try:
            malloc_info(0, fp)
        finally:
            fclose(fp)
        xml = tmp.read().decode("ascii", "replace")
    return len(re.findall(r'<heap nr="\d+"', xml)) or None
