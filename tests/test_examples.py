"""Every script in examples/, and every command of examples/README.md, runs on a newcomer's laptop.

A newcomer's laptop here is a sandbox (``tests/_fresh_ray.py``, the session's ``laptop``): a fresh Ray
of its own, started the plain way (the script's ``dp.init()`` calls ``ray.init()`` with no arguments,
or ``ray start --head`` with none about CPUs), so it has as many CPUs as the machine has cores (2 on
the machine this was built on), in a new terminal's environment. Never the session's cluster: its 8
logical CPUs hid that a store plus a group of 2 workers did not fit 2 cores. The README's commands
run once, as written, in that sandbox: each must exit 0, print what shows it worked, and leave no
noise on stderr (``tests/test_readme.py``). The head its ``ray start --head`` starts is the one the
README's blocks (``tests/test_readme.py``) and ``rlplane store start``'s printed lines
(``tests/workers/test_printed_steps.py``) run on next, as on a laptop whose owner reads on (the three
are one xdist group, in this order, ``tests/conftest.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from tests._fresh_ray import head_command, recorded_head
from tests.test_readme import ROOT, check_clean_run

EXAMPLES = ROOT / "examples"
TIMEOUT_S = 600  # one command on a busy 2-core machine: a Ray of its own, the store, the workers


def test_every_example_is_run_and_checked() -> None:
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert scripts == sorted(CHECKS), f"examples without a check here (or checks without a script): {scripts}"
    listed = (EXAMPLES / "README.md").read_text()
    assert all(f"`{s}`" in listed for s in scripts), "examples/README.md must list every script"
    commands = "\n".join(readme_commands())
    assert all(f"examples/{s}" in commands for s in scripts), "examples/README.md must run every script"


def readme_commands() -> list[str]:
    """The lines of examples/README.md's ```bash block, in order."""
    text = (EXAMPLES / "README.md").read_text()
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)
    assert len(blocks) == 1, "examples/README.md has one ```bash block, the commands to run"
    return [line.strip() for line in blocks[0].splitlines() if line.strip()]


def _trainer_learned(out: str) -> None:
    assert "learned" in out.splitlines()[-1] and "NOT" not in out, out


def _two_processes_shared_rows(out: str) -> None:
    assert "writer: put 4 rows" in out and "reader: got 4 rows" in out, out


def _bypass_measured_the_store(out: str) -> None:
    paths = [line.split()[0] for line in out.splitlines()[1:4]]
    assert paths and set(paths) <= {"floor", "classic", "store"} and "store" in paths, out


# What each script's run must print to show it worked.
CHECKS: dict[str, Callable[[str], None]] = {
    "metadata_only_trainer.py": _trainer_learned,
    "store_two_processes.py": _two_processes_shared_rows,
    "bypass_on_my_cluster.py": _bypass_measured_the_store,
}


@pytest.mark.slow
@pytest.mark.timeout(4 * TIMEOUT_S)
def test_the_commands_of_examples_readme_run_as_written(laptop) -> None:
    """Line by line, from the repository's root, in a new terminal on a fresh machine that has run
    Ray before (it has a token, as a first ``ray.init()`` leaves it, so ``ray start --head`` uses token
    authentication, Ray 2.60's default); each script's output is checked (``CHECKS``). Two rewrites,
    both because this machine is shared: ``ray start --head`` gets ports of its own
    (``_fresh_ray.head_command``), and ``ray stop``, which stops every Ray on the machine, is left to
    the ``laptop`` fixture, which stops this sandbox's processes alone once the first-hour tests that
    use its head are done."""
    assert laptop.head is None, "examples/README.md's first command must find no Ray: run this test first"
    checked = []
    for line in readme_commands():
        if line == ".venv/bin/ray stop":
            continue
        if line == ".venv/bin/ray start --head":
            line = head_command(line)
        proc = laptop.sh(line, timeout=TIMEOUT_S, PYTHONUNBUFFERED="1")
        check_clean_run(proc, f"examples/README.md: {line}")
        if "ray start --head" in line:
            recorded_head(laptop)
        for script, check in CHECKS.items():
            if f"examples/{script}" in line:
                check(proc.stdout)
                checked.append(script)
    assert sorted(checked) == sorted(CHECKS), f"checked {checked}"
