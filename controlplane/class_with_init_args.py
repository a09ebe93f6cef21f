"""Deferred construction of workers: a class plus its constructor arguments.

``ClassWithInitArgs`` builds a local object; ``RayClassWithInitArgs`` builds a Ray actor in a
given placement-group bundle (or next to another actor with ``sharing_with``), with per-call
options that never leak into the next worker.

Example:
    >>> spec = RayClassWithInitArgs(MyWorker, lr=1e-3)
    >>> spec.update_options({"max_concurrency": 2})
    >>> actor = spec(placement_group=pg, placement_group_bundle_idx=0, use_gpu=False)
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.util.placement_group import PlacementGroup


def check_init_args(user_cls: type, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    """Refuse constructor arguments ``user_cls.__init__`` cannot take, before any actor starts.

    Only what is certainly wrong is refused: unknown keyword names (unless the constructor takes
    ``**kwargs``), too many positional arguments, a value given twice. Missing arguments are not
    checked (the group or the caller may still add them, e.g. ``cuda_visible_devices``).

    Raises:
        TypeError: naming the class and the offending arguments.
    """
    from controlplane._strict import unknown_kwargs_error

    try:
        sig = inspect.signature(user_cls)
    except (TypeError, ValueError):  # builtins and C types: nothing to check against
        return
    # Ray's tracing adds a keyword-only ``_ray_trace_ctx`` to actor constructors; not the user's
    # (annotations are dropped too: the message shows what can be passed, ``Cls.__init__(x, y=1)``)
    params = [
        p.replace(annotation=p.empty) for p in sig.parameters.values() if not p.name.startswith("_ray_")
    ]
    sig = sig.replace(parameters=params, return_annotation=sig.empty)
    params = list(sig.parameters.values())
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        unknown = set(kwargs) - names
        if unknown:
            raise unknown_kwargs_error(f"{user_cls.__name__}.__init__{sig}", unknown, names)
    try:
        sig.bind_partial(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{user_cls.__name__}.__init__{sig}: {exc}") from None


def check_actor_options(options: dict[str, Any]) -> None:
    """Refuse option names Ray actors do not know (Ray itself would only refuse at start).

    Raises:
        TypeError: naming the unknown options.
    """
    try:  # Ray's own table of actor options; private, so its absence only skips the check
        from ray._common.ray_option_utils import actor_options as known
    except ImportError:
        return
    unknown = set(options) - set(known)
    if unknown:
        from controlplane._strict import unknown_kwargs_error

        raise unknown_kwargs_error("Ray actor options", unknown, known)


def unwrap_actor_class(cls: object) -> type:
    """The user's Python class behind ``ray.remote(cls)`` (or ``cls`` itself if not wrapped)."""
    meta = getattr(cls, "__ray_metadata__", None)
    if meta is None:
        if not isinstance(cls, type):
            raise TypeError(f"expected a class or a Ray actor class, got {cls!r}")
        return cls
    modified = meta.modified_class
    # Ray wraps the class in a subclass; its first base is the user's class.
    user_cls: type = modified.__bases__[0] if modified.__bases__ else modified
    return user_cls


class ClassWithInitArgs:
    """A class and the arguments to build it with, called later.

    Arguments the class's constructor cannot take (an unknown keyword, unless it takes
    ``**kwargs``; too many positional arguments) are refused here with a ``TypeError``, not
    when the workers start.

    Example:
        >>> ClassWithInitArgs(dict, a=1)()
        {'a': 1}
    """

    def __init__(self, cls: Any, *args: Any, **kwargs: Any) -> None:
        self.cls = cls
        self.args = args
        self.kwargs = kwargs
        self.fused_worker_used = False  # verl's attribute (True for fused classes); for verl code
        if isinstance(cls, type) or hasattr(cls, "__ray_metadata__"):  # others fail at user_cls
            check_init_args(self.user_cls, args, kwargs)

    @property
    def user_cls(self) -> type:
        """The plain Python class (for method binding)."""
        return unwrap_actor_class(self.cls)

    def __call__(self) -> Any:
        return self.user_cls(*self.args, **self.kwargs)


class RayClassWithInitArgs(ClassWithInitArgs):
    """A Ray actor class (or plain class, wrapped with ``ray.remote``) with constructor args.

    ``cls`` may be a plain class or one already wrapped by ``ray.remote`` (``@ray.remote``,
    ``@ray.remote(num_cpus=...)``, ``ray.remote(MyWorker)``); the options of the decorator are
    the defaults of every actor, under the placement and resources the group gives it (its
    ``runtime_env`` is kept, with the group's environment variables added).

    Options set with :meth:`update_options` and resources set with
    :meth:`set_additional_resource` apply to every actor built; options passed to
    ``__call__`` apply to that actor only.

    Raises:
        TypeError: constructor arguments ``cls`` cannot take (named), or a non-class ``cls``.

    Example:
        >>> spec = RayClassWithInitArgs(cls=ray.remote(num_cpus=1)(MyWorker), lr=1e-3)
    """

    def __init__(self, cls: Any, *args: Any, **kwargs: Any) -> None:
        import ray

        if getattr(cls, "__ray_metadata__", None) is None:
            cls = ray.remote(cls)
        super().__init__(cls, *args, **kwargs)
        self._options: dict[str, Any] = {}
        self._additional_resource: dict[str, float] = {}

    def update_options(self, options: dict[str, Any]) -> None:
        """Ray actor options for every actor built from now on.

        Raises:
            TypeError: an option name Ray actors do not have (named).
        """
        check_actor_options(options)
        self._options.update(options)

    def set_additional_resource(self, additional_resource: dict[str, float]) -> None:
        """Extra custom resources every actor requests (any number of entries)."""
        self._additional_resource = dict(additional_resource)

    def __call__(
        self,
        placement_group: PlacementGroup | None = None,
        placement_group_bundle_idx: int = 0,
        use_gpu: bool = True,
        num_gpus: float = 1,
        sharing_with: ActorHandle | None = None,
        device_name: str = "cuda",
        *,
        num_cpus: float | None = None,
        options: dict[str, Any] | None = None,
    ) -> ActorHandle:
        """Start one actor and return its handle.

        Args:
            placement_group: where to place it (with ``placement_group_bundle_idx``).
            use_gpu: request ``num_gpus`` GPUs.
            sharing_with: an actor (a :class:`Worker`) to run next to: same node, same devices.
            device_name: the accelerator ``num_gpus`` counts, as in verl: ``"cuda"`` requests
                ``num_gpus``, ``"npu"`` the ``NPU`` resource, ``"cpu"`` none.
            num_cpus: logical CPUs to request.
            options: extra Ray options for this actor only (merged over :meth:`update_options`).
        """
        kwargs = dict(self.kwargs)
        node_id = None
        if sharing_with is not None:
            node_id = _call(sharing_with, "get_node_id")
            if use_gpu:  # share the target's devices instead of asking for new ones
                kwargs["cuda_visible_devices"] = _call(sharing_with, "get_cuda_visible_devices")
        opts = self.actor_options(
            placement_group,
            placement_group_bundle_idx,
            use_gpu=use_gpu,
            num_gpus=num_gpus,
            node_id=node_id,
            num_cpus=num_cpus,
            options=options,
            device_name=device_name,
        )
        return self.cls.options(**opts).remote(*self.args, **kwargs)

    def actor_options(
        self,
        placement_group: PlacementGroup | None = None,
        placement_group_bundle_idx: int = 0,
        *,
        use_gpu: bool = True,
        num_gpus: float = 1,
        node_id: str | None = None,
        num_cpus: float | None = None,
        options: dict[str, Any] | None = None,
        device_name: str = "cuda",
    ) -> dict[str, Any]:
        """The Ray options one actor is started with (a fresh dict; nothing is remembered).

        ``node_id`` (from ``sharing_with``) pins the actor to that node and asks for no GPU of
        its own; otherwise the actor goes into the given placement-group bundle.
        """
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        from controlplane._devices import accelerator_resource

        check_actor_options(options or {})
        opts: dict[str, Any] = {**self._options, **(options or {})}
        if self._additional_resource:
            opts["resources"] = {**opts.get("resources", {}), **self._additional_resource}
        if num_cpus is not None:
            opts["num_cpus"] = num_cpus
        if node_id is not None:
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
            return opts
        if placement_group is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=placement_group, placement_group_bundle_index=placement_group_bundle_idx
            )
        resource = accelerator_resource(device_name) if use_gpu else None
        if resource == "GPU":
            opts["num_gpus"] = num_gpus
        elif resource is not None:  # e.g. "npu": Ray's NPU resource instead of num_gpus, as in verl
            opts["resources"] = {**opts.get("resources", {}), resource: num_gpus}
        return opts


def _call(actor: ActorHandle, method: str) -> Any:
    import ray

    if not hasattr(actor, method):
        raise TypeError(f"sharing_with needs an actor with a {method}() method (a controlplane Worker)")
    return ray.get(getattr(actor, method).remote(), timeout=60)


__all__ = ["ClassWithInitArgs", "RayClassWithInitArgs"]
