"""lowwater.excgroups.sole_error: the one error ``except*`` handed over, however deep."""

from __future__ import annotations

import pytest
import trio

from lowwater.excgroups import sole_error, unwrapped


def _matched(error: BaseException, kind: type[BaseException]) -> BaseExceptionGroup:
    """The group an ``except* kind`` block receives for ``error``."""
    received = []
    try:
        raise error
    except* kind as group:
        received.append(group)  # an except* block cannot return
    (group,) = received
    return group


def test_the_one_error_at_any_depth_or_none_for_several():
    bind = OSError(98, "in use")
    nested = ExceptionGroup("a", [ExceptionGroup("b", [ExceptionGroup("c", [bind])])])
    assert sole_error(_matched(nested, OSError)) is bind
    assert sole_error(_matched(bind, OSError)) is bind  # a bare error comes as a group of one
    two = ExceptionGroup("a", [ExceptionGroup("b", [OSError()]), OSError()])
    assert sole_error(_matched(two, OSError)) is None


def test_only_the_matched_part_counts():
    bind = OSError(98, "in use")
    with pytest.raises(ExceptionGroup) as info:
        try:
            raise ExceptionGroup("a", [bind, KeyError("other")])
        except* OSError as group:
            assert sole_error(group) is bind
    assert [type(e) for e in info.value.exceptions] == [KeyError]  # the rest propagates


def test_unwrapped_leaves_cancelled_and_several_in_their_groups():
    full = KeyError("full")
    assert unwrapped(ExceptionGroup("a", [ExceptionGroup("b", [full])])) is full
    assert unwrapped(ExceptionGroup("a", [KeyError(), ValueError()])) is None

    async def cancelled_group() -> BaseExceptionGroup[BaseException]:
        with trio.CancelScope() as scope:
            scope.cancel()
            try:
                async with trio.open_nursery():
                    await trio.sleep(1)
            except BaseExceptionGroup as group:
                return group
        raise AssertionError("the nursery raised no group")

    group = trio.run(cancelled_group)
    assert isinstance(sole_error(group), trio.Cancelled) and unwrapped(group) is None
