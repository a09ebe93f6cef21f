"""controlplane: a thin single controller in the style of verl's ``single_controller``.

One driver drives many Ray workers with plain method calls; it passes only what the
caller hands it (in this project: metadata) and never imports ``dataplane``.

Example:
    >>> from controlplane import (Dispatch, RayClassWithInitArgs, RayResourcePool,
    ...                           RayWorkerGroup, Worker, register)
    >>> class Echo(Worker):
    ...     @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    ...     def rank_of(self):
    ...         return self.rank
    >>> pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    >>> RayWorkerGroup(pool, RayClassWithInitArgs(Echo)).rank_of()
    [0, 1]
"""

from controlplane import class_with_init_args as _class_with_init_args
from controlplane import colocate as _colocate
from controlplane import decorator as _decorator
from controlplane import dispatch as _dispatch
from controlplane import errors as _errors
from controlplane import fused as _fused
from controlplane import modes as _modes
from controlplane import per_rank as _per_rank
from controlplane import resource_pool as _resource_pool
from controlplane import worker as _worker
from controlplane import worker_group as _worker_group

# Each public name is written once, in the ``__all__`` of the module that defines it (a module's
# helpers for the rest of the package are imported by name, and left out of it).
from controlplane.class_with_init_args import *  # noqa: F403
from controlplane.colocate import *  # noqa: F403
from controlplane.decorator import *  # noqa: F403
from controlplane.dispatch import *  # noqa: F403
from controlplane.errors import *  # noqa: F403
from controlplane.fused import *  # noqa: F403
from controlplane.modes import *  # noqa: F403
from controlplane.per_rank import *  # noqa: F403
from controlplane.resource_pool import *  # noqa: F403
from controlplane.worker import *  # noqa: F403
from controlplane.worker_group import *  # noqa: F403

__all__: list[str] = []
__all__ += _class_with_init_args.__all__
__all__ += _colocate.__all__
__all__ += _decorator.__all__
__all__ += _dispatch.__all__
__all__ += _errors.__all__
__all__ += _fused.__all__
__all__ += _modes.__all__
__all__ += _per_rank.__all__
__all__ += _resource_pool.__all__
__all__ += _worker.__all__
__all__ += _worker_group.__all__
