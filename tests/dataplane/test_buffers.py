"""The copy-out buffer pool: buffers come back when the last user drops them, bounded in size."""

from __future__ import annotations

import gc
import os

import numpy as np
import torch

from dataplane.codec.buffers import MIN_POOLED_BYTES, BufferPool, take, take_faulted

MiB = 1 << 20


def test_buffer_returns_when_the_tensor_built_on_it_dies() -> None:
    pool = BufferPool(max_bytes=64 * MiB)
    buf = pool.take(4 * MiB)
    address = buf.ctypes.data
    tensor = torch.frombuffer(memoryview(buf), dtype=torch.float32)
    del buf
    gc.collect()
    assert pool.idle_bytes == 0  # the tensor still holds the memory
    tensor.fill_(1.0)
    del tensor
    gc.collect()
    assert pool.idle_bytes == 4 * MiB
    again = pool.take(4 * MiB)
    assert again.ctypes.data == address  # the same warm mapping, not a fresh one
    assert pool.idle_bytes == 0


def test_pool_keeps_at_most_max_bytes_and_sizes_do_not_mix() -> None:
    pool = BufferPool(max_bytes=6 * MiB)
    bufs = [pool.take(4 * MiB), pool.take(2 * MiB), pool.take(2 * MiB)]
    del bufs
    gc.collect()
    assert pool.idle_bytes <= 6 * MiB
    big = pool.take(4 * MiB)
    small = pool.take(2 * MiB)
    assert big.nbytes == 4 * MiB and small.nbytes == 2 * MiB
    pool.clear()
    assert pool.idle_bytes == 0


def test_a_buffer_coming_back_makes_room_by_dropping_the_oldest_idle_ones() -> None:
    pool = BufferPool(max_bytes=8 * MiB)
    first, second = pool.take(2 * MiB), pool.take(4 * MiB)
    second[:] = 7  # a pooled buffer keeps its bytes; a new mapping is zeroed (its address may be reused)
    del first
    gc.collect()
    del second
    gc.collect()
    assert pool.idle_bytes == 6 * MiB
    big = pool.take(6 * MiB)  # a new size: fresh
    del big
    gc.collect()  # back: the 2 MiB one (oldest) goes, then the 4 MiB one (8 MiB would not hold all)
    assert pool.idle_bytes == 6 * MiB
    fresh = pool.take(4 * MiB)
    assert not fresh.any() and pool.idle_bytes == 6 * MiB  # not the evicted 4 MiB one: a new mapping
    too_big = pool.take(10 * MiB)
    del too_big
    gc.collect()
    assert pool.idle_bytes == 6 * MiB  # larger than the pool: dropped, nothing evicted for it
    del fresh


def test_small_buffers_bypass_the_pool() -> None:
    buf = take(MIN_POOLED_BYTES - 1)
    assert isinstance(buf, np.ndarray) and buf.nbytes == MIN_POOLED_BYTES - 1
    assert buf.flags.writeable


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_faulted_buffer_is_resident_before_anything_writes_it() -> None:
    """``take_faulted`` (what the engines receive into) brings a fresh mapping's pages in at once, in
    one pass: several connections faulting them in together are far slower."""
    size = 70 << 20  # (a size no other test pools)
    before = _resident_bytes()
    buf = take_faulted(size)
    grown = _resident_bytes() - before
    assert grown >= size * 0.9, f"only {grown >> 20} MiB of {size >> 20} MiB resident"
    del buf


def test_a_view_names_its_pooled_mapping_and_the_pool_says_what_it_lets_go() -> None:
    """``pooled`` finds the whole mapping under a slice, a cast, an array of a view (what a transfer
    engine registers once); ``on_drop`` hears of each mapping the pool lets go of: evicted to make
    room, too big to keep, cleared; never of one it keeps."""
    pool = BufferPool(max_bytes=8 * MiB)
    dropped: list[int] = []
    unhook = pool.on_drop(dropped.append)
    a, b = pool.take(4 * MiB), pool.take(4 * MiB)
    base_a, base_b = a.ctypes.data, b.ctypes.data
    for view in (memoryview(a.data)[100:200].cast("B"), memoryview(np.asarray(a[8:16])), memoryview(a)):
        mapping, address = pool.pooled(view)
        assert address == base_a and mapping.nbytes == 4 * MiB
    assert pool.pooled(memoryview(bytearray(8))) is None and pool.pooled(memoryview(np.zeros(4))) is None
    del view, mapping
    del a  # (a comes back first: the oldest idle one)
    del b
    gc.collect()
    assert pool.idle_bytes == 8 * MiB and dropped == []  # both kept
    c = pool.take(2 * MiB)  # (another size: coming back, it makes room by dropping the oldest idle one)
    del c
    gc.collect()
    assert dropped == [base_a]
    big = pool.take(16 * MiB)  # more than the pool keeps: let go as it comes back
    base_big = big.ctypes.data
    del big
    gc.collect()
    assert dropped == [base_a, base_big]
    pool.clear()
    assert base_b in dropped[2:] and len(dropped) == 4  # (b and the 2 MiB one)
    unhook()
    pool.take(4 * MiB)
    pool.clear()
    assert len(dropped) == 4  # unhooked
