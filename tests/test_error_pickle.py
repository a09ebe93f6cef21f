"""Every public error class keeps its message (and the culprit in it) through a pickle round trip.

Errors cross process boundaries (Ray pickles what a worker raises), and a custom ``__init__`` with
several arguments plus a ``__reduce__`` or ``args`` override is easy to get wrong: ``str(e)`` then
prints the argument tuple instead of the message. The list of classes is collected from the
packages, so a new error class without an entry below fails here until it gets one.
"""

from __future__ import annotations

import inspect
import pickle
from collections.abc import Callable

import pytest

import controlplane
import controlplane.errors
import dataplane
import dataplane.errors
import workers
from controlplane.errors import make_call_error

CULPRIT = "culprit-7f3a"

# class name -> a constructor call whose message must contain CULPRIT (classes whose __init__ takes
# one message need no entry).
_FACTORIES: dict[str, Callable[[type], BaseException]] = {
    "KeyNotFoundError": lambda c: c(CULPRIT, "p0"),
    "FieldNotFoundError": lambda c: c("k0", "p0", CULPRIT),
    "PartitionNotFoundError": lambda c: c(CULPRIT),
    "StaleMetaError": lambda c: c(CULPRIT, "p0", "Scorer.score"),
    "SchemaError": lambda c: c("f0", f"field {CULPRIT} has the wrong dtype"),
    "InvalidArgumentError": lambda c: c("batch_size", f"batch_size={CULPRIT} must be an int"),
    "ArgumentTypeError": lambda c: c("capcity", f"unknown store option {CULPRIT!r}"),
    "SchemaMismatchError": lambda c: c("f0", "tensor:float32:1", f"field {CULPRIT} is int64"),
    "ShardUnavailableError": lambda c: c("shard-0", f"shard {CULPRIT} is dead"),
    "BatchTimeoutError": lambda c: c("p0", f"waited for {CULPRIT}"),
    "LeaseExpiredError": lambda c: c("p0", f"the lease of {CULPRIT} ran out", keys=["k0"]),
    "ClusterConnectError": lambda c: c("10.0.0.1:6379", f"nothing answers at {CULPRIT}"),
    "ClusterAuthError": lambda c: c("10.0.0.1:6379", f"{CULPRIT} refused the token"),
    "ProtocolVersionError": lambda c: c(2, 1, f"{CULPRIT} speaks version 2"),
    "CheckpointError": lambda c: c("/ckpt/shard-0.bin", f"file {CULPRIT} is corrupted"),
    "CheckpointNotFoundError": lambda c: c("/ckpt/manifest.json", f"{CULPRIT} does not exist"),
    "WorkerDiedError": lambda c: c(f"worker {CULPRIT} (rank 1) is dead", rank=1, worker_name=CULPRIT),
    "MeshConflictError": lambda c: c(f"mesh {CULPRIT} is already registered", mesh_name=CULPRIT),
    "WorkerCallError": lambda c: c("W.f", [1], ValueError(CULPRIT), world_size=2),
    "DriverDataError": lambda c: c("wg.f", "args[0]", CULPRIT),
    "BridgeError": lambda c: c(f"W.{CULPRIT}", 1, 2),
}


def _public_error_classes() -> list[type]:
    found: dict[str, type] = {}
    for module in (dataplane.errors, dataplane, controlplane.errors, controlplane, workers):
        for name in getattr(module, "__all__", dir(module)):
            obj = getattr(module, name, None)
            if inspect.isclass(obj) and issubclass(obj, BaseException):
                found[obj.__qualname__] = obj
    return sorted(found.values(), key=lambda c: c.__qualname__)


def _make(cls: type) -> BaseException:
    factory = _FACTORIES.get(cls.__qualname__)
    if factory is not None:
        return factory(cls)
    params = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in params if p.default is p.empty and p.kind in positional]
    assert len(required) <= 1 or params[0].kind is inspect.Parameter.VAR_POSITIONAL, (
        f"{cls.__qualname__}.__init__ takes {[p.name for p in required]}: add it to _FACTORIES"
    )
    return cls(f"something about {CULPRIT} went wrong")


@pytest.mark.parametrize("cls", _public_error_classes(), ids=lambda c: c.__qualname__)
def test_error_message_survives_pickle(cls: type) -> None:
    err = _make(cls)
    text = str(err)
    assert CULPRIT in text and not text.startswith("("), f"{cls.__qualname__}: str() is {text!r}"
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == text
    assert back.__dict__.keys() >= {k for k in err.__dict__ if not k.startswith("_")}  # attributes kept


def _dataplane_error_classes() -> list[type]:
    return [c for c in _public_error_classes() if c.__module__ == "dataplane.errors"]


@pytest.mark.parametrize("cls", _dataplane_error_classes(), ids=lambda c: c.__qualname__)
def test_error_crosses_the_wire_as_itself(cls: type) -> None:
    """What a shard or the index raises reaches the client as the same class with the same culprit
    attributes, from the attributes the class declares (``wire_attrs``) and nothing else."""
    from dataplane.wire import frames as _wire

    err = _make(cls)
    declared = set(cls.wire_attrs)
    public = {k for k in err.__dict__ if not k.startswith("_")}
    assert public == declared, f"{cls.__qualname__} sets {sorted(public)} but declares {sorted(declared)}"
    rep, _ = _wire.decode_raw_reply(_wire.encode_error(3, err))
    back = _wire.rebuild_error(rep.error)
    assert type(back) is cls and str(back) == str(err)
    assert {a: getattr(back, a) for a in cls.wire_attrs} == {a: getattr(err, a) for a in cls.wire_attrs}


def test_a_malformed_or_foreign_error_is_typed() -> None:
    from dataplane.wire import frames as _wire

    for bad in (None, ["KeyNotFoundError", "m"], ["KeyNotFoundError", 5, {}], ["KeyNotFoundError", "m", []]):
        with pytest.raises(dataplane.WireError, match="malformed error"):
            _wire.rebuild_error(bad)
    assert type(_wire.rebuild_error(["__class__", "m", {}])) is dataplane.DataplaneError
    partial = _wire.rebuild_error(["FieldNotFoundError", "m", {"key": "k"}])  # a peer left some out
    assert (partial.key, partial.partition_id, partial.field) == ("k", "?", "?")


def test_the_list_covers_each_package() -> None:
    names = {c.__qualname__ for c in _public_error_classes()}
    wanted = {"KeyNotFoundError", "WorkerCallError", "WorkerDiedError", "DriverDataError", "BridgeError"}
    assert wanted <= names, names


def test_worker_call_error_mixes_in_the_cause_class_and_pickles() -> None:
    err = make_call_error("Scorer.score", [0, 1], dataplane.KeyNotFoundError(CULPRIT, "p0"), world_size=2)
    assert isinstance(err, controlplane.WorkerCallError) and isinstance(err, dataplane.KeyNotFoundError)
    assert err.key == CULPRIT  # the cause's attributes read through
    expected = f"Scorer.score failed on ranks 0, 1 of 2; rank 0 raised KeyNotFoundError: key '{CULPRIT}'"
    assert str(err).startswith(expected), str(err)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err) and back.failed_ranks == [0, 1]
    # A cause class Python cannot mix in (an incompatible constructor) still gives a WorkerCallError.
    odd = make_call_error("W.f", [0], OSError(2, "no such file"))
    assert isinstance(odd, controlplane.WorkerCallError) and "no such file" in str(odd)
