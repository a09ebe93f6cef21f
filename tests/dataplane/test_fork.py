"""A forked child must never talk on its parent's connections.

Blocking clients keep their Unix-lane connections in a pool (``transport.clients.SyncTransport``); a
fork copies that pool. Were the child to take a pooled connection, parent and child would share one
socket and read each other's replies: each would drop the other's as a stale reply and wait for its
own, which the other had read. The transport drops what it inherited in a forked child.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import select
import signal
import subprocess
import sys
import threading

import torch

import dataplane as dp

from .conftest import own_store

ROUNDS = 300


def _child(pid: str, out: int) -> None:
    code = 1
    try:
        right = 0
        for _ in range(ROUNDS):
            right += dp.kv_batch_get(["a"], pid)["x"].tolist() == [[0, 1, 2, 3]]
        os.write(out, str(right).encode())
        code = 0
    finally:
        os._exit(code)


def test_a_forked_child_never_takes_its_parents_connections(ray_cluster, pid):
    with own_store("t-fork", num_shards=1, rpc_timeout_s=5) as _:
        dp.kv_batch_put(["a", "b"], pid, {"x": torch.arange(8).view(2, 4)})  # the pool holds a connection
        read_end, write_end = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(read_end)
            faulthandler.dump_traceback_later(45, exit=True)  # stuck: says where (captured stderr)
            _child(pid, write_end)
        os.close(write_end)
        ready: list = []
        try:
            wrong = []
            for i in range(ROUNDS):  # the parent reads another row at the same time
                try:
                    got = dp.kv_batch_get(["b"], pid)["x"].tolist()
                except dp.ShardUnavailableError as exc:  # its reply was read by the child
                    wrong.append(f"round {i}: {exc}")
                    break
                if got != [[4, 5, 6, 7]]:
                    wrong.append(f"round {i}: {got}")
            assert not wrong, f"the parent's reads went wrong: {wrong[:3]}"
            ready, _, _ = select.select([read_end], [], [], 60)
            assert ready, "the forked child did not finish its reads within 60 s"
            answer = os.read(read_end, 64).decode()
            assert answer == str(ROUNDS), f"the child read its row right {answer or 'no'} times of {ROUNDS}"
        finally:
            os.close(read_end)
            if not ready:
                os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)  # it has answered (it exits right after) or was killed


# A module whose import takes a while (as torch's and tensordict's do, which a first get imports):
# it says when it has begun, then computes.
SLOW_MODULE = """
from tests.dataplane import test_fork
test_fork.IMPORTING.set()
TOTAL = sum(i * i for i in range(3_000_000))
"""
IMPORTING = threading.Event()


def test_a_child_forked_while_a_thread_imports_a_module_can_import_it(tmp_path, monkeypatch):
    """A child forked while another thread imports a module inherits that module's import lock held by
    a thread it does not have: a first get in a thread while the main thread forks DataLoader workers.
    The fork waits for that import (``dataplane._fork``); the child imports the module at once."""
    (tmp_path / "dp_slow_import.py").write_text(SLOW_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    IMPORTING.clear()
    importer = threading.Thread(target=importlib.import_module, args=("dp_slow_import",))
    importer.start()
    try:
        assert IMPORTING.wait(60), "the import did not begin"
        child = os.fork()  # the import is under way in the other thread
        if child == 0:
            code = 3
            try:
                faulthandler.dump_traceback_later(20, exit=True)  # stuck: says where, and exits 1
                code = 0 if importlib.import_module("dp_slow_import").TOTAL > 0 else 3
            finally:
                os._exit(code)
        status = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
        assert status == 0, f"the forked child could not import the module (exit {status}), stack above"
    finally:
        importer.join()
        sys.modules.pop("dp_slow_import", None)


STUCK_IMPORT = """
import builtins, importlib, os, sys, threading, time
import dataplane._fork as fork

fork.WAIT_S = 0.3
builtins.dp_started, builtins.dp_gate = threading.Event(), threading.Event()
sys.path.insert(0, sys.argv[1])
importer = threading.Thread(target=importlib.import_module, args=("dp_stuck_import",), daemon=True)
importer.start()
assert builtins.dp_started.wait(30), "the import did not begin"
t0 = time.monotonic()
child = os.fork()  # that import never ends while this thread waits
if child == 0:
    os._exit(0)
os.waitpid(child, 0)
print(f"forked after {time.monotonic() - t0:.2f} s", flush=True)
builtins.dp_gate.set()
importer.join(30)
"""


def test_a_fork_waits_for_another_threads_import_only_so_long(tmp_path):
    """An import that does not end (here: it waits for the forking thread) holds a fork at most
    ``WAIT_S``; then the fork goes ahead as CPython's would."""
    (tmp_path / "dp_stuck_import.py").write_text(
        "import builtins\nbuiltins.dp_started.set()\nbuiltins.dp_gate.wait()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", STUCK_IMPORT, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "forked after" in done.stdout, done.stdout + done.stderr[-2000:]
    assert float(done.stdout.split()[2]) < 30
