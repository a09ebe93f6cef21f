"""workers: where the data plane and the control plane meet.

Engine workers on a small torch model, a GRPO trainer whose driver handles metadata only,
and the bridge: a ``@register`` method called with a ``dataplane.KVBatchMeta`` receives its
shard's rows and writes its per-row outputs back (``workers.bridge`` explains it; its ``tqbridge``
and ``bridged_register`` decorators add the bridge's ``call_on_empty`` option).

Example:
    >>> from controlplane import Dispatch, Worker, register
    >>> class Scorer(Worker):
    ...     @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)   # register bridges by itself
    ...     def score(self, batch): ...
"""

from workers import bridge as _bridge
from workers import driver_guard as _driver_guard

# Each public name is written once, in the ``__all__`` of the module that defines it.
from workers.bridge import *  # noqa: F403
from workers.driver_guard import *  # noqa: F403

__all__: list[str] = []
__all__ += _bridge.__all__
__all__ += _driver_guard.__all__
