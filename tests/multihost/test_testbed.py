"""The test bed's hosts are separate hosts to every check a process can make: network, pid and mount
namespaces, ``/tmp`` and ``/dev/shm``; they reach each other over their link and nothing else."""

from __future__ import annotations

import subprocess

import pytest

pytestmark = pytest.mark.slow

_FACTS = (
    "import os, socket; "
    "print(*(os.stat(f'/proc/self/ns/{n}').st_ino for n in ('net', 'pid', 'mnt')), "
    "os.stat('/dev/shm').st_dev, os.stat('/tmp').st_dev, sum(e.isdigit() for e in os.listdir('/proc')) < 10)"
)


def test_each_host_has_namespaces_and_tmpfs_of_its_own(bare_hosts) -> None:
    mine = subprocess.run(
        ["python3", "-c", _FACTS], capture_output=True, text=True, check=True
    ).stdout.split()
    seen = [h.run(["python3", "-c", _FACTS]).stdout.split() for h in bare_hosts.hosts]
    for facts in seen:
        assert facts[-1] == "True", "a host's /proc shows the machine's processes"
        for i, what in enumerate(
            ("network namespace", "pid namespace", "mount namespace", "/dev/shm", "/tmp")
        ):
            assert facts[i] != mine[i], f"a host shares the machine's {what}"
    assert all(a != b for a, b in zip(seen[0][:5], seen[1][:5], strict=True)), "two hosts share something"


_SERVE = (
    "import socket; s = socket.socket(); s.bind(('{ip}', 7000)); s.listen(); print('up', flush=True); "
    "c, _ = s.accept(); c.sendall(c.recv(5))"
)
_CALL = (
    "import socket; s = socket.create_connection(('{ip}', 7000), timeout=10); "
    "s.sendall(b'hello'); print(s.recv(5))"
)


def test_hosts_reach_each_other_and_the_machine_reaches_none(bare_hosts) -> None:
    h1, h2 = bare_hosts.hosts
    server = h2.popen(["python3", "-c", _SERVE.format(ip=h2.ip)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        assert h1.run(["python3", "-c", _CALL.format(ip=h2.ip)]).stdout.strip() == "b'hello'"
    finally:
        server.kill()
        server.wait()
    lost = subprocess.run(["python3", "-c", _CALL.format(ip=h2.ip)], capture_output=True, text=True)
    assert lost.returncode != 0, "the machine's own namespace reached a host"
