"""Every environment variable controlplane reads, parsed here and nowhere else.

=========================================  ==========================================================
variable                                   meaning (reader)
=========================================  ==========================================================
``CONTROLPLANE_AUTO_PADDING``              flag: pad a batch whose size does not divide the ranks
                                           (the PROTO dispatch modes, ``batch.auto_padding_requested``)
``VERL_AUTO_PADDING``                      flag: verl's name for the same switch, honoured so verl
                                           launch scripts that export it behave the same here
``CONTROLPLANE_FUTURE_TIMEOUT_S``          seconds a ``BatchFuture`` waits for its parts (default
                                           600; ``BatchFuture.get`` without ``timeout``)
``WORLD_SIZE``, ``RANK``,                  a worker's place in its group, set per rank by the group
``LOCAL_WORLD_SIZE``, ``LOCAL_RANK``,      (``controlplane._actor_launch``); a worker outside a group
``MASTER_ADDR``, ``MASTER_PORT``           is rank 0 of 1 (``Worker.__init__``, :func:`rank_info`)
``CUDA_VISIBLE_DEVICES``,                  the devices Ray lets an actor see (``_devices``:
``ASCEND_RT_VISIBLE_DEVICES``              ``LOCAL_RANK`` of a worker with an accelerator)
=========================================  ==========================================================

A flag is true for ``1``/``true``/``yes``/``on`` and false for ``0``/``false``/``no``/``off``, unset
or empty (any case, surrounding spaces ignored); any other value is an error that names the
variable, rather than a silent "off". Values are read at call time, not import time, so a test or
a launcher can change them per process. Every reader takes an optional ``environ`` mapping (default
``os.environ``).

Example:
    >>> auto_padding_enabled({"VERL_AUTO_PADDING": "TRUE"})
    True
    >>> env_flag("CONTROLPLANE_AUTO_PADDING", {"CONTROLPLANE_AUTO_PADDING": "off"})
    False
    >>> rank_info({"WORLD_SIZE": "4", "RANK": "2"})[:2]
    (4, 2)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

AUTO_PADDING_ENV = "CONTROLPLANE_AUTO_PADDING"
VERL_AUTO_PADDING_ENV = "VERL_AUTO_PADDING"
FUTURE_TIMEOUT_ENV = "CONTROLPLANE_FUTURE_TIMEOUT_S"
# What a group tells each rank about itself (the group also sets these names: _actor_launch).
RANK_ENV_KEYS = ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

DEFAULT_FUTURE_TIMEOUT_S = 600.0

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def env_text(name: str, environ: Mapping[str, str] | None = None, default: str | None = None) -> str | None:
    """The raw value of ``name``, or ``default`` when it is unset.

    Example:
        >>> env_text("MASTER_ADDR", {}, default="not set")
        'not set'
    """
    return _env(environ).get(name, default)


def env_flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """The flag ``name`` (see the module docstring for the values it accepts).

    Raises:
        ValueError: a value that is neither a true nor a false spelling (named, with the choices).
    """
    raw = _env(environ).get(name, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a flag; use one of {sorted(_TRUE)} or {sorted(_FALSE - {''})}")


def env_int(name: str, default: int, environ: Mapping[str, str] | None = None) -> int:
    """The integer ``name``, or ``default`` when it is unset or empty.

    Raises:
        ValueError: a value that is not an integer (named).
    """
    raw = _env(environ).get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={raw!r} is not an int") from exc


def auto_padding_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``CONTROLPLANE_AUTO_PADDING`` or ``VERL_AUTO_PADDING`` is set to a true value."""
    return env_flag(AUTO_PADDING_ENV, environ) or env_flag(VERL_AUTO_PADDING_ENV, environ)


def future_timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """Deadline in seconds for resolving a ``BatchFuture`` (``CONTROLPLANE_FUTURE_TIMEOUT_S``, default 600).

    Raises:
        ValueError: a value that is not a positive number.
    """
    raw = _env(environ).get(FUTURE_TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_FUTURE_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError as exc:
        raise ValueError(f"{FUTURE_TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from exc
    if not value > 0:  # also refuses nan
        raise ValueError(f"{FUTURE_TIMEOUT_ENV} must be positive, got {value}")
    return value


class RankInfo(NamedTuple):
    """A worker's place in its group, as the group's environment states it."""

    world_size: int
    rank: int
    local_world_size: int
    local_rank: int
    master_addr: str | None
    master_port: str | None


def rank_info(environ: Mapping[str, str] | None = None) -> RankInfo:
    """The rank variables (``RANK_ENV_KEYS``); unset ones default to rank 0 of a group of 1.

    Raises:
        ValueError: a non-integer count, or ``RANK`` outside ``[0, WORLD_SIZE)``.
    """
    info = RankInfo(
        world_size=env_int("WORLD_SIZE", 1, environ),
        rank=env_int("RANK", 0, environ),
        local_world_size=env_int("LOCAL_WORLD_SIZE", 1, environ),
        local_rank=env_int("LOCAL_RANK", 0, environ),
        master_addr=env_text("MASTER_ADDR", environ),
        master_port=env_text("MASTER_PORT", environ),
    )
    if not 0 <= info.rank < info.world_size:
        raise ValueError(f"RANK={info.rank} is outside WORLD_SIZE={info.world_size}")
    return info
