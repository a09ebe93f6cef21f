"""Error types of the control plane, so callers can catch them as one family."""

from __future__ import annotations


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

    Also a ``ValueError`` (what this package raised before) and an ``AssertionError`` (what verl's
    ``Worker.set_dispatch_collect`` raises), so code written for either keeps catching it.
    """

    def __init__(self, message: str, *, mesh_name: str | None = None) -> None:
        super().__init__(message)
        self.mesh_name = mesh_name
