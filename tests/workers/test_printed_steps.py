"""What the CLI tells a user to run works as printed, in a new terminal, under Ray's default token
authentication (Ray 2.60: ``ray start`` turns it on when the machine has a token, which any first
``ray.init()`` leaves in ``~/.ray/auth_token``).

The trial: ``ray start --head`` on a newcomer's machine (the session's ``laptop``, whose head
examples/README.md started when the first-hour tests run together, ``tests/conftest.py``), then
``rlplane store start``, and every line it printed, each in a fresh shell: the Python attach line,
``store status`` with the printed address, and the recipe for another machine (a second sandbox with
no token and no recorded cluster: first refused with an error that names ``ray get-auth-token``, then,
with the token the printed command gives, attached). Before the fix, the attach line and ``store status
--address HOST:PORT`` failed with ``ClusterAuthError ... RAY_AUTH_MODE is unset here`` while
``address="auto"`` worked: Ray presents the machine's token only to the cluster it finds by itself.
"""

from __future__ import annotations

import re
import shlex
import subprocess

import psutil
import pytest

from tests._fresh_ray import VENV_BIN, sandbox, start_head

TIMEOUT_S = 240  # one command on a busy 2-core machine: imports, joining Ray, the store's actors


def _attach_line(address_line: str) -> str:
    """The printed ``dp.init(...)`` call as a shell command a user would type."""
    call = re.search(r"(dp\.init\(address=\"[^\"]+\"\))", address_line).group(1)
    code = f"import dataplane as dp; info = {call}; print('ATTACHED', info.num_shards); dp.close()"
    return f"{VENV_BIN}/python -c {shlex.quote(code)}"


def _check(proc: subprocess.CompletedProcess, what: str) -> None:
    assert proc.returncode == 0, (
        f"{what} (exit {proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )


@pytest.mark.slow
def test_every_line_store_start_prints_works_as_printed(laptop) -> None:
    here = laptop
    with sandbox() as elsewhere:
        address = start_head(here)
        started = here.sh(f"{VENV_BIN}/rlplane store start --shards 1", timeout=TIMEOUT_S)
        _check(started, "rlplane store start")
        out = started.stdout
        try:
            py_line = next(line for line in out.splitlines() if "dp.init(address=" in line)
            status_line = next(line for line in out.splitlines() if line.startswith("see it:"))
            assert address in py_line and address in status_line, out

            attached = here.sh(_attach_line(py_line), timeout=TIMEOUT_S)
            _check(attached, f"the attach line, as printed: {py_line}")
            assert "ATTACHED 1" in attached.stdout
            status = here.sh(status_line.split(":", 1)[1].strip(), timeout=TIMEOUT_S)
            _check(status, f"the status line, as printed: {status_line}")
            assert "1 shard(s) on 1 node(s)" in status.stdout, status.stdout

            # Another machine: no token, no recorded cluster. Refused, with an error naming the fix.
            refused = elsewhere.sh(_attach_line(py_line), timeout=TIMEOUT_S)
            assert refused.returncode != 0 and "ClusterAuthError" in refused.stderr, refused.stderr
            assert "get-auth-token" in refused.stderr and "RAY_AUTH_MODE=token" in refused.stderr
            recipe = next(line for line in out.splitlines() if "get-auth-token" in line)
            token_cmd = re.search(r"`([^`]*get-auth-token)`", recipe).group(1)
            token = here.sh(token_cmd, timeout=TIMEOUT_S)
            _check(token, f"the token command, as printed: {token_cmd}")
            exports = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token.stdout.strip()}
            remote = elsewhere.sh(_attach_line(py_line), timeout=TIMEOUT_S, **exports)
            _check(remote, "the attach line on another machine, with the printed recipe")
            remote_status = elsewhere.sh(status_line.split(":", 1)[1].strip(), timeout=TIMEOUT_S, **exports)
            _check(remote_status, "the status line on another machine, with the printed recipe")
        finally:
            stop = here.sh(f"{VENV_BIN}/rlplane store stop", timeout=TIMEOUT_S)
        _check(stop, "rlplane store stop")
        assert "stopped store" in stop.stdout


def test_bench_help_starts_with_its_usage() -> None:
    proc = subprocess.run(
        [f"{VENV_BIN}/rlplane", "bench", "bypass", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.startswith("usage: rlplane bench bypass"), proc.stdout


@pytest.mark.slow
def test_the_laptop_stops_every_process_its_head_started(laptop) -> None:
    """Stopping a sandbox leaves none of its Ray behind. The last first-hour test, on the head the
    others used (the laptop stops after it anyway, ``tests/conftest.py``). Before the fix the raylet's
    agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``: no path in their command line) and the
    client server (the sandbox named only in its environment) idled on for minutes, through the
    rest of the suite."""
    address = start_head(laptop)
    cmdlines = {p.pid: p.info["cmdline"] or [] for p in psutil.process_iter(["cmdline"])}
    raylet = next(
        psutil.Process(pid)
        for pid, line in cmdlines.items()
        if line and line[0].endswith("/raylet") and any(str(laptop.root) in part for part in line)
    )
    agents = raylet.children()
    clients = [
        psutil.Process(pid)
        for pid, line in cmdlines.items()
        if "ray.util.client.server" in line and f"--address={address}" in line
    ]
    assert len(agents) >= 2 and len(clients) == 1, ([a.name() for a in agents], clients)
    laptop.stop()
    _gone, alive = psutil.wait_procs([raylet, *agents, *clients], timeout=30)
    assert not alive, [p.info for p in psutil.process_iter(["pid", "name", "cmdline"]) if p in alive]
