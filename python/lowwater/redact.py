"""Credentials out of what lowwater prints and records.

A URL may carry a user and password (``http://user:pass@host/v1``); printed
in a startup line, logged, or recorded in an upstream error on a turn, it
leaks them into terminals, CI logs and trajectory files.  Every place that
prints or records a URL it was given (or an error text that may quote one)
passes it through :func:`redact_url` first.
"""

from __future__ import annotations

import re

# scheme "://" then the authority up to its last "@" (a password may hold a raw
# "@"; urlsplit also takes the last one), never past "/", "?", "#" or a space.
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/?#\s]*@")

#: What replaces the ``user:password`` part.
REDACTED = "***"


def redact_url(text: str) -> str:
    """``text`` (a URL, or any message quoting URLs) with every URL's ``user:password@`` replaced by ``***@``.

    ``http://u:p@host:8000/v1`` -> ``http://***@host:8000/v1``; text without
    credentials is returned unchanged.
    """
    return _USERINFO.sub(rf"\g<scheme>{REDACTED}@", text)
