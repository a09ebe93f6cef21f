"""Hosts on one machine: a test bed for the store across hosts, built from Linux namespaces (root only).

Each *host* is a network namespace joined to the others by a veth link to a bridge (its own address in
``10.77.0.0/24``, reachable from the other hosts only: nothing in the machine's own namespace has an
address on that bridge), with its own pid and mount namespaces (``/proc`` shows only its processes,
and ``/tmp`` and ``/dev/shm`` are its own tmpfs), as two containers or pods on one node are. A Ray
node runs in each, started the way a user starts one on a cluster node: ``ray start --head`` on the
first, ``ray start --address=HEAD_IP:6379`` on the others, with one auth token shared by all (as
Ray's docs say to do across nodes). A process runs *on* a host with ``Host.popen`` / ``Host.run``
(its ``/tmp`` is the host's own: give it scripts from elsewhere, or ``-c``);
killing a host's first process (``Host.kill``) ends every process in it, as a lost machine does.

    from bench.testbed import Testbed

    with Testbed(hosts=2) as bed:                  # builds, starts Ray on each, tears down at exit
        bed.hosts[0].run(["python", "script.py"])  # a driver on the first host

    python -m bench.testbed up --hosts 2           # the same from a shell: prints each host's
    python -m bench.testbed exec h2 -- ray status  # address; `exec` runs a command on one
    python -m bench.testbed down

The veth default route gives Ray's address discovery (a UDP ``connect``, which sends nothing) the
host's own address; the machine forwards nothing (``ip_forward`` is left as it is, off here), so
traffic stays between the hosts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# The head's GCS checks each node every second and calls it dead after 3 failed checks in a row (Ray's
# defaults: every 3 s, 5 checks), so a lost host is known in about 3 s instead of 15; a slow host is not
# taken for a dead one sooner, as each check still waits Ray's own timeout (10 s) for its answer.
NODE_DEATH_ENV = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}
REPO = Path(__file__).resolve().parent.parent  # a driver on a host imports this checkout
SUBNET = "10.77.0"  # hosts are .1, .2, ...; a private range, used inside the test bed's namespaces only
RAY_PORT = 6379
STATE = Path(tempfile.gettempdir()) / "rlplane-testbed.json"  # what `python -m bench.testbed` built
# Variables of the calling process that must not reach a host: they name this namespace's Ray, its
# temp dir, its fork server, or pin Ray's node address to 127.0.0.1 (the test suite's loopback switch).
_LOCAL_VARS = ("RAY_ADDRESS", "RAY_TMPDIR", "RLT_ZYGOTE", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")

# A host's first process: mounts its own /tmp and /dev/shm, then reaps orphans until it is killed
# (its death ends every process of the host: the kernel kills a pid namespace with its init).
_INIT = (
    "import os, signal\n"
    "signal.signal(signal.SIGTERM, lambda *_: os._exit(0))\n"
    "print('up', flush=True)\n"
    "while True:\n"
    "    try:\n"
    "        os.wait()\n"
    "    except ChildProcessError:\n"
    "        signal.pause()\n"
)


class TestbedError(RuntimeError):
    """The test bed could not be built or used (not root, no ``ip``, a host that did not come up)."""


def missing() -> str | None:
    """Why a test bed cannot be built here (None when it can): tests skip with this reason."""
    if os.geteuid() != 0:
        return "building hosts from network namespaces needs root (CI runs as root)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"building hosts needs `{tool}` (iproute2 / util-linux)"
    return None


def _sh(*args: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise TestbedError(f"`{' '.join(args)}` failed: {done.stderr.strip()}")


@dataclass
class Host:
    """One host of the bed: its name (``h1``), address, network namespace and first process (as the
    machine's namespace sees its pid)."""

    name: str
    ip: str
    netns: str
    init_pid: int
    env: dict[str, str] = field(default_factory=dict)

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on this host (its network, pid and mount namespaces)."""
        return ["nsenter", "-t", str(self.init_pid), "-n", "-p", "-m", "--", *argv]

    def sees(self, path: str | Path) -> str:
        """Where this host sees ``path`` of this machine: the same path, but for one under ``/tmp``
        (the host's ``/tmp`` is its own), which is at the machine's ``/tmp`` set aside there.

        Example:
            >>> Host("h1", "10.77.0.2", "rlt-ab-h1", 1).sees("/tmp/run/out.json")
            '/run/rlt-ab-h1/run/out.json'
        """
        p = Path(path)
        return f"/run/{self.netns}/{p.relative_to('/tmp')}" if p.is_relative_to("/tmp") else str(p)

    def popen(self, argv: Sequence[str], env: dict[str, str] | None = None, **kw: object) -> subprocess.Popen:
        """Start ``argv`` on this host, with the host's environment (plus ``env``)."""
        return subprocess.Popen(self.command(argv), env={**self.env, **(env or {})}, **kw)  # type: ignore[call-overload]

    def drive(self, argv: Sequence[str], deadline_s: float, on_line: Callable[[str], None]) -> int:
        """Run ``python argv`` with this checkout's packages on this host (a benchmark's driver): each
        line it prints goes to ``on_line``; past ``deadline_s`` it is killed, with its process group
        (nsenter and the driver alike); returns its exit status."""
        # nsenter starts it at the host's / (entering a mount namespace moves the cwd): PYTHONPATH makes
        # it import this checkout's bench and dataplane whatever the cwd.
        path = os.pathsep.join(p for p in (str(REPO), self.env.get("PYTHONPATH", "")) if p)
        proc = self.popen(
            [sys.executable, *argv],
            env={"PYTHONUNBUFFERED": "1", "PYTHONPATH": path},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        timer = threading.Timer(deadline_s, lambda: os.killpg(proc.pid, signal.SIGKILL))
        timer.start()
        try:
            for line in proc.stdout or ():
                on_line(line)
            return proc.wait(timeout=60)  # (its output ended: it is exiting)
        finally:
            timer.cancel()

    def run(
        self, argv: Sequence[str], timeout: float = 300, env: dict[str, str] | None = None, check: bool = True
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` on this host and wait (``timeout`` seconds at most); its output captured."""
        done = subprocess.run(
            self.command(argv),
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and done.returncode != 0:
            said = f"{done.stdout[-2000:]}{done.stderr[-4000:]}"
            raise TestbedError(f"{' '.join(argv)} on {self.name} exited {done.returncode}:\n{said}")
        return done

    def alive(self) -> bool:
        try:
            os.kill(self.init_pid, 0)
        except ProcessLookupError:
            return False
        return True

    def kill(self, timeout_s: float = 30.0) -> None:
        """Lose this host: every process in it dies at once (SIGKILL to its pid namespace's init, which
        takes the namespace's other processes with it). Returns once none is left (the kernel kills
        them as the init exits, not when the signal is sent)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.init_pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        while subprocess.run(
            ["ip", "netns", "pids", self.netns], capture_output=True, text=True
        ).stdout.strip():
            if time.monotonic() > deadline:
                raise TestbedError(f"processes of host {self.name} outlived its init by {timeout_s}s")
            time.sleep(0.01)  # polling the kernel's view, bounded by the deadline above


class Testbed:
    """``hosts`` hosts joined by a bridge, a Ray node on each (``ray=False``: none). A context manager:
    built on entry, torn down on exit (every process of every host, the namespaces, the links)."""

    def __init__(self, hosts: int = 2, ray: bool = True, num_cpus: int = 4, tag: str | None = None) -> None:
        if not 1 <= hosts <= 8:
            raise ValueError(f"hosts must be 1..8, got {hosts}")
        self.n, self.ray, self.num_cpus = hosts, ray, num_cpus
        self.tag = tag or _free_tag()  # (4 hex digits: interface names stay under 15 characters)
        self.bridge = f"rlt{self.tag}br"
        self.hosts: list[Host] = []
        self._inits: list[subprocess.Popen] = []

    # ---- building ---------------------------------------------------------------------------------
    def __enter__(self) -> Testbed:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        why = missing()
        if why:
            raise TestbedError(why)
        try:
            _sh("ip", "link", "add", self.bridge, "type", "bridge")
            # No address at all on the machine's side, IPv6 link-local included: nothing of the
            # machine's own namespace can reach a host, nor a host it.
            _sh("ip", "link", "set", "dev", self.bridge, "addrgenmode", "none")
            _sh("ip", "link", "set", self.bridge, "up")
            env = {k: v for k, v in os.environ.items() if k not in _LOCAL_VARS}
            env.update(
                RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=os.urandom(32).hex(), RAY_USAGE_STATS_ENABLED="0"
            )
            env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
            for i in range(1, self.n + 1):
                self.hosts.append(self._host(i, env))
            if self.ray:
                self._start_ray()
        except BaseException:
            self.down()
            raise

    def _host(self, i: int, env: dict[str, str]) -> Host:
        name, ip = f"h{i}", f"{SUBNET}.{i}"
        netns, veth = f"rlt-{self.tag}-{name}", f"rlt{self.tag}{name}"
        _sh("ip", "netns", "add", netns)
        _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _sh("ip", "link", "set", "dev", veth, "addrgenmode", "none")
        _sh("ip", "link", "set", veth, "master", self.bridge, "up")
        _sh("ip", "-n", netns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _sh("ip", "-n", netns, "link", "set", "eth0", "up")
        _sh("ip", "-n", netns, "link", "set", "lo", "up")
        _sh("ip", "-n", netns, "route", "add", "default", "dev", "eth0")
        mounts = "mount -t tmpfs -o size=2g tmpfs /dev/shm && " + _private_tmp(f"/run/rlt-{self.tag}-{name}")
        init = subprocess.Popen(
            [
                "ip", "netns", "exec", netns,
                "unshare", "--pid", "--mount", "--fork", "--mount-proc", "--propagation", "private",
                "sh", "-c", f'{mounts} && exec "$0" -c "$1"', sys.executable, _INIT,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # (unshare's complaint when the host is killed)
            env=env,
        )  # fmt: skip
        self._inits.append(init)
        if init.stdout is None or init.stdout.readline().strip() != b"up":
            raise TestbedError(f"host {name} did not come up (its first process exited {init.poll()})")
        init.stdout.close()
        return Host(name, ip, netns, _ns_init_pid(netns), env)

    def _start_ray(self) -> None:
        common = [
            "--num-cpus",
            str(self.num_cpus),
            "--disable-usage-stats",
            "--object-store-memory",
            "300000000",
        ]
        head = self.hosts[0]
        head.run(
            ["ray", "start", "--head", f"--node-ip-address={head.ip}", f"--port={RAY_PORT}",
             "--include-dashboard=false", *common],
            env=NODE_DEATH_ENV,
        )  # fmt: skip
        for host in self.hosts[1:]:
            host.run(["ray", "start", f"--address={self.address}", f"--node-ip-address={host.ip}", *common])
        deadline = time.monotonic() + 120
        check = f"import ray; ray.init(address={self.address!r}); print(sum(n['Alive'] for n in ray.nodes()))"
        while True:
            done = head.run(["python", "-c", check], check=False, timeout=120)
            if done.returncode == 0 and done.stdout.strip().endswith(str(self.n)):
                return
            if time.monotonic() > deadline:
                raise TestbedError(
                    f"the Ray nodes did not all join within 120 s: {done.stdout}{done.stderr[-2000:]}"
                )

    @property
    def address(self) -> str:
        """The head's address, as ``ray start --address`` and ``ray.init(address=...)`` take it."""
        return f"{self.hosts[0].ip}:{RAY_PORT}"

    # ---- tearing down ---------------------------------------------------------------------------
    def down(self) -> None:
        for host in self.hosts:
            host.kill()
        for init in self._inits:
            with contextlib.suppress(subprocess.TimeoutExpired):
                init.wait(timeout=30)
        for host in self.hosts:
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)
        for host in self.hosts:
            with contextlib.suppress(OSError):
                os.rmdir(f"/run/rlt-{self.tag}-{host.name}")  # (where its /tmp view was set aside)
        self.hosts.clear()


def _private_tmp(aside: str) -> str:
    """Shell commands giving a host a ``/tmp`` of its own, in its mount namespace. What this process
    runs from (the repository, the virtual environment, the interpreter: a checkout under ``/tmp`` is
    common in CI) stays reachable: the machine's ``/tmp`` is bound at ``aside`` first, and each such
    path bound back at its own place."""
    import bench

    needed = {
        Path(bench.__file__).resolve().parents[1],
        Path(sys.prefix).resolve(),
        Path(sys.executable).resolve(),
    }
    needed |= {Path(sys.base_prefix).resolve()}
    under = sorted({p.parent if p.is_file() else p for p in needed if p.is_relative_to("/tmp")})
    steps = [f"mkdir -p {aside}", f"mount --bind /tmp {aside}", "mount -t tmpfs tmpfs /tmp"]
    for path in under:
        rel = path.relative_to("/tmp")
        steps += [
            f"mkdir -p {shlex.quote(str(path))}",
            f"mount --bind {aside}/{shlex.quote(str(rel))} {shlex.quote(str(path))}",
        ]
    return " && ".join(steps)


def _free_tag() -> str:
    """A tag no test bed on this machine uses. A bed left behind by a killed run (every one of its
    namespaces empty of processes for over a minute: a bed being built has its first process within a
    second, and one in use has at least one host alive) is removed first, its bridge with it."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    beds: dict[str, list[str]] = {}
    for name in netns:
        if name.startswith("rlt-") and name.count("-") == 2:
            beds.setdefault(name.split("-")[1], []).append(name)

    def stale(name: str) -> bool:
        try:
            age = time.time() - os.stat(f"/run/netns/{name}").st_mtime
        except OSError:
            return False
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
        return age > 60 and not pids.strip()

    for tag, names in beds.items():
        if all(stale(n) for n in names):
            for name in names:
                subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
            subprocess.run(["ip", "link", "del", f"rlt{tag}br"], capture_output=True, check=False)
    while (tag := os.urandom(2).hex()) in beds:
        pass
    return tag


def _ns_init_pid(netns: str, timeout_s: float = 30.0) -> int:
    """The machine-side pid of the first process of the pid namespace started in ``netns``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
                ns_pids = next((line.split()[1:] for line in f if line.startswith("NSpid:")), [])
                if ns_pids[-1:] == ["1"] and len(ns_pids) > 1:
                    return int(pid)
        time.sleep(0.05)
    raise TestbedError(f"no process of {netns} became its pid namespace's first process within {timeout_s}s")


# ---- the command line ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.testbed", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build the hosts and start Ray on each")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--no-ray", action="store_true")
    ex = sub.add_parser("exec", help="run a command on one host")
    ex.add_argument("host")
    ex.add_argument("argv", nargs=argparse.REMAINDER)
    sub.add_parser("down", help="tear the hosts down")
    args = parser.parse_args(argv)
    if args.cmd == "up":
        if STATE.exists():
            parser.error(f"a test bed is up already ({STATE}); `python -m bench.testbed down` first")
        bed = Testbed(args.hosts, ray=not args.no_ray)
        bed.up()
        for init in bed._inits:
            init.returncode = 0  # (its hosts outlive this command)
        state = {"tag": bed.tag, "hosts": [vars(h) for h in bed.hosts]}
        STATE.write_text(json.dumps(state))
        for host in bed.hosts:
            print(f"{host.name} {host.ip} (netns {host.netns})")
        if bed.ray:
            print(f"ray: {bed.address}")
        return 0
    if not STATE.exists():
        print("no test bed is up", file=sys.stderr)
        return 1
    state = json.loads(STATE.read_text())
    hosts = {h["name"]: Host(**h) for h in state["hosts"]}
    if args.cmd == "exec":
        argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if args.host not in hosts or not argv:
            parser.error(f"exec HOST -- COMMAND, HOST one of {sorted(hosts)}")
        return subprocess.run(hosts[args.host].command(argv), env=hosts[args.host].env).returncode
    bed = Testbed(len(hosts), tag=state["tag"])
    bed.hosts = list(hosts.values())
    bed.down()
    STATE.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
