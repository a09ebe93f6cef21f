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
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

from dataplane import _auth, _protocol, _wire
from dataplane._column_types import describe_family
from dataplane.errors import SchemaError, WireError

logger = logging.getLogger(__name__)


@dataclass
class _KeyMeta:
    tag: dict[str, Any] = field(default_factory=dict)
    fields: set[str] = field(default_factory=set)


@dataclass
class _PartMeta:
    keys: dict[str, _KeyMeta] = field(default_factory=dict)


@dataclass
class _FieldSchema:
    """A field's family (kind group, dtype, dims per row; ``ColumnSpec.family``), decided by the first
    ``prepare`` that named it (first writer wins); each row's shape is free.

    ``confirmed`` once a put that relies on it commits; until then ``pending`` holds the puts
    (transaction ids) that rely on it, and the last of them to abort takes it back.
    """

    family: list[Any]
    confirmed: bool = False
    pending: set[int] = field(default_factory=set)


class IndexCore:
    """Metadata bookkeeping of the store. Plain class, tested without Ray."""

    def __init__(self) -> None:
        self.partitions: dict[str, _PartMeta] = {}
        self.schemas: dict[str, dict[str, _FieldSchema]] = {}  # pid -> field -> schema
        self.txns: dict[int, tuple[str, list[str]]] = {}  # open put -> (pid, fields it relies on)
        self._txn_ids = itertools.count(1)
        self.registry: dict[str, Any] = {}

    def handle(self, op: str, raw: Any, bufs: list[Any]) -> tuple[dict[str, Any], list]:
        """Decode ``raw`` as operation ``op``'s typed body (``_protocol``) and run the operation."""
        body = _protocol.decode_body(op, raw, _protocol.INDEX_OPS)
        return getattr(self, f"op_{op}")(body), []

    def op_prepare(self, body: _protocol.Prepare) -> dict[str, Any]:
        """Decide the schema of a put's new fields at once, or refuse it: ``SchemaError``.

        Fields already decided must match; new ones are recorded now (not at commit), so of two
        puts racing to create a field with different specs exactly one passes, whichever shards
        their keys live on. Returns the put's transaction id for ``commit`` / ``abort``.
        """
        pid = body.pid
        schema = self.schemas.get(pid, {})
        families = {}
        for name, spec in body.specs.items():
            new_s = _wire.spec_from_wire(spec)
            new_s.check(name)
            families[name] = list(new_s.family())
            old = schema.get(name)
            if old is not None and old.family != families[name]:
                raise SchemaError(
                    name,
                    f"field {name!r}: new data ({describe_family(families[name])}) does not match the stored "
                    f"column ({describe_family(old.family)}); write it with the stored dtype, or use a new "
                    "field name",
                )
        txn = next(self._txn_ids)
        schema = self.schemas.setdefault(pid, schema)
        for name in body.specs:
            entry = schema.get(name)
            if entry is None:
                entry = schema[name] = _FieldSchema(families[name])
            if not entry.confirmed:
                entry.pending.add(txn)
        self.txns[txn] = (pid, list(body.specs))
        return {"txn": txn}

    def op_abort(self, body: _protocol.IndexAbort) -> dict[str, Any]:
        """A prepared put gave up: new fields only it relied on are undecided again."""
        pid, names = self.txns.pop(body.txn, (None, []))
        schema = self.schemas.get(pid, {}) if pid is not None else {}
        for name in names:
            entry = schema.get(name)
            if entry is not None and not entry.confirmed:
                entry.pending.discard(body.txn)
                if not entry.pending:
                    del schema[name]
        if pid is not None and not schema and pid not in self.partitions:
            self.schemas.pop(pid, None)
        return {}

    def op_commit(self, body: _protocol.IndexCommit) -> dict[str, Any]:
        """Record that ``keys`` now hold ``fields`` (and merge ``tags``); returns fields and tags."""
        pid, keys, fields, tags = body.pid, _protocol.unique_keys(body.keys, "commit"), body.fields, body.tags
        if tags is not None and len(tags) != len(keys):
            raise WireError(f"commit: {len(tags)} tags for {len(keys)} keys")
        if body.txn is not None:
            owner = self.txns.get(body.txn, (pid, []))[0]
            if owner != pid:  # before changing anything: a txn confirms only its own partition
                raise WireError(f"commit: put {body.txn} was prepared for partition {owner!r}, not {pid!r}")
            _, names = self.txns.pop(body.txn, (pid, []))
            for name in names:
                entry = self.schemas.get(pid, {}).get(name)
                if entry is not None:
                    entry.confirmed, entry.pending = True, set()
        part = self.partitions.setdefault(pid, _PartMeta())
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

    def op_delete(self, body: _protocol.Delete) -> dict[str, Any]:
        part = self.partitions.get(body.pid)
        removed = 0
        if part is not None:
            for key in body.keys:
                removed += part.keys.pop(key, None) is not None
        return {"removed": removed}

    def op_drop(self, body: _protocol.Drop) -> dict[str, Any]:
        pid = body.pid
        existed = self.partitions.pop(pid, None) is not None
        self.schemas.pop(pid, None)
        return {"existed": existed}

    def op_list(self, body: _protocol.ListKeys) -> dict[str, Any]:
        pid = body.pid
        pids = [pid] if pid is not None else list(self.partitions)
        return {
            "list": {
                p: {k: dict(m.tag) for k, m in self.partitions[p].keys.items()}
                for p in pids
                if p in self.partitions
            }
        }

    def op_resolve(self, body: _protocol.Resolve) -> dict[str, Any]:
        """Which of ``keys`` the index knows, and which fields they hold (classifies a failed get)."""
        part = self.partitions.get(body.pid)
        if part is None:
            return {"partition": False, "known": {}}
        return {
            "partition": True,
            "known": {k: sorted(part.keys[k].fields) for k in body.keys if k in part.keys},
        }

    def op_stats(self, body: _protocol.Stats) -> dict[str, Any]:
        return {"partitions": {p: len(m.keys) for p, m in self.partitions.items()}}

    def op_ping(self, body: _protocol.Ping) -> dict[str, Any]:
        return {}


class IndexActor:
    """The index as an async Ray actor (wrapped with ``ray.remote`` by ``_service``).

    Its sockets are authenticated like the shards' (``_auth``): a ZAP handler task on the actor's
    own zmq context refuses any connection that does not present the store's credentials.
    """

    def __init__(self, name: str, creds: dict[str, str] | None = None, max_message_bytes: int = -1) -> None:
        self.core = IndexCore()
        self._name = name
        self._creds = _auth.Credentials.from_dict(creds or {})
        self._max_message_bytes = max_message_bytes
        self._tasks: list[asyncio.Task] = []
        self.tcp = self.ipc = ""

    async def start(self) -> dict[str, Any]:
        import os
        import uuid

        import ray
        import zmq
        import zmq.asyncio

        from dataplane._liveness import process_start
        from dataplane._segments import boot_id

        if not self._creds.secret:
            raise ValueError("the index needs the store's credentials")
        host_ip = ray.util.get_node_ip_address()
        ctx = zmq.asyncio.Context()  # its own: one ZAP handler per context
        zap = ctx.socket(zmq.REP)
        zap.setsockopt(zmq.LINGER, 0)
        zap.bind(_auth.ZAP_ENDPOINT)
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._serve_zap(zap)))

        def router(curve: bool):
            sock = ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
            _auth.secure_server(sock, self._creds, curve)
            self._tasks.append(loop.create_task(self._serve(sock)))
            return sock

        plain = router(curve=False)
        self.ipc = f"ipc://@{self._name}-{uuid.uuid4().hex[:12]}"
        plain.bind(self.ipc)
        tcp_sock = router(curve=True) if self._creds.encrypt else plain
        self.tcp = f"tcp://{host_ip}:{tcp_sock.bind_to_random_port(f'tcp://{host_ip}')}"
        pid = os.getpid()
        return {
            "tcp": self.tcp,
            "ipc": self.ipc,
            "boot_id": boot_id(),
            "pid": pid,
            "pid_start": process_start(pid),
        }

    async def _serve_zap(self, zap) -> None:
        while True:
            frames = await zap.recv_multipart()
            await zap.send_multipart(_auth.zap_reply(frames, self._creds))

    async def _serve(self, sock) -> None:
        while True:
            msg = await sock.recv_multipart(copy=False)
            if len(msg) < 2:
                continue
            _, reply = _wire.answer(msg[1:], self.core.handle, max_frames=0, who="the index")
            await sock.send_multipart([msg[0], *reply], copy=False)

    async def register(self, registry: dict[str, Any]) -> None:
        self.core.registry = registry

    async def info(self) -> dict[str, Any]:
        """The registry and the client credentials: the one way a process obtains them (a Ray call)."""
        return {**self.core.registry, "credentials": self._creds.for_clients().to_dict()}

    async def ping(self) -> bool:
        return True


__all__ = ["IndexActor", "IndexCore"]
