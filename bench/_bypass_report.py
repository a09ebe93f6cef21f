"""The bypass benchmark's output: progress bar, table, checks, JSON records and the PNG chart.

Runs in the driver, for ``bench.bypass``. The table shows, per point, every path's median and best
step, its overhead over the floor, the driver's bytes and peak RSS growth and the store's bytes,
then the ratios that matter (classic overhead / store overhead, TQ overhead / store overhead, the
store against raw pyzmq). The checks compare those with the targets of issue 12 wherever the run
has the figures; they are reported, never asserted (figures on a busy machine say little).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
from dataclasses import dataclass, field
from typing import Any

from bench import _common

MiB = 2**20
# Targets of issue 12 (on a quiet 2-core machine at 256 MiB and 4 workers); see bench/README.md.
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
    config: Any
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

    def __init__(self, cfg: Any, paths: list[str]) -> None:
        self.total = len(cfg.workers) * len(cfg.payloads) * (cfg.warmup + cfg.steps) * len(paths)
        self.bar: Any = None
        if cfg.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc="bypass", unit="step", file=sys.stderr, leave=False)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.close()

    def at(self, point: Any, path: str) -> None:
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
    """The targets of issue 12, wherever the records have the figures (every point, every group size)."""
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


def plot(records: list[dict[str, Any]], path: str) -> pathlib.Path | None:
    """Step time and driver bytes against payload, one line per path (and group size), log scales.

    Returns the PNG's path, or None (with ``plot_unavailable()`` saying why) without matplotlib.
    """
    if plot_unavailable() is not None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4.2))
    groups = sorted({r["workers"] for r in records})
    styles = ["-", "--", ":", "-."]
    looks = {  # path: (colour, marker); markers tell apart lines that overlap (store and tq bytes)
        "floor": ("0.5", "s"),
        "classic": ("tab:red", "o"),
        "store": ("tab:blue", "D"),
        "tq": ("tab:orange", "^"),
        "pyzmq": ("tab:green", "v"),
    }
    for name, (color, marker) in looks.items():
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
        (ax_b, "bytes through the driver", "bytes"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ticks, [f"{t:.0f}" for t in ticks])
        ax.set_xlabel("payload per step (MiB)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
