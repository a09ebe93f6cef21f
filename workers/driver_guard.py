"""The driver's metadata-only rule, enforced: a worker-group proxy that refuses tensors.

:class:`MetadataOnlyGroup` wraps a worker group. Every method call through it checks, on the
driver, that the arguments and the result are metadata: ``KVBatchMeta``, plain scalars and
strings, and lists / tuples / dicts of those. A tensor, TensorDict, numpy array or raw bytes
anywhere in them raises :class:`DriverDataError`, naming the method and where the value sat,
before anything is dispatched (for arguments) or handed back (for results). It also counts the
bytes that pass through the driver (the pickled size of arguments and results, what Ray ships
for them), so a run can report driver traffic next to store traffic.
"""

from __future__ import annotations

import pickle
from typing import Any

import dataplane as dp

__all__ = ["DriverDataError", "MetadataOnlyGroup", "check_metadata"]

_PLAIN = (str, int, float, bool, type(None))


class DriverDataError(TypeError):
    """Real data (a tensor, array or bytes) reached the driver in strict metadata-only mode.

    Raised on the driver; nothing was dispatched (for an argument). Fix the call site: put the
    data in the store and pass its ``KVBatchMeta``, or return metrics as plain floats.
    """

    def __init__(self, method: str, where: str, kind: str) -> None:
        super().__init__(
            f"{method}: {where} is a {kind}; the driver handles metadata only. Put data in the store "
            "(dp.kv_batch_put) and pass its KVBatchMeta, or return plain numbers"
        )
        self.method, self.where, self.kind = method, where, kind
        self.args = (method, where, kind)

    def __reduce__(self) -> tuple:
        return (DriverDataError, (self.method, self.where, self.kind))


def check_metadata(value: Any, method: str, where: str) -> None:
    """Raise :class:`DriverDataError` if ``value`` holds anything but metadata.

    Example:
        >>> check_metadata({"reward": 0.5, "keys": ["a"]}, "wg.f", "result")
        >>> import torch
        >>> check_metadata([torch.zeros(1)], "wg.f", "args[0]")
        Traceback (most recent call last):
        ...
        workers.driver_guard.DriverDataError: wg.f: args[0][0] is a torch.Tensor; ...
    """
    if type(value) in _PLAIN or isinstance(value, dp.KVBatchMeta):
        return  # KVBatchMeta validates itself: it refuses tensors in keys, tags and extra_info
    if isinstance(value, dict):
        for k, v in value.items():
            check_metadata(v, method, f"{where}[{k!r}]")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_metadata(v, method, f"{where}[{i}]")
        return
    kind = type(value)
    raise DriverDataError(method, where, f"{kind.__module__}.{kind.__qualname__}")


class MetadataOnlyGroup:
    """A worker group whose calls may carry metadata only; counts the bytes through the driver.

    Args:
        group: the worker group (any object whose methods are the bound group methods).
        name: a label for error messages (e.g. ``"actor"``).

    Attributes:
        driver_bytes: total pickled bytes of arguments and results of calls made through it.

    Example:
        >>> actor = MetadataOnlyGroup(actor_wg, "actor")
        >>> meta = actor.compute_log_prob(meta)    # fine: metadata in, metadata out
        >>> actor.compute_log_prob(tensordict)     # raises DriverDataError, dispatches nothing
    """

    def __init__(self, group: Any, name: str) -> None:
        self._group = group
        self._name = name
        self.driver_bytes = 0

    @property
    def group(self) -> Any:
        """The wrapped worker group (for lifecycle calls such as ``kill``)."""
        return self._group

    def __getattr__(self, method: str) -> Any:
        target = getattr(self._group, method)
        if not callable(target):
            return target
        label = f"{self._name}.{method}"

        def call(*args: Any, **kwargs: Any) -> Any:
            check_metadata(list(args), label, "args")
            check_metadata(kwargs, label, "kwargs")
            result = target(*args, **kwargs)
            check_metadata(result, label, "result")
            self.driver_bytes += len(pickle.dumps((args, kwargs))) + len(pickle.dumps(result))
            return result

        call.__name__ = method
        return call
