"""Every script in examples/, and every command of examples/README.md, runs on a newcomer's laptop.

A newcomer's laptop here is a sandbox (``tests/_fresh_ray.py``): a fresh Ray of its own, started the
plain way (the script's ``dp.init()`` calls ``ray.init()`` with no arguments, or ``ray start --head``
with none about CPUs), so it has as many CPUs as the machine has cores (2 on the machine this was
built on), in a new terminal's environment. Never the session's cluster: its 8 logical CPUs hid that
a store plus a group of 2 workers did not fit 2 cores. Each run must exit 0, print what
shows it worked, and leave no noise on stderr (``tests/test_readme.py``).
"""

from __future__ import annotations

import re
import subprocess

import pytest

from tests._fresh_ray import VENV_BIN, Sandbox, free_port, sandbox, start_head, stop_processes_naming
from tests.test_readme import ROOT, check_clean_run

EXAMPLES = ROOT / "examples"
TIMEOUT_S = 600  # one command on a busy 2-core machine: a Ray of its own, the store, the workers


def _run(box: Sandbox, command: str) -> subprocess.CompletedProcess:
    proc = box.sh(command, timeout=TIMEOUT_S, PYTHONUNBUFFERED="1")
    check_clean_run(proc, command)
    return proc


def test_every_example_is_tested() -> None:
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert scripts == sorted(TESTED), f"examples without a test here (or tests without a script): {scripts}"
    listed = (EXAMPLES / "README.md").read_text()
    assert all(f"`{s}`" in listed for s in scripts), "examples/README.md must list every script"
    commands = "\n".join(readme_commands())
    assert all(f"examples/{s}" in commands for s in scripts), "examples/README.md must run every script"


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_metadata_only_trainer() -> None:
    with sandbox() as box:  # no cluster: the script's dp.init() starts a plain local Ray
        args = "--steps 3 --batch-size 8 --lr 0.2"
        proc = _run(box, f"{VENV_BIN}/python examples/metadata_only_trainer.py {args}")
    assert "learned" in proc.stdout.splitlines()[-1] and "NOT" not in proc.stdout, proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 300)
def test_store_two_processes() -> None:
    with sandbox() as box:
        box.make_token()  # as a first ray.init() leaves it: the head uses token authentication
        start_head(box)  # `ray start --head`, as examples/README.md says before this script
        proc = _run(box, f"{VENV_BIN}/python examples/store_two_processes.py")
    assert "writer: put 4 rows" in proc.stdout and "reader: got 4 rows" in proc.stdout, proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 300)
def test_bypass_on_my_cluster() -> None:
    with sandbox() as box:
        start_head(box)  # 2 workers and the producer on a plain head of a 2-core machine
        args = "--address auto --payload-mib 1 --workers 2 --rows 64 --steps 1"
        proc = _run(box, f"{VENV_BIN}/python examples/bypass_on_my_cluster.py {args}")
    paths = [line.split()[0] for line in proc.stdout.splitlines()[1:4]]
    assert paths and set(paths) <= {"floor", "classic", "store"} and "store" in paths, proc.stdout


TESTED = ["metadata_only_trainer.py", "store_two_processes.py", "bypass_on_my_cluster.py"]


def readme_commands() -> list[str]:
    """The lines of examples/README.md's ```bash block, in order."""
    text = (EXAMPLES / "README.md").read_text()
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)
    assert len(blocks) == 1, "examples/README.md has one ```bash block, the commands to run"
    return [line.strip() for line in blocks[0].splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.timeout(4 * TIMEOUT_S)
def test_the_commands_of_examples_readme_run_as_written() -> None:
    """Line by line, from the repository's root, in a new terminal on a fresh machine. Two rewrites,
    both because this machine is shared: ``ray start --head`` gets ports of its own (6379 and 52365
    may be another engineer's), and ``ray stop``, which stops every Ray on the machine, is replaced
    by stopping this sandbox's cluster alone."""
    with sandbox() as box:
        for line in readme_commands():
            if line == ".venv/bin/ray stop":
                stop_processes_naming(box.root)
                continue
            if line == ".venv/bin/ray start --head":
                line += f" --port {free_port()} --dashboard-agent-listen-port {free_port()}"
            proc = box.sh(line, timeout=TIMEOUT_S, PYTHONUNBUFFERED="1")
            check_clean_run(proc, f"examples/README.md: {line}")
