"""Smoke tests for the controller-bypass benchmark (bench/bypass.py).

No timing is asserted (speed belongs in the benchmark's output): the pure tests pin how driver bytes
are counted, and one tiny run through the session's Ray checks that every path runs end to end,
produces correct results (the benchmark checks them itself) and writes the JSON keys readers use.
"""

from __future__ import annotations

import json

import pytest

from bench import bypass
from bench._driver_cost import peak_rss_growth, per_rank_bytes, pickled_bytes

ROW_KEYS = {
    "workers",
    "rows",
    "payload_bytes",
    "classic_time_ratio",
    "classic_bytes_ratio",
    "classic_best_time_ratio",
}
PATH_KEYS = {
    "median_s",
    "best_s",
    "seconds",
    "driver_sent_bytes",
    "driver_recv_bytes",
    "driver_bytes",
    "driver_peak_rss_growth_bytes",
}


def test_dispatched_chunks_carry_each_sample_once() -> None:
    batch = bypass.make_batch(64, 16)
    payload = 64 * 16 * (8 + 8 + 4)
    whole = pickled_bytes(batch)
    assert payload <= whole < payload + 16 * 1024
    # a chunk that pickled as a view would carry the whole batch: 4 chunks would weigh 4 payloads
    assert payload <= per_rank_bytes(batch, 4) < payload + 4 * 16 * 1024


def _touch(n: int) -> int:
    buf = bytearray(n)
    buf[::4096] = b"\x01" * (n // 4096)  # write every page, so each becomes resident
    return buf.count(1)


def test_peak_rss_growth_sees_an_allocation() -> None:
    grew, out = peak_rss_growth(lambda: _touch(64 * 2**20))
    assert out == 16 * 1024
    assert grew is None or grew >= 32 * 2**20


def test_bad_flags_are_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        bypass.parse_args(["--sizes", "256,x"])
    assert "--sizes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bypass.parse_args(["--workers", "0"])
    with pytest.raises(SystemExit):
        bypass.parse_args(["--repeats", "0"])


@pytest.mark.ray
@pytest.mark.slow
def test_tiny_run_writes_the_json(ray_session, tmp_path) -> None:
    import dataplane as dp

    out = tmp_path / "bypass.json"
    argv = ["--sizes", "8,24", "--workers", "2", "--seq", "16", "--repeats", "1"]
    argv += ["--store-name", "t-bench-bypass", "--json", str(out)]
    assert bypass.main(argv) == 0
    assert not dp.is_initialized()  # the run stopped the store it started
    report = json.loads(out.read_text())
    assert {"benchmark", "config", "method", "results", "machine", "elapsed_s"} <= set(report)
    rows = report["results"]
    assert [(r["workers"], r["rows"]) for r in rows] == [(2, 8), (2, 24)]
    for row in rows:
        assert ROW_KEYS | set(bypass.PATHS) <= set(row)
        for path in bypass.PATHS:
            assert PATH_KEYS <= set(row[path]), path
            assert len(row[path]["seconds"]) == 1
        # the store path ships metadata only: far fewer driver bytes than the payload
        assert row["store"]["driver_bytes"] < row["payload_bytes"] < row["classic"]["driver_bytes"]
    assert "store" in bypass.format_table(rows)
