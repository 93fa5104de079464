"""A KV-mode shard's rows told from its own header (``read_shard_rows``): read a field at a time
where the header is written compactly, as a KV shard's is, by the general parse otherwise; the
same rows either way, and the same refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stream_st
from stream_st import HeaderError
from stream_st.core.layout import framed_header
from stream_st.integrations import dataset
from stream_st.integrations.dataset import (
    DatasetInfo,
    kv_rows,
    read_kv_rows,
    read_shard_rows,
    whole_rows,
)

pytest.importorskip("pyarrow")

COLUMNS = ["n", "x"]
DATA = np.arange(4, dtype=np.int64).tobytes()  # four tensors of 8 bytes


def entries(names: str = "ab") -> dict[str, Any]:
    """Rows ``names``: ``n`` an I64 number, ``x`` two F32, back to back in that order."""
    out: dict[str, Any] = {}
    for name in names:
        for column, code, shape in (("n", "I64", []), ("x", "F32", [2])):
            start = 8 * len(out)
            out[f"{name}__{column}"] = {
                "dtype": code,
                "shape": shape,
                "data_offsets": [start, start + 8],
            }
    return out


COMPACT = (",", ":")


def header(members: dict[str, Any], separators: tuple[str, str] = COMPACT, **options: Any) -> str:
    return json.dumps(members, separators=separators, **options)


def shard(path: Path, text: str, data: bytes = DATA) -> str:
    path.write_bytes(framed_header(text.encode()) + data)
    return str(path)


def raw_header(path: str) -> Any:
    blob = Path(path).read_bytes()
    return np.frombuffer(blob, np.uint8)[8 : 8 + int.from_bytes(blob[:8], "little")]


def reordered() -> dict[str, Any]:
    members = entries()
    return {key: dict(reversed(list(entry.items()))) for key, entry in members.items()}


VALID = {  # the header, whether it is compact, the first row's name
    "compact": (header(entries()), True, "a"),
    "non-ASCII names": (header(entries("éb"), ensure_ascii=False), True, "é"),
    "spaces": (header(entries(), (", ", ": ")), False, "a"),
    "fields in another order": (header(reordered()), False, "a"),
    "tensors out of offset order": (header(dict(reversed(entries().items()))), False, "a"),
    "metadata": (header({"__metadata__": {"k": "v"}, **entries()}), False, "a"),
    "escaped names": (header(entries("éb"), ensure_ascii=True), False, "é"),
}


@pytest.mark.parametrize("case", list(VALID))
async def test_rows_are_the_same_whichever_way_the_header_is_read(
    tmp_path: Path, case: str
) -> None:
    text, compact, first = VALID[case]
    path = shard(tmp_path / "s.safetensors", text)
    assert (dataset._compact_tensors(raw_header(path)) is not None) == compact
    rows = await read_shard_rows(path, COLUMNS, "__", size=Path(path).stat().st_size)
    parsed = await stream_st.read_header(path)
    general = kv_rows(DatasetInfo(str(tmp_path), (path,), (parsed,), {}, True), COLUMNS, "__")
    assert rows.names == general.names == [first, "b"]
    assert rows.bases == general.bases
    for column in COLUMNS:
        ours, theirs = rows.columns[column], general.columns[column]
        for field in ("shard", "start", "end"):
            assert getattr(ours, field).tolist() == getattr(theirs, field).tolist()
        assert [ours.specs[s] for s in ours.spec] == [theirs.specs[s] for s in theirs.spec]
    values = await read_kv_rows(rows)
    assert np.asarray(values["n"]).tolist() == [0, 2]


BAD = {
    "a leading zero": (header(entries()).replace("[8,16]", "[8,016]"), "JSON"),
    "a hole": (header(entries()).replace("[16,24]", "[17,25]"), "hole"),
    "a size the dtype does not make": (header(entries()).replace("[2]", "[3]"), "bytes|offsets"),
    "a key twice": (
        header(entries("a")) + header(entries("a")).replace("0,8", "16,24"),
        "twice|duplicate",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
async def test_a_bad_header_is_refused_either_way(tmp_path: Path, case: str) -> None:
    text, message = BAD[case]
    if case == "a key twice":  # two objects joined: the same members, listed twice
        text = text.replace("}{", ",")
    path = shard(tmp_path / "s.safetensors", text)
    with pytest.raises(HeaderError, match=message):
        await read_shard_rows(path, COLUMNS, "__")


async def test_a_shard_of_another_size_than_the_manifest_says_is_refused(tmp_path: Path) -> None:
    path = shard(tmp_path / "s.safetensors", header(entries()))
    with pytest.raises(HeaderError, match="the manifest says 10 bytes"):
        await read_shard_rows(path, COLUMNS, "__", size=10)


def test_whole_rows_needs_the_record_and_every_shards_count() -> None:
    record = {"name_col": "name", "spark_type": "string", "separator": "__"}
    shards = [{"shard_path": "a.safetensors", "samples_count": 2, "bytes": 10}]
    assert whole_rows({"kv": {**record, "whole_rows": True}, "shards": shards})
    assert not whole_rows({"kv": record, "shards": shards})
    assert not whole_rows({"kv": {**record, "whole_rows": "yes"}, "shards": shards})
    lacking = [{"shard_path": "a.safetensors", "bytes": 10}]
    assert not whole_rows({"kv": {**record, "whole_rows": True}, "shards": lacking})


SPLITS = {  # columns, separator, keys
    "plain": (["n", "x"], "__", ["a__n", "a__x", "é__x", "b__n"]),
    "a name holding the separator": (["n", "x"], "__", ["a__b__n", "a__b__x", "__n", "___x"]),
    "a column ending another": (["x", "ax"], "_", ["n_x", "n_ax", "n_a_x", "a_ax"]),
    "a column holding part of the separator": (["_x", "x"], "__", ["a___x", "a__x"]),
    "a column holding the separator": (["a__b", "b"], "__", ["n__a__b", "n__b"]),
}


@pytest.mark.parametrize("case", list(SPLITS))
def test_keys_are_split_as_split_key_splits_each(case: str) -> None:
    import pyarrow as pa

    columns, separator, keys = SPLITS[case]
    names, owners = dataset._split_keys(pa.array(keys)[1:], columns, separator, "s")
    expected = [dataset.split_key(key, columns, separator) for key in keys[1:]]
    assert list(zip(names.to_pylist(), [columns[i] for i in owners], strict=True)) == expected


def test_a_column_ending_in_part_of_the_separator_is_split_at_its_ending() -> None:
    """``_v`` with ``__`` was split at the key's last ``__``: ``a___v`` as ``a_`` and ``v``."""
    assert dataset.split_key("a___v", ["_v", "w"], "__") == ("a", "_v")
    assert dataset.split_key("a__w", ["_v", "w"], "__") == ("a", "w")


@pytest.mark.parametrize("keys", [["a__n", "a__y"], ["a__n", "n"], ["a__n", "a_n"]])
def test_a_key_of_no_column_is_refused(keys: list[str]) -> None:
    import pyarrow as pa

    with pytest.raises(stream_st.UsageError, match=f"tensor '{keys[1]}' of s is no column"):
        dataset._split_keys(pa.array(keys), COLUMNS, "__", "s")


@pytest.mark.parametrize("separator", ["__", ""])  # numpy's split, and key by key
def test_a_long_key_of_no_column_is_cut_in_the_message(separator: str) -> None:
    """The refused key's repr is cut at 80 characters, whatever its length."""
    import pyarrow as pa

    key = "k" * 10_000 + "__y"
    with pytest.raises(stream_st.UsageError) as caught:
        dataset._split_keys(pa.array(["a__n", key]), COLUMNS, separator, "s")
    message = str(caught.value)
    assert f"tensor {repr(key)[:80]} of s is no column" in message
    assert len(message) < 300
