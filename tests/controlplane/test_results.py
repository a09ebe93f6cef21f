"""A failing group call: one error naming the failed ranks and the method, read once per rank."""

from __future__ import annotations

import gc
import logging
import pickle
import threading

import pytest

from controlplane import WorkerCallError
from controlplane.binding import missing_method_hint
from tests.controlplane._group_workers import FlakyWorker
from tests.controlplane._groups import started_groups


# ---- pure ------------------------------------------------------------------------------------------
def test_missing_method_hint_names_the_fix() -> None:
    hint = missing_method_hint(FlakyWorker, "forgot_register")
    assert "FlakyWorker.forgot_register is not decorated with @register" in hint
    assert "execute_all_sync('forgot_register'" in hint
    hint = missing_method_hint(FlakyWorker, "fail_onn")
    assert "did you mean 'fail_on'?" in hint and "['fail_on']" in hint  # the Worker base's own are left out


# ---- with Ray --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def flaky(ray_session):
    with started_groups((2, FlakyWorker)) as (wg,):
        yield wg


class _Spy(logging.Handler):
    """Collects Ray's "Unhandled error" log lines (Ray logs them on ``ray._private.worker``)."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker
        self.lines: list[str] = []
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "Unhandled error" in record.getMessage():
            self.lines.append(record.getMessage())
            if self.marker in record.getMessage():
                self.seen.set()


@pytest.mark.ray
def test_failed_rank_is_named_and_survives_pickle(flaky) -> None:
    with pytest.raises(WorkerCallError) as info:
        flaky.fail_on([1])
    err = info.value
    assert err.failed_ranks == [1] and err.method == "FlakyWorker.fail_on"
    assert str(err).startswith("FlakyWorker.fail_on failed on rank 1 of 2: KeyError: 'no key on rank 1'")
    assert isinstance(err, KeyError) and type(err.cause) is KeyError  # `except KeyError` still works
    assert "raise KeyError" in err.remote_traceback  # the worker's own frame is kept
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) and back.failed_ranks == [1] and isinstance(back, KeyError)
    assert flaky.fail_on([]) == [0, 1]  # the workers are fine afterwards


@pytest.mark.ray
def test_every_failed_rank_is_read_so_ray_logs_nothing(flaky) -> None:
    spy = _Spy("(control)")
    ray_log = logging.getLogger("ray._private.worker")
    ray_log.addHandler(spy)
    try:
        with pytest.raises(WorkerCallError, match=r"on ranks 0, 1 of 2; rank 0 raised KeyError") as info:
            flaky.fail_on([0, 1])
        assert sorted(info.value.errors) == [0, 1]
        del info
        gc.collect()  # the call's refs are gone now; Ray would have logged the unread one here
        # A control: an error nobody reads (its ref dropped at once; ray.wait would count as reading it)
        # is logged, which proves the spy hears Ray; it comes after any log of the call's own refs.
        control = flaky.workers[0].fail_on.remote([0], " (control)")
        del control
        gc.collect()
        assert spy.seen.wait(timeout=60), "Ray did not log the unread control error; the spy hears nothing"
        assert len(spy.lines) == 1, spy.lines  # the control only: the call's two errors were read
    finally:
        ray_log.removeHandler(spy)


@pytest.mark.ray
def test_forgotten_register_is_explained(flaky) -> None:
    with pytest.raises(AttributeError, match=r"FlakyWorker.forgot_register is not decorated with @register"):
        flaky.forgot_register()
    assert not hasattr(flaky, "_private_thing")  # private names get the plain error, and hasattr works
