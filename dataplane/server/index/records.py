"""The index's records, and the state that every group of its operations reads and changes.

``PartMeta`` (a partition: its keys with their fields and tags, a ``KeyTable``; keys cleared lately;
its consumers' streams) and ``FieldSchema`` (a field's family, decided once) are the metadata;
``IndexRecords`` is the base of ``IndexCore`` that holds them beside the rest of the index's state
(open puts, lease deadlines, takes given back) and builds the error for a partition that is not
there. The operations are mixins over it, one module per group: ``index.puts`` (puts and clears),
``index.streaming`` (consumers), ``index.checkpoint``; ``index`` joins them into ``IndexCore``.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dataplane.errors import PartitionNotFoundError, WireError, did_you_mean
from dataplane.server.index.keytable import KeyTable
from dataplane.server.index.streams import PartitionStreams
from dataplane.wire.protocol import WireSpec

CLEARED_KEYS_KEPT = 4096  # cleared keys remembered per partition, so a get of one says "cleared"
CLEARED_PARTITIONS_KEPT = 1024  # cleared partitions remembered, for the same reason
FREE_SLICE = 8192  # keys of a dropped partition freed at a time, between requests (a few milliseconds)


@dataclass
class PartMeta:
    """A partition: its keys (in the order they came), the keys cleared lately, its consumers' streams,
    and when something last happened to it (a put, a take, an ack: ``time.monotonic()``)."""

    keys: KeyTable = field(default_factory=KeyTable)
    # The last CLEARED_KEYS_KEPT keys cleared from it, oldest first: a get of one says "cleared".
    cleared: OrderedDict[str, None] = field(default_factory=OrderedDict)
    streams: PartitionStreams = field(init=False)
    # Which partition of this name it is: a consumer waiting on one never gets rows of a successor.
    incarnation: int = field(default_factory=itertools.count(1).__next__)
    active: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.streams = PartitionStreams(self.keys, self.keys.tag)

    def drain(self, n: int) -> int:
        """Forget up to about ``n`` keys of this dropped partition (streams first, then the keys, so each
        key's name is freed with its last holder); how many went (0: nothing is left)."""
        return self.streams.drain(n) or self.keys.drain(n)


@dataclass
class FieldSchema:
    """A field's family (kind group, dtype, dims per row; ``ColumnSpec.family``), decided by the first
    ``prepare`` that named it (first writer wins); each row's shape is free.

    ``confirmed`` once a put that relies on it commits; until then ``pending`` holds the puts
    (transaction ids) that rely on it, and the last of them to abort or expire takes it back.
    """

    family: list[str | int]
    confirmed: bool = False
    pending: set[int] = field(default_factory=set)
    wire: WireSpec | None = None  # the spec a put without prepare last declared, found of this family


class IndexRecords:
    """The state of ``IndexCore``, empty at first (``prepare_ttl_s`` and ``clock``: see ``IndexCore``).

    Each attribute is read and written on the index's one thread only, so none needs a lock.
    """

    def __init__(self, prepare_ttl_s: float = 120.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.partitions: dict[str, PartMeta] = {}
        self.schemas: dict[str, dict[str, FieldSchema]] = {}  # pid -> field -> schema
        self.txns: dict[int, tuple[str, list[str]]] = {}  # open put -> (pid, fields it relies on)
        self.prepare_ttl_s = prepare_ttl_s
        self._clock = clock
        # When each open put expires, and the same in deadline order (one ttl for all: arrival order)
        # so that expiring costs nothing while no deadline has passed.
        self._open_until: dict[int, float] = {}
        self._deadlines: deque[tuple[float, int]] = deque()
        # Puts aborted before their prepare arrived (txn -> until when it is refused), same order.
        self._early_aborts: dict[int, float] = {}
        self._early_order: deque[tuple[float, int]] = deque()
        self.put_counts = {"aborted": 0, "expired": 0, "refused": 0}
        self.registry: dict[str, Any] = {}
        self.changed: set[str] = set()  # partitions whose rows changed since the actor last looked
        # Lease deadlines (deadline, seq, pid, task, take), stale entries dropped when they come up.
        self.lease_due: list[tuple[float, int, str, str, str]] = []
        self._lease_seq = itertools.count()
        # Takes given back by id (bounded, oldest dropped): a request carrying one that arrives after
        # its release (it travelled on another connection) takes nothing.
        self.released: OrderedDict[str, None] = OrderedDict()
        # The last CLEARED_PARTITIONS_KEPT partitions cleared, oldest first (for the error naming one).
        self.cleared: OrderedDict[str, None] = OrderedDict()
        self.leases_expired = 0  # leased rows given back because their lease ran out (metrics)
        # Partitions cleared or replaced, freed FREE_SLICE keys at a time between requests (``free_some``):
        # freeing a million keys at once would hold every other caller up for a tenth of a second.
        self.dropped: deque[PartMeta] = deque()
        # Partitions with a consumer's new stream being gathered a slice at a time (``build_some``).
        self.building: dict[str, PartMeta] = {}

    def drop(self, part: PartMeta) -> None:
        """``part`` is out of the index: free it in slices, between requests."""
        self.dropped.append(part)

    def build_some(self) -> None:
        """Gather one slice of a consumer's new stream over a big partition (``PartitionStreams.build_some``);
        its partition then counts as changed, so the requests waiting on it are asked again (a
        sequential take is served once the walk has found enough rows; any other, once it is whole)."""
        while self.building:
            pid, part = next(iter(self.building.items()))
            worked, _ = part.streams.build_some() if self.partitions.get(pid) is part else (False, False)
            if worked:  # (a sequential take may be served by the rows gathered so far)
                self.changed.add(pid)
            if not part.streams.building or self.partitions.get(pid) is not part:
                del self.building[pid]
            if worked:
                return

    def free_some(self, n: int = FREE_SLICE) -> int:
        """Free up to about ``n`` keys of the dropped partitions; how many went (0: none is left)."""
        while self.dropped:
            gone = self.dropped[0].drain(n)
            if gone:
                return gone
            self.dropped.popleft()
        return 0

    def missing(self, pid: str, message: str | None = None) -> PartitionNotFoundError:
        """The error for a partition that is not there: cleared (if remembered), or never written, with
        the names it might be a typo of."""
        text = message or f"partition {pid!r} not found"
        if pid in self.cleared:
            text += " (it was cleared: clear_partition; a put creates it anew)"
        elif message is None:
            text += f" (never written, nor among the last {CLEARED_PARTITIONS_KEPT} partitions cleared)"
        return PartitionNotFoundError(pid, text + did_you_mean(pid, self.partitions))

    def page_start(self, pid: str, cursor: str | None, what: str) -> tuple[PartMeta | None, int]:
        """The partition a page (a listing's, ``consumed``'s) is of, and the sequence number it starts
        at: ``cursor`` (``"<incarnation>.<sequence number>"``, as the last page returned) read back
        (``WireError``: not one); ``PartitionNotFoundError`` when the partition was cleared since."""
        if cursor is None:
            return self.partitions.get(pid), 0
        try:
            incarnation, start = (int(part) for part in cursor.split("."))
        except ValueError:
            raise WireError(f"{what}: {cursor!r} is not a cursor a page returned") from None
        part = self.partitions.get(pid)
        if part is None or part.incarnation != incarnation:
            raise PartitionNotFoundError(
                pid,
                f"partition {pid!r} was cleared since this {what} began (clear_partition); ask again "
                "from the start",
            )
        return part, start


__all__ = [
    "CLEARED_KEYS_KEPT",
    "CLEARED_PARTITIONS_KEPT",
    "FREE_SLICE",
    "FieldSchema",
    "IndexRecords",
    "PartMeta",
]
