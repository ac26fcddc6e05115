"""The one error inside Trio's exception groups.

A strict Trio nursery wraps whatever escapes it in an exception group, one
level per nursery it passes through: a bind failure in ``lowwater view``
reaches the command four groups deep (hypercorn's two nurseries, the HTTP
layer's, the command's), a bad data line read mid-run in ``lowwater eval``
three.  ``except* T`` picks the ``T`` errors out at any depth and lets the
rest propagate, but hands its block a group, not an error; a one-line
message (``UsageError``) or a bare re-raise needs the error itself.
Handlers therefore match with ``except*`` and read the error with
:func:`sole_error`::

    try:
        trio.run(main)
    except* OSError as group:
        error = sole_error(group)
        if error is None:  # several: leave the group as it is
            raise
        bind_error = error  # acted on after the try (except* cannot return)
"""

from __future__ import annotations

from typing import TypeVar

E = TypeVar("E", bound=BaseException)


def sole_error(group: BaseExceptionGroup[E]) -> E | None:
    """The one exception ``group`` holds, however deeply nested in
    single-member groups; ``None`` when it holds more than one."""
    members = group.exceptions
    while len(members) == 1:
        (only,) = members
        if not isinstance(only, BaseExceptionGroup):
            return only
        members = only.exceptions
    return None


def unwrapped(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The one exception ``group`` holds (:func:`sole_error`), to re-raise
    bare; ``None`` when it holds several, or when the one is
    :class:`trio.Cancelled`, which must reach the cancel scope that owns it
    as Trio left it.

    For code that documents the errors it raises and runs a nursery inside
    (an async context manager's body, a public method).  Raise the error
    after the ``except`` block, not in it: raised inside, it would take the
    group as its ``__context__``::

        try:
            async with trio.open_nursery() as nursery:
                ...
        except BaseExceptionGroup as group:
            error = unwrapped(group)
            if error is None:
                raise
        else:
            return
        raise error
    """
    import trio  # lazy: this module is imported by commands that never start Trio

    error = sole_error(group)
    return None if isinstance(error, trio.Cancelled) else error
