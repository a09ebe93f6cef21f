"""``transfer_queue.storage.simple_storage``: TransferQueue's in-memory storage unit. The store's
shards take its place; its classes raise ``NotImplementedError`` when used."""

from dataplane.tq._unsupported import unsupported
from dataplane.tq.storage import StorageKeyNotFoundError

SimpleStorageUnit = unsupported("SimpleStorageUnit")
StorageUnitData = unsupported("StorageUnitData")

__all__ = ["SimpleStorageUnit", "StorageKeyNotFoundError", "StorageUnitData"]
