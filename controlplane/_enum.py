"""An enum whose members can be added at run time and keep their identity across processes.

``Dispatch`` and ``Execute`` are built on it: users register custom dispatch modes after
import, and a member sent through Ray (pickled and unpickled in a worker, then sent back)
resolves to the *same* singleton by name, so ``mode is Dispatch.ONE_TO_ALL`` keeps working.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Self, cast


def _member_by_name(enum_cls: type[DynamicEnum], name: str) -> DynamicEnum:
    """Unpickling hook: find the live member by name (registering it if this process lacks it)."""
    member = enum_cls.from_name(name)
    if member is None:
        # A custom mode registered in the driver only: recreate it by name here so the
        # identity (by name) still holds within this process.
        member = enum_cls.register(name)
    return member


class _DynamicEnumMeta(type):
    # Every class of this metaclass is a DynamicEnum, which sets its own ``_members``.
    _members: dict[str, DynamicEnum]

    def __iter__(cls) -> Iterator[DynamicEnum]:
        return iter(cls._members.values())

    def __contains__(cls, item: object) -> bool:
        if isinstance(item, str):
            return item.upper() in cls._members
        return isinstance(item, cls) and cls._members.get(item.name) is item

    def __getitem__(cls, name: str) -> DynamicEnum:
        member = cast("type[DynamicEnum]", cls).from_name(name)
        if member is None:
            raise KeyError(f"{cls.__name__} has no member {name!r}; known: {list(cls._members)}")
        return member

    def __len__(cls) -> int:
        return len(cls._members)


class DynamicEnum(metaclass=_DynamicEnumMeta):
    """Base class of an extensible enum; subclass it and ``register`` members.

    Members compare by identity; pickling resolves by name to the live singleton.

    Example:
        >>> class Color(DynamicEnum):
        ...     _members = {}
        >>> RED = Color.register("red")
        >>> Color.RED is RED and Color["red"] is RED
        True
    """

    _members: dict[str, DynamicEnum] = {}

    def __init__(self, name: str, value: int) -> None:
        self.name = name
        self.value = value

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._members = {}

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.name}: {self.value}>"

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _member_by_name, (type(self), self.name)

    def __copy__(self) -> DynamicEnum:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> DynamicEnum:
        return self

    @classmethod
    def register(cls, name: str) -> Self:
        """Add a member named ``name.upper()``; ``ValueError`` if it exists."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"{cls.__name__} member name must be an identifier, got {name!r}")
        key = name.upper()
        if key in cls._members:
            raise ValueError(f"{cls.__name__}.{key} is already registered")
        member = cls(key, max((m.value for m in cls._members.values()), default=-1) + 1)
        cls._members[key] = member
        setattr(cls, key, member)
        return member

    @classmethod
    def remove(cls, name: str) -> DynamicEnum:
        """Remove a member by name; ``KeyError`` if it does not exist."""
        key = name.upper()
        if key not in cls._members:
            raise KeyError(f"{cls.__name__} has no member {key!r}")
        member = cls._members.pop(key)
        delattr(cls, key)
        return member

    @classmethod
    def from_name(cls, name: str) -> Self | None:
        """The member called ``name`` (case-insensitive), or ``None``."""
        # A class's members are instances of that class (``__init_subclass__`` gives each its own dict).
        return cast("Self | None", cls._members.get(name.upper()) if isinstance(name, str) else None)

    @classmethod
    def names(cls) -> list[str]:
        return list(cls._members)

    @classmethod
    def values(cls) -> list[DynamicEnum]:
        return list(cls._members.values())
