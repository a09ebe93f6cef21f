"""``dp.StreamingDataset``: every row once, in micro-batches, prefetched on a bounded background thread.

A producer in another process (a Ray actor attached to the same store) writes rows one key at a time,
each with its own length, and finishes the partition; the dataset in the test process consumes them
while they are written.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
import threading
import weakref

import pytest
import ray
import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader

import dataplane as dp

from .conftest import own_store, wait_for

pytestmark = pytest.mark.ray

STORE = "t-dataset"
N_ROWS = 23  # not a multiple of any batch size below: the last batch is short
MAX_LEN = 7
KEYS = [f"r{i:02d}" for i in range(N_ROWS)]
FIELDS = ["responses", "reward"]
WAIT_S = 30  # the bound of every wait in this module (a hang fails, it does not stall the suite)


def row(i: int) -> dict:
    """Row ``i``: a response of 1..MAX_LEN tokens (varying) and a reward."""
    return {"responses": torch.arange(1 + i % MAX_LEN) + 100 * i, "reward": torch.tensor(i / 10)}


@ray.remote(num_cpus=0.1)
class Producer:
    """A rollout worker: attaches to the store and writes rows one key at a time."""

    def __init__(self, name: str) -> None:
        dp.init(name=name)

    def produce(self, pid: str, n: int = N_ROWS, finish: bool = True) -> int:
        for i in range(n):
            dp.kv_put(KEYS[i], pid, row(i), tag={"length": 1 + i % MAX_LEN})
        if finish:
            dp.finish_partition(pid)
        return n


@pytest.fixture(scope="module")
def store(ray_cluster):
    with own_store(STORE, num_shards=1, rpc_timeout_s=20) as (cfg, _):
        yield cfg


@pytest.fixture(scope="module")
def producer(store):
    actor = Producer.remote(STORE)
    yield actor
    ray.kill(actor)


def produced(producer, pid: str, **kwargs) -> int:
    """Write the rows and wait (bounded) until the producer is done."""
    return ray.get(producer.produce.remote(pid, **kwargs), timeout=WAIT_S)


def stream_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("dataplane-stream")]


@pytest.fixture(autouse=True)
def no_thread_left():
    yield
    assert stream_threads() == [], "a StreamingDataset prefetch thread outlived its iterator"


def keys_of(tds) -> list[str]:
    return [k for td in tds for k in td["meta"].keys]


def check_rows(tds) -> None:
    """Each TensorDict holds exactly the rows its meta names, with the values the producer wrote;
    together they hold every row exactly once."""
    for td in tds:
        meta = td["meta"]
        assert isinstance(meta, dp.KVBatchMeta) and meta.fields == FIELDS
        assert td.batch_size == torch.Size([meta.size])
        responses = td["responses"].unbind(0)
        for j, key in enumerate(meta.keys):
            i = KEYS.index(key)
            assert torch.equal(responses[j], row(i)["responses"]), key
            assert td["reward"][j].item() == pytest.approx(i / 10), key
            assert meta.tags[j] == {"length": 1 + i % MAX_LEN}
    keys = keys_of(tds)
    assert sorted(keys) == KEYS and len(keys) == len(set(keys))


# ---- every row once ---------------------------------------------------------------------------------


def test_every_row_once_in_micro_batches_while_the_producer_writes(producer, pid):
    ref = producer.produce.remote(pid)  # rows arrive while the dataset consumes them
    ds = dp.StreamingDataset(pid, "train", 5, FIELDS, micro_batch_size=2, timeout_s=WAIT_S)
    tds = list(ds)
    assert ray.get(ref, timeout=WAIT_S) == N_ROWS
    # batches of 5 (the last: the 3 rows left after finish), each handed out 2 rows at a time
    assert [td.batch_size[0] for td in tds] == [2, 2, 1] * 4 + [2, 1]
    assert any(td["responses"].is_nested for td in tds)  # rows of different lengths come jagged
    check_rows(tds)
    assert dp.consumption(pid, "train")["consumed"] == N_ROWS
    assert list(ds) == []  # drained: a second pass ends at once


LOADERS = {  # the ways a PyTorch user writes it: torch's default collate first
    "default collate": lambda ds: DataLoader(ds, batch_size=None),
    "collate given": lambda ds: DataLoader(ds, batch_size=None, collate_fn=dp.StreamingDataset.collate),
    "StreamingDataLoader": lambda ds: dp.StreamingDataLoader(ds),
}


@pytest.mark.parametrize("loader", list(LOADERS))
def test_in_a_dataloader(producer, pid, loader):
    ref = producer.produce.remote(pid)
    ds = dp.StreamingDataset(pid, "train", 4, FIELDS, micro_batch_size=3, timeout_s=WAIT_S)
    tds = list(LOADERS[loader](ds))
    assert ray.get(ref, timeout=WAIT_S) == N_ROWS
    assert [td.batch_size[0] for td in tds] == [3, 1] * 5 + [3]
    check_rows(tds)
    assert all(isinstance(td, TensorDict) and td.get("reward") is not None for td in tds)


def test_streaming_dataloader_reset_replays_and_step_switches_partition(producer, pid):
    produced(producer, pid)
    loader = dp.StreamingDataLoader(dp.StreamingDataset(pid, "train", 8, FIELDS, timeout_s=WAIT_S))
    first = keys_of(loader)
    assert sorted(first) == KEYS
    loader.reset()  # TransferQueue's reset: the same batches again, from the first
    assert keys_of(loader) == first
    other = pid + "-b"
    produced(producer, other)
    loader.step(other)
    assert sorted(keys_of(loader)) == KEYS and loader.dataset.partition_id == other


@pytest.mark.slow
def test_dataloader_workers_are_consumers_of_their_own(producer, pid):
    # spawned workers attach to the store through Ray; together they take every row exactly once
    ref = producer.produce.remote(pid)
    ds = dp.StreamingDataset(pid, "train", 3, FIELDS, micro_batch_size=2, timeout_s=WAIT_S)
    loader = dp.StreamingDataLoader(ds, num_workers=2)  # spawned by default: a fork cannot use Ray
    tds = list(loader)
    assert ray.get(ref, timeout=WAIT_S) == N_ROWS
    assert all(td.batch_size[0] <= 2 for td in tds)
    check_rows(tds)


def test_forked_dataloader_workers_get_a_clear_error(producer, pid):
    produced(producer, pid)
    ds = dp.StreamingDataset(pid, "train", 4, FIELDS)
    loader = DataLoader(
        ds,
        batch_size=None,
        collate_fn=dp.StreamingDataset.collate,
        num_workers=1,
        multiprocessing_context="fork",
        timeout=WAIT_S,
    )
    it = iter(loader)
    with pytest.raises(dp.StoreNotInitializedError, match="spawn") as info:
        next(it)
    # the re-raised error and its frames form a cycle holding the DataLoader iterator: break it, so
    # that dropping the iterator shuts its worker down now (a shutdown left to the cyclic GC waits
    # out torch's 5 s join timeout)
    info.value.__traceback__ = None
    gone = weakref.ref(it)
    del it, info
    assert gone() is None
    assert dp.consumption(pid, "train")["consumed"] == 0  # the worker took nothing


# ---- prefetch -----------------------------------------------------------------------------------------


class Recording(dp.StreamingDataset):
    """Records which batch indexes were requested (the hook runs on the prefetch thread)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.asked: set[int] = set()
        self.cond = threading.Condition()

    def next_meta(self, batch_index: int, timeout_s: float) -> dp.KVBatchMeta:
        with self.cond:
            self.asked.add(batch_index)
            self.cond.notify_all()
        return super().next_meta(batch_index, timeout_s)

    def wait_asked(self, index: int) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: index in self.asked, timeout=WAIT_S)


def parked(it) -> bool:
    """``it``'s prefetch thread has fetched all it may and waits for the consumer to take a batch: no
    free slot, and its loop (``_run``) itself sits in ``Condition.wait`` (not in a store call)."""
    pipe = it._pipe
    frame = sys._current_frames().get(pipe.thread.ident)
    return (
        pipe.free == 0
        and frame is not None
        and frame.f_code.co_name == "wait"
        and frame.f_back is not None
        and frame.f_back.f_code.co_name == "_run"
    )


@pytest.mark.parametrize("prefetch", [1, 2])
def test_the_next_batch_is_fetched_while_this_one_is_processed(producer, pid, prefetch):
    produced(producer, pid)
    ds = Recording(pid, "train", 4, FIELDS, prefetch=prefetch, timeout_s=WAIT_S)
    n = 0
    with iter(ds) as it:  # closed even if an assertion fails
        for k, td in enumerate(it):
            n += td.batch_size[0]
            if k == 0:  # bounded: once it can fetch no more, exactly `prefetch` batches are ahead of this
                wait_for(lambda: parked(it), WAIT_S, "the prefetch thread to wait for a free slot")
                assert sorted(ds.asked) == list(range(prefetch + 1))
            with ds.cond:
                assert max(ds.asked) <= k + prefetch
            # overlap: while batch k is processed, batch k + 1 gets requested (no later than its `next`)
            assert ds.wait_asked(k + 1), f"batch {k + 1} was not requested while batch {k} was processed"
    assert n == N_ROWS
    assert sorted(ds.asked) == list(range(N_ROWS // 4 + 2))  # 6 batches, then the empty one


def test_without_prefetch_a_batch_is_fetched_on_demand(producer, pid):
    produced(producer, pid)
    ds = Recording(pid, "train", 4, FIELDS, prefetch=0, timeout_s=WAIT_S)
    for k, _ in enumerate(ds):
        assert stream_threads() == []  # no thread at all
        with ds.cond:
            assert max(ds.asked) == k


# ---- errors -------------------------------------------------------------------------------------------


def test_a_timeout_raises_batch_timeout_error_out_of_the_iterator(producer, pid):
    produced(producer, pid, n=3, finish=False)  # 3 rows, and more never come
    it = iter(dp.StreamingDataset(pid, "train", 2, FIELDS, timeout_s=0.5))
    assert next(it)["meta"].keys == KEYS[:2]
    with pytest.raises(
        dp.BatchTimeoutError, match=r"batch 1 of task 'train'.*not ready within timeout_s=0.5"
    ):
        next(it)
    assert stream_threads() == []  # the error ended the thread
    with pytest.raises(StopIteration):
        next(it)
    counts = dp.consumption(pid, "train")
    assert counts["consumed"] == 2 and counts["ready"] == 1  # the batch that timed out took nothing


def test_a_partition_that_never_appears_times_out_too(store, pid):
    with pytest.raises(dp.BatchTimeoutError, match="was not ready") as info:
        list(dp.StreamingDataset(pid, "train", 2, FIELDS, timeout_s=0.5))
    assert isinstance(info.value.__cause__, dp.PartitionNotFoundError)


# ---- tasks, peers, ranks ------------------------------------------------------------------------------


def test_two_tasks_each_see_every_row(producer, pid):
    ref = producer.produce.remote(pid)
    reward = dp.StreamingDataset(pid, "reward", 4, FIELDS, timeout_s=WAIT_S)
    train = dp.StreamingDataset(pid, "train", 6, FIELDS, micro_batch_size=3, timeout_s=WAIT_S)
    got: dict[str, list] = {"reward": [], "train": []}
    for a, b in itertools.zip_longest(reward, train):  # both iterating at once, each with its thread
        for name, td in (("reward", a), ("train", b)):
            if td is not None:
                got[name].append(td)
    assert ray.get(ref, timeout=WAIT_S) == N_ROWS
    check_rows(got["reward"])
    check_rows(got["train"])


def test_peers_of_one_rank_get_the_same_batches_and_ranks_get_disjoint_ones(producer, pid):
    ref = producer.produce.remote(pid)
    rank0 = dp.StreamingDataset(pid, "train", 4, FIELDS, dp_rank=0, dp_size=2, timeout_s=WAIT_S)
    rank1 = dp.StreamingDataset(pid, "train", 4, FIELDS, dp_rank=1, dp_size=2, timeout_s=WAIT_S)
    got0, got1 = [], []
    for a, b in itertools.zip_longest(rank0, rank1):
        got0 += [a] if a is not None else []
        got1 += [b] if b is not None else []
    assert ray.get(ref, timeout=WAIT_S) == N_ROWS
    check_rows(got0 + got1)  # disjoint, and every row once
    peer0 = dp.StreamingDataset(pid, "train", 4, FIELDS, dp_rank=0, dp_size=2, timeout_s=WAIT_S)
    assert [td["meta"].keys for td in peer0] == [td["meta"].keys for td in got0]


def test_a_rank_aware_sampler_splits_each_global_batch_over_the_ranks(producer, pid):
    # SeqlenBalancedSampler needs dp_rank and batch_index on every call: one global batch of 8 rows
    # per batch index, split 4 / 4 by token count; each rank's part is kept for its own call
    sampler = dp.SeqlenBalancedSampler("length", dp_size=2)
    ranks = [
        dp.StreamingDataset(pid, "train", 4, FIELDS, dp_rank=r, dp_size=2, sampler=sampler, timeout_s=WAIT_S)
        for r in (0, 1)
    ]
    ref = producer.produce.remote(pid)
    got = list(itertools.zip_longest(*ranks))
    assert ray.get(ref, timeout=WAIT_S) == N_ROWS
    assert [(a.batch_size[0], b.batch_size[0]) for a, b in got] == [(4, 4), (4, 4), (4, 3)]
    check_rows([td for pair in got for td in pair])


# ---- stopping -----------------------------------------------------------------------------------------


def test_an_early_break_leaves_no_thread_and_the_next_pass_goes_on(producer, pid):
    produced(producer, pid)
    ds = dp.StreamingDataset(pid, "train", 4, FIELDS, prefetch=2, timeout_s=WAIT_S)
    for td in ds:
        first = td
        break
    assert stream_threads() == []  # the dropped iterator stopped its thread (no wait needed)
    # batches the thread took ahead were not lost: the next pass hands them over
    check_rows([first, *ds])

    loader = DataLoader(ds, batch_size=None, collate_fn=dp.StreamingDataset.collate)
    for _ in loader:
        pytest.fail("the partition is drained")
    dp.reset_consumption(pid, "train")
    for td in loader:
        assert stream_threads() != [] and td["meta"].size == 4  # read again after the reset
        break
    assert stream_threads() == []


def test_close_and_with_stop_the_thread(producer, pid):
    produced(producer, pid)
    ds = dp.StreamingDataset(pid, "train", 4, FIELDS)
    with iter(ds) as it:
        next(it)
        assert stream_threads() != []
    assert stream_threads() == []
    it = iter(ds)
    next(it)
    it.close()
    assert stream_threads() == []
    with pytest.raises(StopIteration):
        next(it)


EXIT_SCRIPT = """
import sys, threading, ray, dataplane as dp

class Waiting(dp.StreamingDataset):
    asked = threading.Event()

    def next_meta(self, batch_index, timeout_s):
        self.asked.set()
        return super().next_meta(batch_index, timeout_s)

address, store, pid = sys.argv[1:]
ray.init(address=address, logging_level="WARNING", log_to_driver=False)
dp.init(name=store, attach_only=True)
it = iter(Waiting(pid, "train", 100, ["responses"]))  # never 100 rows, never finished: it waits
assert Waiting.asked.wait(30), "the prefetch thread made no request"
print("exiting with the thread in a store call", flush=True)
"""


@pytest.mark.slow
def test_the_interpreter_exits_with_a_thread_waiting_for_rows(producer, pid):
    produced(producer, pid, n=3, finish=False)
    address = ray.get_runtime_context().gcs_address
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(EXIT_SCRIPT), address, STORE, pid],
        capture_output=True,
        text=True,
        timeout=90,  # a hang at exit fails here
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exiting with the thread in a store call" in done.stdout
    assert dp.consumption(pid, "train")["consumed"] == 0


# ---- arguments (no store needed) ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"batch_size": 0}, ValueError, "batch_size must be >= 1"),
        ({"batch_size": 2.0}, TypeError, "batch_size must be an int"),
        ({"micro_batch_size": 0}, ValueError, "micro_batch_size"),
        ({"prefetch": -1}, ValueError, "prefetch"),
        ({"timeout_s": -1}, ValueError, "timeout_s"),
        ({"dp_rank": 2, "dp_size": 2}, ValueError, "dp_rank 2 is not below dp_size 2"),
        ({"fields": ["meta"]}, ValueError, "meta"),
        ({"fields": []}, TypeError, "fields"),
        ({"sampler": dp.GroupSampler("uid", 3)}, ValueError, "not a multiple of group_size"),
        ({"sampler": "group"}, TypeError, "Sampler"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs, error, match):
    args = {"partition_id": "p", "task_name": "t", "batch_size": 4, "fields": FIELDS, **kwargs}
    with pytest.raises(error, match=match):
        dp.StreamingDataset(**args)
