"""Evals with ``workers`` start the stdlib forkserver (and its resource
tracker) in the test process, where they would outlive the test: later
suites that assert "no child process left" (tests/runtime) would see them."""

from __future__ import annotations

from multiprocessing import forkserver, resource_tracker

import pytest


@pytest.fixture(autouse=True)
def _stop_forkserver():
    yield
    # Test-only private API (CPython's own tests use it): both are per process.
    forkserver._forkserver._stop()
    resource_tracker._resource_tracker._stop()
