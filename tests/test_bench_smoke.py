"""Smoke tests for bench/: the helpers and report logic, and one tiny run of the store benchmark.

No timing is asserted here (speed belongs to the benchmark's own output); these tests check that the
benchmark runs end to end on a tiny payload and writes JSON with the keys its readers rely on.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

import pytest

from bench import _common, _memory, _report, runner
from bench.store_throughput import Config, parse_args

HAS_TQ = importlib.util.find_spec("transfer_queue") is not None


def test_throughput_and_percentiles() -> None:
    t = _common.throughput(4 * _common.GB, [2.0, 1.0, 4.0])
    assert t["best_gbps"] == pytest.approx(4.0)
    assert t["median_gbps"] == pytest.approx(2.0)
    assert _common.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert _common.percentile([1.0, 2.0], 90) == pytest.approx(1.9)
    with pytest.raises(ValueError, match="at least one"):
        _common.throughput(1, [])


def test_check_verdicts() -> None:
    assert _common.Check("a", 3.1, 3.0, ">=", "").verdict == "PASS"
    assert _common.Check("a", 2.9, 3.0, ">=", "").verdict == "MISS"
    assert _common.Check("b", 2.5, 2.0, "<=", "").verdict == "MISS"
    assert _common.Check("c", None, 2.0, "<=", "").verdict == "n/a"
    assert _common.ratio(1.0, 0.0) is None


def _fake_results() -> dict:
    def tp(gbps: float) -> dict:
        return _common.throughput(_common.GB, [1.0 / gbps])

    lat = {"p50_us": 100.0, "p90_us": 150.0, "min_us": 90.0, "n": 10}
    mem = {"bytes_resident": 0, "bytes_used": 0, "rss": 100, "os_resident": 100, "shards": 2}
    return {
        "config": {"rows": 1, "cols": 1, "fields": 1, "payload_bytes": 1000, "statistic": "best of 1"},
        "machine": {"host": "h", "cpu_count": 2, "memory_gib": 1, "date_utc": "now"},
        "paths": {
            "memcpy": {"copy": tp(10.0)},
            "ray": {"put": tp(0.5), "get": tp(0.8), "latency": {"bare_ray": lat}},
            "tq": {
                "put": tp(0.8),
                "get": tp(0.25),
                "latency": {"bare_ray_no_arg": lat, "put": lat, "get": lat},
            },
            "store": {
                "put": tp(2.5),
                "get": tp(3.5),
                "latency": {
                    "bare_ray": {**lat, "p50_us": 200.0},
                    "bare_ray_no_arg": lat,
                    "put": {**lat, "p50_us": 150.0},
                    "get": {**lat, "p50_us": 250.0},
                },
                "memory": {
                    "empty": mem,
                    "held": {**mem, "bytes_resident": 1200, "os_resident": 1500},
                    "after_clear": mem,
                },
            },
        },
        "skipped": {},
    }


def test_evaluate_ratios_and_verdicts() -> None:
    results = _fake_results()
    checks, info = _report.evaluate(results)
    assert checks["put_vs_tq"]["value"] == pytest.approx(2.5 / 0.8)
    assert checks["put_vs_tq"]["verdict"] == "PASS"
    assert checks["get_vs_tq"]["value"] == pytest.approx(14.0)
    assert checks["get_vs_memcpy"]["value"] == pytest.approx(0.35)
    assert checks["latency_put_vs_ray"]["verdict"] == "PASS"
    assert checks["latency_get_vs_ray"]["verdict"] == "MISS"
    assert checks["memory_held"]["value"] == pytest.approx(1.2)
    assert checks["memory_after_clear"]["verdict"] == "PASS"
    assert checks["memory_held_os"]["value"] == pytest.approx(1.4)
    assert checks["memory_held_os"]["verdict"] == "MISS"
    assert info["tq_latency_get_vs_ray"] == pytest.approx(1.0)
    assert info["latency_get_vs_ray_noop_x"] == pytest.approx(1.25)
    results["checks"], results["info"] = checks, info
    text = _report.render(results)
    assert "latency_get_vs_ray" in text and "MISS" in text
    md = _report.markdown(results)
    assert "| latency_get_vs_ray | 2.50 | <= 2.0 | MISS |" in md


def test_shard_entries_accepts_the_likely_stats_shapes() -> None:
    one = {"bytes_resident": 5, "pid": 1}
    assert _memory.shard_entries([one]) == [one]
    assert _memory.shard_entries({"shards": [one]}) == [one]
    assert _memory.shard_entries({"s0": one}) == [{**one, "shard": "s0"}]
    with pytest.raises(TypeError, match="per-shard"):
        _memory.shard_entries(42)


def test_cli_flags_are_validated() -> None:
    cfg = parse_args(["--rows", "4", "--cols", "8", "--skip-tq", "--json", "x.json"])
    assert (cfg.rows, cfg.cols, cfg.fields, cfg.skip_tq, cfg.json) == (4, 8, 2, True, "x.json")
    assert cfg.payload_bytes == 4 * 8 * 2 * 4
    assert Config().payload_bytes == 64 * 2**20
    with pytest.raises(SystemExit):
        parse_args(["--rows", "0"])


def test_runner_rejects_unknown_and_reports_unbuilt(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    assert runner.cli(argparse.Namespace(which="nope", out=str(tmp_path))) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err
    missing = runner.Benchmark("ghost", "bench.no_such_benchmark", "never built")
    assert not runner.is_built(missing)
    assert runner.is_built(runner.BENCHMARKS["store"])
    out = tmp_path / "o"
    assert runner.BENCHMARKS["store"].argv(out) == [
        "--json", str(out / "store_throughput.json"), "--plot", str(out / "store_throughput.png"),
        "--markdown", str(out / "store_throughput.md"),
    ]  # fmt: skip
    assert runner.BENCHMARKS["dispatch"].argv(out) == ["--json", str(out / "dispatch_overhead.json")]


def test_runner_runs_a_benchmark_in_a_child_process(tmp_path, monkeypatch) -> None:
    # A stand-in benchmark module: writes its argv to the --json path and exits with status 3.
    (tmp_path / "fake_bench_mod.py").write_text(
        "import json, sys\n"
        "def main(argv):\n"
        "    json.dump(argv, open(argv[argv.index('--json') + 1], 'w'))\n"
        "    return 3\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    bench = runner.Benchmark("fake", "fake_bench_mod", "a stand-in")
    assert runner.run_one(bench, tmp_path / "out", timeout_s=60) == 3
    written = json.loads((tmp_path / "out" / "fake_bench_mod.json").read_text())
    assert written == ["--json", str(tmp_path / "out" / "fake_bench_mod.json")]


def _tiny_run(ray_cluster, tmp_path, paths: str, main_in_process) -> dict:
    """Run the benchmark on 4 rows x 8 floats x 2 fields against the session's Ray; return its JSON."""
    from bench import store_throughput

    out = tmp_path / "store.json"
    argv = ["--rows", "4", "--cols", "8", "--repeats", "1", "--latency-iters", "3", "--latency-warmup", "1",
            "--ray-address", ray_cluster.address, "--call-timeout-s", "60", "--release-wait-s", "2",
            "--paths", paths, "--json", str(out)]  # fmt: skip
    code, printed = main_in_process(store_throughput.main, argv)
    assert code == 0, f"benchmark failed:\n{printed[-3000:]}"
    assert "check" in printed and "memcpy" in printed
    results = json.loads(out.read_text())
    assert {"config", "machine", "paths", "skipped", "checks", "info"} <= results.keys()
    assert results["config"]["payload_bytes"] == 4 * 8 * 2 * 4
    assert results["paths"]["memcpy"]["copy"]["best_gbps"] > 0
    for name in ("put_vs_tq", "get_vs_ray", "get_vs_memcpy", "latency_get_vs_ray", "memory_held"):
        assert {"value", "target", "verdict"} <= results["checks"][name].keys()
    return results


@pytest.mark.ray
def test_store_benchmark_tiny_run_writes_json(ray_cluster, tmp_path, main_in_process) -> None:
    results = _tiny_run(ray_cluster, tmp_path, "memcpy,ray,store", main_in_process)
    ray_path = results["paths"]["ray"]
    assert {"put", "get", "latency"} <= ray_path.keys(), ray_path.get("error")
    assert ray_path["get"]["n"] == 1 and ray_path["latency"]["bare_ray"]["n"] == 3
    assert ray_path["latency"]["bare_ray_no_arg"]["n"] == 3
    assert results["skipped"]["tq"] == "not in --paths"
    if "store" in results["paths"]:
        store = results["paths"]["store"]
        assert {"put", "get", "latency", "memory"} <= store.keys(), store.get("error")
        assert {"empty", "held", "after_clear"} <= store["memory"].keys()
        assert results["checks"]["put_vs_ray"]["value"] is not None
    else:
        assert "store" in results["skipped"]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.skipif(not HAS_TQ, reason="transferqueue is not installed (the bench extra)")
def test_store_benchmark_tiny_transferqueue_run(ray_cluster, tmp_path, main_in_process) -> None:
    # TransferQueue starts three actors of its own (num_cpus=1 each); on 2 busy cores that takes a while.
    results = _tiny_run(ray_cluster, tmp_path, "memcpy,tq", main_in_process)
    tq = results["paths"]["tq"]
    assert {"put", "get", "latency", "init_s"} <= tq.keys(), tq.get("error")
    assert {"bare_ray", "bare_ray_no_arg", "put", "get"} <= tq["latency"].keys()
    assert tq["get"]["n"] == 1


@pytest.mark.ray
def test_checkpoint_benchmark_tiny_run_writes_json(ray_cluster, tmp_path, main_in_process) -> None:
    from bench import checkpoint

    out = tmp_path / "checkpoint.json"
    argv = ["--bytes", "64K", "--rows", "4", "--repeats", "1", "--skip-tq", "--address", ray_cluster.address,
            "--dir", str(tmp_path), "--json", str(out)]  # fmt: skip
    code, printed = main_in_process(checkpoint.main, argv)
    # 64 KiB is all fixed costs: the speed targets may miss, the benchmark must still run whole
    assert code in (0, 1), f"benchmark failed:\n{printed[-3000:]}"
    results = json.loads(out.read_text())
    assert results["skipped"]["tq"] == "--skip-tq" and results["disk"]["write"]["n"] == 1
    store = results["store"]
    assert (
        store["data_bytes"] >= 64 * 1024 and store["save"]["best_gbps"] > 0 and store["load"]["best_gbps"] > 0
    )
    checks = {c["name"]: c for c in results["checks"]}
    assert checks["driver_bytes_ratio"]["verdict"] == "PASS"  # 1.2 KB whatever the rows hold
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.json"]  # its checkpoints are gone


@pytest.mark.ray
def test_gpu_round_trip_runs_on_cpu_tensors_and_checks_the_bytes(
    ray_cluster, tmp_path, main_in_process
) -> None:
    """`scripts/gpu_check.sh`'s benchmark, with CPU tensors: the machinery runs where no GPU is."""
    from bench import gpu

    out = tmp_path / "gpu.json"
    argv = ["--device", "cpu", "--sizes", "64K:4,128K:8", "--repeats", "1",
            "--address", ray_cluster.address, "--json", str(out)]  # fmt: skip
    code, printed = main_in_process(gpu.main, argv)
    assert code == 0, f"benchmark failed:\n{printed[-3000:]}"
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and [r["bytes"] for r in res["rows"]] == [64 * 1024, 128 * 1024]
    for row in res["rows"]:  # the keys issue 48 names, no more
        assert set(row) == {
            "bytes",
            "store_gbps",
            "pinned_gbps",
            "naive_gbps",
            "store_vs_pinned",
            "store_vs_naive",
        }
        assert row["store_gbps"] > 0 and row["store_vs_naive"] > 0
        assert row["pinned_gbps"] is None and row["store_vs_pinned"] is None  # a pinned buffer needs a GPU
    assert [d["d2d_gbps"] for d in res["device_to_device"]] == [None, None]
    assert res["copy_paths"]["writer"]["direct"] == 0  # CPU tensors: plain copies, nothing registered
    assert "64 MiB" not in printed and "store/pinned" in printed and "writer:" in printed


def test_gpu_round_trip_refuses_without_a_cuda_device(capsys) -> None:
    import torch

    from bench import gpu

    if torch.cuda.is_available():
        pytest.skip("checks the refusal where there is no CUDA device")
    assert gpu.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_gpu_round_trip_reads_its_payloads() -> None:
    from bench import gpu

    assert gpu.parse_sizes("16M:8, 1G") == [(16 << 20, 8), (1 << 30, 64)]


def test_index_benchmark_splits_probe_samples_by_phase() -> None:
    from bench import index

    marks = {"idle": (0.0, 1.0), "puts": (1.0, 2.0), "listing": (2.0, 3.0)}
    samples = [(0.5, {"put": 0.001}), (1.5, {"put": 0.004}), (2.5, {"put": 0.002}), (9.0, {"put": 1.0})]
    phases = index.split_phases(samples, marks)
    assert phases["idle"]["put"] == index.summary([0.001])
    assert phases["busy"]["put"]["n"] == 2 and phases["busy"]["put"]["max_ms"] == pytest.approx(4.0)
    assert phases["puts"]["consumption"]["n"] == 0  # an op no sample timed is there, empty
    cfg = index.parse_args(["--quick", "--clients", "3"])
    assert (cfg.rows, cfg.clients, cfg.client_s) == (200_000, 3, 5.0)  # a flag given wins over --quick
    assert index.parse_args([]).rows == 1_000_000
    with pytest.raises(SystemExit):
        index.parse_args(["--rows", "0"])


@pytest.mark.ray
def test_index_benchmark_tiny_run_writes_json(ray_cluster, tmp_path, main_in_process) -> None:
    from bench import index

    out = tmp_path / "index.json"
    argv = ["--rows", "2000", "--put-batch", "500", "--take-batch", "100", "--clients", "2", "--client-s",
            "0.5", "--idle-s", "0.3", "--address", ray_cluster.address, "--json", str(out)]  # fmt: skip
    code, printed = main_in_process(index.main, argv)
    # The targets are the index work's: today they miss, and the run must still finish whole
    assert code in (0, 1), f"benchmark failed:\n{printed[-3000:]}"
    res = json.loads(out.read_text())
    big = res["big"]
    assert big["listing"]["keys"] == 2000 and big["listing"]["reply_bytes"] > 2000 * 4
    assert big["streaming"]["calls"] == 20 and big["puts"]["keys_per_s"] > 0
    assert big["index_rss"]["after_puts"] > 0 and res["probe"]["errors"] == 0
    assert res["probe"]["phases"]["idle"]["put"]["n"] >= 1
    assert {"idle", "puts", "streaming", "listing", "saving", "clearing", "busy"} <= res["probe"][
        "phases"
    ].keys()
    assert big["saving"]["keys"] == 2000
    assert {op: s["n"] > 0 for op, s in res["clients"]["ops"].items()} == dict.fromkeys(
        index.CLIENT_OPS, True
    )
    checks = {c["name"]: c for c in res["checks"]}
    assert {
        "index_bytes_per_key",
        "probe_put_p99_ms",
        "put_commits_per_s",
        "next_batch_rows_per_s",
    } <= checks.keys()
    assert "next_batch_rows_per_s" in printed


# ---- the transport benchmark (its run across two hosts: tests/multihost/test_transport_bench.py) ----


def test_transport_benchmark_without_root_or_address_says_how_and_exits_2(monkeypatch, capsys) -> None:
    from bench import testbed, transport

    monkeypatch.setattr(testbed, "missing", lambda: "building hosts from network namespaces needs root")
    assert transport.main(["--quick"]) == 2
    err = capsys.readouterr().err
    assert "needs root" in err and "--address auto" in err


def test_transport_benchmark_mooncake_engine_names_what_it_lacks(capsys) -> None:
    from bench import transport
    from dataplane.transport.engine import engine_missing

    if not engine_missing("mooncake"):
        pytest.skip("Mooncake's Transfer Engine loads here (tests/dataplane/test_engine.py runs it)")
    assert transport.main(["--engine", "mooncake", "--address", "auto"]) == 2
    err = capsys.readouterr().err
    assert "--engine mooncake" in err and "mooncake-transfer-engine-non-cuda" in err, err


def test_a_store_on_an_engine_that_cannot_run_here_is_refused_naming_what_is_missing() -> None:
    from dataplane.config import StoreConfig
    from dataplane.errors import EngineUnavailableError, InvalidArgumentError
    from dataplane.service.launch import start_service
    from dataplane.transport.engine import engine_missing

    with pytest.raises(InvalidArgumentError, match="engine='rdma' is not one of"):
        StoreConfig(engine="rdma")
    if not engine_missing("mooncake"):
        pytest.skip("Mooncake's Transfer Engine loads here")
    with pytest.raises(EngineUnavailableError, match="libibverbs1"):
        start_service(StoreConfig(engine="mooncake"))  # refused before Ray is asked for anything


def test_transport_benchmark_flags_and_checks() -> None:
    from bench import transport

    quick = transport.parse_args(["--quick"])
    assert (quick.sizes, quick.repeat) == ([64 << 20, 256 << 20], 2)
    full = transport.parse_args(["--sizes", "1MiB,2M", "--connections", "3"])
    assert (full.sizes, full.repeat, full.connections) == ([1 << 20, 2 << 20], 3, [3])
    with pytest.raises(SystemExit):
        transport.parse_args(["--sizes", "1000"])  # not a multiple of 16 rows of 4 KiB

    def tp(gbps: float) -> dict:
        return _common.throughput(10**9, [1.0 / gbps])

    sizes = {"1048576": {"tcp1_put": tp(2), "tcp1_get": tp(2), "tcp4_put": tp(4), "tcp4_get": tp(1),
                         "store_put": tp(1.7), "store_get": tp(1.5)}}  # fmt: skip
    checks = {
        c.name: c
        for c in transport.checks_of({"sizes": sizes, "store_connections": 1, "connections": [1, 4]})
    }
    assert (
        checks["put_vs_tcp1_1MiB"].value == pytest.approx(0.85)
        and checks["put_vs_tcp1_1MiB"].verdict == "PASS"
    )
    assert (
        checks["put_vs_tcp_best_1MiB"].value == pytest.approx(1.7 / 4)
        and "4 connections" in checks["put_vs_tcp_best_1MiB"].what
    )
    assert checks["get_vs_tcp_best_1MiB"].value == pytest.approx(0.75)  # 1 connection is get's best
    assert [checks[n].verdict for n in ("put_vs_tcp_best_1MiB", "get_vs_tcp1_1MiB")] == ["MISS", "MISS"]


def test_raw_tcp_moves_the_bytes_over_one_and_several_connections() -> None:
    """The raw TCP reference on loopback (its far end in this process): every byte arrives, both ways."""
    import numpy as np

    from bench._rawtcp import RawTcp, TcpPeer

    peer = TcpPeer()
    raw = None
    try:
        endpoint = peer.listen("127.0.0.1", timeout_s=30)
        peer.prepare(3 << 20)
        raw = RawTcp(endpoint, max_conns=3, timeout_s=30)
        src = np.random.default_rng(0).integers(0, 255, 3 << 20, dtype=np.uint8)
        for conns in (1, 3):
            out = np.zeros_like(src)
            assert raw.write(memoryview(src), conns) > 0
            assert bytes(peer.buf) == src.tobytes()
            assert raw.read(memoryview(out), conns) > 0
            assert np.array_equal(out, src)
            src = src[::-1].copy()
        assert peer.errors_seen() == []
    finally:
        if raw is not None:
            raw.close()
        peer.close()


def test_transport_benchmark_registered_and_skipped_by_all_where_it_cannot_run(
    capsys, monkeypatch, tmp_path
) -> None:
    import dataclasses

    from bench import testbed

    bench = runner.BENCHMARKS["transport"]
    assert bench.module == "bench.transport" and runner.is_built(bench) and bench.why_not is testbed.missing
    cannot = dataclasses.replace(bench, why_not=lambda: "needs root")
    monkeypatch.setattr(runner, "BENCHMARKS", {"transport": cannot})
    assert runner.cli(argparse.Namespace(which="all", out=str(tmp_path), bench_args=[])) == 0
    assert "rlplane bench transport: cannot run here (needs root); skipped" in capsys.readouterr().out


def test_transport_benchmark_docstring_examples() -> None:
    import doctest

    from bench import _rawtcp, _transport_run

    for module in (_rawtcp, _transport_run):
        assert doctest.testmod(module).failed == 0, module.__name__
