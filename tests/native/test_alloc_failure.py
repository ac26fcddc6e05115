"""The OS refusing payload memory is a MemoryError, never a dead process.

Each case runs in a child process whose address space is capped (RLIMIT_AS)
below what one put needs: the put must raise MemoryError (an ``Exception``, so
a trainer's error handling sees it), leave the table empty and usable, and the
process must exit normally.  Both storage paths are covered: a payload at or
above ``mmap_threshold`` (its own mapping) and one below it (heap).

Found while writing this suite: the heap path aborts the process (Rust's
allocation-failure handler, SIGABRT) instead of raising; the mapped path is
fine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import resource, sys
    import numpy as np
    import psutil
    from lowwater._native import FetchBuffer, InterceptTable

    table_kind, threshold = sys.argv[1], int(sys.argv[2])
    src = np.zeros(512 << 20, np.uint8)  # reserved (not touched) before the cap
    vms = psutil.Process().memory_info().vms
    resource.setrlimit(resource.RLIMIT_AS, (vms + (128 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
    if table_kind == "fetch":
        t = FetchBuffer(mmap_threshold=threshold)
        put = lambda k, b: t.put(k, b, dtype="uint8", shape=(len(b),))
    else:
        t = InterceptTable(mmap_threshold=threshold)
        t.open_rollout("r")
        put = lambda k, b: t.insert(k, "r", b, protocol="p", stream=False)
    try:
        put("big", src)
    except MemoryError as e:
        print("MemoryError", e)
    else:
        print("stored")
    s = t.stats()
    assert (s["entries"], s["bytes"], s["live_bytes"]) == (0, 0, 0), s
    put("small", b"abc")
    assert t.stats()["entries"] == 1 and bytes(t.get("small")) == b"abc"
    print("usable")
    """
)


@pytest.mark.parametrize("table_kind", ["fetch", "intercept"])
@pytest.mark.parametrize("path", ["mapped", "heap"])
def test_refused_memory_is_memory_error(table_kind, path):
    threshold = 1 << 20 if path == "mapped" else 1 << 40
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, table_kind, str(threshold)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "RUST_BACKTRACE": "0"},
    )
    detail = f"rc={proc.returncode}\nstdout={proc.stdout}\nstderr={proc.stderr[-2000:]}"
    assert proc.returncode == 0, f"the process died instead of raising MemoryError: {detail}"
    assert proc.stdout.splitlines()[0].startswith("MemoryError"), detail
    assert proc.stdout.splitlines()[-1] == "usable", detail
