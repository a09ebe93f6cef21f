"""A metadata-only trainer, written as a user of rlplane would write one.

Two workers learn ``y = 3 x`` (one weight each, kept in step). The driver loop below never holds a
tensor: it passes ``KVBatchMeta`` objects (keys, partition, field names) and small floats. Each
worker reads its share of the rows from the store, computes, and writes new columns back:

* ``sample``  makes the inputs for the keys it is given (``bridge=False``: it works with the meta);
* ``act``     bridged: gets its rows as a TensorDict, returns predictions, which land in the store;
* ``grad``    bridged: returns a metric dict per rank (nothing written), averaged on the driver;
* ``update``  applies the mean gradient on every rank.

Run it (a local Ray and an embedded store start by themselves; RAY_ADDRESS joins your cluster)::

    .venv/bin/python examples/metadata_only_trainer.py --steps 20

The group asks one CPU per worker; the store asks none, so the two workers fit a 2-core laptop.
The rows are of one shape, so each get returns dense ``[B]`` tensors (rows of different lengths
would come back as a jagged nested tensor).
"""

from __future__ import annotations

import argparse
import sys

import torch
from tensordict import TensorDict

import dataplane as dp
from controlplane import Dispatch, RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, Worker, register
from workers import MetadataOnlyGroup

TRUE_SLOPE = 3.0


class Learner(Worker):
    """One data-parallel rank: a single weight ``w``, the same on every rank after each update."""

    def __init__(self, lr: float, seed: int) -> None:
        super().__init__()
        self.w = 0.0
        self.lr = lr
        self.gen = torch.Generator().manual_seed(seed + self.rank)  # each rank draws its own inputs

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, bridge=False)
    def sample(self, meta: dp.KVBatchMeta) -> dp.KVBatchMeta:
        dp.init(attach_only=True)  # join the driver's store (a bridged method does this by itself)
        x = torch.randn(meta.size, generator=self.gen)
        return dp.kv_batch_put(meta.keys, meta.partition_id, TensorDict({"x": x}, [meta.size]))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def act(self, batch: TensorDict) -> TensorDict:
        return TensorDict({"y_hat": batch["x"] * self.w, "y": batch["x"] * TRUE_SLOPE}, batch.batch_size)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def grad(self, batch: TensorDict) -> dict:
        err = batch["y_hat"] - batch["y"]
        return {"grad": float((2 * err * batch["x"]).sum()), "loss": float((err**2).sum()), "rows": len(err)}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def update(self, mean_grad: float) -> float:
        self.w -= self.lr * mean_grad
        return self.w


def train(steps: int, batch_size: int, lr: float, seed: int) -> list[float]:
    """Run the loop; returns the loss of every step."""
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(Learner, lr=lr, seed=seed))
    learner = MetadataOnlyGroup(group, "learner")  # refuses any tensor passing through the driver
    losses = []
    try:
        for step in range(steps):
            pid = f"example-step{step}"
            meta = dp.KVBatchMeta([f"{pid}/{i}" for i in range(batch_size)], partition_id=pid)
            meta = learner.sample(meta)  # rows written by the workers; meta.fields == ["x"]
            meta = learner.act(meta)  # + "y_hat", "y"
            parts = learner.grad(meta)  # one metric dict per rank
            rows = sum(p["rows"] for p in parts)
            losses.append(sum(p["loss"] for p in parts) / rows)
            (w, _) = learner.update(sum(p["grad"] for p in parts) / rows)
            dp.clear_partition(pid)
            print(f"step {step:3d}  loss {losses[-1]:8.4f}  w {w:6.3f}  driver bytes {learner.driver_bytes}")
    finally:
        group.kill()
        pool.remove()
    return losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps (default: 20)")
    parser.add_argument("--batch-size", type=int, default=64, help="rows per step (default: 64)")
    parser.add_argument("--lr", type=float, default=0.1, help="learning rate (default: 0.1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the inputs (default: 0)")
    args = parser.parse_args(argv)
    dp.init()  # attach to a running store, or start an embedded one (and a local Ray)
    try:
        losses = train(args.steps, args.batch_size, args.lr, args.seed)
    finally:
        dp.close()
    learned = losses[-1] < losses[0] / 2
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}: {'learned' if learned else 'did NOT learn'}")
    return 0 if learned else 1


if __name__ == "__main__":
    sys.exit(main())
