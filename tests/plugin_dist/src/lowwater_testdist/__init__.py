"""A third party's lowwater plugin distribution, used by lowwater's tests (tests/engine/test_plugin_dist.py)."""
