"""``deserialize`` (:mod:`stream_st.compat`'s, which ``stream_st.numpy``, ``stream_st.torch`` and
an installed ``safetensors`` hand out) checks each tensor against the digest a checksummed
file's header records, as every other reader does (docs/dropin.md, Integrity): a damaged byte
or a damaged record raises :class:`~stream_st.IntegrityError` where it handed the damaged bytes
out; ``verify=False`` skips the check. A file without digests gives what it gave before."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import stream_st
import stream_st.compat as compat
import stream_st.numpy as sn
from stream_st.core.digests import DIGEST_KEY_PREFIX
from stream_st.core.header import parse_header

ARRAYS: dict[str, np.ndarray[Any, Any]] = {
    "a": np.arange(8, dtype=np.float32),
    "b": np.arange(6, dtype=np.int16).reshape(2, 3),
}
"""Two tensors; ``b`` lies last in the file, so the file's last byte is one of ``b``'s."""


def damaged(data: bytes) -> bytes:
    """``data`` with its last byte (one of the last tensor's) flipped."""
    out = bytearray(data)
    out[-1] ^= 0xFF
    return bytes(out)


def expected(data: bytes) -> list[tuple[str, dict[str, Any]]]:
    """What ``deserialize`` gives for ``data``, built from its header by hand: each tensor's
    name, dtype code, shape as a list and bytes as a ``bytearray``, in offset order."""
    length = int.from_bytes(data[:8], "little")
    header = parse_header(data[8 : 8 + length])
    base = header.data_start
    return [
        (
            info.name,
            {
                "dtype": info.dtype,
                "shape": list(info.shape),
                "data": bytearray(data[base + info.start : base + info.end]),
            },
        )
        for info in header.tensors
    ]


def test_a_damaged_tensor_raises_integrity_error() -> None:
    """A byte flipped in a tensor's data: the IntegrityError ``load`` raises, naming the
    tensor, where ``deserialize`` handed the damaged bytes out."""
    data = damaged(sn.save(ARRAYS, checksums=True))
    with pytest.raises(stream_st.IntegrityError) as loaded:
        sn.load(data)
    with pytest.raises(stream_st.IntegrityError) as got:
        compat.deserialize(data)
    assert got.value.name == loaded.value.name == "b"
    assert str(got.value) == str(loaded.value)
    for given in (bytearray(data), memoryview(data)):
        with pytest.raises(stream_st.IntegrityError):
            compat.deserialize(given)


def test_the_drop_ins_deserialize_checks_too() -> None:
    """``stream_st.numpy.deserialize`` (and ``safetensors.numpy``'s once installed) is the same
    function, checked the same way, ``verify=`` passed through."""
    data = damaged(sn.save(ARRAYS, checksums=True))
    assert sn.deserialize is compat.deserialize
    with pytest.raises(stream_st.IntegrityError):
        sn.deserialize(data)
    assert sn.deserialize(data, verify=False) == expected(data)


def test_verify_false_gives_the_bytes_unchecked() -> None:
    """``verify=False``: the file's bytes as they are, damaged or not, as the reference gives
    them; a header's damaged record is not looked at either."""
    data = damaged(sn.save(ARRAYS, checksums=True))
    assert compat.deserialize(data, verify=False) == expected(data)
    assert compat.deserialize(bytes=data, verify=False) == expected(data)
    unchecked = compat.deserialize(data, verify=np.bool_(False))  # type: ignore[arg-type]
    assert unchecked == expected(data)  # numpy's bool_ taken as the other readers take it


def test_an_intact_checksummed_file_reads_as_before() -> None:
    """Checked and found intact: the same entries as unchecked, of the same types."""
    data = sn.save(ARRAYS, checksums=True)
    got = compat.deserialize(data)
    assert got == compat.deserialize(data, verify=False) == expected(data)
    assert [type(entry["data"]) for _, entry in got] == [bytearray, bytearray]
    for name, entry in got:
        assert np.frombuffer(entry["data"], ARRAYS[name].dtype).tobytes() == ARRAYS[name].tobytes()


def test_a_file_without_digests_reads_as_before() -> None:
    """No digests recorded: nothing to check, the reference's entries unchanged (with its
    metadata too, ``verify=`` either way)."""
    for metadata in (None, {"format": "np"}):
        data = sn.save(ARRAYS, metadata=metadata)
        got = compat.deserialize(data)
        assert got == compat.deserialize(data, verify=False) == expected(data)
        assert [(type(n), type(e["dtype"]), type(e["shape"]), type(e["data"])) for n, e in got] == [
            (str, str, list, bytearray)
        ] * 2


def test_a_damaged_record_raises_integrity_error() -> None:
    """A header whose record cannot be checked (a tensor's digest renamed: one tensor without a
    digest, one digest for no tensor) raises as ``load`` does; ``verify=False`` reads it."""
    intact = sn.save(ARRAYS, checksums=True)
    key = f'"{DIGEST_KEY_PREFIX}a"'.encode()
    data = intact.replace(key, f'"{DIGEST_KEY_PREFIX}z"'.encode())
    assert len(data) == len(intact) and data != intact
    with pytest.raises(stream_st.IntegrityError) as loaded:
        sn.load(data)
    with pytest.raises(stream_st.IntegrityError) as got:
        compat.deserialize(data)
    assert str(got.value) == str(loaded.value)
    assert compat.deserialize(data, verify=False) == expected(data)


def test_verify_is_keyword_only_and_a_bool() -> None:
    """``verify`` is keyword-only (the reference's one argument stays the only positional) and
    True or False: a string such as ``"no"`` is refused, not taken as true."""
    data = sn.save(ARRAYS, checksums=True)
    with pytest.raises(TypeError):
        compat.deserialize(data, False)  # type: ignore[call-arg]
    with pytest.raises(stream_st.ArgumentTypeError):
        compat.deserialize(data, verify="no")  # type: ignore[arg-type]
