"""Hosts built on this machine from namespaces (``bench.testbed``): needs root, which CI has; without
it every test here is skipped with the reason.

One test bed serves every module here (``hosts``, session-scoped: building one and starting Ray on
each host is most of a module's time); ``tests/conftest.py`` hands all of ``tests/multihost`` to one
xdist worker as one unit, and the losses (``test_losses.py``, whose last test ends the second host)
run after every other test of it."""

from __future__ import annotations

import pytest

from bench import testbed

LAST = "tests/multihost/test_losses.py"


@pytest.hookimpl(trylast=True)  # after tests/conftest.py's sort (stable: each module stays in order)
def pytest_collection_modifyitems(config, items) -> None:
    why = testbed.missing()
    for item in items:
        if why and "tests/multihost/" in item.nodeid:
            item.add_marker(pytest.mark.skip(reason=why))
    items.sort(key=lambda item: item.nodeid.startswith(LAST))


@pytest.fixture(scope="session")
def hosts():
    """Two hosts with a Ray node on each (the head on h1), shared by every test here."""
    with testbed.Testbed(hosts=2) as bed:
        yield bed
