"""Is a store actor dead? Asked by the transports when a reply is late, so a dead shard or index
fails calls within seconds instead of after the whole ``rpc_timeout_s``.

Two ways to know, the cheap one first:

* **Same host, same pid namespace**: the actor's process is identified by its pid and its start
  time (``/proc/<pid>/stat``), recorded in the registry; a process that is gone, a zombie, or a
  reused pid with another start time is dead. Checked once at attach time to be usable here (in
  another pid namespace the pid means nothing, and that target falls back to Ray).
* **Anywhere else**: the ``remote_dead`` check its owner passes in: Ray's in practice
  (``service.liveness.ray_says_dead``: a ping to the named actor raises ``RayActorError`` once Ray
  has marked it dead, a lookup that finds no such actor means dead too, a ping that is merely slow
  means alive). Without one, a remote target is never found dead here (its calls still end at their
  deadline).

Store actors never restart (``max_restarts=0``), so a target found dead stays dead. ``on_dead``
hears of each once, with its name (the store's metrics count them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Set
from dataclasses import dataclass

RECHECK_S = 0.5  # a target's answer is reused this long, so a burst of late calls asks once


def process_start(pid: int) -> str:
    """The start time of process ``pid`` (clock ticks since boot, as text), or "" if it is not running."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return ""
    fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    if len(fields) < 20 or fields[0] in ("Z", "X"):  # zombie or dead: gone, only not yet reaped
        return ""
    return fields[19]


@dataclass
class Target:
    """One store actor: its Ray name and the process that serves it."""

    name: str
    pid: int
    pid_start: str
    local: bool  # same host: /proc may tell (checked at construction)
    actor_id: str = ""  # Ray's id of the actor, so one started again under the name is not taken for it


class Liveness:
    """Answers ``dead(target)`` for the store's actors. Thread-safe."""

    def __init__(
        self,
        targets: dict[int, Target],
        on_dead: Callable[[str], None] | None = None,
        remote_dead: Callable[[str, str], bool] | None = None,
    ) -> None:
        self.targets = targets
        self._on_dead = on_dead
        self._remote_dead = remote_dead
        for t in targets.values():  # a pid we cannot recognise now (other pid namespace) is not ours
            t.local = t.local and bool(t.pid_start) and process_start(t.pid) == t.pid_start
        self._dead: set[int] = set()
        self._checked: dict[int, float] = {}
        self._lock = threading.Lock()

    def known_dead(self, target: int) -> bool:
        return target in self._dead

    @property
    def known(self) -> Set[int]:
        """The targets found dead so far: a live view (it grows; never write to it)."""
        return self._dead

    def dead(self, target: int) -> bool:
        """Whether ``target`` is dead now (may call ``remote_dead``, e.g. a Ray ping of up to 2 s, for a
        target whose pid namespace is not this process's)."""
        if target in self._dead:
            return True
        t = self.targets.get(target)
        if t is None:
            return False
        if t.local:
            gone = process_start(t.pid) != t.pid_start
        else:
            with self._lock:
                now = time.monotonic()
                if now - self._checked.get(target, -RECHECK_S) < RECHECK_S:
                    return False
                self._checked[target] = now
            gone = self._remote_dead is not None and self._remote_dead(t.name, t.actor_id)
        if gone:
            with self._lock:
                first = target not in self._dead
                self._dead.add(target)
            if first and self._on_dead is not None:
                self._on_dead(t.name)
        return gone
