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


#: The running cluster and the environment it replaced, while it runs.
_RUNNING: dict[str, object] = {}


def _stop_cluster() -> None:
    """Stop the cluster (idempotent): disconnect, stop every node, restore
    the environment, and fail if any Ray process outlived the stop."""
    if not _RUNNING:
        return
    import ray

    cluster = _RUNNING.pop("cluster")
    saved: dict[str, str | None] = _RUNNING.pop("saved")  # type: ignore[assignment]
    try:
        if ray.is_initialized():
            ray.shutdown()
    finally:
        left = cluster.stop()  # type: ignore[attr-defined]  # whatever happened above: no node outlives it
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    assert not left, f"Ray processes left after the cluster stopped (killed now): {left}"


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """The connected two-node cluster (a :class:`lowwater_ray.cluster.LocalCluster`),
    started by the first test that needs it and stopped after the last test
    of tests/ray (see :func:`pytest_runtest_teardown`), not at the end of the
    session: its daemons are children of pytest, and later tests (tests/runtime)
    check that nothing they started is left among this process's children."""
    from lowwater_ray.cluster import LocalCluster

    _RUNNING["saved"] = {k: os.environ.get(k) for k in _ENV}
    os.environ.update(_ENV)
    cluster = LocalCluster(tmp_path_factory.mktemp("ray-cluster"), object_store_mb=256, env=_ENV)
    _RUNNING["cluster"] = cluster
    try:
        cluster.start_head(num_cpus=2, resources={"node1": 1})
        cluster.connect()
        cluster.add_node(num_cpus=2, resources={"node2": 1})
        cluster.wait(2)
        yield cluster
    finally:
        _stop_cluster()


def pytest_runtest_teardown(item, nextitem):
    """After the last test of this directory, stop the cluster at once."""
    here = os.path.dirname(__file__)
    if nextitem is None or not str(nextitem.path).startswith(here + os.sep):
        _stop_cluster()


@pytest.fixture
def admin_key(monkeypatch):
    """The admin key a model server bound beyond loopback needs."""
    monkeypatch.setenv("LOWWATER_ADMIN_KEY", "ray-tests")
    return "ray-tests"
