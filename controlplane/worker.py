"""Worker: the base class of every process a worker group drives.

The group sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` in each worker's environment, so ``torch.distributed.init_process_group("gloo")``
works from the environment alone. A worker also declares its place in each named device mesh
(``_register_dispatch_collect_info``) so that nd dispatch can send it the right data shard.

Example:
    >>> class Trainer(Worker):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self._register_dispatch_collect_info("train", dp_rank=self.rank // 2,
    ...                                              is_collect=self.rank % 2 == 0)
    ...
    ...     @register(Dispatch.ONE_TO_ALL)
    ...     def ping(self):
    ...         return self.rank
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from typing import Any

from controlplane.decorator import Dispatch, Execute, register

logger = logging.getLogger(__name__)

ENV_KEYS = ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def get_node_ip() -> str:
    """This process's node IP as Ray sees it (falls back to the host's address)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception as exc:  # pragma: no cover - Ray not usable here
        logger.debug("ray node ip unavailable: %s", exc)
    return socket.gethostbyname(socket.gethostname())


def get_free_port() -> int:
    """A TCP port that was free a moment ago on this host."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={raw!r} is not an int") from exc


class Worker:
    """Base class of group workers: rank info from the environment, mesh info for nd dispatch.

    Outside a group (no ``RANK`` in the environment) a worker is rank 0 of 1, so the class
    and its ``@register`` methods also work as plain local objects.

    Args:
        cuda_visible_devices: optional device list to export (used when sharing a process).
    """

    def __init__(self, cuda_visible_devices: str | None = None) -> None:
        self._world_size = _env_int("WORLD_SIZE", 1)
        self._rank = _env_int("RANK", 0)
        self._local_world_size = _env_int("LOCAL_WORLD_SIZE", 1)
        self._local_rank = _env_int("LOCAL_RANK", 0)
        self._master_addr = os.environ.get("MASTER_ADDR")
        self._master_port = os.environ.get("MASTER_PORT")
        if not 0 <= self._rank < self._world_size:
            raise ValueError(f"RANK={self._rank} is outside WORLD_SIZE={self._world_size}")
        if cuda_visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = str(cuda_visible_devices)
        self._dispatch_dp_rank: dict[str, int] = {}
        self._collect_dp_rank: dict[str, bool] = {}

    # ---- rank information -------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def local_world_size(self) -> int:
        return self._local_world_size

    def get_master_addr_port(self) -> tuple[str | None, str | None]:
        return self._master_addr, self._master_port

    def get_node_ip(self) -> str:
        return get_node_ip()

    def get_node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def get_pid(self) -> int:
        return os.getpid()

    def get_cuda_visible_devices(self) -> str:
        return os.environ.get("CUDA_VISIBLE_DEVICES", "not set")

    def get_env(self, keys: tuple[str, ...] = ENV_KEYS) -> dict[str, str | None]:
        """The given environment variables as this process sees them."""
        return {key: os.environ.get(key) for key in keys}

    # ---- mesh information for nd dispatch -----------------------------------------------
    def _register_dispatch_collect_info(self, mesh_name: str, dp_rank: int, is_collect: bool) -> None:
        """Declare this rank's data-parallel rank in ``mesh_name`` and whether its output is kept.

        Raises:
            ValueError: ``mesh_name`` was already registered on this worker, or ``dp_rank`` < 0.
        """
        if mesh_name in self._dispatch_dp_rank:
            raise ValueError(
                f"mesh {mesh_name!r} is already registered on {type(self).__name__} rank {self.rank}"
            )
        if not isinstance(dp_rank, int) or dp_rank < 0:
            raise ValueError(f"dp_rank must be an int >= 0, got {dp_rank!r} for mesh {mesh_name!r}")
        self._dispatch_dp_rank[mesh_name] = dp_rank
        self._collect_dp_rank[mesh_name] = bool(is_collect)

    def _mesh_missing(self, mesh_name: str) -> ValueError:
        return ValueError(
            f"mesh {mesh_name!r} is not registered in {type(self).__name__} rank {self.rank}; "
            f"registered: {sorted(self._dispatch_dp_rank)}"
        )

    def query_dispatch_info(self, mesh_name: str) -> int:
        """This rank's dp rank in ``mesh_name`` (local accessor)."""
        if mesh_name not in self._dispatch_dp_rank:
            raise self._mesh_missing(mesh_name)
        return self._dispatch_dp_rank[mesh_name]

    def query_collect_info(self, mesh_name: str) -> bool:
        """Whether this rank's output is collected in ``mesh_name`` (local accessor)."""
        if mesh_name not in self._collect_dp_rank:
            raise self._mesh_missing(mesh_name)
        return self._collect_dp_rank[mesh_name]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_dispatch_info(self, mesh_name: str) -> int:
        return self.query_dispatch_info(mesh_name)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_collect_info(self, mesh_name: str) -> bool:
        return self.query_collect_info(mesh_name)

    def get_dispatch_collect(self) -> dict[str, dict[str, Any]]:
        """Copies of the registered meshes: ``{"dispatch": {mesh: dp_rank}, "collect": {mesh: bool}}``."""
        return {"dispatch": dict(self._dispatch_dp_rank), "collect": dict(self._collect_dp_rank)}

    def set_dispatch_collect(self, mesh_name: str, dp_rank: int, is_collect: bool) -> None:
        """Register a mesh under a new name, e.g. to re-export a sub-worker's mesh."""
        self._register_dispatch_collect_info(mesh_name, dp_rank, is_collect)

    # ---- built-in group methods -----------------------------------------------------------
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def execute_with_func_generator(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``func(self, *args, **kwargs)`` on every rank with its chunk of the data."""
        return func(self, *args, **kwargs)

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def execute_func_rank_zero(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``func(*args, **kwargs)`` on rank 0 only and return its value."""
        return func(*args, **kwargs)
