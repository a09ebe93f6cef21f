"""The session clusters' worker launcher (``worker_start.py``) starts workers as Ray's own does,
forked from the suite's fork server (``server.py``); with the server switched off (``RLT_FORK_SERVER=0``)
the session's workers start the stock way."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from tests import forkserver
from tests.dataplane.conftest import process_exited, wait_for
from tests.forkserver import forkserver_client as _zygote_client
from tests.forkserver import server as _zygote
from tests.forkserver.worker_start import split

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_split_reads_the_context_and_language_in_both_spellings() -> None:
    ctx = '{"env_vars": {"A": "1"}}'
    for argv in (
        [f"--serialized-runtime-env-context={ctx}", "worker.py", "--language=PYTHON", "--x=1"],
        ["--serialized-runtime-env-context", ctx, "worker.py", "--language", "PYTHON", "--x=1"],
    ):
        assert split(argv) == ({"env_vars": {"A": "1"}}, "PYTHON", ["worker.py", "--x=1"])
    assert split(["worker.py"]) == ({}, "", ["worker.py"])


def _probe() -> tuple:
    return os.environ.get("A"), os.environ.get("B"), sys.flags.utf8_mode


@pytest.mark.ray
def test_env_vars_expand_as_ray_expands_them_and_other_contexts_go_to_rays_script(ray_session) -> None:
    import ray

    probe = ray.remote(num_cpus=0.01)(_probe)
    env = {"A": "${HOME}/x", "B": "${RLPLANE_NOT_SET}y"}
    got = ray.get(probe.options(runtime_env={"env_vars": env}).remote(), timeout=120)
    assert got == (f"{os.environ['HOME']}/x", "y", 0)
    # An interpreter given as a command line is Ray's script's to run (through bash): it still applies.
    command = {"py_executable": f"{sys.executable} -X utf8"}
    assert ray.get(probe.options(runtime_env=command).remote(), timeout=120)[2] == 1


_ON = pytest.mark.skipif(not forkserver.enabled(), reason="the fork server is off (RLT_FORK_SERVER=0)")


@pytest.mark.ray
def test_with_the_server_off_the_session_clusters_workers_start_the_stock_way(ray_session) -> None:
    """A worker is forked from the server when it runs, else it is Ray's own ``setup_worker.py``'s exec."""
    import ray

    def probe() -> tuple[bool, str]:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            parent = f.read().replace(b"\0", b" ").decode()
        return "torch" in sys.modules, parent

    preloaded, parent = ray.get(ray.remote(num_cpus=0.01)(probe).remote(), timeout=120)
    if forkserver.enabled():
        assert preloaded and "forkserver" in parent, parent
    else:
        assert not preloaded and "forkserver" not in parent and "raylet" in parent, parent


@_ON
@pytest.mark.ray
def test_the_session_clusters_workers_are_forked_from_the_server(ray_session) -> None:
    import ray

    # This module imports no torch, so a worker that has it without importing it was forked from the
    # server (server.py), which preloads it; from a Ray server, which has Ray's library mapped.
    def probe() -> tuple[bool, bool]:
        with open(f"/proc/{os.getppid()}/maps") as maps:
            return "torch" in sys.modules, "_raylet" in maps.read()

    assert ray.get(ray.remote(num_cpus=0.01)(probe).remote(), timeout=120) == (True, True)


@_ON
@pytest.mark.ray
def test_run_python_forks_in_a_test_process_that_has_joined_ray(ray_session) -> None:
    # ray.init() sets PYTHONBREAKPOINT in this process after the session's server started; a variable
    # read at each breakpoint() call, not at an interpreter's start, must not send run_python to exec.
    code = "import os, sys; print(os.getppid(), 'torch' in sys.modules)"
    parent, preloaded = _zygote.run_python(["-c", code], timeout=60).stdout.split()
    assert int(parent) != os.getpid() and preloaded == "True", "run_python exec'd a new interpreter"


_SCRIPT = """
import os, sys, numpy
probe, draw = os.environ.get("RLT_PROBE"), numpy.random.randint(1 << 62)
print(sys.argv[1:], os.getcwd(), probe, sys.path[0], os.getppid(), draw)
sys.stdout.flush()
if sys.argv[1] == "wait":
    with open(sys.argv[2], "w") as f:
        f.write(str(os.getpid()))
    import signal
    signal.pause()
sys.exit(int(sys.argv[1]))
"""
# A starter, as worker_start.py runs it: it hands its command line to the server and exits with
# the worker's status.
_STARTER = (
    f"import sys; sys.path.insert(0, {TESTS!r}); from forkserver_client import request_worker as start; "
    "sys.exit(start(sys.argv[1], sys.argv[2:]))"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with _zygote.running(str(tmp_path_factory.mktemp("zygote")), modules=["numpy"]) as path:
        yield path


def _starter(server: str, script, *args: str, cwd, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _STARTER, server, str(script), *args],
        cwd=cwd,
        env={**os.environ, "RLT_PROBE": "seen", **env},
        stdout=subprocess.PIPE,
        text=True,
    )


def test_a_forked_worker_runs_as_the_exec_would_and_its_status_comes_back(server, tmp_path) -> None:
    script = tmp_path / "sub" / "worker.py"
    script.parent.mkdir()
    script.write_text(_SCRIPT)
    outs = []
    for status in ("3", "0"):
        starter = _starter(server, script, status, cwd=tmp_path)
        out, _ = starter.communicate(timeout=60)
        assert starter.returncode == int(status), out
        args, cwd, probe, path0, parent, draw = out.rsplit(maxsplit=5)
        # Its arguments, working directory, environment and sys.path[0] are the starter's, its output
        # is the starter's stdout, and its parent is the server, not the starter.
        assert (args, cwd, probe, path0) == (f"['{status}']", str(tmp_path), "seen", str(script.parent))
        assert int(parent) != starter.pid
        outs.append(draw)
    assert outs[0] != outs[1], "two workers drew the same numbers from numpy's global generator"


_RAY_PROBE = """
import os, ray._raylet
with open(f"/proc/{os.getppid()}/maps") as maps:
    print(os.getppid(), ray._raylet.Config.metrics_report_interval_ms(), "_raylet" in maps.read())
"""


def test_a_worker_shares_a_ray_server_only_with_workers_of_the_same_ray_variables(server, tmp_path) -> None:
    """Ray's native library reads the ``RAY_*`` variables once, as it loads: a worker is forked from a
    server that imported Ray with the same ones (its job, its raylet, its settings) or not at all."""
    script = tmp_path / "probe.py"
    script.write_text(_RAY_PROBE)
    seen = []
    for interval in ("1111", "2222", "1111"):
        starter = _starter(server, script, cwd=tmp_path, RAY_metrics_report_interval_ms=interval)
        out, _ = starter.communicate(timeout=120)
        assert starter.returncode == 0, out
        parent, value, parent_has_ray = out.split()
        assert (value, parent_has_ray) == (interval, "True"), "a worker saw another's Ray settings"
        seen.append(parent)
    assert seen[0] == seen[2] != seen[1], f"Ray servers by settings: {seen}"
    # Beyond RAY_SERVERS sets, the least recently used server exits (its workers are gone).
    for n in range(_zygote.RAY_SERVERS + 1):
        starter = _starter(server, script, cwd=tmp_path, RAY_metrics_report_interval_ms=str(3000 + n))
        assert starter.wait(timeout=120) == 0
    root = next(p for p in psutil.process_iter(["cmdline"]) if server in (p.info["cmdline"] or []))
    wait_for(lambda: len(root.children()) <= _zygote.RAY_SERVERS, 60, "the oldest Ray servers to exit")


def test_a_worker_dies_with_its_starter(server, tmp_path) -> None:
    script, pid_file = tmp_path / "worker.py", tmp_path / "pid"
    script.write_text(_SCRIPT)
    starter = _starter(server, script, "wait", str(pid_file), cwd=tmp_path)
    try:
        pid = int(wait_for(lambda: pid_file.exists() and pid_file.read_text(), 60, "the worker to start"))
    finally:
        starter.kill()  # as a raylet kills a worker it started
        starter.wait()
    wait_for(lambda: process_exited(pid), 60, "the worker to die")  # gone, or a zombie not yet reaped


def test_without_a_server_or_with_other_interpreter_settings_the_starter_execs(server, tmp_path) -> None:
    assert _zygote_client.request_worker(str(tmp_path / "none.sock"), ["worker.py"]) is None
    # A PYTHONPATH of its own (as a runtime env may give) is read at an interpreter's start: refused.
    script = tmp_path / "worker.py"
    script.write_text(_SCRIPT)
    starter = _starter(server, script, "3", cwd=tmp_path, PYTHONPATH=str(tmp_path))
    out, _ = starter.communicate(timeout=60)
    assert (starter.returncode, out) == (0, ""), "the starter should have been told to exec"


def test_run_python_forks_a_process_as_subprocess_run_would(server, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(_zygote.ZYGOTE, server)
    code = (
        "import os, sys; print(sys.argv, sys.path[0] == '', os.getppid()); sys.stderr.write('E'); sys.exit(4)"
    )
    done = _zygote.run_python(["-c", code, "x"], timeout=60, cwd=str(tmp_path))
    assert (done.returncode, done.stderr) == (4, "E"), done
    argv, empty_path0, parent = done.stdout.rsplit(maxsplit=2)
    assert (argv, empty_path0) == ("['-c', 'x']", "True") and int(
        parent
    ) != os.getpid()  # forked by the server
    (tmp_path / "mod_here.py").write_text("import sys; print('MODULE', sys.argv[1:])")
    assert (
        _zygote.run_python(["-m", "mod_here", "y"], timeout=60, cwd=str(tmp_path)).stdout == "MODULE ['y']\n"
    )
    # Not forked with Ray loaded: Ray reads the RAY_* variables the process sets before importing it.
    code = "import os; os.environ['RAY_metrics_report_interval_ms'] = '4321'; import ray._raylet as r; "
    code += "print(r.Config.metrics_report_interval_ms())"
    assert _zygote.run_python(["-c", code], timeout=60).stdout == "4321\n"
    killed = _zygote.run_python(["-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], timeout=60)
    assert killed.returncode == -9
    with pytest.raises(subprocess.TimeoutExpired):
        _zygote.run_python(["-c", "import signal; signal.pause()"], timeout=1)


def test_start_python_is_popen_for_a_forked_process(server, monkeypatch) -> None:
    monkeypatch.setenv(_zygote.ZYGOTE, server)
    echo = "import os, sys; print(os.getppid(), sys.stdin.readline().strip(), flush=True); sys.exit(5)"
    proc = _zygote.start_python(["-c", echo], stdin=True, stdout=True)
    assert isinstance(proc, _zygote.Forked) and proc.poll() is None
    proc.stdin.write("hello\n")
    proc.stdin.flush()
    parent, word = proc.stdout.readline().split()
    assert (int(parent) != os.getpid(), word, proc.wait(timeout=60), proc.poll()) == (True, "hello", 5, 5)
    sleeper = _zygote.start_python(["-c", "import signal; signal.pause()"])
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(timeout=0.2)
    sleeper.kill()
    assert sleeper.wait(timeout=60) == -9


def test_run_python_times_out_a_process_that_closed_its_streams_and_lives_on(server, monkeypatch) -> None:
    monkeypatch.setenv(_zygote.ZYGOTE, server)
    code = "import os, signal; os.close(1); os.close(2); signal.pause()"
    with pytest.raises(subprocess.TimeoutExpired):
        _zygote.run_python(["-c", code], timeout=1)
