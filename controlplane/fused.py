"""Fused workers: several roles in one process that can call each other (verl's ``FusedWorker``).

``create_colocated_worker_raw_cls({"actor": spec_a, "critic": spec_b})`` returns a plain
:class:`Worker` subclass (not yet a Ray actor) whose constructor builds every role in the
process. Inside it:

* ``self.actor`` / ``self.critic`` and ``self.fused_worker_dict[role]`` are the role instances;
* every role instance gets the same ``fused_worker_dict``, so a role reaches its sibling with
  ``self.fused_worker_dict["critic"]`` (once all roles are built: not from a constructor);
* ``get_fused_worker_by_name(role)`` and verl's ``_fuw_execute("actor_fwmn_step", ...)`` work too.

Subclass it to add methods that combine roles, or use
:func:`create_colocated_worker_cls_fused` for the plain class as a Ray actor. A group over
either binds the class's own ``@register`` methods, the roles' methods as ``<role>_<method>``
(as :func:`~controlplane.colocate.create_colocated_worker_cls` does), and
``wg.spawn`` / ``wg.spawn_fused`` / ``wg.fuse`` give one view per role.

Example:
    >>> Base = create_colocated_worker_raw_cls({"actor": RayClassWithInitArgs(Actor),
    ...                                         "critic": RayClassWithInitArgs(Critic, val=10)})
    >>> class Hybrid(Base):
    ...     @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    ...     def foo(self, x):
    ...         return self.critic.sub(self.actor.add(x))   # one process, no Ray call
    >>> wg = RayWorkerGroup(pool, RayClassWithInitArgs(Hybrid))
    >>> wg.fuse({"actor", "critic"})
    >>> wg.foo(0.1), wg.actor.add(0.1), wg.critic_sub([1, 2])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from controlplane.class_with_init_args import ClassWithInitArgs, RayClassWithInitArgs
from controlplane.colocate import RoleHost, host_namespace, role_classes, role_specs

FUSED_METHOD_SEP = "_fwmn_"  # verl's "fused worker method name" separator in _fuw_execute


class FusedWorker(RoleHost):
    """Holds one instance per role and shares ``fused_worker_dict`` with each of them."""

    is_fused_worker = True  # verl's class marker (read by verl code; here is_fused_worker_cls decides)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        roles = self._build_roles()
        for role, instance in roles.items():
            if hasattr(type(self), role):  # a subclass attribute would be hidden by the role
                raise ValueError(f"role {role!r} clashes with attribute {type(self).__name__}.{role}")
            setattr(self, role, instance)
        self.fused_worker_dict: dict[str, Any] = roles
        # every role sees the same dict: that is how a role reaches its siblings
        for instance in roles.values():
            setattr(instance, self.fused_worker_attr_name, roles)

    def get_fused_worker_by_name(self, worker_name: str) -> Any:
        """The instance of role ``worker_name`` in this process, or None."""
        return self.fused_worker_dict.get(worker_name)

    def _fuw_execute(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """verl's entry point: ``method_name`` is ``"<role>_fwmn_<method>"``.

        Raises:
            ValueError: ``method_name`` has no ``_fwmn_`` or names an unknown role.
            AttributeError: the role has no such method.
        """
        role, sep, method = method_name.partition(FUSED_METHOD_SEP)
        if not sep or not method:
            form = f"<role>{FUSED_METHOD_SEP}<method>"
            raise ValueError(f"_fuw_execute: {method_name!r} is not of the form {form!r}")
        return self._colocated_call(role, method, *args, **kwargs)


def is_fused_worker_cls(cls: Any) -> bool:
    """Whether ``cls`` was built by :func:`create_colocated_worker_raw_cls` (or subclasses it)."""
    return isinstance(cls, type) and issubclass(cls, FusedWorker) and bool(role_classes(cls))


def create_colocated_worker_raw_cls(
    class_dict: Mapping[str, ClassWithInitArgs], *, name: str | None = None
) -> type:
    """The fused worker class for these roles, as a plain class (verl's signature).

    Args:
        class_dict: role -> the role's class and constructor arguments; role names must be
            identifiers (they become attributes of the fused worker and method prefixes).
        name: the class name (default ``FusedWorker_<role1>_<role2>...``, as in verl).

    Returns:
        A :class:`FusedWorker` subclass with ``raw_cls_dict = {role: user class}`` and
        ``is_fused_worker = True``; wrap it (or a subclass) in ``RayClassWithInitArgs``.

    Raises:
        ValueError: empty ``class_dict``, a bad role name, a role named like an attribute of
            the fused worker, or clashing ``<role>_<method>`` names.
        TypeError: a value is not a ``ClassWithInitArgs``.

    Example:
        >>> Base = create_colocated_worker_raw_cls({"actor": RayClassWithInitArgs(Actor)})
        >>> wg = RayWorkerGroup(pool, RayClassWithInitArgs(Base))
        >>> wg.actor_add(1)
    """
    specs = role_specs(class_dict, "create_colocated_worker_raw_cls")
    for role in specs:
        if hasattr(FusedWorker, role):
            raise ValueError(f"role {role!r} clashes with attribute FusedWorker.{role}; rename the role")
    namespace = host_namespace(specs, FusedWorker, reserved=frozenset(specs))
    namespace["raw_cls_dict"] = {role: cls for role, (cls, _, _) in specs.items()}
    return type(name or "FusedWorker_" + "_".join(specs), (FusedWorker,), namespace)


def create_colocated_worker_cls_fused(
    class_dict: Mapping[str, ClassWithInitArgs], *, name: str | None = None
) -> RayClassWithInitArgs:
    """:func:`create_colocated_worker_raw_cls` as a Ray actor class, ready for ``RayWorkerGroup``.

    Example:
        >>> wg = RayWorkerGroup(pool, create_colocated_worker_cls_fused({"actor": a, "critic": c}))
        >>> views = wg.spawn({"actor", "critic"})
    """
    import ray

    raw = create_colocated_worker_raw_cls(class_dict, name=name)
    result = RayClassWithInitArgs(ray.remote(raw))
    result.fused_worker_used = True  # verl's marker; read by verl code, not by this package
    return result


__all__ = ["create_colocated_worker_cls_fused", "create_colocated_worker_raw_cls"]
