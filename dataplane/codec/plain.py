"""What counts as plain metadata: ``plain_value(value, where)`` returns a private copy or raises.

The one definition of "plain" (tags, extra info, JSON-like rows, metas): str, int, float, bool, None,
and lists, tuples and dicts of them. A tensor or array never passes, so none rides along in metadata.

    >>> plain_value({"uid": 3, "scores": [1.0, 2.5]}, "tags[0]")
    {'uid': 3, 'scores': [1.0, 2.5]}
"""

from __future__ import annotations

from typing import Any

_SCALARS = (str, int, float, bool, type(None))
_MAX_DEPTH = 32


def _plain(value: Any, where: str, depth: int = 0) -> Any:
    """Return a private copy of ``value`` if it is made only of plain types, else raise TypeError.

    Exact type checks on purpose: ``numpy.float64`` subclasses ``float`` but is not a plain value,
    and a tensor must never slip in through a subclass.
    """
    kind = type(value)
    if kind in _SCALARS:
        return value
    if depth > _MAX_DEPTH:
        raise TypeError(f"{where} is nested deeper than {_MAX_DEPTH} levels; KVBatchMeta is small metadata")
    if kind is dict:
        out = {}
        for k, v in value.items():
            if type(k) not in (str, int):
                raise TypeError(f"{where} has a key of type {type(k).__name__}; dict keys must be str or int")
            out[k] = _plain(v, f"{where}[{k!r}]", depth + 1)
        return out
    if kind is list or kind is tuple:
        return kind(_plain(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))
    raise TypeError(
        f"{where} is a {kind.__module__}.{kind.__qualname__}; KVBatchMeta carries only plain values "
        "(str, int, float, bool, None, list, tuple, dict). Put tensors and arrays in the store with "
        "kv_batch_put and pass their keys instead."
    )


plain_value = _plain

__all__ = ["plain_value"]
