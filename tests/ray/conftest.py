"""The Ray tests' cluster: two simulated nodes on this machine (``ray start
--head`` and a second ``ray start`` with its own ports and a ``node2``
resource), started once per session and stopped by it; every process it
started is checked to be gone, by pid.

Run them alone with ``pytest -m ray tests/ray``; without ``ray`` and
``lowwater-ray`` installed they are skipped.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("ray", reason="the Ray tests need ray (pip install -e plugins/lowwater-ray)")
pytest.importorskip("lowwater_ray", reason="the Ray tests need lowwater-ray (pip install -e plugins/lowwater-ray)")


_ENV = {
    # A one-machine test cluster: no token file involved.
    "RAY_AUTH_MODE": "disabled",
    # Ray inlines objects under 100 KiB in its callers' memory instead of the
    # object store; the tests' groups are a few KiB, production shards
    # (4096 tokens x 8 rollouts) far more.  A 1 KiB cut sends the tests'
    # shards through the object store as real ones go.
    "RAY_max_direct_call_object_size": "1024",
}


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """The connected two-node cluster (a :class:`lowwater_ray.cluster.LocalCluster`)."""
    import ray

    from lowwater_ray.cluster import LocalCluster

    saved = {k: os.environ.get(k) for k in _ENV}
    os.environ.update(_ENV)
    cluster = LocalCluster(tmp_path_factory.mktemp("ray-cluster"), object_store_mb=256, env=_ENV)
    try:
        cluster.start_head(num_cpus=2, resources={"node1": 1})
        cluster.connect()
        cluster.add_node(num_cpus=2, resources={"node2": 1})
        cluster.wait(2)
        yield cluster
    finally:
        try:
            if ray.is_initialized():
                ray.shutdown()
        finally:
            left = cluster.stop()  # whatever happened above: no node outlives the session
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        assert not left, f"Ray processes left after the cluster stopped (killed now): {left}"


@pytest.fixture
def admin_key(monkeypatch):
    """The admin key a model server bound beyond loopback needs."""
    monkeypatch.setenv("LOWWATER_ADMIN_KEY", "ray-tests")
    return "ray-tests"
