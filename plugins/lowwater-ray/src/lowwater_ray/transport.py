"""The ``ray`` shard transport: a step's shards are object-store objects.

A node pool returns each finished group's shards as one object (a dict of
numpy arrays, shard id -> array) whose owner is the driver, the trainer
process (the caller of the actor method owns what it returns).  The driver
never pulls the data: its :class:`~lowwater.trainer.shards.ShardRef` objects
carry a :class:`RayHandle`, the cell holding the object reference.

* ``fetch`` (consumer): ``ray.get`` of each object once; numpy arrays are
  deserialized zero-copy over the object store (on the same node; another
  node's raylet pulls the object first), and the views are kept until
  ``drain``.
* ``remove`` (owner, ``clear_batch``): every handle drops its reference, so
  the owner holds nothing of the step even while the trainer still holds
  the :class:`~lowwater.trainer.Batch`.
* ``drain`` (consumer): the views of exactly those ids are dropped; a view
  the consumer's code still holds (a ``numpy`` slice keeps its base alive)
  is still counted in ``stats()`` after the drain, so ``clear_batch``
  reports it as a leak.
* ``held`` (owner, after every drain): the step's objects still referenced
  or pinned anywhere in the cluster, from the raylets' reference tables.

Why the handle is a mutable cell: Ray frees an object when its last
reference anywhere drops, and a trainer typically keeps its ``Batch`` (with
the refs) past ``clear_batch``; dropping the reference *inside* the handle
releases the object whatever holds the ``ShardRef``.
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import trio

from lowwater.trainer.shards import ShardFetchError, ShardMissing, ShardRef
from lowwater.trainer.transport import ShardTransport

log = logging.getLogger("lowwater.ray")

#: Seconds ``held`` waits for the cluster's reference counts to settle (the
#: owner's release reaches the raylets by RPC) before calling an object held.
SETTLE_S = 3.0


class RayHandle:
    """The object reference of a shard's object, and the shard's key in it.

    Attributes:
        ref: the ``ray.ObjectRef`` (``None`` once released).
        key: the shard id inside the object (a dict of arrays).
        object_hex: the object's id, kept after release (leak lookups).
    """

    __slots__ = ("key", "object_hex", "ref")

    def __init__(self, ref: Any, key: str) -> None:
        self.ref = ref
        self.key = key
        self.object_hex: str = ref.hex()

    def release(self) -> bool:
        """Drop the reference; ``True`` if this call dropped it."""
        held, self.ref = self.ref is not None, None
        return held

    def __getstate__(self) -> tuple[Any, str, str]:
        return (self.ref, self.key, self.object_hex)

    def __setstate__(self, state: tuple[Any, str, str]) -> None:
        self.ref, self.key, self.object_hex = state

    def __repr__(self) -> str:
        return f"RayHandle({self.object_hex[:16]}..., key={self.key!r}, released={self.ref is None})"


def shard_refs(rows: list[dict[str, Any]], blob_ref: Any, owner: str) -> None:
    """Turn the ``refs`` a node pool returned (shard metadata whose payloads
    are in the object ``blob_ref``) into :class:`ShardRef` objects, in place."""
    for row in rows:
        refs = row.get("refs")
        if not refs:
            continue
        row["refs"] = [
            ShardRef(
                r["shard_id"],
                owner,
                r["dtype"],
                tuple(r["shape"]),
                r["nbytes"],
                "ray",
                RayHandle(blob_ref, r["shard_id"]),
            )
            if isinstance(r, dict) and r.get("transport") == "ray"
            else r
            for r in refs
        ]


class RayTransport(ShardTransport):
    """``"ray"``: shards as object-store objects; one per process (:meth:`instance`)."""

    name = "ray"
    _instance: RayTransport | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self._views: dict[str, Any] = {}  # shard id -> array (this consumer's copies)
        self._drained: dict[str, tuple[weakref.ref[Any], int]] = {}  # shard id -> (view, nbytes) after drain

    @classmethod
    def instance(cls) -> RayTransport:
        """This process's transport (the factory the plugin registers)."""
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    # -- consumer side -------------------------------------------------------------

    async def fetch(self, refs: Sequence[ShardRef]) -> list[Any]:
        missing = [r for r in refs if r.shard_id not in self._views]
        objects: dict[str, Any] = {}
        for ref in missing:
            handle = ref.handle
            if not isinstance(handle, RayHandle):
                raise ShardFetchError(f"shard {ref.shard_id!r} has no Ray handle")
            if handle.ref is None:
                raise ShardMissing("ray", [ref.shard_id])
            objects.setdefault(handle.object_hex, handle.ref)
        if objects:
            import ray

            hexes = list(objects)
            try:
                values = await trio.to_thread.run_sync(ray.get, [objects[h] for h in hexes])
            except ray.exceptions.ObjectLostError as exc:
                raise ShardFetchError(f"a shard object was lost: {exc}") from exc
            by_hex = dict(zip(hexes, values))
            for ref in missing:
                value = by_hex[ref.handle.object_hex]
                if ref.shard_id not in value:
                    raise ShardMissing("ray", [ref.shard_id])
                self._views[ref.shard_id] = value[ref.shard_id]
            del values, by_hex
        return [self._views[r.shard_id] for r in refs]

    def drain(self, shard_ids: Sequence[str]) -> int:
        removed = 0
        for shard_id in shard_ids:
            view = self._views.pop(shard_id, None)
            if view is None:
                continue
            removed += 1
            self._drained[shard_id] = (weakref.ref(view), int(view.nbytes))
            del view
        if removed:
            gc.collect()  # a view in a reference cycle is not a leak, only late
        return removed

    def stats(self) -> dict[str, int]:
        """Views held: fetched and not drained, plus drained ones something
        still holds (each such is a leak: it pins its object)."""
        for shard_id, (view, _) in list(self._drained.items()):
            if view() is None:
                del self._drained[shard_id]
        kept = sum(n for _, n in self._drained.values())
        return {
            "entries": len(self._views) + len(self._drained),
            "bytes": sum(int(v.nbytes) for v in self._views.values()) + kept,
            "held_after_drain": len(self._drained),
        }

    # -- owner side ------------------------------------------------------------------

    async def remove(self, refs: Sequence[ShardRef]) -> int:
        removed = sum(isinstance(r.handle, RayHandle) and r.handle.release() for r in refs)
        gc.collect()  # drop ObjectRefs caught in cycles now, not at the next collection
        return removed

    async def held(self, refs: Sequence[ShardRef]) -> list[dict[str, Any]]:
        from lowwater_ray.memory import holders

        by_object: dict[str, list[ShardRef]] = {}
        for ref in refs:
            if isinstance(ref.handle, RayHandle):
                by_object.setdefault(ref.handle.object_hex, []).append(ref)
        if not by_object:
            return []
        found: dict[str, list[str]] = {}
        with trio.move_on_after(SETTLE_S):
            while True:
                found = await trio.to_thread.run_sync(holders, list(by_object))
                if not found:
                    return []
                await trio.sleep(0.1)
        return [
            {"shard_id": ref.shard_id, "nbytes": ref.nbytes, "where": "; ".join(found[hex_id])}
            for hex_id, refs_of in by_object.items()
            if hex_id in found
            for ref in refs_of
        ]


__all__ = ["RayHandle", "RayTransport", "shard_refs"]
