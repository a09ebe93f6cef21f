"""``dp.async_close`` leaves the event loop free: its blocking part (stopping an embedded store waits
on Ray for seconds) runs in a thread, while the client's asyncio sockets are closed on the loop that
owns them. No Ray here: the client and the store's handle are stand-ins that record what ran where.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

import dataplane as dp
from dataplane import api

# How long the stand-in store's stop waits for the loop to run something. The loop is free when
# async_close is right, and then it runs at once; this bounds the wait of the code before, which
# blocked the loop for the whole stop.
STOP_DEADLINE_S = 10.0


class _AsyncSockets:
    def __init__(self) -> None:
        self.closed_on: int | None = None

    def close(self) -> None:
        self.closed_on = threading.get_ident()


class _Client:
    def __init__(self) -> None:
        self.asyn = _AsyncSockets()
        self.closed = False

    def close(self) -> None:
        self.closed = True


class _EmbeddedStore:
    """Its ``stop`` asks the event loop to run a coroutine, and waits (with a deadline) until it has."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.other_work_done = threading.Event()
        self.loop_ran_during_stop: bool | None = None

    async def _other_work(self) -> None:
        self.other_work_done.set()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._other_work(), self.loop)
        self.loop_ran_during_stop = self.other_work_done.wait(timeout=STOP_DEADLINE_S)


def test_async_close_leaves_the_event_loop_running(monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> tuple[_Client, _EmbeddedStore, int]:
        client, store = _Client(), _EmbeddedStore(asyncio.get_running_loop())
        monkeypatch.setattr(api._state, "client", client)
        monkeypatch.setattr(api._state, "handle", store)
        monkeypatch.setattr(api._state, "info", None)
        await dp.async_close()
        return client, store, threading.get_ident()

    client, store, loop_thread = asyncio.run(main())
    assert store.loop_ran_during_stop, "the event loop ran nothing while async_close stopped the store"
    assert client.asyn.closed_on == loop_thread, "the asyncio sockets were closed off their loop"
    assert client.closed and not dp.is_initialized()
