"""Where a process runs, as the same-host shortcuts need to know it.

"Same host" is not one fact. Processes on one kernel (equal boot ids) may still sit in different
network, mount or pid namespaces, as two containers or pods on one node do, and each shortcut needs
its own namespace shared:

* the Unix lane (an abstract Unix socket) needs the **network** namespace: abstract names are
  private to one;
* a zmq ``ipc://`` endpoint (a socket file) needs the **mount** namespace: the path must name the
  same file;
* mapping a shard's shared memory (``/proc/<pid>/fd/<n>``), the hosts' memory ledger and the
  ``/proc`` liveness probe need the **pid** namespace: the pid must name the same process.

Each service publishes its ``Locality`` in its registry entry; a client (or a shard linking to the
index) compares it with its own and takes each shortcut only where the namespace it needs is
shared, and tcp otherwise. A namespace is named by its inode in ``nsfs``, unique on one kernel for
as long as the namespace lives, so (boot id, inode) names it on a cluster.

    >>> here = Locality.here()
    >>> here.shares_network(here) and here.shares_files(here) and here.shares_pids(here)
    True
    >>> here.shares_network(Locality.from_dict({"boot_id": here.boot_id}))  # facts missing: not shared
    False
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass
from typing import Any

from dataplane.transport.shm import boot_id


def _namespace(kind: str) -> int:
    """The inode of this process's ``kind`` namespace (0: unknown, e.g. no /proc)."""
    try:
        return os.stat(f"/proc/self/ns/{kind}").st_ino
    except OSError:
        return 0


@dataclass(frozen=True)
class Locality:
    """A process's kernel (boot id) and its network, mount and pid namespaces (0: unknown)."""

    boot_id: str
    net: int = 0
    mnt: int = 0
    pid: int = 0

    @staticmethod
    @functools.cache
    def here() -> Locality:
        """This process's (namespaces do not change under a running store's processes)."""
        return Locality(boot_id(), _namespace("net"), _namespace("mnt"), _namespace("pid"))

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Locality:
        """A registry entry's ``locality`` (what ``to_dict`` wrote); missing facts read as unknown."""
        d = d or {}
        return cls(
            str(d.get("boot_id", "")), int(d.get("net", 0)), int(d.get("mnt", 0)), int(d.get("pid", 0))
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def _same(self, other: Locality, kind: str) -> bool:
        mine, theirs = getattr(self, kind), getattr(other, kind)
        return bool(self.boot_id) and self.boot_id == other.boot_id and mine != 0 and mine == theirs

    def same_kernel(self, other: Locality) -> bool:
        return bool(self.boot_id) and self.boot_id == other.boot_id

    def shares_network(self, other: Locality) -> bool:
        """Abstract Unix sockets of one reach the other (the Unix lane)."""
        return self._same(other, "net")

    def shares_files(self, other: Locality) -> bool:
        """A socket file of one is the same file to the other (``ipc://``)."""
        return self._same(other, "mnt")

    def shares_pids(self, other: Locality) -> bool:
        """A pid of one names the same process to the other (``/proc/<pid>``: mapping, liveness)."""
        return self._same(other, "pid")


__all__ = ["Locality"]
