"""``rlplane bench transport`` on the test bed, on a tiny payload: its driver on h1, the far ends (the
store's remote shard, raw TCP, raw pyzmq) on h2, the report and JSON whole. No speed is asserted (1 MiB
is all fixed costs: a MISS is expected); the run itself must hold together."""

from __future__ import annotations

import json

import pytest

from bench import transport
from dataplane.config import StoreConfig

pytestmark = pytest.mark.slow


def test_the_transport_benchmark_runs_between_two_hosts(hosts, tmp_path, capsys) -> None:
    out = tmp_path / "transport.json"
    code = transport.run_on_bed(hosts, ["--sizes", "1MiB", "--repeat", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code in (0, 1), printed[-4000:]
    res = json.loads(out.read_text())
    h1, h2 = (h.ip for h in hosts.hosts)
    assert res["near"]["ip"] == h1 and res["far"]["ip"] == h2
    assert res["far"]["shard"].startswith(f"tcp://{h2}:"), res["far"]  # the column crossed the link
    assert res["where"] == {"mode": "testbed", "hosts": {"h1": h1, "h2": h2}}
    paths = res["sizes"][str(1 << 20)]
    for path in ("tcp1", "tcp2", "tcp4", "zmq", "store"):
        for op in ("put", "get"):
            assert paths[f"{path}_{op}"]["n"] == 1 and paths[f"{path}_{op}"]["best_gbps"] > 0, (path, op)
    checks = {c["name"]: c["verdict"] for c in res["checks"]}
    conns = StoreConfig().engine_connections  # (the native engine's per shard pair)
    assert set(checks) == {f"{op}_vs_tcp{w}_1MiB" for op in ("put", "get") for w in (conns, "_best")}
    assert set(checks.values()) <= {"PASS", "MISS"}
    assert "raw tcp, 4 conns" in printed and "check" in printed and (code == 1) == ("MISS" in checks.values())
