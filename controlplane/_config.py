"""Configuration read from the environment, in one place.

Read at call time (not import time) so a test or a launcher can flip a switch per process.
"""

from __future__ import annotations

import os

AUTO_PADDING_ENV = "CONTROLPLANE_AUTO_PADDING"
# verl's switch (``DataProtoConfig.auto_padding`` reads it too), honoured so verl launch
# scripts that export it behave the same here.
VERL_AUTO_PADDING_ENV = "VERL_AUTO_PADDING"
FUTURE_TIMEOUT_ENV = "CONTROLPLANE_FUTURE_TIMEOUT_S"

# How long a worker (or the driver) waits for the parts of a BatchFuture before giving up.
DEFAULT_FUTURE_TIMEOUT_S = 600.0

# After one rank of a group call fails, how long the driver waits for the other ranks before it
# reports: ranks failing on the same bug finish within this, and all of them are named. A rank
# still running then (e.g. blocked in a collective with the failed one) is not waited for.
FAILURE_GRACE_S = 1.0


_TRUE = frozenset({"1", "true", "yes", "on"})
_AUTO_PADDING_SWITCHES = (AUTO_PADDING_ENV, VERL_AUTO_PADDING_ENV)


def auto_padding_enabled() -> bool:
    """True when ``CONTROLPLANE_AUTO_PADDING`` or ``VERL_AUTO_PADDING`` is ``1``/``true``/``yes``/``on``.

    Example:
        >>> os.environ["VERL_AUTO_PADDING"] = "1"
        >>> auto_padding_enabled()
        True
    """
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in _AUTO_PADDING_SWITCHES)


def future_timeout_s() -> float:
    """Deadline in seconds for resolving a ``BatchFuture`` (env ``CONTROLPLANE_FUTURE_TIMEOUT_S``)."""
    raw = os.environ.get(FUTURE_TIMEOUT_ENV)
    if not raw:
        return DEFAULT_FUTURE_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError as exc:
        raise ValueError(f"{FUTURE_TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from exc
    if value <= 0:
        raise ValueError(f"{FUTURE_TIMEOUT_ENV} must be positive, got {value}")
    return value
