"""The layouts TransferQueue code reads and writes, and the conversions to and from this store's.

**Reads.** TransferQueue returns every tensor field of ``[B, ...]`` rows as a jagged nested tensor
(``layout=torch.jagged``), even when the rows share a shape; code written for it calls
``.offsets()``, ``.values()``, ``.to_padded_tensor()`` on what it gets (verl's padding helpers
do). Fields of 0-d rows (a ``[B]`` tensor) stay dense. The store returns dense ``[B, ...]`` where
rows agree; ``jagged`` below turns such a tensor into a jagged one without copying (the nested
tensor views the dense one). ``layout="dense"`` keeps the store's layout instead.

**Writes.** A ``NonTensorData`` holding one array or list of ``B`` values (how a TensorDict keeps a
numpy byte-string or object array) is one value per row for TransferQueue; it becomes a list of
those values, so numpy byte strings travel as bytes (no pickle).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict

# What a put takes: a TensorDict, or a mapping of field name to that field's rows.
Columns: TypeAlias = "TensorDict | Mapping[str, object]"

LAYOUTS = ("jagged", "dense")


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
    return layout


def jagged(value: torch.Tensor) -> torch.Tensor:
    """A dense ``[B, L, ...]`` tensor as a jagged nested tensor ``[B, j, ...]`` viewing it."""
    import torch

    b, length = value.shape[0], value.shape[1]
    values = value.reshape(b * length, *value.shape[2:])
    offsets = torch.arange(0, b * length + 1, max(length, 1) if b else 1, dtype=torch.int64)[: b + 1]
    if length == 0:
        offsets = torch.zeros(b + 1, dtype=torch.int64)
    return torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=length, max_seqlen=length)


def to_layout(td: TensorDict, layout: str) -> TensorDict:
    """``td`` with TransferQueue's layout (``jagged``) or as the store returned it (``dense``)."""
    import torch
    from tensordict import TensorDict

    if layout == "dense" or td.batch_size[0] == 0:
        return td
    out = {}
    changed = False
    for name in td.keys():
        value = td.get(name)
        if isinstance(value, torch.Tensor) and not value.is_nested and value.dim() >= 2:
            value = jagged(value.contiguous())
            changed = True
        out[name] = value
    return TensorDict(out, batch_size=td.batch_size, device=td.device) if changed else td


def per_row_values(data: Any) -> Any:
    """``data`` (a TensorDict or a mapping) with each ``NonTensorData`` holding a sequence of one
    value per row replaced by the list of those values (numpy scalars as Python values)."""
    import numpy as np

    if not (hasattr(data, "batch_size") and hasattr(data, "keys")):
        return data
    n = int(data.batch_size[0]) if len(data.batch_size) else None
    out: dict[str, object] = {}
    changed = False
    for name in data.keys():
        value = data.get(name)
        if type(value).__name__ == "NonTensorData":
            inner = value.data
            if isinstance(inner, np.ndarray) and inner.ndim >= 1 and len(inner) == n:
                value = [v.item() if isinstance(v, np.generic) else v for v in inner]
                changed = True
            elif isinstance(inner, (list, tuple)) and len(inner) == n:
                value = list(inner)
                changed = True
        out[name] = value
    if not changed:
        return data
    return out


__all__ = ["LAYOUTS", "check_layout", "jagged", "per_row_values", "to_layout"]
