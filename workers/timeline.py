"""The demo's timeline: when each task worked on each batch, as JSON and (with matplotlib) a PNG.

A *span* is one batch of one task on one rank, a dict with ``task``, ``step``, ``rank``, ``rows``
and wall-clock times (``time.time()``, comparable across the processes of one machine):
``called`` (the call began: a stream call then waits for ready rows), ``start`` (it had its batch)
and ``end`` (its outputs were written). Stream mode gets the spans from the workers' reports
(:class:`workers.bridge.StreamReport`); sync mode times each blocking call on the driver
(``rank`` is ``"all"``: every rank of the group ran it).

:func:`overlap` measures how much the tasks overlapped: ``overlap_s`` is the wall time during
which at least two different tasks were working (waits not counted).

matplotlib is an optional dependency (the ``bench`` extra): :func:`plot` imports it lazily and
returns a one-line note instead of a file when it is missing.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

__all__ = ["TASK_ORDER", "overlap", "plot", "timeline_path", "write"]

# Lanes top to bottom, in pipeline order; tasks not listed follow, sorted.
TASK_ORDER = ["prompts", "rollout", "reward", "reward_metrics", "advantage", "ref", "old_log_prob", "update"]


def timeline_path(summary_path: str | pathlib.Path) -> pathlib.Path:
    """The timeline JSON next to a summary: ``demo-summary.json`` -> ``demo-timeline.json``.

    Example:
        >>> timeline_path("build/demo-summary.json").as_posix()
        'build/demo-timeline.json'
    """
    path = pathlib.Path(summary_path)
    stem = path.stem
    stem = stem[: -len("summary")] + "timeline" if stem.endswith("summary") else stem + "-timeline"
    return path.with_name(stem + ".json")


def overlap(spans: list[dict[str, Any]]) -> dict[str, Any]:
    """Busy seconds per task and the seconds during which two or more tasks worked at once.

    Example:
        >>> overlap([{"task": "a", "start": 0.0, "end": 2.0}, {"task": "b", "start": 1.0, "end": 3.0}])
        {'busy_s': {'a': 2.0, 'b': 2.0}, 'overlap_s': 1.0}
    """
    busy: dict[str, float] = {}
    events: list[tuple[float, int, str]] = []
    for span in spans:
        start, end = float(span["start"]), float(span["end"])
        busy[span["task"]] = busy.get(span["task"], 0.0) + max(0.0, end - start)
        if end > start:
            events += [(start, 1, span["task"]), (end, -1, span["task"])]
    events.sort(key=lambda e: (e[0], e[1]))  # ends before starts at equal times
    active: dict[str, int] = {}
    overlapped, last = 0.0, None
    for when, delta, task in events:
        if last is not None and sum(1 for c in active.values() if c > 0) >= 2:
            overlapped += when - last
        active[task] = active.get(task, 0) + delta
        last = when
    return {"busy_s": {k: round(v, 6) for k, v in busy.items()}, "overlap_s": round(overlapped, 6)}


def write(runs: list[dict[str, Any]], path: str | pathlib.Path) -> pathlib.Path:
    """Write ``{"runs": [{"mode", "t0", "seconds", "spans"}, ...]}`` as JSON; return the path."""
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    return out


def _lanes(spans: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    order = {t: i for i, t in enumerate(TASK_ORDER)}
    lanes = {(s["task"], s.get("rank")) for s in spans}
    return sorted(lanes, key=lambda lane: (order.get(lane[0], len(order)), lane[0], str(lane[1])))


def plot(runs: list[dict[str, Any]], path: str | pathlib.Path) -> tuple[pathlib.Path | None, str]:
    """A Gantt chart per run: one lane per (task, rank), a bar per batch, coloured by step; the
    wait before a batch (``called`` -> ``start``) as a thin grey line. Left: the whole run; right:
    three steps from the middle of it, where the overlap can be seen. Returns ``(path, "")``, or
    ``(None, note)`` when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "timeline plot skipped: matplotlib is not installed (pip install -e '.[bench]')"
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    heights = [max(2.0, 0.32 * len(_lanes(run["spans"])) + 1.3) for run in runs]
    fig, axes = plt.subplots(
        len(runs),
        2,
        figsize=(15, sum(heights)),
        squeeze=False,
        gridspec_kw={"height_ratios": heights, "width_ratios": [3, 2]},
    )
    for (full, zoom), run in zip(axes, runs, strict=True):
        _draw(full, run, None)
        seconds, steps = float(run.get("seconds") or 0.0), int(run.get("steps") or 1)
        per_step = seconds / max(steps, 1)
        middle = seconds / 2 - 1.5 * per_step
        _draw(zoom, run, (max(0.0, middle), max(0.0, middle) + 3 * per_step))
        stats = overlap(run["spans"])
        full.set_title(
            f"{run['mode']}: {steps} steps in {seconds:.2f} s ({run.get('steps_per_s', 0):.2f} steps/s), "
            f"two or more tasks at work {stats['overlap_s']:.2f} s; bar colour = step",
            fontsize=10,
        )
        zoom.set_title(f"{run['mode']}: three steps from the middle (grey: waiting for rows)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out, ""


def _draw(ax: Any, run: dict[str, Any], window: tuple[float, float] | None) -> None:
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab10").colors
    spans, t0 = run["spans"], run["t0"]
    lanes = _lanes(spans)
    row = {lane: i for i, lane in enumerate(lanes)}
    for span in spans:
        start, end, called = span["start"] - t0, span["end"] - t0, span.get("called", span["start"]) - t0
        if window is not None and (end < window[0] or called > window[1]):
            continue
        y = row[(span["task"], span.get("rank"))]
        if start > called:
            ax.plot([called, start], [y, y], color="0.7", linewidth=1.2, zorder=1)
        color = colors[int(span.get("step", 0)) % len(colors)]
        ax.barh(y, max(end - start, 1e-4), left=start, height=0.7, color=color, edgecolor="none", zorder=2)
        if window is not None and span["task"] in ("rollout", "update", "reward", "advantage"):
            label = str(span.get("step", ""))
            ax.text((start + end) / 2, y, label, ha="center", va="center", fontsize=6, clip_on=True)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([t if r in (None, "all") else f"{t} r{r}" for t, r in lanes], fontsize=8)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    if window is not None:
        ax.set_xlim(*window)
    ax.set_xlabel("seconds since the first step began")
    ax.grid(axis="x", alpha=0.3)
