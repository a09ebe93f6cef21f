"""Starting a RayWorkerGroup's actors on a pool: placement, per-rank env, readiness with a deadline."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from controlplane._launch import check_worker_env, launch_workers, master_addr_port, places_for
from controlplane.resource_pool import RayResourcePool, ResourcePool

if TYPE_CHECKING:
    from controlplane.worker_group import RayWorkerGroup

logger = logging.getLogger(__name__)


def start_group(
    wg: RayWorkerGroup,
    pool: ResourcePool,
    *,
    bin_pack: bool,
    detached: bool,
    master: tuple[str | None, int | None],
    use_gpu: bool | None,
    worker_env: dict[str, str] | None,
    num_cpus: float,
    namespace: str | None,
    ready_timeout_s: float,
    device_name: str = "cuda",
) -> None:
    """Start one actor per slot of ``pool`` for ``wg`` and wait until every constructor ran.

    Raises:
        TypeError: ``pool`` is not a Ray pool.
        ValueError: the group wants GPUs from a CPU-only pool, or a device the pool was not
            placed with.
        WorkerDiedError: a constructor failed (the message names the worker).
    """
    if not isinstance(pool, RayResourcePool):
        raise TypeError(f"RayWorkerGroup needs a RayResourcePool, got {type(pool).__name__}")
    use_gpu = pool.use_gpu if use_gpu is None else use_gpu
    if use_gpu and not pool.use_gpu:
        raise ValueError(f"the group asks for GPUs but pool {pool.name_prefix} was built with use_gpu=False")
    check_worker_env(worker_env)
    slots = pool.bundle_slots(strategy="STRICT_PACK" if bin_pack else "PACK", device_name=device_name)
    places = places_for(slots)
    if master[0] is None:
        master = master_addr_port(slots[0])
    wg._master_addr, wg._master_port = master[0], str(master[1])
    workers, names = launch_workers(
        wg.ray_cls_with_init,
        places,
        prefix=wg.name_prefix,
        master=(master[0], int(master[1])),
        use_gpu=use_gpu,
        num_gpus=1.0 / pool.max_colocate_count,
        num_cpus=num_cpus,
        detached=detached,
        worker_env=worker_env,
        namespace=namespace,
        device_name=device_name,
    )
    wg._set_workers(workers, names)
    try:
        wg._wait([w.__ray_ready__.remote() for w in workers], timeout=ready_timeout_s, method="__init__")
    except BaseException:
        wg.kill()
        raise
    logger.info("group %s: %d workers ready (%s)", wg.name_prefix, len(workers), names)
