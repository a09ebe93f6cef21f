"""Fixtures for the workers tests: the session's Ray cluster plus a store attached to it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def store(ray_cluster):
    """The store for this pytest process: started (embedded) here unless one is already attached."""
    import dataplane as dp

    owned = not dp.is_initialized()
    info = dp.init(num_shards=2)
    yield info
    if owned:
        dp.close()
