"""``rlplane store status --watch``: read from a pseudo-terminal while the store has traffic, and the
screen's layout on its own (80 columns, cut-short sections, a shard that does not answer)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import threading

import pytest
import ray
import torch

import dataplane as dp
from dataplane.watch import Snapshot, add_rates, render
from tests.dataplane.conftest import start_store, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
COLUMNS, LINES = 80, 24


class Terminal:
    """A child process on a pseudo-terminal of 80 x 24, and what its screen shows now."""

    def __init__(self, argv: list[str], env: dict[str, str], sigint_ignored: bool = False) -> None:
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", LINES, COLUMNS, 0, 0))
        # sigint_ignored: started the way a shell starts a background job (`cmd &`): SIGINT ignored
        ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
        self.proc = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=ROOT, preexec_fn=ignore
        )
        os.close(slave)
        self.output = b""
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            ready, _, _ = select.select([self.master], [], [], 0.2)
            if not ready:
                if self.proc.poll() is not None:
                    return
                continue
            try:
                data = os.read(self.master, 65536)
            except OSError:  # the child closed its side
                return
            if not data:
                return
            with self._lock:
                self.output += data

    def text(self) -> str:
        with self._lock:
            return self.output.decode(errors="replace")

    def screen(self) -> list[str]:
        """The last whole frame: drawn from the top left (ESC [H) up to clearing the rest (ESC [J)."""
        text = self.text()
        end = text.rfind("\x1b[J")
        start = text.rfind("\x1b[H", 0, end)
        if start < 0 or end < 0:
            return []
        return [_ESCAPE.sub("", line).rstrip("\r") for line in text[start:end].split("\n")]

    def close(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        try:
            try:
                return self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # show where it is stuck: faulthandler prints every thread
                self.proc.send_signal(signal.SIGABRT)
                self.proc.wait(timeout=30)
                raise AssertionError(
                    f"no exit 30 s after SIGINT; its stacks:\n{self.text()[-6000:]}"
                ) from None
        finally:
            self._reader.join(5)
            os.close(self.master)


def _line(screen: list[str], prefix: str) -> list[str] | None:
    return next((line.split() for line in screen if line.startswith(prefix)), None)


@pytest.fixture(scope="module")
def store(ray_cluster):
    """The store ``rlplane store status`` looks for (default name), with traffic from this process."""
    dp.close()
    _, _, handle = start_store(name="dataplane", num_shards=2, capacity_bytes=64 << 20)
    dp.init(name="dataplane")
    try:
        x = torch.zeros(8, 4)
        dp.kv_batch_put([f"a{i}" for i in range(8)], "wp1", {"x": x, "y": x})
        dp.kv_batch_put([f"b{i}" for i in range(3)], "wp2", {"x": x[:3]})
        assert dp.next_batch("wp1", "reward", 4, ["x"], timeout_s=30).size == 4
        yield ray_cluster.address
    finally:
        dp.close()
        handle.stop()


def _cli(address: str, *args: str) -> tuple[list[str], dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env.update(PYTHONPATH=ROOT, TERM="xterm")
    # -X faulthandler: a process that does not exit is made to print its threads' stacks (SIGABRT)
    return [
        sys.executable,
        "-X",
        "faulthandler",
        "-m",
        "rlplane",
        "store",
        "status",
        "--address",
        address,
        *args,
    ], env


@pytest.mark.slow
def test_watch_shows_shards_partitions_and_tasks_live_on_a_terminal(store) -> None:
    term = Terminal(*_cli(store, "--watch", "--interval", "0.3"))
    try:
        first = wait_for(
            lambda: (s := term.screen()) and _line(s, "wp1 / reward") and s, 90, "the first screen"
        )
        assert first[0].startswith("store 'dataplane' at ") and "every 0.3s" in first[0]
        assert (
            "2/2 shards up" in first[1]
            and "of 64.0 MiB" in first[1]
            and "11 rows in 2 partitions" in first[1]
        )
        shards = [line.split() for line in first if re.match(r"^[01]\s", line)]
        assert [s[0] for s in shards] == ["0", "1"] and all(s[-1] == "yes" for s in shards), first
        wp1 = _line(first, "wp1")
        assert wp1[:2] == ["wp1", "8"] and wp1[3] == "256" and wp1[-2:] == ["x,", "y"]  # (2: PUT/S)
        assert _line(first, "wp2")[:2] == ["wp2", "3"]
        assert _line(first, "wp1 / reward")[3:6] == ["4", "4", "0"]  # taken, ready, leased
        # traffic while it watches: a take, a leased take by another task, a finish
        assert dp.next_batch("wp1", "reward", 2, ["x"], timeout_s=30).size == 2
        assert dp.next_batch("wp2", "train", 3, ["x"], timeout_s=30, lease_s=600).size == 3
        dp.finish_partition("wp2")
        moved = wait_for(
            lambda: (
                (s := term.screen()) and (r := _line(s, "wp1 / reward")) and r[3] == "6" and r[6] != "-" and s
            ),
            60,
            "the take to show, with its rate",
        )
        assert float(_line(moved, "wp1 / reward")[6]) > 0, moved  # rows per second over that refresh
        now = wait_for(lambda: (s := term.screen()) and _line(s, "wp2 / train") and s, 60, "the second task")
        assert _line(now, "wp2 / train")[3:6] == ["3", "0", "3"] and _line(now, "wp2")[5] == "yes"
        assert all(len(line) <= COLUMNS for line in now), [line for line in now if len(line) > COLUMNS]
        assert len(now) <= LINES
    finally:
        status = term.close()
    assert status == 0, term.text()[-2000:]
    assert term.text().endswith("\x1b[?25h\x1b[?1049l"), "the terminal was not given back as it was"


def test_ctrl_c_ends_the_watch_even_where_sigint_was_ignored(store) -> None:
    """A process inherits an ignored SIGINT (a shell's background job, a parent that ignores it): the
    watch, which only ends by Ctrl-C, answers it all the same."""
    term = Terminal(*_cli(store, "--watch", "--interval", "0.3"), sigint_ignored=True)
    try:
        wait_for(lambda: _line(term.screen(), "wp1"), 90, "the first screen")
    finally:
        status = term.close()
    assert status == 0, term.text()[-2000:]


@pytest.mark.slow
def test_watch_json_prints_one_object_per_refresh(store) -> None:
    argv, env = _cli(store, "--watch", "--json", "--interval", "0.2", "--count", "2")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first, second = (json.loads(line) for line in proc.stdout.strip().splitlines())
    assert first["store"] == "dataplane" and first["partitions_total"] == 2
    assert [s["alive"] for s in first["shards"]] == [True, True]
    assert sum(s["bytes_used"] for s in first["shards"]) == sum(p["bytes"] for p in first["partitions"])
    wp1 = next(p for p in second["partitions"] if p["partition"] == "wp1")
    assert wp1["rows"] == 8 and wp1["fields"] == ["x", "y"] and wp1["bytes"] == 8 * 4 * 4 * 2
    reward = next(t for t in wp1["tasks"] if t["task"] == "reward")
    assert reward["taken"] + reward["ready"] == 8 and reward["rate"] == 0.0  # no take between the two
    assert all(t["rate"] is None for p in first["partitions"] for t in p["tasks"])  # nothing to compare yet


# ---- a run with a partition per step ----------------------------------------------------------------

OLD_STEPS = 20  # step0 .. step19: written, finished and consumed before the watch starts
STEP_ROWS, PUT_ROWS = 16, 4


@ray.remote(num_cpus=0.1, max_concurrency=2)
class StepWriter:
    """A rollout loop: a partition per step, ``STEP_ROWS`` rows put ``PUT_ROWS`` at a time, then finished."""

    def __init__(self) -> None:
        dp.init(name="dataplane")
        self.stopping = threading.Event()

    def run(self, first: int) -> int:
        """Write steps from ``first`` on until told to stop; returns the last step (finished)."""
        step = first
        while True:
            for i in range(0, STEP_ROWS, PUT_ROWS):
                dp.kv_batch_put(
                    [f"r{j}" for j in range(i, i + PUT_ROWS)], f"step{step}", {"x": torch.zeros(4, 2)}
                )
                self.stopping.wait(0.1)  # the rollout's pace (40 rows/s), not a wait on the store
            dp.finish_partition(f"step{step}")
            if self.stopping.is_set():
                return step
            step += 1

    def stop(self) -> None:
        self.stopping.set()


@ray.remote(num_cpus=0.1, max_concurrency=2)
class StepTrainer:
    """The consumer of a fully-async loop: takes each step's rows as they come, step after step."""

    def __init__(self) -> None:
        dp.init(name="dataplane")
        self.last: int | None = None

    def run(self, first: int) -> int:
        """Drain steps from ``first`` on, until the step ``stop`` names is drained; returns it."""
        step = first
        while self.last is None or step <= self.last:
            try:
                if dp.next_batch(f"step{step}", "train", 4, ["x"], timeout_s=0.5).size == 0:
                    step += 1  # finished and drained
            except (dp.PartitionNotFoundError, dp.BatchTimeoutError):
                pass  # not written yet: ask again (or learn that the writer stopped before it)
        return step - 1

    def stop(self, last: int) -> None:
        self.last = last


def _sections(screen: list[str]) -> tuple[list[list[str]], str | None, list[list[str]]]:
    """A frame's partition rows, the line summing up the partitions not shown, and its task rows."""

    def rows(header: str) -> list[str]:
        at = next((i for i, line in enumerate(screen) if line.startswith(header)), None)
        if at is None:
            return []
        out = []
        for line in screen[at + 1 :]:
            if not line.strip():
                break
            out.append(line)
        return out

    parts = rows("PARTITION  ")
    rest = next((line for line in parts if line.startswith("... and ")), None)
    tasks = rows("PARTITION / TASK")
    split = [line.split() for line in parts if not line.startswith("... ")]
    return split, rest, [line.split() for line in tasks if not line.startswith("... ")]


def _step(name: str) -> int | None:
    return int(name[4:]) if re.fullmatch(r"step[0-9]+", name) else None


def _split(steps: list[int | None]) -> tuple[list[int], list[int]]:
    """Where the run's new steps are in a list of rows, and where the old ones are."""
    new = [i for i, k in enumerate(steps) if k is not None and k >= OLD_STEPS]
    return new, [i for i, k in enumerate(steps) if k is not None and k < OLD_STEPS]


def _rate(text: str) -> float:
    return 0.0 if text == "-" else float(text.replace(",", ""))


@pytest.mark.slow
def test_watch_follows_a_run_with_a_partition_per_step(store) -> None:
    """A writer and a trainer (Ray actors) run a fully-async loop over ``step20``, ``step21``, ... while
    ``step0 .. step19`` sit finished and consumed. The screen shows the steps being written and taken
    first, with rates that move, and sums up the rest in one line."""
    others = [pid for pid in dp.stats()["partitions"] if _step(pid) is None]  # the module's own
    for step in range(OLD_STEPS):
        dp.kv_batch_put([f"r{j}" for j in range(STEP_ROWS)], f"step{step}", {"x": torch.zeros(STEP_ROWS, 2)})
        dp.finish_partition(f"step{step}")
        assert dp.next_batch(f"step{step}", "train", STEP_ROWS, ["x"], timeout_s=30).size == STEP_ROWS
    writer, trainer = StepWriter.remote(), StepTrainer.remote()
    wrote, took = writer.run.remote(OLD_STEPS), trainer.run.remote(OLD_STEPS)
    term = Terminal(*_cli(store, "--watch", "--interval", "0.2"))
    seen: list[list[str]] = []

    def following() -> list[str] | None:
        """A frame showing the newest step first among the steps being written and taken, before every
        idle old step, with rows put and taken per second above zero."""
        screen = term.screen()
        total = re.search(r"rows in ([0-9,]+) partitions", screen[1]) if len(screen) > 1 else None
        parts, rest, tasks = _sections(screen)
        if total is None or not parts or not tasks or rest is None:
            return None
        seen[:] = screen
        newest = int(total.group(1).replace(",", "")) - len(others) - 1  # steps are step0 .. stepN
        names = [p[0] for p in parts]
        steps, task_steps = [_step(n) for n in names], [_step(t[0]) for t in tasks]
        new, old = _split(steps)
        new_tasks, old_tasks = _split(task_steps)
        ok = (
            newest >= OLD_STEPS
            and f"step{newest}" in names
            and new[:1] == [0]
            and (not old or max(new) < min(old))
            and _rate(parts[names.index(f"step{newest}")][2]) > 0  # PUT/S
            and new_tasks[:1] == [0]
            and (not old_tasks or max(new_tasks) < min(old_tasks))
            and _rate(tasks[0][6]) > 0  # TAKE/S
        )
        return screen if ok else None

    try:
        try:
            frame = wait_for(following, 90, "a frame with the newest step first and its rates")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the last frame:\n" + "\n".join(seen)) from None
        print("\n".join(frame))  # (shown with -s: what a partition-per-step run looks like)
        # Stop the run at a step's end; then every step is finished and drained, and the line summing up
        # the partitions not shown counts them exactly.
        ray.get(writer.stop.remote(), timeout=60)
        last = ray.get(wrote, timeout=60)
        ray.get(trainer.stop.remote(last), timeout=60)
        assert ray.get(took, timeout=60) == last
        rows = dp.stats()["partitions"]
        finished = {pid for pid in rows if dp.consumption(pid, "train")["finished"]}

        def summed_up() -> str | None:
            screen = term.screen()
            parts, rest, _ = _sections(screen)
            if rest is None:
                return None
            seen[:] = screen
            hidden = [pid for pid in rows if pid not in {p[0] for p in parts}]
            steps = [pid for pid in hidden if _step(pid) is not None]
            # (the module's own partitions are never drained: wp1 is never finished, wp2's rows stay
            # leased by the first test)
            want = (
                f"... and {len(hidden)} more partitions: {sum(rows[p] for p in hidden):,} rows, "
                f"{len(finished.intersection(hidden))} finished, {len(steps)} drained"
            )
            return rest if rest == want and len(hidden) + len(parts) == len(rows) else None

        try:
            wait_for(summed_up, 60, "the line summing up the partitions not shown")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the last frame:\n" + "\n".join(seen)) from None
    finally:
        status = term.close()
        ray.get(writer.stop.remote(), timeout=60)
        ray.get(trainer.stop.remote(-1), timeout=60)
        for actor in (writer, trainer):
            ray.kill(actor)
        for pid in [p for p in dp.stats()["partitions"] if _step(p) is not None]:
            dp.clear_partition(pid)
    assert status == 0, term.text()[-2000:]


def test_watch_refuses_an_interval_out_of_range(capsys) -> None:
    import argparse

    from dataplane.admin import _status
    from dataplane.config import StoreConfig

    args = argparse.Namespace(watch=True, interval=0.01, json=False, count=None)
    assert _status(args, StoreConfig(), "10.0.0.5:6379") == 2
    assert "--interval 0.01 is not a number of seconds" in capsys.readouterr().out


# ---- the screen alone ------------------------------------------------------------------------------


def _shard(i: int, alive: bool = True) -> dict:
    if not alive:
        return {"shard": i, "node": "10.0.0.7 (deadbeef)", "alive": False, "error": "dead"}
    return {
        "shard": i,
        "node": f"10.0.0.{i} (ab12cd34)",
        "alive": True,
        "bytes_used": 3 << 20,
        "bytes_resident": 5 << 20,
        "capacity_bytes": 1 << 30,
        "clients": 12,
        "rows": 1_000_000,
    }


def _partition(name: str, tasks: int) -> dict:
    return {
        "partition": name,
        "rows": 1_234_567,
        "bytes": 3 << 30,
        "finished": False,
        "fields": ["prompts", "responses", "old_log_probs", "ref_log_probs", "advantages"],
        "tasks": [
            {"task": f"task-{j}-" + "x" * 30, "taken": 10**6, "ready": 10**5, "leased": 7}
            for j in range(tasks)
        ],
    }


def test_a_big_store_fits_80_by_24_and_says_what_it_left_out() -> None:
    parts = [_partition(f"step-{i:05d}-" + "p" * 30, 3) for i in range(24)]
    rows = {f"other-{i}": 10 for i in range(10_000 - len(parts))} | {p["partition"]: p["rows"] for p in parts}
    shards = [_shard(i) for i in range(6)] + [_shard(6, alive=False)]
    before = Snapshot(
        0.0, shards, parts, 10_000, rows, frozenset(list(rows)[:30]), frozenset(list(rows)[:20])
    )
    now = Snapshot(
        2.0, shards, json.loads(json.dumps(parts)), 10_000, dict(rows), before.finished, before.drained, 2.0
    )
    now.partitions[0]["tasks"][0]["taken"] += 500
    now.rows[parts[0]["partition"]] += 300
    add_rates(now, [before])
    lines = render(now, "dataplane", "10.0.0.5:6379", 1.0, COLUMNS, LINES)
    assert len(lines) <= LINES and all(len(line) <= COLUMNS for line in lines), lines
    assert "6/7 shards up" in lines[1] and "6,000,000 rows in 10,000 partitions" in lines[1]
    rest = next(line for line in lines if line.startswith("... and ") and "partitions" in line)
    shown = [line.split()[0] for line in lines if line.startswith("step-") and "/" not in line]
    hidden_rows = 10 * (10_000 - 24) + 1_234_567 * (24 - len(shown))  # (+ none of the 300 put: shown)
    assert (
        rest
        == f"... and {10_000 - len(shown):,} more partitions: {hidden_rows:,} rows, 30 finished, 20 drained"
    )
    assert any(line.endswith("more consumer tasks") for line in lines), lines
    assert any(line.endswith("…") for line in lines)  # long names are cut, visibly
    rate = next(line for line in lines if line.startswith("step-00000-") and "/" in line).split()[-1]
    assert rate == "250.0"  # 500 rows in 2 s
    put = next(line for line in lines if line.startswith("step-00000-") and "/" not in line).split()[2]
    assert put == "150.0"  # 300 rows in 2 s
    assert render(now, "s", "a", 1.0, 200, 200)[0].startswith("store 's' at a")  # a big terminal
    dead = next(line for line in render(before, "s", "a", 1.0, 80, 60) if line.startswith("6 "))
    assert dead.split()[-1] == "NO" and "deadbeef" in dead
