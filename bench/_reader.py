"""The reader: a Ray actor that fetches the benchmark payload from each store under test.

Runs in its own Ray worker process. Every ``read_*`` method ends with every field's bytes held in
the actor, then returns only a small summary (byte count and two sampled values per field) so the
reply costs the same for every path. What "held" means per path, so the comparison is fair:

- ``read_ray(refs)``: ``ray.get`` of an object reference. Ray unpickles torch tensors into the
  actor's private memory (one copy out of the shared-memory object store; ``backing`` below shows
  where the bytes live), so no extra copy is made.
- ``read_tq``: ``transfer_queue.kv_batch_get``; the data arrives over zmq into the actor's memory and
  TransferQueue re-nests it (dense fields come back as jagged nested tensors). No extra copy is made.
- ``read_store(copy=None)``: ``dataplane.kv_batch_get`` with the API's default (copy-out), or with
  ``copy=False`` when the API offers zero-copy views. No extra copy is made.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

if TYPE_CHECKING:
    from ray import ObjectRef


class Summary(TypedDict):
    """What a reader saw: the bytes, each field's first and last element, where the bytes live."""

    nbytes: int
    samples: dict[str, list[float]]
    backing: NotRequired[dict[str, str]]  # per field, the mapping that holds it (probe=True)


def backing(address: int) -> str:
    """What memory ``address`` lives in, from ``/proc/self/maps``: a file path, ``[anon]`` or ``?``."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= address < hi:
                    return parts[5].strip() if len(parts) > 5 else "[anon]"
    except OSError:
        pass
    return "?"


def summarize_fields(td: Any, *, copy: bool = False, probe: bool = False) -> Summary:
    """Byte count and first/last element of every field of ``td`` (dense or jagged nested tensors).

    With ``copy=True`` each field is cloned first (the bytes end up in this process's own memory).
    With ``probe=True`` the summary also says, per field, which mapping holds its bytes.
    """
    nbytes = 0
    where: dict[str, str] = {}
    samples: dict[str, list[float]] = {}
    for name in sorted(td.keys()):
        value = td[name]
        flat = value.values() if getattr(value, "is_nested", False) else value
        if probe:
            where[name] = backing(flat.data_ptr())
        if copy:
            flat = flat.clone()
        flat = flat.reshape(-1)
        nbytes += flat.numel() * flat.element_size()
        samples[name] = [float(flat[0]), float(flat[-1])] if flat.numel() else []
        del flat
    out: Summary = {"nbytes": nbytes, "samples": samples}
    if probe:
        out["backing"] = where
    return out


class Reader:
    """Actor body; wrap with ``ray.remote(Reader).options(num_cpus=...)`` to create one."""

    def pid(self) -> int:
        return os.getpid()

    def noop(self, x: object = None) -> None:
        """The bare Ray actor call that single-key latencies are compared against (with and without x)."""
        return None

    def read_ray(self, refs: list[ObjectRef], probe: bool = False) -> Summary:
        import ray

        # The reference arrives wrapped in a list so Ray does not resolve it before the call.
        td = ray.get(refs[0])
        return summarize_fields(td, probe=probe)

    def attach_tq(self) -> None:
        import transfer_queue as tq

        tq.init()

    def read_tq(self, keys: list[str], partition_id: str, probe: bool = False) -> Summary:
        import transfer_queue as tq

        return summarize_fields(tq.kv_batch_get(keys, partition_id), probe=probe)

    def attach_store(self, transport: str = "auto") -> None:
        import dataplane as dp

        dp.init(transport=transport)

    def read_store(
        self, keys: list[str], partition_id: str, copy: bool | None = None, probe: bool = False
    ) -> Summary:
        import dataplane as dp

        kwargs: dict[str, Any] = {} if copy is None else {"copy": copy}
        return summarize_fields(dp.kv_batch_get(keys, partition_id, **kwargs), probe=probe)
