"""Every user-facing error: its type, and that the message names the culprit."""

from __future__ import annotations

import asyncio
import os
import pickle
import re
import textwrap
from fractions import Fraction

import pytest
import torch
from tensordict import TensorDict

import dataplane as dp
from dataplane.config import StoreConfig
from dataplane.service.launch import no_store_message
from tests.forkserver import run_python

from .conftest import start_store

pytestmark = pytest.mark.ray

NAME = "t-err"


@pytest.fixture(scope="module")
def store(ray_cluster):
    dp.close()
    cfg, registry, handle = start_store(name=NAME, num_shards=2, rpc_timeout_s=20, capacity_bytes=2 << 20)
    dp.init(name=NAME)
    yield cfg
    dp.close()
    handle.stop()


def test_not_initialized():
    dp.close()
    with pytest.raises(dp.StoreNotInitializedError, match="dp.init"):
        dp.kv_batch_get(["a"], "p")
    with pytest.raises(dp.StoreNotInitializedError):
        dp.kv_list()


def test_missing_key_names_key_and_partition(store, pid):
    dp.kv_batch_put(["a", "b"], pid, {"x": torch.zeros(2)})
    with pytest.raises(dp.KeyNotFoundError) as err:
        dp.kv_batch_get(["a", "zz-missing"], pid)
    assert err.value.key == "zz-missing" and err.value.partition_id == pid
    assert "zz-missing" in str(err.value) and pid in str(err.value)
    assert isinstance(err.value, KeyError)


def test_missing_field_names_key_and_field(store, pid):
    dp.kv_batch_put(["a"], pid, {"x": torch.zeros(1)})
    with pytest.raises(dp.KeyNotFoundError, match="'nope'") as err:
        dp.kv_batch_get(["a"], pid, select_fields=["nope"])
    assert err.value.key == "a"


def test_tag_only_key_has_no_fields(store, pid):
    dp.kv_batch_put(["a"], pid, {"x": torch.zeros(1)})
    dp.kv_put("tagged", pid, None, tag={"t": 1})
    with pytest.raises(dp.KeyNotFoundError, match="tagged"):
        dp.kv_batch_get(["tagged"], pid)


def test_unknown_partition(store):
    with pytest.raises(dp.PartitionNotFoundError, match="never-there") as err:
        dp.kv_batch_get(["a"], "never-there")
    assert err.value.partition_id == "never-there"


def test_a_cleared_key_says_it_was_cleared_and_a_never_written_one_does_not(store, pid):
    dp.kv_batch_put(["a", "b"], pid, {"x": torch.zeros(2)})
    dp.kv_clear(["a"], pid)
    with pytest.raises(dp.KeyNotFoundError, match="was cleared") as cleared:
        dp.kv_batch_get(["a"], pid)
    with pytest.raises(dp.KeyNotFoundError, match="never written") as never:
        dp.kv_batch_get(["zz"], pid)
    assert cleared.value.key == "a" and never.value.key == "zz"
    assert "cleared" not in str(never.value).split("never written")[0], never.value


def test_a_misspelt_partition_or_field_gets_did_you_mean(store, pid):
    dp.kv_batch_put(["a"], pid, {"rewards": torch.zeros(1)})
    typo = pid[:-1] + ("x" if pid[-1] != "x" else "y")  # one letter off (never the name itself)
    with pytest.raises(dp.PartitionNotFoundError, match=f"did you mean '{pid}'"):
        dp.kv_batch_get(["a"], typo)
    with pytest.raises(dp.PartitionNotFoundError, match=f"did you mean '{pid}'"):
        dp.consumption(typo, "train")
    with pytest.raises(dp.FieldNotFoundError, match="did you mean 'rewards'") as err:
        dp.kv_batch_get(["a"], pid, select_fields=["reward"])
    assert err.value.field == "reward" and "it holds ['rewards']" in str(err.value)
    with pytest.raises(dp.BatchTimeoutError, match="did you mean 'rewards'"):
        dp.next_batch(pid, "train", 1, ["reward"], timeout_s=0.2)  # waits for a field no put writes
    dp.clear_partition(pid)
    with pytest.raises(dp.PartitionNotFoundError, match="it was cleared"):
        dp.kv_batch_get(["a"], pid)


def test_keys_given_as_one_str_are_named_before_the_fields_are_counted(store, pid):
    one_row = TensorDict({"x": torch.zeros(1)}, [1])
    with pytest.raises(TypeError, match="keys must be a list of str, not the str 'd6'"):
        dp.kv_batch_put("d6", pid, one_row)  # not "field 'x' has 1 rows but the batch has 2"


def test_batch_size_mismatch(store, pid):
    with pytest.raises(dp.BatchSizeError, match="'x'"):
        dp.kv_batch_put(["a", "b", "c"], pid, {"x": torch.zeros(2)})
    with pytest.raises(dp.BatchSizeError):
        dp.kv_batch_put(["a", "b"], pid, TensorDict({"x": torch.zeros(3)}, [3]))
    with pytest.raises(dp.BatchSizeError, match="tags"):
        dp.kv_batch_put(["a", "b"], pid, {"x": torch.zeros(2)}, tags=[{}])
    assert dp.kv_list(pid) == {}, "a failed put wrote something"


def test_schema_mismatch_names_field(store, pid):
    keys = [f"k{i}" for i in range(8)]
    dp.kv_batch_put(keys, pid, {"logp": torch.zeros(8, 4)})
    with pytest.raises(dp.SchemaError, match="'logp'") as err:
        dp.kv_batch_put(keys, pid, {"logp": torch.zeros(8, 4, dtype=torch.int64)})
    assert err.value.field == "logp"
    with pytest.raises(dp.SchemaError, match="'logp'.*2 dims per row"):
        dp.kv_batch_put(["new"], pid, {"logp": torch.zeros(1, 5, 2)})  # dims, on keys that never had it
    assert torch.equal(dp.kv_batch_get(keys, pid)["logp"], torch.zeros(8, 4)), "a rejected put wrote data"
    assert "new" not in dp.kv_list(pid)[pid]
    dp.kv_batch_put(["new"], pid, {"logp": torch.ones(1, 5)})  # another row shape is fine
    assert dp.kv_batch_get(["new"], pid)["logp"].shape == (1, 5)


def test_pickle_needs_opt_in(store, pid):
    with pytest.raises(dp.SerializationError, match="'obj'"):
        dp.kv_batch_put(["a"], pid, {"obj": [Fraction(1, 3)]})
    dp.kv_batch_put(["a"], pid, {"chat": [[{"role": "user", "content": "hi"}]]})  # JSON-like: no pickle
    assert dp.kv_batch_get(["a"], pid).get("chat").tolist() == [[{"role": "user", "content": "hi"}]]


def test_bad_arguments(store, pid):
    with pytest.raises(ValueError, match="duplicate"):
        dp.kv_batch_put(["a", "a"], pid, {"x": torch.zeros(2)})
    with pytest.raises(TypeError, match="partition_id"):
        dp.kv_batch_get(["a"], 3)
    with pytest.raises(TypeError, match="keys must be str"):
        dp.kv_batch_get([1], pid)


def test_store_full_writes_nothing(store, pid):
    before = dp.stats()["bytes_used"]
    big = torch.zeros(64, 16384)  # 4 MiB > 2 MiB capacity
    with pytest.raises(dp.StoreFullError) as err:
        dp.kv_batch_put([f"k{i}" for i in range(64)], pid, {"x": big})
    msg = str(err.value)
    assert "capacity" in msg and "nothing was written" in msg and pid in msg
    assert isinstance(err.value, MemoryError)
    assert dp.stats()["bytes_used"] == before
    assert dp.kv_list(pid) == {}
    dp.kv_batch_put(["small"], pid, {"x": torch.zeros(1, 16)})  # the store still works


def test_failed_copy_into_shared_memory_undoes_the_put(store, pid):
    import os

    client = dp.api.current_client()
    if not all(client.route.shm):
        pytest.skip("this client has no shared-memory path to the shards")
    saved = list(client.memory.pids)
    client.memory.pids[:] = [os.getpid()] * len(saved)  # a real fault: the segments cannot be mapped
    client.maps.clear()
    try:
        with pytest.raises(OSError, match="cannot open|not the shard"):
            dp.kv_batch_put([f"k{i}" for i in range(64)], pid, {"x": torch.ones(64, 1024)})
    finally:
        client.memory.pids[:] = saved
    stats = dp.stats()
    assert all(s["bytes_reserved"] == 0 for s in stats["shards"]), "a reservation was left behind"
    assert dp.kv_list(pid) == {}


@pytest.mark.parametrize("path", ["unix-lane", "zmq", "async-zmq"])
def test_a_request_over_the_frame_limit_is_refused_before_it_is_sent(store, pid, monkeypatch, path):
    """A frame larger than a shard takes (here its 1 MiB capacity + 1 MiB) would be dropped unread:
    the put is refused at once, naming the limit, instead of failing after rpc_timeout_s (zmq) or on
    a closed connection (the Unix lane) as if the shard were overloaded or dead."""
    import asyncio

    if path == "zmq":
        monkeypatch.setenv("DATAPLANE_NO_UNIX_LANE", "1")  # blocking calls over zmq ipc, not the lane
    dp.close()
    dp.init(name=NAME, transport="zmq")  # rows travel as frames

    def put(keys, fields):
        if path == "async-zmq":
            return asyncio.run(dp.async_kv_batch_put(keys, pid, fields))
        return dp.kv_batch_put(keys, pid, fields)

    try:
        keys = [f"{i:0200d}" for i in range(25_000)]  # a header of about 2.5 MB for each shard
        with pytest.raises(dp.RequestTooLargeError, match="header") as err:
            put(keys, {"x": torch.zeros(len(keys), dtype=torch.uint8)})
        msg = str(err.value)
        assert "max_message_bytes" in msg and "nothing was written" in msg and "fewer keys" in msg, msg
        with pytest.raises(dp.RequestTooLargeError, match="buffer frame"):
            put(["big"], {"x": torch.zeros(1, 3 << 20, dtype=torch.uint8)})  # 3 MiB of data in one frame
        assert dp.kv_list(pid) == {}
        assert all(s["bytes_reserved"] == 0 for s in dp.stats()["shards"]), "a reservation was left behind"
        put(["small"], {"x": torch.zeros(1, 16)})  # the store still works
    finally:
        dp.close()
        dp.init(name=NAME)


# ---- errors before work: every bad call of the stream API is typed, named, and sends nothing -------


def _bad_stream_calls(pid: str, plain: dp.KVBatchMeta) -> list[tuple[str, tuple, dict, type, str]]:
    """(function, args, kwargs, the built-in its error also is, the argument it names). Each function
    has an ``async_`` form taking the same arguments."""
    row = (pid, "t", 1, ["x"])
    return [
        ("next_batch", (7, "t", 1, ["x"]), {}, TypeError, "partition_id"),
        ("next_batch", (pid, "", 1, ["x"]), {}, TypeError, "task_name"),
        ("next_batch", (pid, "t", 0, ["x"]), {}, ValueError, "batch_size"),
        ("next_batch", (pid, "t", 1, []), {}, TypeError, "fields"),
        ("next_batch", (pid, "t", 1, 5), {}, TypeError, "fields"),
        ("next_batch", row, {"timeout_s": -1}, ValueError, "timeout_s"),
        ("next_batch", row, {"timeout_s": "1"}, TypeError, "timeout_s"),
        ("next_batch", row, {"dp_rank": 2, "dp_size": 2}, ValueError, "dp_rank"),
        ("next_batch", row, {"batch_index": -1}, ValueError, "batch_index"),
        ("next_batch", row, {"lease_s": 0}, ValueError, "lease_s"),
        ("next_batch", row, {"sampler": object()}, TypeError, "sampler"),
        (
            "next_batch",
            (pid, "t", 3, ["x"]),
            {"sampler": dp.GroupSampler(group_size=2)},
            ValueError,
            "batch_size",
        ),
        ("next_batch", row, {"sampler": dp.SeqlenBalancedSampler(dp_size=2)}, ValueError, "dp_rank"),
        ("ack", (plain,), {}, ValueError, "lease"),
        ("ack", (None,), {}, TypeError, "meta"),
        ("release", (plain,), {}, ValueError, "lease"),
        ("release", ("k0",), {}, TypeError, "meta"),
        ("finish_partition", (7,), {}, TypeError, "partition_id"),
        ("reset_consumption", (7,), {}, TypeError, "partition_id"),
        ("reset_consumption", (pid, 5), {}, TypeError, "task_name"),
        ("reset_consumption", (pid, object()), {}, TypeError, "task_name"),
        ("consumption", (7, "t"), {}, TypeError, "partition_id"),
        ("consumption", (pid, object()), {}, TypeError, "task_name"),
        ("consumption", (pid, "t"), {"fields": [1]}, TypeError, "fields"),
    ]


def test_every_bad_stream_call_raises_a_dataplane_error_that_is_also_the_builtin(store, pid):
    """Code catching ``ValueError`` / ``TypeError`` keeps working; code catching ``dp.DataplaneError``
    catches all of them; the message names the argument; nothing is sent, so nothing is taken."""
    dp.kv_batch_put(["a", "b"], pid, {"x": torch.zeros(2)})
    plain = dp.next_batch(pid, "plain", 1, ["x"], timeout_s=30)  # taken for good: it holds no lease
    calls = _bad_stream_calls(pid, plain)

    def check(where: str, err: BaseException, builtin: type, names: str) -> None:
        assert isinstance(err, dp.DataplaneError) and isinstance(err, builtin), f"{where}: {err!r}"
        assert names in str(err), f"{where} does not name {names!r}: {err}"

    for name, args, kwargs, builtin, names in calls:
        with pytest.raises(Exception) as err:  # noqa: PT011 - the class is what is checked
            getattr(dp, name)(*args, **kwargs)
        check(f"dp.{name}{args}", err.value, builtin, names)

    async def async_forms() -> None:
        for name, args, kwargs, builtin, names in calls:
            with pytest.raises(Exception) as err:  # noqa: PT011
                await getattr(dp, f"async_{name}")(*args, **kwargs)
            check(f"dp.async_{name}{args}", err.value, builtin, names)

    asyncio.run(async_forms())
    assert dp.consumption(pid, "t", ["x"])["consumed"] == 0 and dp.consumption(pid, "t", ["x"])["ready"] == 2


def test_a_bad_streaming_dataset_raises_a_dataplane_error_that_is_also_the_builtin(pid):
    good = {"partition_id": pid, "task_name": "t", "batch_size": 2, "fields": ["x"]}
    bad: list[tuple[dict, type, str]] = [
        ({"partition_id": 7}, TypeError, "partition_id"),
        ({"task_name": 5}, TypeError, "task_name"),
        ({"fields": []}, TypeError, "fields"),
        ({"fields": 5}, TypeError, "fields"),
        ({"fields": ["meta"]}, ValueError, "meta"),
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"batch_size": "2"}, TypeError, "batch_size"),
        ({"dp_rank": 1, "dp_size": 1}, ValueError, "dp_rank"),
        ({"timeout_s": -1}, ValueError, "timeout_s"),
        ({"sampler": object()}, TypeError, "sampler"),
    ]
    for change, builtin, names in bad:
        with pytest.raises(builtin, match=names) as err:
            dp.StreamingDataset(**{**good, **change})
        assert isinstance(err.value, dp.DataplaneError), f"{change}: {err.value!r}"
    with pytest.raises(dp.ArgumentTypeError, match="partition_id"):
        dp.StreamingDataset(**good).step(7)


def test_the_bridges_refusals_are_dataplane_errors():
    from dataplane.bridge import _first_request
    from dataplane.errors import BridgeError

    req = dp.StreamRequest("p", "t", 1, ["x"])
    with pytest.raises(dp.ArgumentTypeError, match="one StreamRequest"):
        _first_request((req, req), {})
    err = BridgeError("W.f", 3, 4)
    assert isinstance(err, dp.DataplaneError) and isinstance(err, ValueError)
    assert str(pickle.loads(pickle.dumps(err))) == str(err)


# ---- errors before work: dp.init --------------------------------------------------------------------


def test_init_refuses_a_misspelt_option_before_it_starts_ray(fork_server):
    """In a fresh process (this one has joined the session's Ray): the typo is named, with the option
    it meant, at once, and Ray was neither started nor joined."""
    code = textwrap.dedent(
        """
        import time
        import ray
        import dataplane as dp
        start = time.monotonic()
        try:
            dp.init(capcity="1G")
        except dp.ArgumentTypeError as err:
            print("ERR", repr(err.argument), isinstance(err, TypeError), err)
        print("RAY", ray.is_initialized(), "S", round(time.monotonic() - start, 3))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = run_python(["-c", code], timeout=120, env=env)
    out = proc.stdout
    assert "ERR 'capcity' True unknown store option 'capcity'" in out, out + proc.stderr
    assert "did you mean 'capacity_bytes'?" in out, out
    assert "RAY False" in out, out + proc.stderr


@pytest.mark.parametrize(
    ("options", "error", "names"),
    [
        ({"capacity_bytes": "1G"}, dp.ArgumentTypeError, "1 << 30"),
        ({"num_shards": 0}, dp.InvalidArgumentError, "num_shards"),
        ({"rpc_timeout_s": float("nan")}, dp.InvalidArgumentError, "rpc_timeout_s"),
        ({"transport": "shmm"}, dp.InvalidArgumentError, "did you mean 'shm'"),
        ({"encrypt": 1}, dp.ArgumentTypeError, "encrypt"),
        ({"name": ""}, dp.ArgumentTypeError, "name"),
        ({"address": "nohost"}, dp.InvalidArgumentError, "HOST:PORT"),
    ],
)
def test_init_checks_every_option_before_anything_else(ray_cluster, options, error, names):
    """Checked before the attach too: an init that would have returned the existing client refuses."""
    with pytest.raises(error, match=re.escape(names)):
        dp.init(**options)


def test_an_attach_that_finds_no_store_names_the_fix(ray_cluster):
    dp.close()
    with pytest.raises(dp.StoreNotInitializedError) as err:
        dp.init(name="t-err-none", attach_only=True)
    text = str(err.value)
    assert "no store 't-err-none'" in text and "store start --name t-err-none`" in text, text
    assert "dp.init(name='t-err-none') without attach_only=True" in text, text
    default = no_store_message(StoreConfig())
    assert "rlplane store start`" in default and "dp.init() without attach_only=True" in default, default
