"""Error types of the control plane, so callers can catch them as one family."""

from __future__ import annotations

import threading

# A worker-side exception class may set this class attribute to True when its message says all a
# caller needs (a typed error about the caller's input, not a bug in the worker's code): a group
# call failing with it then reports without chaining the worker's traceback (``remote_traceback``
# keeps it). A string protocol, so that a store's errors can opt in without importing this package.
CONCISE_ATTR = "__concise_error__"


class ControlPlaneError(RuntimeError):
    """Base class of every error this package raises on purpose (besides ValueError/TypeError)."""


class ResourceShortageError(ControlPlaneError):
    """The cluster cannot place a resource pool; the message names the shortfall."""


class WorkerDiedError(ControlPlaneError):
    """A worker of a group is dead; the message names it (rank and actor name)."""

    def __init__(self, message: str, *, rank: int | None = None, worker_name: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.worker_name = worker_name


class MeshConflictError(ControlPlaneError, ValueError, AssertionError):
    """A mesh name is registered twice on one worker; the message names the mesh, the worker and
    both registrations.

    Also a ``ValueError`` (a bad argument) and an ``AssertionError`` (what verl's
    ``Worker.set_dispatch_collect`` raises), so code that catches either catches it.
    """

    def __init__(self, message: str, *, mesh_name: str | None = None) -> None:
        super().__init__(message)
        self.mesh_name = mesh_name


class WorkerCallError(ControlPlaneError):
    """A group call raised on one or more ranks; the message names the method, the failed ranks
    and the first rank's error (type and message). Raised on the driver, once per call.

    The instance is also of the first cause's class where Python allows it (a worker's
    ``KeyError`` is caught by ``except KeyError``; its attributes read through), like Ray's
    ``RayTaskError(ValueError)``. Recoverable as far as the workers are: they are alive (a dead
    worker raises :class:`WorkerDiedError` instead); fix what the cause says and call again.

    Attributes:
        method: ``"<WorkerClass>.<method>"`` (as the group knows it).
        failed_ranks: the ranks that raised, sorted.
        cause: the first failed rank's exception, as the worker raised it.
        errors: ``{rank: exception}`` for every failed rank.
        world_size: the group's size, when known.
        remote_traceback: the first failed rank's traceback on the worker, as text (the same
            traceback is chained as ``__cause__`` before the error leaves the driver's wait).

    Example:
        ``wg.score(meta)`` where rank 1 of 2 raised ``KeyError("uid")`` raises what this builds:

        >>> e = make_call_error("Scorer.score", [1], KeyError("uid"), world_size=2)
        >>> isinstance(e, WorkerCallError), isinstance(e, KeyError), e.failed_ranks
        (True, True, [1])
        >>> str(e).split(" (the")[0]
        "Scorer.score failed on rank 1 of 2: KeyError: 'uid'"
    """

    def __init__(
        self,
        method: str,
        failed_ranks: list[int],
        cause: BaseException,
        message: str | None = None,
        *,
        errors: dict[int, BaseException] | None = None,
        world_size: int | None = None,
        remote_traceback: str = "",
    ) -> None:
        self.method = method
        self.failed_ranks = sorted(failed_ranks)
        self.cause = cause
        self.errors = dict(errors) if errors else {self.failed_ranks[0]: cause} if self.failed_ranks else {}
        self.world_size = world_size
        self.remote_traceback = remote_traceback
        super().__init__(message or _call_error_message(method, self.failed_ranks, cause, world_size))

    @property
    def concise(self) -> bool:
        """True when the cause's message says all (see ``CONCISE_ATTR``): no traceback is chained."""
        return bool(getattr(type(self.cause), CONCISE_ATTR, False))

    def __str__(self) -> str:  # a KeyError cause class would otherwise repr() the message
        return str(self.args[0]) if self.args else type(self).__name__

    def __reduce__(self) -> tuple[object, ...]:
        args = (self.method, self.failed_ranks, self.cause, self.args[0])
        state = {
            "errors": self.errors,
            "world_size": self.world_size,
            "remote_traceback": self.remote_traceback,
        }
        if type(self) is not WorkerCallError and type(self) in _DUAL_CLASSES.values():
            # A mixed class is made at run time, so it cannot be found by name: rebuild it the same way.
            return (make_call_error, args, state)
        return (type(self), args, state)

    def __setstate__(self, state: dict[str, object]) -> None:  # type: ignore[override]  # never None
        self.__dict__.update(state)

    def __getattr__(self, name: str) -> object:
        # Attributes of the cause read through (``e.key`` of a KeyNotFoundError), as Ray's dual errors do.
        if name.startswith("__") or name in ("cause", "errors", "method", "failed_ranks", "concise"):
            raise AttributeError(name)
        return getattr(self.cause, name)


def _call_error_message(method: str, ranks: list[int], cause: BaseException, world_size: int | None) -> str:
    of = f" of {world_size}" if world_size is not None else ""
    where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    first = f"; rank {ranks[0]} raised" if len(ranks) > 1 else ":"
    text = str(cause).strip() or "(no message)"
    if getattr(type(cause), CONCISE_ATTR, False):
        return f"{method} failed on {where}{of}{first} {type(cause).__name__}: {text}"
    return (
        f"{method} failed on {where}{of}{first} {type(cause).__name__}: {text} "
        "(the worker's traceback is chained above, and in .remote_traceback)"
    )


_DUAL_CLASSES: dict[type, type] = {}
_DUAL_LOCK = threading.Lock()  # one mixed class per cause class: pickling finds it in the cache


def _dual_class(cause_cls: type) -> type:
    """``WorkerCallError`` mixed with ``cause_cls`` (cached), or plain ``WorkerCallError`` when Python
    refuses the mix (an incompatible layout or constructor, such as some ``OSError`` subclasses)."""
    if issubclass(cause_cls, WorkerCallError):
        return cause_cls  # a nested group call: already a WorkerCallError of the right kind
    if not issubclass(cause_cls, Exception):
        return WorkerCallError
    with _DUAL_LOCK:
        cls = _DUAL_CLASSES.get(cause_cls)
        if cls is None:
            name = f"WorkerCallError({cause_cls.__name__})"
            try:
                cls = type(name, (WorkerCallError, cause_cls), {"__module__": __name__, "__qualname__": name})
                cls("m", [0], Exception("probe"))  # a __new__ that does not fit shows here, not when raised
            except Exception:
                cls = WorkerCallError
            _DUAL_CLASSES[cause_cls] = cls
    return cls


def make_call_error(
    method: str, failed_ranks: list[int], cause: BaseException, message: str | None = None, **kwargs: object
) -> WorkerCallError:
    """A :class:`WorkerCallError` that is also an instance of ``type(cause)`` where possible.

    Example:
        >>> e = make_call_error("W.f", [1], KeyError("k"), world_size=2)
        >>> isinstance(e, KeyError), str(e).split(" (")[0]
        (True, "W.f failed on rank 1 of 2: KeyError: 'k'")
    """
    error: WorkerCallError = _dual_class(type(cause))(method, failed_ranks, cause, message, **kwargs)
    return error


__all__ = [
    "ControlPlaneError",
    "MeshConflictError",
    "ResourceShortageError",
    "WorkerCallError",
    "WorkerDiedError",
]
