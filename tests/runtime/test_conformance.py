"""The built-in subprocess runtime passes the runtime conformance state machine."""

from lowwater.runtime import RuntimeConfig, SubprocessRuntime
from lowwater.testing.runtime import CONFORMANCE_PROFILES, PROFILE_ENV, RuntimeConformance, conformance_settings


class SubprocessConformance(RuntimeConformance):
    runtime_factory = staticmethod(lambda: SubprocessRuntime(RuntimeConfig()))


TestSubprocessConformance = SubprocessConformance.TestCase


class PersistentSubprocessConformance(RuntimeConformance):
    """Small output cap and one warm worker: eviction and caps on the hot path."""

    runtime_factory = staticmethod(
        lambda: SubprocessRuntime(RuntimeConfig(persistent=True, max_output_bytes=4096, max_warm_workers=1))
    )


TestPersistentSubprocessConformance = PersistentSubprocessConformance.TestCase


def test_the_profile_variable_picks_the_size():
    ci, long = CONFORMANCE_PROFILES["ci"], CONFORMANCE_PROFILES["long"]
    assert conformance_settings({}) is ci and conformance_settings({PROFILE_ENV: "nope"}) is ci
    assert conformance_settings({PROFILE_ENV: "long"}) is long
    assert long.max_examples * long.stateful_step_count > 10 * ci.max_examples * ci.stateful_step_count
    assert SubprocessConformance.TestCase.settings is conformance_settings()
