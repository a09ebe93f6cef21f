"""Fixtures for the workers tests: the session's Ray cluster plus a store attached to it."""

from __future__ import annotations

import pytest

from controlplane import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from tests.workers._bridge_workers import BridgeWorker

# Rows the demo's one-run table prints (``workers.demo.format_summary``), also in ``--mode both``'s table.
SUMMARY_ROWS = (
    "mean reward, last 10% of steps",
    "reward range",
    "setup, s",
    "training, s",
    "bytes via store",
)


@pytest.fixture(scope="module")
def store(ray_cluster):
    """The store for this module: started (embedded) here unless one is already attached. Per module,
    not per session: a module of another package may close the process's store between two of ours."""
    import dataplane as dp

    owned = not dp.is_initialized()
    info = dp.init(num_shards=2)
    yield info
    if owned:
        dp.close()


@pytest.fixture(scope="module")
def pair(store):
    """A group of two bridge workers (one per module that asks), removed at the module's end."""
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(BridgeWorker))
    yield wg
    wg.kill()
    pool.remove()
