"""Checkpoint benchmark: save and load of the store against the disk itself and TransferQueue 0.1.11.

One run, one fresh local Ray, the same payload for every system: ``--bytes`` (1 GiB) in ``--rows``
(256) rows of one float32 field, in a store of ``--shards`` (2) shards. Figures, best of
``--repeats`` (3) rounds, each system's save and load right after a round of the disk's own:

1. **disk write**: the same bytes written to one file by this process (``os.write``) and fsync'd;
   **disk read**: that file read back into fresh memory after its pages were dropped from the page
   cache (``posix_fadvise(POSIX_FADV_DONTNEED)`` on the fsync'd file: no root needed; a virtual
   disk may still be cached by the host below, which this cannot see);
2. **dataplane save**: ``dp.save_checkpoint(dir)`` (each shard writes and fsyncs its files, the
   directory swap included); **load**: ``dp.load_checkpoint(dir)`` into the emptied store, after the
   checkpoint's pages were dropped the same way;
3. **driver bytes per save** (``CheckpointInfo.driver_bytes``) for this payload and for the same keys
   with 16-byte rows: what passes through the calling process does not grow with the payload;
4. **TransferQueue 0.1.11**: the same rows (each put by its own ``kv_put``: see ``run_tq`` for why
   not one batch), ``tq.save_checkpoint(dir)`` as it is (its storage units pickle their data to
   files and never fsync), then the time to fsync those files (what durability costs it), and
   ``tq.load_checkpoint(dir)`` after dropping their pages.

Targets: save >= 0.5x the disk write, load >= 0.5x the disk read, driver bytes of the
large save <= 1.1x those of the small one.

Usage::

    rlplane bench checkpoint                                  # the full run, table + JSON
    python -m bench.checkpoint --bytes 64M --repeats 1 --skip-tq --json /tmp/c.json
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from bench import _common

if TYPE_CHECKING:
    from tensordict import TensorDict

log = logging.getLogger(__name__)

PARTITION = "bench"


def _drop_cache(path: str) -> None:
    """Drop the page-cache pages of every file under ``path`` (they must be clean: written and fsync'd)."""
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _payload(cfg: argparse.Namespace) -> TensorDict:
    import torch
    from tensordict import TensorDict

    width = cfg.bytes // cfg.rows // 4
    x = torch.empty(cfg.rows, width, dtype=torch.float32)
    x.copy_(torch.arange(cfg.rows * width, dtype=torch.float32).reshape(cfg.rows, width) % 251)
    return TensorDict({"x": x}, [cfg.rows])


def _keys(cfg: argparse.Namespace) -> list[str]:
    return [f"row-{i}" for i in range(cfg.rows)]


class Disk:
    """The disk's own speed for the payload's bytes: one file written and fsync'd, then read back cold
    into fresh memory. A round runs right before each system's save, so that every figure meets the
    same weather on a shared machine; the ratios use the best round of each."""

    def __init__(self, payload: TensorDict, workdir: str) -> None:
        self.data = memoryview(payload["x"].numpy().reshape(-1).view(np.uint8))
        self.path = os.path.join(workdir, "disk.bin")
        self.writes: list[float] = []
        self.reads: list[float] = []

    def round(self) -> None:
        data, path = self.data, self.path
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            done = 0
            while done < len(data):
                done += os.write(fd, data[done : done + (64 << 20)])
            os.fsync(fd)
        finally:
            os.close(fd)
        self.writes.append(time.perf_counter() - t0)
        _drop_cache(path)
        t0 = time.perf_counter()
        out = np.empty(len(data), dtype=np.uint8)  # fresh memory, as a load must allocate it
        with open(path, "rb", buffering=0) as f:
            view, got = out.data, 0
            while got < len(data):
                got += f.readinto(view[got : got + (64 << 20)])
        self.reads.append(time.perf_counter() - t0)
        if not np.array_equal(out[:4096], np.frombuffer(data[:4096], dtype=np.uint8)):
            raise RuntimeError("the disk read back other bytes")
        os.unlink(path)

    def result(self) -> dict[str, _common.Throughput]:
        n = len(self.data)
        return {"write": _common.throughput(n, self.writes), "read": _common.throughput(n, self.reads)}


def _check_rows(get: Callable[[list[str]], TensorDict], payload: TensorDict, keys: list[str]) -> None:
    """A load gave back the payload's bytes (first and last rows compared)."""
    import torch

    got = get([keys[0], keys[-1]])
    expected = payload["x"][[0, len(keys) - 1]]
    value = got["x"]
    if value.is_nested:
        value = torch.stack(list(value.unbind()))
    if not torch.equal(value, expected):
        raise RuntimeError("a load gave back other bytes than were saved")


def run_store(cfg: argparse.Namespace, payload: TensorDict, workdir: str, disk: Disk) -> dict[str, Any]:
    import dataplane as dp

    nbytes = payload["x"].numel() * 4
    keys = _keys(cfg)
    path = os.path.join(workdir, "dataplane")
    dp.init(name="bench-checkpoint", num_shards=cfg.shards)  # a store of its own: it saves every partition
    try:
        dp.kv_batch_put(keys, PARTITION, payload)
        saves, loads, infos = [], [], []
        for _ in range(cfg.repeats):
            disk.round()
            t0 = time.perf_counter()
            infos.append(dp.save_checkpoint(path, metadata={"bench": True}))
            saves.append(time.perf_counter() - t0)
            dp.clear_partition(PARTITION)
            _drop_cache(path)
            t0 = time.perf_counter()
            dp.load_checkpoint(path)
            loads.append(time.perf_counter() - t0)
            _check_rows(lambda k: dp.kv_batch_get(k, PARTITION), payload, keys)
        import torch

        dp.clear_partition(PARTITION)
        dp.kv_batch_put(keys, PARTITION, {"x": torch.zeros(cfg.rows, 4)})  # 16-byte rows, same keys
        small = dp.save_checkpoint(os.path.join(workdir, "dataplane-small"))
        dp.clear_partition(PARTITION)
        return {
            "save": _common.throughput(nbytes, saves),
            "load": _common.throughput(nbytes, loads),
            "data_bytes": infos[-1].data_bytes,
            "driver_bytes": infos[-1].driver_bytes,
            "driver_bytes_small": small.driver_bytes,
            "small_data_bytes": small.data_bytes,
        }
    finally:
        dp.close()
        shutil.rmtree(path, ignore_errors=True)


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, files in os.walk(path) for f in files)


def run_tq(cfg: argparse.Namespace, payload: TensorDict, workdir: str, disk: Disk) -> dict[str, Any]:
    """TransferQueue's checkpoint of the same rows, each written by its own ``kv_put``.

    Rows of one ``kv_batch_put`` stay views of the batch's received buffer in its storage units, and
    its checkpoint pickles each row's whole buffer: the files then hold the batch once per row it
    kept (``batch_put_file_ratio``, measured on 16 rows; 1 GiB in 256 rows would write 64 GiB per
    unit). One put per row keeps the files at the payload's size, so that is what is timed.
    """
    import torch
    import transfer_queue as tq
    from tensordict import TensorDict

    nbytes = payload["x"].numel() * 4
    keys = _keys(cfg)
    path = os.path.join(workdir, "transferqueue")
    tq.init()
    try:
        probe = TensorDict({"x": torch.ones(16, 16384)}, [16])  # 1 MiB in one batch of 16 rows
        tq.kv_batch_put(keys=[f"probe-{i}" for i in range(16)], partition_id="probe", fields=probe)
        tq.save_checkpoint(path)
        ratio = _tree_bytes(path) / (16 * 16384 * 4)
        tq.kv_clear([f"probe-{i}" for i in range(16)], "probe")
        for i, key in enumerate(keys):
            tq.kv_put(key=key, partition_id=PARTITION, fields={"x": payload["x"][i]})
        saves, syncs, loads = [], [], []
        for _ in range(cfg.repeats):
            disk.round()
            t0 = time.perf_counter()
            tq.save_checkpoint(path)
            saves.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            _fsync_tree(path)
            syncs.append(saves[-1] + time.perf_counter() - t0)
            file_bytes = _tree_bytes(path)
            _drop_cache(path)
            t0 = time.perf_counter()
            tq.load_checkpoint(path)
            loads.append(time.perf_counter() - t0)
            _check_rows(lambda k: tq.kv_batch_get(keys=k, partition_id=PARTITION), payload, keys)
        return {
            "save": _common.throughput(nbytes, saves),
            "save_fsync": _common.throughput(nbytes, syncs),
            "load": _common.throughput(nbytes, loads),
            "file_bytes": file_bytes,
            "batch_put_file_ratio": ratio,
        }
    finally:
        tq.close()
        shutil.rmtree(path, ignore_errors=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from dataplane._units import parse_size

    p = argparse.ArgumentParser(prog="rlplane bench checkpoint", description=__doc__.splitlines()[0])
    p.add_argument("--bytes", type=parse_size, default=1 << 30, help="payload bytes (1G, 256M, ...)")
    p.add_argument("--rows", type=int, default=256, help="rows the payload is split into")
    p.add_argument("--shards", type=int, default=2, help="store shards")
    p.add_argument("--repeats", type=int, default=3, help="timed saves and loads per system (best of)")
    p.add_argument("--dir", default=None, help="where to write checkpoints (default: the system's temp dir)")
    p.add_argument("--skip-tq", action="store_true", help="do not run TransferQueue")
    p.add_argument("--address", default="local", help="the Ray to run on (default: a new local one)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON here")
    cfg = p.parse_args(argv)
    if cfg.rows < 1 or cfg.bytes < cfg.rows * 4 or cfg.repeats < 1 or cfg.shards < 1:
        p.error("--rows, --shards and --repeats must be >= 1, and --bytes at least 4 bytes per row")
    return cfg


def _gbps(res: dict[str, Any] | None, what: str) -> str:
    return "-" if res is None else f"{res[what]['best_gbps']:.3f}"


def main(argv: Sequence[str] | None = None) -> int:
    import ray

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg = parse_args(argv)
    opts = {"num_cpus": 8, "include_dashboard": False} if cfg.address == "local" else {}
    workdir = tempfile.mkdtemp(prefix="rlplane-bench-checkpoint-", dir=cfg.dir)
    results: dict[str, Any] = {"disk": None, "store": None, "tq": None, "skipped": {}, "dir": workdir}
    try:
        with _common.ray_for_run(
            lambda: ray.init(address=cfg.address, log_to_driver=False, logging_level="ERROR", **opts)
        ):
            payload = _payload(cfg)
            disk = Disk(payload, workdir)
            results["store"] = run_store(cfg, payload, workdir, disk)
            skipped = _common.why_not_tq(cfg.skip_tq)
            if skipped:
                results["skipped"]["tq"] = skipped
            else:
                results["tq"] = run_tq(cfg, payload, workdir, disk)
            results["disk"] = disk.result()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    disk, store, tq = results["disk"], results["store"], results["tq"]
    checks = [
        _common.Check(
            "save_vs_disk_write",
            _common.ratio(store["save"]["best_gbps"], disk["write"]["best_gbps"]),
            0.5,
            ">=",
            "dp.save_checkpoint GB/s / plain write + fsync GB/s",
        ),
        _common.Check(
            "load_vs_disk_read",
            _common.ratio(store["load"]["best_gbps"], disk["read"]["best_gbps"]),
            0.5,
            ">=",
            "dp.load_checkpoint GB/s / plain cold read GB/s",
        ),
        _common.Check(
            "driver_bytes_ratio",
            _common.ratio(store["driver_bytes"], store["driver_bytes_small"]),
            1.1,
            "<=",
            f"driver bytes, {cfg.bytes >> 20} MiB save / 16-byte-row save (same keys)",
        ),
    ]
    if tq is not None:
        checks += [
            _common.Check(
                "save_vs_tq_fsync",
                _common.ratio(store["save"]["best_gbps"], tq["save_fsync"]["best_gbps"]),
                1.0,
                ">=",
                "dp save / (TQ save + fsync of its files)",
            ),
            _common.Check(
                "load_vs_tq",
                _common.ratio(store["load"]["best_gbps"], tq["load"]["best_gbps"]),
                1.0,
                ">=",
                "dp load / TQ load",
            ),
        ]
    print(
        f"checkpoint bench: {cfg.bytes / 2**30:.2f} GiB in {cfg.rows} rows, {cfg.shards} shards, "
        f"best of {cfg.repeats}"
    )
    print(f"{'system':<34} {'save GB/s':>10} {'load GB/s':>10}")
    print(f"{'disk (write+fsync / cold read)':<34} {_gbps(disk, 'write'):>10} {_gbps(disk, 'read'):>10}")
    print(f"{'dataplane':<34} {_gbps(store, 'save'):>10} {_gbps(store, 'load'):>10}")
    print(f"{'TransferQueue 0.1.11 (no fsync)':<34} {_gbps(tq, 'save'):>10} {_gbps(tq, 'load'):>10}")
    print(f"{'TransferQueue 0.1.11 + fsync':<34} {_gbps(tq, 'save_fsync'):>10} {_gbps(tq, 'load'):>10}")
    print(
        f"dataplane driver bytes per save: {store['driver_bytes']:,} ({store['data_bytes']:,} data bytes); "
        f"{store['driver_bytes_small']:,} for 16-byte rows ({store['small_data_bytes']:,} data bytes)"
    )
    if tq is not None:
        print(
            f"TransferQueue (rows put one by one): {tq['file_bytes']:,} checkpoint bytes; after a batch put "
            f"of 16 rows its checkpoint holds {tq['batch_put_file_ratio']:.1f}x the rows' bytes"
        )
    return _common.report_checks(checks, results, cfg, cfg.json)


if __name__ == "__main__":
    raise SystemExit(main())
