"""workers: where the data plane and the control plane meet.

The ``tqbridge`` wrapper, engine workers on a small torch model, and a GRPO trainer
whose driver handles metadata only.

``from workers import tqbridge`` gives the decorator (the module of the same name,
``workers/tqbridge.py``, also holds the byte counters and :class:`BridgeError`).

Example:
    >>> from controlplane import Dispatch, Worker, register
    >>> from workers import tqbridge
    >>> class Scorer(Worker):
    ...     @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    ...     @tqbridge(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
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
