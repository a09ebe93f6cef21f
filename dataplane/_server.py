"""A zmq ROUTER loop on its own thread, serving a plain handler (the shard's socket side).

The loop answers every request it can parse, success or error, echoing the request id; a
foreign or undecodable message gets an error reply when it carries an identity, and the loop never
dies of a handler exception. It listens on tcp (other hosts) and on an abstract-namespace ipc
socket (same host; nothing is left in the file system, even after a crash). Polls are bounded, so
``stop()`` returns within one poll interval, and ``tick`` runs between requests.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from dataplane import _wire

logger = logging.getLogger(__name__)

Handler = Callable[[str, dict[str, Any], list[memoryview]], tuple[dict[str, Any], list[Any]]]

POLL_MS = 100
TICK_S = 0.25


class ZmqServer:
    """Serves ``handler`` on a ROUTER socket from a daemon thread."""

    def __init__(
        self,
        handler: Handler,
        host_ip: str,
        name: str,
        tick: Callable[[], None] | None = None,
        lock: threading.Lock | None = None,
        max_frames: int | None = None,
    ) -> None:
        self._handler = handler
        self._tick = tick
        self._lock = lock or threading.Lock()
        self._max_frames = max_frames
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host_ip}")
        self.tcp = f"tcp://{host_ip}:{port}"
        self.ipc = f"ipc://@{name}-{uuid.uuid4().hex[:12]}"
        self._sock.bind(self.ipc)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-server", daemon=True)

    def start(self) -> ZmqServer:
        self._thread.start()
        return self

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        last_tick = time.monotonic()
        while not self._stop.is_set():
            if poller.poll(POLL_MS):
                while True:
                    try:
                        msg = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._serve_one(msg)
            now = time.monotonic()
            if self._tick is not None and now - last_tick >= TICK_S:
                last_tick = now
                with self._lock:
                    try:
                        self._tick()
                    except Exception:  # noqa: BLE001 - housekeeping must never kill the loop
                        logger.exception("server tick failed")
        self._sock.close(linger=0)

    def _serve_one(self, msg: list[Any]) -> None:
        if len(msg) < 2:
            return
        rid, reply = _wire.answer(msg[1:], self._locked_handler, max_frames=self._max_frames)
        try:
            self._sock.send_multipart([msg[0], *reply], copy=False)
        except zmq.ZMQError as exc:
            logger.warning("could not send reply %d: %s", rid, exc)

    def _locked_handler(
        self, op: str, body: dict[str, Any], bufs: list[memoryview]
    ) -> tuple[dict[str, Any], list[Any]]:
        with self._lock:
            return self._handler(op, body, bufs)

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)


__all__ = ["ZmqServer"]
