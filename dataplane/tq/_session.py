"""This process's link to the store and to the ``TransferQueueController`` actor, and the attach that
every ``dataplane.tq`` call makes first.

TransferQueue attaches by itself in a process of the cluster that never called ``init``; so does
this module: the first call finds the controller in the ``transfer_queue`` namespace, reads the
config every process shares from it (store name, polling mode, sampler) and attaches to the store.
Calls to the controller have a deadline (``DATAPLANE_TQ_CONTROLLER_TIMEOUT_S``, default 60 s).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.actor import ActorHandle

from dataplane import api
from dataplane._tq_controller import CONTROLLER_NAME, CONTROLLER_NAMESPACE, Controller, TQConfig
from dataplane.config import tq_controller_timeout_s
from dataplane.errors import StoreNotInitializedError


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.controller: ActorHandle | None = None  # handle of the controller in CONTROLLER_NAMESPACE
        self.config: TQConfig | None = None
        self.started: list[ActorHandle] = []  # controller actors this process created (tq.close kills them)


state = _State()


def timeout_s() -> float:
    return tq_controller_timeout_s()


def _find(namespace: str) -> ActorHandle | None:
    import ray

    named = {(a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)}
    # (asked by listing first: a failed get_actor of a name that is then created cancels the creation)
    if (namespace, CONTROLLER_NAME) not in named:
        return None
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=namespace)
    except ValueError:  # it died between the listing and the lookup
        return None


def start_controllers(config: TQConfig) -> ActorHandle:
    """The controller in TransferQueue's namespace (and one in the caller's when it differs): found,
    or started by this process. Returns the handle of the first once those it started are up.

    Waiting for them matters: a controller attaches to the store as it starts, and one still starting
    when this process exits (a script that fails right after ``tq.init()``) found the store already
    stopped by the exit and printed its own ``StoreNotInitializedError`` after the user's error.
    """
    import ray

    created = []
    primary = _find(CONTROLLER_NAMESPACE)
    if primary is None:
        try:
            primary = (
                ray.remote(Controller)
                .options(name=CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE, num_cpus=0, max_restarts=0)
                .remote(config)
            )
            created.append(primary)
        except ValueError:  # another process created it first
            primary = ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
    here = ray.get_runtime_context().namespace
    if here != CONTROLLER_NAMESPACE and _find(here) is None:
        try:
            second = (
                ray.remote(Controller)
                .options(name=CONTROLLER_NAME, namespace=here, num_cpus=0, max_restarts=0)
                .remote(config, primary)
            )
            created.append(second)
        except ValueError:
            pass
    state.started.extend(created)
    _wait_started(created)
    return primary


def _wait_started(handles: list[ActorHandle]) -> None:
    """Until every controller in ``handles`` has run its constructor (both start at once)."""
    import ray

    if not handles:
        return
    try:
        ray.get([h.ping.remote() for h in handles], timeout=timeout_s())
    except ray.exceptions.GetTimeoutError as exc:
        raise TimeoutError(
            f"the TransferQueueController did not start within {timeout_s():.0f} s "
            "(DATAPLANE_TQ_CONTROLLER_TIMEOUT_S); does the cluster have room for one more actor?"
        ) from exc


def attach() -> TQConfig:
    """Make sure this process is attached (store and controller); returns the shared config.

    Raises:
        StoreNotInitializedError: Ray is not initialised in this process, or no store runs.
    """
    known = state.config
    if known is not None and api.is_initialized():
        return known
    with state.lock:
        if state.config is not None and api.is_initialized():
            return state.config
        import ray

        if not ray.is_initialized():
            raise StoreNotInitializedError(
                "dataplane.tq: this process is not part of a Ray cluster: call tq.init() (it joins "
                "or starts one) before the other calls"
            )
        handle = state.controller or _find(CONTROLLER_NAMESPACE)
        if handle is None:
            # A store started with dp.init() (no TransferQueue controller yet): attach to it and
            # give it a controller; none at all: the caller must start one with tq.init().
            info = api.init(attach_only=True) if not api.is_initialized() else api._state.info
            assert info is not None
            handle = start_controllers(default_config(info.extra.get("name", "dataplane")))
        config: TQConfig = call(handle, "get_config")
        api.init(name=config["store"], attach_only=True)
        state.controller, state.config = handle, config
        return config


def default_config(store: str) -> TQConfig:
    return {"store": store, "polling_mode": False, "sampler": None}


def controller() -> ActorHandle:
    attach()
    return state.controller


def call(handle: ActorHandle, method: str, *args: object) -> Any:
    """One controller call, waited for with a deadline (its answer is what ``method`` returns)."""
    import ray

    ref = getattr(handle, method).remote(*args)
    try:
        return ray.get(ref, timeout=timeout_s())
    except ray.exceptions.GetTimeoutError as exc:
        raise TimeoutError(
            f"the TransferQueueController did not answer {method} within {timeout_s():.0f} s "
            "(DATAPLANE_TQ_CONTROLLER_TIMEOUT_S); is its process alive?"
        ) from exc


def ask(method: str, *args: object) -> Any:
    """``call`` on this process's controller (attaching first)."""
    return call(controller(), method, *args)


def tell(method: str, *args: object) -> None:
    """A controller call whose answer nobody waits for (bookkeeping: schemas, forgetting indexes).

    Calls from one process run in the order they were made, so this process's next ``ask`` sees it.
    """
    getattr(controller(), method).remote(*args)


def close() -> None:
    """Forget the link; kill the controllers this process started."""
    import ray

    with state.lock:
        for actor in state.started:
            try:
                ray.kill(actor)
            except Exception:  # already gone with its node or the cluster
                pass
        state.started = []
        state.controller = state.config = None


__all__ = [
    "ask",
    "attach",
    "call",
    "close",
    "controller",
    "default_config",
    "start_controllers",
    "state",
    "tell",
]
