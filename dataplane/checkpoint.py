"""Checkpoint and restore of the whole store: ``dp.save_checkpoint(dir)`` and ``dp.load_checkpoint(dir)``.

An async RL run saves its store with each checkpoint of its weights, so that rows in flight (prompts
taken from the dataloader, not yet trained on) survive a restart::

    dp.save_checkpoint(step_dir / "store", metadata={"global_steps": step})
    ...                                        # crash, restart, dp.init()
    info = dp.load_checkpoint(step_dir / "store")
    info.metadata["global_steps"]

**Who moves the bytes.** Each shard writes its own rows into the directory and reads them back, in
parallel (``server.shard.checkpoint``); the index writes the metadata (``server.index.checkpoint``).
The calling process handles names, sizes and checksums only: ``CheckpointInfo.driver_bytes`` counts
what passed through it, and it does not grow with the rows' bytes.

**What is saved.** Every partition: its rows (every field, with its exact dtype and shapes: dense,
jagged and ragged tensors, strings, JSON-like values, pickled objects as opaque bytes), each key's
tag and fields, each field's schema, and the streaming state: what every consumer task has taken
(``next_batch``), its ready rows in order, the rank-aware batches it remembers, finished partitions
and what ``reset_consumption`` did. After a load, ``kv_list``, gets, ``next_batch`` and
``consumption`` answer as they did at the save. The format has no pickle anywhere
(``server.checkpoint_files``: a JSON manifest, msgpack metadata, raw column buffers with their specs),
and every file is checksummed.

**Atomic.** A save writes ``<dir>.tmp``, makes it durable (fsync), then swaps it in: ``<dir>`` is
renamed to ``<dir>.old``, ``<dir>.tmp`` to ``<dir>``, and ``<dir>.old`` is removed. A save that fails
or is killed at any point leaves the previous checkpoint loadable; a load (or the next save) first
rolls back a swap that was interrupted (``<dir>`` missing and ``<dir>.old`` present). A load is all or
nothing too: every file is read and checked, and every shard has its rows in memory, before
anything of the store changes.

**Loads anywhere.** A checkpoint loads into a store of any number of shards, on any nodes (each
row goes where the new store's hashing places it). A store process must see the directory at the
same path as the caller (a filesystem shared by every node, for a store spanning nodes); one that
cannot makes the save or load fail with an error naming its node and the path.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
import zlib
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from dataplane.api import current_client
from dataplane.client.stream_ops import index_call
from dataplane.config import NAMESPACE
from dataplane.errors import CheckpointError, CheckpointNotFoundError, DataplaneError, ShardUnavailableError
from dataplane.server.checkpoint_files import (
    FORMAT,
    INDEX_FILE,
    MANIFEST,
    VERSION,
    fsync_dir,
    new_token,
    shard_files,
    write_small,
)
from dataplane.wire import protocol as _protocol

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
MAX_MANIFEST_BYTES = 64 << 20


@dataclass(frozen=True)
class CheckpointInfo:
    """What a save wrote or a load restored.

    Attributes:
        path: the checkpoint directory (absolute).
        partitions: keys per partition.
        data_bytes: bytes of row data the shards wrote (save) or read (load).
        driver_bytes: bytes of requests and replies that went through the calling process (the
            index's and the shards' answers, the manifest): metadata only.
        metadata: the ``metadata`` given to ``save_checkpoint``.
        seconds: how long the call took.
        left_out: keys a save left out because they were cleared while it ran (see
            ``save_checkpoint``); 0 for a load.
    """

    path: str
    partitions: dict[str, int]
    data_bytes: int
    driver_bytes: int
    metadata: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    left_out: int = 0


def save_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    *,
    metadata: dict[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> CheckpointInfo:
    """Save every partition of the store (rows, tags, schemas, streaming state) into ``checkpoint_dir``.

    The directory is replaced atomically: until this returns, the previous checkpoint there (if any)
    stays intact and loadable, whatever happens to this process or the store; an existing directory
    that is not a checkpoint is refused, never replaced. One save at a time per directory.

    What a save sees of puts in flight: the index's metadata is taken at one instant, when the index
    handles the save. A put whose index commit came before is saved, one that commits after is not
    (it stays in the store, only not in this checkpoint). Each row is saved whole: a shard pins the
    rows it saves until they are written, so a clear or an overwrite racing the save cannot tear
    one. A key cleared while the save runs may be left out entirely, its metadata too, as if the
    clear came first. A put that overwrites fields of existing keys while the save runs may be
    saved with its new values (every field of one put together) and the keys' previous tags.

    Args:
        checkpoint_dir: where to save; visible at the same path to every node of the store.
        metadata: JSON values kept in the checkpoint's manifest (``CheckpointInfo.metadata`` on load).
        timeout_s: how long the shards may take to write their rows.

    Returns:
        ``CheckpointInfo``: keys per partition, data bytes, bytes through this process.

    Raises:
        CheckpointError: a store process cannot reach the directory (names its node), a write failed
            (disk full), a shard died, or ``checkpoint_dir`` exists and is not a checkpoint.
        TypeError: ``metadata`` is not a dict of JSON values.

    Example:
        >>> info = dp.save_checkpoint("/shared/ckpt/step_100/store", metadata={"global_steps": 100})
        >>> info.partitions
        {'train': 1024}
    """
    meta = _check_metadata(metadata)
    return _run(lambda n, count: _save_flow(checkpoint_dir, meta, n, timeout_s, count), timeout_s)


def load_checkpoint(
    checkpoint_dir: str | os.PathLike[str], *, overwrite: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S
) -> CheckpointInfo:
    """Load a checkpoint ``save_checkpoint`` wrote into this store (of any number of shards).

    All or nothing: every file is checked (sizes, checksums, consistency) and every shard holds its
    rows before any partition appears. Partitions the store holds and the checkpoint does not are
    left alone; a partition the store already holds under a name of the checkpoint is refused
    unless ``overwrite=True``, which replaces it whole (rows, tags, consumption).

    Args:
        checkpoint_dir: a directory ``save_checkpoint`` wrote (visible to every node of the store).
        overwrite: replace partitions of the same names instead of refusing.
        timeout_s: how long the shards may take to read their rows.

    Returns:
        ``CheckpointInfo``: keys per partition, data bytes, and the ``metadata`` given at the save.

    Raises:
        CheckpointNotFoundError: the directory, or a file its manifest lists, does not exist.
        CheckpointError: a file is truncated, corrupted or inconsistent (names it), a store process
            cannot read the directory (names its node), or partitions of the same names exist (names
            them); nothing was loaded.
        StoreFullError: the rows do not fit in a shard's capacity; nothing was loaded.

    Example:
        >>> dp.load_checkpoint("/shared/ckpt/step_100/store").metadata
        {'global_steps': 100}
    """
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be a bool, not {type(overwrite).__name__}")
    return _run(lambda n, count: _load_flow(checkpoint_dir, overwrite, n, timeout_s, count), timeout_s)


async def async_save_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    *,
    metadata: dict[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> CheckpointInfo:
    """Async ``save_checkpoint``: the event loop runs while the shards write."""
    meta = _check_metadata(metadata)
    return await _arun(lambda n, count: _save_flow(checkpoint_dir, meta, n, timeout_s, count), timeout_s)


async def async_load_checkpoint(
    checkpoint_dir: str | os.PathLike[str], *, overwrite: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S
) -> CheckpointInfo:
    """Async ``load_checkpoint``: the event loop runs while the shards read."""
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be a bool, not {type(overwrite).__name__}")
    return await _arun(lambda n, count: _load_flow(checkpoint_dir, overwrite, n, timeout_s, count), timeout_s)


# ---- the steps of a checkpoint, driven sync or async ----------------------------------------------


@dataclass
class _Index:
    """One call to the index: its op and request struct (``wire.protocol``)."""

    op: str
    body: msgspec.Struct


@dataclass
class _Shards:
    """One Ray call on every shard actor (shard ``i`` gets ``args[i]``)."""

    method: str
    args: Sequence[tuple[object, ...]]
    path: str


Flow = Generator[_Index | _Shards, Any, CheckpointInfo]
MakeFlow = Callable[[int, "_Counter"], Flow]  # (number of shards, byte counter) -> the flow
T = TypeVar("T")


class _Counter:
    """Bytes through this process: each request, reply and file it handles, as msgpack would carry it."""

    def __init__(self) -> None:
        self.bytes = 0

    def add(self, value: T) -> T:
        self.bytes += len(msgspec.msgpack.encode(value))
        return value


def _actors(num: int) -> list[ActorHandle]:
    import ray

    config = current_client().config
    return [ray.get_actor(config.shard_name(i), namespace=NAMESPACE) for i in range(num)]


class _Driver:
    """Runs a flow's steps: ``_run`` blocking, ``_arun`` on the event loop; the flow is the same."""

    def __init__(self, make: MakeFlow, timeout_s: float) -> None:
        self.client = current_client()
        num = len(self.client.registry["shards"])
        self.count = _Counter()
        self.flow: Flow = make(num, self.count)
        self.actors = _actors(num)
        self.timeout_s = timeout_s
        self.info: CheckpointInfo | None = None
        self.step: _Index | _Shards | None = None
        self.advance(None, None)

    def advance(self, result: Any, error: BaseException | None) -> None:
        """The flow's next step, given the last one's result or error (``step`` None once it returned)."""
        try:
            self.step = self.flow.send(self.count.add(result)) if error is None else self.flow.throw(error)
        except StopIteration as stop:
            self.step, self.info = None, stop.value

    def submit(self, step: _Shards) -> list[ObjectRef]:
        """The Ray calls of a ``_Shards`` step, sent."""
        return [
            getattr(a, step.method).remote(*self.count.add(args))
            for a, args in zip(self.actors, step.args, strict=True)
        ]


def _run(make: MakeFlow, timeout_s: float) -> CheckpointInfo:
    d = _Driver(make, timeout_s)
    while d.step is not None:
        outcome: tuple[Any, BaseException | None]
        try:
            outcome = (_do(d), None)
        except BaseException as exc:  # noqa: BLE001 - thrown into the flow, which cleans up and re-raises
            outcome = (None, exc)
        d.advance(*outcome)
    assert d.info is not None
    return d.info


async def _arun(make: MakeFlow, timeout_s: float) -> CheckpointInfo:
    d = _Driver(make, timeout_s)
    while d.step is not None:
        d.advance(*await _outcome(d))
    assert d.info is not None
    return d.info


async def _outcome(d: _Driver) -> tuple[Any, BaseException | None]:
    try:
        return await _ado(d), None
    except BaseException as exc:  # noqa: BLE001 - thrown into the flow, which cleans up and re-raises
        return None, exc


def _do(d: _Driver) -> Any:
    import ray

    step = d.step
    if isinstance(step, _Index):
        return d.client.run(index_call(step.op, d.count.add(step.body)))
    assert step is not None  # (called only while the flow has a step)
    refs = d.submit(step)
    ray.wait(refs, num_returns=len(refs), timeout=d.timeout_s)
    return _collect(step, refs, d.timeout_s)


async def _ado(d: _Driver) -> Any:
    import asyncio

    step = d.step
    if isinstance(step, _Index):
        return await d.client.arun(index_call(step.op, d.count.add(step.body)))
    assert step is not None  # (called only while the flow has a step)
    refs = d.submit(step)
    await asyncio.wait([asyncio.wrap_future(r.future()) for r in refs], timeout=d.timeout_s)
    return _collect(step, refs, d.timeout_s)


def _collect(step: _Shards, refs: list[ObjectRef], timeout_s: float) -> list[Any]:
    """Every shard's answer once all are in; the first failure (or who did not answer) otherwise."""
    import ray

    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
    if pending:
        late = [i for i, r in enumerate(refs) if r in pending]
        raise CheckpointError(
            step.path,
            f"shards {late} did not finish the checkpoint's {step.method} within timeout_s={timeout_s:.0f}s; "
            "nothing changed (raise timeout_s for a store this large)",
        )
    out, errors = [], []
    for i, ref in enumerate(refs):
        try:
            out.append(ray.get(ref))
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, BaseException) else exc
            if not isinstance(cause, DataplaneError):
                cause = CheckpointError(
                    step.path, f"shard {i} failed the checkpoint's {step.method}: {cause}"
                )
            errors.append(cause)
        except ray.exceptions.RayActorError as exc:
            errors.append(
                ShardUnavailableError(
                    f"shard-{i}", f"shard {i} died during the checkpoint's {step.method}: {exc}"
                )
            )
    if errors:
        raise errors[0]
    return out


def _quietly(step: _Index | _Shards) -> Generator[_Index | _Shards, Any, None]:
    """A clean-up step whose own failure must not hide the error being raised."""
    try:
        yield step
    except Exception as exc:  # noqa: BLE001 - best effort: the caller re-raises the first error
        logger.debug("checkpoint clean-up step %s failed: %s", step, exc)


# ---- save ------------------------------------------------------------------------------------------


def _save_flow(
    checkpoint_dir: str | os.PathLike[str],
    metadata: dict[str, Any],
    num: int,
    timeout_s: float,
    count: _Counter,
) -> Flow:
    started = time.monotonic()
    final, tmp, old = _paths(checkpoint_dir)
    _roll_back(final, old)
    _refuse_foreign(final)
    _remove_ours(tmp)
    os.makedirs(tmp)
    token = new_token()
    with open(os.path.join(tmp, token), "x"):
        pass
    try:
        saved = yield _Index("checkpoint_save", _protocol.CheckpointSave(tmp, token))
        try:
            args = [(tmp, token, num, saved.file)] * num
            results: list[_protocol.ShardSaveReply] = yield _Shards("checkpoint_save", args, final)
            missing: dict[str, list[str]] = {}
            for r in results:
                for pid, keys in r.missing.items():
                    missing.setdefault(pid, []).extend(keys)
            done = yield _Index("checkpoint_finish", _protocol.CheckpointFinish(saved.save, missing))
        except BaseException:
            yield from _quietly(_Index("checkpoint_drop", _protocol.CheckpointDrop(saved.save)))
            raise
        os.unlink(os.path.join(tmp, token))
        files = {INDEX_FILE: done.file}
        for r in results:
            files.update(r.files)
        data_bytes = sum(r.bytes for r in results)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "saved_at": time.time(),
            "metadata": metadata,
            "num_shards": num,
            "partitions": done.partitions,
            "data_bytes": data_bytes,
            "files": files,
        }
        body = count.add(_signed(manifest))
        write_small(os.path.join(tmp, MANIFEST), body)
        fsync_dir(tmp)
        _swap(tmp, final, old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    elapsed = time.monotonic() - started
    left_out = sum(len(keys) for keys in missing.values())
    return CheckpointInfo(final, done.partitions, data_bytes, count.bytes, metadata, elapsed, left_out)


def _check_metadata(metadata: object) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict of JSON values, not {type(metadata).__name__}")
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"metadata must hold JSON values only (str, int, float, bool, None, lists, dicts): {exc}"
        ) from None
    return metadata


def _signed(manifest: dict[str, Any]) -> bytes:
    """The manifest's bytes, with the checksum of its content in it (checked by ``_read_manifest``)."""
    body = json.dumps(manifest, sort_keys=True)
    return json.dumps({**manifest, "checksum": zlib.crc32(body.encode())}, indent=1, sort_keys=True).encode()


def _paths(checkpoint_dir: object) -> tuple[str, str, str]:
    if not isinstance(checkpoint_dir, str | os.PathLike):
        raise TypeError(f"checkpoint_dir must be a str or a path, not {type(checkpoint_dir).__name__}")
    final = os.path.abspath(os.fspath(checkpoint_dir))
    if final == os.path.dirname(final):
        raise ValueError(f"checkpoint_dir {final!r} is a filesystem root; name a directory inside one")
    return final, final + ".tmp", final + ".old"


def _roll_back(final: str, old: str) -> None:
    """A save killed between its two renames left ``<dir>.old`` and no ``<dir>``: put it back."""
    if not os.path.lexists(final) and os.path.isdir(old):
        logger.warning("checkpoint %s: a save was interrupted while replacing it; restoring %s", final, old)
        os.rename(old, final)
        fsync_dir(os.path.dirname(final))


_OURS = ("manifest.json", "index.msgpack")


def _ours(name: str) -> bool:
    if name in _OURS or name.startswith(".rlplane-save-"):
        return True
    stem, _, ext = name.partition(".")
    return ext in ("msgpack", "bin") and stem.startswith("shard-") and stem[6:].isdigit()


def _is_ours(path: str) -> bool:
    """Whether ``path`` is a checkpoint directory: one holding nothing but checkpoint files (or nothing),
    or a checkpoint's manifest (files a caller added beside it, such as the ``dataplane.tq`` layout's,
    go with it when it is replaced)."""
    if not os.path.isdir(path) or os.path.islink(path):
        return False
    if all(_ours(n) for n in os.listdir(path)):
        return True
    try:
        with open(os.path.join(path, MANIFEST), "rb") as f:
            return bool(json.loads(f.read(MAX_MANIFEST_BYTES)).get("format") == FORMAT)
    except (OSError, ValueError, AttributeError):
        return False


def _refuse_foreign(final: str) -> None:
    if os.path.lexists(final) and not _is_ours(final):
        raise CheckpointError(
            final,
            f"{final} exists and is not a checkpoint (it holds other files); nothing was saved. Choose "
            "another path, or remove it",
        )


def _remove_ours(path: str) -> None:
    """Remove a checkpoint directory of ours (a stale ``.tmp`` or ``.old``), refusing anything else.

    Renamed away first: a shard of a killed save may still be writing into it (through its directory
    descriptor, so into the renamed one), and the path is free at once whatever it still does there.
    """
    if not os.path.lexists(path):
        return
    if not _is_ours(path):
        raise CheckpointError(path, f"{path} exists and is not a checkpoint's; remove it, or choose another")
    trash = f"{path}.removing-{uuid.uuid4().hex[:8]}"
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _swap(tmp: str, final: str, old: str) -> None:
    """Put the new checkpoint ``tmp`` at ``final``; the previous one is loadable at every step."""
    _remove_ours(old)
    if os.path.lexists(final):
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(os.path.dirname(final))
    shutil.rmtree(old, ignore_errors=True)


# ---- load ------------------------------------------------------------------------------------------


def _load_flow(
    checkpoint_dir: str | os.PathLike[str], overwrite: bool, num: int, timeout_s: float, count: _Counter
) -> Flow:
    started = time.monotonic()
    final, _, old = _paths(checkpoint_dir)
    _roll_back(final, old)
    manifest = _read_manifest(final, count)
    files = manifest["files"]
    _check_files(final, files, manifest["num_shards"])
    entry = files[INDEX_FILE]
    staged = yield _Index(
        "checkpoint_stage", _protocol.CheckpointStage(final, entry["bytes"], entry["crc32"])
    )
    load = staged.load
    try:
        if staged.existing and not overwrite:
            raise CheckpointError(
                final,
                f"the store already holds partitions {staged.existing} that checkpoint {final} holds too; "
                "nothing was loaded. Clear them first (dp.clear_partition), or pass overwrite=True",
            )
        args = [(final, load, num, files, manifest["num_shards"], timeout_s)] * num
        results: list[_protocol.ShardStageReply] = yield _Shards("checkpoint_stage", args, final)
        yield _Shards("checkpoint_commit", [(load,)] * num, final)
        try:
            yield _Index("checkpoint_install", _protocol.CheckpointInstall(load, overwrite))
        except BaseException:
            yield from _quietly(_Shards("checkpoint_finish", [(load, False)] * num, final))
            raise
        # Installed: the shards drop what the load replaced (a shard that misses this does it itself
        # at the load's deadline).
        yield from _quietly(_Shards("checkpoint_finish", [(load, True)] * num, final))
    except BaseException:
        yield from _quietly(_Shards("checkpoint_finish", [(load, False)] * num, final))
        yield from _quietly(_Index("checkpoint_drop", _protocol.CheckpointDrop(load)))
        raise
    data_bytes = sum(r.bytes for r in results)
    elapsed = time.monotonic() - started
    return CheckpointInfo(final, staged.partitions, data_bytes, count.bytes, manifest["metadata"], elapsed)


def _read_manifest(final: str, count: _Counter) -> dict[str, Any]:
    path = os.path.join(final, MANIFEST)
    if not os.path.isdir(final):
        raise CheckpointNotFoundError(final, f"checkpoint directory {final} does not exist")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            path,
            f"{final} is not a checkpoint: it has no {MANIFEST} (a save that did not finish never leaves a "
            "directory at its path)",
        ) from None
    count.add(raw)
    try:
        manifest: dict[str, Any] = json.loads(raw)
        checksum = manifest.pop("checksum")
        intact = zlib.crc32(json.dumps(manifest, sort_keys=True).encode()) == checksum
    except (ValueError, KeyError, TypeError, AttributeError):
        intact = False
    if not intact or len(raw) > MAX_MANIFEST_BYTES:
        raise CheckpointError(path, f"checkpoint file {path} is corrupted (its checksum does not match)")
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(
            path,
            f"{path} is a {manifest.get('format')!r} checkpoint of version {manifest.get('version')!r}; this "
            f"release reads {FORMAT!r} version {VERSION}",
        )
    return manifest


def _check_files(final: str, files: object, num_shards: object) -> None:
    """Every file the manifest lists exists with the size it was written with (before any reading)."""
    if type(num_shards) is not int or num_shards < 1 or not isinstance(files, dict):
        raise CheckpointError(
            os.path.join(final, MANIFEST), f"the manifest of checkpoint {final} is malformed"
        )
    needed = [INDEX_FILE, *(name for s in range(num_shards) for name in shard_files(s))]
    for name in needed:
        if name not in files:
            raise CheckpointError(final, f"the manifest of checkpoint {final} does not list {name}")
    for name, entry in files.items():
        path = os.path.join(final, name)
        if not _ours(name) or not isinstance(entry, dict) or type(entry.get("bytes")) is not int:
            raise CheckpointError(final, f"the manifest of checkpoint {final} lists {name!r} malformed")
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                path, f"checkpoint file {path} is missing; nothing was loaded"
            ) from None
        if size != entry["bytes"]:
            what = "truncated" if size < entry["bytes"] else "longer than it was written"
            raise CheckpointError(
                path, f"checkpoint file {path} is {what}: {size} bytes, the manifest says {entry['bytes']}"
            )


__all__ = [
    "CheckpointInfo",
    "async_load_checkpoint",
    "async_save_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]
