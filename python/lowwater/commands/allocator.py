"""Long-lived commands run on glibc's allocator instead of pymalloc.

pymalloc serves small Python objects from 1 MiB arenas and returns an arena
to the OS only once every object in it is gone; after a burst of rollouts a
few surviving objects per arena (Trio's deadline heap, hypercorn and h11
leftovers, caches) pin most of them, and neither waiting nor
``malloc_trim`` gives them back.  On glibc's allocator the same objects live
in the heap the data plane's idle trim already returns.  Measured with
``benches/interception.py --phases hold --servers proxy`` (16,384 open
rollouts, two bursts; 2026-11-24, 2 cores): ``lowwater proxy`` rested
33.3 MiB over its baseline with pymalloc, and a second burst added 3.7 MiB;
with ``PYTHONMALLOC=malloc`` it rested 10.5 MiB over, and a second burst
added nothing (-0.9 MiB).  The figures are in benches/README.md.

A process picks its allocator before it starts, so the command re-executes
itself once (same pid, same arguments) with ``PYTHONMALLOC=malloc`` in its
environment.  A ``PYTHONMALLOC`` the user set (``pymalloc`` included) is
kept.
"""

from __future__ import annotations

import os
import sys


def reexec_on_glibc_malloc() -> None:
    """Replace this process by itself under ``PYTHONMALLOC=malloc``, unless
    ``PYTHONMALLOC`` is set already (returns then).

    Only for a command's own process (``lowwater proxy`` from its console
    script or ``python -m lowwater``), never for a call of
    :func:`lowwater.cli.main` inside another program: ``os.execve`` replaces
    the whole process.

    Raises:
        OSError: the interpreter could not be executed again.
    """
    if "PYTHONMALLOC" in os.environ:
        return
    env = {**os.environ, "PYTHONMALLOC": "malloc"}
    # Whatever was printed so far must not be lost, nor printed twice.
    sys.stdout.flush()
    sys.stderr.flush()
    # sys.orig_argv: the interpreter's own options and the script or -m/-c as given.
    os.execve(sys.executable, sys.orig_argv, env)
