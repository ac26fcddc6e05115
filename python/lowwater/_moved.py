"""Import paths of round one's flat layout, kept working for one release.

``import lowwater.embedding`` (and the others below) still works but warns
with a :class:`DeprecationWarning` naming the new path; the old module name
is an alias of the new module, so objects compare identical.  Remove this
module (and its hook in ``lowwater/__init__.py``) in the next release.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

#: old module name -> new module name.
MOVED = {
    "lowwater.embedding": "lowwater.trainer.api",
    "lowwater.embedding_worker": "lowwater.trainer.job",
    "lowwater.producer": "lowwater.trainer.producer",
    "lowwater.shards": "lowwater.trainer.shards",
    "lowwater.sessions": "lowwater.trainer.sessions",
    "lowwater.results": "lowwater.eval.results",
    "lowwater.eval_worker": "lowwater.eval.job",
    "lowwater.model": "lowwater.upstream.client",
    "lowwater.agent_client": "lowwater.upstream.agent_client",
    "lowwater.runtime.testing": "lowwater.testing.runtime",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.new}; the old path goes away in the next release",
            DeprecationWarning,
            stacklevel=4,
        )
        module = importlib.import_module(self.new)
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The module is the new one, already executed; only the alias is new.
        pass


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old names of :data:`MOVED` and loads them as aliases."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Put :class:`MovedFinder` on ``sys.meta_path`` once."""
    if not any(isinstance(finder, MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedFinder())
