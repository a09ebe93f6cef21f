"""Requests answered in steps: a ``Job`` is a generator a server's loop advances one step per pass,
answering other requests between steps, so work that grows with what a service holds (a checkpoint
of a million keys) never stalls the callers that ask for little.

A job yields ``None`` when it has more work to do now, or a ``Future`` it waits on (file I/O run in
a thread, ``in_thread``); it returns its reply. ``Jobs`` runs them on a server's loop; ``run_job``
runs one to its end on the calling thread (a core used without its server, as tests do).

    >>> def count(n: int) -> Job[int]:
    ...     total = 0
    ...     for i in range(n):  # one slice per step
    ...         total += i
    ...         yield None
    ...     return total
    >>> run_job(count(4))
    6
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Generator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
Job = Generator["Future[Any] | None", None, T]  # yields: more work now (None), or a Future it waits on
WAIT_MS = 2  # how long a loop whose jobs all wait on threads blocks in one poll


def in_thread(fn: Callable[..., T], *args: Any) -> Future[T]:
    """Run ``fn(*args)`` on a thread of its own (blocking I/O off a server's loop); its Future."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the job
            future.set_exception(exc)

    threading.Thread(target=run, name="dataplane-job-io", daemon=True).start()
    return future


def run_job(job: Job[T]) -> T:
    """Run ``job`` to its end on this thread; its result."""
    while True:
        try:
            waited = next(job)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        if waited is not None:
            waited.result()


@dataclass(eq=False)
class _Running:
    job: Job[Any]
    answer: Callable[[Any, BaseException | None], None]  # (reply, error): exactly one is given
    waiting: Future[Any] | None = None


class Jobs:
    """The jobs a server's loop runs: ``start`` one (its first step runs at once, so a request it
    refuses is answered at once), ``step`` each once per pass, round robin."""

    def __init__(self, lock: contextlib.AbstractContextManager[Any] | None = None) -> None:
        self._running: list[_Running] = []
        self._lock = lock if lock is not None else contextlib.nullcontext()  # held around each step

    def __len__(self) -> int:
        return len(self._running)

    def start(self, job: Job[Any], answer: Callable[[Any, BaseException | None], None]) -> None:
        run = _Running(job, answer)
        if self._advance(run):
            self._running.append(run)

    def step(self) -> None:
        """One step of each job that is not waiting on a thread."""
        running, self._running = self._running, []
        going = [run for run in running if self._advance(run)]
        self._running = going + self._running  # (and any job an answer started meanwhile)

    def poll_ms(self) -> int | None:
        """How long the loop may block: 0 while a job has work now, ``WAIT_MS`` while all wait on
        threads; None with no job."""
        if not self._running:
            return None
        return WAIT_MS if all(r.waiting is not None and not r.waiting.done() for r in self._running) else 0

    def _advance(self, run: _Running) -> bool:
        """One step of ``run``; whether it goes on (else it was answered)."""
        if run.waiting is not None:
            if not run.waiting.done():
                return True
            run.waiting = None  # (its outcome is read by the job itself, from the Future it kept)
        try:
            with self._lock:
                run.waiting = next(run.job)
        except StopIteration as done:
            run.answer(done.value, None)
            return False
        except Exception as exc:  # noqa: BLE001 - the request gets the error, the loop goes on
            run.answer(None, exc)
            return False
        return True


__all__ = ["WAIT_MS", "Job", "Jobs", "in_thread", "run_job"]
