"""Every script in examples/ runs, with small sizes, on the session's Ray cluster.

Each runs as a subprocess of the venv's python joined to the session's cluster (``RAY_ADDRESS``,
or ``--address`` with the head's address), must exit 0 and print what shows it worked, with no
noise on stderr (see ``tests/test_readme.py``).
"""

from __future__ import annotations

import pytest

from tests.test_readme import ROOT, check_clean_run, run_python

EXAMPLES = ROOT / "examples"
TIMEOUT_S = 280  # under the suite's per-test limit; each joins Ray and starts a store and workers


def _run(script: str, args: list[str], ray_cluster):
    proc = run_python(EXAMPLES / script, ray_cluster.address, timeout=TIMEOUT_S, args=args)
    check_clean_run(proc, f"examples/{script} {' '.join(args)}")
    return proc


def test_every_example_is_tested() -> None:
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert scripts == sorted(TESTED), f"examples without a test here (or tests without a script): {scripts}"
    listed = (EXAMPLES / "README.md").read_text()
    assert all(f"`{s}`" in listed for s in scripts), "examples/README.md must list every script"


@pytest.mark.slow
@pytest.mark.ray
def test_metadata_only_trainer(ray_cluster) -> None:
    args = ["--steps", "3", "--batch-size", "8", "--lr", "0.2"]
    proc = _run("metadata_only_trainer.py", args, ray_cluster)
    assert "learned" in proc.stdout.splitlines()[-1] and "NOT" not in proc.stdout, proc.stdout


@pytest.mark.slow
@pytest.mark.ray
def test_store_two_processes(ray_cluster) -> None:
    proc = _run("store_two_processes.py", ["--address", ray_cluster.address], ray_cluster)
    assert "writer: put 4 rows" in proc.stdout and "reader: got 4 rows" in proc.stdout, proc.stdout


@pytest.mark.slow
@pytest.mark.ray
def test_bypass_on_my_cluster(ray_cluster) -> None:
    args = ["--address", "auto", "--payload-mib", "1", "--workers", "1", "--rows", "64", "--steps", "1"]
    proc = _run("bypass_on_my_cluster.py", args, ray_cluster)
    paths = [line.split()[0] for line in proc.stdout.splitlines()[1:4]]
    assert paths and set(paths) <= {"floor", "classic", "store"} and "store" in paths, proc.stdout


TESTED = ["metadata_only_trainer.py", "store_two_processes.py", "bypass_on_my_cluster.py"]
