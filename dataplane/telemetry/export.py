"""Hand what this process recorded to Ray's metrics pipeline, from a background thread.

Every ``interval_s`` the exporter collects the recorder (``recorder.Recorder.collect``) and passes
it to ``ray.util.metrics``: a counter's increase since the last export (``Counter.inc``), each
gauge's value (``Gauge.set``: every export, because Ray's metrics agent drops a gauge series not
set for two of its report intervals: a partition that is gone disappears), and a histogram's new
observations per bucket. Ray itself carries a histogram as bucket counts and rebuilds observations
at each bucket's midpoint in its metrics agent; the exporter records new observations at those same
midpoints, so what Prometheus shows is what observing every value at once would have shown, with
no Ray call on any hot path. Each core worker then reports to its node's metrics agent, which
Prometheus scrapes (``dataplane.metrics.endpoint``).

The interval: ``DATAPLANE_METRICS_INTERVAL_S``, else half of Ray's metrics report interval
(``RAY_metrics_report_interval_ms``, 10 s by default) within 0.5-5 s, so every gauge is set in each
report.

    >>> start()  # in a process connected to Ray: True, and the recorder is on
    True
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Any

from dataplane.config import metrics_interval_s
from dataplane.telemetry.catalog import LATENCY_BOUNDS, METRICS
from dataplane.telemetry.recorder import RECORDER, Key, Recorder

logger = logging.getLogger(__name__)

MIN_INTERVAL_S = 0.5
MAX_INTERVAL_S = 5.0


def midpoints(bounds: tuple[float, ...] = LATENCY_BOUNDS) -> list[float]:
    """The value each bucket's observations are exported at (as Ray's metrics agent rebuilds them):
    halfway between its bounds; the first bucket's lower bound is 0, the overflow's value twice the
    last bound.

    >>> midpoints((1.0, 3.0))
    [0.5, 2.0, 6.0]
    """
    mids = [bounds[0] / 2]
    mids += [(lo + hi) / 2 for lo, hi in zip(bounds, bounds[1:], strict=False)]
    return [*mids, bounds[-1] * 2]


def default_interval_s() -> float:
    """Seconds between exports (see the module docstring)."""
    asked = metrics_interval_s()
    if asked is not None:
        return asked
    import ray

    report_s: float
    try:
        report_s = ray._config.metrics_report_interval_ms() / 1000
    except AttributeError:  # a Ray without this accessor: its default
        report_s = 10.0
    return min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, report_s / 2))


STOP_WAIT_S = 5.0


class Exporter:
    """The thread that exports ``recorder`` every ``interval_s`` seconds."""

    def __init__(self, recorder: Recorder, interval_s: float) -> None:
        self.recorder = recorder
        self.interval_s = interval_s
        self._metrics: dict[str, Any] = {}  # name -> ray.util.metrics object, made on first use
        self._tags: dict[Key, dict[str, str]] = {}
        self._sent_counts: dict[Key, float] = {}
        self._sent_buckets: dict[Key, list[int]] = {}
        self._mids = midpoints()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._session: Any = None  # the Ray job the metric objects were made in
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="dataplane-metrics", daemon=True)

    def start(self) -> Exporter:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.flush()

    def stop(self) -> None:
        """No more exports: before Ray shuts down at exit. Waits for one in flight, at most
        ``STOP_WAIT_S`` (an export stuck in Ray must not keep the process from exiting)."""
        got = self._lock.acquire(timeout=STOP_WAIT_S)
        self._stop.set()
        if got:
            self._lock.release()

    def _metric(self, name: str) -> Any:
        metric = self._metrics.get(name)
        if metric is None:
            from ray.util import metrics as ray_metrics

            spec = METRICS[name]
            if spec.kind == "counter":
                metric = ray_metrics.Counter(name, spec.help, spec.tags)
            elif spec.kind == "gauge":
                metric = ray_metrics.Gauge(name, spec.help, spec.tags)
            else:
                metric = ray_metrics.Histogram(name, spec.help, list(LATENCY_BOUNDS), spec.tags)
            self._metrics[name] = metric
        return metric

    def _tags_of(self, key: Key) -> dict[str, str]:
        tags = self._tags.get(key)
        if tags is None:
            tags = self._tags[key] = dict(zip(METRICS[key[0]].tags, key[1:], strict=True))
        return tags

    def flush(self) -> None:
        """Export what was recorded since the last flush (never raises: a failure is logged once).
        Nothing is exported while this process is not connected to Ray; after it reconnects (a new
        ``ray.init``), the metric objects are made anew and only what is new since is exported."""
        import ray

        with self._lock:
            if self._stop.is_set() or not ray.is_initialized():
                return
            try:
                session = ray.get_runtime_context().get_job_id()
                if session != self._session:
                    self._metrics.clear()
                    self._session = session
                self._flush(self.recorder.collect())
            except Exception:  # noqa: BLE001 - metrics must never take the process down
                if not self._failed:
                    self._failed = True
                    logger.exception("exporting the store's metrics to Ray failed; they may be incomplete")

    def _flush(self, sample: Any) -> None:
        for key, total in sample.counters.items():
            delta = total - self._sent_counts.get(key, 0)
            if delta > 0:
                self._metric(key[0]).inc(delta, self._tags_of(key))
                self._sent_counts[key] = total
        for key, buckets in sample.histograms.items():
            sent = self._sent_buckets.get(key)
            if sent is None:
                sent = self._sent_buckets[key] = [0] * len(buckets)
            if buckets == sent:
                continue
            histogram, tags = self._metric(key[0]), self._tags_of(key)
            # Ray takes one observation per call (see the docstring): its Cython recorder directly, a
            # third cheaper than ``observe`` (which checks the same tags every call), where it has one.
            record = getattr(histogram, "_metric", None)
            record = histogram.observe if record is None else record.record
            for i, n in enumerate(buckets):
                for _ in range(n - sent[i]):
                    record(self._mids[i], tags)
                sent[i] = n
        for key, value in sample.gauges.items():
            self._metric(key[0]).set(value, self._tags_of(key))


_start_lock = threading.Lock()
_exporter: Exporter | None = None


def start(recorder: Recorder = RECORDER) -> bool:
    """Start this process's exporter (once) and turn its recorder on, if the process is connected to
    Ray; False, recording nothing, when it is not."""
    global _exporter
    with _start_lock:
        if _exporter is not None:
            return True
        import ray

        if not ray.is_initialized():
            return False
        interval = default_interval_s()
        _exporter = Exporter(recorder, interval).start()
        atexit.register(_exporter.stop)  # runs before Ray's own shutdown (registered earlier)
        recorder.interval_s = interval
        recorder.on = True
        return True


def flush() -> None:
    """Export now what this process recorded (e.g. before it disconnects from Ray)."""
    exporter = _exporter
    if exporter is not None:
        exporter.flush()


__all__ = ["Exporter", "default_interval_s", "flush", "midpoints", "start"]
