"""The viewer's HTTP server: static files and a JSON API over a run's files.

Routes (all ``GET``):

* ``/`` — the page; ``/static/{name}`` — its script and style sheet.
* ``/api/run`` — ``{"results", "header", "summary", "samples"}``: the
  header line, the summary line (with the memory record) or ``null`` while
  the run has not finished, and whether transcripts exist.
* ``/api/rows`` — ``{"rows": [...]}``: one compact object per row
  (:func:`row_summary`), read from the file on each request, so a run
  still in progress shows its new rows on reload.
* ``/api/sample/{rollout_id}`` — the rollout's transcript, as written
  (404 when it has none).  Found through an index of byte offsets built on
  first use and rebuilt when an id is missing (the file grew).

Built on :mod:`lowwater.http`, the package's one HTTP layer; file reads run
in worker threads, never on the Trio loop.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import trio

from lowwater.eval.results import read_rows, read_summary
from lowwater.eval.samples import index, read_sample
from lowwater.http import HTTPError, Receive, Router, Scope, Send, send_bytes, send_json

#: Static files served, with their content types (nothing else is readable).
STATIC = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
#: Characters of an error message kept in the table (the transcript has all of it).
MESSAGE_CHARS = 300
# The page needs nothing from elsewhere; say so to the browser as well.
_HEADERS = [("cache-control", "no-store"), ("content-security-policy", "default-src 'self'; img-src 'self' data:")]


def row_summary(position: int, row: dict[str, Any]) -> dict[str, Any]:
    """The table's view of one results row: ``i`` (position in the file),
    ``task_id``, ``rollout_id``, ``group_id``, ``reward``, ``correct``,
    ``error_class``, ``error`` (message, truncated), ``turns``, ``total_s``,
    ``attempts``."""
    error = row.get("error") or {}
    return {
        "i": position,
        "task_id": row.get("task_id"),
        "rollout_id": row.get("rollout_id"),
        "group_id": row.get("group_id"),
        "reward": row.get("reward"),
        "correct": (row.get("metrics") or {}).get("correct"),
        "error_class": error.get("class"),
        "error": str(error.get("message") or "")[:MESSAGE_CHARS] or None,
        "turns": row.get("turns"),
        "total_s": (row.get("timing") or {}).get("total_s"),
        "attempts": row.get("attempts"),
    }


class Viewer:
    """The viewer of one run (an ASGI app).

    Args:
        results: the results file (``RUN.jsonl``).

    Raises:
        lowwater.eval.results.ResultsFileError: it is not a results file.
    """

    def __init__(self, results: Path) -> None:
        self.results = Path(results)
        header, _, _ = read_rows(self.results)
        if header is None:
            from lowwater.eval.results import ResultsFileError

            raise ResultsFileError(f"{self.results} has no lowwater header line; not a results file")
        self.header = header
        name = header.get("samples")
        self.samples = self.results.with_name(name) if name else None
        self._index: dict[str, tuple[int, int]] = {}
        self.router = Router()
        self.router.add("GET", "/", self._page)
        self.router.add("GET", "/static/{name}", self._static)
        self.router.add("GET", "/api/run", self._run)
        self.router.add("GET", "/api/rows", self._rows)
        self.router.add("GET", "/api/sample/{rollout_id}", self._sample)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.router(scope, receive, send)

    async def _page(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._send_static(send, "index.html")

    async def _static(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._send_static(send, scope["path_params"]["name"])

    async def _send_static(self, send: Send, name: str) -> None:
        if name not in STATIC:
            raise HTTPError(404, f"no static file {name!r}")
        body = resources.files("lowwater.viewer").joinpath("static", name).read_bytes()
        await send_bytes(send, 200, body, STATIC[name], _HEADERS)

    async def _run(self, scope: Scope, receive: Receive, send: Send) -> None:
        summary = await trio.to_thread.run_sync(read_summary, self.results)
        has_samples = self.samples is not None and self.samples.is_file()
        payload = {"results": self.results.name, "header": self.header, "summary": summary, "samples": has_samples}
        await send_json(send, 200, payload, _HEADERS)

    async def _rows(self, scope: Scope, receive: Receive, send: Send) -> None:
        def read() -> list[dict[str, Any]]:
            _, rows, _ = read_rows(self.results)
            return [row_summary(i, r) for i, r in enumerate(rows)]

        await send_json(send, 200, {"rows": await trio.to_thread.run_sync(read)}, _HEADERS)

    async def _sample(self, scope: Scope, receive: Receive, send: Send) -> None:
        rollout_id = scope["path_params"]["rollout_id"]
        samples = self.samples
        if samples is None or not samples.is_file():
            raise HTTPError(404, "this run has no transcripts (it was run with --no-samples)")
        where = self._index.get(rollout_id)
        if where is None:  # a new id: the file grew since the index was built
            self._index = await trio.to_thread.run_sync(index, samples)
            where = self._index.get(rollout_id)
        if where is None:
            raise HTTPError(404, f"no transcript for rollout {rollout_id!r}")
        line = await trio.to_thread.run_sync(read_sample, samples, where)
        await send_bytes(send, 200, line, "application/json", _HEADERS)
