"""The shard's process side: a Ray actor holding a ``ShardCore`` served by a ``ZmqServer`` thread.

The actor's Ray methods are used only to start, describe and stop the shard; every KV operation
reaches it over zmq, on sockets that admit only the store's own peers (``_auth``). Runs on the
shard's node.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from dataplane._auth import Credentials
from dataplane._liveness import process_start
from dataplane._segments import boot_id
from dataplane._server import ZmqServer
from dataplane._shard import ShardCore


class ShardActor:
    """A storage shard (wrapped with ``ray.remote`` by ``_service``; never built by user code)."""

    def __init__(self, shard_id: int, capacity_bytes: int | None, cfg: dict[str, Any], creds: dict) -> None:
        import ray

        self.core = ShardCore(
            shard_id,
            capacity_bytes,
            warm_idle_s=cfg["warm_idle_s"],
            warm_retain_bytes=cfg["warm_retain_bytes"],
            reservation_timeout_s=cfg["reservation_timeout_s"],
            name=cfg["name"],
        )
        self._lock = threading.Lock()
        ip = ray.util.get_node_ip_address()
        self._node_id = ray.get_runtime_context().get_node_id()
        limit = cfg["max_message_bytes"]
        if capacity_bytes is not None:  # no frame can be larger than what the shard may hold
            limit = min(limit, capacity_bytes + (1 << 20))
        self.server = ZmqServer(
            self.core.handle,
            ip,
            f"{cfg['name']}-shard{shard_id}",
            Credentials.from_dict(creds),
            tick=self.core.tick,
            lock=self._lock,
            max_message_bytes=limit,
        ).start()

    def info(self) -> dict[str, Any]:
        return {
            "shard": self.core.shard_id,
            "pid": os.getpid(),
            "pid_start": process_start(os.getpid()),
            "node_id": self._node_id,
            "boot_id": boot_id(),
            "tcp": self.server.tcp,
            "ipc": self.server.ipc,
            "generations": self.core.pool.table.ref(),  # also the probe: can a client map our files?
        }

    def ping(self) -> bool:
        return True

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return self.core.stats()

    def shutdown(self) -> bool:
        self.server.stop()
        with self._lock:
            self.core.close()
        return True


__all__ = ["ShardActor"]
