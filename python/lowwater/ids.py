"""Ids that name rollouts and sessions at ``lowwater proxy``'s admin API.

An id is 1 to 128 characters of ASCII letters, digits, ``.``, ``_``, ``:``
and ``-``, starting with a letter or a digit (:data:`ID_PATTERN`).  Such an
id is safe as a path segment, a file name (no ``/``, no NUL, never ``.`` or
``..``) and a log field.  A stale-session dump once built its file name from
an id holding a NUL: ``open`` raised and the sessions popped after it were
never dumped.  Ids are checked where they enter (400 at the admin API,
``ValueError`` in :class:`~lowwater.trainer.sessions.SessionStore`); no path
is built from an id that did not pass :func:`check_id`.
"""

from __future__ import annotations

import re

#: The longest id accepted (characters).
MAX_ID_CHARS = 128
#: What a valid id matches as a whole.
ID_PATTERN = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._:-]{{0,{MAX_ID_CHARS - 1}}}")
#: The rule in words, for error messages.
ID_RULE = f"1-{MAX_ID_CHARS} characters of letters, digits, '.', '_', ':' and '-', starting with a letter or a digit"


def is_valid_id(value: object) -> bool:
    """True if ``value`` is a ``str`` matching :data:`ID_PATTERN`."""
    return isinstance(value, str) and ID_PATTERN.fullmatch(value) is not None


def check_id(value: object, what: str = "id") -> str:
    """``value`` if it is a valid id.

    Raises:
        ValueError: not a string, or not :data:`ID_PATTERN`; the message
            names ``what`` and the rule (never the whole value: it may be
            long or hold control characters).
    """
    if not is_valid_id(value):
        raise ValueError(f"{what} must be {ID_RULE}; got {_preview(value)}")
    assert isinstance(value, str)
    return value


def _preview(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
