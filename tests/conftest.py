"""Shared fixtures: one Ray session for the whole pytest session.

The session runs on a ``ray.cluster_utils.Cluster`` head with a logical ``num_cpus=8``
(the CI machine has 2 real cores), so tests that need a second "node" add one to the
same cluster with ``ray_cluster.add_node(...)`` instead of starting a second Ray.

Tests that need Ray take the ``ray_cluster`` fixture (or ``ray_session`` when they only
need ``ray`` initialised). Pure tests take neither and never start Ray. ``make test`` runs the suite
on pytest-xdist workers: each is a pytest session of its own, so each has its own cluster.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import warnings

import pytest

# Keep Ray quiet and small on a 2-core machine; set before ray is imported anywhere.
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Test traffic stays on loopback: with this switch off Ray takes 127.0.0.1 as every node's IP (as it
# does on a laptop), so the GCS, raylets, workers and the store's tcp endpoints bind there. Processes
# the tests start inherit it.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Torch on one intra-op thread in the test processes (and what they start with this environment), as
# in Ray's workers. The test processes share the cores (``make test``'s xdist workers, Ray's workers):
# a pool thread waiting for a core spins, and on these tiny tensors that tripled the CPU of a module
# that trains in process (tests/workers/test_engine.py: 70 CPU-s against 25 under a two-process load).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Each node's dashboard agent samples every process of its node (psutil) every 5 s by default for the
# dashboard's graphs, which the session clusters do not have; with a few dozen workers alive that was
# about 12 CPU-seconds a session. The store's own metrics do not go through it (tests/dataplane/
# _metrics_cluster.py, a cluster of its own, keeps Ray's default).
os.environ.setdefault("REPORTER_UPDATE_INTERVAL_MS", "60000")
# Under pytest-xdist (``make test`` runs the suite on several workers) each worker runs its own Ray:
# a temp dir of its own (sessions, sockets, the address `auto` finds; short, for Unix socket paths)
# and ports of its own, so the workers' clusters never meet.
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
_OWN_TMP = None
if WORKER and "RAY_TMPDIR" not in os.environ:
    _OWN_TMP = os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix=f"rlt-{WORKER}-", dir="/tmp")


# What the suite's processes import from this repository. Each Ray worker and subprocess imports some
# of it: with no bytecode on disk (a fresh clone, where PYTHONDONTWRITEBYTECODE, set on some machines,
# means none is ever written) every one of them compiles those sources again. Compiled once up front,
# they read it: about 8% of the CPU of a sample of modules (A/B in one window, in the closing note).
SOURCES = ("dataplane", "controlplane", "workers", "bench", "rlplane", "examples", "tests")


def pytest_configure(config) -> None:
    if WORKER is None:  # the run's first process: before any xdist worker or Ray starts
        import compileall
        import pathlib

        root = pathlib.Path(__file__).resolve().parent.parent
        for name in SOURCES:
            compileall.compile_dir(root / name, quiet=1)


def pytest_unconfigure(config) -> None:
    if _OWN_TMP:
        shutil.rmtree(_OWN_TMP, ignore_errors=True)


def pytest_collection_modifyitems(config, items) -> None:
    """Modules with slow tests run first (a stable sort: each module's tests stay together, in order).
    ``make test`` spreads modules over workers; a long module started last would end the run alone."""
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow)


RAY_NUM_CPUS = 8
WORKER_START = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker_start.py")
RAY_OBJECT_STORE_BYTES = 512 * 1024**2


@pytest.fixture(scope="session")
def ray_cluster():
    """A one-node Ray cluster shared by every test in the session, torn down at the end. Its workers
    are forked from one process that has imported what they import (``tests/_zygote.py``)."""
    import ray
    from ray.cluster_utils import Cluster

    from tests import _zygote
    from tests._fresh_ray import free_port

    class _Cluster(Cluster):
        def add_node(self, wait: bool = True, **node_args):
            # Each node of the session starts its workers without an extra import (tests/_worker_start.py).
            node_args.setdefault("setup_worker_path", WORKER_START)
            return super().add_node(wait, **node_args)

    with contextlib.ExitStack() as stack:
        directory = os.environ.get("RAY_TMPDIR") or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="rlz-")
        )
        # The nodes (and so their workers' starts) inherit this process's environment.
        try:
            os.environ[_zygote.ZYGOTE] = stack.enter_context(_zygote.running(directory))
            stack.callback(os.environ.pop, _zygote.ZYGOTE, None)
        except RuntimeError as exc:  # slower, not wrong: tests/test_worker_start.py names the loss
            warnings.warn(f"{exc}: the session's Ray starts each worker as a new interpreter", stacklevel=1)
        cluster = _Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": RAY_NUM_CPUS,
                "include_dashboard": False,
                "object_store_memory": RAY_OBJECT_STORE_BYTES,
                # Ray's fixed default (52365) would clash between the workers' clusters.
                "dashboard_agent_listen_port": free_port(),
            },
        )
        stack.callback(cluster.shutdown)
        ray.init(address=cluster.address, log_to_driver=True)
        stack.callback(ray.shutdown)
        yield cluster


@pytest.fixture(scope="session")
def ray_session(ray_cluster):
    """Ray initialised for this process (the session's cluster)."""
    import ray

    assert ray.is_initialized()
    return ray_cluster


@pytest.fixture
def main_in_process(ray_session, capsys):
    """Runs a command line's ``main(argv)`` in this process, which has joined the session's Ray (so a
    benchmark uses that Ray and leaves it joined, ``bench._common.ray_for_run``) and is attached to no
    store (the run starts its own); returns ``(exit code, what it printed)``. Checks that the run kept
    Ray and stopped its store."""
    import ray

    import dataplane as dp

    def run(main, argv: list[str]) -> tuple[int, str]:
        dp.close()  # a store this process attached to before would be used instead of the run's own
        code = main(argv)
        assert ray.is_initialized() and not dp.is_initialized(), "the run must keep Ray and stop its store"
        return code, capsys.readouterr().out

    return run
