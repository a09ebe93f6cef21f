"""The index service: partitions, keys, per-key field production status, tags, and the shard registry.

``IndexCore`` is the plain bookkeeping class; ``IndexActor`` is an async Ray actor that serves it
on a zmq ROUTER socket from a task on the actor's event loop (one thread: no locks needed) and
answers a few Ray calls used only at attach time (``info``).

Design rule, enforced in ``IndexActor._serve``: the index receives metadata only. A request that
carries any buffer frame is refused with an error, so tensor bytes can never reach it.

Placement of keys is a stable hash (``_placement``), so the index is not asked where a key lives;
it is on the path only where metadata changes (put, clear) or must be resolved (``kv_list``,
classifying a missing key).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from dataplane import _wire
from dataplane.errors import SchemaError

logger = logging.getLogger(__name__)


@dataclass
class _KeyMeta:
    tag: dict[str, Any] = field(default_factory=dict)
    fields: set[str] = field(default_factory=set)


@dataclass
class _PartMeta:
    keys: dict[str, _KeyMeta] = field(default_factory=dict)


class IndexCore:
    """Metadata bookkeeping of the store. Plain class, tested without Ray."""

    def __init__(self) -> None:
        self.partitions: dict[str, _PartMeta] = {}
        self.schemas: dict[str, dict[str, list[Any]]] = {}  # pid -> field -> wire spec
        self.registry: dict[str, Any] = {}

    def handle(self, op: str, body: dict[str, Any], bufs: list[Any]) -> tuple[dict[str, Any], list]:
        fn = getattr(self, f"op_{op}", None)
        if fn is None:
            raise _wire.WireError(f"index: unknown operation {op!r}")
        return fn(body), []

    def op_prepare(self, body: dict[str, Any]) -> dict[str, Any]:
        """Check a put's column specs against the partition's schema (``commit`` records them)."""
        pid, specs = body["pid"], body["specs"]
        schema = self.schemas.get(pid, {})
        for name, spec in specs.items():
            old = schema.get(name)
            if old is not None and old != spec:
                old_s, new_s = _wire.spec_from_wire(old), _wire.spec_from_wire(spec)
                try:
                    old_s.check_compatible(new_s, name)
                except SchemaError:
                    raise
                except Exception as exc:  # a codec that raises another type still names the field
                    raise SchemaError(name, f"field {name!r}: {exc}") from exc
        return {}

    def op_commit(self, body: dict[str, Any]) -> dict[str, Any]:
        """Record that ``keys`` now hold ``fields`` (and merge ``tags``); returns fields and tags."""
        pid, keys, fields, tags = body["pid"], body["keys"], body.get("fields") or [], body.get("tags")
        part = self.partitions.setdefault(pid, _PartMeta())
        schema = self.schemas.setdefault(pid, {})
        for name, spec in (body.get("specs") or {}).items():
            schema.setdefault(name, spec)
        union: dict[str, None] = {}
        out_tags = []
        for i, key in enumerate(keys):
            meta = part.keys.get(key)
            if meta is None:
                meta = part.keys[key] = _KeyMeta()
            meta.fields.update(fields)
            if tags is not None and tags[i]:
                meta.tag.update(tags[i])
            out_tags.append(dict(meta.tag))
            for f in meta.fields:
                union[f] = None
        order = list(self.schemas.get(pid, {}))
        ordered = [f for f in order if f in union] + sorted(f for f in union if f not in order)
        return {"fields": ordered, "tags": out_tags}

    def op_delete(self, body: dict[str, Any]) -> dict[str, Any]:
        part = self.partitions.get(body["pid"])
        removed = 0
        if part is not None:
            for key in body["keys"]:
                removed += part.keys.pop(key, None) is not None
        return {"removed": removed}

    def op_drop(self, body: dict[str, Any]) -> dict[str, Any]:
        pid = body["pid"]
        existed = self.partitions.pop(pid, None) is not None
        self.schemas.pop(pid, None)
        return {"existed": existed}

    def op_list(self, body: dict[str, Any]) -> dict[str, Any]:
        pid = body.get("pid")
        pids = [pid] if pid is not None else list(self.partitions)
        return {
            "list": {
                p: {k: dict(m.tag) for k, m in self.partitions[p].keys.items()}
                for p in pids
                if p in self.partitions
            }
        }

    def op_resolve(self, body: dict[str, Any]) -> dict[str, Any]:
        """Which of ``keys`` the index knows, and which fields they hold (classifies a failed get)."""
        part = self.partitions.get(body["pid"])
        if part is None:
            return {"partition": False, "known": {}}
        return {
            "partition": True,
            "known": {k: sorted(part.keys[k].fields) for k in body["keys"] if k in part.keys},
        }

    def op_stats(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"partitions": {p: len(m.keys) for p, m in self.partitions.items()}}

    def op_ping(self, body: dict[str, Any]) -> dict[str, Any]:
        return {}


class IndexActor:
    """The index as an async Ray actor (wrapped with ``ray.remote`` by ``_service``)."""

    def __init__(self, name: str) -> None:
        self.core = IndexCore()
        self._name = name
        self._task: asyncio.Task | None = None
        self._sock = None
        self.tcp = self.ipc = ""

    async def start(self) -> dict[str, str]:
        import uuid

        import ray
        import zmq
        import zmq.asyncio

        self._host_ip = ray.util.get_node_ip_address()
        ctx = zmq.asyncio.Context.instance()
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{self._host_ip}")
        self.tcp = f"tcp://{self._host_ip}:{port}"
        self.ipc = f"ipc://@{self._name}-{uuid.uuid4().hex[:12]}"
        self._sock.bind(self.ipc)
        self._task = asyncio.get_running_loop().create_task(self._serve())
        from dataplane._segments import boot_id

        return {"tcp": self.tcp, "ipc": self.ipc, "boot_id": boot_id()}

    async def _serve(self) -> None:
        while True:
            msg = await self._sock.recv_multipart(copy=False)
            if len(msg) < 2:
                continue
            _, reply = _wire.answer(msg[1:], self.core.handle, max_frames=0, who="the index")
            await self._sock.send_multipart([msg[0], *reply], copy=False)

    async def register(self, registry: dict[str, Any]) -> None:
        self.core.registry = registry

    async def info(self) -> dict[str, Any]:
        return dict(self.core.registry)

    async def ready(self) -> bool:
        return True


__all__ = ["IndexActor", "IndexCore"]
