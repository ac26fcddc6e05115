"""The trajectory registry's group-aware eviction (the engine's calls into it)."""

from __future__ import annotations

import pytest

from lowwater.trajectory import TrajectoryRegistry


def test_close_rollout_keeps_grouped_trajectories_until_their_group_closes():
    registry = TrajectoryRegistry()
    registry.open("solo")
    registry.open("g-0", group_id="g")
    registry.open("g-1", group_id="g")
    assert [registry.close_rollout(r) for r in ("solo", "g-0", "g-1")] == [True, False, False]
    assert set(registry) == {"g-0", "g-1"}  # grouped ones wait for the group
    assert [t.rollout_id for t in registry.group("g")] == ["g-0", "g-1"]
    assert registry.close_group("g") == 2
    assert len(registry) == 0 and registry.stats() == {"trajectories": 0, "groups": 0, "turns": 0}


def test_discard_drops_a_retried_member_and_reopen_rejoins_the_group():
    registry = TrajectoryRegistry()
    registry.open("g-0", group_id="g")
    assert registry.discard("g-0") and not registry.discard("g-0")
    registry.open("g-0", group_id="g")
    with pytest.raises(KeyError):
        registry.open("g-0", group_id="g")
    assert registry.close_group("g") == 1 and len(registry) == 0
