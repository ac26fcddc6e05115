"""lowwater: rollouts of LLM agents with memory that returns to its low-water mark.

The public API, nothing else.  See ``docs/`` for the architecture and the
memory contract (every per-rollout structure, its owner and eviction point).
"""

from lowwater._native import (
    BufferFull,
    FetchBuffer,
    InterceptTable,
    InterceptView,
    InternalError,
    LowwaterError,
    RolloutClosed,
    ShardView,
)

__all__ = [
    "BufferFull",
    "FetchBuffer",
    "InterceptTable",
    "InterceptView",
    "InternalError",
    "LowwaterError",
    "RolloutClosed",
    "ShardView",
]

# Round one's flat module paths (lowwater.embedding, lowwater.model, ...)
# still import, with a DeprecationWarning, for one release.
from lowwater import _moved

_moved.install()
