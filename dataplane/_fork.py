"""Forks of a process that uses the store: no child waits for ever on its parent's imports.

A thread in the middle of importing a module holds that module's import lock. A child forked then
inherits the lock, held by a thread it does not have, and its own first use of the module waits for
ever: CPython makes the global import lock anew in a child, not the per-module ones. A process
whose thread makes its first get (importing torch's and tensordict's read path, seconds) while the
main thread forks DataLoader workers hits exactly that.

So before every fork: wait for the imports other threads have in progress to finish, then hold the
global import lock (no thread can begin an import without it) until the fork is done, checking
again under it. The fork is delayed by what is left of those imports, and the child finds them
done. An import of the forking thread itself is not waited for. The wait is bounded (``WAIT_S``):
past it (an import that never ends, or one waiting on the forking thread) the fork goes ahead as
CPython's would, with a warning.

This reads importlib's module locks (``importlib._bootstrap``, CPython 3.11-3.13); where they are
not as expected it does nothing. Registered once, when ``dataplane`` is imported.
"""

from __future__ import annotations

import _imp
import logging
import os
import threading
import time
from importlib import _bootstrap
from typing import Any

ROUNDS = 50  # imports that keep starting between checks: after this many, fork as CPython would
WAIT_S = 10.0  # the longest a fork waits for other threads' imports
logger = logging.getLogger(__name__)
_held = threading.local()


def _foreign_imports() -> list[Any]:
    """The module locks held by another thread: imports in progress there."""
    locks = getattr(_bootstrap, "_module_locks", None)
    if not isinstance(locks, dict):
        return []
    me = threading.get_ident()
    out = []
    for ref in list(locks.values()):
        lock: Any = ref() if callable(ref) else None
        owner, count = getattr(lock, "owner", None), getattr(lock, "count", None)
        if lock is not None and count and owner is not None and owner != me:
            out.append(lock)
    return out


def settle_imports() -> None:
    """Wait (at most ``WAIT_S``) for the imports in progress in other threads; return holding the
    global import lock (``released`` gives it back after the fork) when none is left."""
    deadline = time.monotonic() + WAIT_S
    for _ in range(ROUNDS):
        # (polled, not acquired: an import that never ends, or one waiting on this very thread, must
        # not keep the fork waiting for ever; past the deadline it goes ahead as CPython's would)
        while _foreign_imports():
            if time.monotonic() >= deadline:
                logger.warning("forking while another thread is still importing (waited %.0f s)", WAIT_S)
                return
            time.sleep(0.001)
        _imp.acquire_lock()
        try:
            settled = not _foreign_imports()
        except BaseException:  # (never leave the import lock held: every later import would wait)
            _imp.release_lock()
            raise
        if settled:
            _held.on = True
            return
        _imp.release_lock()


def released() -> None:
    """After the fork, in the parent and in the child: give back what ``settle_imports`` held."""
    if getattr(_held, "on", False):
        _held.on = False
        _imp.release_lock()


os.register_at_fork(before=settle_imports, after_in_parent=released, after_in_child=released)
