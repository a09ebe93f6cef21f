"""Losses across hosts: a shard killed on another host, then a whole host lost (its namespaces'
processes killed). They run after every other test of ``tests/multihost`` (``conftest``): the host
loss ends the shared test bed's second host."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.slow

LOST = str(pathlib.Path(__file__).with_name("_lost.py"))


def _step(proc) -> dict:
    """The driver's next JSON line (Ray may print other lines there too)."""
    while True:
        line = proc.stdout.readline()
        assert line, f"the driver on h1 ended early:\n{proc.stderr.read()[-6000:]}"
        if line.startswith("{"):
            return json.loads(line)


def test_a_shard_killed_on_another_host_is_a_typed_error_naming_it(hosts) -> None:
    h1, h2 = hosts.hosts
    driver = h1.popen(["python", LOST, "shard", "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        ready = _step(driver)
        pid = ready["victim_pid"]  # the shard's process, as h2 numbers it; gone before the driver goes on
        h2.run(
            ["sh", "-c", f"kill -9 {pid} && while kill -0 {pid} 2>/dev/null; do sleep 0.01; done"], timeout=60
        )
        driver.stdin.write("go\n")
        driver.stdin.flush()
        lost = _step(driver)
        assert driver.wait(timeout=300) == 0, driver.stderr.read()[-4000:]
    finally:
        driver.kill()
    assert lost["error"]["type"] == "ShardUnavailableError", lost
    # Found dead through Ray (its pid means nothing on h1), not after the 120 s deadline.
    assert f"{ready['victim']} at" in lost["error"]["message"] and "is dead" in lost["error"]["message"], lost
    assert lost["kept"], "rows on the surviving host changed"


def test_a_lost_host_is_a_typed_error_and_a_checkpoint_loads_onto_what_is_left(hosts) -> None:
    h1, h2 = hosts.hosts
    ckpt = pathlib.Path(__file__).resolve().parents[2] / "build" / f"multihost-ckpt-{h1.netns}"
    driver = h1.popen(["python", LOST, "host", str(ckpt)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        _step(driver)
        h2.kill()  # every process of h2 at once, as a machine that went away
        driver.stdin.write("go\n")
        driver.stdin.flush()
        lost = _step(driver)
        loaded = _step(driver)
        assert driver.wait(timeout=300) == 0, driver.stderr.read()[-4000:]
    finally:
        driver.kill()
        shutil.rmtree(ckpt, ignore_errors=True)
    said = lost["error"]["message"]
    assert lost["error"]["type"] == "ShardUnavailableError", lost
    # It names what was lost and where: the shard on h2 (dead), or the whole store when the index
    # was on h2 too (placement decides).
    assert "lost-host-shard-" in said and h2.ip in said, said
    assert "is dead" in said or ("were lost" in said and "dp.load_checkpoint" in said), said
    assert lost["kept"], "rows on the surviving host changed"
    assert loaded == {"step": "loaded", "nodes": 1, "exact": True}, loaded
