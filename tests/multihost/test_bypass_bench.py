"""``rlplane bench bypass --testbed`` on the session's test bed, on a small step: its driver on h1, the
store one shard per host, the workers spread over both hosts, so the rows consumers read from the
other host's shard cross the link. No speed is asserted; the run and its records must hold together."""

from __future__ import annotations

import json

import pytest

from bench import _bypass_bed

pytestmark = pytest.mark.slow


def test_the_bypass_benchmark_runs_across_two_hosts(hosts, tmp_path, capsys) -> None:
    out = tmp_path / "bypass.json"
    argv = ["--quick", "--payload", "2MiB", "--rows", "64", "--steps", "1", "--warmup", "1"]
    argv += ["--paths", "store", "--raw-zmq", "off", "--store-name", "bypass-bed"]
    code = _bypass_bed.run_on_bed(hosts, argv, str(out), "")
    printed = capsys.readouterr().out
    assert code == 0, printed[-4000:]
    records = json.loads(out.read_text())
    assert {r["path"] for r in records} == {"store"}, records
    both = sorted(h.ip for h in hosts.hosts)
    for r in records:
        assert r["hosts"] == both, r["nodes"]
        assert sorted(set(r["nodes"]["store_shards"])) == both, r["nodes"]  # one shard per host
        assert sorted(set(r["nodes"]["consumers"])) == both, r["nodes"]  # spread: rows cross the link
    assert "consumers on" in printed, printed[-4000:]  # the report says where each role ran
