"""Fetching a group call's per-rank results on the driver, with one error when ranks fail.

``ray.get`` over the ranks' refs raises the first failure it meets, as a long ``RayTaskError``
that does not say which rank raised, and leaves the other ranks' failed results unread: Ray then
logs each of them again as "Unhandled error" when the refs are dropped. :func:`get_results`
fetches the same way on success (one ``ray.get``), and on failure reads every rank's result,
raises one :class:`~controlplane.errors.WorkerCallError` naming the failed ranks (or
:class:`~controlplane.errors.WorkerDiedError` for a dead one), and marks results still running
as read when they arrive, so nothing is reported twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from controlplane.errors import WorkerDiedError, make_call_error

logger = logging.getLogger(__name__)

# After one rank of a group call fails, how long the driver waits for the other ranks before it
# reports: ranks failing on the same bug finish within this, and all of them are named. A rank
# still running then (e.g. blocked in a collective with the failed one) is not waited for.
_FAILURE_GRACE_S = 1.0
_READ_READY_S = 10.0  # reading a result ray.wait reported ready (fetched already): a bound, not a wait


def get_results(
    refs: Any,
    timeout: float | None,
    *,
    method: str,
    world_size: int | None,
    died: Callable[[int, BaseException], WorkerDiedError],
) -> Any:
    """``ray.get(refs, timeout)``, turning failed ranks into one error (runs on the driver).

    Args:
        refs: one ``ObjectRef`` per rank in rank order, or a single ref (rank 0).
        timeout: seconds, or ``None`` for no deadline. A ``GetTimeoutError`` propagates unchanged
            (the caller names the group) and the refs stay unread, so the caller may wait again.
        method: label for the error message, e.g. ``"Scorer.score"``.
        world_size: the group's size, for the message.
        died: builds the error for a rank whose actor died.

    Raises:
        WorkerCallError: one or more ranks raised; also an instance of the first cause's class.
        WorkerDiedError: a rank's actor died (it explains the other ranks' failures too).
    """
    import ray
    from ray.exceptions import GetTimeoutError, RayError

    try:
        return ray.get(refs, timeout=timeout)
    except GetTimeoutError:
        raise
    except RayError as exc:
        first: BaseException = exc
    # Read the ranks outside the except block, so the report does not chain this first error twice.
    failures = _read_failures(list(refs) if isinstance(refs, list) else [refs])
    if not failures:  # cannot happen (the ref that failed is ready), but never lose the error
        raise first
    dead = [(rank, exc) for rank, exc in failures.items() if _is_actor_death(exc)]
    if dead:
        rank, death = dead[0]
        raise died(rank, death) from death
    ranks = sorted(failures)
    # Chained without its driver-side frames (Ray's get internals): what remains is the worker's
    # traceback, printed once above the one-line report.
    first = failures[ranks[0]].with_traceback(None)
    error = make_call_error(
        method,
        ranks,
        _user_cause(first),
        errors={rank: _user_cause(err) for rank, err in failures.items()},
        world_size=world_size,
        remote_traceback=str(first),
    )
    if error.concise:  # the message says all; the worker's traceback stays in .remote_traceback
        raise error from None
    raise error from first


def _read_failures(refs: list[Any]) -> dict[int, BaseException]:
    """Every rank's error among ``refs``: read what is ready within a short grace period (ranks
    failing on the same bug finish together), and mark the rest read when they finish."""
    import ray
    from ray.exceptions import GetTimeoutError

    deadline = time.monotonic() + _FAILURE_GRACE_S
    pending = list(refs)
    ready: list[Any] = []
    while pending:  # ray.wait returns early once everything is ready
        left = deadline - time.monotonic()
        if left <= 0:
            break
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=left)
        ready.extend(done)
    failures: dict[int, BaseException] = {}
    index = {ref: rank for rank, ref in enumerate(refs)}
    for ref in ready:
        try:
            ray.get(ref, timeout=_READ_READY_S)
        except GetTimeoutError:
            pending.append(ref)  # ready but not fetched in time: read when it is
        except Exception as exc:
            failures[index[ref]] = exc
    for ref in pending:  # still running: read its result when it comes, so Ray does not log it
        ref.future().add_done_callback(_discard)
    return failures


def _discard(future: Any) -> None:
    exc = future.exception()
    if exc is not None:
        logger.debug("a rank of an already failed call failed later: %s", (str(exc).splitlines() or [""])[0])


def _is_actor_death(exc: BaseException) -> bool:
    from ray.exceptions import RayActorError

    return isinstance(exc, RayActorError)


def _user_cause(exc: BaseException) -> BaseException:
    """The exception the worker's code raised, without Ray's wrappers (nested calls included)."""
    from ray.exceptions import RayTaskError

    seen = 0
    while isinstance(exc, RayTaskError) and getattr(exc, "cause", None) is not None and seen < 8:
        if exc.cause is exc:
            break
        exc, seen = exc.cause, seen + 1
    return exc


__all__ = ["get_results"]
