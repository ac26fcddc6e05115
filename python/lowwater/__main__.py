"""``python -m lowwater`` runs the ``lowwater`` command."""

import sys

from lowwater.cli import main

sys.exit(main())
