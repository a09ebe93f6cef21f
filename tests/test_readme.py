"""Every ```python block of README.md runs, as written, so the README cannot drift from the code.

The blocks run in order in one subprocess (``tests/_run_blocks.py``: the venv's python, the
repository as working directory, each block a fresh ``__main__`` namespace, Ray shut down between
blocks) on a newcomer's laptop (``tests/_fresh_ray.py``, the session's ``laptop``: a new terminal's
environment, Ray's temp dir of its own) where ``ray start --head`` runs (the head examples/README.md
started, ``tests/test_examples.py``, or ``tests/_fresh_ray.start_head`` when this test runs alone):
each block's ``ray.init()`` / ``dp.init()`` joins that local Ray as it would on such a laptop (Ray
finds the cluster it recorded), which has as many CPUs as the machine has cores (2 on the machine
this was built on), never the session's cluster, whose 8 logical CPUs hid that the bridge block's
store and 2 workers did not fit 2 cores. One Ray for all the blocks instead of one each saves a Ray
start per block (63 -> 33 CPU-seconds for the test); a ``dp.init()`` that starts Ray itself runs as
written in ``examples/metadata_only_trainer.py`` (``tests/test_examples.py``). Every block must run,
print what its ``print(...)  # <literal>`` comments promise, and leave no noise on stderr (a
traceback, Ray's "Unhandled error", asyncio's "Task was destroyed", torch's fx warning).

A block that is a fragment on purpose is preceded in README.md by ``<!-- not-run: reason -->``;
keep such exceptions rare (the test below allows one).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RUN_TIMEOUT_S = 600  # every block: a Ray of its own, stores and worker groups started, on a busy 2-core box

_BLOCK = re.compile(r"(?:<!--\s*not-run:(?P<reason>.*?)-->\s*\n)?^```python\n(?P<code>.*?)^```", re.S | re.M)
_PROMISE = re.compile(r"^\s*print\(.*\)\s*#\s*(?P<comment>.+)$", re.M)
# What a clean run never prints; each names a defect fixed once (a traceback at exit, an
# unhandled Ray error, a pending asyncio task destroyed, torch's fx-tracing warning).
NOISE = ("Traceback (most recent call last)", "Unhandled error", "Task was destroyed", "is_fx_tracing")


@dataclass
class Block:
    line: int
    code: str
    skip: str | None


def readme_blocks(text: str | None = None) -> list[Block]:
    """The ```python blocks of README.md, with their first line number and not-run reason."""
    text = README.read_text() if text is None else text
    return [
        Block(
            text.count("\n", 0, m.start("code")) + 1,
            m.group("code"),
            m.group("reason").strip() if m.group("reason") is not None else None,
        )
        for m in _BLOCK.finditer(text)
    ]


def promised_outputs(code: str) -> list[str]:
    """The outputs ``print(x)  # <literal>`` comments promise (the part before a ``;``), as printed."""
    out = []
    for m in _PROMISE.finditer(code):
        head = m.group("comment").split(";")[0].strip()
        try:
            value = ast.literal_eval(head)
        except (ValueError, SyntaxError):
            continue  # prose, not a promise
        if isinstance(value, list | int | float | str):
            out.append(str(value))
    return out


def run_venv_python(
    target: Path | str, env: dict[str, str], timeout: float = RUN_TIMEOUT_S, args: list[str] | None = None
) -> subprocess.CompletedProcess:
    """Run a script (a ``Path``) or a module (``"tests._run_blocks"``, run with ``-m``) with the venv's
    python in the repository, in the environment ``env``."""
    head = [str(target)] if isinstance(target, Path) else ["-m", target]
    return subprocess.run(
        [sys.executable, *head, *(args or [])],
        cwd=ROOT,
        env={**env, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def check_clean_run(proc: subprocess.CompletedProcess, what: str) -> None:
    """Exit 0 and no noise on stderr; the message shows the output to debug from."""
    report = (
        f"{what} (exit {proc.returncode})\n--- stdout\n{proc.stdout[-3000:]}\n"
        f"--- stderr\n{proc.stderr[-5000:]}"
    )
    assert proc.returncode == 0, report
    for noise in NOISE:
        assert noise not in proc.stderr, f"{noise!r} on stderr of {report}"


def test_blocks_are_found_and_fragments_are_rare() -> None:
    blocks = readme_blocks()
    assert len(blocks) >= 4, f"README.md has {len(blocks)} python blocks; the parser missed some"
    skipped = [b for b in blocks if b.skip is not None]
    assert len(skipped) <= 1, f"more than one README block is marked not-run: {[b.line for b in skipped]}"
    assert all(b.skip for b in skipped), "a not-run marker must give its reason"
    text = "x\n<!-- not-run: a sketch -->\n```python\nf()\n```\n"
    assert readme_blocks(text)[0].skip == "a sketch"  # the marker reaches its block
    assert promised_outputs("print(a)  # [1, 2]; more\nprint(b)  # prose\n") == ["[1, 2]"]


RUN_BLOCKS = [b for b in readme_blocks() if b.skip is None]


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_readme_blocks_run(tmp_path: Path, laptop) -> None:
    from tests._fresh_ray import start_head

    blocks = tmp_path / "blocks.json"
    blocks.write_text(json.dumps([[b.line, b.code] for b in RUN_BLOCKS]))
    start_head(laptop)  # it has a token, as the first ray.init() on a laptop leaves it: token auth is on
    # As a module: run as a script, tests/ would come first on sys.path and tests/dataplane hide dataplane.
    proc = run_venv_python("tests._run_blocks", laptop.env(), args=[str(blocks)])
    started = re.findall(r"^=== block at line (\d+)$", proc.stdout, re.M)
    failed = f"README.md block at line {started[-1]}" if started else "README.md"
    check_clean_run(proc, failed)
    assert "=== all blocks ran" in proc.stdout and len(started) == len(RUN_BLOCKS), proc.stdout
    outputs = re.split(r"^=== block at line \d+$", proc.stdout, flags=re.M)[1:]
    for block, output in zip(RUN_BLOCKS, outputs, strict=True):
        for promise in promised_outputs(block.code):
            assert promise in output, f"README.md line {block.line} promises {promise!r}:\n{output}"
