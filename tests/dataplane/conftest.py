"""Fixtures for the store tests: one store service per test module, clients per transport."""

from __future__ import annotations

import time
import uuid

import pytest


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll ``predicate`` until it returns a truthy value, or fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@pytest.fixture
def pid() -> str:
    """A partition id of its own for each test."""
    return f"p-{uuid.uuid4().hex[:8]}"


def start_store(**options):
    """Start a service owned by the test (not by ``dp``), so clients can attach and detach freely."""
    from dataplane._service import start_service
    from dataplane.config import StoreConfig

    cfg = StoreConfig.from_options(**options)
    registry, handle = start_service(cfg)
    return cfg, registry, handle
