"""Worker groups: one driver-side object that drives N worker actors as one.

``RayWorkerGroup(pool, RayClassWithInitArgs(MyWorker))`` starts one actor per pool slot and
binds every ``@register`` method of ``MyWorker`` as a group method
(``wg.method(data)`` = dispatch -> execute on every rank -> wait -> collect). Groups can also
attach to existing (detached) actors by name or handle, and a colocated group can be split
into one view per role with :meth:`RayWorkerGroup.spawn`.

Example:
    >>> pool = RayResourcePool([4], use_gpu=False, max_colocate_count=1)
    >>> wg = RayWorkerGroup(pool, RayClassWithInitArgs(MyWorker))
    >>> wg.ping()                           # a Dispatch.ONE_TO_ALL method
    [0, 1, 2, 3]
"""

from __future__ import annotations

import inspect
import logging
import secrets
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from controlplane._actor_launch import launch_group
from controlplane._liveness import AlivenessWatcher, LivenessProbe, actor_id_hex, dead_worker_error
from controlplane.class_with_init_args import ClassWithInitArgs, RayClassWithInitArgs
from controlplane.errors import WorkerDiedError
from controlplane.resource_pool import ResourcePool

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

logger = logging.getLogger(__name__)


class _Remote(Protocol):
    """A worker method as the group calls it (an actor method, or ``_RoutedMethod``)."""

    def remote(self, *args: object, **kwargs: object) -> ObjectRef: ...


class WorkerGroup:
    """Backend-neutral part of a group: rank bookkeeping, mesh-info caches, aliveness.

    Subclasses fill ``_workers`` / ``_worker_names`` through :meth:`_set_workers` and implement
    ``execute_all_async`` and ``_wait``. ``resource_pool`` is taken for verl's signature; the
    subclass decides what to start on it.
    """

    def __init__(self, resource_pool: ResourcePool | None, **kwargs: object) -> None:
        if kwargs:  # a misspelt option must not be dropped silently
            from controlplane._strict import init_parameter_names, unknown_kwargs_error

            raise unknown_kwargs_error(f"{type(self).__name__}()", kwargs, init_parameter_names(type(self)))
        self._workers: list[ActorHandle] = []
        self._worker_names: list[str] = []
        self._dispatch_info: dict[str, list[int]] = {}
        self._collect_info: dict[str, list[bool]] = {}
        self._master_addr: str | None = None
        self._master_port: str | None = None
        self._watcher: AlivenessWatcher | None = None

    # ---- membership ---------------------------------------------------------------------
    def _set_workers(self, workers: Sequence[ActorHandle], names: Sequence[str]) -> None:
        """Replace the members; cached mesh info belongs to the old members and is dropped."""
        self._workers = list(workers)
        self._worker_names = list(names)
        self.invalidate_mesh_cache()

    def invalidate_mesh_cache(self) -> None:
        self._dispatch_info.clear()
        self._collect_info.clear()

    @property
    def world_size(self) -> int:
        return len(self._workers)

    @property
    def workers(self) -> list[ActorHandle]:
        return list(self._workers)

    @property
    def worker_names(self) -> list[str]:
        return list(self._worker_names)

    @property
    def master_address(self) -> str | None:
        return self._master_addr

    @property
    def master_port(self) -> str | None:
        return self._master_port

    # ---- mesh information (used by nd dispatch) ----------------------------------------------
    def _get_dispatch_info(self, mesh_name: str) -> list[int]:
        """The dp rank of every global rank in ``mesh_name`` (queried once, then cached)."""
        if mesh_name not in self._dispatch_info:
            info = self._query_all("_query_dispatch_info", mesh_name)
            if any(not isinstance(r, int) or r < 0 for r in info):
                raise ValueError(f"mesh {mesh_name!r}: invalid dp ranks {info}")
            missing = sorted(set(range(max(info) + 1)) - set(info))
            if missing:
                raise ValueError(f"mesh {mesh_name!r}: dp ranks {missing} have no worker (got {info})")
            self._dispatch_info[mesh_name] = info
        return list(self._dispatch_info[mesh_name])

    def _get_collect_info(self, mesh_name: str) -> list[bool]:
        """Whether each global rank's output is kept in ``mesh_name`` (queried once, then cached)."""
        if mesh_name not in self._collect_info:
            info = [bool(x) for x in self._query_all("_query_collect_info", mesh_name)]
            if not any(info):
                raise ValueError(f"mesh {mesh_name!r}: no rank is registered as a collect rank")
            self._collect_info[mesh_name] = info
        return list(self._collect_info[mesh_name])

    def _query_all(self, method_name: str, mesh_name: str) -> list[Any]:
        # (what the workers reported: checked by the callers)
        info = self._wait(self.execute_all_async(method_name, [mesh_name] * self.world_size))
        if len(info) != self.world_size:
            raise RuntimeError(f"mesh {mesh_name!r}: {len(info)} answers for {self.world_size} workers")
        return list(info)

    # ---- aliveness -----------------------------------------------------------------------
    def start_worker_aliveness_check(
        self, every_n_seconds: float = 1.0, on_dead: Callable[[WorkerDiedError], None] | None = None
    ) -> None:
        """Watch the workers in a daemon thread; after a death, every group call raises
        :class:`WorkerDiedError` naming the dead worker (``on_dead`` is also called once)."""
        self.stop_worker_aliveness_check()
        self._watcher = AlivenessWatcher(
            LivenessProbe(self._workers, self._worker_names), every_n_seconds, on_dead
        )
        self._watcher.start()

    def stop_worker_aliveness_check(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None

    def _raise_if_known_dead(self) -> None:
        if self._watcher is not None and self._watcher.error is not None:
            raise self._watcher.error

    def _check_alive(self, timeout_s: float = 5.0) -> None:
        """Raise :class:`WorkerDiedError` if a worker is known dead (busy workers count as alive)."""
        self._raise_if_known_dead()
        error = LivenessProbe(self._workers, self._worker_names).poll(timeout_s)
        if error is not None:
            raise error

    def execute_all_async(self, method_name: str, *args: object, **kwargs: object) -> list[ObjectRef]:
        raise NotImplementedError

    def _wait(
        self, refs: ObjectRef | Sequence[ObjectRef], timeout: float | None = None, method: str | None = None
    ) -> Any:
        raise NotImplementedError


class RayWorkerGroup(WorkerGroup):
    """A group of Ray actors driven as one.

    Built (1) from a :class:`RayResourcePool` or (2) a :class:`SubRayResourcePool`, starting one
    actor per slot, or (3) from existing actors (``resource_pool=None`` with ``worker_names`` or
    ``worker_handles``; see :meth:`from_detached`).

    Args:
        resource_pool: where to start the workers; None to attach to existing ones.
        ray_cls_with_init: the worker class and its constructor arguments.
        bin_pack: STRICT_PACK placement groups (else PACK) when the pool is not yet placed.
        name_prefix: prefix of actor names (random if None).
        detached: actors outlive this driver (pair with a ``detached=True`` pool).
        worker_names / worker_handles: existing actors to attach to, in rank order.
        worker_env: extra environment variables for every worker (cannot override RANK etc.).
        num_cpus_per_worker: logical CPUs each actor requests (a fraction of its bundle).
        namespace: Ray namespace for named actors (for attaching from another driver).
        ready_timeout_s: how long to wait for every actor's constructor.
        call_timeout_s: default deadline of every wait for results (None: no deadline; a dead
            worker still raises :class:`WorkerDiedError` at once).
        device_name: the accelerator each worker gets when the group uses GPUs, as in verl:
            ``"cuda"`` (Ray's ``GPU`` resource), ``"npu"`` (the ``NPU`` resource) or ``"cpu"``
            (no accelerator); default: the pool's ``device_name``. The pool's placement groups
            are built with the same resource.
        ray_wait_register_center_timeout: verl's name for ``ready_timeout_s`` (wins if given).
        profile_steps, worker_nsight_options: verl's profiler settings, accepted and ignored
            (with a warning).

    Raises:
        TypeError: an unknown keyword argument (named, with the closest known one).
        ValueError: an unknown ``device_name``; GPUs asked of a CPU-only pool.

    Example:
        >>> wg = RayWorkerGroup(pool, RayClassWithInitArgs(MyWorker), name_prefix="actor",
        ...                     call_timeout_s=600, device_name="cuda")
    """

    def __init__(
        self,
        resource_pool: ResourcePool | None = None,
        ray_cls_with_init: RayClassWithInitArgs | None = None,
        bin_pack: bool = True,
        name_prefix: str | None = None,
        detached: bool = False,
        worker_names: Sequence[str] | None = None,
        worker_handles: Sequence[ActorHandle] | None = None,
        *,
        master_addr: str | None = None,
        master_port: int | None = None,
        use_gpu: bool | None = None,
        worker_env: dict[str, str] | None = None,
        num_cpus_per_worker: float = 0.1,
        namespace: str | None = None,
        ready_timeout_s: float = 300.0,
        call_timeout_s: float | None = None,
        device_name: str | None = None,
        ray_wait_register_center_timeout: float | None = None,
        profile_steps: object = None,
        worker_nsight_options: object = None,
        **kwargs: object,
    ) -> None:
        from controlplane._devices import accelerator_resource

        super().__init__(resource_pool, **kwargs)
        if device_name is None:  # verl passes it explicitly; here the pool's is the default
            device_name = getattr(resource_pool, "device_name", "cuda")
        accelerator_resource(device_name)  # an unknown device name fails before anything starts
        self.device_name = device_name
        if ray_wait_register_center_timeout is not None:
            ready_timeout_s = ray_wait_register_center_timeout
        if profile_steps is not None or worker_nsight_options is not None:
            # verl's trainer passes its profiler settings; accepted so its code runs, but said aloud.
            logger.warning(
                "RayWorkerGroup: profile_steps / worker_nsight_options are accepted for verl "
                "compatibility and ignored (no profiler integration here)"
            )
        self.call_timeout_s = call_timeout_s
        if ray_cls_with_init is not None and not isinstance(ray_cls_with_init, ClassWithInitArgs):
            raise TypeError(f"ray_cls_with_init must be a RayClassWithInitArgs, got {ray_cls_with_init!r}")
        self.ray_cls_with_init = ray_cls_with_init
        self.name_prefix = name_prefix if name_prefix is not None else secrets.token_hex(3)
        self._role: str | None = None
        self._role_async: frozenset[str] = frozenset()
        self._method_cache: dict[str, list[_Remote]] = {}
        self.wg_dict: dict[str, RayWorkerGroup] | None = None
        if (master_addr is None) != (master_port is None):
            raise ValueError("give both master_addr and master_port, or neither")
        if resource_pool is None:
            self._attach(worker_names, worker_handles, namespace)
        else:
            if ray_cls_with_init is None:
                raise ValueError("a group built from a resource pool needs ray_cls_with_init")
            launched = launch_group(
                resource_pool,
                ray_cls_with_init,
                name_prefix=self.name_prefix,
                bin_pack=bin_pack,
                detached=detached,
                master=None if master_addr is None or master_port is None else (master_addr, master_port),
                use_gpu=use_gpu,
                worker_env=worker_env,
                num_cpus=num_cpus_per_worker,
                namespace=namespace,
                device_name=device_name,
            )
            self._master_addr, self._master_port = launched.master_addr, str(launched.master_port)
            self._set_workers(launched.workers, launched.names)
            self._wait_until_ready(ready_timeout_s)
        if ray_cls_with_init is not None:
            self._bind(ray_cls_with_init.user_cls)

    def _set_workers(self, workers: Sequence[ActorHandle], names: Sequence[str]) -> None:
        self._method_cache = {}  # handles of the old members
        super()._set_workers(workers, names)

    # ---- construction paths ------------------------------------------------------------------
    def _wait_until_ready(self, timeout_s: float) -> None:
        """Wait until every actor's constructor ran; if one failed, kill them all, then raise.

        Raises:
            WorkerDiedError: a constructor failed (the message names the worker).
            TimeoutError: not every constructor finished within ``timeout_s``.
        """
        try:
            self._wait(
                [w.__ray_ready__.remote() for w in self._workers], timeout=timeout_s, method="__init__"
            )
        except BaseException:
            self.kill()  # a half-started group is of no use, and detached actors would outlive us
            raise
        logger.info("group %s: %d workers ready (%s)", self.name_prefix, self.world_size, self._worker_names)

    def _attach(
        self, names: Sequence[str] | None, handles: Sequence[ActorHandle] | None, namespace: str | None
    ) -> None:
        import ray

        if handles is not None:  # handles are strong references; get_actor results are not
            handles = list(handles)
            names = list(names) if names is not None else [f"actor-{actor_id_hex(h)[:12]}" for h in handles]
        elif names is not None:
            handles = []
            for name in names:
                try:
                    handles.append(ray.get_actor(name, namespace=namespace))
                except ValueError as exc:
                    raise ValueError(f"no live actor named {name!r} in namespace {namespace!r}") from exc
            names = list(names)
        else:
            raise ValueError("attaching needs worker_names or worker_handles")
        if len(names) != len(handles) or not handles:
            raise ValueError(f"{len(names)} worker names for {len(handles)} handles")
        self._set_workers(handles, names)

    def _bind(self, user_cls: type) -> list[str]:
        from controlplane.binding import bind_worker_methods

        self._bound_cls = user_cls
        return bind_worker_methods(self, user_cls)

    def __getattr__(self, name: str) -> Any:
        # (Any: the worker methods bound onto the group are set per instance, unseen by mypy.)
        # Only reached when normal lookup failed: say why a worker method is not a group method.
        message = f"{type(self).__name__!r} object has no attribute {name!r}"
        user_cls = self.__dict__.get("_bound_cls")
        if name.startswith("_") or user_cls is None:
            raise AttributeError(message)
        from controlplane.binding import missing_method_hint

        raise AttributeError(f"{message}; {missing_method_hint(user_cls, name)}")

    @classmethod
    def from_detached(
        cls,
        name_prefix: str | None = None,
        worker_names: Sequence[str] | None = None,
        worker_handles: Sequence[ActorHandle] | None = None,
        ray_cls_with_init: RayClassWithInitArgs | None = None,
        namespace: str | None = None,
        **kwargs: Any,
    ) -> RayWorkerGroup:
        """Attach to existing workers (e.g. detached ones started by another driver).

        Example:
            >>> wg = RayWorkerGroup.from_detached(worker_names=names, namespace="trainer",
            ...                                   ray_cls_with_init=RayClassWithInitArgs(MyWorker))
        """
        return cls(
            resource_pool=None,
            ray_cls_with_init=ray_cls_with_init,
            name_prefix=name_prefix,
            worker_names=worker_names,
            worker_handles=worker_handles,
            namespace=namespace,
            **kwargs,
        )

    # ---- colocated roles -------------------------------------------------------------------
    def _colocated_role_classes(self) -> dict[str, type]:
        """``{role: user class}`` of this group's colocated or fused class (empty otherwise)."""
        from controlplane.colocate import role_classes

        if self.ray_cls_with_init is None:
            return {}
        return role_classes(self.ray_cls_with_init.user_cls)

    def spawn(self, prefix_set: Iterable[str]) -> dict[str, RayWorkerGroup]:
        """One group view per role of a colocated or fused class, over the same actors.

        Each view binds only its role's ``@register`` methods, unprefixed (verl's
        ``wg.actor_step`` is ``views["actor"].step``), routes them to the role's instance in the
        shared process, and keeps its own mesh-info cache. Works the same for
        :func:`create_colocated_worker_cls` and fused classes (verl sends the latter to
        :meth:`spawn_fused`; here both paths give the same views).

        Raises:
            ValueError: a role that the group's class does not hold (none for a plain class).

        Example:
            >>> views = wg.spawn({"actor", "critic"})
            >>> views["actor"].generate(batch)
        """
        roles = self._colocated_role_classes()
        prefix_set = list(prefix_set)
        unknown = [role for role in prefix_set if role not in roles]
        if unknown:
            owner = self.ray_cls_with_init.user_cls.__name__ if self.ray_cls_with_init else "None"
            raise ValueError(
                f"role {unknown[0]!r} is not in this colocated group ({owner}); roles: {sorted(roles)}"
            )
        views = {}
        for role in prefix_set:
            view = type(self)(
                resource_pool=None,
                name_prefix=self.name_prefix,
                worker_names=self._worker_names,
                worker_handles=self._workers,
                call_timeout_s=self.call_timeout_s,
            )
            view._master_addr, view._master_port = self._master_addr, self._master_port
            view._role = role
            view._role_async = frozenset(
                name
                for name, fn in inspect.getmembers(roles[role], callable)
                if inspect.iscoroutinefunction(fn)
            )
            view._bind(roles[role])
            views[role] = view
        return views

    def spawn_fused(self, prefix_set: Iterable[str]) -> dict[str, RayWorkerGroup]:
        """:meth:`spawn` for a group of a fused class (:mod:`controlplane.fused`), by verl's name.

        verl returns deep copies of the whole group with the role's methods added on top; here
        each view holds only its role's methods (the fused class's own methods stay on ``self``).

        Raises:
            TypeError: the group's class is not a fused worker class.

        Example:
            >>> views = wg.spawn_fused({"actor", "critic"})
        """
        from controlplane.fused import is_fused_worker_cls

        user_cls = self.ray_cls_with_init.user_cls if self.ray_cls_with_init is not None else None
        if not is_fused_worker_cls(user_cls):
            name = getattr(user_cls, "__name__", repr(user_cls))
            raise TypeError(
                f"spawn_fused needs a group of a fused worker class, not {name}; build it with "
                "create_colocated_worker_raw_cls or create_colocated_worker_cls_fused"
            )
        return self.spawn(prefix_set)

    def fuse(self, prefix_set: Iterable[str]) -> None:
        """Spawn role views (once per role) and expose them as attributes: ``wg.actor.method(...)``.

        Raises:
            ValueError: a role name is already an attribute of the group, or an unknown role.

        Example:
            >>> wg.fuse({"actor", "critic"})
            >>> wg.actor.generate(batch), wg.critic.value(batch)
        """
        prefix_set = list(prefix_set)
        for role in prefix_set:
            if hasattr(self, role) and not (self.wg_dict and role in self.wg_dict):
                raise ValueError(f"role {role!r} clashes with an attribute of {type(self).__name__}")
        # verl spawns only on the first call; later calls with new roles would silently miss them
        self.wg_dict = dict(self.wg_dict or {})
        missing = [role for role in prefix_set if role not in self.wg_dict]
        if missing:
            self.wg_dict.update(self.spawn(missing))
        for role in prefix_set:
            setattr(self, role, self.wg_dict[role])

    # ---- execution -------------------------------------------------------------------------
    def _actor_methods(self, method_name: str) -> list[_Remote]:
        methods = self._method_cache.get(method_name)
        if methods is None:
            if self._role is None:
                methods = [getattr(w, method_name) for w in self._workers]
            else:  # a role view routes through the colocated actor's dispatcher
                entry = "_colocated_call_async" if method_name in self._role_async else "_colocated_call"
                methods = [_RoutedMethod(getattr(w, entry), self._role, method_name) for w in self._workers]
            self._method_cache[method_name] = methods
        return methods

    def execute_all_async(self, method_name: str, *args: object, **kwargs: object) -> list[ObjectRef]:
        """Call ``method_name`` on every rank; returns one ``ObjectRef`` per rank, in rank order.

        Arguments follow verl's rule (see :mod:`controlplane.per_rank`): when every positional
        and keyword argument is a ``list`` of length ``world_size``, rank ``i`` gets element
        ``i`` of each; otherwise every rank gets all arguments whole. ``PerRank(values)`` and
        ``Broadcast(value)`` say it explicitly (then only ``PerRank`` arguments are scattered).

        Raises:
            ValueError: a ``PerRank`` argument whose length is not ``world_size``.
            WorkerDiedError: the aliveness check already found a dead worker.

        Example:
            >>> ray.get(wg.execute_all_async("foo", 3))             # broadcast
            [5, 5, 5, 5]
            >>> ray.get(wg.execute_all_async("foo", [1, 2, 3, 4]))  # scattered
            [3, 4, 5, 6]
        """
        from controlplane.per_rank import split_for_ranks

        self._raise_if_known_dead()
        calls = split_for_ranks(args, kwargs, len(self._workers), method_name)
        methods = self._actor_methods(method_name)
        return [m.remote(*a, **k) for m, (a, k) in zip(methods, calls, strict=True)]

    execute_all = execute_all_async

    def execute_all_sync(self, method_name: str, *args: object, **kwargs: object) -> list[Any]:
        """:meth:`execute_all_async`, then wait for every result."""
        results: list[Any] = self._wait(
            self.execute_all_async(method_name, *args, **kwargs), method=method_name
        )
        return results

    def execute_rank_zero_async(self, method_name: str, *args: object, **kwargs: object) -> ObjectRef:
        """Call ``method_name`` on rank 0 only; returns its ``ObjectRef``.

        As in verl, the arguments reach rank 0 whole: a list of length ``world_size`` is *not*
        cut to its first element. ``PerRank(values)`` gives rank 0 ``values[0]`` and
        ``Broadcast(value)`` gives ``value``; a bound ``Execute.RANK_ZERO`` method's dispatch
        output is marked per rank by the binding, so rank 0 gets its own entry.

        Raises:
            ValueError: a ``PerRank`` argument whose length is not ``world_size``.

        Example:
            >>> ray.get(wg.execute_rank_zero_async("total", [1, 2]))   # rank 0 gets [1, 2]
            3
        """
        from controlplane.per_rank import for_rank_zero

        self._raise_if_known_dead()
        args, kwargs = for_rank_zero(args, kwargs, len(self._workers), method_name)
        return self._actor_methods(method_name)[0].remote(*args, **kwargs)

    execute_rank_zero = execute_rank_zero_async

    def execute_rank_zero_sync(self, method_name: str, *args: object, **kwargs: object) -> Any:
        return self._wait(self.execute_rank_zero_async(method_name, *args, **kwargs), method=method_name)

    def _wait(
        self, refs: ObjectRef | Sequence[ObjectRef], timeout: float | None = None, method: str | None = None
    ) -> Any:
        """``ray.get`` of per-rank results that reports a failure once, naming the rank(s).

        Args:
            refs: one ``ObjectRef`` per rank (rank order), or rank 0's single ref.
            timeout: seconds; default ``call_timeout_s``.
            method: the worker method, for the error message.

        Raises:
            WorkerCallError: ranks raised; names them, the method and the first rank's error, and
                is also an instance of that error's class (``except KeyError`` still works).
            WorkerDiedError: a worker died before answering.
            TimeoutError: ``timeout`` seconds passed first (the refs can be waited on again).
        """
        from ray.exceptions import GetTimeoutError

        from controlplane._results import get_results

        if timeout is None:
            timeout = self.call_timeout_s
        try:
            return get_results(
                refs,
                timeout,
                method=self._call_label(method),
                world_size=self.world_size,
                died=self._died_rank,
            )
        except GetTimeoutError as exc:
            self._check_alive(timeout_s=0.5)  # a death explains the timeout better than the timeout
            raise TimeoutError(f"group {self.name_prefix}: no result within {timeout}s") from exc

    def _call_label(self, method: str | None) -> str:
        """``"<WorkerClass>.<method>"`` (``"<role>.<method>"`` for a role view) for messages."""
        owner = self._role or getattr(getattr(self.ray_cls_with_init, "user_cls", None), "__name__", None)
        name = method or "a call"
        return f"{owner}.{name}" if owner and method else f"{name} of group {self.name_prefix}"

    def _died_rank(self, rank: int, exc: BaseException) -> WorkerDiedError:
        if 0 <= rank < len(self._worker_names):
            return dead_worker_error(rank, self._worker_names[rank], exc)
        return self._died(exc)

    def _died(self, exc: BaseException) -> WorkerDiedError:
        actor_id = getattr(exc, "actor_id", None)
        for rank, worker in enumerate(self._workers):
            if actor_id is not None and actor_id_hex(worker) == str(actor_id):
                return dead_worker_error(rank, self._worker_names[rank], exc)
        try:
            self._check_alive(timeout_s=2.0)
        except WorkerDiedError as found:
            return found
        return WorkerDiedError(f"a worker of group {self.name_prefix} is dead: {str(exc).strip()[:500]}")

    def kill(self) -> None:
        """Kill every actor of the group (detached ones too)."""
        import ray

        self.stop_worker_aliveness_check()
        for worker in self._workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception as exc:  # already gone
                logger.debug("kill failed: %s", exc)


class _RoutedMethod:
    """``worker.<role>.<method>.remote`` for a colocated actor, as one ``.remote`` callable."""

    __slots__ = ("_entry", "_role", "_method")

    def __init__(self, entry: _Remote, role: str, method: str) -> None:
        self._entry, self._role, self._method = entry, role, method

    def remote(self, *args: object, **kwargs: object) -> ObjectRef:
        return self._entry.remote(self._role, self._method, *args, **kwargs)


__all__ = ["RayWorkerGroup", "WorkerGroup"]
