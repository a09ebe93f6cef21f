"""Byte sizes as people write and read them: ``parse_size("1.5G")`` and ``format_bytes(3 << 30)``.

One rule both ways: a unit is a power of 1024, whatever its spelling. ``K``, ``KB``, ``KiB`` (any
case) all mean 1024 bytes, ``M``/``MB``/``MiB`` 1024**2, ``G``/``GB``/``GiB`` 1024**3, ``T``/``TB``/
``TiB`` 1024**4 (as Docker and the JVM read ``512m``; a capacity given as ``2GB`` is 2 GiB, about 7%
more than 2 * 10**9). Output always uses the binary names (``MiB``, ``GiB``).
"""

from __future__ import annotations

import re

_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes in ``text``: a whole number of bytes, or a number with a unit (``512M``, ``1.5GiB``).

    Raises:
        ValueError: ``text`` is not a size, or is not a whole positive number of bytes; the message
            quotes it and shows the forms that work.

    Example:
        >>> parse_size("1G"), parse_size("512MiB"), parse_size("2gb"), parse_size("4096")
        (1073741824, 536870912, 2147483648, 4096)
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _SIZE.match(str(text))
        if match is None or (match.group(3) and match.group(3).lower() == "ib" and not match.group(2)):
            raise ValueError(
                f"invalid size {text!r}: write bytes (1048576) or a number with a unit K, M, G or T "
                "(powers of 1024; KB, KiB, ... mean the same), e.g. 512M, 1.5G, 2GiB"
            )
        number, unit = match.group(1), match.group(2).lower()
        value = float(number) * 1024 ** _UNITS[unit]
        if value != int(value):
            raise ValueError(f"invalid size {text!r}: {value} is not a whole number of bytes")
        value = int(value)
    if value <= 0:
        raise ValueError(f"invalid size {text!r}: a size must be more than 0 bytes")
    return value


def format_bytes(n: int | float | None, unlimited: str = "unlimited") -> str:
    """``n`` bytes for a person: ``512 B``, ``1.5 KiB``, ``12.0 MiB``, ``3.00 GiB``; ``None``: ``unlimited``.

    Example:
        >>> format_bytes(512), format_bytes(3 << 20), format_bytes(3 << 30), format_bytes(None)
        ('512 B', '3.0 MiB', '3.00 GiB', 'unlimited')
    """
    if n is None:
        return unlimited
    if abs(n) < 1024:
        return f"{int(n)} B"
    for power, name in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if abs(n) >= 1024**power:
            digits = 2 if power >= 3 else 1  # a GiB figure: two decimals still mean ~10 MiB
            return f"{n / 1024**power:.{digits}f} {name}"
    raise AssertionError("unreachable")  # pragma: no cover


def exact_bytes(n: int) -> str:
    """``n`` bytes for a message: a person's unit with the exact count after (``64.0 MiB (67108864
    bytes)``), or just ``132 B`` below 1 KiB, where the two are one.

    Example:
        >>> exact_bytes(132), exact_bytes(64 << 20)
        ('132 B', '64.0 MiB (67108864 bytes)')
    """
    return format_bytes(n) if abs(n) < 1024 else f"{format_bytes(n)} ({int(n)} bytes)"


__all__ = ["exact_bytes", "format_bytes", "parse_size"]
