"""Per-kind encoding and decoding of column values (the body of ``codec.columns`` encode / decode).

Kinds: dense and jagged tensors (raw bytes of the tensor's storage), arrow (strings, binary, lists
of numbers: an Arrow large_* data buffer plus int64 offsets), json (JSON-like values such as chat
messages: one msgpack blob per row), object (one pickle per row, opt-in). Pickle lives here and
nowhere else in the data plane, and a reader unpickles only if its own process opted in.
"""

from __future__ import annotations

import logging
import math
import pickle
import warnings
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import torch

from dataplane import config
from dataplane.codec.column_types import Column, ColumnSpec, torch_dtype
from dataplane.codec.plain import MAX_DEPTH, plain_value
from dataplane.errors import BatchSizeError, SchemaError, SerializationError

logger = logging.getLogger(__name__)


class _FxTracingNoise(logging.Filter):
    """Drops one torch warning, "is_fx_tracing will return true for both fx.symbolic_trace and
    torch.export...": torch's own ``nested_tensor_from_jagged`` calls its deprecated
    ``is_fx_tracing()``, so every process that decodes a jagged column printed it once, though
    nothing traces anything. Only that message, only on that torch logger."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("is_fx_tracing will return true")


logging.getLogger("torch.fx._symbolic_trace").addFilter(_FxTracingNoise())

_warned_pickle = False


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def u8_tensor(data: memoryview) -> torch.Tensor:
    """A 1-D uint8 tensor viewing ``data`` (no copy; also for empty and read-only buffers)."""
    if memoryview(data).nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        # A read-only buffer (zmq frame, read-only mapping) is fine: we never write through it.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


def _u8_of_array(arr: np.ndarray) -> memoryview:
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data


_NUMPY_DTYPES = {
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.float32,
    torch.float64,
}


# numpy dtype -> the torch dtype name of a plain row (the dtypes ``_tensor_bytes`` views through numpy;
# their numpy names are the torch names).
_ROW_DTYPES = {np.dtype(str(dtype).removeprefix("torch.")): dtype_name(dtype) for dtype in _NUMPY_DTYPES}


def plain_rows(fields: dict[Any, Any]) -> dict[str, Column] | None:
    """One row per field from a dict of plain CPU tensors (without the batch dim), the common small
    put, in one pass: the columns ``ValueEncoder._dense(name, t[None], 1)`` makes, or None when a value
    needs the general path.

    One torch call per tensor (each costs microseconds, more with cold caches): ``Tensor.numpy()``,
    which refuses exactly what the general path has to convert or reject first (autograd, conjugate or
    negative bits, another device, sparse and nested tensors, dtypes numpy lacks); a view that is not
    contiguous, or a subclass, falls back too. Dtype and shape are then read from the numpy array.
    """
    out = {}
    for name, t in fields.items():
        if type(name) is not str or type(t) is not torch.Tensor:
            return None
        try:
            arr = t.numpy()
            data = memoryview(arr).cast("B")
        except (RuntimeError, TypeError, ValueError):
            return None
        dtype = _ROW_DTYPES.get(arr.dtype)
        if dtype is None:
            return None
        out[name] = Column(ColumnSpec("dense", dtype, arr.shape), 1, data)
    return out


def _tensor_bytes(name: str, t: torch.Tensor) -> memoryview:
    """Zero-copy uint8 view of a contiguous CPU tensor's elements."""
    if t.dtype in _NUMPY_DTYPES and t.numel():  # one torch call, not three (every field of every put)
        return memoryview(t.numpy()).cast("B")
    try:
        return memoryview(t.reshape(-1).view(torch.uint8).numpy())
    except (RuntimeError, TypeError) as e:
        raise SerializationError(f"field {name!r}: tensors of dtype {t.dtype} cannot be stored ({e})") from e


def check_storable(name: str, t: torch.Tensor) -> None:
    """Refuse, naming the field, a tensor whose bytes the codec cannot read: one on the meta device
    (a shape without data) or of a sparse layout. torch's own errors for them are untyped and name
    no field (``NotImplementedError``, ``RuntimeError``)."""
    if t.device.type == "meta":
        raise SerializationError(
            f"field {name!r} is a tensor on the meta device: it has a shape but no data to store; "
            "create it on a real device (or fill torch.empty_like(t, device='cpu')) first"
        )
    if t.layout not in (torch.strided, torch.jagged):  # (jagged: a nested tensor's layout)
        raise SerializationError(
            f"field {name!r}: {t.layout} tensors are not supported; store t.to_dense(), or the sparse "
            "tensor's indices and values as two fields"
        )


def _is_nontensor(value: Any) -> bool:
    return type(value).__name__ in ("NonTensorData", "NonTensorStack") and hasattr(value, "tolist")


class ValueEncoder:
    """Encodes the fields of one batch; ``finish()`` waits once for all CUDA -> pinned host copies."""

    def __init__(self, allow_pickle: bool = False) -> None:
        self._allow_pickle = allow_pickle
        self._cuda_pending = False

    @property
    def allow_pickle(self) -> bool:
        # The environment is read only when a value needs pickle: a lookup per put costs more than
        # encoding a small tensor row.
        return self._allow_pickle or config.env_allows_pickle()

    def finish(self) -> None:
        if self._cuda_pending:
            torch.cuda.synchronize()
            self._cuda_pending = False

    def encode(self, name: str, value: Any, num_rows: int) -> Column:
        if isinstance(value, torch.Tensor):
            check_storable(name, value)
            if value.is_nested:
                return self._nested(name, value, num_rows)
            return self._dense(name, value, num_rows)
        if isinstance(value, np.ndarray):
            if value.dtype.kind in "biufc":
                return self._numpy(name, value, num_rows)
            return self._list(name, value.tolist() if value.dtype.kind in "USa" else list(value), num_rows)
        if _is_nontensor(value):
            return self._list(name, list(value.tolist()), num_rows)
        if isinstance(value, (pa.Array, pa.ChunkedArray)):
            arr = value.combine_chunks() if isinstance(value, pa.ChunkedArray) else value
            _check_rows(name, len(arr), num_rows)
            col = _arrow_column(arr)
            return col if col is not None else self._object(name, arr.to_pylist(), num_rows)
        if isinstance(value, (list, tuple)):
            return self._list(name, list(value), num_rows)
        hint = " (flatten it with td.flatten_keys('.'))" if hasattr(value, "batch_size") else ""
        raise SerializationError(
            f"field {name!r} is a {type(value).__name__}, not a column of {num_rows} rows{hint}; give a "
            "tensor / ndarray with the batch as first dim, or a list with one value per row"
        )

    # -- tensors --------------------------------------------------------------------------------

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous CPU copy-or-view of ``t``: at most one copy; CUDA goes through pinned memory."""
        t = resolved(t)
        if t.device.type == "cpu":
            return t.contiguous()
        if t.device.type == "cuda":
            pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            pinned.copy_(t, non_blocking=True)
            self._cuda_pending = True
            return pinned
        return t.to("cpu").contiguous()

    def _dense(self, name: str, t: torch.Tensor, num_rows: int) -> Column:
        if t.dim() == 0:
            raise BatchSizeError(f"field {name!r} is a 0-d tensor (no batch dim); expected {num_rows} rows")
        _check_rows(name, t.shape[0], num_rows)
        data = _tensor_bytes(name, self._host(t))
        return Column(ColumnSpec("dense", dtype_name(t.dtype), tuple(t.shape[1:])), num_rows, data)

    def _numpy(self, name: str, arr: np.ndarray, num_rows: int) -> Column:
        if arr.ndim == 0:
            raise BatchSizeError(f"field {name!r} is a 0-d array with no batch dim; expected {num_rows} rows")
        _check_rows(name, arr.shape[0], num_rows)
        if not arr.dtype.isnative:
            arr = arr.astype(arr.dtype.newbyteorder("="))
        try:
            dtype = torch.from_numpy(np.empty(0, dtype=arr.dtype)).dtype
        except TypeError as e:
            raise SerializationError(
                f"field {name!r}: numpy dtype {arr.dtype} has no torch equivalent"
            ) from e
        spec = ColumnSpec("dense", dtype_name(dtype), tuple(arr.shape[1:]))
        return Column(spec, num_rows, _u8_of_array(arr))

    def _nested(self, name: str, t: torch.Tensor, num_rows: int) -> Column:
        if t.layout != torch.jagged or t._ragged_idx != 1 or t.lengths() is not None:
            # strided-layout nested tensors and jagged ones with holes: go through their rows
            return self._tensor_list(name, list(t.unbind()), num_rows)
        _check_rows(name, t.shape[0], num_rows)
        return self._jagged(name, t.values(), t.offsets().cpu().numpy().astype(np.int64))

    def _jagged(self, name: str, values: torch.Tensor, elem_offsets: np.ndarray) -> Column:
        trailing = tuple(values.shape[1:])
        row_bytes = values.dtype.itemsize * math.prod(trailing)
        if row_bytes == 0:
            raise SerializationError(f"field {name!r}: jagged rows with an empty trailing shape {trailing}")
        data = _tensor_bytes(name, self._host(values))
        begin, end = int(elem_offsets[0]), int(elem_offsets[-1])
        offsets = (elem_offsets - begin) * row_bytes
        spec = ColumnSpec("jagged", dtype_name(values.dtype), trailing)
        return Column(spec, elem_offsets.size - 1, data[begin * row_bytes : end * row_bytes], offsets)

    def _tensor_list(self, name: str, rows: list[torch.Tensor], num_rows: int) -> Column:
        """Rows of one dtype and one number of dims, each of its own shape: jagged when they differ
        only in their first dim, ragged (with each row's shape) otherwise. One copy."""
        _check_rows(name, len(rows), num_rows)
        for r in rows:
            check_storable(name, r)
        if all(r.dim() == 0 for r in rows):
            return self._dense(name, torch.stack(rows), num_rows)
        first = rows[0]
        for i, r in enumerate(rows):
            if r.dim() != first.dim() or r.dtype != first.dtype:
                raise SchemaError(
                    name,
                    f"field {name!r}: row {i} is {r.dtype} with {r.dim()} dims but row 0 is {first.dtype} "
                    f"with {first.dim()}; the rows of a field share their dtype and number of dims",
                )
        values = torch.cat([r.detach().reshape(-1) for r in rows])  # the one copy; on the rows' device
        if all(r.shape[1:] == first.shape[1:] for r in rows):
            lengths = np.fromiter((r.shape[0] for r in rows), dtype=np.int64, count=len(rows))
            offsets = np.zeros(len(rows) + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            return self._jagged(name, values.view(-1, *first.shape[1:]), offsets)
        shapes = np.array([tuple(r.shape) for r in rows], dtype=np.int64).reshape(len(rows), first.dim())
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(np.prod(shapes, axis=1) * values.element_size(), out=offsets[1:])
        data = _tensor_bytes(name, self._host(values))
        return Column(
            ColumnSpec("ragged", dtype_name(first.dtype), (first.dim(),)), len(rows), data, offsets, shapes
        )

    # -- python values --------------------------------------------------------------------------

    def _list(self, name: str, values: list[Any], num_rows: int) -> Column:
        _check_rows(name, len(values), num_rows)
        if not values:
            raise SerializationError(
                f"field {name!r} is an empty list: its kind cannot be inferred; pass an empty tensor instead"
            )
        if all(isinstance(v, torch.Tensor) for v in values):
            return self._tensor_list(name, values, num_rows)
        if all(isinstance(v, np.ndarray) and v.dtype.kind in "biufc" for v in values):
            rows = [torch.from_numpy(np.ascontiguousarray(v)) for v in values]
            return self._tensor_list(name, rows, num_rows)
        arr = None
        if not any(isinstance(v, (torch.Tensor, np.ndarray)) for v in values):
            try:
                arr = pa.array(values)
            except (pa.ArrowException, TypeError, ValueError, OverflowError):
                arr = None
        if arr is not None and arr.null_count == 0 and _is_number(arr.type):
            # one number per row: a dense column ([B] int64 / float64 / bool)
            return self._numpy(name, arr.to_numpy(zero_copy_only=False), num_rows)
        col = None if arr is None else _arrow_column(arr)
        if col is None:
            try:
                col = _json_column(values)
            except SerializationError as exc:  # JSON-like, but nested too deep for a json column
                if not self.allow_pickle:
                    raise SerializationError(
                        f"field {name!r}: {exc}; JSON-like values are stored without pickle up to "
                        f"{MAX_DEPTH} levels deep. Flatten the value (or store it as a JSON string), or pass "
                        "allow_pickle=True (or set DATAPLANE_ALLOW_PICKLE=1) to store it as an object column"
                    ) from None
        return col if col is not None else self._object(name, values, num_rows)

    def _object(self, name: str, values: list[Any], num_rows: int) -> Column:
        global _warned_pickle
        if not self.allow_pickle:
            culprit = next((v for v in values if type(v) not in (str, bytes, int, float, bool)), values[0])
            raise SerializationError(
                f"field {name!r} holds {type(culprit).__module__}.{type(culprit).__qualname__} values that "
                "need pickle; pass allow_pickle=True (or set DATAPLANE_ALLOW_PICKLE=1) to store them as an "
                "object column, or convert them to tensors / str / bytes / lists of numbers"
            )
        if not _warned_pickle:
            _warned_pickle = True
            logger.warning("field %r is stored with pickle (allow_pickle is on): trusted data only", name)
        blobs = [pickle.dumps(v, protocol=5) for v in values]
        offsets = np.zeros(len(blobs) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, blobs), dtype=np.int64, count=len(blobs)), out=offsets[1:])
        return Column(ColumnSpec("object", "pickle", ()), num_rows, memoryview(b"".join(blobs)), offsets)


_json_encoder = msgspec.msgpack.Encoder()


def _json_column(values: list[Any]) -> Column | None:
    """A json column (one msgpack blob per row), or None when a row is not JSON-like.

    JSON-like: None, bool, int (64-bit), float, str, and lists, tuples (read back as lists) and dicts
    (str or int keys) of those, nested at most ``MAX_DEPTH`` levels deep (deeper: ``SerializationError``
    saying so). Anything else needs pickle.
    """
    try:
        blobs = [_json_encoder.encode(plain_value(v, f"row {i}")) for i, v in enumerate(values)]
    except SerializationError:  # nested too deep: the caller says so, or pickles it
        raise
    except (TypeError, OverflowError):
        return None
    offsets = np.zeros(len(blobs) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, blobs), dtype=np.int64, count=len(blobs)), out=offsets[1:])
    return Column(ColumnSpec("json", "msgpack", ()), len(values), memoryview(b"".join(blobs)), offsets)


def _stack(rows: list[Any]) -> Any:
    """A non-tensor stack of arbitrary Python rows (``from_list`` would re-nest lists)."""
    from tensordict import NonTensorData, NonTensorStack

    return NonTensorStack(*[NonTensorData(v) for v in rows])


def _check_rows(name: str, got: int, num_rows: int) -> None:
    if got != num_rows:
        raise BatchSizeError(f"field {name!r} has {got} rows but the batch has {num_rows} (one per key)")


def _is_number(t: pa.DataType) -> bool:
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t))


# -- arrow ----------------------------------------------------------------------------------------


def _arrow_column(arr: pa.Array) -> Column | None:
    """An arrow Column (zero-copy over ``arr``'s buffers), or None when the type is not supported."""
    t = arr.type
    if arr.null_count:
        return None
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        arr, dtype = arr.cast(pa.large_string()), "large_string"
    elif pa.types.is_binary(t) or pa.types.is_large_binary(t):
        arr, dtype = arr.cast(pa.large_binary()), "large_binary"
    elif (pa.types.is_list(t) or pa.types.is_large_list(t)) and _is_number(t.value_type):
        arr = arr.cast(pa.large_list(t.value_type))
        dtype = f"large_list<{t.value_type}>"
    else:
        return None
    n = len(arr)
    buffers = arr.buffers()
    offs = np.frombuffer(buffers[1], dtype=np.int64)[arr.offset : arr.offset + n + 1]
    if dtype.startswith("large_list"):
        child = arr.values
        if child.null_count:
            return None
        items = child.to_numpy(zero_copy_only=False)  # accounts for the child's own offset
        item_bytes = items.dtype.itemsize
        raw = items.reshape(-1).view(np.uint8)
    else:
        item_bytes = 1
        raw = np.frombuffer(buffers[2], dtype=np.uint8) if buffers[2] is not None else np.empty(0, np.uint8)
    begin, end = int(offs[0]) * item_bytes, int(offs[-1]) * item_bytes
    offsets = offs * item_bytes - begin
    return Column(ColumnSpec("arrow", dtype, ()), n, memoryview(raw[begin:end]), offsets)


def _arrow_values(col: Column) -> list[Any]:
    dtype = col.spec.dtype
    data = pa.py_buffer(col.data)
    if dtype in ("large_string", "large_binary"):
        atype = pa.large_string() if dtype == "large_string" else pa.large_binary()
        arr = pa.Array.from_buffers(atype, col.num_rows, [None, pa.py_buffer(col.offsets), data])
        values: list[Any] = arr.to_pylist()
        return values
    if dtype.startswith("large_list<") and dtype.endswith(">"):
        child_type = pa.type_for_alias(dtype[len("large_list<") : -1])
        np_dtype = np.bool_ if pa.types.is_boolean(child_type) else child_type.to_pandas_dtype()
        items = np.frombuffer(col.data, dtype=np_dtype) if col.data.nbytes else np.empty(0, np_dtype)
        offsets = pa.array(col.offsets // np.dtype(np_dtype).itemsize)
        arr = pa.LargeListArray.from_arrays(offsets, pa.array(items, type=child_type))
        lists: list[Any] = arr.to_pylist()
        return lists
    raise SerializationError(f"unknown arrow column type {dtype!r}")


# -- decode ---------------------------------------------------------------------------------------


def _common_row_shape(col: Column) -> tuple[int, ...] | None:
    """The shape every row of a jagged or ragged column has, if they all have one (else None)."""
    if col.num_rows == 0:
        return None
    shapes = col.row_shapes(np.arange(col.num_rows))
    return tuple(int(d) for d in shapes[0]) if bool(np.all(shapes == shapes[0])) else None


def tensor_view(
    values: torch.Tensor, spec: ColumnSpec, num_rows: int, offsets: np.ndarray | None
) -> torch.Tensor:
    """A dense or jagged column as the tensor a get returns, viewing ``values`` (its bytes, uint8, on
    any device): dense ``[B, ...]``; jagged rows (``offsets``: their byte offsets) of one length dense
    ``[B, L, ...]``, else a nested tensor (jagged layout)."""
    flat = values.view(torch_dtype(spec.dtype))
    if offsets is None:
        return flat.view(num_rows, *spec.shape)
    elem_offsets = offsets // spec.row_bytes()
    lengths = np.diff(elem_offsets)
    if num_rows and bool(np.all(lengths == lengths[0])):  # the rows asked for share one shape: a view
        return flat.view(num_rows, int(lengths[0]), *spec.shape)
    bounds = {"min_seqlen": int(lengths.min()), "max_seqlen": int(lengths.max())} if lengths.size else {}
    return torch.nested.nested_tensor_from_jagged(
        flat.view(-1, *spec.shape), torch.from_numpy(elem_offsets).to(values.device), **bounds
    )


def resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, with any pending conjugation or negation applied (its bytes are its values)."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def decode_value(name: str, col: Column, allow_pickle: bool) -> Any:
    """The TensorDict entry for one column (a tensor view over ``col.data`` when it holds tensors)."""
    spec = col.spec
    if spec.kind in ("dense", "jagged"):
        offsets = col.var_offsets() if spec.kind == "jagged" else None
        return tensor_view(u8_tensor(col.data), spec, col.num_rows, offsets)
    if spec.kind == "ragged":
        shape = _common_row_shape(col)
        if shape is not None:  # the rows asked for share one shape: dense, still a view
            return u8_tensor(col.data).view(torch_dtype(spec.dtype)).view(col.num_rows, *shape)
        # rows differ beyond their first dim: a strided nested tensor (one copy)
        flat = u8_tensor(col.data).view(torch_dtype(spec.dtype))
        item = flat.element_size()
        offsets, shapes = col.var_offsets(), col.ragged_shapes()
        rows = [
            flat[offsets[i] // item : offsets[i + 1] // item].view(*shapes[i].tolist())
            for i in range(col.num_rows)
        ]
        with warnings.catch_warnings():  # torch calls the strided layout a prototype; it is what fits
            warnings.simplefilter("ignore", UserWarning)
            return torch.nested.nested_tensor(rows)
    from tensordict import NonTensorStack

    if spec.kind == "arrow":
        return NonTensorStack.from_list(_arrow_values(col))
    if spec.kind == "json":
        offs = col.var_offsets().tolist()
        dec = msgspec.msgpack.Decoder()
        try:
            return _stack([dec.decode(col.data[offs[i] : offs[i + 1]]) for i in range(col.num_rows)])
        except msgspec.DecodeError as exc:
            raise SerializationError(f"field {name!r}: a json row is not valid msgpack ({exc})") from exc
    if spec.kind == "object":
        if not allow_pickle:
            raise SerializationError(
                f"field {name!r} is a pickled object column; this process did not opt in to unpickling "
                "(dp.init(allow_pickle=True) or DATAPLANE_ALLOW_PICKLE=1). Only do so for data you trust: "
                "unpickling runs code chosen by whoever wrote it"
            )
        offs = col.var_offsets().tolist()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rows = [pickle.loads(col.data[offs[i] : offs[i + 1]]) for i in range(col.num_rows)]
        return _stack(rows)
    raise SerializationError(f"field {name!r}: unknown column kind {spec.kind!r}")
