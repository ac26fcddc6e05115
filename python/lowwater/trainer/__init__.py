"""The trainer side: the API a trainer's loop calls (:mod:`~lowwater.trainer.api`),
the producer that turns groups into shards, the shard store and consumers,
and the session store behind ``lowwater proxy --sessions``.  The trainer
layer never imports the eval layer; both build engines with
:mod:`lowwater.assembly`.  See ``docs/trainer.md``."""

from lowwater.trainer.api import Batch, Lowwater, SyncLowwater, TrainerClosed, TrainerConfig
from lowwater.trainer.drain import DrainReport, clear_batch
from lowwater.trainer.shards import ShardConsumer, ShardRef, ShardStore

__all__ = [
    "Batch",
    "DrainReport",
    "Lowwater",
    "ShardConsumer",
    "ShardRef",
    "ShardStore",
    "SyncLowwater",
    "TrainerClosed",
    "TrainerConfig",
    "clear_batch",
]
