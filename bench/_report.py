"""Turns store-throughput results into the target ratios (with PASS/MISS), a text table and a plot.

The targets (bench/README.md, "Store throughput"); each is a :class:`bench._common.Check`:

- put >= 3x TransferQueue, actor get >= 8x TransferQueue;
- put and actor get >= 1.5x the Ray object-store path;
- actor get >= 0.3x memcpy;
- single-key put and get p50 <= 2x a bare Ray actor call measured in the same phase: ``noop()``
  with no argument, the stricter of the two baselines recorded (``noop(x)`` ships the row's two
  tensors and is about 2x slower; TransferQueue's own "about 6x" matches ``noop()``);
- shard memory while holding the payload <= 1.3x the payload, and <= 10% of it left after clear,
  each judged twice: by the store's accounting (``bytes_resident``) and by what the OS shows for the
  shard processes (RSS plus the memfd files they hold, ``bench._memory``); memory figures are
  fractions of the payload.
"""

from __future__ import annotations

from typing import Any

from bench._common import Check, fmt, ratio


def _gbps(results: dict[str, Any], path: str, op: str) -> float | None:
    entry = results["paths"].get(path, {}).get(op)
    return entry["best_gbps"] if isinstance(entry, dict) and "best_gbps" in entry else None


def _p50(results: dict[str, Any], path: str, op: str) -> float | None:
    entry = results["paths"].get(path, {}).get("latency", {}).get(op)
    return entry["p50_us"] if entry else None


def _memory_fractions(results: dict[str, Any]) -> dict[str, float | None]:
    mem = results["paths"].get("store", {}).get("memory")
    payload = results["config"]["payload_bytes"]
    if not mem:
        return {"held_stats": None, "held_os": None, "after_stats": None, "after_os": None}

    def over(state: str, key: str) -> float | None:
        a, b = mem[state].get(key), mem["empty"].get(key)
        return None if a is None or b is None else (a - b) / payload

    return {
        "held_stats": over("held", "bytes_resident"),
        "held_os": over("held", "os_resident"),
        "after_stats": over("after_clear", "bytes_resident"),
        "after_os": over("after_clear", "os_resident"),
    }


def evaluate(results: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Return ``(checks, info)``: the targets with verdicts, and untargeted ratios."""
    g = lambda path, op: _gbps(results, path, op)  # noqa: E731
    p = lambda path, op: _p50(results, path, op)  # noqa: E731
    mem = _memory_fractions(results)
    # (name, value, target, op, what)
    targets = [
        ("put_vs_tq", ratio(g("store", "put"), g("tq", "put")), 3.0, ">=", "store put / TQ put"),
        ("get_vs_tq", ratio(g("store", "get"), g("tq", "get")), 8.0, ">=", "store get / TQ get (actors)"),
        ("put_vs_ray", ratio(g("store", "put"), g("ray", "put")), 1.5, ">=", "store put / ray.put"),
        ("get_vs_ray", ratio(g("store", "get"), g("ray", "get")), 1.5, ">=", "store get / Ray get by ref"),
        ("get_vs_memcpy", ratio(g("store", "get"), g("memcpy", "copy")), 0.3, ">=", "store get / memcpy"),
        ("latency_put_vs_ray", ratio(p("store", "put"), p("store", "bare_ray_no_arg")), 2.0, "<=",
         "single-key put p50 / Ray noop() p50"),
        ("latency_get_vs_ray", ratio(p("store", "get"), p("store", "bare_ray_no_arg")), 2.0, "<=",
         "single-key get p50 / Ray noop() p50"),
        ("memory_held", mem["held_stats"], 1.3, "<=", "shard bytes_resident - empty, held"),
        ("memory_after_clear", mem["after_stats"], 0.1, "<=", "shard bytes_resident - empty, cleared"),
        ("memory_held_os", mem["held_os"], 1.3, "<=", "shard RSS+memfd - empty, held"),
        ("memory_after_clear_os", mem["after_os"], 0.1, "<=", "shard RSS+memfd - empty, cleared"),
    ]  # fmt: skip
    checks = [Check(*t) for t in targets]
    info = {
        "get_view_vs_memcpy": ratio(g("store", "get_view"), g("memcpy", "copy")),
        "get_view_vs_ray": ratio(g("store", "get_view"), g("ray", "get")),
        "latency_put_vs_ray_noop_x": ratio(p("store", "put"), p("store", "bare_ray")),
        "latency_get_vs_ray_noop_x": ratio(p("store", "get"), p("store", "bare_ray")),
        "tq_latency_put_vs_ray": ratio(p("tq", "put"), p("tq", "bare_ray_no_arg")),
        "tq_latency_get_vs_ray": ratio(p("tq", "get"), p("tq", "bare_ray_no_arg")),
        "tq_put_vs_ray": ratio(g("tq", "put"), g("ray", "put")),
        "tq_get_vs_ray": ratio(g("tq", "get"), g("ray", "get")),
    }
    return {c.name: c.as_dict() for c in checks}, info


_ROWS = (
    ("memcpy", "memcpy (torch copy_)", "copy", "copy"),
    ("ray", "Ray object store", "put", "get"),
    ("tq", "TransferQueue 0.1.11", "put", "get"),
    ("store", "dataplane (copy-out)", "put", "get"),
    ("store", "dataplane (view)", None, "get_view"),
)


def _cell(results: dict[str, Any], path: str, op: str | None) -> str:
    entry = results["paths"].get(path, {}).get(op) if op else None
    if not entry:
        return "-"
    return f"{entry['best_gbps']:.2f} / {entry['median_gbps']:.2f}"


def _lat_cell(lat: dict[str, Any], key: str) -> str:
    entry = lat.get(key)
    return f"{entry['p50_us']:.0f} / {entry['p90_us']:.0f}" if entry else "-"


def _memory_lines(mem: dict[str, Any]) -> list[str]:
    mib = lambda v: fmt(None if v is None else v / 2**20, ".1f")  # noqa: E731
    cols = ("bytes_resident", "os_resident", "rss", "rss_anon", "rss_shmem", "memfd")
    lines = ["", f"{'store shards, MiB':<18}" + "".join(f"{c:>15}" for c in cols)]
    for state in ("cold", "empty", "held", "after_clear"):
        if state in mem:
            lines.append(f"  {state:<16}" + "".join(f"{mib(mem[state].get(c)):>15}" for c in cols))
    lines.append(f"  (memory given back {mem.get('release_waited_s')} s after clear)")
    return lines


def render(results: dict[str, Any]) -> str:
    """The human-readable report: throughput, latency, memory, then the checks."""
    cfg, m = results["config"], results["machine"]
    lines = [
        f"store_throughput: {cfg['rows']} rows x {cfg['cols']} float32 x {cfg['fields']} fields = "
        f"{cfg['payload_bytes'] / 2**20:.1f} MiB; {cfg['statistic']}",
        f"store: transport {cfg.get('store_transport', 'auto')}, encrypt {cfg.get('encrypt', False)}",
        f"machine: {m['host']}, {m['cpu_count']} cores, {m['memory_gib']} GiB, "
        f"load {m.get('load_avg_1m')}, {m['date_utc']}",
        "",
        f"{'path':<24} {'put GB/s best / med':>22} {'get GB/s best / med':>22}",
    ]
    for path, label, put_op, get_op in _ROWS:
        res = results["paths"].get(path)
        if res is None:
            reason = results["skipped"].get(path, "not run")
            lines.append(f"{label:<24} skipped: {reason}")
        elif "error" in res:
            lines.append(f"{label:<24} ERROR: {res['error']}")
        elif get_op in res or put_op in res:
            lines.append(f"{label:<24} {_cell(results, path, put_op):>22} {_cell(results, path, get_op):>22}")
    lines += ["", f"{'p50 / p90 us':<24} {'Ray noop(x)':>18} {'put':>18} {'get':>18} {'Ray noop()':>18}"]
    for path, label in (("tq", "TransferQueue 0.1.11"), ("store", "dataplane")):
        lat = results["paths"].get(path, {}).get("latency")
        if lat:
            cells = [_lat_cell(lat, k) for k in ("bare_ray", "put", "get", "bare_ray_no_arg")]
            lines.append(f"{label:<24} " + " ".join(f"{c:>18}" for c in cells))
    mem = results["paths"].get("store", {}).get("memory")
    if mem:
        lines += _memory_lines(mem)
    lines += ["", f"{'check':<22} {'value':>8} {'target':>9}  verdict  what"]
    for c in results["checks"].values():
        lines.append(
            f"{c['name']:<22} {fmt(c['value']):>8} {c['op'] + ' ' + str(c['target']):>9}  "
            f"{c['verdict']:<7}  {c['what']}"
        )
    info = ", ".join(f"{k}={fmt(v)}" for k, v in results["info"].items() if v is not None)
    if info:
        lines += ["", f"info: {info}"]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: str) -> str:
    """A bar chart of best-of GB/s per path and operation, saved as PNG at ``path``."""
    import pathlib

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    short = {"memcpy": "memcpy", "ray": "Ray", "tq": "TQ 0.1.11", "store": "dataplane"}
    labels = [short[p] + (" view" if get_op == "get_view" else "") for p, _, _, get_op in _ROWS]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.4
    for shift, kind in ((-width / 2, "put"), (width / 2, "get")):
        ops = [put_op if kind == "put" else get_op for _, _, put_op, get_op in _ROWS]
        values = [
            (_gbps(results, p, op) if op else None) or 0.0 for (p, *_), op in zip(_ROWS, ops, strict=True)
        ]
        bars = ax.bar([i + shift for i in range(len(_ROWS))], values, width, label=kind)
        ax.bar_label(bars, labels=[f"{v:.2f}" if v else "" for v in values], fontsize=7)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("GB/s (best of N)")
    ax.legend()
    ax.set_title(
        f"store throughput, {results['config']['payload_bytes'] / 2**20:.0f} MiB payload (memcpy: copy)"
    )
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return str(out)


def markdown(results: dict[str, Any]) -> str:
    """The same report as Markdown tables (what bench/RESULTS.md records)."""
    m = results["machine"]
    out = [
        f"Run {m['date_utc']}, load average {m.get('load_avg_1m')} on {m['cpu_count']} cores; "
        f"{results['config']['statistic']}.",
        "",
        "| path | put GB/s best / median | get GB/s best / median |",
        "|---|---|---|",
    ]
    for path, label, put_op, get_op in _ROWS:
        res = results["paths"].get(path)
        if res and "error" not in res and (get_op in res or put_op in res):
            out.append(f"| {label} | {_cell(results, path, put_op)} | {_cell(results, path, get_op)} |")
        elif res is None or "error" in res:
            why = results["skipped"].get(path, "not run") if res is None else f"error: {res['error']}"
            out.append(f"| {label} | {why} | |")
    out += [
        "",
        "| single-key p50 / p90 (us) | Ray `noop(x)` | put | get | Ray `noop()` |",
        "|---|---|---|---|---|",
    ]
    for path, label in (("tq", "TransferQueue 0.1.11"), ("store", "dataplane")):
        lat = results["paths"].get(path, {}).get("latency")
        if lat:
            cells = [_lat_cell(lat, k) for k in ("bare_ray", "put", "get", "bare_ray_no_arg")]
            out.append(f"| {label} | " + " | ".join(cells) + " |")
    mem = results["paths"].get("store", {}).get("memory")
    if mem:
        out += ["", "| store shards (MiB) | bytes_resident | os_resident | rss |", "|---|---|---|---|"]
        for state in ("empty", "held", "after_clear"):
            s = mem[state]
            vals = [
                fmt(None if s.get(k) is None else s[k] / 2**20, ".1f")
                for k in ("bytes_resident", "os_resident", "rss")
            ]
            out.append(f"| {state} | " + " | ".join(vals) + " |")
    out += ["", "| check | value | target | verdict | what |", "|---|---|---|---|---|"]
    for c in results["checks"].values():
        out.append(
            f"| {c['name']} | {fmt(c['value'])} | {c['op']} {c['target']} | {c['verdict']} | {c['what']} |"
        )
    return "\n".join(out) + "\n"
