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
from typing import Any, TypedDict

__all__ = [
    "STEP_COLORS",
    "TASK_ORDER",
    "WAIT_COLOR",
    "overlap",
    "plot",
    "step_color",
    "timeline_path",
    "write",
]

# Lanes top to bottom, in pipeline order; tasks not listed follow, sorted.
TASK_ORDER = ["prompts", "rollout", "reward", "reward_metrics", "advantage", "ref", "old_log_prob", "update"]
# Bars are coloured by step from matplotlib's tab10 less its grey (#7f7f7f): grey read as "waiting",
# and every tenth step was drawn in it. Waiting is a black dotted line, a colour and a style no bar has.
STEP_COLORS = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
)  # fmt: skip
WAIT_COLOR = "#000000"
WAIT_STYLE = {"color": WAIT_COLOR, "linestyle": ":", "linewidth": 1.4}
WAIT_LABEL = "dotted black: waiting for rows"


def step_color(step: int) -> str:
    """The colour of step ``step``'s bars (``STEP_COLORS`` in turn; never ``WAIT_COLOR``).

    Example:
        >>> step_color(0) == step_color(len(STEP_COLORS)), step_color(7)
        (True, '#bcbd22')
    """
    return STEP_COLORS[step % len(STEP_COLORS)]


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


class Overlap(TypedDict):
    """How the tasks' spans overlapped (``overlap``)."""

    busy_s: dict[str, float]  # per task, the seconds it worked
    overlap_s: float  # the seconds during which two or more tasks worked at once


def overlap(spans: list[dict[str, Any]]) -> Overlap:
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


def _lanes(spans: list[dict[str, Any]]) -> list[tuple[str, object]]:
    order = {t: i for i, t in enumerate(TASK_ORDER)}
    lanes = {(s["task"], s.get("rank")) for s in spans}
    return sorted(lanes, key=lambda lane: (order.get(lane[0], len(order)), lane[0], str(lane[1])))


def plot(runs: list[dict[str, Any]], path: str | pathlib.Path) -> tuple[pathlib.Path | None, str]:
    """A Gantt chart per run: one lane per (task, rank), a bar per batch, coloured by step
    (:func:`step_color`); the wait before a batch (``called`` -> ``start``) as a black dotted line
    (``WAIT_STYLE``, named in the title). Left: the whole run; right:
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
        first = int(run.get("first_step") or 0)  # a resumed run trained steps first+1 .. first+steps
        which = f"steps {first + 1}-{first + steps}, resumed" if first else ""
        full.set_title(
            f"{run['mode']}: {steps} steps{f' ({which})' if which else ''} in {seconds:.2f} s "
            f"({run.get('steps_per_s', 0):.2f} steps/s), two or more tasks at work "
            f"{stats['overlap_s']:.2f} s; bar colour = step",
            fontsize=10,
        )
        zoom.set_title(f"{run['mode']}: three steps from the middle ({WAIT_LABEL})", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out, ""


def _draw(ax: Any, run: dict[str, Any], window: tuple[float, float] | None) -> None:
    spans, t0 = run["spans"], run["t0"]
    lanes = _lanes(spans)
    row = {lane: i for i, lane in enumerate(lanes)}
    for span in spans:
        start, end, called = span["start"] - t0, span["end"] - t0, span.get("called", span["start"]) - t0
        if window is not None and (end < window[0] or called > window[1]):
            continue
        y = row[(span["task"], span.get("rank"))]
        if start > called:
            ax.plot([called, start], [y, y], **WAIT_STYLE, zorder=1)
        color = step_color(int(span.get("step", 0)))
        ax.barh(y, max(end - start, 1e-4), left=start, height=0.7, color=color, edgecolor="none", zorder=2)
        if window is not None and span["task"] in ("rollout", "update", "reward", "advantage"):
            label = str(int(span["step"]) + 1) if "step" in span else ""  # counted from 1, as in the title
            ax.text((start + end) / 2, y, label, ha="center", va="center", fontsize=6, clip_on=True)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([t if r in (None, "all") else f"{t} r{r}" for t, r in lanes], fontsize=8)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    if window is not None:
        ax.set_xlim(*window)
    ax.set_xlabel("seconds since the first step began")
    ax.grid(axis="x", alpha=0.3)
