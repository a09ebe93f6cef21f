"""The suite's fork server: the session clusters' Ray workers, and the tests' own second processes,
are forked from a process that has imported Ray, torch and the store's package, instead of starting
as new interpreters that import them again. An optimisation only: ``RLT_FORK_SERVER=0`` switches it
off, and every process then starts the stock way. ``README.md`` here says what it relies on.

Tests start their second processes with ``run_python`` / ``start_python`` (``subprocess.run`` /
``Popen`` of ``python ARGS``), forked when the server runs, else started as usual.
"""

from __future__ import annotations

import os

from tests.forkserver.server import Forked, run_python, running, start_python

SWITCH = "RLT_FORK_SERVER"


def enabled() -> bool:
    """Whether this run uses the fork server (``RLT_FORK_SERVER`` unset, or anything but ``0``)."""
    return os.environ.get(SWITCH, "1") != "0"


__all__ = ["SWITCH", "Forked", "enabled", "run_python", "running", "start_python"]
