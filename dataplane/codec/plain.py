"""What counts as plain metadata: ``plain_value(value, where)`` returns a private copy or raises.

The one definition of "plain" (tags, extra info, JSON-like rows, metas): str, int, float, bool, None,
and lists, tuples and dicts of them, nested at most ``MAX_DEPTH`` (32) levels deep. A tensor or array
never passes, so none rides along in metadata.

    >>> plain_value({"uid": 3, "scores": [1.0, 2.5]}, "tags[0]")
    {'uid': 3, 'scores': [1.0, 2.5]}
"""

from __future__ import annotations

from typing import Any

from dataplane.errors import SerializationError

_SCALARS = (str, int, float, bool, type(None))
MAX_DEPTH = 32
"""The deepest nesting of lists, tuples and dicts a plain value may have (``[[1]]`` is 2 levels).
Beyond it ``plain_value`` raises ``SerializationError`` (a ``TypeError``) saying so: such a value
is stored only as an object column (pickle, opt-in), never as a JSON-like one or in a tag."""


def _plain(value: Any, where: str, depth: int = 0) -> Any:
    """Return a private copy of ``value`` if it is made only of plain types, else raise TypeError
    (``SerializationError``, a ``TypeError``, when it is nested deeper than ``MAX_DEPTH``).

    Exact type checks on purpose: ``numpy.float64`` subclasses ``float`` but is not a plain value,
    and a tensor must never slip in through a subclass.
    """
    kind = type(value)
    if kind in _SCALARS:
        return value
    if depth >= MAX_DEPTH:  # ``value`` is a container at level depth + 1
        raise SerializationError(
            f"{where} is nested deeper than {MAX_DEPTH} levels of lists and dicts, the most a plain value "
            "(a tag, metadata, a JSON-like row) may have"
        )
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

__all__ = ["MAX_DEPTH", "plain_value"]
