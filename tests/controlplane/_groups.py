"""Starting and removing test groups: one pool per group, everything removed at the end."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from controlplane import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup


@contextlib.contextmanager
def started_groups(*layout: tuple[int, type]) -> Iterator[list[RayWorkerGroup]]:
    """One group per ``(world_size, worker class)``, each on a pool of its own; killed and freed on
    exit, also when a later group fails to start."""
    pools = [RayResourcePool([size], use_gpu=False, max_colocate_count=1) for size, _ in layout]
    groups: list[RayWorkerGroup] = []
    try:
        for pool, (_, cls) in zip(pools, layout, strict=True):
            groups.append(RayWorkerGroup(pool, RayClassWithInitArgs(cls)))
        yield groups
    finally:
        for group in groups:
            group.kill()
        for pool in pools:
            pool.remove()
