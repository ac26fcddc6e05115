"""Append-only JSONL files: whole lines or nothing, private to the user.

Results and trajectory files are appended to while a run goes on and must
stay parseable whatever happens: a failed ``write`` (a full disk) used to
leave a partial line that the next row was appended to, so a good row became
unparseable.  :class:`LineFile` writes each line with one ``os.write`` on an
``O_APPEND`` descriptor and, if the write fails or is short, truncates the
file back to where the line began before raising.  Files are created mode
0600: they hold prompts, completions and rewards of the run.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

#: Mode of every results/trajectory file lowwater creates.
FILE_MODE = 0o600


class LineWriteError(OSError):
    """A line could not be appended; the file was truncated back to its last whole line."""


def open_private(path: Path, flags: int) -> int:
    """``os.open`` with mode 0600 (applied to an existing file too); the descriptor."""
    fd = os.open(path, flags | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except OSError:
        os.close(fd)
        raise
    return fd


class LineFile:
    """One file opened for appending whole lines; thread-safe.

    Args:
        path: the file (created 0600 if missing).

    Raises:
        OSError: the file cannot be opened.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd: int | None = open_private(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        self._lock = threading.Lock()
        self.lines_written = 0

    def append(self, line: bytes) -> None:
        """Append ``line`` (which ends in ``\\n``) whole, or not at all.

        Blocking (file I/O): call it from a thread, e.g.
        ``trio.to_thread.run_sync(file.append, line)``.

        Raises:
            LineWriteError: the write failed (``ENOSPC``: the disk is full);
                the file holds exactly the lines written before.
            ValueError: the file was closed.
        """
        with self._lock:
            if self._fd is None:
                raise ValueError(f"{self.path} is closed")
            fd = self._fd
            start = os.lseek(fd, 0, os.SEEK_END)
            try:
                written = os.write(fd, line)
                if written != len(line):
                    raise OSError(errno.ENOSPC, "short write")
            except OSError as exc:
                try:
                    os.ftruncate(fd, start)
                except OSError:
                    pass
                reason = "the disk is full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else exc.strerror
                raise LineWriteError(exc.errno, f"cannot append to {self.path}: {reason}") from exc
            self.lines_written += 1

    def close(self) -> None:
        """Flush to disk (fsync) and close.  Idempotent."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)


def write_atomic(path: Path, lines: list[bytes]) -> None:
    """Replace ``path`` with ``lines`` atomically (a 0600 temporary file,
    fsynced, then renamed); the temporary file is removed on every error.

    Raises:
        OSError: the file could not be written (``path`` is unchanged).
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        with os.fdopen(fd, "wb") as f:
            for line in lines:
                f.write(line)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
