"""A driver run on host h1 of the test bed (``python tests/multihost/_bridge.py``): the bridge with a
worker group spread over both hosts, on a store with a shard on each; what each worker wrote back,
and where each ran, printed as one JSON line.

Each row holds a 4 MiB tensor, so a worker's half of the batch (12 MiB) crosses through the transfer
engine from whichever host holds it; the workers' bundles are too large for two on one host (3 of
a host's 4 CPUs), so Ray places one on each.
"""

from __future__ import annotations

import json

import ray
import torch
from tensordict import TensorDict

import dataplane as dp
from controlplane import Dispatch, RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, Worker, register

ROWS = 6
WIDTH = 1 << 20  # float32 values per row: 4 MiB


class SpreadWorker(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)  # bridged: a KVBatchMeta in, one back
    def summed(self, batch: TensorDict) -> TensorDict:
        host = int(ray.util.get_node_ip_address().rsplit(".", 1)[1])
        return TensorDict(
            {"s": batch["w"].sum(1) + 1000 * self.rank, "host": torch.full((batch.shape[0],), host)},
            batch.batch_size,
        )


def main() -> None:
    ray.init(address="auto", log_to_driver=False)
    dp.init(num_shards=2)
    keys = [f"b{i}" for i in range(ROWS)]
    w = torch.arange(ROWS, dtype=torch.float32).reshape(ROWS, 1) * torch.ones(ROWS, WIDTH)
    dp.kv_batch_put(keys, "bridge", {"x": torch.arange(ROWS), "w": w})
    meta = dp.KVBatchMeta(keys, [{} for _ in keys], "bridge", ["x", "w"], {})
    pool = RayResourcePool([1, 1], use_gpu=False, max_colocate_count=3)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(SpreadWorker))
    try:
        out = wg.summed(meta)
        got = dp.kv_batch_get(keys, "bridge", ["s", "host"])
        where = [h.__ray_call__.remote(lambda self: ray.util.get_node_ip_address()) for h in wg.workers]
        ips = ray.get(where, timeout=120)
        report = {
            "fields": list(out.fields),
            "s": got["s"].tolist(),
            "want_s": [float(i * WIDTH + 1000 * (i >= ROWS // 2)) for i in range(ROWS)],
            "host": got["host"].tolist(),
            "worker_ips": ips,
        }
    finally:
        wg.kill()
        pool.remove()
    print(json.dumps(report))
    dp.close()


if __name__ == "__main__":
    main()
