"""Typed errors of the data plane. Every error is a ``DataplaneError``.

Each class also subclasses the built-in error a caller would naturally catch
(``KeyError`` for a missing key, ``ValueError`` for bad input, ...), and every
message names the culprit and, where there is one, the next step.

    >>> try:
    ...     dp.kv_batch_get(["nope"], partition_id="train")
    ... except dp.KeyNotFoundError as e:
    ...     print(e.key, e.partition_id)
    nope train
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar


class DataplaneError(Exception):
    """Root of every error the data plane raises.

    ``wire_attrs`` names the culprit attributes a class adds, in the order its constructor takes
    them; the message is always the constructor's last argument. That one declaration is how an
    error crosses the wire (``dataplane.wire.frames``: class name, message and these attributes,
    rebuilt as the same class) and how it pickles (``__reduce__`` below), so a new error class
    with culprit attributes declares them here and nowhere else.
    """

    wire_attrs: ClassVar[tuple[str, ...]] = ()

    def __str__(self) -> str:  # KeyError subclasses would otherwise repr() the message
        return str(self.args[0]) if self.args else self.__class__.__name__

    def __reduce__(self) -> Any:
        if not self.wire_attrs:
            return super().__reduce__()
        return (type(self), (*(getattr(self, a) for a in self.wire_attrs), str(self)))


class StoreNotInitializedError(DataplaneError, RuntimeError):
    """A KV call was made before ``dp.init()`` (or after ``dp.close()``)."""


class KeyNotFoundError(DataplaneError, KeyError, ValueError):
    """A key is not stored in the partition. Attributes: ``key``, ``partition_id``.

    Also a ``ValueError`` whose message says "not found", so code written against TransferQueue
    (which raises ``ValueError``) catches it unchanged.
    """

    wire_attrs: ClassVar[tuple[str, ...]] = ("key", "partition_id")

    def __init__(self, key: str, partition_id: str, message: str | None = None) -> None:
        self.key = key
        self.partition_id = partition_id
        super().__init__(message or f"key {key!r} not found in partition {partition_id!r}")


class FieldNotFoundError(KeyNotFoundError):
    """A requested field is not stored for a key. Attributes: ``key``, ``partition_id``, ``field``."""

    wire_attrs: ClassVar[tuple[str, ...]] = ("key", "partition_id", "field")

    def __init__(self, key: str, partition_id: str, field: str, message: str | None = None) -> None:
        self.field = field
        super().__init__(
            key,
            partition_id,
            message
            or f"select_fields entry {field!r} not found: key {key!r} in partition {partition_id!r} has no "
            f"field {field!r} (not written yet)",
        )


class PartitionNotFoundError(DataplaneError, KeyError, ValueError):
    """The partition does not exist (never written, or cleared). Attribute: ``partition_id``."""

    wire_attrs: ClassVar[tuple[str, ...]] = ("partition_id",)

    def __init__(self, partition_id: str, message: str | None = None) -> None:
        self.partition_id = partition_id
        super().__init__(message or f"partition {partition_id!r} not found (never written, or cleared)")


class StaleMetaError(KeyNotFoundError, PartitionNotFoundError):
    """A bridged method was called with a ``KVBatchMeta`` whose rows are no longer stored (its
    partition or keys were cleared since the meta was made, or never written). Raised on the
    worker, before the method runs. Attributes: ``key`` (the first missing key, or the meta's
    first key when the whole partition is gone), ``partition_id``, ``method``.

    Also a ``KeyNotFoundError`` and a ``PartitionNotFoundError``, so either ``except`` catches it.
    Not recoverable with this meta: pass the meta a put returned after the clear.
    """

    # The message says all a caller needs: a group call failing with it does not chain the worker's
    # traceback (the controller honours this class attribute; see controlplane.errors).
    __concise_error__ = True

    wire_attrs: ClassVar[tuple[str, ...]] = ("key", "partition_id", "method")

    def __init__(self, key: str, partition_id: str, method: str, message: str | None = None) -> None:
        self.key = key
        self.partition_id = partition_id
        self.method = method
        # Not super().__init__: the two parents' constructors take different arguments.
        DataplaneError.__init__(
            self,
            message
            or f"{method} got a stale KVBatchMeta: key {key!r} is not in partition {partition_id!r} "
            "(cleared, or never written); pass the meta a put returned after the clear",
        )


class SchemaError(DataplaneError, ValueError):
    """A field's dtype, shape or kind does not match the column already stored. Attribute: ``field``."""

    wire_attrs: ClassVar[tuple[str, ...]] = ("field",)

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


class SchemaMismatchError(SchemaError):
    """New data of a field does not match the family (kind, dtype, dims per row) the partition stores
    it as. Attributes: ``field``, ``stored``: that family, its parts joined by ":" (``"tensor:float32:1"``,
    ``"arrow:large_string"``), so that a caller can adapt its data without parsing the message
    (``dataplane.tq`` does)."""

    wire_attrs: ClassVar[tuple[str, ...]] = ("field", "stored")

    def __init__(self, field: str, stored: str, message: str) -> None:
        self.stored = stored
        super().__init__(field, message)


class BatchSizeError(DataplaneError, ValueError):
    """The number of keys and the batch size of the fields (or tags) differ."""


class InvalidArgumentError(DataplaneError, ValueError):
    """An argument of a call (or a ``dp.init`` option) is out of range or malformed: ``batch_size=0``,
    ``timeout_s=nan``, ``dp_rank`` not below ``dp_size``, a meta that holds no lease. Attribute:
    ``argument``, its name. Raised before anything is sent or started: nothing changed."""

    wire_attrs: ClassVar[tuple[str, ...]] = ("argument",)

    def __init__(self, argument: str, message: str) -> None:
        self.argument = argument
        super().__init__(message)


class ArgumentTypeError(DataplaneError, TypeError):
    """An argument of a call has the wrong type (``partition_id=7``, ``fields=[1]``), or ``dp.init``
    got an option it does not know (the message says which it may have meant). Attribute:
    ``argument``, its name. Raised before anything is sent or started: nothing changed."""

    wire_attrs: ClassVar[tuple[str, ...]] = ("argument",)

    def __init__(self, argument: str, message: str) -> None:
        self.argument = argument
        super().__init__(message)


class SerializationError(DataplaneError, TypeError):
    """A value cannot be stored without pickle, and pickle was not allowed for it."""


class ShardUnavailableError(DataplaneError, ConnectionError):
    """A shard did not answer within its deadline (dead or unreachable). Attribute: ``shard``."""

    wire_attrs: ClassVar[tuple[str, ...]] = ("shard",)

    def __init__(self, shard: str, message: str) -> None:
        self.shard = shard
        super().__init__(message)


class StoreFullError(DataplaneError, MemoryError):
    """A put would exceed the store's byte capacity; nothing was written."""


class SchedulingError(DataplaneError, TimeoutError):
    """Ray could not schedule the store's actors within the deadline (not enough resources)."""


class BatchTimeoutError(DataplaneError, TimeoutError):
    """``next_batch`` waited ``timeout_s`` and not enough rows became ready; says how many were.
    Attribute: ``partition_id``. Nothing was marked consumed."""

    wire_attrs: ClassVar[tuple[str, ...]] = ("partition_id",)

    def __init__(self, partition_id: str, message: str) -> None:
        self.partition_id = partition_id
        super().__init__(message)


class ReservationExpiredError(DataplaneError, TimeoutError):
    """A put stalled between reserving space and committing longer than ``reservation_timeout_s``.

    The shards give such space back (and never reuse the memory the stalled writer may still write
    into); the put is aborted. The message says whether any part of it had committed.
    """


class LeaseExpiredError(DataplaneError, TimeoutError):
    """An ``ack`` came after the lease of some of its rows ran out: those rows went back to their task
    and may have been delivered to another consumer. Attributes: ``partition_id``, ``keys`` (the
    late ones; the others were acknowledged)."""

    wire_attrs: ClassVar[tuple[str, ...]] = ("partition_id",)

    def __init__(self, partition_id: str, message: str | None = None, *, keys: Sequence[str] = ()) -> None:
        self.partition_id = partition_id
        self._keys = list(keys)  # raised by the client itself: the keys never cross the wire
        super().__init__(message or f"the lease of {len(self._keys)} row(s) of {partition_id!r} ran out")

    @property
    def keys(self) -> list[str]:
        return self._keys


class ResourceLimitError(DataplaneError, OSError):
    """This process (or a shard) ran out of an OS resource, such as file descriptors; names the limit."""


class WireError(DataplaneError, ValueError):
    """A request or reply could not be decoded or broke the protocol (names what was wrong)."""


class RequestTooLargeError(WireError):
    """A request holds a frame larger than its target takes (``max_message_bytes``; a shard with a
    capacity takes no frame larger than that capacity plus 1 MiB). Refused by the client before
    anything is sent, so nothing was written; the message names the frame, the limit and what to do
    (fewer keys or smaller rows per call, or a store started with a larger limit)."""


class ProtocolVersionError(WireError):
    """The two ends of a request speak different versions of the wire protocol (a client, or a
    shard, of another dataplane release than the service it called). Attributes:
    ``client_version`` (the request's), ``service_version`` (the answering service's).

    Nothing of the request was read past its header. Not recoverable by retrying: run the same
    dataplane release in every process that uses the store (restart the store, or the client).
    """

    wire_attrs: ClassVar[tuple[str, ...]] = ("client_version", "service_version")

    def __init__(self, client_version: int, service_version: int, message: str | None = None) -> None:
        self.client_version = client_version
        self.service_version = service_version
        super().__init__(
            message
            or f"wire protocol mismatch: the client speaks version {client_version}, the service "
            f"version {service_version}; run the same dataplane release in every process of the store"
        )


class CheckpointError(DataplaneError, ValueError):
    """A checkpoint could not be saved or loaded (``dp.save_checkpoint`` / ``dp.load_checkpoint``).
    Attribute: ``path``, the file or directory at fault.

    On load: a file is truncated, corrupted (its checksum does not match the manifest) or
    inconsistent with the others, or the store already holds partitions of the same names; nothing
    was loaded. On save: a store process cannot reach the directory (it is not on a filesystem every
    node mounts at the same path), a write failed, or a shard died; the previous checkpoint at that
    path is intact. The message names the file, the node where it matters, and the next step.
    """

    wire_attrs: ClassVar[tuple[str, ...]] = ("path",)

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        super().__init__(message)


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint directory, or a file its manifest lists, does not exist. Attribute: ``path``.

    Also a ``FileNotFoundError``, as TransferQueue raises for a missing checkpoint."""


class ClusterConnectError(DataplaneError, ConnectionError):
    """This process could not connect to the Ray cluster at ``address`` (``dp.init(address=...)``,
    ``rlplane ... --address``): nothing answers there, or it is not a Ray cluster this process can
    join. Attribute: ``address``. Recoverable: start the cluster, or fix the address; the message
    says which."""

    wire_attrs: ClassVar[tuple[str, ...]] = ("address",)

    def __init__(self, address: str, message: str) -> None:
        self.address = address
        super().__init__(message)


class ClusterAuthError(ClusterConnectError, PermissionError):
    """The Ray cluster at ``address`` exists but refused this process's authentication token (Ray's
    token authentication, ``RAY_AUTH_MODE=token``), or this process has no token to offer. The
    message says where Ray looks for the token. Recoverable: give this process the cluster's token."""


class BridgeError(DataplaneError, ValueError):
    """A bridged method returned a TensorDict whose batch size is not the meta's. Attributes:
    ``method``, ``got`` (its batch size), ``expected`` (the meta's).

    Raised on the worker (and re-raised on the driver by Ray). Not recoverable by retrying:
    the method must return one row per key of the meta it was given (or metrics).
    """

    wire_attrs = ("method", "got", "expected")

    def __init__(self, method: str, got: int, expected: int, message: str | None = None) -> None:
        super().__init__(
            message
            or f"{method} returned a TensorDict of batch size {got} for a KVBatchMeta of {expected} keys; "
            "a bridged method must return one row per key (or a dict of metrics)"
        )
        self.method, self.got, self.expected = method, got, expected


class EngineUnavailableError(DataplaneError):
    """The transfer engine asked for (``StoreConfig.engine``) cannot run in this process; the message
    says what is missing (a package, a library, the extra to install)."""


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the names in ``known`` close to ``name``; "" when none is.

    Example:
        >>> did_you_mean("setp1", ["step1", "step2", "eval"])
        " (did you mean 'step1' or 'step2'?)"
    """
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)"


__all__ = [
    "ArgumentTypeError",
    "BridgeError",
    "BatchSizeError",
    "BatchTimeoutError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "ClusterAuthError",
    "ClusterConnectError",
    "DataplaneError",
    "EngineUnavailableError",
    "FieldNotFoundError",
    "InvalidArgumentError",
    "KeyNotFoundError",
    "LeaseExpiredError",
    "PartitionNotFoundError",
    "ProtocolVersionError",
    "RequestTooLargeError",
    "ReservationExpiredError",
    "ResourceLimitError",
    "SchedulingError",
    "SchemaError",
    "SchemaMismatchError",
    "SerializationError",
    "ShardUnavailableError",
    "StaleMetaError",
    "StoreFullError",
    "StoreNotInitializedError",
    "WireError",
]
