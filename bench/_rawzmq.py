"""The raw pyzmq reference of the bypass benchmark: the store path's bytes sent over one bare zmq stream.

Two Ray actors (``ZmqPeer``): a receiver that binds a ``PULL`` socket on its node's IP and a sender
that connects a ``PUSH`` socket to it (tcp, even on one host: what crosses between nodes). Per point
the sender preallocates one buffer per message the store path sends over the wire in a step (one
per producer put, one per consumer get, one per consumer write-back: same sizes, same count), so a
timed transfer is only ``send(copy=False)`` on one side and ``recv(copy=False)`` on the other. No
framing, no metadata, no copies in Python: the fastest one stream of these bytes goes, which is
the limit the store path's zmq transport is measured against.

Used by ``bench.bypass`` (driver) and run in two actors.
"""

from __future__ import annotations

import time
from typing import Any


class RawZmqTimeout(TimeoutError):
    """A raw zmq transfer did not finish within its deadline: names the side, the endpoint and the wait.

    Recoverable only by rerunning: the peer is gone or the link is far slower than the deadline allows.
    """

    def __init__(self, side: str, endpoint: str, timeout_s: float, done: int, total: int) -> None:
        super().__init__(
            f"raw zmq {side} on {endpoint}: {done} of {total} messages after {timeout_s:.0f} s; "
            "check the link between the two nodes or raise --call-timeout-s"
        )
        self.side, self.endpoint, self.timeout_s, self.done, self.total = (
            side,
            endpoint,
            timeout_s,
            done,
            total,
        )

    def __reduce__(self) -> tuple:
        return (RawZmqTimeout, (self.side, self.endpoint, self.timeout_s, self.done, self.total))


class ZmqPeer:
    """Actor body: one end of the raw stream. Wrap with ``ray.remote(ZmqPeer)`` to create one.

    Example:
        >>> rx, tx = Peer.remote(), Peer.remote()
        >>> endpoint = ray.get(rx.bind.remote())
        >>> ray.get(tx.connect.remote(endpoint)); ray.get(tx.prepare.remote([2**20] * 4))
        >>> ray.get([rx.receive.remote(4, 60.0), tx.send.remote(60.0)])
        [4194304, 4194304]
    """

    def __init__(self) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.sock: Any = None
        self.endpoint = ""
        self.frames: list[Any] = []

    def bind(self) -> str:
        """Bind a PULL socket on this node's IP, any port; return its endpoint."""
        import ray
        import zmq

        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        ip = ray.util.get_node_ip_address()
        port = self.sock.bind_to_random_port(f"tcp://{ip}")
        self.endpoint = f"tcp://{ip}:{port}"
        return self.endpoint

    def connect(self, endpoint: str) -> None:
        """Connect a PUSH socket to the receiver's endpoint."""
        import zmq

        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.endpoint = endpoint

    def prepare(self, sizes: list[int]) -> int:
        """Allocate (and touch, so no page fault is timed) one buffer per message; return total bytes."""
        import numpy as np

        self.frames = [np.ones(size, dtype=np.uint8) for size in sizes]
        return sum(sizes)

    def send(self, timeout_s: float) -> int:
        """Send every prepared buffer as one message, zero-copy; return the bytes sent."""
        import zmq

        self.sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        trackers = []
        for i, frame in enumerate(self.frames):
            try:
                trackers.append(self.sock.send(frame, copy=False, track=True))
            except zmq.Again:
                raise RawZmqTimeout("sender", self.endpoint, timeout_s, i, len(self.frames)) from None
        # The buffers must outlive the transfer: wait until zmq let go of the last one.
        deadline = time.monotonic() + timeout_s
        for i, tracker in enumerate(trackers):
            try:
                tracker.wait(max(0.0, deadline - time.monotonic()))
            except zmq.NotDone:
                raise RawZmqTimeout("sender", self.endpoint, timeout_s, i, len(trackers)) from None
        return sum(f.nbytes for f in self.frames)

    def receive(self, count: int, timeout_s: float) -> int:
        """Receive ``count`` messages without copying them into Python objects; return the bytes."""
        import zmq

        deadline = time.monotonic() + timeout_s
        total = 0
        for i in range(count):
            left_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            if not self.sock.poll(left_ms, zmq.POLLIN):
                raise RawZmqTimeout("receiver", self.endpoint, timeout_s, i, count)
            total += len(self.sock.recv(copy=False))
        return total

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        self.frames = []
        self.ctx.term()


class RawZmq:
    """Driver-side handle: a receiver and a sender placed on two given nodes (or this one).

    Example:
        >>> raw = RawZmq(src_node_id, dst_node_id, timeout_s=300)
        >>> raw.prepare([64 * 2**20] * 3)
        >>> seconds = raw.transfer()
        >>> raw.close()
    """

    def __init__(self, src_node: str | None, dst_node: str | None, timeout_s: float) -> None:
        import ray

        self.timeout_s = timeout_s
        peer = ray.remote(ZmqPeer)
        self.rx = peer.options(num_cpus=0.01, scheduling_strategy=_on(dst_node)).remote()
        self.tx = peer.options(num_cpus=0.01, scheduling_strategy=_on(src_node)).remote()
        endpoint = ray.get(self.rx.bind.remote(), timeout=timeout_s)
        ray.get(self.tx.connect.remote(endpoint), timeout=timeout_s)
        self.endpoint = endpoint
        self.count = 0

    def prepare(self, sizes: list[int]) -> int:
        """Preallocate the sender's messages for the next transfers; returns their total bytes."""
        import ray

        self.count = len(sizes)
        return ray.get(self.tx.prepare.remote(sizes), timeout=self.timeout_s)

    def transfer(self) -> float:
        """One timed transfer of every prepared message; seconds from the driver, both calls included."""
        import ray

        start = time.perf_counter()
        got, sent = ray.get(
            [self.rx.receive.remote(self.count, self.timeout_s), self.tx.send.remote(self.timeout_s)],
            timeout=self.timeout_s + 10,
        )
        seconds = time.perf_counter() - start
        if got != sent:
            raise RuntimeError(f"raw zmq on {self.endpoint}: received {got} bytes of {sent} sent")
        return seconds

    def close(self) -> None:
        import ray

        for actor in (self.tx, self.rx):
            try:
                ray.get(actor.close.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - tearing down; the actor is killed next either way
                pass
            ray.kill(actor)


def _on(node_id: str | None) -> Any:
    if node_id is None:
        return None
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
