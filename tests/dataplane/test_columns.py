"""The column codec: every kind round trips, zero-copy where promised, gather, errors (pure: no Ray)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pyarrow as pa
import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from dataplane.codec import rows as _rows
from dataplane.codec.column_types import Column, ColumnSpec
from dataplane.codec.columns import decode_fields, encode_fields, encode_row
from dataplane.codec.gather import gather, gather_view, gathered_nbytes, slice_rows
from dataplane.codec.rows import assemble
from dataplane.errors import BatchSizeError, SchemaError, SerializationError

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def rand(shape, dtype):
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (exact for every dtype, NaNs included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def addr(buf) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


def roundtrip(fields, n, **kw):
    return decode_fields(encode_fields(fields, n, **kw), n)


# -- dense --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("row_shape", [(), (3,), (2, 3)], ids=["0d", "1d", "2d"])
def test_dense_round_trip_every_dtype(dtype, row_shape):
    x = rand((4, *row_shape), dtype)
    cols = encode_fields({"x": x}, 4)
    assert cols["x"].spec == ColumnSpec("dense", str(dtype).removeprefix("torch."), row_shape)
    assert cols["x"].offsets is None
    out = decode_fields(cols, 4)["x"]
    assert not out.is_nested
    assert same_bits(out, x)


def test_bf16_and_bool_exact_values():
    x = torch.tensor([[1.0078125, -0.0, float("inf")], [float("nan"), 3.0e38, 1e-40]], dtype=torch.bfloat16)
    b = torch.tensor([True, False])
    td = roundtrip({"x": x, "b": b}, 2)
    assert td["x"].dtype == torch.bfloat16 and same_bits(td["x"], x)
    assert td["b"].dtype == torch.bool and td["b"].tolist() == [True, False]


def test_dense_encode_is_zero_copy_and_decode_views_the_buffer():
    x = torch.arange(12, dtype=torch.float32).view(4, 3)
    col = encode_fields({"x": x}, 4)["x"]
    assert addr(col.data) == x.data_ptr()
    out = decode_fields({"x": col}, 4)["x"]
    assert out.data_ptr() == addr(col.data)
    # decoding a plain buffer (e.g. a received frame) shares it too
    buf = bytearray(x.numpy().tobytes())
    view = decode_fields({"x": Column(col.spec, 4, memoryview(buf))}, 4)["x"]
    assert view.data_ptr() == addr(buf) and torch.equal(view, x)


def test_decode_read_only_buffer():
    x = torch.arange(6, dtype=torch.int16)
    col = Column(ColumnSpec("dense", "int16", ()), 6, memoryview(x.numpy().tobytes()))
    assert torch.equal(decode_fields({"x": col}, 6)["x"], x)


def test_non_contiguous_input_is_copied_once_and_exact():
    x = torch.arange(24, dtype=torch.float32).view(4, 6)[:, ::2]
    y = torch.arange(12, dtype=torch.int32).view(3, 4).t()
    td = roundtrip({"x": x, "y": y}, 4)
    assert torch.equal(td["x"], x) and torch.equal(td["y"], y)


def test_tensor_slice_view_encodes_only_its_rows():
    base = torch.arange(20, dtype=torch.int64).view(10, 2)
    col = encode_fields({"x": base[3:6]}, 3)["x"]
    assert col.nbytes == 3 * 16 and addr(col.data) == base[3:6].data_ptr()


def test_numpy_arrays_are_dense():
    a = np.arange(8, dtype=np.float16).reshape(4, 2)
    big_endian = np.arange(4, dtype=">i4")
    td = roundtrip({"a": a, "be": big_endian}, 4)
    assert td["a"].dtype == torch.float16 and np.array_equal(td["a"].numpy(), a)
    assert td["be"].tolist() == [0, 1, 2, 3]


def test_numpy_dtype_without_torch_equivalent():
    with pytest.raises(SerializationError, match="'q': numpy dtype"):
        encode_fields({"q": np.zeros(2, dtype=np.longdouble)}, 2)


def test_list_of_numbers_per_row_is_dense():
    td = roundtrip({"r": [1.5, 2.5], "i": [1, 2], "ok": [True, False]}, 2)
    assert td["r"].dtype == torch.float64 and td["r"].tolist() == [1.5, 2.5]
    assert td["i"].dtype == torch.int64 and td["ok"].dtype == torch.bool


def test_empty_batch_dense():
    td = roundtrip({"x": torch.zeros(0, 3)}, 0)
    assert td["x"].shape == (0, 3)


def test_requires_grad_and_conj_inputs():
    x = torch.randn(3, 2, requires_grad=True)
    c = torch.randn(3, dtype=torch.complex64)
    td = roundtrip({"x": x, "c": c.conj()}, 3)
    assert torch.equal(td["x"], x.detach()) and torch.equal(td["c"], c.conj().resolve_conj())


# -- jagged -------------------------------------------------------------------------------------


def test_list_of_tensors_is_jagged_and_views_the_buffer():
    rows = [torch.randn(2, 3), torch.randn(0, 3), torch.randn(5, 3)]
    col = encode_fields({"j": rows}, 3)["j"]
    assert col.spec == ColumnSpec("jagged", "float32", (3,))
    assert col.offsets.tolist() == [0, 24, 24, 84]
    out = decode_fields({"j": col}, 3)["j"]
    assert out.is_nested and out.layout == torch.jagged
    assert out.values().data_ptr() == addr(col.data)
    assert all(torch.equal(a, b) for a, b in zip(out.unbind(), rows, strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.bool, torch.int8, torch.complex64], ids=str)
def test_nested_jagged_tensor_round_trip(dtype):
    rows = [rand((n,), dtype) for n in (3, 1, 4)]
    nt = torch.nested.nested_tensor(rows, layout=torch.jagged)
    out = roundtrip({"nt": nt}, 3)["nt"]
    assert out.dtype == dtype
    assert all(same_bits(a, b) for a, b in zip(out.unbind(), rows, strict=True))


def test_jagged_in_tensordict():
    nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(1)], layout=torch.jagged)
    td = TensorDict({"nt": nt, "x": torch.zeros(2)}, batch_size=[2])
    out = roundtrip(td, 2)
    assert [r.tolist() for r in out["nt"].unbind()] == [[1.0, 1.0], [1.0]]


def test_list_of_zero_d_tensors_is_dense():
    td = roundtrip({"r": [torch.tensor(1.0), torch.tensor(2.0)]}, 2)
    assert not td["r"].is_nested and td["r"].tolist() == [1.0, 2.0]


def test_rows_share_dtype_and_number_of_dims():
    with pytest.raises(SchemaError, match=r"'j': row 1 is torch.int64") as info:
        encode_fields({"j": [torch.zeros(2, 3), torch.zeros(1, 3, dtype=torch.int64)]}, 2)
    assert info.value.field == "j"
    with pytest.raises(SchemaError, match="row 1 .* 1 dims but row 0 .* 2"):
        encode_fields({"j": [torch.zeros(2, 3), torch.zeros(4)]}, 2)


def test_rows_that_differ_beyond_their_first_dim_are_ragged():
    rows = [torch.arange(6.0).view(2, 3), torch.arange(4.0).view(1, 4), torch.zeros(0, 2)]
    col = encode_fields({"img": rows}, 3)["img"]
    assert col.spec == ColumnSpec("ragged", "float32", (2,)) and col.shapes.tolist() == [
        [2, 3],
        [1, 4],
        [0, 2],
    ]
    out = decode_fields({"img": col}, 3)["img"]
    assert out.is_nested and [t.tolist() for t in out.unbind()] == [r.tolist() for r in rows]
    # a subset whose rows share one shape comes back dense, and still without a copy
    sub = _rows.contiguous_view(col, np.array([1]))
    assert not decode_fields({"img": sub}, 1)["img"].is_nested


def test_jagged_rows_of_one_length_come_back_dense():
    col = encode_fields({"j": [torch.arange(3), torch.arange(3, 6)]}, 2)["j"]
    assert col.spec.kind == "jagged"
    out = decode_fields({"j": col}, 2)["j"]
    assert not out.is_nested and out.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_segments_of_one_field_with_different_row_shapes_assemble_into_one_column():
    a = encode_fields({"x": torch.arange(6).view(2, 3)}, 2)["x"]  # dense rows of 3
    b = encode_fields({"x": torch.arange(10).view(2, 5)}, 2)["x"]  # dense rows of 5
    c = encode_fields({"x": [torch.arange(2), torch.arange(3)]}, 2)["x"]  # jagged
    assert a.spec.family() == b.spec.family() == c.spec.family()
    both = _rows.assemble_any(3, [(a, np.array([1]), np.array([0])), (b, np.array([0, 1]), np.array([1, 2]))])
    assert both.spec == ColumnSpec("jagged", "int64", ())
    got = decode_fields({"x": both}, 3)["x"]
    assert [t.tolist() for t in got.unbind()] == [[3, 4, 5], [0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    same = _rows.assemble_any(2, [(b, np.array([1]), np.array([0])), (b, np.array([0]), np.array([1]))])
    assert same.spec == ColumnSpec("dense", "int64", (5,))  # one spec: the ordinary path
    mixed = _rows.assemble_any(2, [(a, np.array([0]), np.array([0])), (c, np.array([1]), np.array([1]))])
    assert decode_fields({"x": mixed}, 2)["x"].tolist() == [[0, 1, 2], [0, 1, 2]]  # one shape: dense
    img = encode_fields({"x": torch.zeros(1, 2, 2)}, 1)["x"]
    wide = encode_fields({"x": torch.ones(1, 2, 3)}, 1)["x"]
    rag = _rows.assemble_any(2, [(img, np.array([0]), np.array([0])), (wide, np.array([0]), np.array([1]))])
    assert rag.spec == ColumnSpec("ragged", "float32", (2,)) and rag.shapes.tolist() == [[2, 2], [2, 3]]


# -- arrow and objects --------------------------------------------------------------------------


def test_arrow_kinds_round_trip():
    fields = {
        "s": ["héllo", "", "wörld ✓"],
        "b": [b"\x00\x01", b"", b"xyz"],
        "li": [[1, 2, 3], [], [-(2**40)]],
        "lf": [[0.5], [1.5, 2.5], []],
        "lb": [[True, False], [], [True]],
    }
    cols = encode_fields(fields, 3)
    assert {k: c.spec.dtype for k, c in cols.items()} == {
        "s": "large_string",
        "b": "large_binary",
        "li": "large_list<int64>",
        "lf": "large_list<double>",
        "lb": "large_list<bool>",
    }
    assert all(c.spec.kind == "arrow" and c.offsets.dtype == np.int64 for c in cols.values())
    td = decode_fields(cols, 3)
    for k, v in fields.items():
        assert td.get(k).tolist() == v


def test_pyarrow_array_input_zero_copy_and_sliced():
    arr = pa.array(["aa", "b", "cccc", "dd"], type=pa.large_string())
    col = encode_fields({"s": arr}, 4)["s"]
    assert addr(col.data) == arr.buffers()[2].address
    sliced = pa.array(["x", "yy", "zzz", "w"]).slice(1, 2)
    assert roundtrip({"s": sliced}, 2).get("s").tolist() == ["yy", "zzz"]
    lists = pa.array([[1], [2, 3], [4, 5, 6]]).slice(1)
    assert roundtrip({"l": lists}, 2).get("l").tolist() == [[2, 3], [4, 5, 6]]


def test_tensordict_non_tensor_entries():
    td = TensorDict({"x": torch.zeros(3)}, batch_size=[3])
    td["s"] = NonTensorStack.from_list(["a", "b", "c"])
    td["const"] = "same"
    out = roundtrip(td, 3)
    assert out.get("s").tolist() == ["a", "b", "c"]
    assert out.get("const").tolist() == ["same"] * 3


def test_objects_need_pickle_opt_in_on_both_sides(monkeypatch):
    monkeypatch.delenv("DATAPLANE_ALLOW_PICKLE", raising=False)
    rows = [Fraction(1, 3), None, {"b": Fraction(2)}]
    with pytest.raises(
        SerializationError, match=r"'obj'.*fractions.Fraction.*allow_pickle=True.*DATAPLANE_ALLOW_PICKLE"
    ):
        encode_fields({"obj": rows}, 3)
    cols = encode_fields({"obj": rows}, 3, allow_pickle=True)
    assert cols["obj"].spec == ColumnSpec("object", "pickle", ())
    assert decode_fields(cols, 3, allow_pickle=True).get("obj").tolist() == rows
    # the reader decides, never the data: without its own opt-in nothing is unpickled
    with pytest.raises(SerializationError, match="'obj'.*did not opt in to unpickling"):
        decode_fields(cols, 3)
    monkeypatch.setenv("DATAPLANE_ALLOW_PICKLE", "1")
    assert encode_fields({"obj": rows}, 3)["obj"].spec.kind == "object"


def test_json_like_rows_need_no_pickle(monkeypatch):
    monkeypatch.delenv("DATAPLANE_ALLOW_PICKLE", raising=False)
    chats = [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "score": 0.5}],
        [],
        None,
    ]
    cols = encode_fields({"chat": chats, "s": ["a", None, "c"], "mixed": [1, "two", [3.0, None]]}, 3)
    assert {c.spec.kind for c in cols.values()} == {"json"}
    out = decode_fields(cols, 3)
    assert out.get("chat").tolist() == chats
    assert out.get("s").tolist() == ["a", None, "c"]
    assert out.get("mixed").tolist() == [1, "two", [3.0, None]]
    assert roundtrip({"t": [(1, 2), {"k": (3,)}]}, 2).get("t").tolist() == [[1, 2], {"k": [3]}]  # as JSON
    with pytest.raises(SerializationError, match="'big'"):  # beyond 64 bits: msgpack cannot carry it
        encode_fields({"big": [2**70, None]}, 2)


def _nested(levels: int) -> object:
    """A JSON-like value ``levels`` lists and dicts deep (``[{"a": [...]}]``)."""
    value: object = 1
    for i in range(levels):
        value = [value] if i % 2 else {"a": value}
    return value


def test_json_like_rows_nest_32_levels_and_deeper_ones_say_so(monkeypatch):
    """The depth limit is stated (``MAX_DEPTH``): 32 levels are a json column; 33 are refused naming
    the field and the limit (the old code called them values that "need pickle"), or pickled when
    pickle is allowed."""
    from dataplane.codec.plain import MAX_DEPTH

    monkeypatch.delenv("DATAPLANE_ALLOW_PICKLE", raising=False)
    assert MAX_DEPTH == 32
    deepest = [_nested(MAX_DEPTH), None]
    cols = encode_fields({"m": deepest}, 2)
    assert cols["m"].spec.kind == "json"
    assert decode_fields(cols, 2).get("m").tolist() == deepest
    too_deep = [_nested(MAX_DEPTH + 1), None]
    with pytest.raises(SerializationError, match=r"'m'.*row 0.*nested deeper than 32 levels") as err:
        encode_fields({"m": too_deep}, 2)
    assert "need pickle" not in str(err.value) and "Flatten" in str(err.value), err.value
    assert encode_fields({"m": too_deep}, 2, allow_pickle=True)["m"].spec.kind == "object"
    from dataplane.client.ops import _check_tags  # a tag: the same limit, the same words

    with pytest.raises(TypeError, match=r"tags\[0\]\['t'\].*nested deeper than 32 levels.*a tag"):
        _check_tags([{"t": _nested(MAX_DEPTH)}], 1)


def test_non_column_value_is_rejected_with_the_field():
    with pytest.raises(SerializationError, match="'cfg' is a dict, not a column of 2 rows"):
        encode_fields({"cfg": {"a": 1}}, 2)
    with pytest.raises(SerializationError, match="'e' is an empty list"):
        encode_fields({"e": []}, 0)


def _sparse_or_meta(kind: str, how: str) -> object:
    """A field of 2 rows (or one row, for ``kv_put``) of ``kind``, given the way ``how`` says."""
    dense = torch.arange(6.0).view(2, 3)
    if kind == "meta-nested":  # (no rows can be taken out of it: given whole every way)
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(1)], layout=torch.jagged).to("meta")
    make = {
        "sparse-coo": lambda t: t.to_sparse(),
        "sparse-csr": lambda t: t.view(1, -1).to_sparse_csr(),  # (CSR has 2 dims)
        "meta": lambda t: t.to("meta"),
    }[kind]
    if how == "row-list":
        return [make(r) for r in dense.unbind()]
    if how == "kv_put-row":
        return make(dense[0])
    return make(dense) if kind != "sparse-csr" else dense.to_sparse_csr()


@pytest.mark.parametrize("kind", ["sparse-coo", "sparse-csr", "meta", "meta-nested"])
@pytest.mark.parametrize("how", ["batch", "tensordict", "row-list", "kv_put-row"])
def test_sparse_and_meta_tensors_are_refused_naming_the_field(kind, how):
    """torch raised its own untyped errors (NotImplementedError for meta tensors, RuntimeError for a
    sparse row): each is a SerializationError naming the field and saying what to do."""
    value = _sparse_or_meta(kind, how)
    hint = "to_dense" if kind.startswith("sparse") else "meta device"
    with pytest.raises(SerializationError, match=f"'f'.*{hint}"):
        if how in ("batch", "row-list"):
            encode_fields({"f": value}, 2)
        elif how == "tensordict":
            encode_fields(TensorDict({"f": value}, [2]), 2)
        else:
            encode_row({"f": value})


# -- batch size and schema errors ---------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [torch.zeros(3, 2), np.zeros(3), ["a", "b", "c"], [torch.zeros(1)] * 3],
    ids=["tensor", "ndarray", "list", "tensor-list"],
)
def test_batch_size_mismatch_names_field_and_sizes(value):
    with pytest.raises(BatchSizeError, match="'f' has 3 rows but the batch has 4"):
        encode_fields({"f": value}, 4)


def test_zero_d_tensor_is_a_batch_size_error():
    with pytest.raises(BatchSizeError, match="'x' is a 0-d tensor"):
        encode_fields({"x": torch.tensor(1.0)}, 1)


def test_decode_row_count_mismatch():
    cols = encode_fields({"x": torch.zeros(2)}, 2)
    with pytest.raises(BatchSizeError, match="'x' has 2 rows, expected 3"):
        decode_fields(cols, 3)


def test_spec_compatibility_is_dtype_and_dims_not_shape():
    spec = ColumnSpec("dense", "float32", (4,))
    for same in (
        ColumnSpec("dense", "float32", (4,)),
        ColumnSpec("dense", "float32", (5,)),  # rows of another length
        ColumnSpec("jagged", "float32", ()),  # rows of many lengths
        ColumnSpec("ragged", "float32", (1,)),
    ):
        spec.check_compatible(same, "x")
    for other, what in (
        (ColumnSpec("dense", "bfloat16", (4,)), "bfloat16 tensors with 1 dim per row"),
        (ColumnSpec("jagged", "float32", (4,)), "float32 tensors with 2 dims per row"),
        (ColumnSpec("arrow", "large_string", ()), "arrow large_string values"),
    ):
        with pytest.raises(SchemaError) as info:
            spec.check_compatible(other, "logp")
        msg = str(info.value)
        assert info.value.field == "logp" and "'logp'" in msg
        assert what in msg and "float32 tensors with 1 dim per row" in msg


def test_row_nbytes():
    assert ColumnSpec("dense", "bfloat16", (2, 3)).row_nbytes() == 12
    assert ColumnSpec("dense", "bool", ()).row_nbytes() == 1
    assert ColumnSpec("jagged", "float32", (3,)).row_nbytes() is None


# -- encode_row ---------------------------------------------------------------------------------


def test_encode_row_kinds():
    cols = encode_row(
        {
            "t": torch.tensor([1, 2, 3]),
            "scalar": torch.tensor(0.5),
            "text": "hi",
            "ids": [4, 5],
            "r": 1.0,
            "resp": [torch.ones(2, 2)],
        }
    )
    assert all(c.num_rows == 1 for c in cols.values())
    assert cols["t"].spec == ColumnSpec("dense", "int64", (3,))
    assert cols["scalar"].spec == ColumnSpec("dense", "float32", ())
    assert cols["text"].spec.dtype == "large_string"
    assert cols["ids"].spec.dtype == "large_list<int64>"
    assert cols["r"].spec == ColumnSpec("dense", "float64", ())
    assert cols["resp"].spec == ColumnSpec("jagged", "float32", (2,))
    td = decode_fields(cols, 1)
    assert td["t"].tolist() == [[1, 2, 3]] and td.get("text").tolist() == ["hi"]
    assert td.get("ids").tolist() == [[4, 5]]


@pytest.mark.parametrize(
    "value",
    [
        torch.tensor(7),
        torch.arange(6, dtype=torch.int32).view(2, 3),
        torch.zeros(0),
        torch.tensor([True, False]),
        torch.arange(6.0).view(2, 3)[:, 1],  # not contiguous: the general path copies it
        torch.ones(3, requires_grad=True),
        torch.ones(3, dtype=torch.bfloat16),  # no numpy dtype
        torch.ones(2, dtype=torch.uint16),
        torch.tensor([1 + 2j, 3 - 1j]).conj(),  # conjugate bit: resolved by the general path
        torch.ones(3)._neg_view(),
    ],
)
def test_encode_row_of_plain_tensors_is_the_general_paths_row(value):
    """A dict of plain CPU tensors takes a shortcut (``plain_rows``); its columns are the ones the
    general path makes for a batch of one, and a tensor the shortcut cannot view falls back to it."""
    got = encode_row({"x": value, "y": torch.tensor(1.5)})
    want = encode_fields({"x": value.detach()[None], "y": torch.tensor([1.5])}, 1)
    for name in ("x", "y"):
        assert got[name].spec == want[name].spec and got[name].num_rows == 1
        assert bytes(got[name].data) == bytes(want[name].data)
    assert torch.equal(decode_fields(got, 1)["x"][0], value.detach().resolve_conj().resolve_neg())


def test_encode_row_tensordict_batch_one():
    td = TensorDict({"x": torch.zeros(1, 4)}, batch_size=[1])
    assert encode_row(td)["x"].spec.shape == (4,)
    with pytest.raises(BatchSizeError, match="batch size 2"):
        encode_row(TensorDict({"x": torch.zeros(2, 4)}, batch_size=[2]))
    assert encode_row(TensorDict({"x": torch.zeros(4)}, batch_size=[]))["x"].spec.shape == (4,)


# -- gather -------------------------------------------------------------------------------------


def _expect(value, rows):
    if isinstance(value, torch.Tensor):
        return value[rows]
    return [value[i] for i in rows]


@pytest.mark.parametrize("kind", ["dense", "dense-bf16", "jagged", "string", "lists", "object"])
def test_gather_across_parts_with_uneven_rows(kind):
    g = torch.Generator().manual_seed(1)
    parts_values = []
    for n in (5, 7):
        if kind == "dense":
            parts_values.append(torch.randn(n, 3, generator=g))
        elif kind == "dense-bf16":
            parts_values.append(torch.randn(n, 5, generator=g).bfloat16())
        elif kind == "jagged":
            parts_values.append(
                [torch.randn(int(torch.randint(0, 6, (1,), generator=g)), 2) for _ in range(n)]
            )
        elif kind == "string":
            parts_values.append(
                ["x" * int(torch.randint(0, 9, (1,), generator=g)) + str(i) for i in range(n)]
            )
        elif kind == "lists":
            parts_values.append([list(range(int(torch.randint(0, 5, (1,), generator=g)))) for _ in range(n)])
        else:
            parts_values.append([{"i": i, "pad": "y" * i} for i in range(n)])
    cols = [encode_fields({"f": v}, len(v), allow_pickle=True)["f"] for v in parts_values]
    picks = [np.array([4, 0, 2, 2 - 1]), np.array([6, 5, 0, 1, 2])]
    parts = list(zip(cols, picks, strict=True))
    out = gather(parts, field="f")
    assert out.num_rows == 9 and out.nbytes == gathered_nbytes(parts)
    got = decode_fields({"f": out}, 9)
    expected = [x for v, p in zip(parts_values, picks, strict=True) for x in _expect(v, p.tolist())]
    if kind.startswith("dense"):
        assert same_bits(got["f"], torch.stack(expected))
    elif kind == "jagged":
        assert all(torch.equal(a, b) for a, b in zip(got["f"].unbind(), expected, strict=True))
    else:
        assert got.get("f").tolist() == expected


@pytest.mark.parametrize("row_bytes", [3, 40, 2000], ids=["tiny", "small", "large"])
def test_gather_variable_rows_runs_and_permutations(row_bytes):
    # tiny / small rows take the vectorised path, large rows one copy per merged run
    rng = np.random.default_rng(0)
    rows = [
        bytes(rng.integers(0, 256, int(rng.integers(0, 2 * row_bytes)), dtype=np.uint8)) for _ in range(50)
    ]
    col = encode_fields({"b": rows}, 50)["b"]
    idx = np.concatenate([np.arange(10, 20), rng.permutation(50)[:20], np.arange(30, 35)])
    got = decode_fields({"b": gather([(col, idx)])}, idx.size).get("b").tolist()
    assert got == [rows[i] for i in idx]


def test_gather_dense_random_permutation_matches_index():
    x = torch.randn(64, 7)  # 28-byte rows: int32 words
    col = encode_fields({"x": x}, 64)["x"]
    idx = np.random.default_rng(0).permutation(64)
    assert torch.equal(decode_fields({"x": gather([(col, idx)])}, 64)["x"], x[idx])


def test_gather_into_out_buffer_writes_there():
    x = torch.arange(10, dtype=torch.float32)
    col = encode_fields({"x": x}, 10)["x"]
    out = bytearray(100)
    res = gather([(col, [9, 1]), (col, [3])], memoryview(out))
    assert addr(res.data) == addr(out) and res.nbytes == 12
    assert np.frombuffer(out, dtype=np.float32, count=3).tolist() == [9.0, 1.0, 3.0]
    with pytest.raises(ValueError, match="out has 4 bytes, 12 are needed"):
        gather([(col, [9, 1]), (col, [3])], memoryview(bytearray(4)))
    with pytest.raises(ValueError, match="read-only"):
        gather([(col, [1])], memoryview(bytes(8)))


def test_gather_errors():
    a = encode_fields({"x": torch.zeros(3)}, 3)["x"]
    b = encode_fields({"x": torch.zeros(3, dtype=torch.float64)}, 3)["x"]
    with pytest.raises(SchemaError, match="'logp'.*float64.*float32"):
        gather([(a, [0]), (b, [0])], field="logp")
    with pytest.raises(IndexError, match="row 3 of part 0 is out of range"):
        gather([(a, [0, 3])])
    with pytest.raises(ValueError, match="at least one part"):
        gather([])


@pytest.mark.parametrize("row_bytes", [3, 40, 3000], ids=["tiny", "small", "large"])
@pytest.mark.parametrize("order", ["in-order", "scattered"])
def test_assemble_matches_row_by_row_reference(row_bytes, order, monkeypatch):
    # every copy path of the store's assembly: dense and variable rows, per-run loops and vectorised
    monkeypatch.setattr(_rows, "_TAKE_CHUNK_BYTES", 50)  # vectorised takes in several chunks
    rng = np.random.default_rng(row_bytes)
    n = 64
    dense = encode_fields({"x": torch.randint(0, 100, (n, row_bytes), dtype=torch.int8)}, n)["x"]
    rows = [
        bytes(rng.integers(0, 256, int(rng.integers(0, 2 * row_bytes)), dtype=np.uint8)) for _ in range(n)
    ]
    var = encode_fields({"b": rows}, n)["b"]
    src_a = np.concatenate([np.arange(5, 25), rng.permutation(n)[:20]])
    src_b = rng.permutation(n)[:24]
    dst = np.arange(64) if order == "in-order" else rng.permutation(64)
    pieces_src = [(src_a, dst[:40]), (src_b, dst[40:])]
    for col in (dense, var):
        out = assemble(col.spec, 64, [(col, s, d) for s, d in pieces_src])
        want = [b""] * 64
        for s, d in pieces_src:
            for i, j in zip(s.tolist(), d.tolist(), strict=True):
                want[j] = bytes(col.data[slice(*col.row_range(i, i + 1))])
        got = [bytes(out.data[slice(*out.row_range(i, i + 1))]) for i in range(64)]
        assert out.num_rows == 64 and got == want


def test_gather_view_is_zero_copy_for_one_contiguous_run():
    rows = ["a", "bb", "ccc", "dddd"]
    col = encode_fields({"s": rows}, 4)["s"]
    view = gather_view([(col, np.array([1, 2]))])
    assert view.offsets.tolist() == [0, 2, 5]
    assert addr(view.data) == addr(col.data) + 1
    assert decode_fields({"s": view}, 2).get("s").tolist() == ["bb", "ccc"]
    x = torch.arange(8.0).view(4, 2)
    dcol = encode_fields({"x": x}, 4)["x"]
    dview = gather_view([(dcol, [2, 3])])
    assert decode_fields({"x": dview}, 2)["x"].data_ptr() == x[2].data_ptr()
    assert gather_view([(col, [2, 1])]) is None
    assert gather_view([(col, [0]), (col, [1])]) is None


def test_slice_rows_bounds():
    col = encode_fields({"x": torch.zeros(4)}, 4)["x"]
    assert slice_rows(col, 1, 1).num_rows == 0
    with pytest.raises(IndexError, match="out of range"):
        slice_rows(col, 2, 5)


# -- devices ------------------------------------------------------------------------------------


def test_cpu_tensors_skip_the_cuda_staging_path():
    cuda_was_initialized = torch.cuda.is_initialized()
    x = torch.randn(4, 3)
    col = encode_fields({"x": x, "j": [torch.ones(2), torch.ones(1), torch.ones(0), torch.ones(3)]}, 4)["x"]
    assert addr(col.data) == x.data_ptr()  # no staging copy
    assert torch.cuda.is_initialized() == cuda_was_initialized
    td = decode_fields({"x": col}, 4, device="cpu")
    assert td["x"].device.type == "cpu" and torch.equal(td["x"], x)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_staged_and_come_back_on_device():
    x = torch.randn(8, 6, device="cuda").bfloat16()[:, ::2]  # non-contiguous bf16 on GPU
    rows = [torch.randn(n, 2, device="cuda") for n in (1, 0, 3)]
    nt = torch.nested.nested_tensor(
        [torch.ones(2, device="cuda"), torch.ones(1, device="cuda")], layout=torch.jagged
    )
    cols = encode_fields({"x": x, "b": x > 0}, 8)
    assert cols["x"].spec == ColumnSpec("dense", "bfloat16", (3,))
    td = decode_fields(cols, 8, device="cuda")
    assert td["x"].device.type == "cuda" and same_bits(td["x"], x) and torch.equal(td["b"], x > 0)
    jag = decode_fields(encode_fields({"j": rows}, 3), 3, device="cuda")["j"]
    assert jag.is_cuda and all(torch.equal(a, b) for a, b in zip(jag.unbind(), rows, strict=True))
    assert decode_fields(encode_fields({"nt": nt}, 2), 2)["nt"].values().tolist() == [1.0, 1.0, 1.0]
