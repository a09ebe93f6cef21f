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

from controlplane.class_with_init_args import ClassWithInitArgs, RayClassWithInitArgs
from controlplane.colocate import create_colocated_worker_cls
from controlplane.decorator import register, register_dispatch_mode, update_dispatch_mode
from controlplane.dispatch import make_nd_compute_dispatch_fn
from controlplane.errors import (
    ControlPlaneError,
    MeshConflictError,
    ResourceShortageError,
    WorkerCallError,
    WorkerDiedError,
)
from controlplane.fused import create_colocated_worker_cls_fused, create_colocated_worker_raw_cls
from controlplane.modes import Dispatch, Execute
from controlplane.per_rank import Broadcast, PerRank
from controlplane.resource_pool import (
    RayResourcePool,
    ResourcePool,
    ResourcePoolManager,
    SubRayResourcePool,
    merge_resource_pool,
    split_resource_pool,
)
from controlplane.worker import Worker
from controlplane.worker_group import RayWorkerGroup, WorkerGroup

__version__ = "0.1.0"

__all__ = [
    "Worker",
    "WorkerGroup",
    "ResourcePool",
    "ClassWithInitArgs",
    "RayResourcePool",
    "SubRayResourcePool",
    "ResourcePoolManager",
    "RayClassWithInitArgs",
    "RayWorkerGroup",
    "register",
    "Dispatch",
    "Execute",
    "make_nd_compute_dispatch_fn",
    "register_dispatch_mode",
    "update_dispatch_mode",
    "split_resource_pool",
    "merge_resource_pool",
    "create_colocated_worker_cls",
    "create_colocated_worker_raw_cls",
    "create_colocated_worker_cls_fused",
    "ControlPlaneError",
    "MeshConflictError",
    "ResourceShortageError",
    "WorkerCallError",
    "WorkerDiedError",
    "PerRank",
    "Broadcast",
]
