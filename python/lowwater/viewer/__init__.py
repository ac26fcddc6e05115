"""``lowwater view RUN.jsonl``: a local web page for a run's results and transcripts.

:class:`~lowwater.viewer.server.Viewer` serves static files shipped with the
package (vanilla HTML, JS and CSS in ``static/``: no build step, no CDN, so
the page works offline) and a small JSON API over the results file and its
samples file.  Transcripts are loaded on demand, one per click, from their
byte offsets, so a run of thousands of rollouts opens at once.
"""

from lowwater.viewer.server import Viewer, row_summary

__all__ = ["Viewer", "row_summary"]
