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
from collections.abc import Callable, Mapping
from typing import Any

from controlplane import _config
from controlplane._devices import apply_local_rank
from controlplane.decorator import register
from controlplane.errors import MeshConflictError
from controlplane.modes import Dispatch, Execute

logger = logging.getLogger(__name__)

ENV_KEYS = _config.RANK_ENV_KEYS


def get_node_ip() -> str:
    """This process's node IP as Ray sees it (falls back to the host's address)."""
    try:
        import ray

        if ray.is_initialized():
            ip: str = ray.util.get_node_ip_address()
            return ip
    except Exception as exc:  # pragma: no cover - Ray not usable here
        logger.debug("ray node ip unavailable: %s", exc)
    return socket.gethostbyname(socket.gethostname())


def get_free_port() -> int:
    """A TCP port that was free a moment ago on this host."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port: int = sock.getsockname()[1]
        return port


class DispatchCollectInfo(dict[str, dict[str, int]]):
    """``Worker.get_dispatch_collect``'s result, in verl's format.

    ``{"dispatch_dp_rank": {mesh: dp_rank}, "collect_dp_rank": {mesh: is_collect}}``: a plain
    ``dict`` for ``**`` and pickling. The short keys ``"dispatch"`` / ``"collect"`` are read too, as
    aliases of those two, but never listed, so ``**info`` stays valid.
    """

    _ALIASES = {"dispatch": "dispatch_dp_rank", "collect": "collect_dp_rank"}

    def __missing__(self, key: str) -> dict[str, int]:
        if key in self._ALIASES:
            return self[self._ALIASES[key]]
        raise KeyError(key)


def _pick_source_mesh(
    mesh_name: str,
    dispatch: Mapping[str, int] | int,
    collect: Mapping[str, bool] | bool,
    source_mesh: str | None,
) -> tuple[int, bool]:
    """The one ``(dp_rank, is_collect)`` to copy out of another worker's mesh tables."""
    if not (isinstance(dispatch, Mapping) and isinstance(collect, Mapping)):
        raise TypeError(
            f"set_dispatch_collect({mesh_name!r}): dispatch_dp_rank and collect_dp_rank must both be "
            f"dicts (from get_dispatch_collect()) or both plain values, got {type(dispatch).__name__} "
            f"and {type(collect).__name__}"
        )
    if set(dispatch) != set(collect):
        raise ValueError(
            f"set_dispatch_collect({mesh_name!r}): dispatch meshes {sorted(dispatch)} and collect meshes "
            f"{sorted(collect)} differ"
        )
    if source_mesh is not None:
        if source_mesh not in dispatch:
            raise ValueError(
                f"set_dispatch_collect({mesh_name!r}): source mesh {source_mesh!r} is not among "
                f"{sorted(dispatch)}"
            )
        return dispatch[source_mesh], bool(collect[source_mesh])
    choices = {(dispatch[m], bool(collect[m])) for m in dispatch}
    if len(choices) != 1:
        detail = "no mesh" if not choices else f"meshes {sorted(dispatch)} with different info"
        raise ValueError(
            f"set_dispatch_collect({mesh_name!r}): the source worker has {detail}; "
            "pass source_mesh=<one of its meshes>"
        )
    return next(iter(choices))


class Worker:
    """Base class of group workers: rank info from the environment, mesh info for nd dispatch.

    Outside a group (no ``RANK`` in the environment) a worker is rank 0 of 1, so the class
    and its ``@register`` methods also work as plain local objects.

    Args:
        cuda_visible_devices: optional device list to export (used when sharing a process).
    """

    fused_worker_attr_name = "fused_worker_dict"  # verl's name for the sibling-role dict

    def __init__(self, cuda_visible_devices: str | None = None) -> None:
        apply_local_rank()  # LOCAL_RANK = this actor's device among those it sees (verl's rule)
        info = _config.rank_info()
        self._world_size, self._rank = info.world_size, info.rank
        self._local_world_size, self._local_rank = info.local_world_size, info.local_rank
        self._master_addr, self._master_port = info.master_addr, info.master_port
        if cuda_visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = str(cuda_visible_devices)
        self._dispatch_dp_rank: dict[str, int] = {}
        self._collect_dp_rank: dict[str, bool] = {}
        # Filled by a FusedWorker with its role instances, so sibling roles reach each other.
        self.fused_worker_dict: dict[str, Any] = {}

    def get_fused_worker_by_name(self, worker_name: str) -> Any:
        """The sibling role ``worker_name`` of a fused worker, or None (verl's accessor)."""
        return self.fused_worker_dict.get(worker_name)

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

        node_id: str = ray.get_runtime_context().get_node_id()
        return node_id

    def get_pid(self) -> int:
        return os.getpid()

    def get_cuda_visible_devices(self) -> str:
        visible = _config.env_text("CUDA_VISIBLE_DEVICES")
        return "not set" if visible is None else visible

    def get_env(self, keys: tuple[str, ...] = ENV_KEYS) -> dict[str, str | None]:
        """The given environment variables as this process sees them."""
        return {key: _config.env_text(key) for key in keys}

    # ---- mesh information for nd dispatch -----------------------------------------------
    def _register_dispatch_collect_info(self, mesh_name: str, dp_rank: int, is_collect: bool) -> None:
        """Declare this rank's data-parallel rank in ``mesh_name`` and whether its output is kept.

        Raises:
            MeshConflictError: ``mesh_name`` was already registered on this worker (also a
                ``ValueError`` and an ``AssertionError``).
            ValueError: ``dp_rank`` < 0.
        """
        self._check_mesh_free(mesh_name, dp_rank, is_collect)
        if not isinstance(dp_rank, int) or dp_rank < 0:
            raise ValueError(f"dp_rank must be an int >= 0, got {dp_rank!r} for mesh {mesh_name!r}")
        self._dispatch_dp_rank[mesh_name] = dp_rank
        self._collect_dp_rank[mesh_name] = bool(is_collect)

    def _check_mesh_free(self, mesh_name: str, dp_rank: object, is_collect: object) -> None:
        # verl refuses any second registration of a name, even with equal values; so do we, so
        # that copying two roles' meshes under one name cannot silently keep the first.
        if mesh_name in self._dispatch_dp_rank or mesh_name in self._collect_dp_rank:
            raise MeshConflictError(
                f"mesh {mesh_name!r} is already registered on {type(self).__name__} rank {self.rank} "
                f"(dp_rank={self._dispatch_dp_rank.get(mesh_name)}, "
                f"is_collect={self._collect_dp_rank.get(mesh_name)}); refusing dp_rank={dp_rank}, "
                f"is_collect={is_collect}. Register each mesh once, or copy it under a new name",
                mesh_name=mesh_name,
            )

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

    def get_dispatch_collect(self) -> DispatchCollectInfo:
        """This worker's registered meshes, as keyword arguments for ``set_dispatch_collect``.

        Returns copies (changing them does not change the worker):
        ``{"dispatch_dp_rank": {mesh: dp_rank}, "collect_dp_rank": {mesh: is_collect}}``,
        verl's format. The older keys ``"dispatch"`` / ``"collect"`` still read the same dicts.

        Example (a fused worker re-exporting its roles' meshes, as verl's engine workers do):
            >>> self.set_dispatch_collect("ref", **self.ref.get_dispatch_collect())
            >>> self.set_dispatch_collect("actor", **self.actor.get_dispatch_collect())
        """
        return DispatchCollectInfo(
            dispatch_dp_rank=dict(self._dispatch_dp_rank), collect_dp_rank=dict(self._collect_dp_rank)
        )

    def set_dispatch_collect(
        self,
        mesh_name: str,
        dispatch_dp_rank: Mapping[str, int] | int,
        collect_dp_rank: Mapping[str, bool] | bool,
        *,
        source_mesh: str | None = None,
    ) -> None:
        """Register ``mesh_name`` on this worker with another worker's mesh info.

        Args:
            mesh_name: the name to register here.
            dispatch_dp_rank, collect_dp_rank: the source worker's ``{mesh: dp_rank}`` and
                ``{mesh: is_collect}`` (what ``get_dispatch_collect()`` returns), or a plain
                ``dp_rank`` and ``is_collect``.
            source_mesh: which of the source's meshes to copy; needed only when the source has
                several meshes that disagree (verl silently took the last one).

        Raises:
            MeshConflictError: ``mesh_name`` is already registered here (an ``AssertionError``
                too, as in verl).
            ValueError: the source has no mesh, lacks ``source_mesh``, or has several
                disagreeing meshes and no ``source_mesh`` was given.

        Example:
            >>> fused.set_dispatch_collect("actor", **actor.get_dispatch_collect())
            >>> fused.query_dispatch_info("actor") == actor.query_dispatch_info("actor")
            True
        """
        if isinstance(dispatch_dp_rank, Mapping) or isinstance(collect_dp_rank, Mapping):
            dp_rank, is_collect = _pick_source_mesh(mesh_name, dispatch_dp_rank, collect_dp_rank, source_mesh)
        else:
            dp_rank, is_collect = dispatch_dp_rank, collect_dp_rank
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


__all__ = ["Worker"]
