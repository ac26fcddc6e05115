"""The step-end drain: :func:`clear_batch` releases one step's shards at
their owners and in every consumer's fetch buffer, and reports what is still
held afterwards (docs/design.md#incidents: consumer processes grew ~2 GB per
step because only the controller drained).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import attrs
import httpx
import orjson
import trio

from lowwater.trainer.shards import ShardRef, ShardStore

log = logging.getLogger("lowwater.trainer.drain")


@attrs.frozen
class DrainReport:
    """What :func:`clear_batch` did: owners' removals, each consumer's stats
    after the drain, and (for transports that can tell, ``ray``) what of the
    step was still held anywhere after it: ``held`` entries ``{"shard_id",
    "nbytes", "where"}``, each a leak."""

    ids: tuple[str, ...]
    owners_removed: dict[str, int]
    consumers: dict[str, dict[str, Any] | None]
    held: tuple[dict[str, Any], ...] = ()

    @property
    def leaked_bytes(self) -> int:
        """Bytes still held by consumers after the drain (0 when the step is released)."""
        return sum((c or {}).get("stats", {}).get("bytes", 0) for c in self.consumers.values())


async def clear_batch(
    refs_or_ids: Iterable[ShardRef | str],
    *,
    client: httpx.AsyncClient,
    consumers: Iterable[str],
    owners: Iterable[str] = (),
    local: ShardStore | None = None,
    transports: dict[str, Any] | None = None,
) -> DrainReport:
    """Release one step's shards everywhere.

    The owners (those named by the references, plus ``owners``, plus ``local``)
    remove their copies; references of another transport (``ray``) are
    released through it (``transports``, or the plugin registry); then every
    consumer in ``consumers`` (``host:port``) drains exactly those ids, and
    each such transport is asked what of the step is still held (each is
    logged as a leak and listed in :attr:`DrainReport.held`).  The fan-out carries a flat list of id strings,
    never the references (which a consumer would resolve again on arrival).
    A consumer whose buffer is not empty afterwards is logged as a warning with
    its size in bytes; a consumer that cannot be reached is logged too, and
    never raises: a failing stats call must not break training.
    """
    ids: list[str] = []
    owner_set = set(owners)
    others: dict[str, list[ShardRef]] = {}
    for item in refs_or_ids:
        if isinstance(item, ShardRef):
            ids.append(item.shard_id)
            if item.transport == "http":
                owner_set.add(item.owner)
            else:
                others.setdefault(item.transport, []).append(item)
        else:
            ids.append(item)
    owners_removed: dict[str, int] = {}
    by_name: dict[str, Any] = dict(transports or {})
    if others:
        for name, refs in others.items():
            if name not in by_name:
                from lowwater import plugins as plugins_mod
                from lowwater.trainer.transport import transport_factory

                by_name[name] = transport_factory(plugins_mod.load(), name)()
            owners_removed[name] = await by_name[name].remove(refs)
    if local is not None:
        owners_removed[local.address or "local"] = await trio.to_thread.run_sync(local.remove, ids)
        owner_set.discard(local.address)
    consumer_list = list(consumers)
    results: dict[str, dict[str, Any] | None] = {}
    payload = orjson.dumps({"ids": ids})

    async def to_owner(owner: str) -> None:
        try:
            r = await client.request("DELETE", f"http://{owner}/shards", content=payload)
            r.raise_for_status()
            owners_removed[owner] = r.json()["removed"]
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            log.warning("shard owner %s did not confirm removal of %d shards: %r", owner, len(ids), exc)

    async def to_consumer(consumer: str) -> None:
        try:
            r = await client.post(f"http://{consumer}/buffer/drain", content=payload)
            r.raise_for_status()
            answer: dict[str, Any] = r.json()
            results[consumer] = answer
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("consumer %s did not report its fetch buffer after the drain: %r", consumer, exc)
            results[consumer] = None
            return
        stats = answer["stats"]
        if stats.get("entries"):
            log.warning(
                "consumer %s still holds %d shards (%d bytes) after the step's drain: a fetch-buffer leak",
                consumer,
                stats["entries"],
                stats["bytes"],
            )

    async with trio.open_nursery() as nursery:
        for owner in owner_set:
            nursery.start_soon(to_owner, owner)
        for consumer in consumer_list:
            nursery.start_soon(to_consumer, consumer)
    held: list[dict[str, Any]] = []
    for name, refs in others.items():
        for item in await by_name[name].held(refs):
            held.append(item)
            log.warning(
                "shard %s (%d bytes) of the step is still held after the drain (%s): a leak",
                item.get("shard_id"),
                item.get("nbytes", 0),
                item.get("where", name),
            )
    return DrainReport(tuple(ids), owners_removed, results, tuple(held))
