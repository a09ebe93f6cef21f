"""``transfer_queue.storage``: ``StorageKeyNotFoundError`` (here the store's ``KeyNotFoundError``, a
``KeyError`` as in TransferQueue) and ``StorageUnitData``, TransferQueue's in-memory container
(``simple_storage``). TransferQueue's storage backends have no equivalent: the store is the
backend."""

from dataplane.tq.storage import simple_storage
from dataplane.tq.storage.simple_storage import *  # noqa: F403 - StorageUnitData and TransferQueue's names

__all__ = simple_storage.__all__
