"""Docstring examples run (``doctest``), so they cannot drift from the code.

``RUNNABLE`` names what runs: a module (every ``>>>`` example in it), one object of a module
(``module.function``, ``module.Class``: its examples and those of its methods), or a module's own
docstring alone (``module.__doc__``). These are the examples that stand alone on a laptop: no Ray
cluster, store or worker group. The other examples in the packages are sketches of a call inside a
larger program (``wg.score(meta)`` with a group and a meta made elsewhere); they are not listed. A
new standalone example belongs in a listed module, or its module or object gets listed here.
``test_runnable_names_exist`` keeps the list honest: every name is a module or object of the
project whose docstrings hold an example.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

RUNNABLE = [
    "bench._bypass_data",
    "bench._bypass_report.headline",
    "bench._common",
    "bench._driver_cost",
    "bench.bypass.parse_size",
    "bench.runner",
    "controlplane._config",
    "controlplane._devices.__doc__",
    "controlplane._devices.accelerator_resource",
    "controlplane._devices.local_ranks_by_node",
    "controlplane._enum",
    "controlplane._placement_groups.ip_sort_key",
    "controlplane._placement_groups.never_fits_fix",
    "controlplane._strict",
    "controlplane.batch.__doc__",
    "controlplane.class_with_init_args.ClassWithInitArgs",
    "controlplane.decorator.register",
    "controlplane.dispatch._no_batch_message",
    "controlplane.errors",
    "controlplane.modes",
    "controlplane.per_rank.mark_dispatched",
    "controlplane.per_rank.split_for_ranks",
    "controlplane.resource_pool.ResourcePool",
    "controlplane.worker.__doc__",
    "dataplane.codec.buffers",
    "dataplane.codec.column_types",
    "dataplane.codec.columns",
    "dataplane.codec.plain",
    "dataplane.codec.gather",
    "dataplane.server.checkpoint_files",
    "dataplane.server.dispatch",
    "dataplane.wire.decoders",
    "dataplane.wire.placement",
    "dataplane.wire.protocol",
    "dataplane._units",
    "dataplane.errors.did_you_mean",
    "dataplane.bridge",
    "dataplane.admin",
    "dataplane.config",
    "dataplane.dataset.StreamBatch",
    "dataplane.meta",
    "dataplane.samplers.balanced_partition",
    "dataplane.stream.StreamRequest",
    "dataplane.service.connect",
    "dataplane.service.launch.no_store_message",
    "dataplane.service.launch.store_command",
    "dataplane.tq.metadata",
    "dataplane.tq.sampler.base",
    "dataplane.tq.sampler.grpo_group_n_sampler",
    "dataplane.tq.sampler.rank_aware_sampler",
    "dataplane.tq.sampler.seqlen_balanced_sampler",
    "dataplane.tq.sampler.sequential_sampler",
    "dataplane.telemetry.bounds",
    "dataplane.telemetry.catalog",
    "dataplane.telemetry.recorder",
    "dataplane.telemetry.export.midpoints",
    "dataplane.watch",
    "workers",
    "workers.checkpoints",
    "workers.config",
    "workers.demo",
    "workers.driver_guard.check_metadata",
    "workers.engine",
    "workers.engine.actor",
    "workers.engine.advantage",
    "workers.engine.model",
    "workers.engine.reference",
    "workers.engine.reward",
    "workers.engine.rollout",
    "workers.engine.task",
    "workers.timeline",
    "rlplane",
    "rlplane.cli",
]

_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _tests_for(name: str) -> list[doctest.DocTest]:
    """The doctests of ``name`` (a module, ``module.object`` or ``module.__doc__``), found by
    importing the module."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable prefix is the module
        module_name = ".".join(parts[:cut])
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        found = [t for t in doctest.DocTestFinder().find(module, module_name) if t.examples]
        if cut == len(parts):
            return found
        if parts[cut:] == ["__doc__"]:  # the module's docstring (its doctest bears the module's name)
            return [t for t in found if t.name == module_name]
        return [t for t in found if t.name == name or t.name.startswith(name + ".")]
    raise AssertionError(f"{name} is not importable")


def _source_of(name: str) -> tuple[pathlib.Path, list[str]]:
    """The file of the module ``name`` starts with, and the object path after it."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path, parts[cut:]
    raise AssertionError(f"{name}: no module of the project has this name")


def _docstrings(node: ast.AST) -> list[str]:
    """The docstrings of ``node`` and of every class and function inside it."""
    found = []
    for inner in ast.walk(node):
        if isinstance(inner, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(inner)
            if doc:
                found.append(doc)
    return found


@pytest.mark.parametrize("name", RUNNABLE)
def test_runnable_names_exist(name: str) -> None:
    """Every listed name is a module, object or module docstring of the project with an example
    (read from the source, so a renamed or emptied entry is named even if importing would fail)."""
    path, rest = _source_of(name)
    where = path.relative_to(ROOT)
    node: ast.AST = ast.parse(path.read_text(), filename=str(path))
    if rest == ["__doc__"]:
        docs = [ast.get_docstring(node) or ""]
    else:
        for attr in rest:
            body = getattr(node, "body", [])
            defs = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
            match = [n for n in body if isinstance(n, defs) and n.name == attr]
            assert match, f"{name}: neither a module nor an object defined in {where}; fix or remove it"
            node = match[0]
        docs = _docstrings(node)
    parser = doctest.DocTestParser()
    assert any(parser.get_examples(doc) for doc in docs), (
        f"{name} has no >>> example in {where}; remove it from RUNNABLE"
    )


@pytest.mark.parametrize("name", RUNNABLE)
def test_docstring_examples_run(name: str) -> None:
    tests = _tests_for(name)
    assert tests, f"{name} has no >>> examples any more; remove it from RUNNABLE"
    runner = doctest.DocTestRunner(optionflags=_FLAGS)
    report: list[str] = []
    for test in tests:
        runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)
