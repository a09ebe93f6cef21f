"""workers: where the data plane and the control plane meet.

Engine workers on a small torch model, a GRPO trainer whose driver handles metadata only,
and the bridge: a ``@register`` method called with a ``dataplane.KVBatchMeta`` receives its
shard's rows and writes its per-row outputs back (``workers.bridge`` explains it; its ``tqbridge``
and ``bridged_register`` decorators add the bridge's ``call_on_empty`` option).

Example:
    >>> from controlplane import Dispatch, Worker, register
    >>> class Scorer(Worker):
    ...     @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)   # register bridges by itself
    ...     def score(self, batch): ...
"""

import importlib as _importlib
import importlib.util as _importlib_util
import typing as _typing

# Each public name is written once, in the ``__all__`` of the module that defines it; this front door
# hands out those modules' names. They are imported on first use, so that a light module of this
# package (``workers.config``, ``workers.checkpoints``: what ``rlplane demo`` checks its flags and
# ``--resume`` with) loads neither torch nor Ray. A type checker sees plain imports instead.
_MODULES = ("workers.bridge", "workers.driver_guard")

if _typing.TYPE_CHECKING:
    from workers.bridge import *  # noqa: F403
    from workers.driver_guard import *  # noqa: F403

    __all__: list[str]
else:

    def __getattr__(name: str) -> _typing.Any:
        if name.startswith("__") and name != "__all__":  # probes (__wrapped__, ...): nothing to load
            raise AttributeError(f"module 'workers' has no attribute {name!r}")
        if _importlib_util.find_spec(f"workers.{name}") is not None:
            # `from workers import checkpoints` asks for the attribute first: a submodule loads alone
            return _importlib.import_module(f"workers.{name}")
        modules = [_importlib.import_module(m) for m in _MODULES]
        if name == "__all__":
            return [n for module in modules for n in module.__all__]
        for module in modules:
            if name in module.__all__:
                return getattr(module, name)
        raise AttributeError(f"module 'workers' has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*globals(), *__getattr__("__all__")})
