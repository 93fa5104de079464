"""Defects found by the twelfth round of attacks, each with the test that failed before its mend:
sharded and dataset writers given a URL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stream_st
from stream_st import ArgumentTypeError, UnsupportedSinkError

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    "url",
    [
        "s3://bucket/ckpt/",
        "https://user:secret@example.invalid/up/?X-Amz-Signature=abc",
        "tcp://127.0.0.1:1",
    ],
)
async def test_a_sharded_or_dataset_writer_given_a_url_refuses_it_rather_than_making_local_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedSinkError, match="local folder") as info:
        stream_st.open_sharded_writer(url)
    assert "secret" not in str(info.value) and "abc" not in str(info.value)
    with pytest.raises(UnsupportedSinkError, match="local folder"):
        stream_st.open_dataset_writer(url)
    assert list(tmp_path.iterdir()) == []  # no "s3:" or "https:" folder


async def test_a_sharded_writer_takes_a_file_url_as_its_folder(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    async with stream_st.open_sharded_writer(folder.as_uri()) as writer:
        await writer.write("w", np.arange(4, dtype=np.float32))
    assert (folder / "model.safetensors").exists() or list(folder.glob("*.safetensors"))


def test_a_folder_of_another_type_is_an_argument_type_error() -> None:
    with pytest.raises(ArgumentTypeError, match="path or a file:// URL"):
        stream_st.open_sharded_writer(5)  # type: ignore[arg-type]


def test_the_reference_s_private_names_programs_import_are_there() -> None:
    """torch's checkpoint reader imports ``_getdtype`` from ``safetensors.torch``, vLLM
    ``_TYPES``: the drop-ins have them, as the reference's tables say."""
    torch = pytest.importorskip("torch")
    import safetensors.numpy as reference_numpy
    import safetensors.torch as reference_torch

    import stream_st.numpy
    import stream_st.torch
    from stream_st import compat

    for code, dtype in reference_torch._TYPES.items():
        assert stream_st.torch._TYPES[code] is dtype
        assert stream_st.torch._getdtype(code) is dtype
    assert all(stream_st.torch._SIZE[d] == n for d, n in reference_torch._SIZE.items() if d)
    assert stream_st.torch.TensorSpec is compat.TensorSpec
    assert stream_st.torch.deserialize is compat.deserialize
    assert stream_st.torch.serialize is compat.serialize
    assert stream_st.torch.serialize_file is compat.serialize_file
    with pytest.raises(KeyError):
        stream_st.torch._getdtype("NOPE")
    assert {c: np.dtype(t) for c, t in reference_numpy._TYPES.items()} == stream_st.numpy._TYPES
    arrays: dict[str, np.ndarray[Any, Any]] = {
        "a": np.arange(6, dtype=np.int16).reshape(2, 3),
        "b": np.ones(2, np.float64),
    }
    got = stream_st.numpy._view2np(compat.deserialize(reference_numpy.save(arrays)))
    assert all(np.array_equal(got[name], array) for name, array in arrays.items())
    assert torch.float32 in stream_st.torch._SIZE


def test_safe_open_numpy_arrays_are_copies_of_their_own(tmp_path: Path) -> None:
    """The reference hands each numpy array out a copy: writing to one changes no later read."""
    import stream_st.numpy

    file = tmp_path / "a.safetensors"
    stream_st.numpy.save_file({"x": np.arange(4, dtype=np.float32)}, file)
    with stream_st.numpy.safe_open(file, "np") as opened:
        first = opened.get_tensor("x")
        first *= 10
        part = opened.get_slice("x")[0:2]
        part[0] = 7
        assert opened.get_tensor("x").tolist() == [0, 1, 2, 3]
        assert opened.get_slice("x")[0:2].tolist() == [0, 1]
        assert opened.get_tensors()["x"].tolist() == [0, 1, 2, 3]


def test_a_torch_slice_written_to_never_makes_the_whole_tensor_look_corrupt(
    tmp_path: Path,
) -> None:
    """Rows of a mapped tensor whose digest is recorded and not yet checked are a copy: the
    caller's writes to them are no damage a later whole read reports."""
    torch = pytest.importorskip("torch")
    import stream_st.torch

    file = tmp_path / "a.safetensors"
    stream_st.torch.save_file({"x": torch.arange(4.0)}, file, checksums=True)
    with stream_st.torch.safe_open(file, "pt") as opened:
        part = opened.get_slice("x")[0:2]
        part[0] = 5
        whole = opened.get_tensor("x")
        assert whole.tolist() == [0, 1, 2, 3]
        whole[1] = 9  # a view of the checked tensor, as the reference's: later reads see it
        assert opened.get_slice("x")[0:2].tolist() == [0, 9]


def test_s3_keys_with_a_question_mark_or_a_hash_are_cache_keys_of_their_own() -> None:
    """An s3:// key runs to its end (``?`` and ``#`` included): two such objects never share a
    cached copy; a plain key keeps the key it had."""
    import hashlib

    from stream_st.transports.cache.keys import object_key

    keys = {object_key(f"s3://b/m{tail}").key for tail in ("#1", "#2", "?v=1", "?v=2", "")}
    assert len(keys) == 5
    plain = object_key("s3://b/ckpt/m.safetensors")
    assert plain.key == hashlib.sha256(b"s3://b/ckpt/m.safetensors").hexdigest()[:40]
    assert plain.shown == "s3://b/ckpt/m.safetensors"


def test_a_sharded_checkpoint_under_an_s3_prefix_with_a_question_mark_is_an_index() -> None:
    """An s3:// key runs to its end: an index under ``ck?v/`` is an index, and its shards lie
    beside it, where a URL split would have cut the key at ``?``."""
    from stream_st.core.shards import is_index, shard_address
    from stream_st.tools.cp import address_in

    index = "s3://bkt/ck?v#1/model.safetensors.index.json"
    assert is_index(index)
    assert shard_address(index, "model-1.safetensors") == "s3://bkt/ck?v#1/model-1.safetensors"
    assert address_in("s3://bkt/p?x/", "m.safetensors") == "s3://bkt/p?x/m.safetensors"
    signed = "https://h/a/model.safetensors.index.json?sig=1"  # a URL's query stays one
    assert shard_address(signed, "x y.safetensors") == "https://h/a/x%20y.safetensors?sig=1"


async def test_a_chunk_generator_may_reuse_its_buffer_once_the_chunk_is_taken() -> None:
    """A generator that yields one bytearray, then clears and refills it: each chunk is let go
    of once taken, so the producer's buffer is free again (no BufferError)."""
    import safetensors.numpy as reference_numpy

    arrays: dict[str, np.ndarray[Any, Any]] = {
        "a": np.arange(1000, dtype=np.float32),
        "b": np.ones(300, np.int16),
    }
    data = reference_numpy.save(arrays)

    async def chunks() -> Any:
        buffer = bytearray()
        for start in range(0, len(data), 777):
            buffer.clear()
            buffer += data[start : start + 777]
            yield buffer

    got = {name: array async for name, array in stream_st.open_stream(chunks())}
    assert all(np.array_equal(got[name], array) for name, array in arrays.items())


async def test_an_anyio_stream_that_gives_more_than_asked_or_text_is_refused() -> None:
    import anyio.abc
    import safetensors.numpy as reference_numpy

    data = reference_numpy.save({"a": np.arange(10, dtype=np.float32)})

    class Loose(anyio.abc.ByteReceiveStream):
        def __init__(self, answer: Any) -> None:
            self.answer = answer

        async def receive(self, max_bytes: int = 65536) -> bytes:
            answer: bytes = self.answer
            return answer

        async def aclose(self) -> None:
            pass

    with pytest.raises(stream_st.TransportError, match="at most 8 were asked for"):
        await stream_st.load(Loose(data))
    with pytest.raises(stream_st.UnsupportedSourceError, match="gave str"):
        await stream_st.load(Loose("text"))


@pytest.mark.parametrize("shape", [(-1,), (-1, 2)], ids=["float32", "2-D"])
async def test_a_stream_giving_memoryviews_of_any_format_is_read_by_their_bytes(
    shape: tuple[int, ...],
) -> None:
    """An anyio byte stream whose ``receive`` gives memoryviews of float32 items (counted as
    items, not bytes, by ``len``) or of two dimensions: read as their bytes (a bare
    ``ValueError`` before, from copying the view into the buffer)."""
    import anyio.abc
    import safetensors.numpy as reference_numpy

    data = reference_numpy.save({"a": np.arange(6, dtype=np.float32)})

    class Views(anyio.abc.ByteReceiveStream):
        def __init__(self) -> None:
            self.at = 0

        async def receive(self, max_bytes: int = 65536) -> Any:  # not bytes, on purpose
            if self.at >= len(data):
                raise anyio.EndOfStream
            piece = data[self.at : self.at + 8]
            self.at += len(piece)
            return np.frombuffer(piece, np.float32).reshape(shape).data

        async def aclose(self) -> None:
            pass

    loaded = await stream_st.load(Views())
    assert loaded["a"].tolist() == list(range(6))


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 404 Not Found\nFAKE: second line\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 300 Multiple Choices\r\nLocation: /a\nInjected: b\r\nContent-Length: 0\r\n\r\n",
    ],
)
async def test_an_answer_s_bare_line_feed_never_makes_a_message_of_two_lines(
    answer: bytes,
) -> None:
    from ..servers.http_server import RangeHTTPServer
    from ..servers.lossy_proxy import LossyProxy

    with RangeHTTPServer() as server, LossyProxy(server.port) as proxy:
        proxy.lose("GET", "", answer, times=None)
        with pytest.raises(stream_st.SafetensorsError) as info:
            await stream_st.load(proxy.url + "/m.safetensors")
    assert "\n" not in str(info.value) and "\r" not in str(info.value)
    assert "second line" not in str(info.value) and "Injected" not in str(info.value)


async def test_a_416_to_the_first_bytes_of_an_object_it_says_holds_some_is_no_empty_file() -> None:
    from ..servers.http_server import RangeHTTPServer
    from ..servers.lossy_proxy import LossyProxy

    refusal = b"HTTP/1.1 416 Range Not Satisfiable\r\nContent-Range: bytes */504232\r\n"
    with RangeHTTPServer() as server, LossyProxy(server.port) as proxy:
        proxy.lose("GET", "", refusal + b"Content-Length: 0\r\n\r\n", times=None)
        with pytest.raises(stream_st.HTTPProtocolError, match="holds 504232 bytes"):
            await stream_st.load(proxy.url + "/m.safetensors")
