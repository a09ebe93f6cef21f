"""TransferQueue names that cannot mean the same thing on this store: importing them works, using
them raises ``NotImplementedError`` naming what to use instead."""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

# name -> what to use instead
ALTERNATIVES = {
    "TransferQueueController": "tq.init() (it starts or finds the controller) and tq.get_client()",
    "ZMQServerInfo": "tq.get_client(): the client attaches to the store by itself",
    "ZMQMessage": "the client's methods; the store's wire protocol is its own (dataplane.wire)",
    "ZMQRequestType": "the client's methods; the store's wire protocol is its own (dataplane.wire)",
    "process_zmq_server_info": "tq.get_client(): the client attaches to the store by itself",
    "SimpleStorageUnit": "dp.init(num_shards=...), or the config key backend.SimpleStorage."
    "num_data_storage_units",
    "AsyncSimpleStorageManager": "tq.get_client() (put / get_data go to the store's shards directly)",
}


def _message(name: str) -> str:
    return (
        f"{name} is TransferQueue's own machinery, with no equivalent on this store; use {ALTERNATIVES[name]}"
    )


def unsupported(name: str) -> type:
    """A class named ``name`` whose construction (and ``.remote``) raises NotImplementedError."""
    message = _message(name)

    def refuse(*args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(message)

    return type(
        name,
        (),
        {
            "__new__": refuse,
            "remote": staticmethod(refuse),
            "options": staticmethod(refuse),
            "__doc__": message,
        },
    )


def unsupported_function(name: str) -> Callable[..., NoReturn]:
    message = _message(name)

    def refuse(*args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(message)

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = message
    return refuse


__all__ = ["ALTERNATIVES", "unsupported", "unsupported_function"]
