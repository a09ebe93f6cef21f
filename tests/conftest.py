"""Shared fixtures: one Ray session for the whole pytest session.

The session runs on a ``ray.cluster_utils.Cluster`` head with a logical ``num_cpus=8``
(the CI machine has 2 real cores), so tests that need a second "node" add one to the
same cluster with ``ray_cluster.add_node(...)`` instead of starting a second Ray.

Tests that need Ray take the ``ray_cluster`` fixture (or ``ray_session`` when they only
need ``ray`` initialised). Pure tests take neither and never start Ray. ``fork_server`` is the
process the session's Ray workers and the tests' own second processes are forked from
(``tests/forkserver``, ``RLT_FORK_SERVER=0`` switches it off); ``laptop`` is the newcomer's machine
the first-hour tests share.
``make test`` runs the suite on pytest-xdist workers: each is a pytest session of its own, so each
has its own cluster.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
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
# Each node's agent also opens every file of its events directory every 2 s by default, for the
# dashboard: one file per worker process that ever ran there (all of them empty here), a few hundred
# by the end of a session, and some 0.04 CPU-seconds a second for each session cluster's agent. Once a
# minute here.
os.environ.setdefault("SCAN_EVENT_DIR_INTERVAL_SECONDS", "60")
# Every Ray process sends its metrics to its node's agent every 10 s by default; no test of a session
# cluster reads them (tests/dataplane/_metrics_cluster.py sets its own), so once a minute.
os.environ.setdefault("RAY_metrics_report_interval_ms", "60000")
# Each cluster's log monitor globs its logs directory for new worker files every 0.1 s while the
# directory holds under 1,000 files (Ray's threshold), and a session cluster's holds hundreds by the
# end: 13-19 CPU-seconds a session. Once a second here; a worker's lines reach the driver all the same,
# up to a second later.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
os.environ.setdefault("LOG_NAME_UPDATE_INTERVAL_S", "1")
# Each pytest session (under pytest-xdist, ``make test``, each worker is one) runs its own Ray with a
# temp dir of its own (sessions, sockets, the address `auto` finds, the fork server's socket; short,
# for Unix socket paths) and ports of its own, so the sessions' clusters never meet each other nor a
# Ray the user runs. A RAY_TMPDIR the user set (a cluster whose /tmp is small) is where those dirs go.
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
_OWN_TMP: str | None = None
# The suite starts Rays of its own and names their addresses; a RAY_ADDRESS the user set (their own
# cluster) must not send a test's `ray.init()` or a process it starts there.
os.environ.pop("RAY_ADDRESS", None)


# What the suite's processes import from this repository. Each Ray worker and subprocess imports some
# of it: with no bytecode on disk (a fresh clone, where PYTHONDONTWRITEBYTECODE, set on some machines,
# means none is ever written) every one of them compiles those sources again. Compiled once up front,
# they read it: about 8% of the CPU of a sample of modules (A/B in one window, in the closing note).
SOURCES = ("dataplane", "controlplane", "workers", "bench", "rlplane", "examples", "tests")


def _xdist_controller(config) -> bool:
    """This process hands the tests to xdist workers and runs none itself (``-n N``, N > 0)."""
    return WORKER is None and config.getoption("numprocesses", default=None) not in (None, 0)


def pytest_configure(config) -> None:
    global _OWN_TMP
    if not _xdist_controller(config):  # a session that runs tests: a Ray temp dir of its own
        _OWN_TMP = os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(
            prefix=f"rlt-{WORKER or 'main'}-", dir=os.environ.get("RAY_TMPDIR") or "/tmp"
        )
    if WORKER is None:  # the run's first process: before any xdist worker or Ray starts
        import compileall
        import pathlib

        root = pathlib.Path(__file__).resolve().parent.parent
        for name in SOURCES:
            compileall.compile_dir(root / name, quiet=1)


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """pytest keeps each test module's assertion-rewritten bytecode in ``__pycache__`` only where
    bytecode may be written; under PYTHONDONTWRITEBYTECODE (set on some machines) every xdist worker
    rewrote all the test modules on every run (collection: 11.1 CPU-seconds a worker, 6.2 once they are
    written). They are written while pytest imports them, as the sources' own are (``pytest_configure``)."""
    saved, sys.dont_write_bytecode = sys.dont_write_bytecode, False
    try:
        return (yield)
    finally:
        sys.dont_write_bytecode = saved


def pytest_unconfigure(config) -> None:
    if _OWN_TMP:
        shutil.rmtree(_OWN_TMP, ignore_errors=True)


# The first-hour tests that share one newcomer's machine (the ``laptop`` fixture): one unit of work for
# xdist, so one worker and one ``ray start --head`` for the three, in this order (examples/README.md
# starts the head; its first command must find none).
FIRST_HOUR = ("tests/test_examples.py", "tests/test_readme.py", "tests/workers/test_printed_steps.py")
# The multi-host modules share one test bed: one unit of work too.
MULTIHOST = "tests/multihost/"


def _module(nodeid: str) -> str:
    """The test file a test's nodeid names (``tests/x.py::test_y[z]`` -> ``tests/x.py``)."""
    return nodeid.split("::")[0]


def pytest_collection_modifyitems(config, items) -> None:
    """Modules with slow tests run first, the first-hour modules (together the longest unit) before
    the others (a stable sort: each module's tests stay together, in order). ``make test`` spreads
    modules over workers (``--dist loadfile``, ``pytest_xdist_make_scheduler``); a long module started
    last would end the run alone."""
    slow = {_module(item.nodeid) for item in items if item.get_closest_marker("slow")}
    order = {name: i for i, name in enumerate(FIRST_HOUR)}

    def rank(item) -> tuple[bool, int]:
        module = _module(item.nodeid)
        return module not in slow, order.get(module, len(order))

    items.sort(key=rank)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: a run without xdist has no such hook
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the first-hour modules as one unit of work, and the multi-host ones as
    another (xdist's ``loadgroup`` would say so with marks, but its group names do not reach the
    scheduler under pytest 9.2, where an item's nodeid is no longer the attribute it rewrites)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = _module(nodeid)
            if module.startswith(MULTIHOST):  # one test bed for them all (tests/multihost/conftest.py)
                return MULTIHOST
            return "first-hour" if module in FIRST_HOUR else module

    return ModuleScheduling(config, log)


_LAPTOP: list = []  # the session's laptop, once a test has asked for it


@pytest.fixture(scope="session")
def laptop():
    """A newcomer's machine (``tests/_fresh_ray.py``) shared by the first-hour tests (``FIRST_HOUR``):
    it has a Ray token, as a first ``ray.init()`` leaves it. The first to need a head starts it
    (examples/README.md's ``ray start --head``, or ``_fresh_ray.start_head`` for a test run alone), the
    others use it; everything it ran is stopped, by process id, once the last of them is done
    (``pytest_runtest_teardown``), and its folder removed at the end of the session."""
    from tests._fresh_ray import sandbox

    with sandbox() as box:
        box.make_token()
        _LAPTOP.append(box)
        try:
            yield box
        finally:
            _LAPTOP.remove(box)


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down
def pytest_runtest_teardown(item, nextitem) -> None:
    """The laptop's Ray stops when the first-hour tests are done, not when the session is: its head,
    dashboard and agents would idle through the rest of the run (some 10 CPU-seconds)."""
    last = nextitem is None or _module(nextitem.nodeid) not in FIRST_HOUR
    if _LAPTOP and _module(item.nodeid) in FIRST_HOUR and last:
        _LAPTOP[0].stop()


RAY_NUM_CPUS = 8
IDLE_WORKERS = 2  # idle workers each session cluster keeps for tasks (Ray's default: RAY_NUM_CPUS)
WORKER_START = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forkserver", "worker_start.py")
RAY_OBJECT_STORE_BYTES = 512 * 1024**2


@pytest.fixture(scope="session")
def fork_server():
    """The session's fork server (``tests/forkserver``), named by ``RLT_ZYGOTE`` in this process's
    environment, which the session cluster's nodes inherit: their workers, and the processes tests
    start with ``run_python`` / ``start_python``, are forked from it. Yields its socket's path, or None
    when it is switched off (``RLT_FORK_SERVER=0``) or did not start (slower, not wrong:
    tests/forkserver/test_forkserver.py names the loss)."""
    from tests import forkserver
    from tests.forkserver.forkserver_client import ZYGOTE

    if not forkserver.enabled():
        yield None
        return
    with contextlib.ExitStack() as stack:
        # A directory of this session's own (RAY_TMPDIR is one, under xdist): one server per session.
        directory = _OWN_TMP or stack.enter_context(tempfile.TemporaryDirectory(prefix="rlz-"))
        try:
            path = os.environ[ZYGOTE] = stack.enter_context(forkserver.running(directory))
            stack.callback(os.environ.pop, ZYGOTE, None)
        except RuntimeError as exc:
            warnings.warn(f"{exc}: the session's processes start as new interpreters", stacklevel=1)
            path = None
        yield path


@pytest.fixture(scope="session")
def ray_cluster(fork_server):
    """A one-node Ray cluster shared by every test in the session, torn down at the end. Its workers
    are forked from one process that has imported what they import (``fork_server``)."""
    import ray
    from ray.cluster_utils import Cluster

    from tests._fresh_ray import free_port

    class _Cluster(Cluster):
        def add_node(self, wait: bool = True, **node_args):
            # Each node of the session starts its workers without an extra import
            # (tests/forkserver/worker_start.py), unless the fork server is switched off: then Ray's own.
            if fork_server is not None:
                node_args.setdefault("setup_worker_path", WORKER_START)
            return super().add_node(wait, **node_args)

    with contextlib.ExitStack() as stack:
        cluster = _Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": RAY_NUM_CPUS,
                "include_dashboard": False,
                "object_store_memory": RAY_OBJECT_STORE_BYTES,
                # Ray's fixed default (52365) would clash between the workers' clusters.
                "dashboard_agent_listen_port": free_port(),
                # Ray keeps as many idle workers as the node has CPUs (8 logical here) for tasks to
                # come, each waking some 100 times a second (about 0.9% of a core each): two of them
                # serve the suite's task bursts, the rest only cost a 2-core machine.
                "_system_config": {"num_workers_soft_limit": IDLE_WORKERS},
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
