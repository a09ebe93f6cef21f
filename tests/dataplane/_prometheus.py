"""Read Prometheus' text exposition format (what a Ray metrics agent serves at /metrics): enough of
it for the metric tests to sum series by name and labels."""

from __future__ import annotations

import re
import urllib.request

_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')

Series = tuple[str, dict[str, str], float]


def parse(text: str) -> list[Series]:
    """Every sample of the exposition ``text``: ``(name, labels, value)``; comments are skipped."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            raise ValueError(f"not a Prometheus sample line: {line!r}")
        name, labels, value = match.groups()
        pairs = {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL.findall(labels or "")}
        out.append((name, pairs, float(value)))
    return out


def total(series: list[Series], name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels`` (0 when there is none)."""
    return sum(v for n, ls, v in series if n == name and all(ls.get(k) == x for k, x in labels.items()))


def scrape(endpoint: str, timeout: float = 10.0) -> list[Series]:
    """The samples a metrics agent serves at ``http://endpoint/metrics``."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=timeout) as reply:  # noqa: S310
        return parse(reply.read().decode())
