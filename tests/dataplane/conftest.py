"""Fixtures for the store tests: one store service per test module, clients per transport."""

from __future__ import annotations

import contextlib
import os
import time
import uuid

import pytest


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll ``predicate`` until it returns a truthy value, or fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def thread_files(pid: int, name: str) -> dict[str, str]:
    """The text of ``/proc/PID/task/TID/<name>`` (``stat``, ``schedstat``, ...) per thread id of process
    ``pid``; {} when it is gone (a thread that ends meanwhile is left out)."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    texts = {}
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/{name}", "rb") as f:
                texts[tid] = f.read().decode(errors="replace")
        except OSError:  # a thread that ended meanwhile
            continue
    return texts


def thread_states(pid: int) -> list[str]:
    """The state letter (R, S, D, T, Z, ...) of each thread of process ``pid``; [] when it is gone."""
    return [stat[stat.rfind(")") + 2] for stat in thread_files(pid, "stat").values()]


def process_exited(pid: int) -> bool:
    """Whether every thread of process ``pid`` has exited, so the kernel has closed its sockets.

    Not the same as ``liveness.process_start(pid) == ""``, which is true as soon as the main thread is
    a zombie: the other threads of a killed process may still be exiting then (slowly, on a loaded
    machine), and its sockets stay open (a connect and a write to them succeed) until the last is done.
    """
    return all(state in "ZX" for state in thread_states(pid))


@pytest.fixture
def pid() -> str:
    """A partition id of its own for each test."""
    return f"p-{uuid.uuid4().hex[:8]}"


def start_store(**options):
    """Start a service owned by the test (not by ``dp``), so clients can attach and detach freely."""
    from dataplane.config import StoreConfig
    from dataplane.service.launch import start_service

    cfg = StoreConfig.from_options(**options)
    registry, handle = start_service(cfg)
    return cfg, registry, handle


def store_fixtures(name: str, transports: list[str] | None = None, **options):
    """A module-scoped ``store`` fixture (a store of the module's own) and an ``attached`` one (this
    process attached to it for one test): ``store, attached = store_fixtures("t-x", num_shards=2)``.
    With ``transports`` (e.g. ``["shm", "zmq"]``) each test using ``attached`` runs once per
    transport, and ``attached`` yields the transport."""
    import dataplane as dp

    @pytest.fixture(scope="module")
    def store(ray_cluster):
        dp.close()
        cfg, registry, handle = start_store(name=name, **options)
        yield cfg
        dp.close()
        handle.stop()

    @pytest.fixture(params=transports or [None])
    def attached(store, request):
        dp.close()  # a test before may have attached to a store of its own
        if request.param is None:
            dp.init(name=name)
            yield store
        else:
            dp.init(name=name, transport=request.param)
            yield request.param
        dp.close()

    return store, attached


@contextlib.contextmanager
def own_store(name: str, **options):
    """A store of the test's own (its own options), this process attached to it; stopped at the end."""
    import dataplane as dp

    dp.close()
    cfg, registry, handle = start_store(name=name, **options)
    try:
        dp.init(name=name)
        yield cfg, registry
    finally:
        dp.close()
        handle.stop()


def keys_on_shards(pid: str, num_shards: int, prefix: str = "k") -> list[str]:
    """One key per shard of partition ``pid``: ``result[i]`` is placed on shard ``i``."""
    from dataplane.client.sharding import HashPlacement

    placement, found, i = HashPlacement(num_shards), {}, 0
    while len(found) < num_shards:
        found.setdefault(placement.shard_of(pid, f"{prefix}{i}"), f"{prefix}{i}")
        i += 1
    return [found[s] for s in range(num_shards)]


def raw_socket(
    registry: dict, target: str = "index", authenticated: bool = True, password: str | None = None
):
    """A raw zmq DEALER connected to a store actor's ipc endpoint, as any local process could open one.

    ``target`` is "index" or a shard number. With ``authenticated`` it presents the store's
    credentials (from the registry, as a client that attached through Ray would); ``password``
    presents that PLAIN password instead; neither means no credentials at all.
    """
    import zmq

    from dataplane.transport.auth import Credentials, secure_client

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if authenticated:
        secure_client(sock, Credentials.from_dict(registry["credentials"]), curve=False)
    elif password is not None:
        sock.plain_username = b"dataplane"
        sock.plain_password = password.encode()
    actor = registry["index"] if target == "index" else registry["shards"][int(target)]
    sock.connect(actor["ipc"])
    return sock


class UnixDealer:
    """A raw Unix-lane connection (``transport.unix``) with the few DEALER methods the raw-socket tests use,
    so one test body can check a service's answers over zmq and over the Unix lane alike."""

    def __init__(self, address: str, secret: str) -> None:
        from collections import deque

        from dataplane.transport import unix

        self.conn = unix.connect(address, secret, max_frames=1 << 20, max_bytes=-1)
        self.inbox: deque = deque()

    def send_multipart(self, frames, copy: bool = True, flags: int = 0) -> None:
        assert self.conn.send_all(list(frames), time.monotonic() + 30), "the service closed the connection"

    def poll(self, timeout: int | None = None, flags: int = 1) -> int:
        from dataplane.transport import unix

        deadline = time.monotonic() + (timeout if timeout is not None else 1e9) / 1000
        while not self.inbox and not self.conn.closed:
            left = deadline - time.monotonic()
            if left <= 0 or not self.conn.wait(max(0, int(left * 1000))):
                break
            try:
                self.inbox.extend(self.conn.read())
            except unix.ConnectionClosed:
                self.conn.close()
        return 1 if self.inbox else 0

    def recv_multipart(self, flags: int = 0, copy: bool = True) -> list[bytes]:
        import zmq

        if not self.poll(0 if flags & zmq.NOBLOCK else None):
            raise zmq.Again()
        return [bytes(f) for f in self.inbox.popleft()]

    def close(self, linger: int = 0) -> None:
        self.conn.close()


def raw_unix_socket(registry: dict, target: str = "index") -> UnixDealer:
    """``raw_socket``'s counterpart on the Unix lane, authenticated with the store's secret."""
    actor = registry["index"] if target == "index" else registry["shards"][int(target)]
    return UnixDealer(actor["unix"], registry["credentials"]["secret"])


def request(sock, op: str, body: dict, frames=(), rid: int = 7, timeout_ms: int = 10_000):
    """Send one request on a raw socket; the reply header (its body raw, read by ``wire.requests.reply``)
    and frames, or None if no reply came."""
    from dataplane.wire import frames as _wire

    sock.send_multipart(_wire.encode_request(rid, op, body, list(frames)))
    if not sock.poll(timeout_ms):
        return None
    return _wire.decode_raw_reply(sock.recv_multipart())


def held_after_first_step(job, started, gate):
    """``job`` (``server.jobs``) run one step, then waiting on ``gate`` (a Future: its server's loop
    serves everyone else meanwhile), then run to its end; ``started`` is set after the first step."""
    step = next(job)
    started.set()
    yield gate
    yield step
    return (yield from job)
