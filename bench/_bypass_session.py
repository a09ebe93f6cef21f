"""What one bypass run holds (Ray, the store, TransferQueue, the worker groups) and how a point is measured.

Runs in the driver, for ``bench.bypass``. ``Session`` starts only what is not running yet and
stops only what it started: an existing Ray cluster (``--address``), a store this process already
attached to, or a TransferQueue controller someone else runs are left as they were.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

from bench import _common
from bench._bypass_data import row_nbytes, seq_for
from bench._bypass_paths import PATH_CLASSES, BypassPath, Point
from bench._bypass_worker import BypassConsumer, BypassProducer, WorkerPlace
from bench._driver_cost import peak_rss_growth
from bench._rawzmq import RawZmq

if TYPE_CHECKING:
    from ray import ObjectRef

    from bench._bypass_report import Progress
    from bench.bypass import BypassConfig
    from controlplane import RayResourcePool, RayWorkerGroup, SubRayResourcePool

T = TypeVar("T")

log = logging.getLogger(__name__)

# The store's data path per --transport: "zmq" is what a worker on another node gets (tcp frames).
DP_TRANSPORT = {"auto": "auto", "shm": "shm", "zmq": "tcp"}
RAW = "pyzmq"
TQ_CONTROLLER = ("TransferQueueController", "transfer_queue")  # its actor name and namespace


class Session:
    """Ray, the store, TransferQueue and the producer group for one run; a context manager.

    Example:
        >>> with Session(cfg) as s, s.consumers(4) as consumers:
        ...     records = measure_point(s, consumers, 256 * 2**20, progress)
    """

    def __init__(self, cfg: BypassConfig) -> None:
        self.cfg = cfg
        self.notes: list[str] = []
        self.started_ray = self.owns_store = self.owns_tq = False
        self.tq: ModuleType | None = None  # transfer_queue, when this run measures it
        self._producers: RayWorkerGroup | None = None
        self.producer_nodes: list[WorkerPlace] = []
        self.store_name = cfg.store_name
        self.store_nodes: list[str] = []
        self.raw = False
        self.paths = [p for p in cfg.paths if p != "tq"]
        # id(group) -> (group, its slice), until stopped
        self._groups: dict[int, tuple[RayWorkerGroup, SubRayResourcePool]] = {}
        # one pool of 1-CPU bundles that every group of the run shares
        self._pool: RayResourcePool | None = None
        self._spawned: dict[int, RayWorkerGroup] = {}  # consumer groups started ahead, by size
        self._attached: dict[int, list[WorkerPlace]] = {}  # and where their workers run
        self.setup_s: dict[str, float] = {}  # seconds per phase outside the timed steps
        self._stack = contextlib.ExitStack()

    @property
    def producers(self) -> RayWorkerGroup:
        """The producer group (started when the session is entered)."""
        if self._producers is None:
            raise RuntimeError("bypass: the producers start when the session is entered")
        return self._producers

    # ---- setup and teardown ----------------------------------------------------------------
    def __enter__(self) -> Session:
        cfg = self.cfg
        try:
            self._timed("ray", self._start_ray)
            # Everything slow to start overlaps: TransferQueue's actors come up while the store and
            # the worker processes start, and each group's attach (imports, store client) is sent
            # as soon as the group stands; only their TransferQueue clients wait for TransferQueue.
            tq_start = None
            if "tq" in cfg.paths:
                self._stack.callback(self._close_tq)  # before the groups': they detach from it first
                tq_start = _Background(self._start_tq, "TransferQueue start (tq.init)")
            try:
                self._timed("store", self._start_store)
                self._producers = self._timed("producers", lambda: self._spawn(BypassProducer, cfg.producers))
                attaching = [self.producers.attach(*self._attach_args)]
                first = cfg.workers[0]
                self._spawned[first] = self._timed("consumers", lambda: self._spawn(BypassConsumer, first))
                attaching.append(self._spawned[first].attach(*self._attach_args))
            except BaseException:
                if tq_start is not None:
                    tq_start.wait(cfg.call_timeout_s)  # let it finish before tearing down under it
                raise
            if tq_start is not None:
                self._timed("tq", lambda: tq_start.join(cfg.call_timeout_s))
            if self.tq is not None:
                self.paths.insert(len([p for p in self.paths if p in ("floor", "classic", "store")]), "tq")
            multi_node = len(_alive_nodes()) > 1
            self.raw = cfg.raw_zmq if cfg.raw_zmq is not None else (cfg.transport == "zmq" or multi_node)
            if self.raw:
                self.paths.append(RAW)
            self.producer_nodes, self._attached[first] = self._timed(
                "attach", lambda: self._finish_attach([self.producers, self._spawned[first]], attaching)
            )
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._timed("teardown", self._stack.close)

    def _timed(self, phase: str, fn: Callable[[], T]) -> T:
        """Run ``fn``, adding its seconds to ``setup_s[phase]`` (where a slow start goes, in the run file)."""
        start = time.perf_counter()
        try:
            return fn()
        finally:
            self.setup_s[phase] = round(self.setup_s.get(phase, 0.0) + time.perf_counter() - start, 2)

    def _start_ray(self) -> None:
        from dataplane.service.connect import connect  # one meaning of --address in every rlplane command

        cfg = self.cfg

        def join() -> None:
            if cfg.address not in (None, "local"):
                connect(cfg.address, log_to_driver=False)
            else:
                # "local": a fresh Ray, never one another process left running on this host. Every
                # worker holds a 1-CPU bundle; TransferQueue's three actors want one CPU each.
                cpus = cfg.ray_num_cpus or max(8, max(cfg.workers) + cfg.producers + 4)
                connect("local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)

        self.started_ray = self._stack.enter_context(_common.ray_for_run(join))

    def _start_store(self) -> None:
        import dataplane as dp

        self.owns_store = not dp.is_initialized()
        options: dict[str, Any] = {"num_shards": self.cfg.shards}
        if self.cfg.warm_idle_s is not None:
            options["warm_idle_s"] = self.cfg.warm_idle_s
        info = dp.init(name=self.cfg.store_name, transport=DP_TRANSPORT[self.cfg.transport], **options)
        if self.owns_store:
            self._stack.callback(dp.close)
        self.store_name = info.extra.get("name", self.cfg.store_name)  # the one this process is on
        self.store_nodes = list(info.shard_nodes)

    def _start_tq(self) -> None:
        if importlib.util.find_spec("transfer_queue") is None:
            self.notes.append("tq skipped: transferqueue is not installed (pip install -e '.[bench]')")
            return
        import ray
        import transfer_queue as tq

        try:
            ray.get_actor(TQ_CONTROLLER[0], namespace=TQ_CONTROLLER[1])
            self.owns_tq = False  # someone runs TransferQueue already: attach, never kill theirs
        except ValueError:
            self.owns_tq = True
        tq.init()
        self.tq = tq

    def _close_tq(self) -> None:
        if self.tq is None:
            return
        if self.owns_tq:
            self.tq.close()
            return
        import transfer_queue.interface as tqi

        client = getattr(tqi, "_TQ_CLIENT", None)
        if client is not None:
            client.close()
            tqi._TQ_CLIENT = None

    def _spawn(self, cls: type, n: int) -> RayWorkerGroup:
        """Start ``n`` workers of ``cls`` on the first ``n`` bundles of the run's pool; stopped with the run.

        Producers and every consumer group share one pool of 1-CPU bundles, as many as the largest
        group (each actor asks a tenth of its bundle): the producers are the benchmark's own helpers
        and take no CPU slot a consumer needs, so ``--workers N`` fits a cluster of N CPUs (a plain
        ``ray start --head`` on an N-core machine).
        """
        from controlplane import RayClassWithInitArgs, RayWorkerGroup, SubRayResourcePool

        pool = self._shared_pool()
        slice_ = SubRayResourcePool(pool.get_placement_groups(), 0, n, use_gpu=False, max_colocate_count=1)
        wg = None
        try:
            wg = RayWorkerGroup(
                slice_, RayClassWithInitArgs(cls, seq=1), call_timeout_s=self.cfg.call_timeout_s
            )
        except BaseException:
            _stop_group(wg)
            raise
        self._groups[id(wg)] = (wg, slice_)
        self._stack.callback(self._stop, wg)
        return wg

    def _shared_pool(self) -> RayResourcePool:
        """The run's pool, placed on first use and removed at the end (after every group on it)."""
        if self._pool is None:
            from controlplane import RayResourcePool

            size = max(max(self.cfg.workers), self.cfg.producers)
            pool = RayResourcePool([size], use_gpu=False, max_colocate_count=1)
            # SPREAD puts bundles on different nodes where it can, PACK on as few as it can; both fall
            # back rather than fail.
            pool.get_placement_groups(strategy="SPREAD" if self.cfg.strategy == "spread" else "PACK")
            self._stack.callback(pool.remove)
            self._pool = pool
        return self._pool

    @property
    def _attach_args(self) -> tuple[str, str]:
        return self.store_name, DP_TRANSPORT[self.cfg.transport]

    def _finish_attach(
        self, groups: list[RayWorkerGroup], attaching: list[list[ObjectRef]]
    ) -> list[list[WorkerPlace]]:
        """Wait for the groups' ``attach`` calls (then attach them to TransferQueue); where workers run."""
        import ray

        pending = [ref for refs in attaching for ref in refs]
        if self.tq is not None:
            pending += [ref for wg in groups for ref in wg.attach_tq()]
        try:
            ray.get(pending, timeout=self.cfg.call_timeout_s)
        except ray.exceptions.GetTimeoutError:
            took = self.cfg.call_timeout_s
            raise TimeoutError(
                f"bypass: workers did not attach to store {self.store_name!r} within {took:.0f} s"
            ) from None
        nodes = [ray.get(refs) for refs in attaching]
        for found in nodes:
            log.info("%d workers on %s", len(found), sorted({n["node_ip"] for n in found}))
        return nodes

    def _stop(self, wg: RayWorkerGroup) -> None:
        if id(wg) in self._groups:
            _stop_group(self._groups.pop(id(wg))[0])

    @contextlib.contextmanager
    def consumers(self, n: int) -> Iterator[tuple[RayWorkerGroup, list[WorkerPlace]]]:
        """A consumer group of ``n`` workers for the points of one group size; stopped afterwards."""
        wg = self._spawned.pop(n, None) or self._timed("consumers", lambda: self._spawn(BypassConsumer, n))
        try:
            nodes = self._attached.pop(n, None) or self._timed(
                "attach", lambda: self._finish_attach([wg], [wg.attach(*self._attach_args)])[0]
            )
            yield wg, nodes
        finally:
            self._timed("teardown", lambda: self._stop(wg))


class _Background:
    """Run ``fn`` in a thread; ``join`` waits with a deadline and re-raises what it raised."""

    def __init__(self, fn: Callable[[], object], what: str) -> None:
        self.what = what
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), name=f"bypass: {what}", daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller by join()
            self.error = exc

    def wait(self, timeout_s: float) -> None:
        """Wait for the thread (at most ``timeout_s``), whatever it did."""
        self.thread.join(timeout_s)

    def join(self, timeout_s: float) -> None:
        """Wait for the thread; raise ``TimeoutError`` past ``timeout_s``, or what ``fn`` raised."""
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise TimeoutError(f"bypass: {self.what} did not finish within {timeout_s:.0f} s")
        if self.error is not None:
            raise self.error


def _stop_group(wg: RayWorkerGroup | None) -> None:
    """Detach the workers' clients (best effort) and kill them (their bundles stay the run's)."""
    if wg is not None:
        try:
            wg.teardown()
        except Exception as exc:  # noqa: BLE001 - the workers are killed next either way
            log.warning("bypass workers did not detach cleanly: %s", exc)
        wg.kill()


# ---------------------------------------------------------------------------- one point


def measure_point(
    session: Session, consumers: tuple[RayWorkerGroup, list[WorkerPlace]], payload: int, progress: Progress
) -> list[dict[str, Any]]:
    """Every path at one payload on one consumer group, interleaved; returns one record per path.

    Raises:
        BypassCheckError: a path delivered wrong data (checked on the first, untimed, round).
    """
    cfg = session.cfg
    wg, consumer_nodes = consumers
    rows, seq = cfg.rows_for(payload), seq_for(cfg.row_bytes_for(payload))
    session.producers.set_seq(seq)
    wg.set_seq(seq)
    point = Point(payload, rows, seq, session.producers, wg, f"bypass-w{wg.world_size}-{payload}")
    paths: dict[str, BypassPath] = {n: PATH_CLASSES[n](point) for n in session.paths if n != RAW}
    raw = None
    try:
        if RAW in session.paths:
            raw = _raw_reference(session, point, consumer_nodes)
        _store_traffic(session, wg, reset=True)
        seconds, rss = _rounds(session, point, paths, raw, progress)
        traffic = _store_traffic(session, wg, reset=True)
        store_bytes = round(traffic / (cfg.warmup + cfg.steps)) if "store" in paths else None
        sizes = {name: path.driver_bytes() for name, path in paths.items()}
    finally:
        for path in paths.values():
            path.close()
        if raw is not None:
            raw.close()
    wire = sum(_wire_sizes(point)) if raw is not None else 0
    return _records(_point_facts(session, point, consumer_nodes), seconds, rss, sizes, store_bytes, wire)


def _rounds(
    session: Session, point: Point, paths: dict[str, BypassPath], raw: RawZmq | None, progress: Progress
) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """Warm-up and timed rounds, each visiting every path (order rotated); seconds and RSS growths."""
    cfg = session.cfg
    names = list(session.paths)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    rss: dict[str, list[int]] = {name: [] for name in names}
    for r in range(cfg.warmup + cfg.steps):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            progress.at(point, name)
            if name == RAW:
                assert raw is not None  # (RAW is among the paths only with its pair)
                grew, took = None, raw.transfer()
            else:  # the first round checks every path's whole output (untimed: a warm-up round)
                grew, took = peak_rss_growth(functools.partial(_timed, paths[name], r, check=r == 0))
            if r >= cfg.warmup:
                seconds[name].append(took)
                if grew is not None:
                    rss[name].append(grew)
            progress.update()
    return seconds, rss


def _point_facts(session: Session, point: Point, consumer_nodes: list[WorkerPlace]) -> dict[str, Any]:
    """What every record of a point shares: its sizes, groups, transport and where each process ran."""
    node_ids = {
        "producers": [n["node_id"] for n in session.producer_nodes],
        "consumers": [n["node_id"] for n in consumer_nodes],
        "store_shards": session.store_nodes,
    }
    ips = _node_ips()
    nodes = {role: [ips.get(node, node) for node in ids] for role, ids in node_ids.items()}
    return {
        "payload_bytes": point.rows * row_nbytes(point.seq),
        "payload_requested": point.payload_bytes,
        "workers": point.consumers.world_size,
        "producers": point.producers.world_size,
        "rows": point.rows,
        "row_bytes": row_nbytes(point.seq),
        "steps": session.cfg.steps,
        "transport": session.cfg.transport,
        "store_path": sorted({n["store_transport"] for n in consumer_nodes}),  # as the consumers see it
        "nodes": nodes,  # each process's node IP, per role (rank order)
        "node_ids": node_ids,  # the same as Ray node ids (two nodes may share an IP)
        "hosts": sorted({ip for ips in nodes.values() for ip in ips}),
    }


def _timed(path: BypassPath, step: int, check: bool) -> float:
    start = time.perf_counter()
    path.step(step, check)
    return time.perf_counter() - start


def _store_traffic(session: Session, consumers: RayWorkerGroup, reset: bool) -> int:
    """Bytes the workers moved through the store since the last reset (puts, bridged gets and writes)."""
    total = 0
    for group in (session.producers, consumers):
        for t in group.store_traffic(reset):
            total += t["stored_bytes"] + t["read_bytes"] + t["written_bytes"]
    return total


def _wire_sizes(point: Point) -> list[int]:
    """The store path's messages in a step: one per producer put, consumer get and consumer write-back."""
    n_p, n_c = point.producers.world_size, point.consumers.world_size
    row, out = row_nbytes(point.seq), 4 * point.seq  # OUT is float32 [seq]
    return [point.rows // n_p * row] * n_p + [point.rows // n_c * row] * n_c + [point.rows // n_c * out] * n_c


def _raw_reference(session: Session, point: Point, consumer_nodes: list[WorkerPlace]) -> RawZmq:
    """The raw pyzmq pair: sender on producer 0's node, receiver on another node where there is one."""
    src = session.producer_nodes[0]["node_id"]
    dst = next((n["node_id"] for n in consumer_nodes if n["node_id"] != src), consumer_nodes[0]["node_id"])
    raw = RawZmq(src, dst, session.cfg.call_timeout_s)
    raw.prepare(_wire_sizes(point))
    return raw


def _records(
    base: dict[str, Any],
    seconds: dict[str, list[float]],
    rss: dict[str, list[int]],
    sizes: dict[str, tuple[int, int]],
    store_bytes: int | None,
    wire_bytes: int,
) -> list[dict[str, Any]]:
    """One record per path, with overheads over the floor and the ratios the table prints."""
    out: dict[str, dict[str, Any]] = {}
    for name, secs in seconds.items():
        pair = sizes.get(name)
        sent, recv = pair if pair is not None else (None, None)
        out[name] = {
            "path": name,
            **base,
            "step_s": statistics.median(secs),
            "best_s": min(secs),
            "seconds": [round(s, 6) for s in secs],
            "driver_sent_bytes": sent,
            "driver_recv_bytes": recv,
            "driver_bytes": None if pair is None else sum(pair),
            "driver_peak_rss": max(rss[name]) if rss[name] else None,
            "store_bytes": store_bytes if name == "store" else (wire_bytes if name == RAW else None),
        }
    floor = out.get("floor")
    for name, rec in out.items():
        if name == RAW:  # all of it is moving the store path's bytes: compare with the store's overhead
            rec["overhead_s"], rec["best_overhead_s"] = rec["step_s"], rec["best_s"]
        elif floor is not None:
            rec["overhead_s"] = rec["step_s"] - floor["step_s"]
            rec["best_overhead_s"] = rec["best_s"] - floor["best_s"]
        else:
            rec["overhead_s"] = rec["best_overhead_s"] = None
    store = out.get("store")
    store_overhead = None if store is None else store["overhead_s"]
    for name in ("classic", "tq"):
        if name in out:
            out[name]["overhead_vs_store"] = _ratio(out[name]["overhead_s"], store_overhead)
    if store is not None and RAW in out:
        # >= 1: the store moved its bytes at least as fast as one bare zmq stream moves them.
        store["vs_pyzmq"] = _ratio(out[RAW]["step_s"], store["overhead_s"])
        store["vs_pyzmq_best"] = _ratio(out[RAW]["best_s"], store["best_overhead_s"])
    return list(out.values())


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None  # a non-positive overhead (within noise of the floor) has no meaningful ratio
    return num / den


def _alive_nodes() -> list[dict[str, Any]]:
    import ray

    return [node for node in ray.nodes() if node.get("Alive")]


def _node_ips() -> dict[str, str]:
    return {node["NodeID"]: node["NodeManagerAddress"] for node in _alive_nodes()}
