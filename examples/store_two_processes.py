"""The store as a service: started with ``rlplane store start``, used from two other processes.

``rlplane store start`` runs the store on a Ray cluster, detached: it outlives the command. Any
process of the cluster then attaches with ``dp.init(address=...)`` (``"auto"``, or the head's
``HOST:PORT``); here a *writer* process puts rows and exits, and a *reader* process, started after
it, finds them. ``rlplane store stop`` removes the store at the end.

Run it on a machine where a Ray cluster runs (``.venv/bin/ray start --head`` first, or set
RAY_ADDRESS)::

    .venv/bin/python examples/store_two_processes.py                 # --address auto
    .venv/bin/python examples/store_two_processes.py --address 10.0.0.5:6379

The two roles are this same file with ``--role writer`` / ``--role reader``; each is what a
process of your own would do to use the store.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

# The command on PATH, else the one installed next to this Python (a venv used without activating it).
RLPLANE = shutil.which("rlplane") or str(Path(sys.executable).with_name("rlplane"))
PARTITION = "example-two-processes"
KEYS = [f"row{i}" for i in range(4)]


def writer(address: str) -> None:
    import torch
    from tensordict import TensorDict

    import dataplane as dp

    info = dp.init(address=address)  # attaches: the store runs already, so nothing new starts
    assert not info.owned, "the writer must attach to the CLI's store, not start its own"
    td = TensorDict({"tokens": torch.arange(4 * 3).view(4, 3)}, batch_size=[4])
    meta = dp.kv_batch_put(KEYS, PARTITION, td)
    print(f"writer: put {meta.size} rows (fields {meta.fields}) into the store's {info.num_shards} shard(s)")
    dp.close()  # drops this process's client; the store keeps running (this process did not start it)


def reader(address: str) -> None:
    import dataplane as dp

    dp.init(address=address)
    td = dp.kv_batch_get(KEYS, PARTITION)  # rows of one shape: a dense [4, 3] tensor
    print(
        f"reader: got {td.batch_size[0]} rows written by another process; tokens[3] = "
        f"{td['tokens'][3].tolist()}"
    )
    assert td["tokens"][3].tolist() == [9, 10, 11]
    dp.clear_partition(PARTITION)
    dp.close()


def run(*args: str) -> None:
    print("$", " ".join(Path(a).name if a in (RLPLANE, sys.executable) else a for a in args), flush=True)
    subprocess.run(args, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--address",
        default="auto",
        help="the Ray cluster: auto (RAY_ADDRESS, else the one `ray start` started) "
        "or HOST:PORT (default: auto)",
    )
    parser.add_argument(
        "--role",
        choices=("all", "writer", "reader"),
        default="all",
        help="all: start the store, run a writer then a reader, stop the store (default)",
    )
    args = parser.parse_args(argv)
    if args.role == "writer":
        writer(args.address)
        return 0
    if args.role == "reader":
        reader(args.address)
        return 0
    run(RLPLANE, "store", "start", "--address", args.address, "--shards", "1")
    try:
        for role in ("writer", "reader"):  # two separate processes, one after the other
            run(sys.executable, __file__, "--role", role, "--address", args.address)
    finally:
        run(RLPLANE, "store", "stop", "--address", args.address)
    return 0


if __name__ == "__main__":
    sys.exit(main())
