"""Colocation: several role workers in one Ray actor process.

``create_colocated_worker_cls({"actor": spec_a, "critic": spec_b})`` builds a new actor class
that, in its constructor, instantiates each role's class locally (same process, same rank
environment). The driver reaches a role through one dispatcher method,
``_colocated_call(role, method, ...)``, so role methods never clash and no user class is
modified. ``RayWorkerGroup.spawn`` / ``fuse`` give one group view per role.

Example:
    >>> spec = create_colocated_worker_cls({"actor": RayClassWithInitArgs(Actor),
    ...                                     "critic": RayClassWithInitArgs(Critic, lr=1e-4)})
    >>> wg = RayWorkerGroup(pool, spec)
    >>> views = wg.spawn({"actor", "critic"})
    >>> views["actor"].generate(batch)     # runs Actor.generate in the shared processes
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from controlplane.class_with_init_args import ClassWithInitArgs, RayClassWithInitArgs
from controlplane.worker import Worker

logger = logging.getLogger(__name__)


class ColocatedWorker(Worker):
    """Holds one instance per role; subclasses set ``_role_specs = {role: (cls, args, kwargs)}``."""

    _role_specs: dict[str, tuple[type, tuple, dict]] = {}

    def __init__(self) -> None:
        super().__init__()
        self.worker_dict: dict[str, Any] = {}
        for role, (cls, args, kwargs) in self._role_specs.items():
            self.worker_dict[role] = cls(*args, **kwargs)

    def _role_method(self, role: str, method: str) -> Any:
        worker = self.worker_dict.get(role)
        if worker is None:
            raise ValueError(f"no role {role!r} in {type(self).__name__}; roles: {sorted(self.worker_dict)}")
        fn = getattr(worker, method, None)
        if fn is None or not callable(fn):
            raise AttributeError(f"role {role!r} ({type(worker).__name__}) has no method {method!r}")
        return fn

    def _colocated_call(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``worker_dict[role].method(*args, **kwargs)`` (sync role methods)."""
        return self._role_method(role, method)(*args, **kwargs)

    def get_role_pids(self) -> dict[str, int]:
        """Every role's process id (all the same: that is the point)."""
        return {role: self.get_pid() for role in self.worker_dict}


async def _colocated_call_async(
    self: ColocatedWorker, role: str, method: str, *args: Any, **kwargs: Any
) -> Any:
    """Await ``worker_dict[role].method(*args, **kwargs)`` (async role methods)."""
    return await self._role_method(role, method)(*args, **kwargs)


def _has_async_methods(cls: type) -> bool:
    return any(inspect.iscoroutinefunction(fn) for _, fn in inspect.getmembers(cls, callable))


def create_colocated_worker_cls(
    class_dict: dict[str, ClassWithInitArgs], name: str | None = None
) -> RayClassWithInitArgs:
    """One actor class holding a worker per role.

    Args:
        class_dict: role -> the role's class and constructor arguments. Role names must be
            identifiers (they become attribute names with ``fuse``).
        name: the generated class's name (default ``Colocated_<role1>_<role2>...``).

    Returns:
        A :class:`RayClassWithInitArgs` for the colocated class; its ``colocated_roles`` maps each
        role to its user class (what ``spawn`` binds).

    Raises:
        ValueError: empty ``class_dict`` or a role name that is not an identifier.
        TypeError: a value is not a ``ClassWithInitArgs``.
    """
    import ray

    if not class_dict:
        raise ValueError("create_colocated_worker_cls needs at least one role")
    specs: dict[str, tuple[type, tuple, dict]] = {}
    for role, spec in class_dict.items():
        if not isinstance(role, str) or not role.isidentifier():
            raise ValueError(f"role name {role!r} must be an identifier")
        if not isinstance(spec, ClassWithInitArgs):
            raise TypeError(f"role {role!r}: expected a RayClassWithInitArgs, got {type(spec).__name__}")
        specs[role] = (spec.user_cls, tuple(spec.args), dict(spec.kwargs))
    namespace: dict[str, Any] = {"_role_specs": specs, "__module__": __name__}
    if any(_has_async_methods(cls) for cls, _, _ in specs.values()):
        namespace["_colocated_call_async"] = _colocated_call_async
    cls_name = name or "Colocated_" + "_".join(specs)
    colocated = type(cls_name, (ColocatedWorker,), namespace)
    result = RayClassWithInitArgs(ray.remote(colocated))
    result.colocated_roles = {role: cls for role, (cls, _, _) in specs.items()}
    return result
