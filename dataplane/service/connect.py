"""Connect this process to Ray: one meaning of ``address`` for ``dp.init`` and every ``rlplane`` command.

=============  ===================================================================================
``address``    meaning
=============  ===================================================================================
``None``       Ray's own choice, as ``ray.init()``: ``RAY_ADDRESS``, else the cluster ``ray start``
               last started on this machine, else a new local Ray (``dp.init`` only; the commands
               always name one of the three below)
``"local"``    a new Ray of this process's own, even when a cluster runs (``RAY_ADDRESS`` ignored)
``"auto"``     the running cluster: ``RAY_ADDRESS``, else the one ``ray start`` started on this
               machine; an error when there is none
``HOST:PORT``  the cluster whose head (its GCS) listens there
=============  ===================================================================================

An existing cluster is checked before Ray is asked to join it, because Ray retries a failed join
for about 20 s and writes a log line to stderr for every attempt. For ``HOST:PORT`` the check takes
a second: a TCP connect (nothing listens: ``ClusterConnectError``), then one question to the GCS
(a token refused: ``ClusterAuthError``). For ``auto`` Ray finds the address itself, so the join's
log lines are kept off the terminal instead, and the failure is classified from their text.

Token authentication (Ray 2.60, on by default): Ray presents this machine's token
(``~/.ray/auth_token``) to the cluster it finds by itself, never to an address it is given. A
``HOST:PORT`` (or ``RAY_ADDRESS``) naming the cluster ``ray start`` recorded on this machine, the one
``auto`` finds, gets the token too, once that cluster refused this process for want of one
(``token_for_this_machines_cluster``), so the ``dp.init(address="HOST:PORT")`` line ``rlplane store
start`` prints works as printed. Any other address gets a token only from ``RAY_AUTH_MODE=token``.

Runs in the driver (the ``rlplane`` command, or the user's process calling ``dp.init``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from dataplane.errors import ClusterAuthError, ClusterConnectError, InvalidArgumentError

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0  # a TCP connect to the head: a live head answers in milliseconds

# Ray's token authentication (Ray >= 2.52): where a process finds the token it presents.


def command(name: str) -> str:
    """How a shell calls this installation's command ``name`` (``rlplane``, ``ray``): the bare name when
    PATH finds this one, else its full path (a venv used without activating it), so that a line a
    message or the CLI prints works as printed.

    Example:
        >>> command("ray").endswith("ray")
        True
    """
    import shutil

    here = os.path.join(os.path.dirname(sys.executable), name)
    found = shutil.which(name)
    if found and os.path.realpath(found) == os.path.realpath(here):
        return name
    return here


def _token_help() -> str:
    return (
        "give this process the cluster's token: RAY_AUTH_TOKEN=<token>, or RAY_AUTH_TOKEN_PATH=<file> "
        f"(default file ~/.ray/auth_token), with RAY_AUTH_MODE=token; `{command('ray')} get-auth-token` on "
        "the head node prints the token"
    )


# Text Ray's GCS client writes (C++ log line, exception message) when the GCS refuses a token.
_REFUSED_MARKS = ("InvalidAuthToken", "Unauthenticated", "token is invalid or incorrect")
_NO_TOKEN_MARKS = ("no authentication token was found",)


def parse_address(address: str | None) -> tuple[str, int] | None:
    """``(host, port)`` for ``HOST:PORT``; ``None`` for ``None``, ``"local"`` and ``"auto"``.

    Raises:
        InvalidArgumentError: anything else (a ``ValueError``), naming the value and the forms that work.

    Example:
        >>> parse_address("10.0.0.5:6379"), parse_address("auto")
        (('10.0.0.5', 6379), None)
    """
    if address is None or address in ("local", "auto"):
        return None
    host, sep, port = str(address).rpartition(":")
    if sep and host and port.isdigit() and 0 < int(port) < 65536 and "/" not in host:
        return host.strip("[]"), int(port)
    raise InvalidArgumentError(
        "address",
        f"address {address!r} is not 'local' (a new Ray of this process's own), 'auto' (the running "
        "cluster) or HOST:PORT (the head of a cluster, e.g. 10.0.0.5:6379)",
    )


def classify_failure(text: str) -> str:
    """What a failed join says about itself: ``"refused"`` (the cluster refused this process's
    token), ``"no_token"`` (token authentication is on here but this process has no token) or
    ``"unreachable"`` (anything else).

    ``text`` is what Ray wrote while joining (stderr) plus the exception's message. Ray 2.60 logs
    ``Failed to get cluster ID from GCS server: Unauthenticated: RPC error: InvalidAuthToken:
    Authentication token is missing or incorrect`` once a second for a refused token, then raises
    ``ConnectionError: Failed to connect to Ray cluster at HOST:PORT``.

    Example:
        >>> classify_failure("Unauthenticated: RPC error: InvalidAuthToken: Authentication token is missing")
        'refused'
    """
    low = text.lower()
    if any(mark.lower() in low for mark in _NO_TOKEN_MARKS):
        return "no_token"
    if any(mark.lower() in low for mark in _REFUSED_MARKS):
        return "refused"
    return "unreachable"


def failure_error(address: str, kind: str, detail: str = "") -> ClusterConnectError:
    """The typed error for a failed join of kind ``kind`` (see ``classify_failure``), in one line.

    Example:
        >>> str(failure_error("10.0.0.5:6379", "unreachable", "connection refused"))[:59]
        'no Ray cluster answers at 10.0.0.5:6379 (connection refused'
    """
    why = f" ({detail})" if detail else ""
    where = f"at {address}"
    if address == "auto":  # Ray chose the cluster: say which one it tried, when it says
        env = os.environ.get("RAY_ADDRESS")
        where = f"found by address 'auto' (RAY_ADDRESS={env})" if env else "found by address 'auto'"
    if kind == "refused":
        mode = os.environ.get("RAY_AUTH_MODE", "")
        sent = (
            "this process presented a token the cluster does not accept"
            if mode.lower() == "token"
            else f"RAY_AUTH_MODE is {mode or 'unset'} here, so this process presented no token"
        )
        return ClusterAuthError(
            address,
            f"the Ray cluster {where} refused this process: it uses token authentication and {sent}"
            f"{why}; {_token_help()}",
        )
    if kind == "no_token":
        return ClusterAuthError(
            address, f"token authentication is on for this process but it has no token{why}; {_token_help()}"
        )
    hint = (
        f"start one with `{command('ray')} start --head`, or pass --address HOST:PORT of its head (the port "
        "`ray start` printed, 6379 by default)"
        if address == "auto"
        else "check the host and port (the head's GCS port, 6379 by default), or use the address 'local' "
        "for a new Ray on this machine"
    )
    what = "no running Ray cluster was found" if address == "auto" else f"no Ray cluster answers at {address}"
    return ClusterConnectError(address, f"{what}{why}; {hint}")


@contextlib.contextmanager
def captured_stderr() -> Iterator[list[str]]:
    """Route file descriptor 2 to a temporary file for the block; yields the list its lines land in.

    Ray's C++ client logs past ``sys.stderr`` straight to fd 2, so redirecting the Python object is
    not enough. Only for joining an existing cluster: a process started meanwhile (a new local Ray)
    would inherit the file as its stderr.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    lines: list[str] = []
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines.extend(tmp.read().decode(errors="replace").splitlines())


def _last_distinct(lines: list[str]) -> str:
    """The last Ray line worth quoting (the retries repeat it), without its log prefix."""
    for line in reversed(lines):
        text = line.split("] ", 1)[-1].split(" -- ", 1)[-1].strip()
        if text:
            return text[:300]
    return ""


def probe(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Check that a Ray head answers at ``HOST:PORT`` and accepts this process, in about a second.

    Raises:
        ClusterConnectError: nothing accepts a TCP connection there within ``timeout_s``.
        ClusterAuthError: the head refused this process's token.
    """
    host, port = parse_address(address) or ("", 0)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        raise failure_error(address, "unreachable", f"nothing accepts connections there: {exc}") from None
    try:  # Ray's own GCS client: one attempt, where ray.init would retry for 20 s
        # Ray's stub of _raylet (a compiled module) does not declare GcsClient.
        from ray._raylet import GcsClient  # type: ignore[attr-defined]
    except ImportError:  # a Ray without it: ray.init's own error, classified, will say
        return
    with captured_stderr() as lines:
        try:
            GcsClient(address=f"{host}:{port}")
        except Exception as exc:  # noqa: BLE001 - classified below; anything else is for ray.init
            kind = classify_failure(f"{type(exc).__name__}: {exc}\n" + "\n".join(lines))
            if kind != "unreachable":  # Ray's AuthenticationError appends a paragraph of help: drop it
                raise failure_error(address, kind, f"Ray: {getattr(exc, 'message', exc)}") from None


def recorded_here(address: str | None) -> bool:
    """Whether ``address`` (``HOST:PORT``) names the cluster ``ray start`` recorded on this machine, the
    one Ray's ``auto`` finds (``ray_current_cluster`` in Ray's temp dir).

    Example:
        >>> recorded_here("local")  # not an address
        False
    """
    try:
        wanted = parse_address(address)
    except ValueError:  # e.g. a ray:// client address in RAY_ADDRESS: Ray's own business
        return False
    if wanted is None:
        return False
    try:
        from ray._private.services import find_bootstrap_address
    except ImportError:
        return False
    try:
        recorded = parse_address(find_bootstrap_address(None) or "auto")
    except ValueError:
        return False
    return recorded is not None and recorded[1] == wanted[1] and _same_host(wanted[0], recorded[0])


def token_for_this_machines_cluster(address: str | None) -> bool:
    """Switch token mode on in this process, presenting this machine's Ray token, when ``address``
    names the cluster ``ray start`` recorded here (``recorded_here``) and nothing says otherwise
    (``RAY_AUTH_MODE`` unset, a token in ``~/.ray/auth_token`` or ``RAY_AUTH_TOKEN``); True if it did.

    Ray 2.60 gives its default token to the cluster it finds by itself (address ``auto`` or none)
    but never to an address it is given (an argument or ``RAY_ADDRESS``), so
    ``dp.init(address="HOST:PORT")`` of that very cluster was refused ("RAY_AUTH_MODE is unset here")
    while ``dp.init()`` worked. ``connect`` calls this only after the cluster refused this process for
    want of a token: named by its address, the recorded cluster is the one ``auto`` would trust. Any
    other address gets no token unless ``RAY_AUTH_MODE=token`` says so (a token sent to a host someone
    typed could leak).

    Example:
        >>> token_for_this_machines_cluster("local")  # not an address: nothing to do
        False
    """
    if os.environ.get("RAY_AUTH_MODE") is not None or not recorded_here(address):
        return False
    try:
        from ray._private.authentication import authentication_token_setup as tokens
    except ImportError:  # a Ray without token authentication
        return False
    ray_log = logging.getLogger(tokens.__name__)  # its notice that token mode is on: not for a user
    level = ray_log.level
    ray_log.setLevel(logging.ERROR)
    try:
        return bool(tokens.maybe_enable_token_auth_if_token_available(warn_if_disabled=False))
    finally:
        ray_log.setLevel(level)


def _probe_presenting_token(address: str) -> None:
    """``probe``; if the cluster refuses this process for want of a token and is the one ``ray start``
    recorded here, present this machine's token and probe again."""
    try:
        probe(address)
    except ClusterAuthError:
        if not token_for_this_machines_cluster(address):
            raise
        probe(address)


def _same_host(host: str, recorded: str) -> bool:
    """Whether ``host`` names ``recorded``, an address of this machine (where ``ray start`` ran)."""
    return host in (recorded, "localhost", "127.0.0.1", "::1") or _ip(host) == recorded


def check_joined(address: str | None) -> None:
    """With Ray already initialised here, an explicit ``HOST:PORT`` must name the cluster joined.

    Raises:
        InvalidArgumentError: it names another cluster (a ``ValueError``); says which one this
            process is in.
    """
    import ray

    wanted = parse_address(address)
    if wanted is None:  # None, "auto", "local": whatever this process joined will do
        return
    here = ray.get_runtime_context().gcs_address
    here_host, _, here_port = here.rpartition(":")
    host, port = wanted
    same_host = host in (here_host, "localhost", "127.0.0.1") or _ip(host) == here_host
    if here_port != str(port) or not same_host:
        raise InvalidArgumentError(
            "address",
            f"dp.init(address={address!r}): this process already joined the Ray cluster at {here}; "
            "call ray.shutdown() first to join another, or leave address out",
        )


def _ip(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def connect(address: str | None, **ray_options: Any) -> Any:
    """``ray.init`` for ``address`` with the meaning in the module docstring; returns Ray's context.

    ``ray_options`` go to ``ray.init`` (``namespace``, ``num_cpus``, ``logging_level``, ...).

    Raises:
        InvalidArgumentError: ``address`` has none of the forms above (a ``ValueError``).
        ClusterConnectError: no cluster answers at ``address`` (or none runs, for ``"auto"``).
        ClusterAuthError: the cluster refused this process's authentication token.

    Example:
        >>> connect("local", num_cpus=2, include_dashboard=False)  # doctest: +SKIP
    """
    import ray

    parse_address(address)  # the forms are checked before anything starts
    ray_options.setdefault("logging_level", logging.WARNING)
    given = os.environ.get("RAY_ADDRESS") if address in (None, "auto") else None
    if given and recorded_here(given):  # Ray joins it as an address it was given: it may want our token
        _probe_presenting_token(given)
    if address is None or address == "local":
        # Not captured: a new local Ray's processes would inherit the capture file as their stderr.
        try:
            return ray.init(address=address, **ray_options)
        except (ConnectionError, ray.exceptions.AuthenticationError) as exc:  # None may join RAY_ADDRESS
            text = f"{exc}\n{exc.__cause__ or ''}"
            detail = f"Ray: {getattr(exc, 'message', exc)}"
            raise failure_error(address or "auto", classify_failure(text), detail) from None
    if address != "auto":
        _probe_presenting_token(address)
    with captured_stderr() as lines:
        try:
            ctx = ray.init(address=address, **ray_options)
        except (ConnectionError, RuntimeError, ray.exceptions.RayError) as exc:
            failure = exc
        else:
            failure = None
    if failure is None:  # joined: what Ray said on the way (which cluster 'auto' chose, ...) is detail
        if lines:
            logger.debug("joined the Ray cluster at %s; Ray wrote:\n%s", address, "\n".join(lines))
        return ctx
    text = f"{failure}\n{failure.__cause__ or ''}\n" + "\n".join(lines)
    kind = classify_failure(text)
    detail = _last_distinct(lines) if kind != "unreachable" else str(failure)
    logger.debug("joining the Ray cluster at %s failed; Ray wrote:\n%s", address, "\n".join(lines))
    raise failure_error(address, kind, f"Ray: {detail}" if detail else "") from None


__all__ = [
    "PROBE_TIMEOUT_S",
    "captured_stderr",
    "check_joined",
    "classify_failure",
    "command",
    "connect",
    "failure_error",
    "parse_address",
    "probe",
    "recorded_here",
    "token_for_this_machines_cluster",
]
