"""Turning a finished group's trajectories into shards for a trainer.

Per group, six shards go into the producer's :class:`~lowwater.trainer.shards.ShardStore`
(ids ``{prefix}/{name}``):

=============  =========  ==============  ==========================================
name           dtype      shape           contents
=============  =========  ==============  ==========================================
``token_ids``  int64      ``[T]``         completion token ids of every turn of
                                          every rollout, concatenated
``logprobs``   float32    ``[T]``         their log-probabilities (natural log)
``loss_mask``  uint8      ``[T]``         1 where the token is trained on
``offsets``    int64      ``[n + 1]``     rollout ``i`` owns ``[offsets[i], offsets[i+1])``
``rewards``    float32    ``[n]``         each rollout's reward (0 for errored ones)
``advantages`` float32    ``[n]``         reward minus the group mean, divided by the
                                          group standard deviation plus 1e-6 (GRPO,
                                          Shao et al. 2024, "DeepSeekMath", eq. 3);
                                          0 for a group whose rewards are all equal
=============  =========  ==============  ==========================================

``T`` is the group's total completion tokens and ``n`` its size.  Turns
without token ids (an upstream that returned no logprobs) contribute no
tokens; errored rollouts keep their tokens with ``loss_mask`` 0, so the
trainer sees them but does not learn from them.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from typing import Any

from lowwater.trainer.shards import ShardRef, ShardStore

SHARD_NAMES = ("token_ids", "logprobs", "loss_mask", "offsets", "rewards", "advantages")


def group_advantages(rewards: Sequence[float]) -> list[float]:
    """GRPO advantages: ``(r - mean) / (std + 1e-6)``; all 0 if the rewards are equal."""
    n = len(rewards)
    if n == 0:
        return []
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    if std == 0.0:
        return [0.0] * n
    return [(r - mean) / (std + 1e-6) for r in rewards]


def group_shards(
    store: ShardStore, prefix: str, rollouts: Sequence[Any], trajectories: dict[str, Any]
) -> list[ShardRef]:
    """Put one group's shards into ``store``; returns their references in
    :data:`SHARD_NAMES` order.

    ``rollouts`` are :class:`lowwater.rollout.Rollout` objects;
    ``trajectories`` maps rollout id to its trajectory (read before the
    group's eviction).

    Raises:
        lowwater.BufferFull: the store is at capacity.
    """
    token_ids, logprobs, loss_mask = array("q"), array("f"), array("B")
    offsets = array("q", [0])
    rewards = array("f")
    for rollout in rollouts:
        trained = rollout.error is None
        trajectory = trajectories.get(rollout.rollout_id)
        for turn in trajectory.turns if trajectory is not None else ():
            ids = turn.token_ids or []
            token_ids.extend(ids)
            lps = list(turn.logprobs or [])
            lps += [0.0] * (len(ids) - len(lps))
            logprobs.extend(lps[: len(ids)])
            loss_mask.extend([1 if trained else 0] * len(ids))
        offsets.append(len(token_ids))
        rewards.append(float(rollout.reward) if trained and rollout.reward is not None else 0.0)
    advantages = array("f", group_advantages(list(rewards)))
    arrays: dict[str, tuple[array[Any], str]] = {
        "token_ids": (token_ids, "int64"),
        "logprobs": (logprobs, "float32"),
        "loss_mask": (loss_mask, "uint8"),
        "offsets": (offsets, "int64"),
        "rewards": (rewards, "float32"),
        "advantages": (advantages, "float32"),
    }
    refs = []
    for name in SHARD_NAMES:
        data, dtype = arrays[name]
        refs.append(store.put(f"{prefix}/{name}", data, dtype=dtype, shape=(len(data),)))
    return refs
