"""Start worker processes from the stdlib forkserver without the parent's ``__main__``.

multiprocessing re-imports the parent's main module in every child started
by spawn or forkserver.  Under ``pytest`` that is pytest; under a trainer
script it is the script and everything it imports (torch...), in every
worker, on every recycle: exactly the start-up cost and memory the
forkserver is here to avoid (docs/workers.md, "Why a forkserver").  The
worker's job is named by a ``module:callable`` factory, so the main module
is never needed.

:class:`LeanPopen` does this by overriding the private
``multiprocessing.popen_forkserver.Popen._launch`` with a copy of its body
minus the two ``init_main_*`` preparation keys.  A private method can change
in any release, so the copy is only trusted on the versions it was checked
against (:data:`SUPPORTED_PYTHON`); :func:`check_python` refuses the others
when a pool starts, rather than start workers through a launcher that may
no longer match the forkserver's protocol.

Stdlib only: this module is unpickled by reference in every worker.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import sys
from collections.abc import Sequence
from multiprocessing import context as mp_context
from multiprocessing import forkserver, popen_forkserver, reduction, spawn, util
from typing import Any

#: Modules the forkserver imports once; every worker shares their pages.
#: Lean on purpose: a worker imports its job's dependencies itself.
LEAN_PRELOAD = ("lowwater.workers.child", "lowwater.workers.pool")

#: CPython ``(major, minor)`` versions, half-open ``[low, high)``, whose
#: ``popen_forkserver.Popen._launch`` :meth:`LeanPopen._launch` copies.  The
#: body (and ``spawn.get_preparation_data``'s ``init_main_*`` keys) was
#: compared and found identical on CPython 3.10.13, 3.11.7, 3.12.1 and
#: 3.13.0; the worker tests run on 3.11 (3.11 is also the floor for
#: ``except*``).  Later versions have not been checked.  Keep in step with
#: ``requires-python`` in pyproject.toml (``tests/workers/test_launcher.py``
#: checks that they agree).
SUPPORTED_PYTHON = ((3, 11), (3, 14))


def supported_range() -> str:
    """:data:`SUPPORTED_PYTHON` as a version specifier, e.g. ``">=3.11,<3.14"``."""
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_PYTHON
    return f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"


def check_python(version: tuple[int, int] | None = None, implementation: str | None = None) -> None:
    """Refuse to launch workers on an interpreter whose forkserver was not checked.

    Args:
        version: ``(major, minor)``; default ``sys.version_info[:2]``.
        implementation: default ``sys.implementation.name``.

    Raises:
        RuntimeError: not CPython within :data:`SUPPORTED_PYTHON`; the message
            names the supported range and the ``start_method="spawn"`` way out.
    """
    major, minor = sys.version_info[:2] if version is None else version
    implementation = sys.implementation.name if implementation is None else implementation
    low, high = SUPPORTED_PYTHON
    if implementation == "cpython" and low <= (major, minor) < high:
        return
    raise RuntimeError(
        f"lowwater's worker pool starts workers with a copy of CPython's private forkserver launcher "
        f"(multiprocessing.popen_forkserver.Popen._launch), checked on CPython {supported_range()} only; "
        f"this is {implementation} {major}.{minor}. "
        f"Use a supported Python, or WorkerPool(..., start_method='spawn') (slower starts, and every worker "
        f"re-imports the parent's __main__)."
    )


class LeanPopen(popen_forkserver.Popen):
    """``popen_forkserver.Popen`` minus the parent's ``__main__``.

    Same body as the stdlib's ``_launch`` on :data:`SUPPORTED_PYTHON`, with
    the two ``init_main_*`` keys dropped from the preparation data.
    """

    def _launch(self, process_obj: Any) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        prep_data.pop("init_main_from_name", None)
        prep_data.pop("init_main_from_path", None)
        buf = io.BytesIO()
        mp_context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            mp_context.set_spawning_popen(None)
        # _fds and util.close_fds are private; typeshed does not list them.
        self.sentinel, w = forkserver.connect_to_new_process(self._fds)  # type: ignore[attr-defined]  # private, see above
        _parent_w = os.dup(w)
        # util.close_fds is private too (see above): hence the ignore.
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))  # type: ignore[attr-defined]
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class LeanProcess(mp_context.ForkServerProcess):
    """A forkserver process started through :class:`LeanPopen`."""

    @staticmethod
    def _Popen(process_obj: Any) -> LeanPopen:
        return LeanPopen(process_obj)


def configure_forkserver(extra: Sequence[str] = ()) -> None:
    """Set the forkserver's preload list to :data:`LEAN_PRELOAD` plus ``extra``.

    The forkserver is one per parent process and reads the list when it
    starts, so the first pool (or other forkserver user) in a process decides
    it; later calls only matter if the server is restarted.
    """
    multiprocessing.get_context("forkserver").set_forkserver_preload([*LEAN_PRELOAD, *extra])
