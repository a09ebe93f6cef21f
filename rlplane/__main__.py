"""``python -m rlplane``: the ``rlplane`` command, for an interpreter whose scripts are not on PATH."""

import sys

from rlplane.cli import main

sys.exit(main())
