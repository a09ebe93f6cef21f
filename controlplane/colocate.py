"""Colocation: several role workers in one Ray actor process (verl's ``WorkerDict``).

``create_colocated_worker_cls({"actor": spec_a, "critic": spec_b})`` builds a new actor class
that, in its constructor, instantiates each role's class locally (same process, same rank
environment). The roles are reached three ways:

* the colocated group itself: every ``@register`` method ``m`` of role ``r`` is bound as
  ``wg.r_m(...)`` (verl's prefix convention), with the role's dispatch mode, execute mode and
  blocking flag, sync or ``async def``;
* role views: ``wg.spawn({"actor", "critic"})`` gives one group per role over the same actors,
  with the role's methods unprefixed; ``wg.fuse(...)`` sets them as ``wg.actor`` / ``wg.critic``;
* on the actor: ``_colocated_call(role, method, ...)`` (what role views use), or ``worker_dict``.

The user classes are never modified: the prefixed methods live on the generated class only.
For roles that call each other in one process, see :mod:`controlplane.fused`.

Example:
    >>> spec = create_colocated_worker_cls({"actor": RayClassWithInitArgs(Actor),
    ...                                     "critic": RayClassWithInitArgs(Critic, lr=1e-4)})
    >>> wg = RayWorkerGroup(pool, spec)
    >>> wg.actor_generate(batch)           # Actor.generate in the shared processes
    >>> views = wg.spawn({"actor", "critic"})
    >>> views["critic"].value(batch)       # Critic.value, same processes
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from controlplane.binding import registered_methods
from controlplane.class_with_init_args import ClassWithInitArgs, RayClassWithInitArgs
from controlplane.decorator import MAGIC_ATTR
from controlplane.worker import Worker

# role -> (its class, the constructor's positional and keyword arguments)
RoleSpecs = dict[str, tuple[type, tuple[object, ...], dict[str, object]]]


class RoleHost(Worker):
    """Base of the generated colocated classes: holds one instance per role.

    Subclasses set ``_role_specs = {role: (cls, args, kwargs)}``; :meth:`_build_roles` fills
    ``_role_instances`` in that order.
    """

    _role_specs: RoleSpecs = {}

    def _build_roles(self) -> dict[str, Any]:
        self._role_instances: dict[str, Any] = {}
        for role, (cls, args, kwargs) in self._role_specs.items():
            self._role_instances[role] = cls(*args, **kwargs)
        return self._role_instances

    def _role_method(self, role: str, method: str) -> Callable[..., Any]:
        worker = self._role_instances.get(role)
        if worker is None:
            raise ValueError(
                f"no role {role!r} in {type(self).__name__}; roles: {sorted(self._role_instances)}"
            )
        fn: Callable[..., Any] | None = getattr(worker, method, None)
        if fn is None or not callable(fn):
            raise AttributeError(f"role {role!r} ({type(worker).__name__}) has no method {method!r}")
        return fn

    def _colocated_call(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``<role instance>.method(*args, **kwargs)`` (sync role methods)."""
        return self._role_method(role, method)(*args, **kwargs)

    # A group bound to the colocated class itself (``wg.actor_step``) asks the *host* for mesh
    # info, but the roles registered their meshes on themselves: answer for them.
    def query_dispatch_info(self, mesh_name: str) -> int:
        return self._mesh_answer(mesh_name, "dispatch", super().query_dispatch_info)

    def query_collect_info(self, mesh_name: str) -> bool:
        return bool(self._mesh_answer(mesh_name, "collect", super().query_collect_info))

    def _mesh_answer(self, mesh_name: str, kind: str, own: Callable[[str], int]) -> int:
        if mesh_name in self.get_dispatch_collect()[kind]:
            return own(mesh_name)
        answers = {
            role: info[kind][mesh_name]
            for role, info in self._role_mesh_info().items()
            if mesh_name in info[kind]
        }
        if not answers:
            return own(mesh_name)  # raises: not registered anywhere
        if len(set(answers.values())) > 1:
            raise ValueError(
                f"mesh {mesh_name!r} is registered differently by roles {answers} of "
                f"{type(self).__name__} rank {self.rank}; call the method through a role view (wg.spawn)"
            )
        return next(iter(answers.values()))

    def _role_mesh_info(self) -> dict[str, dict[str, dict[str, int]]]:
        return {
            role: worker.get_dispatch_collect()
            for role, worker in self._role_instances.items()
            if callable(getattr(worker, "get_dispatch_collect", None))
        }


async def _colocated_call_async(self: RoleHost, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
    """Await ``<role instance>.method(*args, **kwargs)`` (async role methods)."""
    return await self._role_method(role, method)(*args, **kwargs)


class ColocatedWorker(RoleHost):
    """verl's ``WorkerDict``: ``worker_dict[role]`` is the role's instance in this process."""

    def __init__(self) -> None:
        super().__init__()
        self.worker_dict: dict[str, Any] = self._build_roles()


# ---- building the classes ------------------------------------------------------------------
def role_classes(user_cls: object) -> dict[str, type]:
    """``{role: user class}`` of a colocated or fused class (empty for any other class).

    Example:
        >>> role_classes(spec.user_cls)
        {'actor': <class 'Actor'>, 'critic': <class 'Critic'>}
    """
    specs = getattr(user_cls, "_role_specs", None)
    if not isinstance(specs, dict) or not isinstance(user_cls, type) or not issubclass(user_cls, RoleHost):
        return {}
    return {role: cls for role, (cls, _, _) in specs.items()}


def role_specs(class_dict: Mapping[str, ClassWithInitArgs], caller: str) -> RoleSpecs:
    """Validate ``{role: RayClassWithInitArgs}`` and unwrap it to ``{role: (cls, args, kwargs)}``.

    Raises:
        ValueError: empty, or a role name that is not an identifier.
        TypeError: a value is not a ``ClassWithInitArgs``.
    """
    if not class_dict:
        raise ValueError(f"{caller} needs at least one role")
    specs: RoleSpecs = {}
    for role, spec in class_dict.items():
        if not isinstance(role, str) or not role.isidentifier():
            raise ValueError(f"{caller}: role name {role!r} must be an identifier")
        if not isinstance(spec, ClassWithInitArgs):
            got = type(spec).__name__
            raise TypeError(f"{caller}: role {role!r}: expected a RayClassWithInitArgs, got {got}")
        specs[role] = (spec.user_cls, tuple(spec.args), dict(spec.kwargs))
    return specs


def has_async_methods(cls: type) -> bool:
    return any(inspect.iscoroutinefunction(fn) for _, fn in inspect.getmembers(cls, callable))


def _forwarder(role: str, name: str, fn: Callable[..., object]) -> Callable[..., Any]:
    """A method of the host running ``<role instance>.<name>``; it carries the role's
    ``@register`` settings so the group binds it with the role's dispatch/execute/blocking.
    Futures are resolved by the role's own wrapper, so the forwarder passes arguments as is."""
    if inspect.iscoroutinefunction(fn):

        async def forward(self: RoleHost, *args: Any, **kwargs: Any) -> Any:
            return await self._role_method(role, name)(*args, **kwargs)
    else:

        def forward(self: RoleHost, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]  # sync twin
            return self._role_method(role, name)(*args, **kwargs)

    functools.update_wrapper(forward, fn, assigned=("__doc__",), updated=())
    forward.__name__ = forward.__qualname__ = f"{role}_{name}"
    setattr(forward, MAGIC_ATTR, dict(getattr(fn, MAGIC_ATTR)))
    return forward


def prefixed_methods(
    specs: RoleSpecs, base: type, reserved: frozenset[str] = frozenset()
) -> dict[str, Callable[..., Any]]:
    """``{f"{role}_{method}": forwarder}`` for every ``@register`` method of every role.

    Raises:
        ValueError: a prefixed name is taken twice (``a`` + ``b_c`` vs ``a_b`` + ``c``), clashes
            with an attribute of ``base`` (role ``get`` + method ``pid`` would hide ``get_pid``)
            or with a name in ``reserved``.
    """
    methods: dict[str, Callable[..., Any]] = {}
    owner: dict[str, str] = {}
    for role, (cls, _, _) in specs.items():
        for name in registered_methods(cls):
            fn = getattr(cls, name)
            full = f"{role}_{name}"
            where = f"{cls.__name__}.{name} of role {role!r}"
            if full in owner:
                raise ValueError(f"{where} and {owner[full]} both become {full!r}; rename a role or a method")
            if hasattr(base, full) or full in reserved:
                raise ValueError(
                    f"{where} becomes {full!r}, which {base.__name__} already has; rename the role"
                )
            methods[full], owner[full] = _forwarder(role, name, fn), where
    return methods


def host_namespace(specs: RoleSpecs, base: type, reserved: frozenset[str] = frozenset()) -> dict[str, object]:
    """Class attributes of a generated host class: the specs, the prefixed methods and, when a
    role has ``async def`` methods, the async entry point (only then: it makes the actor async)."""
    namespace: dict[str, object] = {"_role_specs": specs, "__module__": base.__module__}
    namespace.update(prefixed_methods(specs, base, reserved))
    if any(has_async_methods(cls) for cls, _, _ in specs.values()):
        namespace["_colocated_call_async"] = _colocated_call_async
    return namespace


def create_colocated_worker_cls(
    class_dict: Mapping[str, ClassWithInitArgs], name: str | None = None
) -> RayClassWithInitArgs:
    """One actor class holding a worker per role (verl's ``WorkerDict``).

    Args:
        class_dict: role -> the role's class and constructor arguments. Role names must be
            identifiers (they become method prefixes, and attribute names with ``fuse``).
        name: the generated class's name (default ``Colocated_<role1>_<role2>...``).

    Returns:
        A :class:`RayClassWithInitArgs` for the colocated class. A group built from it binds
        ``<role>_<method>`` for every ``@register`` method of every role, and ``spawn`` gives
        one view per role (:func:`role_classes` of the class says which).

    Raises:
        ValueError: empty ``class_dict``, a role name that is not an identifier, or two
            prefixed names that clash (see :func:`prefixed_methods`).
        TypeError: a value is not a ``ClassWithInitArgs``.

    Example:
        >>> spec = create_colocated_worker_cls({"actor": RayClassWithInitArgs(Actor)})
        >>> RayWorkerGroup(pool, spec).actor_generate(batch)
    """
    import ray

    specs = role_specs(class_dict, "create_colocated_worker_cls")
    cls_name = name or "Colocated_" + "_".join(specs)
    colocated = type(cls_name, (ColocatedWorker,), host_namespace(specs, ColocatedWorker))
    return RayClassWithInitArgs(ray.remote(colocated))


__all__ = ["create_colocated_worker_cls"]
