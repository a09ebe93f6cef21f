"""The ``rlplane`` command line: help, version, sizes, addresses, the store's and the demo's output.

Most of it is tested on the functions that parse and format, without Ray. The commands themselves
run in subprocesses elsewhere: ``tests/dataplane/test_service.py`` (``store start|status|stop`` on
the session's cluster) and ``tests/workers/test_trainer.py`` (``demo --steps 1``).

Authentication: the session's Ray cluster does not use token authentication, so a refused token
is tested on ``classify_failure`` with the text Ray 2.60 writes. It was captured from a real head
(``RAY_AUTH_MODE=token RAY_AUTH_TOKEN=<a> ray start --head --port 6399``) joined with another token
(``RAY_AUTH_MODE=token RAY_AUTH_TOKEN=<b> rlplane store start --address 127.0.0.1:6399``), which
printed the one ``ClusterAuthError`` line and exited 1 within two seconds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import socket
import subprocess
import sys
from importlib import metadata

import pytest

from dataplane._units import format_bytes, parse_size
from dataplane.admin import describe, format_status, option_differences
from dataplane.errors import ClusterAuthError, ClusterConnectError
from dataplane.service import connect as _connect
from rlplane.cli import build_parser
from workers.demo import format_summary, judge, reward_window

# What Ray 2.60 wrote when a head refused this process's token (see the module docstring).
RAY_REFUSED_LOG = (
    "[2026-12-02 02:44:04,930 W 13126 13126] gcs_client.cc:210: Failed to get cluster ID from GCS server: "
    "Unauthenticated: RPC error: InvalidAuthToken: Authentication token is missing or incorrect"
)
RAY_REFUSED_EXC = "ConnectionError: Failed to connect to Ray cluster at 192.0.2.2:6399"
RAY_NO_TOKEN_EXC = (
    "AuthenticationError: Token authentication is enabled but no authentication token was found"
)
RAY_TIMEOUT_LOG = (
    "gcs_client.cc:210: Failed to get cluster ID from GCS server: TimedOut: Timed out while waiting for GCS "
    "to become available."
)


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_help_is_plain_text_with_defaults(capsys) -> None:
    texts = {
        argv: _help(capsys, *argv)
        for argv in [
            (),
            ("store",),
            ("store", "start"),
            ("store", "status"),
            ("store", "stop"),
            ("demo",),
            ("bench",),
        ]
    }
    for argv, text in texts.items():
        assert "``" not in text, f"rlplane {' '.join(argv)} --help shows docstring markup:\n{text}"
        said = text.split("\n\n")[1]  # between the usage and the options: what the command does
        assert not said.lstrip().startswith(("options:", "positional")), f"rlplane {' '.join(argv)}: {text}"
    start, demo = texts[("store", "start")], texts[("demo",)]
    assert (
        "(default: auto)" in start and "(default: unlimited)" in start and "one per alive Ray node" in start
    )
    assert "(default: local)" in demo and "(default: 40)" in demo
    flat = " ".join(demo.split())
    assert "--seed SEED seed of the model weights" in flat and "(default: 0)" in flat
    # --address: one meaning, said in each command's help
    for argv in [("store", "start"), ("store", "status"), ("store", "stop"), ("demo",)]:
        flat = " ".join(texts[argv].split())
        assert "auto = the running cluster" in flat and "HOST:PORT = the cluster whose head" in flat, argv
    assert "local = a new Ray" in " ".join(demo.split())
    assert "exit status" in " ".join(demo.split()) and "not judged" in " ".join(demo.split())


def test_version_comes_from_the_package_metadata(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"rlplane {metadata.version('rlplane')}"


# What `rlplane --version` and every `--help` may not load: torch and tensordict take seconds to
# import, Ray one; only the command that runs imports what it needs.
HEAVY = ("torch", "tensordict", "ray", "dataplane.api", "workers.demo", "bench.runner")
HELP_ARGVS = [
    ["--version"],
    ["--help"],
    ["store", "--help"],
    ["store", "start", "--help"],
    ["store", "status", "--help"],
    ["store", "stop", "--help"],
    ["demo", "--help"],
    ["bench", "--help"],
]


def test_version_and_help_load_neither_torch_nor_ray() -> None:
    """Every answer, in one fresh interpreter, through ``rlplane.cli.main`` as the console script
    calls it; then none of the heavy modules is loaded."""
    code = (
        "import sys, json\n"
        "from rlplane.cli import main\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as done:\n"
        "        assert done.code == 0, (argv, done.code)\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(HELP_ARGVS)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == [], proc.stdout


def test_demo_refuses_what_it_cannot_run_before_loading_torch_or_ray(tmp_path) -> None:
    """A --resume with no checkpoint, or flags that do not fit, answered through ``rlplane.cli.main`` in
    one fresh interpreter: exit 2 and one line naming the flag (and the directory), with neither torch
    nor Ray loaded, so no Ray, store or worker was started (before, a missing checkpoint was found
    after some 40 s of starting them, and reported by a traceback)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = {
        f"--resume {tmp_path / 'nope'}: no such directory": ["--resume", str(tmp_path / "nope")],
        f"--resume {empty}: no complete trainer checkpoint in it": ["--resume", str(empty)],
        "--resume is for stream mode, not --mode sync": ["--mode", "sync", "--resume", str(empty)],
        "--checkpoint-every needs --checkpoint-dir": ["--checkpoint-every", "2"],
    }
    code = (
        "import contextlib, io, json, sys\n"
        "from rlplane.cli import main\n"
        "said = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    out = io.StringIO()\n"
        "    with contextlib.redirect_stdout(out):\n"
        "        status = main(['demo', '--summary', sys.argv[2], *argv])\n"
        "    said.append([status, out.getvalue()])\n"
        f"heavy = sorted(m for m in {(*HEAVY, 'workers.trainer')!r} if m in sys.modules)\n"
        "print(json.dumps({'said': said, 'heavy': heavy}))\n"
    )
    summary = str(tmp_path / "summary.json")
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(list(cases.values())), summary],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    for expected, (status, printed) in zip(cases, result["said"], strict=True):
        assert status == 2 and printed.startswith(f"rlplane demo: {expected}"), printed
        assert printed.count("\n") == 1, printed  # one line, no traceback
    assert result["heavy"] == [], result
    assert "Traceback" not in proc.stderr and not os.path.exists(summary)


def test_max_staleness_must_be_zero_or_more(capsys) -> None:
    assert build_parser().parse_args(["demo", "--max-staleness", "0"]).max_staleness == 0
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["demo", "--max-staleness", "-1"])
    assert done.value.code == 2
    assert "argument --max-staleness: must be 0 or more, got -1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, expected",
    [
        ("4096", 4096),
        ("1G", 1 << 30),
        ("1gb", 1 << 30),
        ("1GiB", 1 << 30),
        ("512MiB", 512 << 20),
        ("512m", 512 << 20),
        ("2GB", 2 << 30),
        ("1.5G", 3 << 29),
        ("64K", 64 << 10),
        ("100B", 100),
    ],
)
def test_sizes_parse_in_powers_of_1024(text: str, expected: int) -> None:
    assert parse_size(text) == expected
    args = build_parser().parse_args(["store", "start", "--capacity", text])
    assert args.capacity == expected


@pytest.mark.parametrize("bad", ["1X", "G", "-1G", "0", "1.3", "ten", "1iB", ""])
def test_a_bad_size_is_refused_naming_it(bad: str, capsys) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(bad)
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["store", "start", f"--capacity={bad}"])  # "=": "-1G" is a value
    assert done.value.code == 2
    assert f"--capacity: invalid size {bad!r}" in capsys.readouterr().err


def test_sizes_print_in_binary_units() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1536, 3 << 20, 3 << 30, None)] == [
        "0 B",
        "1023 B",
        "1.5 KiB",
        "3.0 MiB",
        "3.00 GiB",
        "unlimited",
    ]


def test_steps_must_be_at_least_one(capsys) -> None:
    assert build_parser().parse_args(["demo", "--steps", "1"]).steps == 1
    for bad in ("0", "-3", "x"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["demo", "--steps", bad])
        assert "--steps" in capsys.readouterr().err


def test_address_forms() -> None:
    assert _connect.parse_address("10.0.0.5:6379") == ("10.0.0.5", 6379)
    assert _connect.parse_address("head.example:1234") == ("head.example", 1234)
    for form in (None, "local", "auto"):
        assert _connect.parse_address(form) is None
    for bad in ("10.0.0.5", "ray://10.0.0.5:10001", ":6379", "host:0", "host:99999", "localx"):
        with pytest.raises(ValueError, match="HOST:PORT") as err:
            _connect.parse_address(bad)
        assert repr(bad) in str(err.value)


def test_a_refused_token_is_named_as_such() -> None:
    assert _connect.classify_failure(f"{RAY_REFUSED_EXC}\n{RAY_REFUSED_LOG}\n{RAY_REFUSED_LOG}") == "refused"
    assert _connect.classify_failure(RAY_NO_TOKEN_EXC) == "no_token"
    assert _connect.classify_failure(f"{RAY_REFUSED_EXC}\n{RAY_TIMEOUT_LOG}") == "unreachable"
    err = _connect.failure_error("10.0.0.5:6379", "refused", "Ray: InvalidAuthToken")
    assert isinstance(err, ClusterAuthError) and isinstance(err, ConnectionError)
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err) and again.address == "10.0.0.5:6379"
    text = str(again)
    assert "\n" not in text and "10.0.0.5:6379" in text and "refused" in text
    assert "RAY_AUTH_TOKEN" in text and "RAY_AUTH_MODE=token" in text
    missing = _connect.failure_error("auto", "unreachable", "Ray: no cluster")
    assert type(missing) is ClusterConnectError and "ray start --head" in str(missing)


def test_ray_log_lines_written_to_fd2_are_captured() -> None:
    with _connect.captured_stderr() as lines:
        os.write(2, f"{RAY_REFUSED_LOG}\n".encode())
    assert lines == [RAY_REFUSED_LOG]


def test_nothing_listening_is_reported_at_once() -> None:
    with socket.socket() as s:  # a port nothing listens on: bound, never listened
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
        with pytest.raises(ClusterConnectError, match="no Ray cluster answers at 127.0.0.1") as err:
            _connect.probe(address, timeout_s=5)
    assert not isinstance(err.value, ClusterAuthError) and err.value.address == address


_REGISTRY = {
    "config": {"name": "dataplane", "capacity_bytes": 1 << 30, "encrypt": False},
    "shards": [
        {"tcp": "tcp://10.0.0.5:4000", "node_id": "ab12cd34ef56"},
        {"tcp": "tcp://10.0.0.6:4000", "node_id": "99aa88bb77cc"},
    ],
}


def test_start_describes_the_store_and_names_options_that_differ() -> None:
    text = describe(_REGISTRY)
    assert text.startswith("store 'dataplane': 2 shards on 2 nodes (10.0.0.5, 10.0.0.6)")
    assert "capacity 1.00 GiB (512.0 MiB per shard)" in text
    same = {"shards": 2, "capacity": 1 << 30, "encrypt": None}
    assert option_differences(_REGISTRY, same) == []
    assert option_differences(_REGISTRY, {"shards": None, "capacity": None, "encrypt": None}) == []
    differ = option_differences(_REGISTRY, {"shards": 3, "capacity": 512 << 20, "encrypt": True})
    assert differ == [
        "--shards 2 (asked 3)",
        "--capacity 1.00 GiB (asked 512.0 MiB)",
        "--encrypt off (asked on)",
    ]


def test_status_is_a_table() -> None:
    shards = [
        {
            "shard": i,
            "host": f"10.0.0.{5 + i}",
            "node_id": f"{i}bcdef0123",
            "bytes_used": used,
            "bytes_resident": used + (1 << 20),
            "capacity_bytes": None,
            "partitions": {"step0": 3 + i},
        }
        for i, used in enumerate((3 << 20, 5 << 30))
    ]
    stats = {
        "name": "dataplane",
        "shards": shards,
        "partitions": {"step0": 7},
        "bytes_used": (3 << 20) + (5 << 30),
    }
    lines = format_status(stats, [2, None], "10.0.0.5:6379").splitlines()
    assert "2 shard(s) on 2 node(s)" in lines[0] and "5.00 GiB used of unlimited" in lines[0]
    assert lines[1].split() == [
        "shard",
        "node",
        "used",
        "in",
        "memory",
        "capacity",
        "partitions",
        "rows",
        "clients",
    ]
    assert lines[2].split() == [
        "0",
        "10.0.0.5",
        "(0bcdef01)",
        "3.0",
        "MiB",
        "4.0",
        "MiB",
        "unlimited",
        "1",
        "3",
        "2",
    ]
    assert lines[3].split()[-1] == "?"  # a shard that did not say how many clients it has
    assert "step0 (7 keys)" in lines[4]
    assert not any("null" in line or "None" in line for line in lines)


def _summary(steps: int, first: float, last: float) -> dict:
    return {
        "mode": "sync",
        "steps": steps,
        "reward_window": reward_window(steps),
        "reward_first": first,
        "reward_last": last,
        "reward_history": [first, last],
        "samples_per_step": 8,
        "steps_per_s": 2.0,
        "seconds": 3.0,
        "setup_seconds": 2.0,
        "startup_seconds": 1.5,
        "driver_bytes": 10,
        "store_bytes": 5000,
    }


def test_demo_says_whether_the_reward_rose() -> None:
    assert [reward_window(n) for n in (1, 2, 9, 10, 40, 41)] == [1, 1, 1, 1, 4, 4]
    status, line = judge(_summary(40, 0.1, 0.7))
    assert status == 0 and "rose" in line and "first 4 steps" in line
    status, line = judge(_summary(40, 0.5, 0.5))
    assert status == 1 and "did not rise" in line and "exit status 1" in line
    status, line = judge(_summary(1, 0.2, 0.2))
    assert status == 0 and "not judged" in line


def test_demo_summary_says_what_it_shows() -> None:
    table = format_summary(_summary(40, 0.1, 0.7))
    rows = {
        line.split("|")[0].strip(): line.split("|")[1].strip() for line in table.splitlines() if "|" in line
    }
    assert rows["mean reward, first 10% of steps"] == "0.100  (steps 1-4)"
    assert rows["mean reward, last 10% of steps"] == "0.700  (steps 37-40)"
    assert rows["reward range (per-step means)"] == "0.100 .. 0.700"
    assert rows["setup, s"] == "3.5  (Ray and store 1.5, workers and model 2.0)"
    assert rows["training, s"] == "3.0" and rows["steps/s (training)"] == "2.00"
    assert rows["bytes via store"] == "5,000  (4.9 KiB)"


def test_a_resumed_demo_summary_says_which_steps_this_run_trained() -> None:
    summary = {
        **_summary(40, 0.1, 0.7),
        "mode": "stream",
        "max_staleness": 1,
        "stream_chunks": 2,
        "steps_this_run": 22,
        "steps_per_s": 22 / 5.5,
        "seconds": 5.5,
        "resumed_from": 18,
        "run": 2,
    }
    table = format_summary(summary)
    rows = {
        line.split("|")[0].strip(): line.split("|")[1].strip() for line in table.splitlines() if "|" in line
    }
    assert rows["steps"] == "40  (8 samples/step; this run trained 22: steps 19-40)"
    assert rows["steps/s (training)"] == "4.00  (22 steps, this run)"
    assert rows["resumed"] == "run 2, from the checkpoint after step 18 (steps 1-18 trained by earlier runs)"
    assert rows["mean reward, last 10% of steps"] == "0.700  (steps 37-40)"  # the whole training's


def test_init_says_what_it_did(ray_session, caplog) -> None:
    from dataplane import api
    from dataplane.meta import StoreInfo

    info = StoreInfo("rlplane", 2, ("n1", "n1"), owned=True, capacity_bytes=1 << 30, extra={"name": "s"})
    with caplog.at_level(logging.INFO, logger="dataplane"):
        api._announce(info)
        api._announce(StoreInfo("rlplane", 1, ("n1",), owned=False, extra={"name": "s"}))
    said = [r.getMessage() for r in caplog.records if r.name == "dataplane.api"]
    assert said[0].startswith("started an embedded store 's' (2 shard(s) on 1 node(s), capacity 1.00 GiB")
    assert said[1].startswith("attached to store 's' (1 shard(s) on 1 node(s), capacity unlimited")
    # A program that configured no logging still sees the line: the package logger gets a handler.
    root, package = logging.getLogger(), logging.getLogger("dataplane")
    saved = root.handlers[:], package.handlers[:], package.level
    try:
        root.handlers[:], package.handlers[:] = [], []
        package.setLevel(logging.NOTSET)
        api._ensure_visible()
        assert package.level == logging.INFO and len(package.handlers) == 1
        assert isinstance(package.handlers[0], logging.StreamHandler)
        api._ensure_visible()  # once only
        assert len(package.handlers) == 1
    finally:
        root.handlers[:], package.handlers[:] = saved[0], saved[1]
        package.setLevel(saved[2])  # also clears the loggers' cached levels


def test_store_cli_refuses_local_for_status(capsys) -> None:
    from dataplane import admin

    args = argparse.Namespace(store_action="status", address="local", json=False)
    assert admin.cli(args) == 2
    assert "holds no store" in capsys.readouterr().out


def test_init_refuses_an_address_of_another_cluster(ray_session) -> None:
    import ray

    import dataplane as dp

    here = ray.get_runtime_context().gcs_address
    with pytest.raises(ValueError, match="already joined the Ray cluster at") as err:
        dp.init(address="127.0.0.1:1")  # a port no Ray head uses
    assert here in str(err.value) and "127.0.0.1:1" in str(err.value)


def test_a_store_server_counts_its_open_connections() -> None:
    """What ``store status`` shows as a shard's clients: connections open now, closed ones gone."""
    import time

    import zmq

    from dataplane.server.index.core import IndexCore
    from dataplane.server.router import RequestServer
    from dataplane.transport.auth import Credentials, secure_client

    def settles_at(n: int) -> bool:
        deadline = time.monotonic() + 10
        while server.connections != n and time.monotonic() < deadline:
            time.sleep(0.01)  # the server thread counts from zmq's socket events
        return server.connections == n

    creds = Credentials.new(encrypt=False)
    server = RequestServer(IndexCore(), "127.0.0.1", "count", creds).start()
    ctx = zmq.Context()
    try:
        socks = []
        for endpoint in (server.ipc, server.tcp):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            secure_client(sock, creds.for_clients(), False)
            sock.connect(endpoint)
            socks.append(sock)
        assert settles_at(2), server.connections
        socks.pop().close()
        assert settles_at(1), server.connections
    finally:
        for sock in socks:
            sock.close()
        server.stop()
        ctx.term()


def test_output_into_a_closed_pipe_ends_quietly(ray_cluster) -> None:
    """`rlplane store status --watch | head -1`: the reader takes one line and goes; the command's next
    write finds no reader, and it ends with the status of a process cut off by SIGPIPE (141), with no
    traceback. A watch writes (and flushes) a line per refresh, so a write after the reader left is
    certain, whatever the timing."""
    import select
    import time

    from tests.dataplane.conftest import start_store
    from tests.forkserver import start_python

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    name = "t-cli-pipe"
    _, _, handle = start_store(name=name, num_shards=1)
    try:
        argv = ["store", "status", "--watch", "--json", "--interval", "0.1", "--count", "3000"]
        proc = start_python(
            ["-m", "rlplane", *argv, "--name", name, "--address", ray_cluster.address],
            stdout=True,
            stderr=True,
            cwd=root,
        )
        first = proc.stdout.readline()
        proc.stdout.close()  # as `head -1` exits
        deadline, said = time.monotonic() + 120, b""
        while select.select([proc.stderr], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(proc.stderr.fileno(), 1 << 16)
            if not chunk:
                break
            said += chunk
        else:
            proc.kill()
            pytest.fail(f"the command went on writing into the closed pipe: {said.decode()}")
        code = proc.wait(timeout=60)
    finally:
        handle.stop()
    text = said.decode(errors="replace")
    assert json.loads(first)["store"] == name, first
    assert "Traceback" not in text and "BrokenPipeError" not in text, text
    assert code == 141, (code, text)
