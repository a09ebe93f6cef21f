"""Hosts built on this machine from namespaces (``bench.testbed``): needs root, which CI has; without
it every test here is skipped with the reason."""

from __future__ import annotations

import pytest

from bench import testbed


def pytest_collection_modifyitems(config, items) -> None:
    why = testbed.missing()
    if why:
        for item in items:
            if "tests/multihost/" in item.nodeid:
                item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="module")
def hosts():
    """Two hosts with a Ray node on each (the head on h1)."""
    with testbed.Testbed(hosts=2) as bed:
        yield bed
