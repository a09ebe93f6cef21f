"""The store's configuration: one place for every knob and every ``DATAPLANE_*`` variable.

``StoreConfig`` is a plain, msgpack-able dataclass. ``dp.init(**options)`` builds one from its
keyword arguments over these defaults; a service started by ``rlplane store start`` keeps the
config it was started with, and attaching clients read it from the index service.

Environment variables (read here only, each by one function; a value that does not parse raises
``ValueError`` naming the variable):
    DATAPLANE_TRANSPORT        "auto" (default), "shm", "zmq" or "tcp": this process's transport
                               (``StoreConfig.transport``; also overrides a service's when attaching)
    DATAPLANE_ENGINE           "native" (default), "zmq" or "mooncake": the transfer engine of a store
                               this process starts (``StoreConfig.engine``)
    DATAPLANE_MOONCAKE_PROTOCOL  "tcp" (default) or "rdma": the transport of the mooncake engine
    DATAPLANE_MOONCAKE_DEVICE  the RDMA device the mooncake engine uses ("" by default: its choice)
    DATAPLANE_MOONCAKE_REGISTERED_BYTES  read by the store's shards: most bytes of shared-memory
                               segments a shard's mooncake engine keeps registered to lend rows from
                               (default 8 GiB; 0: every reply is copied)
    DATAPLANE_RPC_TIMEOUT      seconds a request to a shard or the index may take (default 60)
    DATAPLANE_ALLOW_PICKLE     a flag (``env_flag``: 1/true/yes/on or 0/false/no/off, any case;
                               default off): this process may write and read object columns
    DATAPLANE_NO_UNIX_LANE     a flag: blocking clients reach same-host services over zmq ipc rather
                               than the Unix lane (``transport.unix``; for comparisons)
    DATAPLANE_READ_POOL_BYTES  idle bytes of copy-out buffers a process keeps for its next reads
                               (default 1 GiB; 0 turns the pool off)
    DATAPLANE_PINNED_BYTES     most bytes of shared-memory mappings a process registers with CUDA
                               for one-copy device transfers (default 8 GiB; 0: staged copies only)
    DATAPLANE_UNIX_PEER_UIDS   read by the store's actors: uids (comma-separated) whose processes may
                               connect to their Unix lane besides their own uid, which always may
                               (default: none; any other uid is closed at accept)
    DATAPLANE_TQ_CONTROLLER_TIMEOUT_S  seconds ``dataplane.tq`` waits for its controller actor (60)
    DATAPLANE_METRICS          a flag (default on): the default of ``StoreConfig.metrics`` for a store
                               this process starts (``docs/metrics.md``)
    DATAPLANE_METRICS_INTERVAL_S  seconds between two exports of this process's metrics to Ray
                               (default: half of Ray's metrics report interval, within 0.5-5 s)

Example:
    >>> cfg = StoreConfig.from_options(num_shards=2, transport="zmq")
    >>> cfg.num_shards, cfg.transport
    (2, 'zmq')
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from dataplane.errors import ArgumentTypeError, InvalidArgumentError, did_you_mean

NAMESPACE = "rlplane"
"""Ray namespace of the store's named actors (embedded or started by ``rlplane store start``)."""

MAX_TIMEOUT_S = 1e9
"""The longest timeout, in seconds, any setting or call takes (about 31 years): finite, so no deadline
computed from one overflows a clock or a poll. Where a call takes ``None``, that waits for ever."""

INT64_MAX = 2**63 - 1
"""The largest size or count the store takes: what a socket option, a numpy index or msgpack carries."""


def check_number(
    name: str, value: Any, low: float, high: float, *, integer: bool = False, above: bool = False
) -> None:
    """Refuse ``value`` for the argument ``name`` unless it is a finite number in ``[low, high]``
    (``(low, high]`` with ``above``; an ``int`` with ``integer``): ``ArgumentTypeError`` (a
    ``TypeError``) for another type (a bool included), ``InvalidArgumentError`` (a ``ValueError``) for
    ``nan``, ``inf`` or a value out of range. Both name the argument.

        >>> check_number("rpc_timeout_s", float("inf"), 0, MAX_TIMEOUT_S, above=True)
        Traceback (most recent call last):
        ...
        dataplane.errors.InvalidArgumentError: rpc_timeout_s=inf must be a finite number in (0, 1000000000.0]
    """
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        what = "an int" if integer else "a number"
        raise ArgumentTypeError(name, f"{name} must be {what}, not {type(value).__name__} ({value!r})")
    inside = (low < value if above else low <= value) and value <= high
    if not inside or (type(value) is not int and not math.isfinite(value)):
        bounds = f"{'(' if above else '['}{low!r}, {high!r}]"
        what = "an int" if integer else "a finite number"
        raise InvalidArgumentError(name, f"{name}={value!r} must be {what} in {bounds}")


TRANSPORTS = ("auto", "shm", "zmq", "tcp")
ENGINES = ("native", "zmq", "mooncake")  # transfer engines (``transport.engine``)


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def env_flag(name: str) -> bool:
    """The on/off variable ``name``: 1/true/yes/on or 0/false/no/off (any case, unset = off).

    The one flag parser of the data plane: every reader of a flag asks it, so no two readers can
    disagree about a value.
    """
    raw = os.environ.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"environment variable {name}={os.environ[name]!r} is not a flag; use 1/true or 0/false")


def env_allows_pickle() -> bool:
    """Whether ``DATAPLANE_ALLOW_PICKLE`` lets this process pickle and unpickle object columns."""
    return env_flag("DATAPLANE_ALLOW_PICKLE")


def env_unix_lane() -> bool:
    """Whether this process's blocking client talks to same-host services over the Unix lane
    (``transport.unix``); ``DATAPLANE_NO_UNIX_LANE=1`` keeps it on zmq ipc (to compare the two)."""
    return not env_flag("DATAPLANE_NO_UNIX_LANE")


def unix_peer_uids() -> frozenset[int]:
    """The uids whose processes may connect to this process's Unix-lane listeners: its own, and
    those ``DATAPLANE_UNIX_PEER_UIDS`` lists (e.g. ``"1001,1002"``).

    >>> os.getuid() in unix_peer_uids()
    True
    """
    raw = os.environ.get("DATAPLANE_UNIX_PEER_UIDS", "")
    uids = {os.getuid()}
    for part in raw.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit():
            raise ValueError(
                f"environment variable DATAPLANE_UNIX_PEER_UIDS={raw!r}: {part!r} is not a uid; "
                "give numeric uids separated by commas, e.g. 1001,1002"
            )
        uids.add(int(part))
    return frozenset(uids)


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from exc
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"environment variable {name}={raw!r} must be a finite number >= 0")
    return value


def tq_controller_timeout_s() -> float:
    """Seconds ``dataplane.tq`` waits for its TransferQueue controller actor to answer
    (``DATAPLANE_TQ_CONTROLLER_TIMEOUT_S``, default 60)."""
    return _env_float("DATAPLANE_TQ_CONTROLLER_TIMEOUT_S", 60.0)


MOONCAKE_PROTOCOLS = ("tcp", "rdma")


def env_mooncake() -> tuple[str, str]:
    """The mooncake engine's transport and RDMA device (``DATAPLANE_MOONCAKE_PROTOCOL``,
    ``DATAPLANE_MOONCAKE_DEVICE``)."""
    protocol = os.environ.get("DATAPLANE_MOONCAKE_PROTOCOL") or "tcp"
    if protocol not in MOONCAKE_PROTOCOLS:
        raise ValueError(f"DATAPLANE_MOONCAKE_PROTOCOL={protocol!r} is not one of {MOONCAKE_PROTOCOLS}")
    return protocol, os.environ.get("DATAPLANE_MOONCAKE_DEVICE", "")


def env_metrics() -> bool:
    """Whether a store this process starts exports metrics (``DATAPLANE_METRICS``; unset = on)."""
    return "DATAPLANE_METRICS" not in os.environ or env_flag("DATAPLANE_METRICS")


def metrics_interval_s() -> float | None:
    """Seconds between two exports of this process's metrics (``DATAPLANE_METRICS_INTERVAL_S``);
    None when unset (the exporter derives it from Ray's report interval)."""
    value = _env_float("DATAPLANE_METRICS_INTERVAL_S", 0.0)
    if value < 0:
        raise ValueError(f"environment variable DATAPLANE_METRICS_INTERVAL_S={value} must be >= 0")
    return value or None


def read_buffer_pool_bytes() -> int:
    """Most idle bytes of copy-out buffers a process keeps warm for its next reads
    (``DATAPLANE_READ_POOL_BYTES``, default 1 GiB: a loop reading batches up to that size every step
    reads into warm pages; 0 turns the pool off)."""
    return min(int(_env_float("DATAPLANE_READ_POOL_BYTES", 2**30)), INT64_MAX)


def mooncake_registered_bytes() -> int:
    """Most bytes of shared-memory segments a shard's mooncake engine keeps registered to lend rows
    from (``DATAPLANE_MOONCAKE_REGISTERED_BYTES``, default 8 GiB: over RDMA they are pinned; 0: copy
    every reply); ``transport.mooncake_engine``."""
    return min(int(_env_float("DATAPLANE_MOONCAKE_REGISTERED_BYTES", 8 * 2**30)), INT64_MAX)


def pinned_bytes() -> int:
    """Most bytes of shared-memory mappings a process registers with CUDA (``DATAPLANE_PINNED_BYTES``,
    default 8 GiB; 0 turns registration off: device copies are staged through pinned buffers);
    ``dataplane.transport.pinning``."""
    return min(int(_env_float("DATAPLANE_PINNED_BYTES", 8 * 2**30)), INT64_MAX)


@dataclass
class StoreConfig:
    """Every setting of the store and of its clients.

    Attributes:
        name: prefix of the named actors (``<name>-index``, ``<name>-shard-<i>``); two stores with
            different names can run side by side in one cluster.
        num_shards: storage shards; ``None`` means one per alive Ray node.
        capacity_bytes: byte capacity of the *whole* store (split evenly over shards); ``None`` = unbounded.
        num_cpus: logical CPUs each store actor requests. 0 by default: the store never takes a CPU
            slot a worker group needs, so a store plus a group of as many workers as the machine has
            cores schedules on a plain ``ray.init()`` (the actors still run; Ray only stops counting
            them). Give a fraction to make Ray account for them on a shared cluster.
        transport: "auto" (shared memory when the shard is on this host, else zmq), "shm", "zmq" (frames
            over the same-host ipc socket, or tcp across hosts), or "tcp" (frames over tcp even on the
            same host: what a client on another node gets, for tests and benchmarks).
        rpc_timeout_s: deadline for one request to a shard or the index. A dead shard or index is
            noticed sooner: a reply late by a second makes the client check whether its process died,
            and calls to a dead one raise ``ShardUnavailableError`` at once.
        schedule_timeout_s: how long ``init`` waits for Ray to place the store's actors before
            raising ``SchedulingError``.
        shm_min_bytes: columns smaller than this travel inline in the request (one round trip
            cheaper than a shared-memory segment); larger ones go through shared memory.
        warm_idle_s: a freed shared-memory segment is kept warm for reuse this long, then given back.
        warm_retain_bytes: at most this many bytes of freed segments are kept warm per shard.
        reservation_timeout_s: a put whose client stalled or vanished between reserve and commit is undone
            after this (its memory is fenced, never reused); a client aborts its own put past 80% of it.
        allow_pickle: this process may write and read ``object`` columns (pickle; the one place pickle
            may appear). A per-process choice: an attaching client never takes it from the service.
        encrypt: CURVE-encrypt the tcp traffic between hosts (about 3x slower for bulk bytes on the zmq
            path); same-host traffic is authenticated but not encrypted either way.
        engine: what moves buffers of ``engine_min_bytes`` or more between a client and a shard over tcp
            (another host, or ``transport="tcp"``): "native" (plain TCP split over
            ``engine_connections`` connections per shard pair), "zmq" (in the zmq message: one stream
            per shard pair) or "mooncake" (Mooncake's Transfer Engine, where it is installed);
            ``transport.engine``. An encrypting store keeps every byte in its CURVE stream.
        engine_connections: connections (and threads) a client splits one large buffer over.
        engine_min_bytes: buffers at least this large go through the engine.
        max_message_bytes: the largest frame a store socket accepts (a shard with a capacity accepts at
            most that much); a peer that sends more is disconnected.
        detached: actors outlive the creating process (``rlplane store start``).
        metrics: the store's processes (its actors, and every client attached to it) export metrics
            through Ray's metrics pipeline (``docs/metrics.md``); off, they record nothing.
        metrics_partitions: the most partitions (and consumer tasks of partitions) that get series of
            their own in a metric with a ``partition`` label: the largest, the rest summed under
            ``"other"``; -1 gives every partition its own series (a run of 10,000 partitions then makes
            10,000 series per such metric), 0 sums them all.
    """

    name: str = "dataplane"
    num_shards: int | None = None
    capacity_bytes: int | None = None
    num_cpus: float = 0.0
    transport: str = "auto"
    rpc_timeout_s: float = 60.0
    schedule_timeout_s: float = 30.0
    shm_min_bytes: int = 64 * 1024
    warm_idle_s: float = 2.0
    warm_retain_bytes: int = 1 << 30
    reservation_timeout_s: float = 120.0
    allow_pickle: bool = False
    encrypt: bool = False
    engine: str = "native"
    engine_connections: int = 4
    engine_min_bytes: int = 4 << 20
    max_message_bytes: int = 1 << 32
    detached: bool = False
    metrics: bool = True
    metrics_partitions: int = 20

    def __post_init__(self) -> None:
        if type(self.name) is not str or not self.name:  # it prefixes the actors' names
            raise ArgumentTypeError("name", f"name must be a non-empty str, not {self.name!r}")
        if self.transport not in TRANSPORTS:
            maybe = did_you_mean(str(self.transport), TRANSPORTS)
            raise InvalidArgumentError(
                "transport", f"transport={self.transport!r} is not one of {TRANSPORTS}{maybe}"
            )
        if self.engine not in ENGINES:
            maybe = did_you_mean(str(self.engine), ENGINES)
            raise InvalidArgumentError("engine", f"engine={self.engine!r} is not one of {ENGINES}{maybe}")
        for flag in _FLAGS:
            value = getattr(self, flag)
            if not isinstance(value, bool):
                raise ArgumentTypeError(
                    flag, f"{flag} must be True or False, not {type(value).__name__} ({value!r})"
                )
        for name in ("capacity_bytes", "warm_retain_bytes", "max_message_bytes", "shm_min_bytes"):
            value = getattr(self, name)
            if isinstance(value, str):  # "1G", as `rlplane store start --capacity` takes it
                raise ArgumentTypeError(
                    name,
                    f"{name} must be an int number of bytes, not the str {value!r}; e.g. 1 << 30 for 1 GiB",
                )
        # Every number is checked here, where it enters (``dp.init``, ``rlplane store start``, an
        # attaching client's copy): finite and in range, so nothing computed from it overflows later.
        for name, low, high, integer, above in _NUMBERS:
            value = getattr(self, name)
            if value is not None or name not in _OPTIONAL:
                check_number(name, value, low, high, integer=integer, above=above)

    @classmethod
    def from_options(cls, **options: Any) -> StoreConfig:
        """Defaults, then ``DATAPLANE_*`` variables, then ``options``.

        Raises:
            ArgumentTypeError: an option that is no field (naming it, and the field it may mean), or
                a value of the wrong type.
            InvalidArgumentError: a value out of range.

        Example:
            >>> StoreConfig.from_options(capcity=1 << 30)
            Traceback (most recent call last):
            ...
            dataplane.errors.ArgumentTypeError: unknown store option 'capcity' (did you mean ...
        """
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            name = unknown[0]
            raise ArgumentTypeError(
                name,
                f"unknown store option {name!r}{did_you_mean(name, known)}; the options are StoreConfig's "
                f"fields: {', '.join(known)}",
            )
        base: dict[str, Any] = {
            "transport": client_transport_override() or "auto",
            "rpc_timeout_s": _env_float("DATAPLANE_RPC_TIMEOUT", 60.0),
            "allow_pickle": env_allows_pickle(),
            "metrics": env_metrics(),
            "engine": os.environ.get("DATAPLANE_ENGINE") or "native",
        }
        base.update({k: v for k, v in options.items() if v is not None or k in ("num_shards",)})
        return cls(**base)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StoreConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def shard_capacity(self, num_shards: int) -> int | None:
        """Byte capacity of one shard when the store's capacity is split over ``num_shards``."""
        if self.capacity_bytes is None:
            return None
        return max(1, self.capacity_bytes // num_shards)

    def index_name(self) -> str:
        return f"{self.name}-index"

    def shard_name(self, i: int) -> str:
        return f"{self.name}-shard-{i}"


# field, lowest, highest, an int, the lowest excluded
_NUMBERS = (
    ("num_shards", 1, 2**31 - 1, True, False),
    ("capacity_bytes", 1, INT64_MAX, True, False),
    ("num_cpus", 0, 64, False, False),  # 0: the store takes no CPU a worker needs
    ("rpc_timeout_s", 0, MAX_TIMEOUT_S, False, True),
    ("schedule_timeout_s", 0, MAX_TIMEOUT_S, False, True),
    ("shm_min_bytes", 0, INT64_MAX, True, False),
    ("warm_idle_s", 0, MAX_TIMEOUT_S, False, False),
    ("warm_retain_bytes", 0, INT64_MAX, True, False),
    ("reservation_timeout_s", 0, MAX_TIMEOUT_S, False, True),
    ("max_message_bytes", 1, INT64_MAX, True, False),
    ("engine_connections", 1, 64, True, False),
    ("engine_min_bytes", 1, INT64_MAX, True, False),
    ("metrics_partitions", -1, 2**31 - 1, True, False),  # -1: every partition
)
_OPTIONAL = frozenset({"num_shards", "capacity_bytes"})  # None: one shard per node / unbounded
_FLAGS = ("allow_pickle", "encrypt", "detached", "metrics")


def client_transport_override() -> str | None:
    """A per-process transport override (``DATAPLANE_TRANSPORT``) for clients attaching to a service."""
    raw = os.environ.get("DATAPLANE_TRANSPORT")
    if raw and raw not in TRANSPORTS:
        raise ValueError(f"DATAPLANE_TRANSPORT={raw!r} is not one of {TRANSPORTS}")
    return raw or None


__all__ = ["StoreConfig"]
