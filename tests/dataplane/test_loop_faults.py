"""A server loop cannot die: an exception in any step of it is logged, the request it concerns is
answered with a typed error, and the loop serves on.

No Ray: the index's and a shard's servers run here on their own threads, as their actors run them
(the shard linked to the index, so its one-round-trip puts commit there), and the peers are raw
authenticated zmq sockets. An exception in these steps cannot be caused from outside (the wire
refuses every value that could raise one, ``test_hostile_numbers.py``), so each test injects one by
replacing the step with one that raises once (or, for the poll timeout, every time).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest
import zmq

from dataplane.server.index.actor import IndexServer
from dataplane.server.index.core import IndexCore
from dataplane.server.router import FREEZE_S
from dataplane.server.shard import actor as shard_actor
from dataplane.server.shard.actor import ShardServer
from dataplane.server.shard.core import ATTACH_SLICE, ShardCore
from dataplane.transport.auth import Credentials, secure_client
from dataplane.transport.liveness import process_start
from dataplane.transport.locality import Locality
from dataplane.wire import frames as _wire
from dataplane.wire import protocol as _protocol
from dataplane.wire.requests import INDEX, reply

from .conftest import held_after_first_step, wait_for

REPLY_MS = 10_000  # a reply that must come; a missing one fails the test, never hangs it
WAIT_S = 0.3  # the timeout of a parked ``next`` that must end in BatchTimeoutError
_rids = itertools.count(1)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)  # closes the test's sockets too, also those a failed assert still holds


@pytest.fixture
def creds() -> Credentials:
    return Credentials.new(encrypt=False)


@contextlib.contextmanager
def _serving(server: Any) -> Iterator[Any]:
    server.start()
    try:
        yield server
    finally:
        server.stop()
        if not server._ctx.closed:  # its loop died (what these tests look for): close what it left,
            server._ctx.destroy(linger=0)  # or the context's finaliser would wait for it at exit
        if isinstance(server, ShardServer):
            server.core.close()


@pytest.fixture
def index(creds) -> Iterator[IndexServer]:
    with _serving(IndexServer(IndexCore(), "127.0.0.1", f"lf-index-{uuid.uuid4().hex[:6]}", creds)) as server:
        yield server


def _shard(creds: Credentials, index: IndexServer, lane: bool) -> ShardServer:
    name = f"lf-shard-{uuid.uuid4().hex[:6]}"
    core = ShardCore(0, capacity_bytes=1 << 20, name=f"{name}-{os.getpid()}")
    server = ShardServer(core, "127.0.0.1", name, creds, rpc_timeout_s=10.0, lock=threading.Lock())
    me = os.getpid()
    server.link(
        {
            "name": index.name,
            "locality": Locality.here().to_dict(),
            "ipc": index.ipc,
            "tcp": index.tcp,
            "unix": index.unix if lane else None,  # None: the link is a zmq DEALER
            "pid": me,
            "pid_start": process_start(me),
        }
    )
    # The link takes the lane exactly when one is offered (the entry says the index is on this host).
    assert server._link is not None and (server._link.endpoints[INDEX].unix is not None) == lane
    return server


@pytest.fixture(params=["unix-link", "zmq-link"])
def shard(request, creds, index) -> Iterator[ShardServer]:
    with _serving(_shard(creds, index, lane=request.param == "unix-link")) as server:
        yield server


def _dealer(ctx: zmq.Context, creds: Credentials, server: Any) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_client(sock, creds.for_clients(), curve=False)
    sock.connect(server.ipc)
    return sock


def _ask(sock: zmq.Socket, op: str, body: dict, frames: list | None = None) -> _wire.RawReply:
    """One request; its reply header, the body raw as a client receives it (a reply to an earlier
    request is skipped), within the deadline."""
    rid = next(_rids)
    sock.send_multipart(_wire.encode_request(rid, op, body, frames or []))
    while True:
        assert sock.poll(REPLY_MS), f"no reply to {op!r} within {REPLY_MS} ms: the server stopped serving"
        rep = _wire.decode_raw_reply(sock.recv_multipart())[0]
        if rep.rid == rid:
            return rep


def _fault(monkeypatch, owner: Any, name: str, times: int = 1) -> list[int]:
    """Make ``owner.name`` raise ``RuntimeError`` on its next ``times`` calls, then behave again;
    returns the count of faults still to come (``[0]`` once all were raised)."""
    original = getattr(owner, name)
    left = [times]

    def faulty(*args: Any, **kwargs: Any) -> Any:
        if left[0] > 0:
            left[0] -= 1
            raise RuntimeError(f"injected fault in {name}")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, faulty)
    return left


def _fired(left: list[int]) -> None:
    wait_for(lambda: left[0] == 0, REPLY_MS / 1000, "the injected fault to be raised")


# ---- the index --------------------------------------------------------------------------------


def _next(pid: str, timeout_s: float = WAIT_S) -> dict:
    return {"partition": pid, "task": "t", "batch_size": 2, "fields": ["x"], "timeout_s": timeout_s}


def _index_serves(sock: zmq.Socket) -> None:
    """The index answers at once, parks a request and times it out, and hands out ready rows."""
    assert _ask(sock, "stats", {}).error is None
    pid = f"p-{uuid.uuid4().hex[:6]}"
    assert _ask(sock, "commit", {"partition": pid, "keys": ["a"], "fields": ["x"]}).error is None
    rep = _ask(sock, "next", _next(pid))
    assert rep.error is not None and rep.error[0] == "BatchTimeoutError", rep
    assert _ask(sock, "commit", {"partition": pid, "keys": ["b"], "fields": ["x"]}).error is None
    rep = _ask(sock, "next", _next(pid))
    assert rep.error is None and sorted(reply(rep.body, _protocol.BatchReply).keys) == ["a", "b"], rep


def test_an_index_handler_that_raises_gets_its_request_a_typed_error(index, ctx, creds, monkeypatch):
    sock = _dealer(ctx, creds, index)
    left = _fault(monkeypatch, index.core, "op_list")
    rep = _ask(sock, "list", {"partition": None})
    assert rep.error is not None and rep.error[0] == "DataplaneError", rep
    assert "RuntimeError" in rep.error[1] and "injected" in rep.error[1], rep.error
    assert left == [0]
    left = _fault(monkeypatch, index.core, "op_next")  # a waiting op, run by the server's own code
    rep = _ask(sock, "next", _next("nowhere"))
    assert rep.error is not None and "injected" in rep.error[1], rep
    _index_serves(sock)


def test_the_index_serves_on_while_its_poll_timeout_raises(index, ctx, creds, monkeypatch):
    """Every computation of the poll timeout raises (the old loop died at the first, with every later
    call timing out): requests are still answered, and parked ones still time out."""
    sock = _dealer(ctx, creds, index)
    left = _fault(monkeypatch, index, "poll_timeout_ms", times=10**9)
    wait_for(lambda: left[0] < 10**9, REPLY_MS / 1000, "the poll timeout to be computed")
    _index_serves(sock)
    assert left[0] < 10**9 - 1, "the loop stopped computing its poll timeout"


def test_the_index_serves_on_after_its_after_poll_timers_raise(index, ctx, creds, monkeypatch):
    sock = _dealer(ctx, creds, index)
    _fired(_fault(monkeypatch, index, "after_poll"))
    _index_serves(sock)


def test_a_deadline_that_fails_to_expire_is_answered_with_the_error(index, ctx, creds, monkeypatch):
    """Timing out a parked request raises: that request gets a typed error, the others are served."""
    sock = _dealer(ctx, creds, index)
    left = _fault(monkeypatch, index.core, "timeout_error")
    rep = _ask(sock, "next", _next("nowhere"))
    assert left == [0]
    assert rep.error is not None and rep.error[0] == "DataplaneError", rep
    assert "deadline" in rep.error[1] and "injected" in rep.error[1], rep.error
    _index_serves(sock)


# ---- a shard and its link to the index --------------------------------------------------------


def _put_ready(sock: zmq.Socket, pid: str, key: str) -> _wire.RawReply:
    spec = ["dense", "float32", [2]]
    col = {"spec": spec, "rows": 1, "data": 0}
    body = {
        "partition": pid,
        "keys": [key],
        "fields": {"x": {"spec": spec, "nbytes": 8, "col": col}},
        "tags": None,
    }
    return _ask(sock, "put_ready", body, [np.ones(2, dtype=np.float32).tobytes()])


def _shard_serves(sock: zmq.Socket, index_sock: zmq.Socket) -> None:
    """The shard stores a one-round-trip put and the index makes it ready."""
    assert _ask(sock, "stats", {}).error is None
    pid = f"p-{uuid.uuid4().hex[:6]}"
    rep = _put_ready(sock, pid, "k")
    assert rep.error is None and _index_error(rep) is None, rep
    assert _listed(index_sock, pid) == {pid: {"k": {}}}


def _used(sock: zmq.Socket) -> int:
    return reply(_ask(sock, "stats", {}).body, _protocol.ShardStatsReply).bytes_used


def _listed(index_sock: zmq.Socket, pid: str) -> dict[str, dict[str, Any]]:
    return reply(_ask(index_sock, "list", {"partition": pid}).body, _protocol.ListReply).list


def _index_error(rep: _wire.RawReply) -> list[Any] | None:
    """Why a ``put_ready`` stored its rows without knowing whether the index recorded them (None: it did)."""
    return reply(rep.body, _protocol.PutReadyReply).index_error


def test_a_shard_handler_or_tick_that_raises_does_not_stop_the_shard(shard, index, ctx, creds, monkeypatch):
    sock, index_sock = _dealer(ctx, creds, shard), _dealer(ctx, creds, index)
    _fault(monkeypatch, shard.core, "op_stats")
    rep = _ask(sock, "stats", {})
    assert rep.error is not None and "injected" in rep.error[1], rep
    _fired(_fault(monkeypatch, shard, "_tick"))
    _fired(_fault(monkeypatch, shard, "after_poll"))
    _fired(_fault(monkeypatch, shard, "poll_timeout_ms"))
    _shard_serves(sock, index_sock)


def test_a_commit_that_fails_to_reach_the_index_is_refused_and_taken_back(
    shard, index, ctx, creds, monkeypatch
):
    sock, index_sock = _dealer(ctx, creds, shard), _dealer(ctx, creds, index)
    used = _used(sock)
    _fault(monkeypatch, shard, "_index_socket")
    rep = _put_ready(sock, "refused", "k")
    assert rep.error is not None and "injected" in rep.error[1], rep
    assert _used(sock) == used, "a put the index never saw kept its rows"
    assert _listed(index_sock, "refused") == {}
    _shard_serves(sock, index_sock)


@pytest.mark.parametrize("step", ["_check_sent", "_settle"])
def test_a_failure_with_a_commit_in_flight_answers_its_writer(shard, index, ctx, creds, monkeypatch, step):
    """The timer over the commits in flight, or the handling of the index's answer, raises: the writer
    is told at once that its rows are stored but may not be ready (not left to its own deadline)."""
    sock, index_sock = _dealer(ctx, creds, shard), _dealer(ctx, creds, index)
    left = _fault(monkeypatch, shard, step)
    rep = _put_ready(sock, "in-flight", "k")
    assert left == [0], f"{step} was not reached"
    assert rep.error is None and _index_error(rep) is not None, rep
    assert "injected" in _index_error(rep)[1], rep
    _shard_serves(sock, index_sock)


def test_a_link_whose_reply_cannot_be_read_answers_its_writer(creds, index, ctx, monkeypatch):
    """Reading the index's reply raises (zmq link): the writers in flight are told, the link is
    opened afresh, and the next put commits."""
    with _serving(_shard(creds, index, lane=False)) as shard:
        sock, index_sock = _dealer(ctx, creds, shard), _dealer(ctx, creds, index)
        left = _fault(monkeypatch, shard_actor, "recv_frames")
        rep = _put_ready(sock, "unread", "k")
        assert left == [0]
        assert rep.error is None and _index_error(rep) is not None, rep
        assert "injected" in _index_error(rep)[1], rep
        _shard_serves(sock, index_sock)


def test_a_big_put_is_stored_in_slices_with_other_requests_answered_between(
    shard, index, ctx, creds, monkeypatch
):
    """A big put is stored a slice per step; held after its first slice (by a gate the job waits on,
    the loop free), a 1-row put sent meanwhile is stored and made ready at once; the big one then
    stores every row and the index records every key."""
    started, gate = threading.Event(), Future()
    real = shard.core.job_put_ready

    def gated(body: Any, bufs: Any) -> Any:
        job = real(body, bufs)
        return held_after_first_step(job, started, gate) if body.partition == "big" else job

    monkeypatch.setattr(shard.core, "job_put_ready", gated)
    sock, index_sock = _dealer(ctx, creds, shard), _dealer(ctx, creds, index)
    n = 3 * ATTACH_SLICE
    spec = ["dense", "float32", [2]]
    keys = [f"b{i}" for i in range(n)]
    big = {
        "partition": "big",
        "keys": keys,
        "fields": {"x": {"spec": spec, "nbytes": 8 * n, "col": {"spec": spec, "rows": n, "data": 0}}},
        "tags": None,
    }
    rid = next(_rids)
    try:
        sock.send_multipart(
            _wire.encode_request(rid, "put_ready", big, [np.ones(2 * n, dtype=np.float32).tobytes()])
        )
        assert started.wait(REPLY_MS / 1000)
        assert len(shard.core.partitions["big"].rows) == ATTACH_SLICE  # one slice attached
        rep = _put_ready(sock, "small", "s")
        assert rep.error is None and _index_error(rep) is None, rep
        gate.set_result(None)
        assert sock.poll(REPLY_MS)
        rep = _wire.decode_raw_reply(sock.recv_multipart())[0]
        assert rep.rid == rid and rep.error is None and _index_error(rep) is None, rep
        assert list(_listed(index_sock, "big")["big"]) == keys
    finally:
        if not gate.done():
            gate.set_result(None)


def test_a_shard_server_keeps_what_it_holds_out_of_the_collector_s_sight(creds):
    """Every server's loop freezes its process's heap each ``FREEZE_S`` (``router.freeze_heap``):
    a full collection then scans only what came since, not a million rows' records (a shard's full
    collections grew to 18 ms a million rows in, each a stall of every request)."""
    name = f"lf-shard-{uuid.uuid4().hex[:6]}"
    core = ShardCore(0, capacity_bytes=1 << 20, name=f"{name}-{os.getpid()}")
    server = ShardServer(core, "127.0.0.1", name, creds, rpc_timeout_s=10.0, lock=threading.Lock())
    held = [[]]  # (a container the collector tracks, made before the loop runs)
    assert any(o is held for o in gc.get_objects())
    with _serving(server):
        wait_for(
            lambda: not any(o is held for o in gc.get_objects()),
            20 * FREEZE_S,
            "the shard's loop to freeze its heap",
        )
