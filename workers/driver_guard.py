"""The driver's metadata-only rule, enforced: a worker-group proxy that refuses tensors.

:class:`MetadataOnlyGroup` wraps a worker group. Every method call through it checks, on the
driver, that the arguments and the result are metadata: ``KVBatchMeta``, plain scalars and
strings, and lists / tuples / dicts of those. A tensor, TensorDict, numpy array or raw bytes
anywhere in them raises :class:`DriverDataError`, naming the method and where the value sat,
before anything is dispatched (for arguments) or handed back (for results). It also counts the
bytes that pass through the driver (the pickled size of arguments and results, what Ray ships
for them), so a run can report driver traffic next to store traffic.

``dp.StreamRequest`` and ``dp.StreamResult`` (and the bridge's ``StreamReport``) count as
metadata when every field holds metadata: a stream request names a partition, a task, fields and
a built-in sampler's parameters; a result holds counts, timings and metric dicts.

:meth:`MetadataOnlyGroup.submit` starts a call without waiting (the same dispatch, execution and
collect as a plain call, split in two): the driver can keep several stages in flight and collect
their results later, each wait with a timeout.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import TYPE_CHECKING, Any

import dataplane as dp

if TYPE_CHECKING:
    from ray import ObjectRef

    from controlplane.binding import GroupMethod, Launched

__all__ = ["DriverDataError", "MetadataOnlyGroup"]

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

    def __reduce__(self) -> tuple[object, ...]:
        # Rebuilt from its fields (args holds only the message), so str() is the message after pickle too.
        return (DriverDataError, (self.method, self.where, self.kind))


def check_metadata(value: object, method: str, where: str) -> None:
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
    if isinstance(value, (dp.StreamRequest, dp.StreamResult)):
        for field in dataclasses.fields(value):
            check_metadata(getattr(value, field.name), method, f"{where}.{field.name}")
        return
    if isinstance(value, dp.Sampler):
        spec = value.spec()
        if spec is None:
            raise DriverDataError(method, where, f"sampler of its own ({type(value).__qualname__})")
        check_metadata(spec, method, where)
        return
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

    def submit(self, method: str, *args: Any, **kwargs: Any) -> PendingCall:
        """Start ``group.<method>(*args, **kwargs)`` and return at once; :meth:`PendingCall.result`
        collects it. Arguments are checked (and nothing dispatched) as for a plain call.

        The group method must be a controller ``GroupMethod`` (its ``launch`` and ``finish`` are the
        two halves of a plain call, padding and unpadding included); calls to one worker from this
        driver run in submission order.

        Raises:
            DriverDataError: an argument holds data.

        Example:
            >>> request = dp.StreamRequest("step3", "reward", 64, ["responses"])
            >>> pending = reward.submit("compute_reward", request)
            >>> pending.result(timeout=60)  # a StreamReport
        """
        label = f"{self._name}.{method}"
        check_metadata(list(args), label, "args")
        check_metadata(kwargs, label, "kwargs")
        bound = getattr(self._group, method)
        launched = bound.launch(*args, **kwargs)
        self.driver_bytes += len(pickle.dumps((args, kwargs)))
        return PendingCall(self, label, bound, launched)


class PendingCall:
    """A submitted group call: its per-rank ``ObjectRef`` s and, once collected, its result.

    Attributes:
        label: ``"<group>.<method>"``.
    """

    def __init__(self, guard: MetadataOnlyGroup, label: str, bound: GroupMethod, launched: Launched) -> None:
        self._guard = guard
        self.label = label
        self._bound = bound
        self._launched = launched
        refs = launched.refs
        self._rank_zero = not isinstance(refs, list)
        self._refs = [refs] if self._rank_zero else list(refs)
        self._result: Any = None
        self._collected = False

    def __repr__(self) -> str:
        return f"<pending {self.label} ({'collected' if self._collected else 'in flight'})>"

    @property
    def refs(self) -> list[ObjectRef]:
        """The per-rank ``ObjectRef`` s (one for a rank-zero method)."""
        return list(self._refs)

    def done(self) -> bool:
        """True when every rank has answered (collecting then does not wait)."""
        import ray

        if self._collected:
            return True
        ready, _ = ray.wait(self._refs, num_returns=len(self._refs), timeout=0, fetch_local=False)
        return len(ready) == len(self._refs)

    def result(self, timeout: float) -> Any:
        """Wait up to ``timeout`` seconds, collect as the plain call would, check it is metadata.

        Raises:
            TimeoutError: not every rank answered in time (the call keeps running).
            DriverDataError: the result holds data.
            WorkerCallError: ranks raised (names them; also of the first cause's class).
            WorkerDiedError: a worker died.
        """
        if self._collected:
            return self._result
        group = self._bound.worker_group
        # The controller's wait: one error naming the failed ranks (or the dead worker).
        values = group._wait(self._refs, timeout, method=self._bound.method_name)
        result = self._bound.finish(self._launched, values[0] if self._rank_zero else values)
        check_metadata(result, self.label, "result")
        self._guard.driver_bytes += len(pickle.dumps(result))
        self._result, self._collected = result, True
        return result
