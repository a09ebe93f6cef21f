"""``transfer_queue.storage.simple_storage``: TransferQueue's in-memory storage unit.

``StorageUnitData`` is TransferQueue's data container, with its constructor, methods and errors: a
plain in-process table of samples x fields keyed by global index, with an optional capacity in
samples. It is a local container only; the store's shards hold the store's rows.
``SimpleStorageUnit`` (the zmq server around it) has no equivalent and raises
``NotImplementedError`` when used, as do ``StorageUnitData.save_checkpoint`` / ``load_checkpoint``
(TransferQueue pickles the table; this package never unpickles: save the store with
``tq.save_checkpoint``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from dataplane.errors import KeyNotFoundError as StorageKeyNotFoundError
from dataplane.tq._unsupported import unsupported

SimpleStorageUnit = unsupported("SimpleStorageUnit")

_NO_PICKLE = (
    "StorageUnitData.{} is TransferQueue's pickle of the table, and dataplane.tq never unpickles: "
    "put the rows in the store and save it with tq.save_checkpoint (no pickle in its format)"
)


class StorageUnitData:
    """A table of samples x fields in memory, keyed by global index (TransferQueue's container).

    ``field_data`` maps each field to ``{global_index: value}``; ``storage_size`` bounds the number of
    distinct global indexes held (``None``: no bound). Values are kept as given, never copied.

    Example:
        >>> sud = StorageUnitData(storage_size=4)
        >>> sud.put_data({"x": [10, 11]}, global_indexes=[0, 1])
        >>> sud.get_data(["x"], [1, 0])
        {'x': [11, 10]}
    """

    def __init__(self, storage_size: int | None = None) -> None:
        self.field_data: dict[str, dict[int, object]] = {}  # field -> global index -> the value
        self.storage_size = storage_size
        self._active_keys: set[int] = set()

    @property
    def active_key_count(self) -> int:
        """How many distinct global indexes are held."""
        return len(self._active_keys)

    # TransferQueue's SSD-offload counters: this container never offloads.
    @property
    def ssd_offload_enabled(self) -> bool:
        return False

    @property
    def ssd_active_values(self) -> int:
        return 0

    @property
    def ssd_active_bytes(self) -> int:
        return 0

    @property
    def ssd_fallback_values_total(self) -> int:
        return 0

    def get_data(self, fields: list[str], global_indexes: list[int]) -> dict[str, list[object]]:
        """``{field: [value per global index, in the order given]}``.

        Raises:
            ValueError: a field was never put (names the fields held).
            StorageKeyNotFoundError: a global index is not held for a field (a ``KeyError``).
        """
        out: dict[str, list[object]] = {}
        for name in fields:
            column = self.field_data.get(name)
            if column is None:
                raise ValueError(
                    f"StorageUnitData get_data: field {name!r} not found; held: {sorted(self.field_data)}"
                )
            missing = next((k for k in global_indexes if k not in column), None)
            if missing is not None:
                raise StorageKeyNotFoundError(
                    str(missing),
                    "",
                    f"StorageUnitData get_data: global index {missing!r} not found in field {name!r}",
                )
            out[name] = [column[k] for k in global_indexes]
        return out

    def put_data(self, field_data: Mapping[str, Sequence[object]], global_indexes: list[int]) -> None:
        """Store ``field_data[field][i]`` at ``global_indexes[i]``, replacing what was there.

        Nothing is stored when the call raises.

        Raises:
            ValueError: the new global indexes would exceed ``storage_size``, or a field's values and
                ``global_indexes`` differ in length ("length mismatch", naming the field).
        """
        if self.storage_size is not None:
            new = {k for k in global_indexes if k not in self._active_keys}
            if len(self._active_keys) + len(new) > self.storage_size:
                raise ValueError(
                    f"Storage capacity exceeded: {len(self._active_keys)} held + {len(new)} new > "
                    f"storage_size {self.storage_size}"
                )
        for name, values in field_data.items():
            if len(values) != len(global_indexes):
                raise ValueError(
                    f"StorageUnitData put_data: field {name!r} has {len(values)} values for "
                    f"{len(global_indexes)} global indexes (length mismatch)"
                )
        for name, values in field_data.items():
            column = self.field_data.setdefault(name, {})
            column.update(zip(global_indexes, values, strict=True))
        self._active_keys.update(global_indexes)

    def clear(self, keys: Iterable[int]) -> None:
        """Drop every field of these global indexes; indexes not held are ignored."""
        keys = list(keys)
        for column in self.field_data.values():
            for k in keys:
                column.pop(k, None)
        self._active_keys.difference_update(keys)

    def save_checkpoint(self, path: str | Path, storage_unit_id: str) -> None:
        raise NotImplementedError(_NO_PICKLE.format("save_checkpoint"))

    def load_checkpoint(self, path: str | Path) -> int | None:
        raise NotImplementedError(_NO_PICKLE.format("load_checkpoint"))

    def close(self) -> None:
        """Nothing to release (TransferQueue's SSD variant closes its files here)."""


__all__ = ["SimpleStorageUnit", "StorageKeyNotFoundError", "StorageUnitData"]
