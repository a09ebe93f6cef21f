"""Checkpoints of the stream-mode trainer: the policy, the store and the trainer, saved together, so
that a run killed at any point resumes from the last checkpoint (``rlplane demo --mode stream
--checkpoint-dir DIR --checkpoint-every N``, then ``--resume DIR``).

A checkpoint is taken between two steps, before step ``k`` trains: the policy holds the updates of
steps ``0 .. k-1``; the store holds the rows of the steps already launched (``k`` up to
``k + max_staleness``: prompts, responses, rewards, advantages, not yet trained on), which is what
an async trainer must not lose. The stages of those steps finish first, so that no consumer holds
rows it has taken but not written back. The layout of ``DIR``::

    step-<k>/actor.pt       the policy's weights and optimizer state (``torch.save``; loaded
                            ``weights_only``)
    step-<k>/store/         ``dp.save_checkpoint``: the partitions in flight, with their consumption
    step-<k>/trainer.json   the trainer: the next step, the metrics so far, the prompt ledger, and the
                            reports of the calls of the steps in flight that already finished
    latest                  "step-<k>", written last (a temporary file, then a rename): it only ever
                            names a complete checkpoint

The *prompt ledger* says, for every step trained so far, which prompts (``uid`` tags) its update took,
how many rows, and in which run: after a resume, every prompt of every step appears exactly once.

    >>> check_ledger([{"step": 0, "uids": [0, 1], "rows": 4, "run": 1}], steps=1, prompts_per_step=2, n=2)
    (True, 'every prompt of steps 0-0 was trained exactly once (run 1: steps 0-0)')
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:  # imported where used: `rlplane demo --resume` checks a checkpoint without torch or Ray
    from workers.bridge import StreamReport

STATE_VERSION = 1
LATEST = "latest"
# What a complete checkpoint holds besides trainer.json (the store's manifest is written last, by a
# rename: dataplane.checkpoint).
PARTS = ("actor.pt", "store/manifest.json")
# Settings a resumed run must share with the run it resumes (the rest, e.g. steps, may change).
SAME_SETTINGS = (
    "prompts_per_step", "n", "dp", "seed", "task", "model", "actor", "max_staleness", "stream_chunks",
    "rollout_chunks",
)  # fmt: skip


class LedgerEntry(TypedDict):
    """The prompts one step trained: their uid tags, the rows its update took, the run that trained it."""

    step: int
    uids: list[int]
    rows: int
    run: int


class TrainerState(TypedDict):
    """``trainer.json``: what a run needs to resume before step ``step``."""

    version: int
    run: int
    step: int
    launched: int  # the last step launched (its stages may be in flight)
    settings: dict[str, Any]  # the run's TrainerConfig, as JSON values
    history: list[dict[str, float]]  # each trained step's metrics
    stream_counts: dict[str, dict[str, int]]  # task -> rows / consumed
    ledger: list[LedgerEntry]
    inflight: dict[str, list[tuple[str, dict[str, Any]]]]  # step -> (task, its StreamReport as JSON)


def step_dir(root: str | os.PathLike[str], step: int) -> pathlib.Path:
    return pathlib.Path(root) / f"step-{step}"


def _write_atomic(path: pathlib.Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_state(step: pathlib.Path, state: TrainerState) -> None:
    _write_atomic(step / "trainer.json", json.dumps(state, indent=1))


def mark_latest(root: str | os.PathLike[str], step: int) -> None:
    """Name ``step``'s checkpoint the one to resume from (after everything of it is written)."""
    _write_atomic(pathlib.Path(root) / LATEST, f"step-{step}\n")


class ResumeError(ValueError):
    """The checkpoint to resume from cannot be: none there, one incomplete or unreadable, or one of a run
    with other settings. The message names the directory and what is wrong."""


def latest(root: str | os.PathLike[str]) -> tuple[pathlib.Path, TrainerState]:
    """The newest complete checkpoint under ``root`` and its trainer state (files only: no torch, no Ray).

    Raises:
        ResumeError: ``root`` is not a directory, holds no complete checkpoint, or the one ``latest``
            names lacks a part or is unreadable (the message names what).
    """
    where = pathlib.Path(root)
    if not where.is_dir():
        raise ResumeError(f"{root}: {'not a directory' if where.exists() else 'no such directory'}")
    pointer = where / LATEST
    if not pointer.is_file():
        raise ResumeError(f"{root}: no complete trainer checkpoint in it (no {LATEST} file)")
    step = where / pointer.read_text().strip()
    # Each message begins with root, the directory the caller named (the CLI puts --resume before it).
    newest = f"{root}: the newest checkpoint, {step.name},"
    try:
        state: TrainerState = json.loads((step / "trainer.json").read_text())
    except (OSError, ValueError) as exc:
        raise ResumeError(f"{newest} has no readable trainer.json ({exc})") from None
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        version = state.get("version") if isinstance(state, dict) else None
        raise ResumeError(f"{newest} is of version {version!r}, not {STATE_VERSION}")
    missing = [part for part in PARTS if not (step / part).exists()]
    if missing:
        raise ResumeError(f"{newest} is incomplete: {' and '.join(missing)} missing")
    return step, state


def _plain(name: str, value: object) -> str:
    return f"{name}={value!r}"


def check_settings(
    saved: dict[str, Any],
    current: dict[str, Any],
    where: pathlib.Path,
    said: Callable[[str, object], str] = _plain,
) -> None:
    """Raise ``ResumeError`` naming the settings that differ from those of the checkpointed run
    (``said(name, value)`` writes one: ``dp=3`` by default; ``rlplane demo`` writes its flags)."""
    differ = [name for name in SAME_SETTINGS if saved.get(name) != current.get(name)]
    if differ:
        pairs = ", ".join(f"{said(n, current.get(n))} (checkpoint: {saved.get(n)!r})" for n in differ)
        raise ResumeError(f"cannot resume from {where}: {pairs}; run with the checkpointed settings")


def report_to_json(report: StreamReport) -> dict[str, Any]:
    return dataclasses.asdict(report)


def report_from_json(data: dict[str, Any]) -> StreamReport:
    from workers.bridge import StreamReport

    return StreamReport(**data)


class Done:
    """A call of a step in flight that finished before the checkpoint: its report, as a result."""

    def __init__(self, report: StreamReport) -> None:
        self.report = report

    def result(self, timeout: float) -> StreamReport:
        return self.report


def _ranges(steps: list[int]) -> str:
    return f"{min(steps)}-{max(steps)}" if steps else "none"


def check_ledger(ledger: list[LedgerEntry], steps: int, prompts_per_step: int, n: int) -> tuple[bool, str]:
    """Whether every prompt of steps ``0 .. steps-1`` was trained exactly once (each step's update took
    all ``prompts_per_step * n`` rows of its prompts, no step trained twice, none missing), and the
    line that says so."""
    per_step: dict[int, list[LedgerEntry]] = {}
    for entry in ledger:
        per_step.setdefault(entry["step"], []).append(entry)
    problems = []
    for step in range(steps):
        entries = per_step.get(step, [])
        expected = list(range(step * prompts_per_step, (step + 1) * prompts_per_step))
        if len(entries) != 1:
            problems.append(f"step {step} trained {len(entries)} times")
        elif sorted(entries[0]["uids"]) != expected or entries[0]["rows"] != prompts_per_step * n:
            problems.append(f"step {step} trained {entries[0]['rows']} rows of prompts {entries[0]['uids']}")
    if problems:
        return False, "the prompt ledger is wrong: " + "; ".join(problems)
    runs: dict[int, list[int]] = {}
    for entry in ledger:
        runs.setdefault(entry["run"], []).append(entry["step"])
    where = ", ".join(f"run {r}: steps {_ranges(s)}" for r, s in sorted(runs.items()))
    return True, f"every prompt of steps 0-{steps - 1} was trained exactly once ({where})"


__all__ = [
    "Done",
    "ResumeError",
    "check_ledger",
    "check_settings",
    "latest",
    "mark_latest",
    "report_from_json",
    "report_to_json",
    "step_dir",
    "write_state",
]
