"""Memory of the store's shards, as the store accounts it and as the OS sees it (RSS).

Used by the store benchmark (driver side). ``dp.stats()`` gives each shard's ``bytes_resident`` (shared
memory it holds, including warm free segments) and ``pid``; RSS and its anonymous / shared-memory /
file parts come from ``/proc/<pid>/status``. RSS counts only pages a shard has mapped, so shared
memory that clients fill but the shard never touches shows in ``bytes_resident`` and not in RSS;
the bytes of the memfd files a shard holds open (``/proc/<pid>/fd``) fill that gap, and
``os_resident`` adds them up without double counting. The shards must run on this host.
"""

from __future__ import annotations

import os
import time
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensordict import TensorDict


def shard_entries(stats: object) -> list[dict[str, Any]]:
    """The per-shard dicts in ``dp.stats()``, whether it is a list, ``{"shards": ...}`` or ``{id: {...}}``."""
    if isinstance(stats, dict) and "shards" in stats:
        stats = stats["shards"]
    if isinstance(stats, dict):
        stats = [dict(v, shard=k) for k, v in stats.items() if isinstance(v, dict)]
    if not isinstance(stats, list):
        raise TypeError(f"dp.stats() returned {type(stats).__name__}; expected per-shard dicts")
    return [s for s in stats if isinstance(s, dict)]


def _memfd_bytes(pid: int) -> int:
    """Bytes allocated to the memfd files that process ``pid`` holds open (mapped or not)."""
    total = 0
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            if os.readlink(f"{fd_dir}/{fd}").startswith("/memfd:"):
                total += os.stat(f"{fd_dir}/{fd}").st_blocks * 512
        except OSError:  # the fd closed between listdir and stat
            continue
    return total


def _process_memory(pid: int) -> dict[str, int]:
    """RSS of a process, its anonymous / shared-memory / file parts, and its memfd bytes.

    ``os_resident`` = RSS + memfd bytes - mapped shared memory: what the process keeps resident,
    counting a memfd page once whether or not the process has it mapped.
    """
    import psutil

    out = {"rss": psutil.Process(pid).memory_info().rss}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("RssAnon", "RssShmem", "RssFile"):
                out[name.lower().replace("rss", "rss_")] = int(value.split()[0]) * 1024
    out["memfd"] = _memfd_bytes(pid)
    out["os_resident"] = out["rss"] + out["memfd"] - out.get("rss_shmem", 0)
    return out


def shard_memory(dp: ModuleType) -> dict[str, Any]:
    """Sums over the shards: ``dp.stats()`` byte accounting and their processes' RSS (with parts).

    See the module docstring for what each figure counts.
    """
    import psutil

    shards = shard_entries(dp.stats())
    out: dict[str, Any] = {
        "bytes_resident": sum(int(s.get("bytes_resident", 0)) for s in shards),
        "bytes_used": sum(int(s.get("bytes_used", 0)) for s in shards),
        "shards": len(shards),
    }
    try:
        for shard in shards:
            for key, value in _process_memory(int(shard["pid"])).items():
                out[key] = out.get(key, 0) + value
    except (KeyError, TypeError, ValueError, OSError, psutil.Error) as exc:  # e.g. a shard on another host
        out["os_resident"] = out["rss"] = None
        out["os_error"] = f"{type(exc).__name__}: {exc}"
    return out


def _wait_released(
    dp: ModuleType, baseline: dict[str, Any], limit: float, wait_s: float
) -> tuple[dict[str, Any], float]:
    """Poll the shards' memory until it is within ``limit`` bytes of ``baseline`` or ``wait_s`` passes."""
    start = time.perf_counter()
    while True:
        now = shard_memory(dp)
        waited = time.perf_counter() - start
        if now["bytes_resident"] - baseline["bytes_resident"] <= limit or waited >= wait_s:
            return now, round(waited, 3)
        time.sleep(0.2)  # polling the store's accounting, bounded by wait_s


def store_memory(
    dp: ModuleType, keys: list[str], partition_id: str, td: TensorDict, payload_bytes: int, wait_s: float
) -> dict[str, Any]:
    """Shard memory empty, holding ``td`` under ``keys``, and after clear (polled up to ``wait_s``).

    "Empty" is measured after one put/get/clear of a single row, so one-time costs (code paths,
    lazily imported modules, connections) are not charged to the payload; the store as it was
    right after ``init`` is reported as ``cold``.
    """
    cold = shard_memory(dp)
    dp.kv_batch_put(keys[:1], partition_id, td[:1])
    dp.kv_batch_get(keys[:1], partition_id)
    dp.kv_clear(keys[:1], partition_id)
    empty, _ = _wait_released(dp, cold, 0, wait_s)
    dp.kv_batch_put(keys, partition_id, td)
    held = shard_memory(dp)
    dp.kv_clear(keys, partition_id)
    after, waited = _wait_released(dp, empty, 0.1 * payload_bytes, wait_s)
    return {"cold": cold, "empty": empty, "held": held, "after_clear": after, "release_waited_s": waited}
