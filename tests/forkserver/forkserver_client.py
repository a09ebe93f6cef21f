"""The requesting side of the fork server's protocol (``server.py`` describes it): what a
process that wants a worker forked does. Kept to a few standard-library imports because every Ray
worker of the test clusters starts by running it (``worker_start.py``), in a new interpreter
each time: some 300 a run."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct

ZYGOTE = "RLT_ZYGOTE"  # the environment variable naming the session's server (tests/conftest.py)


def recv_exactly(conn: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``conn``; ConnectionError if the peer closes first."""
    data = bytearray()
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        data += chunk
    return bytes(data)


def request(
    path: str, argv: list[str], env: dict, cwd: str, fds: list[int], ray_worker: bool = False
) -> tuple[socket.socket, int] | None:
    """Ask the server at ``path`` to run ``python ARGV`` with these streams (``ray_worker``: Ray's
    worker, forked by a Ray server); its connection and the new process's pid, or None when there is
    no server or it says to exec instead."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        body = json.dumps({"argv": argv, "env": env, "cwd": cwd, "ray": ray_worker}).encode()
        socket.send_fds(conn, [struct.pack(">Q", len(body))], fds)
        conn.sendall(body)
        pid = struct.unpack(">i", recv_exactly(conn, 4))[0]
    except (OSError, ConnectionError):
        conn.close()
        return None
    if pid == 0:
        conn.close()
        return None
    return conn, pid


def status(conn: socket.socket) -> int:
    """The process's exit status, sent when it is gone (1 if the server went first)."""
    try:
        return struct.unpack(">i", recv_exactly(conn, 4))[0]
    except (OSError, ConnectionError):
        return 1
    finally:
        conn.close()


def request_worker(path: str, argv: list[str]) -> int | None:
    """In the starter: have the server run ``argv`` (Ray's worker) as this process would; its exit
    status (128 + a signal's number, as a shell reports it), or None if the caller is to exec it."""
    started = request(path, argv, dict(os.environ), os.getcwd(), [0, 1, 2], ray_worker=True)
    if started is None:
        return None
    conn, pid = started
    # The streams are the worker's now; this process waits, passing on the signals a raylet sends the
    # process it started.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: os.kill(pid, signum))
    code = status(conn)
    return code if code >= 0 else 128 - code
