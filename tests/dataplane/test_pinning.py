"""Which copy a device transfer takes, and the registry of mappings registered with CUDA.

On CPU the registry is built with callables that record the calls (its injection point: in a process
with a GPU they are ``cudaHostRegister`` / ``cudaHostUnregister``), over real ``map_fd`` mappings of
memfd files, so the cache, the cap and the unregistration before unmapping are checked for real. The
`gpu`-marked test registers a mapping with CUDA and copies through it.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from dataplane.codec.paths import CopyPath, copy_path
from dataplane.transport.pinning import PinRegistry, cuda_calls, registry
from dataplane.transport.shm import before_unmap, map_fd

MiB = 1 << 20


def test_copy_path_takes_every_branch() -> None:
    assert copy_path("cpu", True, MiB, 10 * MiB) is CopyPath.MEMCPY  # a CPU tensor: memcpy, always
    assert copy_path("cpu", False, MiB, 0) is CopyPath.MEMCPY
    assert copy_path("cuda", True, MiB, 0) is CopyPath.DIRECT  # registered: no room needed
    assert copy_path("cuda", False, MiB, MiB) is CopyPath.REGISTER  # fits the cap exactly
    assert copy_path("cuda", False, MiB + 1, MiB) is CopyPath.STAGED  # past the cap
    assert copy_path("cuda", False, MiB, 0) is CopyPath.STAGED


class Recorder:
    """The (register, unregister) pair, recording each call; ``fail`` makes registration fail."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.fail = False
        self.mapped_at_unregister: list[bool] = []

    def register(self, addr: int, nbytes: int) -> int:
        self.calls.append(("register", addr, nbytes))
        return 1 if self.fail else 0  # (a CUDA error code, or cudaSuccess)

    def unregister(self, addr: int) -> int:
        self.calls.append(("unregister", addr, 0))
        self.mapped_at_unregister.append(_mapped(addr))
        return 0


def _mapped(addr: int) -> bool:
    """Whether ``addr`` starts a mapping of this process now (``/proc/self/maps``)."""
    with open("/proc/self/maps") as f:
        return any(int(line.split("-", 1)[0], 16) == addr for line in f)


def _mapping(nbytes: int) -> memoryview:
    fd = os.memfd_create("test-pinning")
    try:
        os.ftruncate(fd, nbytes)
        return map_fd(fd, nbytes)
    finally:
        os.close(fd)


def test_a_mapping_is_registered_once_and_a_slice_finds_it() -> None:
    rec = Recorder()
    reg = PinRegistry(4 * MiB, (rec.register, rec.unregister))
    m = _mapping(MiB)
    assert reg.pin(m) is CopyPath.DIRECT
    assert reg.pin(m[4096:8192]) is CopyPath.DIRECT  # a slice of the same mapping: no second call
    (call,) = rec.calls
    assert call[0] == "register" and call[2] == MiB and _mapped(call[1])
    stats = reg.stats()
    assert stats["pinned_bytes"] == MiB and stats["pinned_mappings"] == 1
    assert stats["registered"] == 1 and stats["direct"] == 2 and stats["staged"] == 0
    assert reg.pin(m, device="cpu") is CopyPath.MEMCPY  # a CPU tensor's copy needs no registration


def test_past_the_cap_a_copy_is_staged_and_counted_and_the_room_comes_back_at_unmap() -> None:
    rec = Recorder()
    reg = PinRegistry(3 * MiB, (rec.register, rec.unregister))
    first, second = _mapping(2 * MiB), _mapping(2 * MiB)
    assert reg.pin(first) is CopyPath.DIRECT
    assert reg.pin(second) is CopyPath.STAGED  # 2 + 2 MiB would pass the 3 MiB cap: not registered
    assert [c[0] for c in rec.calls] == ["register"]
    assert reg.stats()["staged"] == 1 and reg.stats()["pinned_bytes"] == 2 * MiB
    addr = rec.calls[0][1]
    del first
    gc.collect()
    assert rec.calls[-1] == ("unregister", addr, 0)
    assert rec.mapped_at_unregister == [True]  # unregistered while the pages were still mapped
    assert not _mapped(addr)  # then unmapped
    assert reg.stats()["pinned_bytes"] == 0 and reg.stats()["unregistered"] == 1
    assert reg.pin(second) is CopyPath.DIRECT  # the room is back


def test_a_failed_registration_stages_the_copy_and_is_tried_again_later() -> None:
    rec = Recorder()
    reg = PinRegistry(4 * MiB, (rec.register, rec.unregister))
    m = _mapping(MiB)
    rec.fail = True
    assert reg.pin(m) is CopyPath.STAGED
    assert reg.stats()["failed"] == 1 and reg.stats()["pinned_bytes"] == 0
    rec.fail = False
    assert reg.pin(m) is CopyPath.DIRECT
    assert [c[0] for c in rec.calls] == ["register", "register"]
    assert len(m.obj._unmapper.before) == 1  # its unmap is hooked once, however many tries


def test_a_mapping_whose_unmap_cannot_be_hooked_is_never_registered() -> None:
    rec = Recorder()
    reg = PinRegistry(4 * MiB, (rec.register, rec.unregister))
    assert reg.pin(memoryview(bytearray(MiB))) is CopyPath.STAGED  # no unregistration could follow
    assert rec.calls == [] and reg.stats()["failed"] == 1


def test_without_cuda_calls_or_with_a_zero_cap_nothing_is_registered() -> None:
    m = _mapping(MiB)
    assert PinRegistry(8 * MiB, None).pin(m) is CopyPath.STAGED  # no GPU in this process
    rec = Recorder()
    off = PinRegistry(0, (rec.register, rec.unregister))  # DATAPLANE_PINNED_BYTES=0
    assert off.pin(m) is CopyPath.STAGED and rec.calls == []


def test_the_process_registry_takes_its_cap_from_the_environment() -> None:
    reg = registry()
    assert reg is registry()
    expected = 8 << 30 if torch.cuda.is_available() else 0  # no CUDA calls here: nothing to register
    if "DATAPLANE_PINNED_BYTES" not in os.environ:
        assert reg.cap_bytes == expected


def test_before_unmap_hooks_only_map_fd_mappings() -> None:
    seen: list[int] = []
    assert before_unmap(memoryview(bytearray(16)), seen.append) is False
    m = _mapping(4096)
    assert before_unmap(m[:10], seen.append) is True
    del m
    gc.collect()
    assert len(seen) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_registered_mapping_takes_device_copies_both_ways() -> None:
    calls = cuda_calls()
    assert calls is not None
    reg = PinRegistry(64 * MiB, calls)
    m = _mapping(16 * MiB)
    assert reg.pin(m) is CopyPath.DIRECT
    host = torch.frombuffer(m, dtype=torch.uint8)
    assert host.is_pinned()  # CUDA sees the shared mapping as pinned memory
    x = torch.randint(0, 255, (16 * MiB,), dtype=torch.uint8, device="cuda")
    host.copy_(x, non_blocking=True)
    torch.cuda.synchronize()
    back = host.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, x)
    del host, m
    gc.collect()
    assert reg.stats()["pinned_bytes"] == 0 and reg.stats()["unregistered"] == 1
