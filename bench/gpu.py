"""GPU round trip: a CUDA tensor put by one process and read onto the GPU by another, against a plain
device-to-host-to-device copy of the same bytes.

One fresh local Ray (or ``--address``), an embedded store of one shard. Per round:

1. **store**: the driver puts ``--rows`` rows of one float32 field that live on the GPU
   (``dp.kv_batch_put``: staged to host through pinned memory, into the shard's shared memory); a
   reader actor in another process gets them with ``device="cuda"`` and synchronises. The figure is
   put time + get time (each side timed where it runs), checked bit for bit on the GPU.
2. **reference**: in the driver, the same tensor copied to host (``.cpu()``) and back
   (``.to("cuda")``), synchronised: the naive host-staged copy (pageable memory, one process).
3. **pinned** (on a GPU only): the same round trip through a pinned host buffer allocated once,
   outside the timing: the floor of a copy staged through host memory, which the store's path (two
   processes, shared memory between them) can approach but not beat.

Printed: the times as GB/s of payload (best of ``--repeats``), the ratio store / reference and, on a
GPU, store / pinned.
``--device cpu`` runs the same code with CPU tensors (no reference copy to speak of: its figure is
a memcpy), so the machinery is exercised where there is no GPU (the test suite does that).

Usage::

    python -m bench.gpu                       # 256 MiB in 64 rows, 5 rounds, on the GPU
    python -m bench.gpu --device cpu --bytes 1M --repeats 1 --json /tmp/gpu.json
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

from bench._common import GB, machine_facts, ratio, ray_for_run, throughput, write_json
from dataplane._units import parse_size

STORE = "bench-gpu"


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


def run(nbytes: int, rows: int, repeats: int, device: str, address: str | None = None) -> dict[str, Any]:
    """Measure ``repeats`` rounds; returns the figures (GB/s, best and median) and their ratio.
    The Ray is ``address``, else a fresh local one, or the one this process has joined already."""
    import ray
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --device cpu, or on a machine with a GPU")

    def join() -> None:
        if address:  # an existing cluster
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)

    with ray_for_run(join):
        return _round_trips(nbytes, rows, repeats, device)


def _round_trips(nbytes: int, rows: int, repeats: int, device: str) -> dict[str, Any]:
    import ray
    import torch

    import dataplane as dp

    width = max(1, nbytes // 4 // rows)
    reader = None
    try:
        dp.init(name=STORE, num_shards=1)
        gpus = 0.5 if device == "cuda" else 0  # the driver keeps the device visible; the actor asks
        reader = ray.remote(GpuReader).options(num_cpus=0, num_gpus=gpus).remote(device)
        x = torch.rand(rows, width, device=device)
        expected = float(x.double().sum())
        keys = [f"r{i}" for i in range(rows)]
        store_s, ref_s, pinned_s = [], [], []
        # allocated once, as a staging buffer a real path would keep
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True) if device == "cuda" else None
        for i in range(repeats):
            pid = f"gpu-{i}"
            start = time.perf_counter()
            dp.kv_batch_put(keys, pid, {"x": x})
            put_s = time.perf_counter() - start
            get_s, total = ray.get(reader.get.remote(keys, pid), timeout=600)
            if abs(total - expected) > 1e-6 * max(1.0, abs(expected)):
                raise AssertionError(f"round {i}: the reader's sum {total} is not the writer's {expected}")
            store_s.append(put_s + get_s)
            dp.clear_partition(pid)
            start = time.perf_counter()
            back = x.cpu().to(device)
            if device == "cuda":
                torch.cuda.synchronize()
            ref_s.append(time.perf_counter() - start)
            del back
            if host is not None:
                start = time.perf_counter()
                host.copy_(x, non_blocking=True)
                torch.cuda.synchronize()
                back = host.to(device, non_blocking=True)
                torch.cuda.synchronize()
                pinned_s.append(time.perf_counter() - start)
                del back
        payload = rows * width * 4
        store, ref = throughput(payload, store_s), throughput(payload, ref_s)
        pinned = throughput(payload, pinned_s) if pinned_s else None
        return {
            "device": device,
            "bytes": payload,
            "rows": rows,
            "store": store,
            "reference": ref,
            "pinned": pinned,
            "store_vs_reference": ratio(store["best_gbps"], ref["best_gbps"]),
            "store_vs_pinned": ratio(store["best_gbps"], pinned["best_gbps"]) if pinned else None,
        }
    finally:
        if reader is not None:  # the Ray may outlive this run (a process that had joined it)
            ray.kill(reader)
        dp.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", type=parse_size, default=256 << 20, help="payload (256M)")
    parser.add_argument("--rows", type=int, default=64, help="rows of the payload (64)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds; best of them is reported (5)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--json", default=None, help="write the figures here as JSON")
    parser.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    args = parser.parse_args(argv)
    res = run(args.bytes, args.rows, args.repeats, args.device, args.address)
    print(f"payload {res['bytes'] / GB:.3f} GB in {res['rows']} rows on {res['device']}")
    paths = (
        ("store put + get in another process", "store"),
        ("device->host->device", "reference"),
        ("the same through a pinned buffer", "pinned"),
    )
    for what, key in paths:
        t = res[key]
        if t is not None:  # no pinned copy on CPU tensors
            print(f"  {what}: {t['best_gbps']:.2f} GB/s best, {t['median_gbps']:.2f} median")
    print(f"  ratio store / reference: {res['store_vs_reference']:.2f}")
    if res["store_vs_pinned"] is not None:
        print(f"  ratio store / pinned: {res['store_vs_pinned']:.2f}")
    if args.json:
        write_json(args.json, {"machine": machine_facts(), "results": res})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
