"""``rlplane bench bypass --testbed N``: the controller-bypass benchmark across N hosts of a test bed
built on this machine (``bench.testbed``: root only).

The driver runs on h1 and joins the bed's Ray cluster (``--address auto``); the store starts one
shard per node and the workers are spread over the nodes (``--strategy spread``), so producers,
consumers and shards sit on different hosts and every row a consumer reads from another host's
shard crosses a real network stack. The same run on a cluster is ``--address auto``.
"""

from __future__ import annotations

import pathlib
import sys
import time
from collections.abc import Sequence

from bench import testbed

DEADLINE_S = 3600.0  # the driver on h1 is killed past this


def _outputs(argv: Sequence[str], flags: tuple[str, ...], host: testbed.Host) -> list[str]:
    """``argv`` with the paths after ``flags`` made absolute (the driver starts at the host's /) and
    as ``host`` sees them (its ``/tmp`` is its own).

    Example:
        >>> _outputs(["--json", ""], ("--json",), testbed.Host("h1", "10.77.0.2", "rlt-ab-h1", 1))
        ['--json', '']
    """
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg in flags and out[i + 1]:
            out[i + 1] = host.sees(pathlib.Path(out[i + 1]).resolve())
    return out


def run(hosts: int, argv: Sequence[str], json_path: str, plot_path: str) -> int:
    """Build a bed of ``hosts`` hosts, run the benchmark with ``argv`` on h1; its exit status."""
    why = testbed.missing()
    if why:
        print(f"rlplane bench bypass --testbed: cannot build a test bed here: {why}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    with testbed.Testbed(hosts=hosts) as bed:
        print(f"test bed of {hosts} hosts up in {time.perf_counter() - t0:.1f} s", flush=True)
        return run_on_bed(bed, argv, json_path, plot_path)


def run_on_bed(bed: testbed.Testbed, argv: Sequence[str], json_path: str, plot_path: str) -> int:
    """The benchmark with ``argv`` on a test bed that is up: its driver on h1, joined to the bed's
    cluster, the workers spread over every host; its exit status."""
    args = [*argv, "--address", "auto", "--strategy", "spread", "--json", json_path, "--plot", plot_path]
    h1 = bed.hosts[0]
    args = _outputs(args, ("--json", "--plot"), h1)
    print(f"driver on {h1.name} ({h1.ip}); hosts: {', '.join(h.ip for h in bed.hosts)}", flush=True)

    def echo(line: str) -> None:
        print(f"  {h1.name}| {line}", end="", flush=True)

    return h1.drive(["-m", "bench.bypass", "--no-progress", *args], DEADLINE_S, echo)


__all__ = ["run", "run_on_bed"]
