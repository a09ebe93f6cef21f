"""``server.jobs``: requests answered in steps, as a server's loop runs them."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import pytest

from dataplane.server.jobs import WAIT_MS, Job, Jobs, in_thread, run_job


def _counting(name: str, steps: int, log: list[str]) -> Job[str]:
    for i in range(steps):
        log.append(f"{name}{i}")
        yield None
    return f"{name} done"


def test_jobs_step_round_robin_and_each_is_answered_once() -> None:
    jobs, log, answers = Jobs(), [], []
    answer = lambda reply, exc: answers.append((reply, exc))  # noqa: E731
    jobs.start(_counting("a", 3, log), answer)
    jobs.start(_counting("b", 2, log), answer)
    assert log == ["a0", "b0"] and len(jobs) == 2 and jobs.poll_ms() == 0  # first steps at once
    while jobs:
        jobs.step()
    assert log == ["a0", "b0", "a1", "b1", "a2"] and answers == [("b done", None), ("a done", None)]
    assert jobs.poll_ms() is None


def test_a_job_that_fails_is_answered_with_its_error_and_the_others_go_on() -> None:
    def failing() -> Job[None]:
        yield None
        raise ValueError("no such thing")

    jobs, answers = Jobs(), []
    jobs.start(failing(), lambda reply, exc: answers.append(("failing", exc)))
    jobs.start(_counting("c", 2, []), lambda reply, exc: answers.append((reply, exc)))
    while jobs:
        jobs.step()
    assert [a for a, _ in answers] == ["failing", "c done"]
    assert isinstance(answers[0][1], ValueError) and answers[1][1] is None


def test_a_job_waiting_on_a_thread_is_not_stepped_until_it_is_done() -> None:
    gate = threading.Event()
    future: Future[int] = in_thread(lambda: gate.wait(10) and 7)

    def waiting() -> Job[int]:
        yield future
        return future.result() + 1

    jobs, answers, lock_holds = Jobs(_Counting()), [], []
    jobs._lock.holds = lock_holds  # type: ignore[attr-defined]
    jobs.start(waiting(), lambda reply, exc: answers.append(reply))
    for _ in range(3):
        assert jobs.poll_ms() == WAIT_MS  # (all wait: the loop may block a little)
        jobs.step()
    assert answers == [] and len(lock_holds) == 1  # stepped once, then only looked at
    gate.set()
    future.result(10)
    jobs.step()
    assert answers == [8] and not jobs


class _Counting:
    """A lock that notes each hold."""

    holds: list[int]

    def __enter__(self) -> None:
        self.holds.append(1)

    def __exit__(self, *exc: Any) -> None:
        pass


def test_run_job_runs_a_job_to_its_end_on_this_thread() -> None:
    log: list[str] = []
    assert run_job(_counting("d", 3, log)) == "d done" and log == ["d0", "d1", "d2"]
    with pytest.raises(ZeroDivisionError):
        run_job(iter([in_thread(lambda: 1 / 0)]))  # type: ignore[arg-type]
