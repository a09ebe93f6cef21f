"""Detecting dead workers: a probe that never blocks on busy actors, and a background watcher."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from controlplane.errors import WorkerDiedError

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

logger = logging.getLogger(__name__)


def actor_id_hex(handle: ActorHandle) -> str:
    hex_id: str = handle._actor_id.hex()
    return hex_id


def dead_worker_error(rank: int, name: str, cause: BaseException | str) -> WorkerDiedError:
    summary = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    return WorkerDiedError(f"worker {name!r} (rank {rank}) is dead: {summary}", rank=rank, worker_name=name)


class LivenessProbe:
    """Pings every worker with ``__ray_ready__``; at most one ping per worker is outstanding.

    A busy worker simply has not answered yet (it counts as alive); a dead one answers
    with ``RayActorError`` as soon as Ray knows it died.
    """

    def __init__(self, workers: Sequence[ActorHandle], names: Sequence[str]) -> None:
        self._workers = list(workers)
        self._names = list(names)
        self._pending: dict[int, ObjectRef] = {}

    def poll(self, timeout_s: float) -> WorkerDiedError | None:
        """Return an error for the first dead worker found within ``timeout_s``, else None."""
        import ray
        from ray.exceptions import RayActorError

        for rank, worker in enumerate(self._workers):
            if rank not in self._pending:
                self._pending[rank] = worker.__ray_ready__.remote()
        refs = list(self._pending.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        ready_set = set(ready)
        for rank in sorted(self._pending):
            ref = self._pending[rank]
            if ref not in ready_set:
                continue
            del self._pending[rank]
            try:
                ray.get(ref)
            except RayActorError as exc:
                return dead_worker_error(rank, self._names[rank], exc)
        return None


class AlivenessWatcher:
    """A daemon thread that polls a :class:`LivenessProbe` and remembers the first death.

    The group raises the remembered error on its next call; ``on_dead`` (if given) is
    called once from the watcher thread. Nothing aborts the driver.
    """

    def __init__(
        self,
        probe: LivenessProbe,
        every_n_seconds: float,
        on_dead: Callable[[WorkerDiedError], None] | None = None,
    ) -> None:
        self._probe = probe
        self._every = every_n_seconds
        self._on_dead = on_dead
        self._stop = threading.Event()
        self.error: WorkerDiedError | None = None
        self._thread = threading.Thread(target=self._run, name="controlplane-aliveness", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._every + 5.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                error = self._probe.poll(self._every)
            except Exception as exc:  # Ray shut down under us; nothing more to watch
                logger.debug("aliveness watcher stops: %s", exc)
                return
            if error is not None:
                self.error = error
                logger.error("%s", error)
                if self._on_dead is not None:
                    self._on_dead(error)
                return
            self._stop.wait(self._every)
