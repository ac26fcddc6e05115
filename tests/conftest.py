"""Suite-wide settings: the Hypothesis profile.

``LOWWATER_HYPOTHESIS_PROFILE=long`` runs the property tests longer (a soak
run, not CI): the ``long`` Hypothesis profile below applies to every test
that does not set its own ``max_examples``, and the runtime conformance
machine reads the same variable for its size
(``lowwater.testing.runtime.CONFORMANCE_PROFILES``).  Unset, Hypothesis's
defaults apply.  Example::

    LOWWATER_HYPOTHESIS_PROFILE=long .venv/bin/python -m pytest -p no:cacheprovider tests/runtime tests/envs
"""

from __future__ import annotations

import os

from hypothesis import settings

#: Same name as lowwater.testing.runtime.PROFILE_ENV (not imported: this file loads before every test).
PROFILE_ENV = "LOWWATER_HYPOTHESIS_PROFILE"

settings.register_profile("long", max_examples=2000, stateful_step_count=100, deadline=None)

if os.environ.get(PROFILE_ENV) == "long":
    settings.load_profile("long")


#: Set by .ci/run: a skipped test fails the run.  Optional parts (the browser,
#: Ray, the test plugin distribution) skip on a developer's machine that lacks
#: them, but CI installs them all, so a skip there means a test silently did
#: not run.  The GSM8K data is not installed by CI (it lives beside the
#: checkout, see the README), so its skips are exempt.
NO_SKIP_ENV = "LOWWATER_NO_SKIP"
_DATA_SKIP = "shared/data/gsm8k"


def _reason(report: object) -> str:
    longrepr = getattr(report, "longrepr", None)
    return str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def pytest_sessionfinish(session, exitstatus):
    if not os.environ.get(NO_SKIP_ENV):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    unexpected = [r for r in skipped if _DATA_SKIP not in _reason(r)]
    if unexpected and session.exitstatus == 0:
        session.exitstatus = 1
        if reporter is not None:
            reporter.write_line(
                f"{NO_SKIP_ENV}: {len(unexpected)} test(s) skipped although CI installs every part they need",
                red=True,
            )
