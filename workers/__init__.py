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

from workers.driver_guard import DriverDataError, MetadataOnlyGroup
from workers.tqbridge import BridgeError, bridged_register, tqbridge

__all__: list[str] = [
    "BridgeError",
    "DriverDataError",
    "MetadataOnlyGroup",
    "__version__",
    "bridged_register",
    "tqbridge",
]

__version__ = "0.1.0"
