"""Test support for lowwater and its plugins: a pytest plugin with fixtures
(:mod:`lowwater.testing.pytest_plugin`), Hypothesis strategies
(:mod:`lowwater.testing.strategies`) and a background Trio loop
(:mod:`lowwater.testing.background`).  The runtime conformance state machine
is :mod:`lowwater.testing.runtime`."""
