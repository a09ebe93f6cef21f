"""The bypass benchmark's output: progress bar, table, checks, JSON records and the PNG chart.

Runs in the driver, for ``bench.bypass``. The table shows, per point, every path's median and best
step, its overhead over the floor, the driver's bytes and peak RSS growth and the store's bytes,
then the ratios that matter (classic overhead / store overhead, TQ overhead / store overhead, the
store against raw pyzmq). The checks compare those with the targets (bench/README.md) wherever the
run has the figures; they are reported, never asserted (figures on a busy machine say little).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bench import _common

if TYPE_CHECKING:
    from bench._bypass_paths import Point
    from bench.bypass import BypassConfig

MiB = 2**20
# The bypass targets (on a quiet 2-core machine at 256 MiB and 4 workers); see bench/README.md.
TARGET_CLASSIC_X = 8.0  # classic overhead / store overhead >=
TARGET_TQ_X = 3.0  # tq overhead / store overhead >=
TARGET_PYZMQ_X = 0.8  # raw pyzmq seconds / store overhead >=
TARGET_DRIVER_GROWTH = 1.5  # store driver bytes at the largest payload / at the smallest <=

METHOD = {
    "step_s": "driver wall time of one step (producer stage, consumer stage, clean-up): median of steps",
    "best_s": "fastest step",
    "overhead_s": "step_s - floor's step_s (pyzmq: its whole transfer time)",
    "driver_bytes": "pickled size (protocol 5, out-of-band buffers) of per-rank args + results, + clear",
    "driver_peak_rss": "VmHWM during a step (reset by /proc/self/clear_refs) minus VmRSS before; max",
    "store_bytes": "store: bytes workers put, fetched and wrote back per step; pyzmq: bytes sent",
    "overhead_vs_store": "this path's overhead_s / store's overhead_s",
    "vs_pyzmq": "pyzmq seconds / store overhead_s (>= 1: the store moved its bytes as fast as raw zmq)",
}


@dataclass
class Report:
    """A run's records plus what a reader needs to trust them."""

    records: list[dict[str, Any]]
    config: BypassConfig
    notes: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    machine: dict[str, Any] = field(default_factory=_common.machine_facts)
    setup_s: dict[str, float] = field(default_factory=dict)  # start/stop seconds per phase

    def checks(self) -> list[_common.Check]:
        return evaluate(self.records)


class Progress:
    """A tqdm bar over every step of the run (stderr); a no-op when ``progress`` is off.

    Example:
        >>> with Progress(cfg, ["floor", "store"]) as bar:
        ...     bar.at(point, "store"); bar.update()
    """

    def __init__(self, cfg: BypassConfig, paths: list[str]) -> None:
        self.total = len(cfg.workers) * len(cfg.payloads) * (cfg.warmup + cfg.steps) * len(paths)
        self.bar: Any = None
        if cfg.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc="bypass", unit="step", file=sys.stderr, leave=False)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()

    def at(self, point: Point, path: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(
                f"{point.payload_bytes // MiB} MiB, {point.consumers.world_size} workers, {path}"
            )

    def update(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def point_done(self, records: list[dict[str, Any]]) -> None:
        """Show a finished point's table above the bar (without a bar, the final table says it all)."""
        if self.bar is not None:
            self.bar.write(format_table(records), file=sys.stdout)


def _f(value: float | None, scale: float = 1.0, spec: str = ".1f") -> str:
    return "-" if value is None else f"{value * scale:{spec}}"


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}x"


def format_table(records: list[dict[str, Any]]) -> str:
    """Fixed-width table, one line per path and point, then each point's ratios."""
    head = (
        f"{'W':>3} {'MiB':>6} {'path':<8}| {'step ms':>8} {'best':>8} {'overhead':>9} | "
        f"{'driver KiB sent':>15} {'recv':>9} | {'RSS+ MiB':>8} | {'store MiB':>9}"
    )
    lines = [head, "-" * len(head)]
    for (workers, payload), group in _points(records).items():
        for r in group:
            lines.append(
                f"{workers:>3} {payload / MiB:>6.0f} {r['path']:<8}| {_f(r['step_s'], 1e3):>8} "
                f"{_f(r['best_s'], 1e3):>8} {_f(r['overhead_s'], 1e3):>9} | "
                f"{_f(r['driver_sent_bytes'], 1 / 1024):>15} {_f(r['driver_recv_bytes'], 1 / 1024):>9} | "
                f"{_f(r['driver_peak_rss'], 1 / MiB):>8} | {_f(r['store_bytes'], 1 / MiB, '.0f'):>9}"
            )
        by = {r["path"]: r for r in group}
        ratios = []
        if "classic" in by and "store" in by:
            ratios.append(f"classic/store overhead {_x(by['classic'].get('overhead_vs_store'))}")
        if "tq" in by and "store" in by:
            ratios.append(f"tq/store overhead {_x(by['tq'].get('overhead_vs_store'))}")
        if "store" in by and "vs_pyzmq" in by["store"]:
            ratios.append(f"store vs raw pyzmq {_x(by['store']['vs_pyzmq'])}")
        if ratios:
            lines.append(f"{'':>19}" + "; ".join(ratios))
    return "\n".join(lines)


def _points(records: list[dict[str, Any]]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    points: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in records:
        points.setdefault((r["workers"], r["payload_bytes"]), []).append(r)
    return points


def evaluate(records: list[dict[str, Any]]) -> list[_common.Check]:
    """The bypass targets, wherever the records have the figures (every point, every group size)."""
    checks: list[_common.Check] = []
    for (workers, payload), group in _points(records).items():
        by = {r["path"]: r for r in group}
        at = f"W={workers} {payload / MiB:.0f}MiB"
        # The classic and TQ targets are the shared-memory path's; over zmq the store's own bytes cost
        # what the tcp stream costs, and the pyzmq check is the one that applies.
        same_host_path = by.get("store", {}).get("transport") != "zmq"
        if "classic" in by and "store" in by and same_host_path:
            checks.append(
                _common.Check(
                    f"classic/store {at}",
                    by["classic"].get("overhead_vs_store"),
                    TARGET_CLASSIC_X,
                    ">=",
                    "classic overhead / store overhead",
                )
            )
        if "tq" in by and "store" in by and same_host_path:
            checks.append(
                _common.Check(
                    f"tq/store {at}",
                    by["tq"].get("overhead_vs_store"),
                    TARGET_TQ_X,
                    ">=",
                    "TQ overhead / store overhead",
                )
            )
        if "store" in by and "vs_pyzmq" in by["store"]:
            checks.append(
                _common.Check(
                    f"store/pyzmq {at}",
                    by["store"]["vs_pyzmq"],
                    TARGET_PYZMQ_X,
                    ">=",
                    "raw pyzmq seconds / store overhead",
                )
            )
    for path in ("store", "classic"):
        by_workers: dict[int, list[dict[str, Any]]] = {}
        for r in records:
            if r["path"] == path and r["driver_bytes"]:
                by_workers.setdefault(r["workers"], []).append(r)
        for workers, rs in by_workers.items():
            if len({r["payload_bytes"] for r in rs}) < 2:
                continue
            lo = min(rs, key=lambda r: r["payload_bytes"])
            hi = max(rs, key=lambda r: r["payload_bytes"])
            growth = hi["driver_bytes"] / lo["driver_bytes"]
            span = f"{lo['payload_bytes'] / MiB:.0f}->{hi['payload_bytes'] / MiB:.0f}MiB"
            if path == "store":
                checks.append(
                    _common.Check(
                        f"store driver bytes W={workers} {span}",
                        growth,
                        TARGET_DRIVER_GROWTH,
                        "<=",
                        "driver bytes grow with payload",
                    )
                )
            else:  # informational: classic's should grow with the payload
                checks.append(
                    _common.Check(
                        f"classic driver bytes W={workers} {span}",
                        growth,
                        hi["payload_bytes"] / lo["payload_bytes"] / 2,
                        ">=",
                        "grows with the payload (reference)",
                    )
                )
    return checks  # fmt: skip


def render(result: Report) -> str:
    """The whole text report: the table, the checks and the notes."""
    lines = [format_table(result.records), ""]
    checks = result.checks()
    if checks:
        width = max(len(c.name) for c in checks)
        lines.append(f"{'check':<{width}}  {'value':>7}  target   verdict")
        for c in checks:
            value, target = _common.fmt(c.value), _common.fmt(c.target)
            lines.append(f"{c.name:<{width}}  {value:>7}  {c.op} {target:<5}  {c.verdict}")
    placed: dict[int, dict[str, Any]] = {}
    for r in result.records:
        nodes, ids = r.get("nodes") or {}, r.get("node_ids") or {}
        if ids and len({i for v in ids.values() for i in v}) > len({i for v in nodes.values() for i in v}):
            nodes = {role: [i[:8] for i in v] for role, v in ids.items()}  # nodes share IPs: name them by id
        placed.setdefault(r["workers"], nodes)
    for workers, nodes in placed.items():
        where = "; ".join(f"{role.replace('_', ' ')} on {_hosts(ips)}" for role, ips in nodes.items() if ips)
        lines.append(f"W={workers}: {where}")
    m = result.machine
    if result.setup_s:
        lines.append("start/stop s: " + ", ".join(f"{k} {v:.1f}" for k, v in result.setup_s.items()))
    lines.append(
        f"ran {result.elapsed_s:.0f} s on {m['host']} ({m['cpu_count']} cores, "
        f"load {m['load_avg_1m']} at start); read ratios, not absolute figures, "
        "and rerun on a quiet machine before quoting them"
    )
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)


def _hosts(ips: list[str]) -> str:
    """``["a", "a", "b"]`` -> ``"a x2, b"``: which nodes a role's processes run on."""
    counts: dict[str, int] = {}
    for ip in ips:
        counts[ip] = counts.get(ip, 0) + 1
    return ", ".join(ip if n == 1 else f"{ip} x{n}" for ip, n in counts.items())


def write_json(result: Report, path: str) -> list[pathlib.Path]:
    """The records (a JSON list) at ``path``; config, machine, notes and checks in ``<stem>.run.json``."""
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result.records, indent=1, default=str) + "\n")
    cfg = result.config
    run = {
        "benchmark": "bypass",
        "records": out.name,
        "config": {k: v for k, v in vars(cfg).items() if k != "progress"},
        "method": METHOD,
        "checks": [c.as_dict() for c in result.checks()],
        "notes": result.notes,
        "elapsed_s": round(result.elapsed_s, 1),
        "setup_s": result.setup_s,
        "machine": result.machine,
    }
    side = _common.write_json(out.with_name(f"{out.stem}.run.json"), run)
    return [out, side]


def plot_unavailable() -> str | None:
    """Why no chart can be drawn here (matplotlib missing), or None."""
    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed (pip install -e '.[bench]')"
    return None


_LOOKS = {  # path: (colour, marker); markers tell apart lines that overlap (store and tq bytes)
    "floor": ("0.5", "s"),
    "classic": ("tab:red", "o"),
    "store": ("tab:blue", "D"),
    "tq": ("tab:orange", "^"),
    "pyzmq": ("tab:green", "v"),
}


def headline(records: list[dict[str, Any]]) -> str:
    """What to read from the chart, from the records: at the largest payload (first group size), how
    many times fewer bytes the driver carried on the store path than on the classic one, and each
    path's step time over the compute floor; with several payloads, how the driver bytes grow.

    Example:
        >>> rec = lambda path, p, b, o: {"path": path, "payload_bytes": p, "workers": 2,
        ...                              "driver_bytes": b, "overhead_s": o}
        >>> print(headline([rec("classic", 64 * MiB, 128 * MiB, 0.5), rec("store", 64 * MiB, 8192, 0.1)]))
        64 MiB per step, 2 workers: the driver carries 16384x fewer bytes on the store path (8.0 KiB) than
        on the classic one (128.0 MiB); over the compute floor a step takes 0.10 s (store), 0.50 s (classic)
    """
    from dataplane._units import format_bytes

    workers = min(r["workers"] for r in records)
    mine = [r for r in records if r["workers"] == workers]
    top = max(r["payload_bytes"] for r in mine)
    at = {r["path"]: r for r in mine if r["payload_bytes"] == top}
    head = f"{format_bytes(top).replace('.0 ', ' ')} per step, {workers} workers"
    parts = []
    store, classic = at.get("store"), at.get("classic")
    if store and classic and store["driver_bytes"]:
        ratio = classic["driver_bytes"] / store["driver_bytes"]
        parts.append(
            f"the driver carries {ratio:.0f}x fewer bytes on the store path "
            f"({format_bytes(store['driver_bytes'])}) than on the classic one "
            f"({format_bytes(classic['driver_bytes'])})"
        )
    over = [f"{at[p]['overhead_s']:.2f} s ({p})" for p in ("store", "classic", "tq") if p in at]
    if over:
        parts.append("over the compute floor a step takes " + ", ".join(over))
    payloads = sorted({r["payload_bytes"] for r in mine})
    growth = {
        p: [r["driver_bytes"] for r in sorted(mine, key=lambda r: r["payload_bytes"]) if r["path"] == p]
        for p in ("store", "classic")
    }
    if len(payloads) > 1 and all(len(v) > 1 and v[0] for v in growth.values()):
        parts.append(
            f"from {format_bytes(payloads[0])} to {format_bytes(top)} the classic driver's bytes grow "
            f"{growth['classic'][-1] / growth['classic'][0]:.0f}x, the store's "
            f"{growth['store'][-1] / growth['store'][0]:.1f}x"
        )
    return f"{head}: " + "; ".join(parts) if parts else head


def plot(records: list[dict[str, Any]], path: str) -> pathlib.Path | None:
    """The chart of a run, titled with what to read from it (``headline``): step time and driver bytes
    against payload, one line per path (and group size), log scales; a run of one payload per group
    (``--quick``) gets bars per path instead, one point being no line.

    Returns the PNG's path, or None (with ``plot_unavailable()`` saying why) without matplotlib.
    """
    if plot_unavailable() is not None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4.8))
    one_point = len({r["payload_bytes"] for r in records}) == 1
    (_bars if one_point else _lines)(records, ax_t, ax_b)
    import textwrap

    fig.suptitle(textwrap.fill(headline(records), 150), fontsize=9)
    fig.tight_layout()
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _lines(records: list[dict[str, Any]], ax_t: Any, ax_b: Any) -> None:
    """Step time and driver bytes against payload, a line per path and group size."""
    groups = sorted({r["workers"] for r in records})
    styles = ["-", "--", ":", "-."]
    for name, (color, marker) in _LOOKS.items():
        for i, workers in enumerate(groups):
            rs = sorted((r for r in records if r["path"] == name and r["workers"] == workers),
                        key=lambda r: r["payload_bytes"])  # fmt: skip
            if not rs:
                continue
            x = [r["payload_bytes"] / MiB for r in rs]
            label = name if len(groups) == 1 else f"{name} W={workers}"
            style = {"color": color, "linestyle": styles[i % len(styles)], "marker": marker}
            ax_t.plot(x, [r["step_s"] for r in rs], label=label, **style)
            if rs[0]["driver_bytes"]:
                ax_b.plot(x, [r["driver_bytes"] for r in rs], label=label, **style)
    ticks = sorted({r["payload_bytes"] / MiB for r in records})
    for ax, title, unit in (
        (ax_t, "step time (median)", "seconds"),
        (ax_b, "bytes through the driver (the store's: metadata, flat)", "bytes"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ticks, [f"{t:.0f}" for t in ticks])
        ax.set_xlabel("payload per step (MiB)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)


def _bars(records: list[dict[str, Any]], ax_t: Any, ax_b: Any) -> None:
    """One payload: a bar per path (and group size) for step time and for driver bytes, labelled."""
    from dataplane._units import format_bytes

    rs = sorted(
        records, key=lambda r: (r["workers"], list(_LOOKS).index(r["path"]) if r["path"] in _LOOKS else 9)
    )
    groups = len({r["workers"] for r in rs})
    names = [r["path"] if groups == 1 else f"{r['path']}\nW={r['workers']}" for r in rs]
    colors = [_LOOKS.get(r["path"], ("0.3", ""))[0] for r in rs]
    bars = ax_t.bar(names, [r["step_s"] for r in rs], color=colors)
    ax_t.bar_label(bars, [f"{r['step_s']:.2f} s" for r in rs], fontsize=8)
    ax_t.set_ylabel("seconds")
    ax_t.set_title("step time (median); floor: the compute alone")
    carried = [r for r in rs if r["driver_bytes"]]
    bars = ax_b.bar(
        [n for n, r in zip(names, rs, strict=True) if r["driver_bytes"]],
        [r["driver_bytes"] for r in carried],
        color=[c for c, r in zip(colors, rs, strict=True) if r["driver_bytes"]],
    )
    ax_b.bar_label(bars, [format_bytes(r["driver_bytes"]) for r in carried], fontsize=8)
    ax_b.set_yscale("log")
    ax_b.set_ylabel("bytes (log scale)")
    ax_b.set_title("bytes through the driver per step")
    for ax in (ax_t, ax_b):
        ax.grid(True, axis="y", which="both", alpha=0.3)
