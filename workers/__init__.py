"""workers: where the data plane and the control plane meet.

Engine workers on a small torch model, a GRPO trainer whose driver handles metadata only,
and the bridge: a ``@register`` method called with a ``dataplane.KVBatchMeta`` receives its
shard's rows and writes its per-row outputs back (``workers.tqbridge`` explains it and keeps the
``tqbridge`` / ``bridged_register`` decorators as aliases).

Example:
    >>> from controlplane import Dispatch, Worker, register
    >>> class Scorer(Worker):
    ...     @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)   # register bridges by itself
    ...     def score(self, batch): ...
"""

import sys as _sys
import types as _types
from typing import TYPE_CHECKING
from typing import Any as _Any

__version__ = "0.1.0"

__all__: list[str] = [
    "BridgeError",
    "DriverDataError",
    "MetadataOnlyGroup",
    "__version__",
    "bridged_register",
    "tqbridge",
]

# Each name is imported on first use: the ``rlplane`` command (``workers.cli``) lives in this
# package, and ``rlplane --version`` or ``rlplane store status`` must not pay for torch and
# tensordict, which the bridge and the driver guard load.
_HOME = {
    "BridgeError": "workers.tqbridge",
    "bridged_register": "workers.tqbridge",
    "tqbridge": "workers.tqbridge",
    "DriverDataError": "workers.driver_guard",
    "MetadataOnlyGroup": "workers.driver_guard",
}

if TYPE_CHECKING:
    from workers.driver_guard import DriverDataError, MetadataOnlyGroup
    from workers.tqbridge import BridgeError, bridged_register, tqbridge
else:

    def __getattr__(name: str) -> _Any:
        if name in _HOME:
            import importlib

            return getattr(importlib.import_module(_HOME[name]), name)
        raise AttributeError(f"module 'workers' has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(__all__)

    class _Package(_types.ModuleType):
        """``workers.tqbridge`` stays the decorator (as it was when this package imported it eagerly):
        importing the submodule of the same name does not rebind it here (the module is in
        ``sys.modules["workers.tqbridge"]``)."""

        def __setattr__(self, name: str, value: _Any) -> None:
            if name in _HOME and isinstance(value, _types.ModuleType):
                return
            super().__setattr__(name, value)

    _sys.modules[__name__].__class__ = _Package
