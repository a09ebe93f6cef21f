"""Metadata types of the data plane: ``KVBatchMeta`` (which rows of the store) and ``StoreInfo``.

A ``KVBatchMeta`` names rows in the store by key; it never carries the rows themselves. It is what
the driver holds and what ``controlplane`` dispatch chunks and concatenates, so it must stay small
and cheap to serialize: every value in it is a plain Python type (str, int, float, bool, None, and
lists / tuples / dicts of those). Tensors and arrays are refused with ``TypeError``.

    >>> meta = KVBatchMeta(["a", "b", "c"], partition_id="train", fields=["prompt"])
    >>> [m.keys for m in meta.chunk(2)]
    [['a', 'b'], ['c']]
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, SupportsIndex, cast

from dataplane.codec.plain import plain_value as _plain
from dataplane.errors import ArgumentTypeError, KeyNotFoundError


def check_partition(partition_id: object, caller: str | None = None) -> str:
    """``partition_id`` if it is a str, else ``ArgumentTypeError`` (a ``TypeError``) naming ``caller``
    and the type given.

    The one check of a partition name (``KVBatchMeta``, ``StreamingDataset.step`` and the client's
    operations all call it). A str subclass is refused too: msgpack, which carries the name to the
    store, takes only a str.

        >>> check_partition(7, "StreamingDataset.step")
        Traceback (most recent call last):
        ...
        dataplane.errors.ArgumentTypeError: StreamingDataset.step: partition_id must be a str, not int
    """
    if type(partition_id) is not str:
        where = f"{caller}: " if caller else ""
        raise ArgumentTypeError(
            "partition_id", f"{where}partition_id must be a str, not {type(partition_id).__name__}"
        )
    return partition_id


def _unique(items: Iterable[str], what: str) -> None:
    seen: set[str] = set()
    for item in items:
        if item in seen:
            raise ValueError(f"duplicate {what} {item!r} in KVBatchMeta")
        seen.add(item)


def _str_list(value: object, attr: str, noun: str, what: str) -> list[str]:
    """A private list copy of ``value`` if it is a sequence of unique str, else raise (naming ``attr``)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"KVBatchMeta {attr} must be a list of str, got {type(value).__name__}")
    items = list(value)
    for i, item in enumerate(items):
        if type(item) is not str:
            raise TypeError(f"KVBatchMeta {attr}[{i}] is a {type(item).__name__}; {noun} must be str")
    _unique(items, what)
    return items


@dataclass(eq=True)
class KVBatchMeta:
    """Which rows of the store a batch is made of: keys, their tags, a partition and field names.

    Args:
        keys: the row keys (str, unique), in batch order.
        tags: one plain dict per key (default: an empty dict per key).
        partition_id: the partition the keys live in (required).
        fields: the field names the keys hold / that a reader should fetch; ``None`` means all.
        extra_info: small plain side information passed to workers (e.g. a sampling temperature).

    Raises:
        ValueError: duplicate keys or fields, or ``len(tags) != len(keys)``.
        TypeError: a key is not a str, or a tensor / array / other non-plain value appears anywhere
            in ``keys``, ``tags``, ``fields`` or ``extra_info`` (the message says where).

    It implements the batch protocol ``controlplane`` dispatch uses (``len``, ``chunk(n)`` and the
    classmethod ``concat``) and allows uneven chunks. Instances are plain dataclasses: they pickle,
    encode with ``msgspec`` as-is, and ``to_dict`` / ``from_dict`` give a msgpack-able dict.

    Example:
        >>> meta = KVBatchMeta(["k0", "k1", "k2"], partition_id="train", extra_info={"temperature": 1.0})
        >>> len(meta), meta.size
        (3, 3)
        >>> parts = meta.chunk(2)
        >>> KVBatchMeta.concat(parts) == meta
        True
        >>> meta.reorder([2, 0, 1]).keys
        ['k2', 'k0', 'k1']
    """

    keys: list[str]
    tags: list[dict[Any, Any]] | None = None
    partition_id: str | None = None
    fields: list[str] | None = None
    extra_info: dict[Any, Any] | None = field(default=None)

    allows_uneven_chunks: ClassVar[bool] = True
    # Makes ``@register`` methods take a meta for their rows (see ``controlplane.bridge``); set by
    # ``dataplane._bridge_hook`` when the package loads, so this module never imports the bridge.
    __worker_bridge__: ClassVar[Any] = None

    def __post_init__(self) -> None:
        keys = _str_list(self.keys, "keys", "keys", "key")
        check_partition(self.partition_id, "KVBatchMeta")
        tags: list[dict[Any, Any]]
        if self.tags is None:
            tags = [{} for _ in keys]
        else:
            if isinstance(self.tags, dict) or not isinstance(self.tags, Sequence):
                raise TypeError(f"KVBatchMeta tags must be a list of dicts, got {type(self.tags).__name__}")
            if len(self.tags) != len(keys):
                raise ValueError(f"KVBatchMeta has {len(keys)} keys but {len(self.tags)} tags; one per key")
            tags = []
            for i, tag in enumerate(self.tags):
                if type(tag) is not dict:
                    raise TypeError(f"KVBatchMeta tags[{i}] is a {type(tag).__name__}; a tag must be a dict")
                tags.append(_plain(tag, f"KVBatchMeta tags[{i}] (key {keys[i]!r})"))
        fields = None if self.fields is None else _str_list(self.fields, "fields", "names", "field")
        extra = {} if self.extra_info is None else self.extra_info
        if type(extra) is not dict:
            raise TypeError(f"KVBatchMeta extra_info must be a dict, got {type(extra).__name__}")
        self.keys = keys
        self.tags = tags
        self.fields = fields
        self.extra_info = _plain(extra, "KVBatchMeta extra_info")

    @classmethod
    def _trusted(
        cls, keys: list[str], tags: list[dict[Any, Any]], partition_id: str, fields: list[str] | None
    ) -> KVBatchMeta:
        """A meta built from what the index service answered (msgpack-decoded, so plain by
        construction, keys unique): skips the checks user input needs. Not for user values."""
        meta = object.__new__(cls)
        meta.keys, meta.tags, meta.partition_id, meta.fields, meta.extra_info = (
            keys,
            tags,
            partition_id,
            fields,
            {},
        )
        return meta

    # ``tags``, ``partition_id`` and ``extra_info`` accept None in the constructor; __post_init__ (and
    # ``_trusted``) replace it, so on a built meta they always hold a list, a str and a dict.

    @property
    def _tag_list(self) -> list[dict[Any, Any]]:
        return cast("list[dict[Any, Any]]", self.tags)

    @property
    def _pid(self) -> str:
        return cast(str, self.partition_id)

    @property
    def _extra(self) -> dict[Any, Any]:
        return cast("dict[Any, Any]", self.extra_info)

    # -- size ---------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Number of keys (rows) in the batch."""
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    @classmethod
    def empty(cls, partition_id: str) -> KVBatchMeta:
        """A batch of no keys in ``partition_id``.

        Example:
            >>> KVBatchMeta.empty("train").size
            0
        """
        return cls([], None, partition_id)

    # -- batch protocol -----------------------------------------------------------------------

    def _derive(self, idx: Sequence[int], fields: list[str] | None) -> KVBatchMeta:
        keys = [self.keys[i] for i in idx]
        all_tags = self._tag_list
        tags = [all_tags[i] for i in idx]
        return KVBatchMeta(keys, tags, self.partition_id, fields, self.extra_info)

    def chunk(self, n: int) -> list[KVBatchMeta]:
        """Split into exactly ``n`` batches in order; sizes differ by at most one (larger ones first).

        ``n`` may exceed the size: the last chunks are then empty. Every chunk keeps the partition,
        fields and ``extra_info``.

        Example:
            >>> [c.size for c in KVBatchMeta(list("abcde"), partition_id="p").chunk(3)]
            [2, 2, 1]
        """
        if type(n) is not int or n < 1:
            raise ValueError(f"chunk(n) needs an int n >= 1, got {n!r}")
        base, rest = divmod(self.size, n)
        out, start = [], 0
        for i in range(n):
            stop = start + base + (1 if i < rest else 0)
            out.append(self._derive(range(start, stop), self.fields))
            start = stop
        return out

    @classmethod
    def concat(cls, metas: Sequence[KVBatchMeta]) -> KVBatchMeta:
        """Join batches of one partition in order.

        Fields become the union in first-seen order (``None`` if any batch has ``None``: all fields);
        ``extra_info`` dicts are merged.

        Raises:
            ValueError: no batches, different partitions, a key in two batches, or an ``extra_info``
                key with conflicting values.

        Example:
            >>> a = KVBatchMeta(["a"], partition_id="p", fields=["x"])
            >>> b = KVBatchMeta(["b"], partition_id="p", fields=["y", "x"])
            >>> KVBatchMeta.concat([a, b]).fields
            ['x', 'y']
        """
        metas = list(metas)
        if not metas:
            raise ValueError("KVBatchMeta.concat needs at least one batch (else the partition is unknown)")
        for i, m in enumerate(metas):
            if not isinstance(m, KVBatchMeta):
                raise TypeError(f"KVBatchMeta.concat: item {i} is a {type(m).__name__}, not a KVBatchMeta")
        pid = metas[0].partition_id
        for m in metas[1:]:
            if m.partition_id != pid:
                raise ValueError(
                    f"KVBatchMeta.concat: partitions differ ({pid!r} and {m.partition_id!r}); "
                    "concatenate batches of one partition only"
                )
        fields: list[str] | None
        union: list[str] = []
        for m in metas:
            if m.fields is None:
                fields = None
                break
            union.extend(f for f in m.fields if f not in union)
        else:
            fields = union
        extra: dict[Any, Any] = {}
        for m in metas:
            for k, v in m._extra.items():
                if k in extra and extra[k] != v:
                    raise ValueError(
                        f"KVBatchMeta.concat: extra_info[{k!r}] conflicts ({extra[k]!r} vs {v!r})"
                    )
                extra[k] = v
        keys = [k for m in metas for k in m.keys]
        tags = [t for m in metas for t in m._tag_list]
        return cls(keys, tags, pid, fields, extra)

    # -- selection ----------------------------------------------------------------------------

    def select_keys(self, keys: Sequence[str]) -> KVBatchMeta:
        """The batch of ``keys`` (a subset, in the given order) with their tags.

        Raises:
            KeyNotFoundError: a key is not in this batch (it names the key and partition).
        """
        if isinstance(keys, str):
            keys = [keys]
        pos = {k: i for i, k in enumerate(self.keys)}
        idx = []
        for k in keys:
            if k not in pos:
                msg = f"key {k!r} is not in this KVBatchMeta (partition {self.partition_id!r})"
                raise KeyNotFoundError(k, self._pid, msg)
            idx.append(pos[k])
        return self._derive(idx, self.fields)

    def select_fields(self, fields: Sequence[str]) -> KVBatchMeta:
        """The same keys, restricted to ``fields`` (which must be a subset of ``self.fields`` if set).

        Raises:
            ValueError: a field is not among this batch's fields.
        """
        if isinstance(fields, str):
            fields = [fields]
        fields = list(fields)
        if self.fields is not None:
            missing = [f for f in fields if f not in self.fields]
            if missing:
                raise ValueError(f"fields {missing} are not in this KVBatchMeta's fields {self.fields}")
        return self._derive(range(self.size), fields)

    def reorder(self, indices: Iterable[SupportsIndex]) -> KVBatchMeta:
        """Put the rows in a new order, in place, and return this meta: row ``i`` becomes the row
        that was at ``indices[i]``.

        In place as verl's ``DataProto.reorder`` and TransferQueue's ``BatchMeta.reorder`` (trainers
        that balance sequence lengths ignore the return value); returning ``self`` also lets it chain.
        ``indices`` must be a permutation of ``range(size)`` (ints, numpy ints or an integer tensor).

        Raises:
            ValueError: ``indices`` is not a permutation of ``range(size)`` (the meta is unchanged).
        """
        idx = [operator.index(i) for i in indices]
        if sorted(idx) != list(range(self.size)):
            raise ValueError(f"reorder needs a permutation of range({self.size}), got {idx[:16]}")
        tags = self._tag_list
        self.keys = [self.keys[i] for i in idx]
        self.tags = [tags[i] for i in idx]
        return self

    # -- serialization ------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (msgpack / JSON friendly) that ``from_dict`` turns back into this batch."""
        return {
            "keys": list(self.keys),
            "tags": [dict(t) for t in self._tag_list],
            "partition_id": self.partition_id,
            "fields": None if self.fields is None else list(self.fields),
            "extra_info": dict(self._extra),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KVBatchMeta:
        """Inverse of ``to_dict`` (validates again)."""
        return cls(d["keys"], d.get("tags"), d["partition_id"], d.get("fields"), d.get("extra_info"))

    def __repr__(self) -> str:
        keys = self.keys if self.size <= 4 else [*self.keys[:3], "...", self.keys[-1]]
        return (
            f"KVBatchMeta(size={self.size}, partition_id={self.partition_id!r}, keys={keys}, "
            f"fields={self.fields}, extra_info={self.extra_info})"
        )


@dataclass(frozen=True)
class StoreInfo:
    """What ``dp.init()`` connected to. Plain values only.

    Attributes:
        namespace: the Ray namespace of the service's named actors.
        num_shards: how many storage shards the service runs.
        shard_nodes: the Ray node id of each shard, in shard order.
        owned: True when this process started the service (an embedded store it stops on close).
        capacity_bytes: the store's total byte capacity (``None``: unbounded).
        transport: the data path this client uses ("shm" same-node shared memory, or "zmq").

    Example:
        >>> StoreInfo("rlplane", 2, ("n1", "n1"), owned=True).num_shards
        2
    """

    namespace: str
    num_shards: int
    shard_nodes: tuple[str, ...] = ()
    owned: bool = False
    capacity_bytes: int | None = None
    transport: str = "shm"
    extra: dict[str, Any] = field(default_factory=dict)


class KVListPage(dict[str, dict[str, dict[Any, Any]]]):
    """One page of ``dp.kv_list(partition_id, limit=...)``: ``{partition: {key: tag}}`` as the whole
    listing is, holding at most ``limit`` keys, and ``cursor``, where the next page starts (pass it
    to ``kv_list``; None when this page was the last)."""

    def __init__(self, listing: dict[str, dict[str, dict[Any, Any]]], cursor: str | None) -> None:
        super().__init__(listing)
        self.cursor = cursor


__all__ = ["KVBatchMeta", "KVListPage", "StoreInfo", "check_partition"]
