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
