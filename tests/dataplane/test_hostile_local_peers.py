"""Local processes that try to take the store down without its secret, and replies that lie about memory.

* A connection flood on the same-host Unix lane, from uid ``nobody`` and from the store's own uid
  without the secret: separate processes open connections to a shard and to the index as fast as
  they are served and never say hello, while this process keeps putting and reading. No legitimate
  call may fail, and the store's descriptors stay bounded (the other uid's connections are closed
  at accept, the store's own uid's unauthenticated ones are capped per listener).
* A segment reference longer than its file: the reader gets a typed error, never SIGBUS.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest
import torch

import dataplane as dp
from dataplane.transport import unix
from dataplane.transport.clients import SyncTransport
from dataplane.wire.requests import INDEX, Call
from tests.forkserver import run_python

from .conftest import store_fixtures, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEADLINE_S = 60.0

# ---- the connection flood ----------------------------------------------------------------------------

STORE = "t-flood"
store, attached = store_fixtures(STORE, num_shards=1, rpc_timeout_s=30)

# A hostile process: standard library only (it may run as a user who cannot read this venv), drops to
# ``drop`` ("uid:gid") before it opens a socket, then holds up to ``hold`` connections to the given
# Unix-lane addresses without a word, opening a new one for each the service closes, until its stdin
# closes. It reports how many it opened and how many the service closed.
ATTACKER = textwrap.dedent(
    r"""
    import json, os, resource, select, socket, sys, time
    cfg = json.loads(sys.argv[1])
    if cfg["drop"]:
        uid, gid = map(int, cfg["drop"].split(":"))
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    addresses = ["\0" + a[1:] for a in cfg["addresses"]]
    poller = select.poll()
    poller.register(sys.stdin.fileno(), select.POLLIN)
    held, opened, closed, full, told = {}, 0, 0, 0, False
    stop_at = time.monotonic() + cfg["max_s"]
    while time.monotonic() < stop_at:
        while len(held) < cfg["hold"]:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(addresses[opened % len(addresses)])
            except BlockingIOError:  # the backlog is full: look again after the poll
                s.close()
                full += 1
                break
            except OSError:
                s.close()
                break
            held[s.fileno()] = s
            poller.register(s, select.POLLIN)
            opened += 1
        if not told and opened >= cfg["hold"]:
            told = True
            print(json.dumps({"started": opened, "uid": os.getuid()}), flush=True)
        events = poller.poll(10)
        if any(fd == sys.stdin.fileno() for fd, _ in events):
            break
        for fd, _ in events:
            poller.unregister(fd)
            held.pop(fd).close()
            closed += 1
    print(json.dumps({"uid": os.getuid(), "opened": opened, "closed": closed, "full": full,
                      "held": len(held)}), flush=True)
    """
)

HOLD = 3000  # connections an attacker keeps open: well over the cap of a listener
ROUNDS = 30  # put + get rounds of the legitimate client while the attack runs
FRESH_EVERY = 2  # every so many rounds, a new blocking client connects to the shard and the index
SLACK_FDS = 128  # descriptors a legitimate client's use may add (its connections, new segments)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _attack(addresses: list[str], drop: str) -> subprocess.Popen:
    cfg = {"addresses": addresses, "hold": HOLD, "drop": drop, "max_s": 300}
    return subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", ATTACKER, json.dumps(cfg)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
    )


def _started(proc: subprocess.Popen) -> dict[str, Any]:
    """The attacker's first report (it opened ``HOLD`` connections), read within the deadline."""
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(DEADLINE_S)
    assert got and got[0], (
        f"the attacker did not start: {proc.poll()} {proc.stderr.read() if proc.poll() else ''}"
    )
    return json.loads(got[0])


def _stop(proc: subprocess.Popen) -> dict[str, Any]:
    """Close the attacker's stdin (its signal to stop) and read its last report (its exit status too)."""
    try:
        out, err = proc.communicate(input="", timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    lines = out.strip().splitlines()
    report = json.loads(lines[-1]) if proc.returncode == 0 and lines else {"stderr": err[-2000:]}
    return {**report, "exit": proc.returncode}


@pytest.mark.ray
@pytest.mark.parametrize("who", ["nobody", "the store's uid"])
def test_a_connection_flood_without_the_secret_fails_no_legitimate_call(attached, pid, who) -> None:
    if who == "nobody":
        if os.geteuid() != 0:
            pytest.skip("running a process as uid nobody needs root")
        nobody = pwd.getpwnam("nobody")
        drop, uid = f"{nobody.pw_uid}:{nobody.pw_gid}", nobody.pw_uid
    else:
        drop, uid = "", os.getuid()
    client = dp.api.current_client()
    registry = client.registry
    shard, index = registry["shards"][0], registry["index"]
    x = torch.arange(4 * 32768, dtype=torch.float32).reshape(4, -1)  # 128 KiB a row: through shared memory
    keys = [f"k{i}" for i in range(4)]
    dp.kv_batch_put(keys, pid, {"x": x})  # the shard's own link to the index is made before the attack
    base = {"shard": _fds(shard["pid"]), "index": _fds(index["pid"])}
    attackers = [_attack([shard["unix"]], drop), _attack([index["unix"]], drop)]  # one on each
    failures: list[str] = []
    peak = dict(base)
    try:
        for proc in attackers:
            report = _started(proc)
            assert report["uid"] == uid, report
        for i in range(ROUNDS):
            try:
                dp.kv_batch_put(keys, pid, {"x": x + i})
                got = dp.kv_batch_get(keys, pid)["x"]
                if not torch.equal(got, x + i):
                    failures.append(f"round {i}: read back other values")
                if i % FRESH_EVERY == 0:  # a new client: connects to both under the attack
                    fresh = SyncTransport(
                        client.sync.endpoints, client.sync.creds, 30.0, client.sync.liveness
                    )
                    try:
                        results = fresh.call_many([Call(0, "stats", {}), Call(INDEX, "stats", {})])
                    finally:
                        fresh.close()
                    failures += [
                        f"round {i}: a fresh client: {r!r}" for r in results if isinstance(r, BaseException)
                    ]
            except Exception as exc:  # noqa: BLE001 - counted: the assertion below shows them all
                failures.append(f"round {i}: {type(exc).__name__}: {exc}")
            peak["shard"] = max(peak["shard"], _fds(shard["pid"]))
            peak["index"] = max(peak["index"], _fds(index["pid"]))
    finally:
        reports = [_stop(proc) for proc in attackers]
    print(f"{who}: attackers {reports}; descriptors before {base}, peak {peak}; failures {len(failures)}")
    assert all(r["exit"] == 0 and r["opened"] >= HOLD for r in reports), reports
    assert failures == [], f"{len(failures)} of {ROUNDS} rounds failed: {failures[:5]}"
    cap = 0 if who == "nobody" else unix.max_unauthenticated()
    for what in ("shard", "index"):
        assert peak[what] <= base[what] + cap + SLACK_FDS, (
            f"the {what}'s descriptors grew from {base[what]} to {peak[what]} under the flood"
        )
    for what, proc_pid in (("shard", shard["pid"]), ("index", index["pid"])):  # and they come back
        wait_for(lambda p=proc_pid, w=what: _fds(p) <= base[w] + SLACK_FDS, 30, f"the {what}'s descriptors")
    assert torch.equal(dp.kv_batch_get(keys, pid)["x"], x + ROUNDS - 1)


# ---- a segment reference longer than its file ----------------------------------------------------------


def _read_past_the_end() -> None:
    """In a process of its own: a get whose shard reply names 16 MiB of a 64 KiB segment file.

    The file and the generation table are real memfds of this process, mapped back through
    ``/proc/<pid>/fd`` as a client maps a shard's; the reply goes through the wire encoding. Prints
    what the get raised (a mapping past the end of the file would kill this process with SIGBUS
    when the rows are copied out of it).
    """
    import numpy as np

    from dataplane.client import ops
    from dataplane.client.mappings import ShardMemory
    from dataplane.client.sharding import HashPlacement
    from dataplane.codec.columns import encode_fields
    from dataplane.server.shard.segments import GenTable, ShmFile
    from dataplane.wire import frames as _wire
    from dataplane.wire.requests import decode_result

    table = GenTable(slots=4)
    seg = ShmFile.create(7, 1 << 16)
    seg.slot = table.take()
    seg.gen = table.new_generation(seg.slot)
    memory = ShardMemory([os.getpid()], [table.ref()])
    route = ops.Route(
        placement=HashPlacement(1), shm=[True], memory=memory, shm_min_bytes=0,
        commit_within_s=60.0, rpc_timeout_s=5.0,
    )  # fmt: skip
    rows = 4
    spec = encode_fields({"x": torch.zeros(rows, 1 << 18)}, rows)["x"].spec  # 1 MiB a row
    ref = seg.ref()
    ref[2] = 16 << 20  # the lie: the file holds 64 KiB
    frames: list[Any] = []
    entry = {
        "t": "s",
        "segs": [[ref, rows << 20, rows, -1, False, _wire.spec_to_wire(spec), -1]],
        "seg": _wire.array_to_wire(np.zeros(rows, np.int64), frames),
        "row": _wire.array_to_wire(np.arange(rows, dtype=np.int64), frames),
    }
    reply = [
        bytes(memoryview(f)) for f in _wire.encode_reply(1, {"fields": {"x": entry}, "version": 1}, frames)
    ]
    op = ops.get(route, ["a", "b", "c", "d"], "p", ["x"], copy=True)
    next(op)
    try:
        op.send([decode_result(reply)[1]])
        print(json.dumps({"raised": None}))
    except StopIteration:
        print(json.dumps({"raised": None}))
    except Exception as exc:  # noqa: BLE001 - reported to the test, which checks it
        print(json.dumps({"raised": type(exc).__name__, "message": str(exc)}))


def test_a_segment_reference_past_the_end_of_its_file_is_a_typed_error_not_sigbus() -> None:
    code = "from tests.dataplane.test_hostile_local_peers import _read_past_the_end; _read_past_the_end()"
    proc = run_python(["-c", code], timeout=120, cwd=ROOT)
    assert proc.returncode == 0, f"the reader died (exit {proc.returncode}): {proc.stderr[-2000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["raised"] == "WireError", out
    assert f"named {16 << 20} bytes" in out["message"] and f"holds {1 << 16}" in out["message"], out
