"""Detached workers: started by one driver, attached by name from another driver process."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from controlplane import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from tests.controlplane._group_workers import EnvWorker
from tests.forkserver import run_python

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]

CLIENT = textwrap.dedent(
    """
    import json, sys
    import ray
    from controlplane import RayClassWithInitArgs, RayWorkerGroup
    from tests.controlplane._group_workers import EnvWorker

    address, namespace, names = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    ray.init(address=address, namespace=namespace, log_to_driver=False)
    wg = RayWorkerGroup.from_detached(worker_names=names, namespace=namespace,
                                      ray_cls_with_init=RayClassWithInitArgs(EnvWorker))
    result = {"add": wg.add(5), "pids": [e["pid"] for e in wg.env()], "names": wg.worker_names}
    print("RESULT " + json.dumps(result), flush=True)
    ray.shutdown()
    """
)


def test_attach_from_another_driver(ray_cluster) -> None:
    import ray

    namespace = ray.get_runtime_context().namespace
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1, detached=True, name_prefix="trainer")
    spec = RayClassWithInitArgs(EnvWorker, offset=10)
    wg = RayWorkerGroup(pool, spec, detached=True, name_prefix="trainer")
    try:
        names = wg.worker_names
        assert names == ["trainerEnvWorker_0:0", "trainerEnvWorker_0:1"]
        pids = [e["pid"] for e in wg.env()]
        proc = run_python(
            ["-c", CLIENT, ray_cluster.address, namespace, json.dumps(names)], 240, cwd=str(ROOT)
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, f"client failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        result = json.loads(lines[-1][len("RESULT ") :])
        assert result == {"add": [15, 16], "pids": pids, "names": names}
        # the other driver has exited; the detached workers are still there for us
        assert wg.add(0) == [10, 11]
    finally:
        wg.kill()
        pool.remove()
