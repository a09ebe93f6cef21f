"""The bypass benchmark's workload: rows made from a formula, the consumer's step, and the checks.

Runs wherever it is imported: in producer workers (``make_rows``), consumer workers (``make_rows``
on the floor path, ``check_rows`` and ``compute`` on every path) and the driver (``check_output``).

A row is what a rollout hands to the next stage: ``row`` (its int64 id), ``responses`` (int64
tokens), ``old_log_probs`` and ``advantages`` (float32), the last three of ``seq`` tokens each, so
a row weighs ``16 * seq + 8`` bytes. Every value is ``row_part[r] + col_part[t]`` (one add, so it
is bit-exact wherever it is computed): making a batch costs one write pass per field, about what a
copy of it costs, so the floor path (consumers make their rows instead of receiving them) is a
fair stand-in for "the data is already there". The step writes one float32 field::

    new_log_probs = old_log_probs * 2 + advantages

``* 2`` is exact and the add rounds once, so the driver can recompute the expected output exactly,
block by block, without holding the batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict

FIELDS = ("row", "responses", "old_log_probs", "advantages")
OUT = "new_log_probs"
BYTES_PER_TOKEN = 8 + 4 + 4  # responses int64, old_log_probs float32, advantages float32
ROW_ID_BYTES = 8
CHECK_BLOCK_ROWS = 256  # rows recomputed at a time by check_output (bounds the driver's memory)


class BypassCheckError(RuntimeError):
    """A path delivered wrong data: names the path, the field and the first wrong row.

    Raised on a worker (``check_rows``, re-raised on the driver by Ray) or on the driver
    (``check_output``). Not recoverable: the path under test moved or computed the wrong bytes.
    """

    def __init__(self, path: str, field: str, row: int, detail: str) -> None:
        super().__init__(f"bypass {path} path: field {field!r}, row {row}: {detail}")
        self.path, self.field, self.row, self.detail = path, field, row, detail

    def __reduce__(self) -> tuple:
        return (BypassCheckError, (self.path, self.field, self.row, self.detail))


def seq_for(row_bytes: int) -> int:
    """Tokens per row so that a row's token fields weigh ``row_bytes`` (at least one token).

    Example:
        >>> seq_for(64 * 1024)
        4096
    """
    return max(1, row_bytes // BYTES_PER_TOKEN)


def row_nbytes(seq: int) -> int:
    """Bytes of one row (every field, the row id included)."""
    return BYTES_PER_TOKEN * seq + ROW_ID_BYTES


def _parts(rows: torch.Tensor, seq: int, step: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per field: (row part ``[n]``, column part ``[seq]``) of the step's values."""
    import torch

    t = torch.arange(seq, dtype=torch.int64)
    r = rows.to(torch.int64)
    return {
        "responses": (r * 1009 + step * 7, t % 32000),
        "old_log_probs": (
            (r % 997).to(torch.float32) * -1e-3 - step * 1e-4,
            (t % 101).to(torch.float32) * -1e-4,
        ),
        "advantages": (((r % 13) - 6).to(torch.float32) * 0.1, (t % 7).to(torch.float32) * 1e-2),
    }


def make_rows(rows: torch.Tensor, seq: int, step: int, into: TensorDict | None = None) -> TensorDict:
    """The step's rows ``rows`` (an int64 tensor of row ids) as a TensorDict of ``len(rows)`` rows.

    ``into``: a TensorDict of the same rows and ``seq`` to write into (warm memory: the workers
    reuse one per batch shape, so no path pays page faults for making its rows; see
    ``RowBuffers``). Without it, fresh tensors are allocated.

    Example:
        >>> import torch
        >>> td = make_rows(torch.arange(4), 8, step=0)
        >>> sorted(td.keys()), td["responses"].shape
        (['advantages', 'old_log_probs', 'responses', 'row'], torch.Size([4, 8]))
    """
    import torch
    from tensordict import TensorDict

    n = len(rows)
    parts = _parts(rows, seq, step)
    if into is None:
        columns = {"row": torch.empty(n, dtype=torch.int64)}
        columns.update({name: torch.empty((n, seq), dtype=p[0].dtype) for name, p in parts.items()})
        into = TensorDict(columns, batch_size=[n])
    into["row"].copy_(rows)
    for name, (row_part, col_part) in parts.items():
        torch.add(row_part[:, None], col_part[None, :], out=into[name])
    return into


class RowBuffers:
    """One warm TensorDict per batch shape, reused by ``make_rows`` step after step (per process).

    Every path's producers make their rows into it, and the floor's consumers too: the rows of a
    step cost a write pass over memory that is already mapped, the least making them can cost.
    Safe to reuse because every path copies the rows out before the producer's call returns (Ray
    serialises a return value, the stores copy on put).
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[int, int], TensorDict] = {}

    def make(self, rows: torch.Tensor, seq: int, step: int) -> TensorDict:
        key = (len(rows), seq)
        if key not in self.buffers:
            self.buffers.clear()  # a new point: drop the previous shape's memory
            self.buffers[key] = make_rows(rows, seq, step)
            return self.buffers[key]
        return make_rows(rows, seq, step, into=self.buffers[key])


def compute(td: TensorDict) -> TensorDict:
    """The consumer's step: ``new_log_probs = old_log_probs * 2 + advantages``, one row per input row."""
    from tensordict import TensorDict

    out = td["old_log_probs"] * 2
    out += td["advantages"]
    return TensorDict({OUT: out}, batch_size=td.batch_size)


def densify(td: TensorDict, seq: int) -> TensorDict:
    """Jagged (nested) fields, as TransferQueue returns dense ones, as dense views: ``row`` ``[n]``,
    every other field ``[n, seq]``."""
    from tensordict import TensorDict

    n = td.batch_size[0]
    columns = {}
    for name in td.keys():
        value = td[name]
        if getattr(value, "is_nested", False):
            value = value.values()  # a view of the rows' values, concatenated: no copy
        columns[name] = value.reshape(n) if name == "row" else value.reshape(n, seq)
    return TensorDict(columns, batch_size=[n])


def check_rows(path: str, td: TensorDict, step: int) -> None:
    """Spot-check every row a worker received: its id's first and last token of every field.

    Cheap (two columns per field), so it runs on every step: a row delivered to the wrong place, a
    stale step or a torn column fails here, naming the path, the field and the row.

    Raises:
        BypassCheckError: the first wrong value found.
    """
    rows = td["row"]
    seq = td["responses"].shape[-1]
    for name, (row_part, col_part) in _parts(rows, seq, step).items():
        got = td[name]
        for t in (0, seq - 1):
            bad = (got[:, t] != row_part + col_part[t]).nonzero()
            if len(bad):
                i = int(bad[0])
                raise BypassCheckError(path, name, int(rows[i]), f"token {t} of step {step} is wrong")


def check_output(path: str, out: torch.Tensor, n_rows: int, seq: int, step: int) -> None:
    """Check the step's whole output (``[n_rows, seq]`` for rows ``0..n_rows-1``) exactly, in blocks.

    Raises:
        BypassCheckError: a shape mismatch or the first wrong row.
    """
    import torch

    if tuple(out.shape) != (n_rows, seq):
        raise BypassCheckError(path, OUT, 0, f"shape {tuple(out.shape)}, expected {(n_rows, seq)}")
    for lo in range(0, n_rows, CHECK_BLOCK_ROWS):
        rows = torch.arange(lo, min(n_rows, lo + CHECK_BLOCK_ROWS))
        parts = _parts(rows, seq, step)
        old = parts["old_log_probs"][0][:, None] + parts["old_log_probs"][1][None, :]
        adv = parts["advantages"][0][:, None] + parts["advantages"][1][None, :]
        expected = old * 2
        expected += adv
        bad = (out[lo : lo + len(rows)] != expected).any(dim=1).nonzero()
        if len(bad):
            raise BypassCheckError(
                path, OUT, lo + int(bad[0]), f"differs from the expected value (step {step})"
            )
