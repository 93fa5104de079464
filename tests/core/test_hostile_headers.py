"""Headers a hostile peer may send: refused as the reference refuses them, quickly, with a short
message, never with anything but a SafetensorsError; and a header's memory follows its bytes."""

from __future__ import annotations

import json
import struct
import threading
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import safetensors

import stream_st
from stream_st import HeaderError, SafetensorsError, TruncatedStreamError, parse_header, tools
from stream_st.cli import main
from stream_st.core.strict_json import PIECE_BYTES
from stream_st.reader import header as reader_module
from stream_st.reader.turns import TURN_CHECKPOINTS
from stream_st.transports.inmemory import BytesSource

from .._util import chunked, raw_file, stepped

U64_MAX = 2**64 - 1


def entry(dtype: str = "U8", shape: str = "[0]", offsets: str = "[0, 0]") -> str:
    """A tensor entry's JSON text, its numbers spelled exactly as given."""
    return f'{{"dtype": "{dtype}", "shape": {shape}, "data_offsets": {offsets}}}'


def reference_refuses(text: str | bytes) -> bool:
    body = text.encode() if isinstance(text, str) else text
    try:
        safetensors.deserialize(struct.pack("<Q", len(body)) + body)
    except safetensors.SafetensorError:
        return True
    return False


# ---------------------------------------------------------------- lone surrogates

SURROGATES = [
    ("name, high", '{"a\\ud800": ' + entry() + "}", "tensor name"),
    ("name, low", '{"\\uDC00b": ' + entry() + "}", "tensor name"),
    ("name, reversed pair", '{"\\udc00\\ud800": ' + entry() + "}", "tensor name"),
    ("metadata value", '{"__metadata__": {"k": "a\\ud800"}}', r"__metadata__\['k'\]"),
    ("metadata key", '{"__metadata__": {"\\udfff": "v"}}', "__metadata__ key"),
]


@pytest.mark.parametrize(
    ("case", "text", "where"), SURROGATES, ids=[case for case, _, _ in SURROGATES]
)
def test_lone_surrogate_is_refused_as_the_reference_does(case: str, text: str, where: str) -> None:
    assert reference_refuses(text)
    with pytest.raises(HeaderError, match=f"{where} .* lone UTF-16 surrogate") as info:
        parse_header(text.encode())
    str(info.value).encode("utf-8")  # the message itself is printable text


def test_surrogate_pairs_and_escaped_backslashes_are_text() -> None:
    text = '{"\\ud83d\\ude80": ' + entry() + ', "\\\\ud800": ' + entry() + "}"
    assert not reference_refuses(text)
    assert parse_header(text.encode()).names() == ["🚀", "\\ud800"]


def test_lone_surrogate_fails_cleanly_in_the_tools_and_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "surrogate.safetensors"
    path.write_bytes(raw_file('{"a\\ud800": ' + entry() + "}"))
    with pytest.raises(HeaderError):
        anyio.run(lambda: tools.hash(path))
    for command in ("inspect", "hash", "validate"):
        status = main([command, str(path)])
        captured = capsys.readouterr()
        assert status != 0, command
        assert "Traceback" not in captured.err and "surrogate" in captured.err, command


# ---------------------------------------------------------------- numbers

NOT_PLAIN_INTEGERS = [
    ("-0 dimension", entry(shape="[-0]")),
    ("-0 start", entry(offsets="[-0, 0]")),
    ("-0 end", entry(offsets="[0, -0]")),
    ("-0 among dimensions", entry(shape="[2, -0]")),
    ("1.0 dimension", entry(shape="[1.0]", offsets="[0, 1]")),
    ("1e0 dimension", entry(shape="[1e0]", offsets="[0, 1]")),
    ("1E3 end", entry(shape="[1000]", offsets="[0, 1E3]")),
    ("-0.0 start", entry(offsets="[-0.0, 0]")),
    ("2**64 dimension", entry(shape=f"[0, {2**64}]")),
    ("2**64 end", entry(offsets=f"[0, {2**64}]")),
    ("1e400 dimension", entry(shape="[1e400]")),
    ("true dimension", entry(shape="[true]", offsets="[0, 1]")),
    ("null offset", entry(offsets="[0, null]")),
]


@pytest.mark.parametrize(
    ("case", "tensor"), NOT_PLAIN_INTEGERS, ids=[case for case, _ in NOT_PLAIN_INTEGERS]
)
def test_only_plain_integers_are_dimensions_and_offsets(case: str, tensor: str) -> None:
    text = '{"a": ' + tensor + "}"
    assert reference_refuses(text)
    with pytest.raises(HeaderError, match=r"shape must be|data_offsets must be"):
        parse_header(text.encode())


def test_minus_zero_in_a_name_or_metadata_is_no_number() -> None:
    text = '{"__metadata__": {"k": "-0"}, "x-0": ' + entry() + "}"
    header = parse_header(text.encode())
    assert header.names() == ["x-0"] and header.metadata == {"k": "-0"}


# ---------------------------------------------------------------- huge shapes


def dims_header(dims: list[int], dtype: str = "U8") -> bytes:
    return json.dumps({"a": {"dtype": dtype, "shape": dims, "data_offsets": [0, 0]}}).encode()


@pytest.mark.parametrize(
    ("dims", "dtype"),
    [
        ([U64_MAX] * 230, "U8"),
        ([U64_MAX] * 230, "F6_E2M3"),
        ([U64_MAX] * 50_000 + [0], "F6_E2M3"),
        ([U64_MAX] * 50_000 + [0], "U8"),
        ([2**40] * 3 + [0], "F4"),
        ([U64_MAX, U64_MAX, 0], "F6_E3M2"),
    ],
    ids=["230 x u64", "230 x u64 packed", "50000 then 0, packed", "50000 then 0", "F4", "3 dims"],
)
def test_overflowing_shapes_are_refused_with_a_short_message(dims: list[int], dtype: str) -> None:
    """The reference refuses a shape whose running product passes 2**64 - 1, even when a later
    dimension is 0; the check stops there, so it is linear and forms no huge number."""
    text = dims_header(dims, dtype)
    assert reference_refuses(text)
    with pytest.raises(HeaderError) as info:
        parse_header(text)
    message = str(info.value)
    assert len(message) < 400 and "\n" not in message


def test_a_kept_tensor_s_shape_is_refused_past_2_64_values_as_any_shape_is() -> None:
    """``unknown_dtypes="keep"`` sizes a tensor of a code stream_st does not know by its
    offsets, but its shape is checked as any shape is: a count of values past 2**64 - 1 is
    refused (it was kept), and one below it kept."""
    for dims in ([2**40, 2**40], [U64_MAX] * 50_000 + [0]):
        with pytest.raises(HeaderError, match=r"holds more than 2\*\*64 - 1 values"):
            parse_header(dims_header(dims, "I4"), unknown_dtypes="keep")
    largest = [2**32, 2**32 - 1]
    assert parse_header(dims_header(largest, "I4"), unknown_dtypes="keep")["a"].shape == (
        2**32,
        2**32 - 1,
    )


@pytest.mark.parametrize("code", ["f32", "Bf16", "f8_e4m3"])
def test_a_known_code_in_other_case_is_refused_even_by_a_header_only_parse(code: str) -> None:
    """The reference refuses ``"f32"``; ``unknown_dtypes="keep"`` kept it as an unknown code,
    so ``hash`` gave it F32's structural hash (the dtype lower-cased). It is refused in any mode,
    naming the tensor and the code, its hint the upper-case code (not "header-only reads
    accept it"), in the walk and the fast parse alike."""
    text = dims_header([4], code).replace(b"[0, 0]", b"[0, 16]")
    assert reference_refuses(text)
    for keep in ("keep", "refuse"):
        with pytest.raises(stream_st.UnknownDtypeError) as info:
            parse_header(text, unknown_dtypes=keep)
        message = str(info.value)
        assert f"tensor 'a': unknown safetensors dtype {code!r}" in message
        assert f"codes are upper case ({code.upper()!r})" in message
        assert "header-only" not in message
    assert parse_header(dims_header([4], "I4"), unknown_dtypes="keep")["a"].dtype == "I4"


def test_a_zero_first_keeps_the_count_at_zero() -> None:
    text = dims_header([0] + [U64_MAX] * 1000, "F6_E2M3")  # packed: numpy holds it 1-D
    assert not reference_refuses(text)
    assert parse_header(text)["a"].array_shape == (0,)


@pytest.mark.parametrize(
    ("dim", "count"), [(1234567890123456789, 200_000), (1, 2_000_000)], ids=["19 digits", "1"]
)
def test_a_shape_of_too_many_dimensions_is_refused_in_milliseconds(dim: int, count: int) -> None:
    """A 4 MB header of 200,000 dimensions (or 2,000,000) is refused once more dimensions than
    numpy takes are read, before the others are converted or multiplied (the reference, which
    has no such limit, reads the whole shape)."""
    text = dims_header([dim] * count)
    assert len(text) > 4_000_000
    start = time.process_time()
    with pytest.raises(HeaderError, match="dimensions, more than the 64 a numpy array can have"):
        parse_header(text)
    assert time.process_time() - start < 0.1


def test_more_dimensions_than_numpy_takes_are_refused_before_each_is_read() -> None:
    text = '{"a": ' + entry(shape="[" + "1, " * 1000 + '"x"]', offsets="[0, 1]") + "}"
    with pytest.raises(HeaderError, match="'a': 1001 dimensions, more than the 64"):
        parse_header(text.encode())


def test_deeply_nested_values_make_short_messages() -> None:
    deep = "[" * 900 + "]" * 900
    for text in (
        '{"a": ' + entry(shape=deep) + "}",
        '{"a": ' + entry(offsets=deep) + "}",
        '{"__metadata__": {"k": ' + deep + "}}",
        '{"a": ' + deep + "}",
    ):
        with pytest.raises(HeaderError) as info:
            parse_header(text.encode())
        assert len(str(info.value)) < 400


# ---------------------------------------------------------------- JSON grammar

GRAMMAR = [
    '{"a": ' + entry() + "}",
    '{ "a" :\n\t' + entry() + " \r\n}\n\t ",
    "{ }",
    "{}   ",
    "{,}",
    '{"a": ' + entry() + ",}",
    '{"a" ' + entry() + "}",
    '{"a": }',
    '{"a": ' + entry(),
    '{"a": ' + entry() + "} x",
    '{"a": ' + entry() + "}}",
    '{"a": ' + entry() + ' "b": ' + entry() + "}",
    "{a: 1}",
    '{"a\x01": ' + entry() + "}",
    '{"a\\x": ' + entry() + "}",
    '{"a": ' + entry(shape="[01]") + "}",
    '{"a": ' + entry(shape="[+1]") + "}",
    '{"__metadata__": {}, "a": ' + entry() + "}",
    '{"a": ' + entry() + ', "__metadata__": {"k": "v"}}',
    '{"a": {"dtype": "U8", "dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}',
    '{"a": {"dtype": "U8", "shape": [1], "shape": [0], "data_offsets": [0, 0]}}',
    '{"a": {"dtype": "U8", "shape": [0], "data_offsets": [0, 1], "data_offsets": [0, 0]}}',
    '{"a": {"d\\u0074ype": "U8", "shape": [0], "data_offsets": [0, 0]}}',
]

DUPLICATES = [
    '{"__metadata__": {}, "__metadata__": {}}',
    '{"a": ' + entry() + ', "a": ' + entry() + "}",
    '{"a": ' + entry() + ', "\\u0061": ' + entry() + "}",
    '{"__metadata__": {"k": "1", "k": "1"}}',
]


@pytest.mark.parametrize("text", GRAMMAR)
def test_json_grammar_as_the_reference(text: str) -> None:
    parsed_as_the_reference(text, reference_refuses(text))


def parsed_as_the_reference(text: str, refused: bool) -> None:
    """``text`` is refused as a header where the reference refuses it (``refused``), and only
    there."""
    try:
        parse_header(text.encode())
    except HeaderError:
        assert refused, "refused a header the reference accepts"
    else:
        assert not refused, "accepted a header the reference refuses"


PAD = " " * (PIECE_BYTES + 1)
"""Whitespace a piece long: an entry holding it is read in steps, a field at a time."""


@pytest.mark.parametrize(
    "text", GRAMMAR + ['{"a": ' + tensor + "}" for _, tensor in NOT_PLAIN_INTEGERS]
)
def test_a_long_entry_is_read_in_steps_as_the_reference_reads_it(text: str) -> None:
    padded = text.replace(", ", "," + PAD).replace(": ", ":" + PAD)
    refused = reference_refuses(padded)
    assert refused == reference_refuses(text)
    parsed_as_the_reference(padded, refused)


@pytest.mark.parametrize("text", DUPLICATES)
def test_duplicate_names_are_refused_where_the_reference_keeps_the_last(text: str) -> None:
    with pytest.raises(HeaderError, match="duplicate key"):
        parse_header(text.encode())


@pytest.mark.parametrize("raw", [None, "{}", 12, [1]], ids=["None", "str", "int", "list"])
def test_a_header_that_is_no_bytes_is_a_safetensors_error(raw: Any) -> None:
    with pytest.raises(SafetensorsError):
        parse_header(raw)


# ---------------------------------------------------------------- the reader's header read


def stalled_after(prefix: bytes, gate: anyio.Event) -> Callable[[], AsyncIterator[bytes]]:
    async def chunks() -> AsyncIterator[bytes]:
        yield prefix
        await gate.wait()

    return chunks


def test_a_stalled_peer_declaring_a_huge_header_costs_little_memory() -> None:
    declared = 90_000_000
    prefix = struct.pack("<Q", declared) + b'{"a'

    async def run() -> tuple[int, list[BaseException]]:
        gate = anyio.Event()
        errors: list[BaseException] = []

        async def read() -> None:
            try:
                await stream_st.read_header(stalled_after(prefix, gate)())
            except SafetensorsError as exc:
                errors.append(exc)

        tracemalloc.start()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(read)
                await anyio.sleep(0.05)
                peak = tracemalloc.get_traced_memory()[1]
                gate.set()
        finally:
            tracemalloc.stop()
        return peak, errors

    peak, errors = anyio.run(run)
    assert peak < declared // 20
    assert [type(e) for e in errors] == [TruncatedStreamError]


def test_a_short_header_from_a_stream_grows_with_the_bytes_that_arrive() -> None:
    text = json.dumps(
        {f"t{i}": {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]} for i in range(5000)}
    )
    data = raw_file(text, bytes(5000))
    assert len(text) > 2 * reader_module.HEADER_FIRST_READ

    async def read(size: int) -> list[str]:
        return (await stream_st.read_header(chunked(data, size))).names()

    expected = [f"t{i}" for i in range(5000)]
    for size in (1, 1000, 65_536, len(data)):
        assert anyio.run(read, size) == expected
    truncated = data[: 8 + len(text) - 1]
    with pytest.raises(TruncatedStreamError, match="the header"):
        anyio.run(stream_st.read_header, chunked(truncated, 4096))


class CountingSource(BytesSource):
    """Bytes in memory that record the size of every read asked of them."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.reads: list[int] = []

    async def receive_into(self, buffer: memoryview) -> int:
        self.reads.append(len(buffer))
        return await super().receive_into(buffer)


def test_a_source_of_known_size_reads_the_header_in_one_read() -> None:
    text = json.dumps(
        {f"t{i}": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]} for i in range(10_000)}
    )
    source = CountingSource(raw_file(text))
    assert len(anyio.run(stream_st.read_header, source)) == 10_000
    assert source.reads == [8, len(text)]


@pytest.mark.parametrize(
    "big",
    [
        lambda: many_tensors(64_000),  # 4 MB: 120 pieces, 30-300 ms
        lambda: raw_file(LONG_MEMBERS["metadata first, as the reference writes it"]()),
        lambda: raw_file(LONG_MEMBERS["a packed tensor of many dimensions"]()),
    ],
    ids=["tensors", "metadata", "dimensions"],
)
def test_a_big_header_is_parsed_in_steps_that_let_the_loop_run(big: Callable[[], bytes]) -> None:
    turns = 0

    async def read(data: bytes) -> int:
        nonlocal turns
        turns = 0
        done = anyio.Event()

        async def count() -> None:
            nonlocal turns
            while not done.is_set():
                await anyio.lowlevel.checkpoint()
                turns += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(count)
            await anyio.lowlevel.checkpoint()
            before = turns
            count_of = len(await stream_st.read_header(data))
            during = turns - before
            done.set()
        assert threading.current_thread() is threading.main_thread()
        return during if count_of else -1

    opening = anyio.run(read, many_tensors(10))  # one piece: the turns of the open alone
    assert opening <= 2 * TURN_CHECKPOINTS
    assert anyio.run(read, big()) >= opening + 2 * TURN_CHECKPOINTS  # turns between steps


TENSOR = '"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}'
LONG_MEMBERS: dict[str, Callable[[], str]] = {
    "metadata first, as the reference writes it": lambda: (
        '{"__metadata__":{' + ",".join(f'"k{i}":"v"' for i in range(100_000)) + f"}},{TENSOR}}}"
    ),
    "metadata last, as json.dumps writes it": lambda: (
        f'{{{TENSOR}, "__metadata__": {{'
        + ", ".join(f'"k{i}": "v\\n"' for i in range(100_000))
        + "}}"
    ),
    "a packed tensor of many dimensions": lambda: (
        '{"a": {"dtype": "F6_E2M3", "shape": [' + "1, " * 400_000 + '0], "data_offsets": [0, 0]}}'
    ),
    "whitespace": lambda: "{" + TENSOR.replace(":", ":" + " " * 400_000) + " " * 400_000 + "}",
}
"""Valid headers (of empty tensors: no data) of a megabyte or two whose bulk is one member, or
whitespace."""


@pytest.mark.parametrize("case", LONG_MEMBERS)
def test_a_header_of_one_long_member_is_parsed_in_steps(case: str) -> None:
    """No step of a parse reads much more than a piece of the header, whatever its shape: the
    metadata is read a window of entries at a time, a shape a run of dimensions at a time,
    whitespace a piece at a time (each was one step, of the whole)."""
    text = LONG_MEMBERS[case]()
    assert not reference_refuses(text)
    raw = text.encode()
    found, yields = stepped(raw)
    assert found == parse_header(raw) and found.metadata == json.loads(text).get("__metadata__", {})
    assert yields >= len(raw) // (4 * PIECE_BYTES)  # a step reads 128 KiB at most, on average


ITEMS = "1, " * 500_000 + "and no end"
"""1.5 MB of an array's items, and then text that is no JSON: a value refused before it is read
is refused for what it is, not as invalid JSON."""
IMPOSSIBLE = [
    (
        "a metadata value",
        '{"__metadata__": {"k": [' + ITEMS,
        r"__metadata__\['k'\] must be a string, got an array",
    ),
    (
        "the metadata",
        '{"__metadata__": [' + ITEMS,
        "__metadata__ must be a JSON object, got an array",
    ),
    ("a tensor's entry", '{"a": [' + ITEMS, "'a': entry must be a JSON object, got an array"),
    ("an unknown field", '{"a": {"dtype": "U8", "x": [' + ITEMS, r"'a': unknown field\(s\)"),
    (
        "a shape of whole bytes",
        '{"a": {"dtype": "U8", "shape": [' + ITEMS,
        "'a': at least .* dimensions, more than the 64",
    ),
    (
        "a packed shape of too many values",
        '{"a": {"dtype": "F6_E2M3", "shape": [' + "4294967296, " * 3 + ITEMS,
        r"'a': shape .* holds more than 2\*\*64 - 1 values",
    ),
    (
        "the offsets",
        '{"a": {"dtype": "U8", "shape": [1], "data_offsets": [' + ITEMS,
        "'a': data_offsets must be exactly two",
    ),
]


@pytest.mark.parametrize(("case", "text", "message"), IMPOSSIBLE, ids=[c[0] for c in IMPOSSIBLE])
def test_a_value_that_cannot_be_is_refused_before_it_is_read(
    case: str, text: str, message: str
) -> None:
    with pytest.raises(HeaderError, match=message):
        parse_header(text.encode())


def many_tensors(count: int) -> bytes:
    """A valid file of ``count`` empty tensors: a header of about 60 bytes a tensor."""
    return raw_file(
        {f"t{i}": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]} for i in range(count)}
    )


def test_a_parse_nobody_waits_for_stops() -> None:
    data = many_tensors(10_000)
    looks: list[int] = []

    def stop() -> bool:
        looks.append(1)
        return len(looks) > 1

    with pytest.raises(stream_st.UsageError, match="stopped"):
        parse_header(data[8:], stop=stop)
    assert len(looks) == 2  # it looked again after a few thousand tensors, and stopped there


def test_the_deadline_bounds_a_big_headers_parse() -> None:
    """A header-only read of a big header ends at its deadline, not when the parse would end."""
    data = many_tensors(200_000)
    with pytest.raises(stream_st.ReadTimeoutError, match="deadline"):
        anyio.run(lambda: stream_st.read_header(data, deadline=0.01))
