"""``transfer_queue.storage``: the one public name, ``StorageKeyNotFoundError`` (here the store's
``KeyNotFoundError``, a ``KeyError`` as in TransferQueue). TransferQueue's storage backends have no
equivalent: the store is the backend."""

from dataplane.errors import KeyNotFoundError as StorageKeyNotFoundError

__all__ = ["StorageKeyNotFoundError"]
