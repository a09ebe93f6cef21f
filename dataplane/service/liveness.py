"""Ray's word on whether a store actor is dead: the check ``transport.liveness`` uses for an actor
whose process this one cannot see (another host, another pid namespace)."""

from __future__ import annotations

from dataplane.config import NAMESPACE

RAY_PING_TIMEOUT_S = 2.0


def ray_says_dead(name: str, actor_id: str = "") -> bool:
    """Whether the named store actor (Ray's ``actor_id``, when known) is dead as far as Ray knows: no
    such actor, another actor under its name now (the store was started again), or a ping that raises
    ``RayActorError``. A slow ping (busy, not dead) and a process without Ray say alive."""
    import ray

    if not ray.is_initialized():
        return False
    try:
        handle = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return True  # no such actor any more
    if actor_id and handle._actor_id.hex() != actor_id:
        return True  # the name is another actor's now
    try:
        ray.get(handle.ping.remote(), timeout=RAY_PING_TIMEOUT_S)
    except ray.exceptions.RayActorError:
        return True
    except ray.exceptions.GetTimeoutError:
        return False
    return False


__all__ = ["RAY_PING_TIMEOUT_S", "ray_says_dead"]
