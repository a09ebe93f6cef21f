"""The store's administration: start it as a service on a Ray cluster, show it, stop it.

This is what ``rlplane store start|status|stop`` runs (the command line itself is ``rlplane.cli``;
this module runs in that command's process, a driver of the cluster).

``--address`` means what it means everywhere (``dataplane.service.connect``): ``auto`` (the default) the
running cluster, ``HOST:PORT`` the cluster whose head listens there, and ``local`` a new Ray of this
machine's own. For ``store start`` that new Ray is a head started with ``ray start`` in the background,
so it outlives the command like the store's detached actors do (``ray stop`` stops it); ``status``
and ``stop`` refuse ``local``, as a new Ray holds no store.

What the commands print:

- ``start``: what runs (shards, nodes, capacity) and the line that attaches to it
  (``dp.init(address="HOST:PORT")``). A store already running with the options asked for is not an
  error; one running with other options is (exit 1), and the message names each option that differs.
- ``status``: a table, one row per shard (node, bytes used and held, capacity, partitions, rows,
  clients), below a one-line summary; ``--json`` prints ``dp.stats()`` plus ``address`` and each
  shard's ``clients`` instead, with bytes as integers. ``--watch [--interval S] [--count N]`` keeps
  a live view of shards, partitions and consumer tasks on the screen (``dataplane.watch``; with
  ``--json``, one JSON line per refresh).
- ``stop``: whether a store was stopped.

Exit status: 0 done, 1 the store or the cluster refused (the printed line says why), 2 a bad argument
(and 141 from ``rlplane.cli`` when what reads the output went away: the work is done all the same).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from dataplane._units import format_bytes
from dataplane.config import NAMESPACE, StoreConfig
from dataplane.errors import ClusterConnectError, DataplaneError
from dataplane.service import connect as _connect

logger = logging.getLogger(__name__)

_RAY_START_TIMEOUT_S = 120.0  # `ray start --head` on a loaded 2-core machine takes ~15 s
_CLIENTS_TIMEOUT_S = 10.0
_MAX_PARTITIONS_LISTED = 12


def _say(text: str) -> None:
    """CLI output (the one place this package writes to stdout)."""
    sys.stdout.write(text + "\n")


# ---- joining Ray ----------------------------------------------------------------------------------


def _start_head() -> str:
    """Start a Ray head on this machine in the background (``ray start``); returns a line saying so.

    Raises:
        ClusterConnectError: ``ray start`` failed (a Ray head may already run here), with its last line.
    """
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    cmd = [ray_bin, "start", "--head", "--include-dashboard=false", "--disable-usage-stats"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_RAY_START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ClusterConnectError(
            "local", f"`ray start --head` did not finish within {_RAY_START_TIMEOUT_S:.0f}s"
        ) from None
    if proc.returncode != 0:  # its error is the last line of stderr (after a traceback), else of stdout
        said = [line.strip() for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
        why = re.sub(r"\x1b\[[0-9;]*m", "", said[-1]) if said else f"exit status {proc.returncode}"
        raise ClusterConnectError(
            "local",
            f"`ray start --head` failed ({why}); if a Ray cluster already runs on this machine, start the "
            "store on it with --address auto",
        )
    return f"started a new Ray head on this machine for the store (`{_connect.command('ray')} stop` stops it)"


def _join(address: str, action: str) -> None:
    """Join the cluster ``address`` names (see the module docstring)."""
    _connect.parse_address(address)  # a malformed address is refused before anything starts
    if address == "local":
        if action != "start":
            raise ValueError(
                f"`rlplane store {action}` needs the cluster the store runs on: --address auto (the running "
                "cluster) or HOST:PORT; --address local would start a new Ray, which holds no store"
            )
        _say(_start_head())
        # The head just started is the one `ray start` recorded for this machine: let Ray find it
        # there, and not at a RAY_ADDRESS meant for another cluster ("local" ignores RAY_ADDRESS).
        os.environ.pop("RAY_ADDRESS", None)
        address = "auto"
    _connect.connect(address, namespace=NAMESPACE, log_to_driver=False)


def _cluster_address() -> str:
    import ray

    address: str = ray.get_runtime_context().gcs_address
    return address


# ---- what the commands print ----------------------------------------------------------------------


def _host(endpoint: str) -> str:
    """``10.0.0.5`` from ``tcp://10.0.0.5:4242``."""
    return endpoint.rsplit("//", 1)[-1].rsplit(":", 1)[0]


def node_label(host: str, node_id: str) -> str:
    """A shard's node as a person reads it: its IP and the start of its Ray node id.

    Example:
        >>> node_label("10.0.0.5", "3f2a9c1e55aa")
        '10.0.0.5 (3f2a9c1e)'
    """
    return f"{host} ({node_id[:8]})" if node_id else host


def describe(registry: dict[str, Any]) -> str:
    """One line: what the running store is (shards, nodes, capacity, encryption).

    Example:
        >>> reg = {"config": {"name": "dataplane", "capacity_bytes": 1 << 30, "encrypt": False},
        ...        "shards": [{"tcp": "tcp://10.0.0.5:1", "node_id": "ab12cd34ef"}] * 2}
        >>> print(describe(reg))
        store 'dataplane': 2 shards on 1 node (10.0.0.5), capacity 1.00 GiB (512.0 MiB per shard), unencrypted
    """
    cfg, shards = registry["config"], registry["shards"]
    hosts = sorted({_host(s["tcp"]) for s in shards})
    nodes = sorted({s["node_id"] for s in shards})
    capacity = cfg.get("capacity_bytes")
    per_shard = ""
    if capacity and len(shards) > 1:
        per_shard = f" ({format_bytes(capacity // len(shards))} per shard)"
    node_word = "node" if len(nodes) == 1 else "nodes"
    shard_word = "shard" if len(shards) == 1 else "shards"
    crypto = "encrypted" if cfg.get("encrypt") else "unencrypted"
    where = f"{len(shards)} {shard_word} on {len(nodes)} {node_word} ({', '.join(hosts)})"
    return f"store {cfg['name']!r}: {where}, capacity {format_bytes(capacity)}{per_shard}, {crypto}"


def attach_lines(
    address: str,
    token_auth: bool = False,
    rlplane: str = "rlplane",
    ray_command: str = "ray",
    name: str = StoreConfig.name,
) -> list[str]:
    """How another process attaches to the store of the cluster at ``address``; each line works as
    printed, in a fresh shell on this machine (``tests/workers/test_printed_steps.py`` runs them).

    With Ray's token authentication on (``token_auth``), a process on this machine presents the
    machine's token to this cluster by itself (``dataplane.service.connect``); one on another machine
    needs the token, which ``ray get-auth-token`` prints here. ``rlplane`` and ``ray_command`` are
    how to call the two commands (``command``); ``name`` the store's, named in both lines unless it
    is the default one.

    Example:
        >>> attach_lines("10.0.0.5:6379")[0]
        'attach from Python: dp.init(address="10.0.0.5:6379")   (import dataplane as dp)'
        >>> print(attach_lines("10.0.0.5:6379", token_auth=True)[-1])
        from another machine (Ray's token authentication is on): run `ray get-auth-token` here, and
        there `export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=<what it printed>` before the lines above
    """
    named = "" if name == StoreConfig.name else f", name={name!r}"
    lines = [
        f'attach from Python: dp.init(address="{address}"{named})   (import dataplane as dp)',
        f"see it:             {rlplane} store status --address {address}{_name_flag(name)}",
    ]
    if token_auth:
        lines.append(
            f"from another machine (Ray's token authentication is on): run `{ray_command} get-auth-token` "
            "here, and\nthere `export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=<what it printed>` before the lines "
            "above"
        )
    return lines


def _name_flag(name: str) -> str:
    """`` --name NAME`` for a store that is not the default one (what the commands must be told)."""
    return "" if name == StoreConfig.name else f" --name {shlex.quote(name)}"


def _attach_lines(address: str, name: str) -> list[str]:
    """``attach_lines`` for the cluster this process joined."""
    try:
        # Ray's stub of _raylet (a compiled module) does not declare these names.
        from ray._raylet import AuthenticationMode, get_authentication_mode  # type: ignore[attr-defined]

        token_auth = get_authentication_mode() == AuthenticationMode.TOKEN
    except ImportError:  # a Ray without token authentication
        token_auth = False
    return attach_lines(address, token_auth, _connect.command("rlplane"), _connect.command("ray"), name)


def option_differences(registry: dict[str, Any], asked: dict[str, Any]) -> list[str]:
    """The options of ``asked`` (given on the command line; ``None`` = not given) that the running
    store (``registry``) does not have, each as ``name running (asked value)``.

    Example:
        >>> reg = {"config": {"capacity_bytes": None, "encrypt": False}, "shards": [{}, {}]}
        >>> option_differences(reg, {"shards": 1, "capacity": 1 << 30, "encrypt": None})
        ['--shards 2 (asked 1)', '--capacity unlimited (asked 1.00 GiB)']
    """
    cfg = registry["config"]
    running = {
        "shards": len(registry["shards"]),
        "capacity": cfg.get("capacity_bytes"),
        "encrypt": bool(cfg.get("encrypt")),
    }
    shown: dict[str, Callable[[Any], str]] = {
        "capacity": format_bytes,
        "encrypt": lambda v: "on" if v else "off",
        "shards": str,
    }
    out = []
    for name in ("shards", "capacity", "encrypt"):
        want = asked.get(name)
        if want is not None and want != running[name]:
            out.append(f"--{name} {shown[name](running[name])} (asked {shown[name](want)})")
    return out


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(f"{v:<{w}}" for v, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]]


def format_status(stats: dict[str, Any], clients: list[int | None], address: str) -> str:
    """``rlplane store status`` for people: a summary line, a row per shard, the partitions.

    ``stats`` is ``dp.stats()`` (with each shard's ``host``); ``clients[i]`` the open connections
    to shard ``i`` other than this command's (``None``: the shard did not say).

    Example:
        >>> shard = {"shard": 0, "host": "10.0.0.5", "node_id": "ab12cd34ef", "bytes_used": 3 << 20,
        ...          "bytes_resident": 4 << 20, "capacity_bytes": None, "partitions": {"step0": 4}}
        >>> text = format_status({"name": "dataplane", "shards": [shard], "partitions": {"step0": 4},
        ...                       "bytes_used": 3 << 20}, [1], "10.0.0.5:6379")
        >>> print(text.splitlines()[2])
        0      10.0.0.5 (ab12cd34)  3.0 MiB  4.0 MiB    unlimited  1           4     1
    """
    shards = stats["shards"]
    nodes = {s["node_id"] for s in shards}
    caps = [s.get("capacity_bytes") for s in shards]
    total_cap = None if any(c is None for c in caps) else sum(caps)
    partitions = stats.get("partitions", {})
    lines = [
        f"store {stats['name']!r} on the Ray cluster at {address} (namespace {NAMESPACE!r}): {len(shards)} "
        f"shard(s) on {len(nodes)} node(s), {format_bytes(stats['bytes_used'])} used of "
        f"{format_bytes(total_cap)}, {len(partitions)} partition(s), {sum(partitions.values())} key(s)"
    ]
    header = ["shard", "node", "used", "in memory", "capacity", "partitions", "rows", "clients"]
    rows: list[list[str]] = []
    for s, n_clients in zip(shards, clients, strict=True):
        rows.append(
            [
                str(s.get("shard", len(rows))),
                node_label(s.get("host", "?"), s.get("node_id", "")),
                format_bytes(s["bytes_used"]),
                format_bytes(s.get("bytes_resident", s["bytes_used"])),
                format_bytes(s.get("capacity_bytes")),
                str(len(s.get("partitions", {}))),
                str(sum(s.get("partitions", {}).values())),
                "?" if n_clients is None else str(n_clients),
            ]
        )
    lines += _table(header, rows)
    if partitions:
        listed = sorted(partitions.items())
        shown = ", ".join(f"{pid} ({keys} keys)" for pid, keys in listed[:_MAX_PARTITIONS_LISTED])
        more = len(listed) - _MAX_PARTITIONS_LISTED
        lines.append(f"partitions: {shown}" + (f", and {more} more" if more > 0 else ""))
    lines.append(
        "used: bytes of live rows; in memory: what the shard holds, freed memory kept for reuse included; "
        "clients: open connections, this command's not counted"
    )
    return "\n".join(lines)


# ---- the commands ---------------------------------------------------------------------------------


def _config(args: argparse.Namespace) -> StoreConfig:
    return StoreConfig.from_options(
        name=getattr(args, "name", None) or StoreConfig.name,
        num_shards=getattr(args, "shards", None),
        capacity_bytes=getattr(args, "capacity", None),
        encrypt=bool(getattr(args, "encrypt", False)),
        detached=True,
    )


def _start(args: argparse.Namespace, cfg: StoreConfig, address: str) -> int:
    from dataplane.service.launch import find_service, start_service

    found = find_service(cfg)
    if found is not None:
        registry = found[0]
        asked = {"shards": args.shards, "capacity": args.capacity, "encrypt": args.encrypt or None}
        differ = option_differences(registry, asked)
        rlplane = _connect.command("rlplane")
        if differ:
            _say(
                f"rlplane store start: store {cfg.name!r} is already running, with other options than "
                f"asked: {'; '.join(differ)}. Stop it first (`{rlplane} store stop --address {address}"
                f"{_name_flag(cfg.name)}`) to "
                "start it with these, or use it as it is:"
            )
            _say("\n".join([describe(registry), *_attach_lines(address, cfg.name)]))
            return 1
        _say(f"already running, with the options asked for (not started again): {describe(registry)}")
        _say("\n".join(_attach_lines(address, cfg.name)))
        return 0
    registry, _ = start_service(cfg)
    _say(f"started {describe(registry)}, in Ray namespace {NAMESPACE!r}")
    _say("\n".join(_attach_lines(address, cfg.name)))
    return 0


def _clients(names: list[str]) -> list[int | None]:
    """Each shard's open connections, less this command's own one (``None``: no answer in time)."""
    import ray

    refs: list[Any] = []
    for name in names:
        try:
            refs.append(ray.get_actor(name, namespace=NAMESPACE).clients.remote())
        except (ValueError, AttributeError) as exc:  # gone, or a shard of an older rlplane
            logger.debug("shard %s cannot report its clients: %s", name, exc)
            refs.append(None)
    out: list[int | None] = []
    for ref in refs:
        try:
            out.append(None if ref is None else max(0, ray.get(ref, timeout=_CLIENTS_TIMEOUT_S) - 1))
        except ray.exceptions.RayError as exc:  # a dead or stuck shard: the table says "?"
            logger.debug("a shard did not report its clients: %s", exc)
            out.append(None)
    return out


def _status(args: argparse.Namespace, cfg: StoreConfig, address: str) -> int:
    # A client of its own rather than dp.init(): init loads torch and tensordict ahead of the first
    # get, seconds of imports that a status line never needs.
    from dataplane import api
    from dataplane.client import ops as _ops
    from dataplane.client.handle import StoreClient
    from dataplane.service.launch import find_service

    interval = getattr(args, "interval", 1.0)
    if not 0.1 <= interval <= 3600:
        _say(f"rlplane store status: --interval {interval:g} is not a number of seconds in [0.1, 3600]")
        return 2
    found = find_service(cfg)
    if found is None:
        _say(
            f"rlplane store status: no store {cfg.name!r} runs in Ray namespace {NAMESPACE!r} (Ray cluster "
            f"at {address}); start one with `{_connect.command('rlplane')} store start --address {address}"
            f"{_name_flag(cfg.name)}`"
        )
        return 1
    from dataplane.service.liveness import ray_says_dead

    client = StoreClient(found[0], remote_dead=ray_says_dead)
    if getattr(args, "watch", False):
        from dataplane import watch

        try:
            nodes = [node_label(_host(s["tcp"]), s["node_id"]) for s in client.registry["shards"]]
            return watch.run(client, nodes, address, interval, as_lines=args.json, count=args.count)
        finally:
            client.close()
    try:
        shards, index = client.run(_ops.stats(client.route))
        stats = api.stats_dict(client, shards, index)
        clients = _clients([s["name"] for s in stats["shards"]])
    finally:
        client.close()
    if args.json:
        out = {**stats, "address": address}
        for shard, n in zip(out["shards"], clients, strict=True):
            shard["clients"] = n
        _say(json.dumps(out, indent=2, default=str))
    else:
        _say(format_status(stats, clients, address))
    return 0


def cli(args: argparse.Namespace) -> int:
    """Run ``rlplane store start|status|stop`` (parsed by ``rlplane.cli``); returns the exit status."""
    import ray

    action = args.store_action
    address = getattr(args, "address", None) or "auto"
    try:
        _join(address, action)
    except ValueError as exc:
        _say(f"rlplane store {action}: {exc}")
        return 2
    except ClusterConnectError as exc:
        _say(f"rlplane store {action}: {exc}")
        return 1
    try:
        cfg = _config(args)
        address = _cluster_address()  # what another process attaches to, even when found by 'auto'
        if action == "start":
            return _start(args, cfg, address)
        if action == "status":
            return _status(args, cfg, address)
        if action == "stop":
            from dataplane.service.launch import stop_named

            stopped = stop_named(cfg)
            _say(f"stopped store {cfg.name!r}" if stopped else f"no store {cfg.name!r} ran at {address}")
            return 0
    except DataplaneError as exc:
        _say(f"rlplane store {action}: {exc}")
        return 1
    finally:
        ray.shutdown()
    return 2


__all__ = ["attach_lines", "cli", "describe", "format_status", "node_label", "option_differences"]
