"""``rlplane store status --watch``: the running store on one screen, refreshed in place like ``top``.

Each refresh asks every shard and the index for their state in one batch of requests (``snapshot``:
one round trip, then one ``tasks`` request per partition shown, in parallel), so watching costs the
store a few requests a second, never a scan of its rows. The screen (``render``, fitted to the
terminal, readable at 80 columns):

* **shards**: node, bytes used, memory held (freed segments kept warm included), capacity, open
  connections (this command's not counted), and whether it answered;
* **partitions**, the most recently active first (by the last put, take or ack the index saw; those
  active within the last refresh interval in natural order, ``step9`` before ``step10``): rows, rows
  put per second, bytes on all shards, finished or not, fields; the rest summed in one line (how
  many, their rows, how many finished, how many drained by every consumer task);
* **consumer tasks** of those partitions, the most recently active first: rows taken, ready and not
  taken (the lag), leased and not acknowledged, and rows taken per second.

Rates are counters' differences over the monotonic time between refreshes, over the last
``RATE_WINDOW_S`` seconds (at least one refresh): a consumer that takes a batch now and then shows
its average, not a burst one refresh and ``0.0`` the next. The first refresh has none (``-``).

``--json`` prints one JSON object per refresh instead (``as_json``: every shard, the
``JSON_PARTITIONS`` most recently active partitions with their tasks, how many partitions there are
and the rows, finished and drained ones of all), for scripts. Ctrl-C ends it (exit 0), as does
``--count N`` after N refreshes.

    >>> shard = {"shard": 0, "node": "10.0.0.5 (ab12cd34)", "alive": True, "bytes_used": 3 << 20,
    ...          "bytes_resident": 4 << 20, "capacity_bytes": None, "clients": 2, "rows": 8}
    >>> part = {"partition": "step0", "rows": 8, "bytes": 3 << 20, "finished": False, "fields": ["x"],
    ...         "put_rate": 2.0, "tasks": [{"task": "reward", "taken": 6, "ready": 2, "leased": 0,
    ...                                     "rate": 3.0}]}
    >>> snap = Snapshot(0.0, [shard], [part], 1, rows={"step0": 8})
    >>> lines = render(snap, "dataplane", "10.0.0.5:6379", 1.0, 80, 24)
    >>> for line in lines[1:]:
    ...     print(line)
    1/1 shards up, 3.0 MiB used of unlimited, 8 rows in 1 partitions
    <BLANKLINE>
    SHARD  NODE                    USED       RESIDENT   CAPACITY   CLIENTS  ALIVE
    0      10.0.0.5 (ab12cd34)     3.0 MiB    4.0 MiB    unlimited        2  yes
    <BLANKLINE>
    PARTITION                     ROWS     PUT/S      BYTES  FIN  FIELDS
    step0                            8       2.0    3.0 MiB  no   x
    <BLANKLINE>
    PARTITION / TASK                     TAKEN       READY     LEASED     TAKE/S
    step0 / reward                           6           2          0        3.0
"""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import msgspec

from dataplane._units import format_bytes
from dataplane.client.ops import Op, _reply
from dataplane.errors import DataplaneError
from dataplane.wire import protocol as _protocol
from dataplane.wire.requests import INDEX, Call

JSON_PARTITIONS = 100  # the most recently active partitions a --json refresh describes (with their tasks)
MIN_WIDTH = 40
RATE_WINDOW_S = 3.0  # rates are over the refreshes of about this many seconds

# Escape sequences of a refresh in place: the alternate screen (what was on the terminal comes back
# afterwards), the cursor hidden, each frame drawn from the top left, each line and the rest of the
# screen cleared after what is written.
_ENTER, _LEAVE = "\x1b[?1049h\x1b[?25l", "\x1b[?25h\x1b[?1049l"
_HOME, _EOL, _EOS = "\x1b[H", "\x1b[K", "\x1b[J"


@dataclass
class Snapshot:
    """The store at one moment: a dict per shard, per partition shown (the most recently active
    first, each with its ``tasks``), how many partitions there are in all, and of every partition its
    rows and whether it is finished or drained. ``time`` is the wall clock (shown), ``clock`` the
    monotonic one (rates are over it)."""

    time: float
    shards: list[dict[str, Any]]
    partitions: list[dict[str, Any]]
    partitions_total: int
    rows: dict[str, int] = field(default_factory=dict)
    finished: frozenset[str] = frozenset()
    drained: frozenset[str] = frozenset()
    clock: float = 0.0


_NUMBERS = re.compile(r"([0-9]+)")


def natural(name: str) -> tuple[tuple[str | int, ...], str]:
    """The sort key that puts ``step9`` before ``step10``: the name's runs of digits compared as numbers.

    Example:
        >>> sorted(["step10", "step9", "step1", "a"], key=natural)
        ['a', 'step1', 'step9', 'step10']
    """
    # (split with a group alternates text and digits, text first: equal positions hold equal types)
    parts = _NUMBERS.split(name)
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts)), name


def recency(idle_s: float | None, tie_s: float) -> float:
    """The sort key of how long ago something last happened: what was active within the last ``tie_s``
    seconds (the refresh interval) ties, so two busy partitions do not swap places every refresh;
    the rest go by their idle time."""
    if idle_s is None:
        return math.inf
    return 0.0 if idle_s < tie_s else idle_s


def snapshot(nodes: list[str], limit: int, timeout_s: float, tie_s: float = 0.0) -> Op[Snapshot]:
    """Ask every shard for its stats and the index for its partitions, then the index for the tasks of
    the ``limit`` most recently active partitions (``recency``, ``tie_s`` the refresh interval, then
    ``natural`` order); returns a ``Snapshot`` (rates not filled in). A shard that does not answer within
    ``timeout_s`` is shown as not alive; the index must answer."""
    ask = _protocol.Stats()
    calls = [Call(s, "stats", ask, timeout=timeout_s) for s in range(len(nodes))]
    results = yield [*calls, Call(INDEX, "stats", ask, timeout=timeout_s)]
    clock, wall = time.monotonic(), time.time()
    index = _reply(results[-1], _protocol.IndexStatsReply)
    rows, idle, drained = index.partitions, index.idle, frozenset(index.drained)
    shards = [_shard(i, node, res) for i, (node, res) in enumerate(zip(nodes, results[:-1], strict=True))]
    shown = sorted(rows, key=lambda pid: (recency(idle.get(pid), tie_s), natural(pid)))[:limit]
    asks = [Call(INDEX, "tasks", _protocol.Tasks(pid), timeout=timeout_s) for pid in shown]
    answers = (yield asks) if shown else []
    partitions = []
    for pid, res in zip(shown, answers, strict=True):
        if isinstance(res, BaseException):  # cleared since the index listed it
            continue
        body = _reply(res, _protocol.TasksReply)
        tasks = [{"task": name, **msgspec.structs.asdict(counts)} for name, counts in body.tasks.items()]
        partitions.append(
            {
                "partition": pid,
                "rows": body.rows,
                "bytes": sum(s.get("partition_bytes", {}).get(pid, 0) for s in shards if s["alive"]),
                "finished": body.finished,
                "drained": pid in drained,
                "idle_s": idle.get(pid),
                "fields": body.fields,
                "tasks": tasks,
            }
        )
    return Snapshot(wall, shards, partitions, len(rows), rows, frozenset(index.finished), drained, clock)


def _shard(i: int, node: str, res: Any) -> dict[str, Any]:
    if isinstance(res, BaseException):
        error = str(res).split(";")[0] if isinstance(res, DataplaneError) else repr(res)
        return {"shard": i, "node": node, "alive": False, "error": error}
    body = _reply(res, _protocol.ShardStatsReply)
    return {
        "shard": i,
        "node": node,
        "alive": True,
        "error": None,
        "bytes_used": body.bytes_used,
        "bytes_reserved": body.bytes_reserved,
        "bytes_resident": body.bytes_resident,
        "capacity_bytes": body.capacity_bytes,
        "clients": None if body.clients is None else max(0, body.clients - 1),  # less this command's own
        "rows": sum(body.partitions.values()),
        "partition_bytes": body.partition_bytes,
    }


def add_rates(snap: Snapshot, before: Sequence[Snapshot]) -> None:
    """Each shown partition's ``put_rate`` (rows put per second) and each task's ``rate`` (rows taken
    per second), over the monotonic time since the oldest snapshot of ``before`` (oldest first) that
    knows its count; None where none does (the first refresh).

    A snapshot knows every partition's rows (one it does not list had none yet), and its tasks' counts
    for the partitions it showed or did not list (no task had taken anything of those yet). A count
    that went down (rows cleared, rows given back) counts as no progress."""
    known = [
        (b.clock, b.rows, {p["partition"]: p for p in b.partitions}) for b in before if b.clock < snap.clock
    ]
    for part in snap.partitions:
        pid = part["partition"]
        part["put_rate"] = None
        if known:
            then, rows, _ = known[0]
            put = snap.rows.get(pid, part["rows"]) - rows.get(pid, 0)
            part["put_rate"] = max(0, put) / (snap.clock - then)
        # The oldest snapshot that showed the partition's tasks, or had no such partition yet.
        since = next(((t, shown.get(pid)) for t, r, shown in known if pid in shown or pid not in r), None)
        was = {} if since is None or since[1] is None else {t["task"]: t["taken"] for t in since[1]["tasks"]}
        for task in part["tasks"]:
            task["rate"] = None
            if since is not None:
                task["rate"] = max(0, task["taken"] - was.get(task["task"], 0)) / (snap.clock - since[0])


# ---- the screen ----------------------------------------------------------------------------------


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


def _pair(pid: str, task: str, width: int) -> str:
    """``partition / task`` in ``width`` columns, each cut short as needed (both stay visible)."""
    text = f"{pid} / {task}"
    if len(text) <= width:
        return text
    head = _fit(pid, max((width - 3) // 2, width - 3 - len(task)))
    return f"{head} / {_fit(task, width - 3 - len(head))}"


def _row(values: list[str], widths: list[int], right: set[int]) -> str:
    cells = []
    for i, (value, width) in enumerate(zip(values, widths, strict=True)):
        value = _fit(value, width)
        cells.append(value.rjust(width) if i in right else value.ljust(width))
    return "  ".join(cells).rstrip()


def _count(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


_SHARD_COLS = (["SHARD", "NODE", "USED", "RESIDENT", "CAPACITY", "CLIENTS", "ALIVE"], [5, 22, 9, 9, 9, 7, 5])
_PART_COLS = (["PARTITION", "ROWS", "PUT/S", "BYTES", "FIN", "FIELDS"], [22, 10, 8, 9, 3, 17])
_TASK_COLS = (["PARTITION / TASK", "TAKEN", "READY", "LEASED", "TAKE/S"], [30, 10, 10, 9, 9])


def _rate(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:,.1f}" if rate < 1000 else f"{rate:,.0f}"


def _section(items: list[Any], room: int, what: str) -> tuple[list[Any], str | None]:
    """The items that fit in ``room`` lines, and the line saying how many did not (None if all fit)."""
    if len(items) <= room:
        return items, None
    shown = items[: max(0, room - 1)]
    return shown, f"... and {len(items) - len(shown)} more {what}"


def _rest(snap: Snapshot, shown: set[str]) -> str:
    """The line that sums up the partitions not shown: how many, their rows, finished, drained."""
    rest = [pid for pid in snap.rows if pid not in shown]
    n = snap.partitions_total - len(shown)
    rows = sum(snap.rows[pid] for pid in rest)
    finished = sum(pid in snap.finished for pid in rest)
    drained = sum(pid in snap.drained for pid in rest)
    return f"... and {n:,} more partitions: {rows:,} rows, {finished:,} finished, {drained:,} drained"


def render(snap: Snapshot, store: str, address: str, interval: float, width: int, height: int) -> list[str]:
    """The screen for ``snap``: at most ``height`` lines of at most ``width`` columns (a section cut
    short says how much it left out)."""
    width = max(width, MIN_WIDTH)
    shards, parts = snap.shards, snap.partitions
    alive = [s for s in shards if s["alive"]]
    caps = [c for s in alive if (c := s.get("capacity_bytes")) is not None]
    capacity = sum(caps) if alive and len(caps) == len(alive) else None
    tasks = sorted(
        ((p["partition"], t) for p in parts for t in p["tasks"]),
        key=lambda pt: (recency(pt[1].get("idle_s"), interval), natural(pt[0]), natural(pt[1]["task"])),
    )
    clock = time.strftime("%H:%M:%S", time.localtime(snap.time))
    lines = [
        f"store {store!r} at {address}  {clock}  every {interval:g}s (Ctrl-C quits)",
        f"{len(alive)}/{len(shards)} shards up, {format_bytes(sum(s['bytes_used'] for s in alive))} used of "
        f"{format_bytes(capacity)}, {sum(s['rows'] for s in alive):,} rows in {snap.partitions_total:,} "
        "partitions",
    ]
    room = max(3, height - len(lines) - 6)  # less three blank lines and three headers
    shard_rows, more_shards = _section(shards, max(1, min(len(shards), room // 3)), "shards")
    room -= len(shard_rows) + (more_shards is not None)
    part_room = max(1, room // 2) if tasks else room
    part_rows, more_parts = parts, None
    if snap.partitions_total > min(len(parts), part_room):  # (a snapshot holds the most active few only)
        part_rows = parts[: min(len(parts), part_room - 1)]
        more_parts = _rest(snap, {p["partition"] for p in part_rows})
    room -= len(part_rows) + (more_parts is not None)
    task_rows, more_tasks = _section(tasks, max(1, room), "consumer tasks")

    lines += ["", _row(*_SHARD_COLS, set())]
    for s in shard_rows:
        if not s["alive"]:
            lines.append(_row([str(s["shard"]), s["node"], "-", "-", "-", "-", "NO"], _SHARD_COLS[1], set()))
            continue
        values = [
            str(s["shard"]),
            s["node"],
            format_bytes(s["bytes_used"]),
            format_bytes(s["bytes_resident"]),
            format_bytes(s["capacity_bytes"]),
            _count(s["clients"]),
            "yes",
        ]
        lines.append(_row(values, _SHARD_COLS[1], {5}))
    lines += [more_shards] if more_shards else []
    lines += ["", _row(*_PART_COLS, {1, 2, 3})]
    for p in part_rows:
        values = [
            p["partition"],
            f"{p['rows']:,}",
            _rate(p.get("put_rate")),
            format_bytes(p["bytes"]),
            "yes" if p["finished"] else "no",
        ]
        lines.append(_row([*values, ", ".join(p["fields"])], _PART_COLS[1], {1, 2, 3}))
    lines += [more_parts] if more_parts else []
    lines += ["", _row(*_TASK_COLS, {1, 2, 3, 4})]
    for pid, t in task_rows:
        values = [
            _pair(pid, t["task"], _TASK_COLS[1][0]),
            f"{t['taken']:,}",
            f"{t['ready']:,}",
            f"{t['leased']:,}",
            _rate(t.get("rate")),
        ]
        lines.append(_row(values, _TASK_COLS[1], {1, 2, 3, 4}))
    lines += [more_tasks] if more_tasks else []
    if not tasks:
        lines.append("(no consumer task has taken rows of these partitions yet)")
    return [_fit(line, width) for line in lines[:height]]


def as_json(snap: Snapshot, store: str, address: str) -> str:
    """One refresh for scripts: one line of JSON (bytes as integers; rates null on the first)."""
    shards = [{k: v for k, v in s.items() if k != "partition_bytes"} for s in snap.shards]
    out = {
        "time": snap.time,
        "store": store,
        "address": address,
        "shards": shards,
        "partitions": snap.partitions,
        "partitions_total": snap.partitions_total,
        "totals": {
            "rows": sum(snap.rows.values()),
            "finished": len(snap.finished),
            "drained": len(snap.drained),
        },
    }
    return json.dumps(out)


# ---- the loop -------------------------------------------------------------------------------------


def frames(client: Any, nodes: list[str], interval: float, limit: int) -> Iterator[Snapshot]:
    """Snapshots ``interval`` seconds apart, each with its rates over about ``RATE_WINDOW_S``."""
    before: deque[Snapshot] = deque()
    timeout = max(1.0, interval)
    while True:
        started = time.monotonic()
        snap = client.run(snapshot(nodes, limit, timeout, interval))
        # Keep the newest snapshot at least the window old, and those after it.
        while len(before) > 1 and snap.clock - before[1].clock >= RATE_WINDOW_S:
            before.popleft()
        add_rates(snap, before)
        yield snap
        before.append(snap)
        time.sleep(max(0.0, interval - (time.monotonic() - started)))  # the refresh rate, not a wait on state


def run(
    client: Any,
    nodes: list[str],
    address: str,
    interval: float,
    *,
    as_lines: bool = False,
    count: int | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """Watch the store ``client`` is attached to (``nodes``: each shard's node as a person reads it)
    until Ctrl-C or ``count`` refreshes; the screen on a terminal, frames one after another otherwise,
    JSON lines with ``as_lines``. Returns the exit status."""
    store = client.config.name
    tty = out.isatty() and not as_lines
    if threading.current_thread() is threading.main_thread():  # (only it may set a handler)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # leave the screen as it was
        # Ctrl-C is how a watch ends, also in a process that inherited SIGINT ignored (a shell's
        # background job, a parent that ignores it), where Python installs no handler of its own.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if tty:
        out.write(_ENTER)
    try:
        limit = JSON_PARTITIONS if as_lines else shutil.get_terminal_size((80, 24)).lines
        for n, snap in enumerate(frames(client, nodes, interval, limit), 1):
            if as_lines:
                out.write(as_json(snap, store, address) + "\n")
            else:
                size = shutil.get_terminal_size((80, 24))
                lines = render(snap, store, address, interval, size.columns, size.lines)
                if tty:
                    # (no newline after the last line: a full screen would scroll)
                    out.write(
                        _HOME + "".join(line + _EOL + "\n" for line in lines[:-1]) + lines[-1] + _EOL + _EOS
                    )
                else:
                    out.write("\n".join(lines) + "\n\n")
            out.flush()
            if count is not None and n >= count:
                break
    except KeyboardInterrupt:
        pass
    finally:
        if tty:
            out.write(_LEAVE)
            out.flush()
    return 0


__all__ = [
    "JSON_PARTITIONS",
    "RATE_WINDOW_S",
    "Snapshot",
    "add_rates",
    "as_json",
    "natural",
    "recency",
    "render",
    "run",
    "snapshot",
]
