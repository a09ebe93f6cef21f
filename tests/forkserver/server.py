"""A fork server for the test clusters' Ray workers: each worker is forked from a process that has
already imported Ray, torch, tensordict and the store's package, instead of being a new interpreter
that imports them again.

The suite starts some 300 Ray workers on 2 cores, and each new one spent most of its CPU importing:
Ray (half a CPU-second), then the module its actor class lives in (torch: 2, tensordict: 1.5-2.5
more). Ray's native library reads its settings and the worker's own (its job, its raylet: every
``RAY_*`` variable) from the environment when it loads, once, so the server at the socket (the root)
imports everything but Ray, and forks one Ray server per set of ``RAY_*`` variables that imports Ray
with them; it forks the workers that have those variables (``_Server``, ``ray_key``).

``tests/conftest.py`` starts this server once per test session, before the cluster, and each node's
worker start (``worker_start.py``) hands it the worker's command line, environment, working
directory and standard streams. The server (its Ray server) forks; the child runs Ray's own
``default_worker.py`` with them, as the exec would have, and exits as an interpreter does (non-daemon
threads joined, atexit functions run). The starter stays, as the process the raylet started, until the
worker exits, and exits with its status; if the starter dies first, the worker is killed (it would have
died with it). A worker whose interpreter settings differ from the server's (``PYTHON*`` or ``LD_*``
variables, e.g. a runtime env's ``PYTHONPATH``) is exec'd, as Ray does without the fork server.

Each server forks only from its main loop, on its one Python thread (what runs besides, numpy's and
pyarrow's idle native pools, is not copied; importing Ray starts no thread). After a fork the child
reseeds what an import seeded in the server (numpy's global generator; Python's ``random`` reseeds
itself), so no two workers draw the same numbers. They do share the server's hash seed
(``PYTHONHASHSEED`` is read once, at the interpreter's start).

Protocol, over a Unix stream socket: the starter sends 8 bytes (the JSON's length, big-endian) with its
stdin, stdout and stderr attached (SCM_RIGHTS), then the JSON ``{"argv", "env", "cwd", "ray"}``; the
server (whichever Ray server took the request) answers 4 bytes, the worker's pid (0: exec it yourself),
then 4 more when the worker is gone: its exit status as ``subprocess`` reports it (minus a signal's
number). ``argv`` is what would follow ``python``: a script, ``-c CODE`` or ``-m MODULE``, then the
arguments. ``ray`` is true for Ray's worker, which a Ray server forks. ``run_python`` uses the same
server for the tests' own subprocesses that join the session's cluster; the root forks those, so one
may set ``RAY_*`` variables before it imports Ray, as in a new interpreter.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator

try:  # run as a script (the fork server itself), this directory is first on sys.path
    from forkserver_client import ZYGOTE, recv_exactly, request, status
except ImportError:  # imported as tests.forkserver.server
    from tests.forkserver.forkserver_client import ZYGOTE, recv_exactly, request, status

# What the suite's actor classes import besides Ray (their modules are this repository's tests); what
# needs Ray (controlplane, most of dataplane) the Ray servers import.
PRELOAD = (
    "numpy",
    "pyarrow",
    "pyarrow.json",
    "torch",
    "tensordict",
    "zmq",
    "msgspec",
    "dataplane",
    "controlplane",
)


class _RayImport(BaseException):
    """Raised, in the server, by an import of Ray; not an ImportError, so no fallback catches it."""


class _NoRay:
    """A meta path finder that refuses ``ray``: Ray's native library reads its per-worker settings
    (the job's id, the raylet's pid) from the environment when it loads, so the root must not load
    it; its Ray servers do, each with the variables of the workers it forks."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise _RayImport(name)
        return None


def _ray_dependencies() -> list[str]:
    """The modules outside Ray that ``import ray`` loads (asked of a child interpreter, which then
    exits: this process must not load Ray)."""
    script = (
        "import sys; before = set(sys.modules); import ray; "
        "print(*sorted(m for m in set(sys.modules) - before if m.split('.')[0] != 'ray'))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    return out.stdout.split()


def _preload(modules: list[str] | None) -> list[str]:
    """Import what the workers would: Ray's dependencies, then ``PRELOAD`` and every module of
    ``dataplane`` (or only ``modules``); anything that fails is left to the workers. Returns the
    modules that need Ray, for the servers that load it (``_preload_ray``)."""
    import pkgutil

    need_ray: list[str] = []

    def attempt(name: str) -> None:
        try:
            importlib.import_module(name)
        except _RayImport:
            need_ray.append(name)
        except Exception:  # noqa: BLE001 - a worker imports it itself
            pass

    sys.meta_path.insert(0, _NoRay)
    try:
        names = modules if modules is not None else [*_ray_dependencies(), *PRELOAD]
        for name in filter(None, names):
            attempt(name)
        if "dataplane" in sys.modules:
            for info in pkgutil.walk_packages(sys.modules["dataplane"].__path__, "dataplane."):
                attempt(info.name)
    finally:
        sys.meta_path.remove(_NoRay)
    assert "ray" not in sys.modules and "ray._raylet" not in sys.modules, "the fork server loaded Ray"
    return need_ray


# What Ray's worker script (ray/_private/workers/default_worker.py) imports besides ``ray``, then
# what nearly every worker of the suite imported once running (pydantic, through Ray: 0.1 CPU-s).
RAY_PRELOAD = (
    "ray",
    "ray.actor",
    "ray._private.node",
    "ray._private.parameter",
    "ray._private.async_compat",
    "ray._private.ray_logging",
    "ray._private.runtime_env.setup_hook",
    "ray._common.usage.usage_lib",
    "ray._common.pydantic_compat",
    "ray._private.arrow_serialization",
)


def _preload_ray(modules: list[str]) -> None:
    """In a Ray server: import Ray (its native library reads this environment's ``RAY_*`` variables
    as it loads), what Ray's worker script imports, and ``modules``, which needed Ray."""
    for name in [*RAY_PRELOAD, *modules]:
        with contextlib.suppress(Exception):  # a worker imports it itself
            importlib.import_module(name)


def ray_key(env: dict[str, str]) -> str:
    """What a process forked from a server that has imported Ray inherits from that server's
    environment: every ``RAY_*`` variable, which Ray's native library reads once, as it loads (its
    settings, the worker's job, its raylet). Processes whose variables agree share a Ray server."""
    return json.dumps(sorted((k, v) for k, v in env.items() if k.startswith("RAY_")))


# Read at each breakpoint() call, not at the start: ray.init() sets it in a test process after the
# server has started, and run_python from that process would otherwise always exec.
_READ_LATER = {"PYTHONBREAKPOINT"}


def _startup_env(env) -> dict[str, str]:
    """The variables an interpreter reads only when it starts (or the loader, when it loads it)."""
    return {k: v for k, v in env.items() if k.startswith(("PYTHON", "LD_")) and k not in _READ_LATER}


def _main(argv: list[str]):
    """What ``python ARGV...`` runs (``-c CODE``, ``-m MODULE`` or a script, then its arguments), with
    ``sys.argv`` and ``sys.path[0]`` set as that interpreter sets them."""
    import runpy

    if argv[0] == "-c":
        import types

        sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        return lambda: exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    if argv[0] == "-m":
        sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
        return lambda: runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
    return lambda: runpy.run_path(argv[0], run_name="__main__")


def _run_worker(request: dict, fds: list[int]) -> int:
    """In the forked child: become the process the starter would have exec'd; returns its exit status."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    code = 0
    try:
        _main(request["argv"])()
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except BaseException:  # noqa: BLE001 - reported as the interpreter reports it, then status 1
        sys.excepthook(*sys.exc_info())
        code = 1
    # What the interpreter does at exit, in its order: wait for non-daemon threads, run the atexit
    # functions (Ray shuts its worker down in one). Not the server's own cleanup, which a return
    # through its frames would run.
    import atexit
    import threading

    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    return code


def _exit_status(code: object) -> int:
    """The status ``sys.exit(code)`` ends a process with."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


RAY_SERVERS = 4  # Ray servers kept; the least recently used one beyond them drains and exits
_REQUEST_MAX = 1 << 16  # a request handed to a Ray server: one message of at most this many bytes


def _read_request(conn: socket.socket) -> tuple[dict, list[int]] | None:
    """A starter's request from its new connection: the JSON and the streams attached; None (the
    connection closed) when it sends garbage or stops midway."""
    conn.settimeout(30)  # a starter stopped mid-request must not stall every other worker's start
    fds: list[int] = []
    try:
        head, fds, _flags, _addr = socket.recv_fds(conn, 8, 3)
        head += recv_exactly(conn, 8 - len(head))
        body = json.loads(recv_exactly(conn, struct.unpack(">Q", head)[0]))
    except (OSError, ValueError, ConnectionError):  # socket.timeout is an OSError
        for fd in fds:
            os.close(fd)
        conn.close()
        return None
    conn.settimeout(None)
    return body, fds


class _Server:
    """A fork server's state: where requests come from, and each running worker's starter connection.

    The server at the socket (the root) has not imported Ray. It hands each Ray worker's request to a
    Ray server, a child it forked that has set the requester's ``RAY_*`` variables and then imported
    Ray (``ray_key``: one per set of them, ``RAY_SERVERS`` kept), over a ``SOCK_SEQPACKET`` link: the
    request and, attached, the starter's connection and streams. The Ray server forks the worker and
    answers the starter itself, so the worker skips Ray's import (0.3 CPU-s of each, with what Ray
    imports once running). The tests' own processes (``run_python``), and a worker no Ray server could
    take, the root forks itself; they import Ray after the fork.
    """

    def __init__(self, source: socket.socket, need_ray: list[str] | None) -> None:
        self.source = source  # the root's listening socket, or a Ray server's link to the root
        self.need_ray = need_ray  # the root: what its Ray servers preload besides Ray; None in one
        self.wake_r, self.wake_w = os.pipe()
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self.wake_w)  # SIGCHLD wakes the loop
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        self.selector = selectors.DefaultSelector()
        handle = self.accept if need_ray is not None else self.take
        self.selector.register(source, selectors.EVENT_READ, handle)
        self.selector.register(self.wake_r, selectors.EVENT_READ, self.reap)
        self.starters: dict[int, socket.socket | None] = {}  # worker pid -> its starter (None: gone)
        self.ray_servers: dict[str, tuple[int, socket.socket]] = {}  # ray_key -> pid, link; oldest first
        self.draining = False  # a Ray server whose root closed the link: exits when its workers have

    def run(self) -> None:
        """Serve until SIGTERM (or, in a Ray server, until drained); what was imported before is frozen
        first, so the forked children touch fewer of the server's pages (copy-on-write)."""
        gc.collect()
        gc.freeze()
        try:
            while True:
                for key, _ in self.selector.select():
                    if key.fd in self.selector.get_map():  # not closed by an earlier event of the batch
                        key.data(key)
        finally:
            for pid in self.starters:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for pid, _link in self.ray_servers.values():  # each kills its workers as it exits
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)

    def accept(self, _key: selectors.SelectorKey) -> None:
        """The root: a starter connected."""
        conn, _addr = self.source.accept()
        got = _read_request(conn)
        if got is None:
            return
        request, fds = got
        try:
            if _startup_env(request["env"]) != _startup_env(os.environ):
                # What the interpreter read at its start (its path, hash seed, preloaded libraries)
                # differs: the starter execs a worker of its own (pid 0 tells it so).
                with contextlib.suppress(OSError):
                    conn.sendall(struct.pack(">i", 0))
                conn.close()
            elif request.get("ray") and self._hand_over(request, conn, fds):
                conn.close()  # the Ray server's now
            else:
                self._fork_worker(request, conn, fds)
        finally:  # the streams are the worker's or the Ray server's now (or nobody's)
            for fd in fds:
                os.close(fd)

    def take(self, _key: selectors.SelectorKey) -> None:
        """A Ray server: the root handed over a request (the starter's connection and streams attached),
        or closed the link (drain: exit once the workers are gone)."""
        try:
            body, fds, flags, _addr = socket.recv_fds(self.source, _REQUEST_MAX, 4)
        except OSError:
            body, fds, flags = b"", [], 0
        if not body:
            self.selector.unregister(self.source)
            self.draining = True
            self._exit_if_drained()
            return
        if len(fds) != 4 or flags & socket.MSG_TRUNC:
            for fd in fds:
                os.close(fd)
            return
        conn = socket.socket(fileno=fds[0])
        try:
            self._fork_worker(json.loads(body), conn, fds[1:])
        finally:
            for fd in fds[1:]:
                os.close(fd)

    def _hand_over(self, request: dict, conn: socket.socket, fds: list[int]) -> bool:
        """The root: pass the request to the Ray server of its ``RAY_*`` variables, started if need be;
        False if none can take it."""
        body = json.dumps(request).encode()
        if len(body) > _REQUEST_MAX:
            return False
        key = ray_key(request["env"])
        try:
            server = self.ray_servers.pop(key, None) or self._start_ray_server(request["env"], conn, fds)
        except OSError:  # no fork now (EAGAIN, ENOMEM): the root tries one of its own
            return False
        try:
            socket.send_fds(server[1], [body], [conn.fileno(), *fds])
        except OSError:  # it died: the next request for these variables starts another
            server[1].close()
            return False
        self.ray_servers[key] = server  # the most recently used, last
        while len(self.ray_servers) > RAY_SERVERS:
            _pid, link = self.ray_servers.pop(next(iter(self.ray_servers)))
            link.close()  # it drains: serves its running workers, then exits
        return True

    def _start_ray_server(
        self, env: dict[str, str], conn: socket.socket, fds: list[int]
    ) -> tuple[int, socket.socket]:
        """Fork a Ray server with ``env``; ``conn`` and ``fds``, the request being handed over, are
        closed in it (it receives them as they come over the link)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                self._close_in_child(ours, conn)
                for fd in fds:
                    os.close(fd)
                os.environ.clear()
                os.environ.update(env)
                _preload_ray(self.need_ray or [])
                _Server(theirs, None).run()
            except SystemExit as exc:
                code = _exit_status(exc.code)
            except BaseException:  # noqa: BLE001 - said, then status 1; the root forks the next workers
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        theirs.close()
        return pid, ours

    def _fork_worker(self, request: dict, conn: socket.socket, fds: list[int]) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._become_worker(request, fds, conn)  # never returns
        self.starters[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, self.starter_closed)
        with contextlib.suppress(OSError):  # a starter gone already is seen as its connection closing
            conn.sendall(struct.pack(">i", pid))

    def _close_in_child(self, *also: socket.socket) -> None:
        """In a forked child: drop the server's sockets and signal handlers."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self.selector.close()
        links = [link for _pid, link in self.ray_servers.values()]
        for sock in (self.source, *also, *self.starters.values(), *links):
            if sock is not None:
                sock.close()
        os.close(self.wake_r)
        os.close(self.wake_w)

    def _become_worker(self, request: dict, fds: list[int], conn: socket.socket) -> None:
        """In the forked child: drop the server's state, run the worker, exit."""
        code = 1
        try:
            self._close_in_child(conn)
            code = _run_worker(request, fds)
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)

    def reap(self, _key: selectors.SelectorKey) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wake_r, 4096):
                pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:  # no child left
                break
            if pid == 0:
                break
            for key, (server_pid, link) in list(self.ray_servers.items()):
                if server_pid == pid:  # a Ray server died: the next request starts another
                    del self.ray_servers[key]
                    link.close()
            conn = self.starters.pop(pid, None)
            if conn is not None:
                self.selector.unregister(conn)
                with contextlib.suppress(OSError):
                    conn.sendall(struct.pack(">i", os.waitstatus_to_exitcode(status)))
                conn.close()
        self._exit_if_drained()

    def _exit_if_drained(self) -> None:
        if self.draining and not self.starters:
            sys.exit(0)

    def starter_closed(self, key: selectors.SelectorKey) -> None:
        """A starter's connection is readable: it sent nothing after its request, so it has closed,
        i.e. died (killed by its raylet); its worker dies with it, as an exec'd one would have."""
        conn = key.fileobj
        pid = next(p for p, c in self.starters.items() if c is conn)
        self.selector.unregister(conn)
        conn.close()
        self.starters[pid] = None  # reaped, and forgotten, on its SIGCHLD
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def serve(path: str, modules: list[str] | None = None) -> None:
    # Ready once it listens, before it preloads (3-4 s): the session's cluster starts meanwhile, and
    # the first requests wait in the backlog until the loop accepts them.
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    print("ready", flush=True)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nobody reads the pipe any more: never fill it
    need_ray = _preload(modules)
    _Server(listener, need_ray).run()


def run_python(
    args: list[str], timeout: float, env: dict[str, str] | None = None, cwd: str | None = None
) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], capture_output=True, text=True, ...)`` for a test's
    process that joins the session's cluster: a new process all the same, forked by the session's
    server when there is one (it has imported torch and the store's package already), else started
    as usual. Raises ``subprocess.TimeoutExpired`` (the process killed) after ``timeout`` seconds."""
    proc = start_python(args, stdout=True, stderr=True, env=env, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # as subprocess.run: the process is killed, then the timeout raised
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


class Forked:
    """What :func:`start_python` returns when the server forked the process: the part of
    ``subprocess.Popen`` the tests use (``pid``, ``stdin`` / ``stdout`` / ``stderr`` when piped,
    ``poll``, ``wait``, ``communicate``, ``kill``, ``returncode``: negative for a signal, as Popen
    reports it)."""

    def __init__(self, command: list[str], conn: socket.socket, pid: int, stdin, stdout, stderr) -> None:
        self.args, self.pid = command, pid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None
        self._conn = conn

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self.returncode = status(self._conn)  # sent when the process is gone
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if timeout is not None and not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = status(self._conn)
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """What the piped stdout and stderr carried until every writer closed them, once the process
        is gone (no input is sent); ``subprocess.TimeoutExpired`` after ``timeout`` seconds, the process
        left running, as Popen's."""
        deadline = None if timeout is None else time.monotonic() + timeout
        got = _read_until_closed([self.stdout, self.stderr], deadline)
        if got is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        return got

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def start_python(
    args: list[str],
    stdin: bool = False,
    stdout: bool = False,
    stderr: bool = False,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> Forked | subprocess.Popen:
    """``subprocess.Popen([sys.executable, *args], text=True, ...)`` for a test's process that joins
    the session's cluster: forked by the session's server when there is one, else a real Popen.
    ``stdin`` / ``stdout`` / ``stderr``: text pipes (else this process's streams, as Popen inherits
    them)."""
    env = dict(os.environ if env is None else env)
    cwd = cwd or os.getcwd()
    command = [sys.executable, *args]
    path = os.environ.get(ZYGOTE)
    pipes = [os.pipe() if piped else None for piped in (stdin, stdout, stderr)]
    # The child reads its stdin's pipe and writes the others; an end left out is this process's stream.
    theirs = [(pipe[0] if fd == 0 else pipe[1]) if pipe else fd for fd, pipe in enumerate(pipes)]
    ours = [(pipe[1] if fd == 0 else pipe[0]) if pipe else None for fd, pipe in enumerate(pipes)]
    started = request(path, args, env, cwd, theirs) if path else None
    for fd, pipe in zip(theirs, pipes, strict=True):
        if pipe is not None:
            os.close(fd)
    if started is None:
        for fd in ours:
            if fd is not None:
                os.close(fd)
        modes = [subprocess.PIPE if piped else None for piped in (stdin, stdout, stderr)]
        return subprocess.Popen(
            command, text=True, env=env, cwd=cwd, stdin=modes[0], stdout=modes[1], stderr=modes[2]
        )
    conn, pid = started
    streams = [None if fd is None else os.fdopen(fd, "w" if i == 0 else "r") for i, fd in enumerate(ours)]
    return Forked(command, conn, pid, *streams)


def _read_until_closed(streams: list, deadline: float | None) -> tuple[str, str] | None:
    """Everything written to the pipes ``streams`` (stdout, stderr) until every writer closed them;
    None at ``deadline`` (the streams stay open: the caller closes them)."""
    chunks: dict[int, list[bytes]] = {stream.fileno(): [] for stream in streams}
    with selectors.DefaultSelector() as selector:
        for fd in chunks:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            for key, _ in selector.select(left):
                data = os.read(key.fd, 1 << 16)
                if data:
                    chunks[key.fd].append(data)
                else:
                    selector.unregister(key.fd)
    out, err = (b"".join(parts).decode(errors="replace") for parts in chunks.values())
    return out, err


@contextlib.contextmanager
def running(directory: str, modules: list[str] | None = None, timeout_s: float = 120.0) -> Iterator[str]:
    """Run a server for this session, its socket in ``directory``; yields the socket's path, which
    goes in ``RLT_ZYGOTE`` of the environment the cluster's nodes start with, as soon as the server
    listens (its preload goes on while the caller starts the cluster; requests wait for it). ``modules``:
    what it preloads instead of Ray's dependencies and ``PRELOAD``."""
    path = os.path.join(directory, "zygote.sock")
    command = [sys.executable, os.path.abspath(__file__), path]
    if modules is not None:
        command.append(",".join(modules))
    server = subprocess.Popen(command, stdout=subprocess.PIPE)
    try:
        ready, _, _ = select.select([server.stdout], [], [], timeout_s)
        line = server.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            raise RuntimeError(
                f"the workers' fork server did not start within {timeout_s}s (it said {line!r})"
            )
        yield path
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


if __name__ == "__main__":
    # Not this script's directory (tests/, whose packages would shadow the repository's) but the
    # worker script's, set in each child.
    sys.path[0] = ""
    serve(sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2 else None)
