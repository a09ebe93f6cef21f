"""Fresh Ray clusters and fresh shells for the first-hour tests, never the session's cluster.

A newcomer's machine in a box: a short folder of its own under /tmp (Ray's Unix sockets live there,
and their paths must stay under ~107 bytes) holding a home (``~/.ray/auth_token``, where Ray 2.60 keeps
its token) and Ray's temp dir (``RAY_TMPDIR``: the cluster ``ray start`` records for ``auto``, so
nothing here finds another engineer's cluster on a shared machine, nor theirs ours). Commands run
as a person runs them in a new terminal: a clean environment (PATH without the venv, that home),
from the repository's root.

Everything a sandbox started is stopped at the end by process id: the processes whose command line
or environment names the sandbox's folder, and their descendants (``ray stop`` would stop every Ray on
the machine). The session's ``laptop`` (``tests/conftest.py``) is one such machine, whose head the
first-hour tests share.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent  # the venv running the tests


@dataclass
class Sandbox:
    """One newcomer machine: ``root`` holds ``home`` and ``ray_tmp``; ``head`` is the address of the
    head ``start_head`` started there, if it did."""

    root: Path
    head: str | None = None

    @property
    def home(self) -> Path:
        return self.root / "h"

    @property
    def ray_tmp(self) -> Path:
        return self.root / "t"

    def env(self, **extra: str) -> dict[str, str]:
        """A new terminal's environment: no venv on PATH, no RAY_ADDRESS, this sandbox's home."""
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": str(self.home),
            "RAY_TMPDIR": str(self.ray_tmp),
            "LANG": "C.UTF-8",
        }
        env.update(extra)
        return env

    def sh(self, command: str, timeout: float, **extra: str) -> subprocess.CompletedProcess:
        """Run ``command`` in bash as typed, from the repository's root, in a new terminal's env."""
        return subprocess.run(
            ["bash", "-c", command],
            cwd=ROOT,
            env=self.env(**extra),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def make_token(self) -> str:
        """Give this machine a Ray token, as a first ``ray.init()`` would (``~/.ray/auth_token``)."""
        proc = self.sh(f"{VENV_BIN}/ray get-auth-token --generate", timeout=120)
        assert proc.returncode == 0 and proc.stdout.strip(), proc.stdout + proc.stderr
        return proc.stdout.strip()

    def stop(self) -> None:
        """Stop every process this machine ran (its head, and what runs on it); its files stay."""
        stop_processes_naming(self.root)
        self.head = None


@contextlib.contextmanager
def sandbox() -> Iterator[Sandbox]:
    """A fresh sandbox; at the end every process that names it is stopped and the folder removed."""
    box = Sandbox(Path(tempfile.mkdtemp(prefix="rlp-", dir="/tmp")))
    box.home.mkdir()
    box.ray_tmp.mkdir()
    try:
        yield box
    finally:
        box.stop()
        shutil.rmtree(box.root, ignore_errors=True)


def stop_processes_naming(path: Path, timeout_s: float = 30.0) -> None:
    """Kill, by pid, what a sandbox's Ray started: the processes whose command line or environment
    names ``path``, and their descendants. Ray's agents rename themselves (``ray::DashboardAgent``: no
    path left to see, their environment overwritten too) and its client server names the sandbox only
    in its environment; each outlived the sandbox by minutes when only command lines were matched."""
    mine: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["pid", "cmdline", "environ"]):
        try:
            named = [*(proc.info["cmdline"] or []), *(proc.info["environ"] or {}).values()]
            if proc.pid != os.getpid() and any(str(path) in part for part in named):
                mine[proc.pid] = proc
                mine.update((child.pid, child) for child in proc.children(recursive=True))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    for proc in mine.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(list(mine.values()), timeout=timeout_s)


def free_port() -> int:
    """A TCP port nothing listens on now (for a head that must not take Ray's defaults on a shared box)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def head_command(typed: str = f"{VENV_BIN}/ray start --head") -> str:
    """``ray start --head`` as typed, on ports of its own: 6379, 52365 and the dashboard's 8265 may be
    another engineer's, or another test's Ray (a dashboard that cannot bind 8265 prints a traceback)."""
    return (
        f"{typed} --port {free_port()} --dashboard-port {free_port()}"
        f" --dashboard-agent-listen-port {free_port()}"
    )


def start_head(box: Sandbox, command: str | None = None, timeout: float = 240.0) -> str:
    """The sandbox's head: started by ``command`` (default ``head_command()``) unless one runs there
    already; returns its address. Token authentication is on when the sandbox has a token, as Ray
    2.60 does by default."""
    if box.head is not None:
        return box.head
    cmd = command or head_command()
    proc = box.sh(cmd, timeout=timeout, PYTHONUNBUFFERED="1")
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return recorded_head(box)


def recorded_head(box: Sandbox) -> str:
    """The address the sandbox's ``ray start --head`` recorded (as ``address="auto"`` finds it), kept
    as its ``head``."""
    recorded = box.ray_tmp / "ray" / "ray_current_cluster"
    deadline = time.monotonic() + 30
    while not recorded.exists():  # written by `ray start` before it returns; bounded all the same
        assert time.monotonic() < deadline, f"`ray start` recorded no address in {recorded}"
        time.sleep(0.1)
    box.head = recorded.read_text().strip()
    return box.head
