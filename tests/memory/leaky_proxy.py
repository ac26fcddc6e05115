"""``lowwater proxy`` with a deliberate per-rollout leak: the failing control of test_proxy_rss.py.

Usage: ``python leaky_proxy.py [lowwater proxy flags]``.  Every recorded turn
(its request's message delta, its completion) is also appended to a
module-level list that nothing empties, the shape of the peer leak in
docs/design.md#incidents (a process-lifetime registry of finished
rollouts' data).  The leak is patched in before the command runs (no
hook sees every recorded turn, failed calls' included).
"""

import sys

from lowwater import cli
from lowwater.trajectory import Trajectory

KEPT: list = []
_add_turn = Trajectory.add_turn


def _leaking_add_turn(self, turn):
    KEPT.append(turn)
    _add_turn(self, turn)


Trajectory.add_turn = _leaking_add_turn

if __name__ == "__main__":
    sys.exit(cli.main(["proxy", *sys.argv[1:]]))
