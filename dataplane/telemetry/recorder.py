"""The hot path of the store's metrics: plain counters and histogram buckets, in this process's memory.

Recording a call costs a lock, a dict lookup and an increment (about a microsecond); nothing here
talks to Ray. A background thread (``export``) collects what was recorded every few seconds and
hands it to ``ray.util.metrics``. Until that thread runs (a process not connected to Ray, or a store
whose ``metrics`` option is off) ``Recorder.on`` is False and the callers record nothing.

A key is a tuple: the metric's name, then its label values in the order the catalog lists them,
e.g. ``("dataplane_client_rows", "dataplane", "put")``. Servers keep their own counters (plain
attributes of their cores) and ``publish`` a snapshot of them, with their gauges, from their own
thread; the exporter turns cumulative counters into increments.

    >>> rec = Recorder()
    >>> rec.on = True
    >>> rec.add(("dataplane_client_rows", "s", "put"), 4)
    >>> rec.observe(("dataplane_client_op_seconds", "s", "put"), 0.0003)
    >>> sample = rec.collect()
    >>> sample.counters[("dataplane_client_rows", "s", "put")], sum(sample.histograms[
    ...     ("dataplane_client_op_seconds", "s", "put")])
    (4, 1)
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Collection
from dataclasses import dataclass, field

from dataplane.telemetry.catalog import LATENCY_BOUNDS, OTHER

Key = tuple[str, ...]

# Error classes a client names in dataplane_client_errors; any other is counted as OTHER, so a label
# value never comes from a message or an arbitrary type.
_ERROR_NAMES = frozenset(
    {
        "TypeError",
        "ValueError",
        "KeyError",
        "TimeoutError",
        "ConnectionError",
        "KeyboardInterrupt",
        "CancelledError",
    }
)


@dataclass
class Sample:
    """Everything recorded so far: cumulative counters, histogram bucket counts (one per bound of
    ``LATENCY_BOUNDS``, then the overflow), and the gauges' last values."""

    counters: dict[Key, float] = field(default_factory=dict)
    histograms: dict[Key, list[int]] = field(default_factory=dict)
    gauges: dict[Key, float] = field(default_factory=dict)


class Recorder:
    """This process's metrics. Thread-safe; ``on`` is read without the lock (a flag)."""

    def __init__(self) -> None:
        self.on = False
        self.interval_s = 5.0  # how often the exporter collects (servers publish as often)
        self._lock = threading.Lock()
        self._counts: dict[Key, float] = {}
        self._hists: dict[Key, list[int]] = {}
        self._published: dict[str, tuple[dict[Key, float], dict[Key, float]]] = {}

    def add(self, key: Key, amount: float = 1) -> None:
        """Add ``amount`` to the counter ``key``."""
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + amount

    def observe(self, key: Key, seconds: float) -> None:
        """Count ``seconds`` in its bucket of the histogram ``key``."""
        i = bisect.bisect_left(LATENCY_BOUNDS, seconds)  # bounds are inclusive upper bounds (le)
        with self._lock:
            buckets = self._hists.get(key)
            if buckets is None:
                buckets = self._hists[key] = [0] * (len(LATENCY_BOUNDS) + 1)
            buckets[i] += 1

    def publish(self, source: str, counters: dict[Key, float], gauges: dict[Key, float]) -> None:
        """Replace what ``source`` (a server of this process) said last: its cumulative counters and
        its gauges. A gauge it no longer lists is no longer exported (Ray drops the series soon)."""
        with self._lock:
            self._published[source] = (counters, gauges)

    def withdraw(self, source: str) -> None:
        """``source`` is gone (a server stopped): its gauges are exported no more."""
        with self._lock:
            self._published.pop(source, None)

    def collect(self) -> Sample:
        """A copy of everything recorded and published, taken under the lock."""
        with self._lock:
            sample = Sample(dict(self._counts), {k: list(v) for k, v in self._hists.items()})
            published = list(self._published.values())
        for counters, gauges in published:  # (each snapshot is replaced, never changed: no copy)
            for key, value in counters.items():
                sample.counters[key] = sample.counters.get(key, 0) + value
            sample.gauges.update(gauges)
        return sample


RECORDER = Recorder()
"""This process's recorder (one per process: every store client and server in it shares it)."""


def _off_in_child() -> None:  # a forked child has no exporter thread and no Ray connection of its own
    RECORDER.on = False


os.register_at_fork(after_in_child=_off_in_child)


class ClientMetrics:
    """What a store client records: each call's latency and outcome, and the rows and bytes it moved.

    ``call`` and ``moved`` do nothing while the process's recorder is off.
    """

    __slots__ = ("rec", "store", "_keys")

    def __init__(self, store: str, rec: Recorder = RECORDER) -> None:
        self.store = store
        self.rec = rec
        self._keys: dict[str, tuple[Key, Key, Key]] = {}  # op -> its keys, made once (ops are few)

    def _keys_of(self, op: str) -> tuple[Key, Key, Key]:
        keys = self._keys.get(op)
        if keys is None:
            keys = self._keys[op] = (
                ("dataplane_client_op_seconds", self.store, op),
                ("dataplane_client_rows", self.store, op),
                ("dataplane_client_bytes", self.store, op),
            )
        return keys

    def call(self, op: str, seconds: float, error: BaseException | None = None) -> None:
        rec = self.rec
        if not rec.on:
            return
        rec.observe(self._keys_of(op)[0], seconds)
        if error is not None:
            rec.add(("dataplane_client_errors", self.store, op, error_name(error)))

    def moved(self, op: str, rows: int, nbytes: int | None = None) -> None:
        rec = self.rec
        if not rec.on:
            return
        _, rows_key, bytes_key = self._keys_of(op)
        with rec._lock:  # (one acquisition for both counters: this runs once per call)
            counts = rec._counts
            counts[rows_key] = counts.get(rows_key, 0) + rows
            if nbytes is not None:
                counts[bytes_key] = counts.get(bytes_key, 0) + nbytes

    def peer_dead(self, peer: str) -> None:
        if self.rec.on:
            self.rec.add(("dataplane_peers_dead", self.store, peer))


def error_name(exc: BaseException) -> str:
    """The label value for an error: its class name when it is a data plane error or a common builtin
    (bounded), else ``"other"``.

    >>> error_name(ValueError("x")), error_name(RuntimeError("y"))
    ('ValueError', 'other')
    """
    name = type(exc).__name__
    module = type(exc).__module__
    if module == "dataplane.errors" or name in _ERROR_NAMES:
        return name
    return OTHER


class ServerMetrics:
    """What a shard or the index records on its request loop: the time to serve each request of the
    ops it times (an op the service does not know counted as ``"other"``; ``untimed`` ops not at
    all), and the wait of calls answered later."""

    __slots__ = ("rec", "prefix", "labels", "_served", "_other", "_waited")

    def __init__(
        self,
        prefix: str,
        labels: tuple[str, ...],
        ops: Collection[str],
        rec: Recorder = RECORDER,
        untimed: Collection[str] = (),
    ) -> None:
        self.rec = rec
        self.prefix = prefix  # "dataplane_shard" or "dataplane_index"
        self.labels = labels  # the values of the metric's labels before ``op``
        name = prefix + "_op_seconds"
        self._served: dict[str | None, Key | None] = {op: (name, *labels, op) for op in ops}
        self._served.update(dict.fromkeys(untimed))
        self._other: Key = (name, *labels, OTHER)
        self._waited: dict[str, Key] = {}

    def served(self, op: str | None, seconds: float) -> None:
        if self.rec.on:
            key = self._served.get(op, self._other)
            if key is not None:
                self.rec.observe(key, seconds)

    def waited(self, op: str, seconds: float) -> None:
        if self.rec.on:
            key = self._waited.get(op)
            if key is None:
                key = self._waited[op] = (self.prefix + "_wait_seconds", *self.labels, op)
            self.rec.observe(key, seconds)


__all__ = ["RECORDER", "ClientMetrics", "Key", "Recorder", "Sample", "ServerMetrics", "error_name"]
