"""TransferQueue 0.1.11's own tutorials (``tq_tutorials/``: only their import lines changed) on
``dataplane.tq``, each run as a script on the session's cluster, as a user runs them; and what a
script that fails after ``tq.init()`` prints when it exits."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

import dataplane as dp
import dataplane.tq as tq
from tests.forkserver import run_python

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = Path(__file__).resolve().parent / "tq_tutorials"

# What only a controller that failed to start prints (Ray's prefix of its lines, and the error).
CONTROLLER_TRACES = ("Controller pid=", "TransferQueueController pid=", "StoreNotInitializedError")


@pytest.fixture
def own_cluster_env(ray_cluster) -> dict[str, str]:
    """The environment of a script that joins the session's cluster with its own ``ray.init()``, in a
    cluster where no store or TransferQueue controller of this process runs: the script starts its
    own, as on a user's machine (this process's ``close`` stops only what it started)."""
    tq.close()
    dp.close()
    return {**os.environ, "RAY_ADDRESS": ray_cluster.address}


def _run(path: Path, env: dict[str, str], timeout: float = 240):
    return run_python([str(path)], timeout, env=env, cwd=str(ROOT))


@pytest.mark.parametrize(
    "name",
    ["01_core_components", "02_kv_interface", "03_metadata_concepts", "04_understanding_controller"],
)
def test_tutorial_runs_unchanged(own_cluster_env, name):
    """As on TransferQueue. 02 writes ``attention_mask`` as float32 for one key and int64 for four
    others, then reads all five: each row keeps its dtype, as TransferQueue keeps it."""
    proc = _run(TUTORIALS / f"{name}.py", own_cluster_env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Error during tutorial" not in proc.stdout and "Traceback" not in proc.stderr, out
    assert not any(t in proc.stderr for t in CONTROLLER_TRACES), proc.stderr


def test_tutorial_05_stops_at_a_sampler_in_the_config_naming_the_fix(own_cluster_env):
    """TransferQueue runs 05 (its controller runs the sampler objects the config ships); here no code
    travels in the config, and the error names the per-call form (``dataplane/tq/__init__.py``)."""
    proc = _run(TUTORIALS / "05_custom_sampler.py", own_cluster_env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Error during tutorial: sampler RandomSamplerWithReplacement is not one of" in proc.stdout
    assert "get_meta(..., sampling_config={'sampler': ...})" in proc.stdout, proc.stdout


def test_tutorial_06_stops_at_dataloader_workers_naming_the_fix(own_cluster_env):
    """TransferQueue runs 06 (``StreamingDataLoader(num_workers=2)``); here DataLoader worker processes
    cannot attach to the store, and the error says to use ``num_workers=0`` (with which 06 completes,
    after the 25 s its update workers sleep)."""
    proc = _run(TUTORIALS / "06_streaming_dataloader.py", own_cluster_env)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "StreamingDataLoader(num_workers=2)" in proc.stderr and "use num_workers=0" in proc.stderr


def test_a_script_failing_after_init_exits_with_its_own_error_only(own_cluster_env, tmp_path):
    """A script that raises right after ``tq.init()`` (as tutorial 02 did) shows its error, and no
    traceback of a TransferQueue controller. ``tq.init`` used to return before the controller of the
    script's namespace had started; the exit stopped the store meanwhile, and that controller's failed
    attach (``StoreNotInitializedError``) was printed after the user's error, on a machine slow enough
    to start it. Here workers start fast, so the script asks Ray in which state ``tq.init`` left the
    controllers it started (they must be up: the deterministic half), and its exit hook waits for them
    after the store has stopped (``atexit`` runs it last), so that a failed start is printed."""
    script = tmp_path / "fails_after_init.py"
    script.write_text(
        textwrap.dedent(
            """
            import atexit, sys
            import ray
            import dataplane.tq as tq

            def settle():
                try:
                    handle = ray.get_actor("TransferQueueController", namespace="tq-exit-test")
                    ray.get(handle.ping.remote(), timeout=120)
                    print("controller up at exit", file=sys.stderr)
                except Exception as exc:
                    print(f"controller failed: {type(exc).__name__}: {exc}", file=sys.stderr)

            atexit.register(settle)
            ray.init(namespace="tq-exit-test")
            tq.init()
            from ray._private.state import actors
            from dataplane.tq import _session
            for handle in _session.state.started:
                print("controller", actors(handle._actor_id.hex())["State"], file=sys.stderr)
            raise RuntimeError("the user's own error")
            """
        )
    )
    proc = _run(script, own_cluster_env)
    err = proc.stderr
    assert proc.returncode == 1, proc.stdout + err
    assert err.count("controller ALIVE") == 2, err  # its own controllers, in both namespaces, up
    assert "RuntimeError: the user's own error" in err, err
    assert "controller up at exit" in err, err
    assert not any(t in err for t in CONTROLLER_TRACES), err
