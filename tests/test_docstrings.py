"""Docstring examples run (``doctest``), so they cannot drift from the code.

``RUNNABLE`` names what runs: a module (every ``>>>`` example in it) or one object of a module.
These are the examples that stand alone on a laptop: no Ray cluster, store or worker group. The
other examples in the packages are sketches of a call inside a larger program (``wg.score(meta)``
with a group and a meta made elsewhere); they are not listed. A new standalone example belongs
in a listed module, or its module or object gets listed here.
"""

from __future__ import annotations

import doctest
import importlib

import pytest

RUNNABLE = [
    "controlplane._config",
    "controlplane._devices.accelerator_resource",
    "controlplane._devices.local_ranks_by_node",
    "controlplane._enum",
    "controlplane._placement_groups.ip_sort_key",
    "controlplane._strict",
    "controlplane.class_with_init_args.ClassWithInitArgs",
    "controlplane.decorator.register",
    "controlplane.errors",
    "controlplane.modes",
    "controlplane.per_rank.mark_dispatched",
    "controlplane.per_rank.split_for_ranks",
    "controlplane.resource_pool.ResourcePool",
    "dataplane.codec.buffers",
    "dataplane.codec.column_types",
    "dataplane.codec.columns",
    "dataplane.codec.gather",
    "dataplane.wire.protocol",
    "dataplane._units",
    "dataplane._worker_bridge",
    "dataplane.config",
    "dataplane.meta",
    "dataplane.samplers.balanced_partition",
    "workers",
    "workers.driver_guard.check_metadata",
    "workers.engine.actor",
    "workers.engine.advantage",
    "workers.engine.model",
    "workers.engine.reference",
    "workers.engine.reward",
    "workers.engine.rollout",
    "workers.engine.task",
    "workers.timeline",
]

_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _tests_for(name: str) -> list[doctest.DocTest]:
    """The doctests of ``name`` (a module, or ``module.object``), found by importing the module."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable prefix is the module
        module_name = ".".join(parts[:cut])
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        found = doctest.DocTestFinder().find(module, module_name)
        if cut == len(parts):
            return [t for t in found if t.examples]
        return [t for t in found if t.examples and (t.name == name or t.name.startswith(name + "."))]
    raise AssertionError(f"{name} is not importable")


@pytest.mark.parametrize("name", RUNNABLE)
def test_docstring_examples_run(name: str) -> None:
    tests = _tests_for(name)
    assert tests, f"{name} has no >>> examples any more; remove it from RUNNABLE"
    runner = doctest.DocTestRunner(optionflags=_FLAGS)
    report: list[str] = []
    for test in tests:
        runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)
