"""The built-in subprocess runtime passes the runtime conformance state machine."""

from lowwater.runtime import RuntimeConfig, SubprocessRuntime
from lowwater.testing.runtime import RuntimeConformance


class SubprocessConformance(RuntimeConformance):
    runtime_factory = staticmethod(lambda: SubprocessRuntime(RuntimeConfig()))


TestSubprocessConformance = SubprocessConformance.TestCase


class PersistentSubprocessConformance(RuntimeConformance):
    """Small output cap and one warm worker: eviction and caps on the hot path."""

    runtime_factory = staticmethod(
        lambda: SubprocessRuntime(RuntimeConfig(persistent=True, max_output_bytes=4096, max_warm_workers=1))
    )


TestPersistentSubprocessConformance = PersistentSubprocessConformance.TestCase
