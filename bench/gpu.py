"""GPU round trip: a CUDA tensor put by one process and read onto the GPU by another, against the
pinned-buffer floor, the naive copy and a device-to-device copy of the same bytes, per payload.

One fresh local Ray (or ``--address``), an embedded store of one shard. Per payload (``--sizes``,
default 16 MiB in 8 rows, 256 MiB and 1 GiB in 64 rows), best of ``--repeats`` rounds of:

1. **store**: the driver puts the rows of one float32 field that live on the GPU
   (``dp.kv_batch_put``: one copy, device -> the shard's shared memory through the writer's mapping
   registered with CUDA); a reader actor in another process gets them with ``device="cuda"`` (one
   copy, the reader's registered mapping -> device) and synchronises. The figure is put time + get
   time (each timed where it runs), checked on the GPU against the writer's sum.
2. **pinned**: in the driver, the same round trip through a pinned host buffer allocated once,
   outside the timing: the floor of a copy staged through host memory.
3. **naive**: ``x.cpu().to("cuda")``, pageable memory, one process.
4. **device-to-device**: ``torch.empty_like(x).copy_(x)`` on the same GPU: what a path that never
   leaves the device would approach (the store keeps host memory; ``docs/gpu.md``).

Printed: one table (GB/s of payload, best of the rounds; the ratios store / pinned, store / naive,
store / device-to-device) and the writer's and reader's copy paths (``transport.pinning`` counts:
direct copies, staged ones, bytes registered). ``--json`` writes ``{"device", "rows": [{"bytes",
"store_gbps", "pinned_gbps", "naive_gbps", "store_vs_pinned", "store_vs_naive"}, ...],
"device_to_device": [{"bytes", "d2d_gbps", "store_vs_d2d"}, ...], "torch", "cuda", "copy_paths"}``.

Without a CUDA device it refuses (exit status 2). ``--device cpu`` runs the same code with CPU
tensors (no pinned or device-to-device figures), so the machinery is exercised where there is no GPU
(the test suite does that).

Usage::

    python -m bench.gpu --json bench/results/gpu.json      # 16M, 256M, 1G on the GPU
    python -m bench.gpu --device cpu --sizes 64K:4 --repeats 1 --json /tmp/gpu.json
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench._common import GB, fmt, ratio, ray_for_run, write_json
from dataplane._units import parse_size

STORE = "bench-gpu"
DEFAULT_SIZES = "16M:8,256M:64,1G:64"
MiB = 1 << 20


class GpuReader:
    """Actor body: attaches to the driver's store and reads the payload onto ``device``."""

    def __init__(self, device: str) -> None:
        import dataplane as dp

        self.device = device
        dp.init(name=STORE)

    def get(self, keys: list[str], pid: str) -> tuple[float, float]:
        """Seconds to get ``keys`` onto the device (synchronised), and the sum of the values."""
        import torch

        import dataplane as dp

        start = time.perf_counter()
        td = dp.kv_batch_get(keys, pid, ["x"], device=self.device)
        if self.device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        return seconds, float(td["x"].double().sum())

    def copy_paths(self) -> dict[str, int]:
        from dataplane.transport.pinning import registry

        return registry().stats()


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """``"16M:8,256M:64"`` -> ``[(16 MiB, 8 rows), (256 MiB, 64 rows)]`` (rows default to 64)."""
    out = []
    for part in text.split(","):
        size, _, rows = part.strip().partition(":")
        out.append((parse_size(size), int(rows) if rows else 64))
    return out


def run(
    sizes: Sequence[tuple[int, int]], repeats: int, device: str, address: str | None = None
) -> dict[str, Any]:
    """Measure every payload of ``sizes`` in one Ray (``address``, else a fresh local one, or the one
    this process has joined already); returns the figures (see the module docstring)."""
    import ray

    def join() -> None:
        if address:  # an existing cluster
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)

    with ray_for_run(join):
        return _measure(sizes, repeats, device)


def _measure(sizes: Sequence[tuple[int, int]], repeats: int, device: str) -> dict[str, Any]:
    import ray
    import torch

    import dataplane as dp
    from dataplane.transport.pinning import registry

    reader = None
    rows_out: list[dict[str, Any]] = []
    d2d_out: list[dict[str, Any]] = []
    try:
        # Freed segments stay warm for the next round (so do their registrations): the rounds measure
        # the steady state of a training loop, not the first touch of fresh memory.
        dp.init(name=STORE, num_shards=1, warm_idle_s=600.0, warm_retain_bytes=4 << 30)
        gpus = 0.5 if device == "cuda" else 0  # the driver keeps the device visible; the actor asks
        reader = ray.remote(GpuReader).options(num_cpus=0, num_gpus=gpus).remote(device)
        for nbytes, rows in sizes:
            row, d2d = _payload(reader, nbytes, rows, repeats, device)
            rows_out.append(row)
            d2d_out.append(d2d)
        paths = {"writer": registry().stats(), "reader": ray.get(reader.copy_paths.remote(), timeout=60)}
    finally:
        if reader is not None:  # the Ray may outlive this run (a process that had joined it)
            ray.kill(reader)
        dp.close()
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "rows": rows_out,
        "device_to_device": d2d_out,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "copy_paths": paths,
    }


def _payload(
    reader: Any, nbytes: int, rows: int, repeats: int, device: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One payload's figures: its row of ``rows`` and its device-to-device comparison."""
    import torch

    width = max(1, nbytes // 4 // rows)
    x = torch.rand(rows, width, device=device)
    payload = rows * width * 4
    store_gbps = payload / _best(lambda i: _store_round(reader, x, f"gpu-{payload}-{i}"), repeats) / GB
    naive_gbps = payload / _best(lambda _: _timed_sync(device, lambda: x.cpu().to(device)), repeats) / GB
    pinned_gbps = d2d_gbps = None
    if device == "cuda":
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)  # allocated once, untimed
        pinned_gbps = payload / _best(lambda _: _pinned_round(x, host), repeats) / GB
        d2d_gbps = payload / _best(lambda _: _timed_sync(device, x.clone), repeats) / GB
    row = {
        "bytes": payload,
        "store_gbps": store_gbps,
        "pinned_gbps": pinned_gbps,
        "naive_gbps": naive_gbps,
        "store_vs_pinned": ratio(store_gbps, pinned_gbps),
        "store_vs_naive": ratio(store_gbps, naive_gbps),
    }
    return row, {"bytes": payload, "d2d_gbps": d2d_gbps, "store_vs_d2d": ratio(store_gbps, d2d_gbps)}


def _best(fn: Callable[[int], float], repeats: int) -> float:
    """The shortest of ``repeats`` timings ``fn(round)`` returns (seconds)."""
    return min(fn(i) for i in range(repeats))


def _store_round(reader: Any, x: Any, pid: str) -> float:
    """Seconds of one put from this process's device + one get onto the reader's, checked."""
    import ray

    import dataplane as dp

    keys = [f"r{i}" for i in range(x.shape[0])]
    expected = float(x.double().sum())
    start = time.perf_counter()
    dp.kv_batch_put(keys, pid, {"x": x})
    put_s = time.perf_counter() - start
    get_s, total = ray.get(reader.get.remote(keys, pid), timeout=300)
    if abs(total - expected) > 1e-6 * max(1.0, abs(expected)):
        raise AssertionError(f"{pid}: the reader's sum {total} is not the writer's {expected}")
    dp.clear_partition(pid)
    return put_s + get_s


def _pinned_round(x: Any, host: Any) -> float:
    """Seconds of ``x`` -> a pinned buffer -> the device: the floor of a host-staged copy."""
    import torch

    start = time.perf_counter()
    host.copy_(x, non_blocking=True)
    torch.cuda.synchronize()
    host.to(x.device, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _timed_sync(device: str, fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` takes, its device work included."""
    import torch

    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def table(res: dict[str, Any]) -> str:
    """The figures as one table: a line per payload."""
    head = ("payload", "store GB/s", "pinned", "naive", "d2d", "store/pinned", "store/naive", "store/d2d")
    lines = [" | ".join(head)]
    for row, d2d in zip(res["rows"], res["device_to_device"], strict=True):
        cells = (
            f"{row['bytes'] / MiB:.0f} MiB",
            fmt(row["store_gbps"]),
            fmt(row["pinned_gbps"]),
            fmt(row["naive_gbps"]),
            fmt(d2d["d2d_gbps"], ".1f"),
            fmt(row["store_vs_pinned"]),
            fmt(row["store_vs_naive"]),
            fmt(d2d["store_vs_d2d"], ".3f"),
        )
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes(DEFAULT_SIZES),
                        help=f"payloads, each BYTES[:ROWS] ({DEFAULT_SIZES})")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5, help="rounds per payload; the best is reported (5)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--json", default=None, help="write the figures here as JSON")
    parser.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    args = parser.parse_args(argv)
    import torch

    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, python {sys.version.split()[0]}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "bench.gpu: no CUDA device here (torch sees none); run on a GPU machine, or --device cpu",
            file=sys.stderr,
        )
        return 2
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()}")
    res = run(args.sizes, args.repeats, args.device, args.address)
    print(table(res))
    for side, stats in res["copy_paths"].items():
        print(
            f"  {side}: {stats['direct']} direct copies, {stats['staged']} staged, "
            f"{stats['pinned_bytes'] / MiB:.0f} MiB registered in {stats['pinned_mappings']} mappings "
            f"(cap {stats['cap_bytes'] / MiB:.0f} MiB, {stats['failed']} registrations failed)"
        )
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
