"""Smoke tests for the controller-bypass benchmark (bench/bypass.py).

No timing is asserted (speed belongs in the benchmark's output). The pure tests pin the workload
(rows from a formula, exact checks that catch a wrong row), how driver bytes are counted, the
command line and the report; one run of the ``--quick`` preset, through the command line's ``main``
in this process against the session's cluster (``--address``), checks that every path runs end to
end and checks its results, and that the JSON records and the PNG are written as ``make
bench-quick`` writes them. ``bench.bypass.run()``, the entry point of ``examples/``, runs in
``tests/test_examples.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest

from bench import _bypass_report, bypass, runner
from bench._bypass_data import BypassCheckError, check_output, check_rows, compute, make_rows, seq_for
from bench._bypass_paths import collected_bytes, dispatched_bytes
from bench._driver_cost import peak_rss_growth, pickled_bytes

HAS_TQ = importlib.util.find_spec("transfer_queue") is not None
HAS_MPL = importlib.util.find_spec("matplotlib") is not None
RECORD_KEYS = {
    "path", "payload_bytes", "workers", "producers", "rows", "row_bytes", "step_s", "best_s",
    "overhead_s", "best_overhead_s", "seconds", "driver_sent_bytes", "driver_recv_bytes",
    "driver_bytes", "driver_peak_rss", "store_bytes", "transport", "nodes", "node_ids", "hosts",
}  # fmt: skip


# ---------------------------------------------------------------------------- the workload


def test_rows_follow_the_formula_and_the_checks_catch_a_wrong_row() -> None:
    import torch

    td = make_rows(torch.arange(8, 16), seq=32, step=3)
    assert td["responses"].dtype == torch.int64 and td["old_log_probs"].shape == (8, 32)
    check_rows("t", td, step=3)
    with pytest.raises(BypassCheckError, match="step 4"):
        check_rows("t", td, step=4)  # a stale step
    td["advantages"][5, -1] += 1
    with pytest.raises(BypassCheckError, match=r"'advantages', row 13") as info:
        check_rows("t", td, step=3)
    assert (info.value.path, info.value.field, info.value.row) == ("t", "advantages", 13)


def test_row_buffers_are_reused_and_rewritten() -> None:
    import torch

    from bench._bypass_data import RowBuffers

    buffers = RowBuffers()
    first = buffers.make(torch.arange(4), 8, step=0)
    again = buffers.make(torch.arange(4), 8, step=5)
    assert again is first  # warm memory, written in place
    check_rows("t", again, step=5)
    assert buffers.make(torch.arange(6), 8, step=5) is not first  # a new shape gets its own


def test_check_output_is_exact_and_names_the_first_wrong_row() -> None:
    import torch

    rows = 600  # more than one check block
    out = compute(make_rows(torch.arange(rows), seq=16, step=1))["new_log_probs"]
    check_output("t", out, rows, 16, step=1)
    out[517, 3] = torch.nextafter(out[517, 3], torch.tensor(1.0))  # one ulp off
    with pytest.raises(BypassCheckError, match="row 517"):
        check_output("t", out, rows, 16, step=1)
    with pytest.raises(BypassCheckError, match="shape"):
        check_output("t", out[:10], rows, 16, step=1)


def test_dispatched_chunks_carry_each_sample_once() -> None:
    batch = make_rows(__import__("torch").arange(64), seq=16, step=0)
    payload = 64 * (16 * 16 + 8)
    assert payload <= pickled_bytes(batch) < payload + 16 * 1024
    # a chunk that pickled as a view would carry the whole batch: 4 chunks would weigh 4 payloads
    assert payload <= dispatched_bytes(4, batch, 0) < payload + 4 * 16 * 1024
    assert collected_bytes([1, 2], 2) == pickled_bytes(1) + pickled_bytes(2)


def _touch(n: int) -> int:
    buf = bytearray(n)
    buf[::4096] = b"\x01" * (n // 4096)  # write every page, so each becomes resident
    return buf.count(1)


def test_peak_rss_growth_sees_an_allocation() -> None:
    grew, out = peak_rss_growth(lambda: _touch(64 * 2**20))
    assert out == 16 * 1024
    assert grew is None or grew >= 32 * 2**20


# ---------------------------------------------------------------------------- command line


def test_sizes_parse_and_format() -> None:
    assert bypass.parse_size("64MiB") == 64 * 2**20
    assert bypass.parse_size("1GiB") == 2**30 and bypass.parse_size("1GB") == 10**9
    assert bypass.parse_size("512k") == 512 * 1024 and bypass.parse_size("4096") == 4096
    assert bypass.format_size(256 * 2**20) == "256MiB" and bypass.format_size(1000) == "1000B"
    with pytest.raises(ValueError, match="not a size"):
        bypass.parse_size("64 parsecs")
    assert seq_for(64 * 1024) == 4096


def test_quick_preset_and_overrides() -> None:
    cfg, args = bypass.parse_args(["--quick", "--payload", "8MiB", "--json", "out/b.json"])
    assert cfg.payloads == (8 * 2**20,) and cfg.workers == (2,) and cfg.producers == 1 and cfg.steps == 3
    assert args.plot == "out/b.png"
    cfg, _ = bypass.parse_args(["--workers", "2,4,8,16", "--row-bytes", "64KiB", "--transport", "zmq"])
    assert cfg.workers == (2, 4, 8, 16) and cfg.rows_for(256 * 2**20) == 4096
    assert bypass.BypassConfig().payloads == (64 * 2**20, 256 * 2**20, 2**30)


@pytest.mark.parametrize(
    ("argv", "culprit"),
    [
        (["--payload", "64MiB,x"], "--payload"),
        (["--workers", "0"], "--workers"),
        (["--steps", "0"], "steps"),
        (["--paths", "floor,warp"], "warp"),
        (["--rows", "1000", "--workers", "16"], "16 workers"),
        (["--address", "nowhere"], "nowhere"),
    ],
)
def test_bad_flags_are_refused_naming_the_culprit(argv, culprit, capsys) -> None:
    with pytest.raises(SystemExit):
        bypass.parse_args(argv)
    assert culprit in capsys.readouterr().err


def test_runner_passes_the_benchmarks_flags_and_takes_out_back() -> None:
    assert runner.split_out(["--quick", "--out", "build/bench"], "x") == ("build/bench", ["--quick"])
    assert runner.split_out(["--out=o", "--payload", "1GiB"], "x") == ("o", ["--payload", "1GiB"])
    args = argparse.Namespace(which="all", out="o", bench_args=["--quick"])
    assert runner.cli(args) == 2  # flags without a benchmark's name are refused


def test_bypass_results_go_to_build_bench_by_default() -> None:
    bench = runner.BENCHMARKS["bypass"]
    assert bench.out == "build/bench"
    assert bench.argv(__import__("pathlib").Path(bench.out)) == ["--json", "build/bench/bypass.json"]


def test_cli_hands_flags_after_the_name_to_the_benchmark() -> None:
    from rlplane.cli import build_parser

    args = build_parser().parse_args(["bench", "bypass", "--quick", "--out", "build/bench"])
    assert (args.which, args.bench_args) == ("bypass", ["--quick", "--out", "build/bench"])


# ---------------------------------------------------------------------------- report


def _record(path: str, payload: int, step: float, overhead: float | None, driver: int) -> dict:
    return {"path": path, "payload_bytes": payload, "workers": 4, "step_s": step, "best_s": step,
            "overhead_s": overhead, "driver_sent_bytes": driver // 2, "driver_recv_bytes": driver // 2,
            "driver_bytes": driver, "driver_peak_rss": 0, "store_bytes": None}  # fmt: skip


def test_report_ratios_and_checks() -> None:
    mib = 2**20
    records = []
    for payload, scale in ((64 * mib, 1), (256 * mib, 4)):
        classic = _record("classic", payload, 1.0 * scale, 0.9 * scale, 150 * mib * scale)
        records += [
            _record("floor", payload, 0.1 * scale, 0.0, 20_000),
            {**classic, "overhead_vs_store": 18.0},
            {**_record("store", payload, 0.15 * scale, 0.05 * scale, 45_000), "vs_pyzmq": 0.7},
            {**_record("tq", payload, 0.35 * scale, 0.25 * scale, 45_000), "overhead_vs_store": 5.0},
        ]
    text = _bypass_report.format_table(records)
    assert "classic/store overhead 18.0x; tq/store overhead 5.0x; store vs raw pyzmq 0.7x" in text
    checks = {c.name: c for c in _bypass_report.evaluate(records)}
    assert checks["classic/store W=4 256MiB"].verdict == "PASS"
    assert checks["store/pyzmq W=4 64MiB"].verdict == "MISS"
    assert checks["store driver bytes W=4 64->256MiB"].value == pytest.approx(1.0)
    assert checks["classic driver bytes W=4 64->256MiB"].value == pytest.approx(4.0)


# ---------------------------------------------------------------------------- runs


@pytest.mark.skipif(not HAS_MPL, reason="needs matplotlib (the bench extra)")
@pytest.mark.parametrize("payloads", [[64 * 2**20], [16 * 2**20, 64 * 2**20]])
def test_the_chart_of_one_point_or_several_is_drawn_with_its_reading(tmp_path, payloads) -> None:
    paths = (("floor", 0.5, 0.0, 0), ("classic", 1.0, 0.5, 2**21), ("store", 0.6, 0.1, 9000))
    records = [
        {"path": path, "payload_bytes": p, "workers": 2, "step_s": step, "overhead_s": over,
         "driver_bytes": carried * p // 2**20 if path == "classic" else carried}
        for p in payloads
        for path, step, over, carried in paths
    ]  # fmt: skip
    assert _bypass_report.plot(records, str(tmp_path / "b.png")).stat().st_size > 10_000
    reading = _bypass_report.headline(records)
    assert "fewer bytes on the store path" in reading and "0.10 s (store)" in reading
    assert ("the classic driver's bytes grow 4x" in reading) == (len(payloads) > 1), reading


@pytest.mark.ray
@pytest.mark.slow
def test_quick_preset_runs_every_path_checked_and_writes_json_and_png(
    ray_cluster, tmp_path, main_in_process
) -> None:
    """The command line's ``main`` in this process, against the session's cluster (``--address``):
    this process has joined that Ray already, so the run uses it and leaves it joined, starts and
    stops a store of its own, and writes what ``make bench-quick`` writes (JSON records, PNG)."""
    paths = bypass.PATHS if HAS_TQ else ("floor", "classic", "store")  # tq: the bench extra
    out = tmp_path / "bypass.json"
    argv = ["--quick", "--payload", "256KiB", "--rows", "64", "--steps", "1", "--paths", ",".join(paths),
            "--address", ray_cluster.address, "--store-name", "t-bench-bypass",
            "--json", str(out)]  # fmt: skip
    code, printed = main_in_process(bypass.main, argv)
    assert code == 0, printed[-3000:]
    records = json.loads(out.read_text())
    assert [r["path"] for r in records] == list(paths)
    by = {r["path"]: r for r in records}
    for r in records:
        assert RECORD_KEYS <= set(r), r["path"]
        assert r["workers"] == 2 and r["rows"] == 64 and len(r["seconds"]) == 1
    payload = by["store"]["payload_bytes"]
    # the store path ships metadata only: far fewer driver bytes than the payload; classic ships it all
    assert by["store"]["driver_bytes"] < payload < by["classic"]["driver_bytes"]
    # put once, fetched once, the new field (a quarter of the token bytes) written back, per step
    assert payload * 2 <= by["store"]["store_bytes"] <= payload * 2.5
    assert by["floor"]["overhead_s"] == 0.0 and "overhead_vs_store" in by["classic"]
    assert "classic/store overhead" in printed
    run = json.loads((tmp_path / "bypass.run.json").read_text())
    assert run["config"]["address"] == ray_cluster.address and run["machine"]["cpu_count"]
    assert (tmp_path / "bypass.png").exists() == HAS_MPL
