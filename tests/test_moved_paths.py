"""Round one's import paths keep working for one release, with a warning
naming the new path (python/lowwater/_moved.py)."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

from lowwater._moved import MOVED


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_an_old_path_is_the_new_module_and_warns(old: str, new: str) -> None:
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert any(new in m for m in messages), messages


def test_names_that_moved_out_of_the_shards_module_are_still_found_there() -> None:
    from lowwater.trainer import drain, shards

    assert shards.clear_batch is drain.clear_batch
    assert shards.DrainReport is drain.DrainReport
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = shards.nope
