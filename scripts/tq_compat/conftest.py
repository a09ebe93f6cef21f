"""Shared by this project's drivers of verl's code (copied next to them by scripts/tq_compat.sh)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def store():
    """A Ray of the module's own and TransferQueue (or dataplane.tq) on it, in polling mode."""
    import ray
    import transfer_queue as tq

    ray.init(num_cpus=4)
    tq.init({"controller": {"polling_mode": True}})
    yield
    tq.close()
    ray.shutdown()
