"""The transports' constructors, and ``serving``, refuse an argument of the wrong type or out of
range as they are called, with a :class:`~stream_st.SafetensorsError` naming it: each was a bare
``TypeError``, ``AttributeError``, ``OSError`` or ``OverflowError``, some only mid-read."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import stream_st
from stream_st.sinks import FileSink
from stream_st.sources import FileSource
from stream_st.transports.http.sink import HttpSink
from stream_st.transports.http.source import HttpSource
from stream_st.transports.hub import HubSource
from stream_st.transports.s3.source import S3Source

from .._util import sample_file

URL = "http://127.0.0.1:9/m.safetensors"

CASES: dict[str, tuple[Callable[[Path], Any], type[Exception], str]] = {
    "HttpSource(None)": (lambda p: HttpSource(None), stream_st.ArgumentTypeError, "url must"),  # type: ignore[arg-type]
    "HttpSource(name=5)": (
        lambda p: HttpSource(URL, name=5),  # type: ignore[arg-type]
        stream_st.ArgumentTypeError,
        "name must be a string",
    ),
    "HttpSource(client=5)": (
        lambda p: HttpSource(URL, client=5),  # type: ignore[arg-type]
        stream_st.ArgumentTypeError,
        "client must be an HTTPClient",
    ),
    "HttpSink(headers=5)": (
        lambda p: HttpSink(URL, headers=5),  # type: ignore[arg-type]
        stream_st.UsageError,
        "headers must be a mapping",
    ),
    "HttpSink(None)": (lambda p: HttpSink(None), stream_st.ArgumentTypeError, "url must"),  # type: ignore[arg-type]
    "S3Source(config=5)": (
        lambda p: S3Source("s3://b/k", config=5),  # type: ignore[arg-type]
        stream_st.ArgumentTypeError,
        "config must be an S3Config",
    ),
    "S3Source(None)": (lambda p: S3Source(None), stream_st.ArgumentTypeError, "url must"),  # type: ignore[arg-type]
    "HubSource(None)": (lambda p: HubSource(None), stream_st.ArgumentTypeError, "url must"),  # type: ignore[arg-type]
    "FileSink(None)": (lambda p: FileSink(None), stream_st.ArgumentTypeError, "path must"),  # type: ignore[arg-type]
    "FileSource(None)": (lambda p: FileSource(None), stream_st.ArgumentTypeError, "path must"),  # type: ignore[arg-type]
    "FileSource(fd=-1)": (
        lambda p: FileSource(p, fd=-1),
        stream_st.UsageError,
        "fd must be an integer >= 0",
    ),
    "FileSource(fd=2**70)": (
        lambda p: FileSource(p, fd=1 << 70),
        stream_st.UsageError,
        "no open file descriptor",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_argument_is_refused_as_the_object_is_made(tmp_path: Path, case: str) -> None:
    make, error, message = CASES[case]
    path = tmp_path / "m.safetensors"
    path.write_bytes(sample_file())
    with pytest.raises(error, match=message):
        make(path)


def test_serving_refuses_a_host_that_is_no_string(tmp_path: Path) -> None:
    """``serving`` runs on asyncio only; ``host=None`` was a bare TypeError (``":" in None``)."""
    path = tmp_path / "m.safetensors"
    path.write_bytes(sample_file())

    async def serve() -> None:
        async with stream_st.serving(path, host=None):  # type: ignore[arg-type]
            pass

    with pytest.raises(stream_st.ArgumentTypeError, match="host must be a string"):
        asyncio.run(serve())


def test_serving_refuses_an_empty_host(tmp_path: Path) -> None:
    """``host=""`` listened on every interface (the command refuses ``--host ""`` for that)
    and gave ``server.url`` as ``http://:PORT/...``, which ``stream_st.load`` refused."""
    path = tmp_path / "m.safetensors"
    path.write_bytes(sample_file())

    async def serve() -> None:
        async with stream_st.serving(path, host=""):
            pass

    refusal = r"host is empty: it would listen on every interface \(name 0\.0\.0\.0 for that\)"
    with pytest.raises(stream_st.UsageError, match=refusal):
        asyncio.run(serve())
    with pytest.raises(stream_st.UsageError, match=refusal):
        stream_st.serve(path, host="")


class _NotAPath:
    """An ``os.PathLike`` whose ``__fspath__`` gives a number."""

    def __fspath__(self) -> Any:
        return 5


async def test_a_path_like_that_gives_no_path_is_an_argument_error() -> None:
    """Its ``__fspath__`` giving neither str nor bytes: Python's bare TypeError escaped."""
    with pytest.raises(stream_st.ArgumentTypeError, match="not a path"):
        await stream_st.load(_NotAPath())


async def test_an_async_generator_read_by_two_streams_at_once_is_refused() -> None:
    """The second stream over a generator the first is stepping: a UsageError (as for a shared
    anyio or asyncio stream), where the generator's bare RuntimeError escaped."""
    import anyio
    import numpy as np

    import stream_st.numpy

    raw = stream_st.numpy.save({f"t{i}": np.arange(100, dtype=np.float32) for i in range(20)})

    async def chunks() -> Any:
        for start in range(0, len(raw), 500):
            await anyio.sleep(0.001)
            yield raw[start : start + 500]

    source = chunks()
    outcomes: list[object] = []

    async def read() -> None:
        try:
            outcomes.append(len([name async for name, _ in stream_st.open_stream(source)]))
        except stream_st.SafetensorsError as exc:
            outcomes.append(exc)

    async with anyio.create_task_group() as group:
        group.start_soon(read)
        await anyio.sleep(0.0005)
        group.start_soon(read)
    assert 20 in outcomes, outcomes
    (refused,) = [o for o in outcomes if isinstance(o, stream_st.UsageError)]
    assert "read by another stream" in str(refused)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_generator_that_never_waits_read_by_two_streams_is_refused(backend: str) -> None:
    """A generator yielding without awaiting is never running when the second stream looks:
    that stream opens once the first has its header, and is refused at once (a UsageError),
    where each took chunks the other never saw: the second's header was tensor bytes
    (HeaderTooLargeError), the first ended short (TruncatedStreamError)."""
    import anyio
    import numpy as np

    import stream_st.numpy

    raw = stream_st.numpy.save({f"t{i}": np.arange(1000, dtype=np.float32) for i in range(20)})

    async def chunks() -> Any:
        for start in range(0, len(raw), 512):
            yield raw[start : start + 512]

    async def main() -> list[object]:
        source = chunks()
        opened, tried = anyio.Event(), anyio.Event()
        outcomes: list[object] = []

        async def first() -> None:
            try:
                async with stream_st.open_stream(source) as stream:
                    opened.set()
                    await tried.wait()
                    outcomes.append(len([name async for name, _ in stream]))
            except stream_st.SafetensorsError as exc:
                outcomes.append(exc)

        async def second() -> None:
            await opened.wait()
            try:
                outcomes.append(len([name async for name, _ in stream_st.open_stream(source)]))
            except stream_st.SafetensorsError as exc:
                outcomes.append(exc)
            tried.set()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as group:
                group.start_soon(first)
                group.start_soon(second)
        return outcomes

    refused, read = anyio.run(main, backend=backend)
    assert read == 20, read
    assert isinstance(refused, stream_st.UsageError), refused
    assert "async generator is being read by another stream" in str(refused)


async def test_a_source_object_given_to_a_second_read_is_refused(tmp_path: Path) -> None:
    """A :class:`~stream_st.sources.Source` is read once: given to a second read (after the
    first, or while it runs), a UsageError saying so, where a closed file's bare OSError escaped
    and other sources' leftovers were called a truncated file."""
    import anyio

    path = tmp_path / "m.safetensors"
    path.write_bytes(sample_file())
    source = FileSource(path)
    assert await stream_st.load(source)
    with pytest.raises(stream_st.UsageError, match="given to another read already"):
        await stream_st.load(source)

    fresh = FileSource(path)
    outcomes: list[object] = []

    async def read() -> None:
        try:
            outcomes.append(len(await stream_st.load(fresh)))
        except stream_st.SafetensorsError as exc:
            outcomes.append(exc)

    async with anyio.create_task_group() as group:
        group.start_soon(read)
        group.start_soon(read)
    assert any(isinstance(o, int) for o in outcomes), outcomes
    (refused,) = [o for o in outcomes if isinstance(o, stream_st.UsageError)]
    assert "read once" in str(refused)


async def test_a_sink_object_given_to_a_second_write_is_refused(tmp_path: Path) -> None:
    """A :class:`~stream_st.sinks.Sink` takes one message: given to a second writer (while the
    first writes, or after its commit), a UsageError, as a source given to a second read is,
    where two writers at once committed one file mixing both messages."""
    import numpy as np

    path = tmp_path / "x.safetensors"
    sink = FileSink(path)
    first = stream_st.open_writer(sink, [stream_st.TensorSpec("a", "F32", (4,))])
    second = stream_st.open_writer(sink, [stream_st.TensorSpec("b", "I32", (4,))])
    with pytest.raises(stream_st.UsageError, match="given to another write already"):
        async with first:
            await first.write("a", np.ones(4, np.float32))
            async with second:
                await second.write("b", np.full(4, 7, np.int32))
    assert not path.exists()
    sink = FileSink(path)
    await stream_st.save(sink, {"a": np.ones(4, np.float32)})
    with pytest.raises(stream_st.UsageError, match="one message"):
        await stream_st.save(sink, {"b": np.full(4, 7, np.int32)})
    assert list(await stream_st.load(path)) == ["a"]


async def test_connect_and_listen_name_only_the_limits_they_take() -> None:
    """``connect``/``listen`` take the limits and no transport options: a misspelt keyword's
    message lists just those, where it offered ``headers`` and ``ssl_context``, which they then
    refused too."""
    with pytest.raises(stream_st.ArgumentTypeError, match=r"\['timeot'\]") as caught:
        await stream_st.connect("tcp://127.0.0.1:9", timeot=1)  # type: ignore[call-arg]
    assert "headers" not in str(caught.value) and "the limits" in str(caught.value)
    with pytest.raises(stream_st.ArgumentTypeError, match=r"\['headers'\]") as caught:
        async with stream_st.listen(headers={}):  # type: ignore[call-arg]
            pass
    assert "ssl_context" not in str(caught.value)
