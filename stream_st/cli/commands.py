"""The ``stream-st`` command: inspect, ls, show, hash, diff, validate, cp, serve, demo,
completion.

Every command takes any source the library reads (a path, ``http(s)://``, ``s3://``, ``hf://``,
``tcp://``, a sharded ``*.index.json``, a model directory, ``-`` for standard input) and works
in constant memory; ``cp`` writes to ``-`` as standard output. Exit status: 0 success
(equal, valid); 1 a difference (``diff``) or failed validation (``validate``); 2 an error (bad
input, unreachable source, bad arguments); 3 an internal error (a bug: the traceback goes to
stderr); 130 interrupted; 141 the output pipe closed early (``| head``), as for a command killed
by SIGPIPE.
"""

from __future__ import annotations

import argparse
import itertools
import os
import posixpath
import re
import socket
import stat
import sys
import unicodedata
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Sequence
from contextlib import aclosing, contextmanager, suppress
from dataclasses import asdict
from types import EllipsisType
from typing import Any

import anyio
import numpy as np

from .. import tools
from .._api import open_stream
from ..core.digests import ALGORITHM_KEY
from ..core.header import TensorInfo
from ..core.shards import INDEX_SUFFIX, is_index, split_address
from ..core.stats import LoadStats, last_stats
from ..core.strict_json import Number, decode_json
from ..errors import (
    SafetensorsError,
    SourceNotFoundError,
    TensorNotFoundError,
    TransportError,
    TruncatedStreamError,
    UnsupportedSourceError,
    UsageError,
    redact,
)
from ..reader import TensorStream
from ..sharded.reader import ShardedStream
from ..tools.common import command_clock, headers_of, naming, plural
from ..tools.cp import address_in, local_path, make_directory
from ..tools.hash import Hashes, structure_of
from ..tools.inspect import described
from ..tools.model_checks import ModelConfig
from ..tools.validate import expected_shapes
from ..transports.file.sink import PipeSink
from ..transports.file.source import FileSource
from ..transports.options import TransportOptions
from ..transports.registry import SinkLike, read_object
from ..transports.tcp import SocketSink, SocketSource
from .demo import print_report, run_demo
from .exits import EXIT_DIFFERENT, EXIT_ERROR, EXIT_OK, SIGNAL_GRACE
from .options import limits_of, options_of
from .output import (
    PROG,
    STDIO,
    OutputError,
    brief,
    digests_line,
    failed,
    human,
    print_bytes,
    print_json,
    print_validation,
    progress_reporter,
    show_values,
    shown,
    status_line,
    surrogates_as_bytes,
    without_digests,
)


def source_arg(text: str) -> str:
    """A source argument as the library takes it: ``-`` is standard input (``/dev/stdin``,
    which :func:`_readable` opens).
    Standard input that is a regular file read already past its start (``(head -c 8 >
    /dev/null; stream-st hash --file -) < f``) is a :class:`~stream_st.UsageError`: the path
    opens the file anew, read from its start, not from where the shell's reads left it."""
    if text != STDIO:
        return text
    offset = _stdin_offset()
    if offset:
        raise UsageError(
            f"standard input is a file read up to byte {offset:,} already, and '-' would read "
            f"it from its start: pipe the rest of it (tail -c +{offset + 1} FILE | stream-st ...)"
        )
    return "/dev/stdin"


def _stdin_offset() -> int:
    """Where the reads of standard input have left it, when it is a regular file; else 0 (a
    pipe, a terminal, standard input closed: opening ``/dev/stdin`` tells)."""
    with suppress(OSError):
        if stat.S_ISREG(os.fstat(0).st_mode):
            return os.lseek(0, 0, os.SEEK_CUR)
    return 0


class _SocketInput(SocketSource):
    """Standard input that is a socket, read as a ``tcp://`` peer is (see :func:`_readable`),
    and named ``/dev/stdin`` where a result names its source, as standard input that is a pipe
    is."""

    def __str__(self) -> str:
        return self.name


def _readable(source: str) -> str | SocketSource:
    """``source``, one of :func:`source_arg`'s, as the library reads it. Standard input that is
    a socket (inetd's, systemd's socket activation, ``socat EXEC:``), which ``/dev/stdin``
    cannot open anew (``ENXIO``), is read through a duplicate of its descriptor, left blocking
    as the processes sharing it hold it, each ``recv`` non-blocking by itself: the waits for
    the peer's bytes are the event loop's, within ``--timeout``, and a signal stops them."""
    if source != "/dev/stdin":
        return source
    try:
        mode = os.fstat(0).st_mode
    except OSError:  # closed: opening /dev/stdin says so
        return source
    if not stat.S_ISSOCK(mode):
        return source
    return _SocketInput(_socket_of(0, source), source)


def _socket_of(fd: int, name: str) -> socket.socket:
    """A socket object over a duplicate of ``fd`` (a socket other processes share), closed
    again if it cannot be made; out of descriptors is a :class:`~stream_st.TransportError`."""
    try:
        duplicate = os.dup(fd)
    except OSError as exc:
        raise TransportError(f"cannot use {name}: {exc.strerror or exc}", url=name) from None
    try:
        return socket.socket(fileno=duplicate)
    except BaseException:
        os.close(duplicate)
        raise


def one_source_arg(text: str) -> str:
    """The one source an argument names (a model directory: its index or its only file)."""
    found = tools.model_sources(source_arg(text))
    if len(found) > 1:
        raise UsageError(
            f"{text} holds {len(found)} safetensors files and no index: name one of them"
        )
    return found[0]


async def _destination(text: str) -> SinkLike:
    """A destination argument as the library takes it: ``-`` is standard output, written
    through in place, never to a terminal. A pipe is opened anew (a descriptor of its own, set
    non-blocking without touching the one other processes share). A socket (inetd's, systemd's
    socket activation, ``socat EXEC:``), which cannot be opened anew, is written as a
    ``tcp://`` peer is, through a duplicate of the descriptor left blocking as the processes
    sharing it hold it, each ``send`` non-blocking by itself: the waits for the peer to take
    bytes are the event loop's, within ``--timeout``, and a signal stops them. Anything else (a
    file redirected with ``>`` or ``>>``) is written through the inherited descriptor, so the
    bytes land at the shell's offset, appended under ``>>``."""
    if text != STDIO:
        return text
    if sys.stdout.isatty():
        raise UsageError("refusing to write safetensors to a terminal: redirect or pipe stdout")
    sys.stdout.flush()
    fd = sys.stdout.fileno()
    mode = os.fstat(fd).st_mode
    if stat.S_ISFIFO(mode):
        return await PipeSink.open("/dev/stdout")
    if stat.S_ISSOCK(mode):
        return SocketSink.over_shared(_socket_of(fd, "standard output"), "standard output")
    # The duplicate listed as os.dup returns (C code appends it, no bytecode run between), so
    # that an interrupt (a signal handler's exception) there or as the sink takes it closes it.
    opened: list[int] = []
    try:
        opened.extend(map(os.dup, (fd,)))
        return PipeSink(opened[0], "standard output", opened=opened)
    except BaseException:
        for unheld in opened:
            os.close(unheld)
        raise


async def _each(args: argparse.Namespace, run: Callable[[str], Awaitable[int]]) -> int:
    """Run ``run`` on every source the arguments name (directories expanded), going on past a
    source that fails; the status is the worst: an error, else a difference, else success."""
    if len(args.sources) > 1 and args.sources.count(STDIO) + args.sources.count("/dev/stdin") > 1:
        raise UsageError("standard input can be read once: name '-' once")
    status = EXIT_OK
    grace = SIGNAL_GRACE  # waited once: a signal comes with the first failure it causes
    for text in args.sources:
        try:
            sources = tools.model_sources(source_arg(text))
        except SafetensorsError as exc:
            failed(text, exc)
            status = EXIT_ERROR
            continue
        for source in sources:
            try:
                found = await run(source)
            except SafetensorsError as exc:
                # A failure that came with a stopping signal (the source ended by the same
                # hangup) is the signal's doing: a moment for the loop to take the signal in,
                # which cancels this, and the command reports the signal alone.
                await anyio.sleep(grace)
                grace = 0
                failed(source, exc)
                found = EXIT_ERROR
            status = max(status, found)
    return status


async def run_inspect(args: argparse.Namespace) -> int:
    async def one(source: str) -> int:
        clock = command_clock(options_of(args))
        headers = await headers_of(_readable(source), clock, unknown_dtypes="keep")
        result = described(source, headers)
        if args.json:
            print_json(result.to_json())
            return EXIT_OK
        print(shown(result.source))
        shards = f" in {result.shards} shards" if result.shards > 1 else ""
        print(
            f"  {plural(result.tensor_count, 'tensor')}{shards}, "
            f"{result.parameter_count:,} parameters, {human(result.data_bytes)} of data, "
            f"header {human(result.header_bytes)}"
        )
        metadata = without_digests(result.metadata)
        if len(metadata) < len(result.metadata):  # each shard's digests judged on its own:
            # the merged metadata labels what differs between shards
            records = [(header.metadata, header.names()) for header in headers]
            print(f"  checksummed: {digests_line(records)}")
        if metadata:
            print("  metadata:")
            for key, value in metadata.items():
                print(f"    {shown(key)}: {shown(value)}")
        if result.tensors:
            names = [shown(t["name"]) for t in result.tensors]
            width = max(len("name"), *map(len, names))
            print(f"  {'name':<{width}}  {'dtype':<11} {'shape':<22} {'bytes':>12}")
            for name, t in zip(names, result.tensors, strict=True):
                shape = str(t["shape"])
                print(f"  {name:<{width}}  {t['dtype']:<11} {shape:<22} {t['bytes']:>12,}")
        return EXIT_OK

    return await _each(args, one)


async def run_ls(args: argparse.Namespace) -> int:
    async def one(source: str) -> int:
        result = await tools.inspect(_readable(source), **options_of(args))
        for t in result.tensors:
            print(shown(t["name"]))
        return EXIT_OK

    return await _each(args, one)


def parse_index(text: str) -> tuple[int | slice | EllipsisType, ...]:
    """A ``--slice`` argument, numpy's basic indexing: ``0:4``, ``1``, ``:,0:2``, ``::2``,
    ``...,0``."""
    index: list[int | slice | EllipsisType] = []
    for part in text.split(","):
        if part.strip() == "...":
            index.append(Ellipsis)
            continue
        try:
            if ":" not in part:
                index.append(int(part))
                continue
            bounds = [int(b) if b.strip() else None for b in part.split(":")]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected numpy-style indices, got {text!r}"
            ) from None
        if len(bounds) > 3:
            raise argparse.ArgumentTypeError(f"expected start:stop[:step], got {part!r}")
        if len(bounds) == 3 and bounds[2] == 0:
            raise argparse.ArgumentTypeError(f"a slice's step cannot be zero, got {part!r}")
        index.append(slice(*bounds))
    return tuple(index)


async def run_show(args: argparse.Namespace) -> int:
    source = one_source_arg(args.source)
    options = options_of(args)
    with naming(source):
        checksummed = await _checksummed(source, options)
    # A local file is mapped (copy=False): a big tensor is not read into new memory to show a
    # slice of it, or the edges a summary shows; those alone are copied out of the file
    # (_printed). A checksummed one is read whole to be checked: copied as it is (the check of a
    # mapping reads pages a file truncated meanwhile has lost: SIGBUS).
    stream = open_stream(_readable(source), include=[args.name], copy=checksummed, **options)

    async def arrivals() -> AsyncGenerator[tuple[argparse.Namespace, TensorInfo, Any]]:
        """The tensor as each shard delivers it (a dataset's: one a shard, each of its own
        shape), what is printed of it (:func:`_printed`) with the arguments it is printed with
        and its info from that shard's header, one held at a time."""
        with naming(source):  # the source's own errors only, not the options' nor --slice's
            async with stream:
                async for _, array in stream:
                    info = stream.header[args.name]
                    printed = await _printed(args, stream, info, array)
                    del array
                    yield printed[0], info, printed[1]
                    del printed

    try:
        async with aclosing(arrivals()) as arrived:
            async for shown_args, info, array in arrived:
                show_values(shown_args, info, array)
                del array
    except TensorNotFoundError:
        source = redact(args.source)  # alone: masked in the message, a signed value ran to its end
        raise UsageError(
            f"{source} has no tensor {surrogates_as_bytes(repr(args.name))} "
            f"(stream-st ls {source} lists them)"
        ) from None
    return EXIT_OK


async def _checksummed(source: str, options: TransportOptions) -> bool:
    """Whether ``source`` is a local regular file, index or dataset folder whose header records
    digests (or a shard's does): ``show`` reads its tensor whole then, to check it."""
    path = local_path(source, UnsupportedSourceError)
    if path is None:
        return False
    found = anyio.Path(path)
    if await found.is_dir():  # a dataset's folder, or a checkpoint's: its index
        sources = tools.model_sources(path)
        if len(sources) != 1:
            return False
        source = sources[0]
    elif not await found.is_file():  # a pipe is read once, by show
        return False
    headers = await headers_of(source, command_clock(options), unknown_dtypes="keep")
    return any(ALGORITHM_KEY in header.metadata for header in headers)


SUMMARY_THRESHOLD = 200
"""More values than this are summarized by ``show`` (numpy's ``threshold``, as
:func:`~.output.show_values` gives it): only the edges of each axis are printed."""

SUMMARY_EDGE = 3
"""Values a summary prints at each end of an axis (numpy's ``edgeitems``, as
:func:`~.output.show_values` gives it)."""

NEAR_BYTES = 64 << 10
"""Bytes of a tensor that ``show`` reads in one read where they lie within this span (or within
twice their own size), else one row at a time: a read of 64 KiB costs about what a handful of
small ones do."""


async def _printed(
    args: argparse.Namespace, stream: TensorStream[Any], info: TensorInfo, array: Any
) -> tuple[argparse.Namespace, Any]:
    """What ``show`` prints of ``array``, the tensor ``info`` as ``stream`` delivered it, with the
    arguments to print it with.

    A view of a local file's mapping (read-only: ``copy=False``) is never read through: a file
    truncated meanwhile (a training job saving a checkpoint in place truncates it first) kills
    the process with SIGBUS where a lost page is touched. The values printed are copied out of
    the file instead, with positioned reads, a :class:`~stream_st.TruncatedStreamError` where
    the file has ended: the ``--slice`` alone (applied here: the arguments returned have none),
    of a summary only its edges (:func:`_edges`), into an array of its shape whose other values
    are zeros never read (memory the system gives as it is written). An F4 tensor, decoded whole
    before it is sliced, is copied whole; a ``--slice`` that does not fit is left to
    :func:`~.output.show_values` to refuse, nothing read. An array in fresh memory (another
    source's) is returned as it is."""
    reading = stream._current if isinstance(stream, ShardedStream) else stream
    assert reading is not None  # a shard's stream, while it hands out its tensors
    source, start, base = reading.source, stream.header.data_start + info.start, array.ctypes.data
    if array.flags.writeable or not isinstance(source, FileSource):  # not a view of a mapping
        return args, array

    async def copy(into: Any, part: Any) -> None:
        """Copy ``part``, a view of ``array``, into ``into`` from the file."""
        low, high = _bounds(part)
        if high - low > max(NEAR_BYTES, 2 * part.nbytes):  # far apart: at least one axis
            for row in range(len(part)):
                await copy(into[row, ...], part[row, ...])
            return
        whole = part.flags.c_contiguous and into.flags.c_contiguous  # read straight into it
        read = into if whole else np.empty(high - low, np.uint8)
        offset = start + low - base
        got = await source.read_into_at(offset, read.reshape(-1).view(np.uint8).data)
        if got < high - low:
            raise TruncatedStreamError(
                f"tensor {info.name!r}",
                name=info.name,
                offset=offset + got,
                expected=offset + high - low,
                source=source.name,
            )
        if not whole:
            into[...] = np.ndarray(
                part.shape, part.dtype, read, part.ctypes.data - low, part.strides
            )

    selected, shown_args = array, args
    if args.slice and not info.dtype_info.packed:
        index = args.slice if Ellipsis in args.slice else (*args.slice, Ellipsis)  # 0-d: a view
        try:
            selected = array[index]
        except (IndexError, TypeError):
            return args, np.zeros(array.shape, array.dtype)
        shown_args = argparse.Namespace(**{**vars(args), "slice": None})
    values = np.zeros(selected.shape, selected.dtype)
    summarized = not args.json and info.dtype != "F4" and selected.size > SUMMARY_THRESHOLD
    for at in _edges(selected.shape) if summarized else [(Ellipsis,)]:
        if selected[at].size:
            await copy(values[at], selected[at])
    return shown_args, values


def _edges(shape: Sequence[int]) -> list[tuple[slice, ...]]:
    """The blocks of an array of ``shape`` that a summary of it prints (numpy's): along each
    axis longer than twice :data:`SUMMARY_EDGE`, its first and last :data:`SUMMARY_EDGE`
    values, along the others all of them."""
    edges = [slice(None, SUMMARY_EDGE), slice(-SUMMARY_EDGE, None)]
    return list(
        itertools.product(*(edges if n > 2 * SUMMARY_EDGE else [slice(None)] for n in shape))
    )


def _bounds(array: Any) -> tuple[int, int]:
    """The address of the first byte of ``array``'s values (at least one), and one past its
    last, whatever the signs of its strides."""
    low = high = array.ctypes.data
    for size, stride in zip(array.shape, array.strides, strict=True):
        if stride < 0:
            low += (size - 1) * stride
        else:
            high += (size - 1) * stride
    return low, high + array.itemsize


async def run_hash(args: argparse.Namespace) -> int:
    if args.format == "weight-inspect":
        return await run_weight_inspect(args)
    if args.check:
        return await run_hash_check(args)
    if args.file and args.content and not args.json:
        raise UsageError(
            "--file prints sha256sum's lines, which have no room for --content: add --json"
        )

    def printed(source: str, result: Hashes) -> None:
        """Print ``result``, the hashes of ``source``."""
        if args.json:
            print_json(result)
        elif args.file:  # as sha256sum prints it: sha256sum -c and stream-st hash --check take it
            name = STDIO if source == "/dev/stdin" and STDIO in args.sources else redact(source)
            print_bytes(os.fsencode(checksum_line(result["file_sha256"], name)))
        else:
            named = shown(redact(source))  # a directory's file name cannot forge a line
            print(f"structural {result['structural_hash']}  {named}")
            if "content_hash" in result:
                print(f"content    {result['content_hash']}  {named}")

    async def one(source: str) -> int:
        if args.content and not args.file and is_index(source):
            await _one_digest_a_name(source, args, printed)
        with progress_reporter("hashing", args.quiet or not args.content) as progress:
            result = await tools.hash(
                _readable(source),
                content=args.content,
                file=args.file,
                progress=progress,
                **options_of(args),
            )
        printed(source, result)
        return EXIT_OK

    return await _each(args, one)


async def _one_digest_a_name(
    source: str, args: argparse.Namespace, printed: Callable[[str, Hashes], None]
) -> None:
    """Refuse ``hash --content`` of a checkpoint whose shards repeat a tensor name (a batch-mode
    dataset's columns are in every shard), before any tensor is read: the content hash gives
    one name one digest. Its structural hash is ``printed`` first, then a
    :class:`~stream_st.UsageError` raised."""
    headers = await headers_of(source, command_clock(options_of(args)), unknown_dtypes="keep")
    shards = Counter(name for header in headers for name in header.names())
    name, count = max(shards.items(), key=lambda item: item[1], default=("", 1))
    if count > 1:
        printed(source, structure_of(source, headers))
        raise UsageError(
            f"tensor {name!r} is in {count} shards, and --content gives one name one digest: "
            "hash each shard (stream-st hash --content SHARD...)"
        )


async def run_weight_inspect(args: argparse.Namespace) -> int:
    """``hash --format weight-inspect``: the weight-inspect tool's structural ID of each file,
    ``wi:safetensors:0:<8 hex> <hash>  <source>`` (``--json``: its ``id --json`` record)."""
    if args.content or args.file or args.check:
        raise UsageError(
            "--format weight-inspect hashes the header only: no --content, --file or --check"
        )

    async def one(source: str) -> int:
        found = await tools.weight_inspect(_readable(source), **options_of(args))
        if args.json:
            print_json(found)
        else:
            print(f"{found['id']} {found['structural_hash']}  {shown(redact(source))}")
        return EXIT_OK

    return await _each(args, one)


def checksum_line(sha256: str, name: str) -> str:
    """``sha256sum``'s line for ``name``: a name holding a backslash, a newline or a carriage
    return is escaped, the line then starting with a backslash (as coreutils does); so is one
    holding another control or format character, escaped as :func:`.output.shown` escapes it
    (``\\x1b``), where ``sha256sum`` writes it as it is, to drive the terminal (``hash --check``
    reads it back; ``sha256sum -c`` does not). A byte that is not UTF-8, and any other
    character (a no-break space), is left as it is: the line is written as the name's bytes
    (:func:`os.fsencode`), whatever the output's encoding, as ``sha256sum -c`` reads it."""
    escaped = "".join(
        "\\\\" if c == "\\" else shown(c) if _drives_the_terminal(c) else c for c in name
    )
    return f"{sha256}  {name}" if escaped == name else f"\\{sha256}  {escaped}"


def _drives_the_terminal(character: str) -> bool:
    """Whether ``character`` is a control or format character (an escape sequence's ESC, a
    line break, a bidirectional override), which a checksum line escapes."""
    return unicodedata.category(character) in ("Cc", "Cf")


_CHECK_LINE = re.compile(r"(\\?)([0-9a-fA-F]{64}) [ *](.+)")
_CHECK_BSD = re.compile(r"(\\?)SHA256 \((.+)\) = ([0-9a-fA-F]{64})")
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)")
_SHORT_ESCAPES = {"n": "\n", "r": "\r", "t": "\t"}


def _unescaped(match: re.Match[str]) -> str:
    """The character one escape of a checksum line's name stands for (see
    :func:`checksum_line`): ``\\n``, ``\\r``, ``\\t``, ``\\xHH``, ``\\uHHHH``, ``\\UHHHHHHHH``
    (one Unicode has), else what follows the backslash."""
    code = match[1]
    if len(code) > 1 and int(code[1:], 16) <= sys.maxunicode:
        return chr(int(code[1:], 16))
    return _SHORT_ESCAPES.get(code, code)


def parse_checksum_line(line: str) -> tuple[str, str] | None:
    """(sha256, name) of one line of a checksum list (``sha256sum``'s or the BSD ``SHA256 (name)
    = hex`` form), or None for a line of neither form."""
    found = _CHECK_LINE.fullmatch(line)
    if found is not None:
        escaped, digest, name = found.groups()
    else:
        found = _CHECK_BSD.fullmatch(line)
        if found is None:
            return None
        escaped, name, digest = found.groups()
    if escaped:
        name = _ESCAPE.sub(_unescaped, name)
    return digest.lower(), name


async def _read_list(text: str) -> list[str]:
    """The lines of the checksum list ``text`` (``-``: standard input), split at line feeds
    alone, one carriage return before each dropped (a list written on Windows), as
    ``sha256sum -c`` reads them: a name may hold any other character (U+2028, a form feed)."""
    listed = _readable(source_arg(text))
    try:
        if isinstance(listed, str):
            data = await anyio.Path(listed).read_bytes()
        else:  # a socket on standard input, read to its end
            data, _ = await read_object(listed)
    except OSError as exc:
        raise SourceNotFoundError(
            f"cannot read checksum list: {exc.strerror or exc}", url=text
        ) from None
    lines = data.decode("utf-8", errors="surrogateescape").split("\n")
    return [line.removesuffix("\r") for line in lines]


async def run_hash_check(args: argparse.Namespace) -> int:
    """``hash --check LIST...``: as ``sha256sum -c``, each listed source (local or remote) read
    whole and its sha256 compared with the list's: ``NAME: OK`` or ``NAME: FAILED``; exit status
    1 if one differs, 2 if one cannot be read or a list cannot be read or holds no checksum
    line (said, and the other lists checked)."""
    if args.content or args.file or args.json:
        raise UsageError("--check takes checksum lists alone (no --content, --file or --json)")
    status = EXIT_OK
    mismatched = unreadable = 0
    for listed in args.sources:
        try:
            lines = await _read_list(listed)
        except SafetensorsError as exc:  # missing, a directory: said, the other lists checked
            failed(listed, exc)
            status = EXIT_ERROR
            continue
        # a blank line or a comment (its first character a #) skipped, as sha256sum -c does
        entries = [parse_checksum_line(line) for line in lines if line.strip() and line[0] != "#"]
        malformed = entries.count(None)
        if malformed == len(entries):
            failed(listed, UsageError("no properly formatted SHA256 checksum lines found"))
            status = EXIT_ERROR
            continue
        for entry in entries:
            if entry is None:
                continue
            want, name = entry
            named = shown(redact(name))  # no password nor signature; no line forged
            try:
                got = await tools.file_sha256(_readable(source_arg(name)), **options_of(args))
            except SafetensorsError as exc:
                failed(name, exc)
                print(f"{named}: FAILED open or read")
                unreadable += 1
                continue
            print(f"{named}: {'OK' if got == want else 'FAILED'}")
            mismatched += got != want
        if malformed:
            lines_word = "line is" if malformed == 1 else "lines are"
            print(
                f"{PROG}: WARNING: {malformed} {lines_word} improperly formatted", file=sys.stderr
            )
    if unreadable:
        files = "file" if unreadable == 1 else "files"
        print(f"{PROG}: WARNING: {unreadable} listed {files} could not be read", file=sys.stderr)
        status = EXIT_ERROR
    if mismatched:
        sums = "checksum" if mismatched == 1 else "checksums"
        print(f"{PROG}: WARNING: {mismatched} computed {sums} did NOT match", file=sys.stderr)
        status = max(status, EXIT_DIFFERENT)
    return status


async def run_diff(args: argparse.Namespace) -> int:
    a, b = one_source_arg(args.a), one_source_arg(args.b)
    if a == b == "/dev/stdin":
        raise UsageError("standard input can be read once: name '-' once")
    with progress_reporter("comparing", args.quiet or not args.content) as progress:
        result = await tools.diff(
            _readable(a),
            _readable(b),
            content=args.content,
            progress=progress,
            **options_of(args),
        )
    if args.json:
        print_json(result.to_json())
    else:
        for name in result.added:
            print(f"+ {shown(name)}")
        for name in result.removed:
            print(f"- {shown(name)}")
        for name, changes in result.changed.items():
            detail = ", ".join(f"{key} {a} -> {b}" for key, (a, b) in changes.items())
            print(f"~ {shown(name)}: {detail}")
        for key in result.metadata_added:
            print(f"+ metadata {shown(key)}: {brief(result.metadata_values[key])}")
        for key in result.metadata_removed:
            print(f"- metadata {shown(key)}: {brief(result.metadata_values[key])}")
        for key, (a, b) in result.metadata_changed.items():
            print(f"~ metadata {shown(key)}: {brief(a)} -> {brief(b)}")
        for name in result.content_differs:
            print(f"~ {shown(name)}: content differs")
        if result.equal:
            compared = " (content compared)" if result.content_compared else ""
            print(f"equal{compared}")
    return EXIT_OK if result.equal else EXIT_DIFFERENT


def _load_shapes(path: str | None) -> dict[str, list[int]] | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            shapes = decode_json(f.read(), f"expected shapes {path}", strict=True)
    except (OSError, SafetensorsError) as exc:
        raise UsageError(f"--expect-shapes: cannot read {path}: {exc}") from None
    try:  # checked here, once, as validate() checks it: the option's error, not each source's
        return expected_shapes(_minus_zero_as_zero(shapes))
    except SafetensorsError as exc:
        raise UsageError(
            f"--expect-shapes: {path} must map tensor names to shapes (lists of integers >= 0): "
            f"{exc}"
        ) from None


def _minus_zero_as_zero(shapes: object) -> object:
    """The ``--expect-shapes`` document, each dimension written ``-0`` taken as the integer 0
    (as :func:`json.loads` reads it): the strict reader keeps ``-0`` apart, a :class:`Number`,
    which is no dimension in a safetensors header but no negative one either."""
    if not isinstance(shapes, dict):
        return shapes
    return {
        name: [0 if isinstance(dim, Number) and dim == "-0" else dim for dim in shape]
        if isinstance(shape, list)
        else shape
        for name, shape in shapes.items()
    }


def _load_config(path: str | None) -> ModelConfig | None:
    """The ``--config`` file, read once for every source: an unreadable or unusable one is the
    option's error, before any source is read, not each source's."""
    if path is None:
        return None
    try:
        return ModelConfig.read(path)
    except SafetensorsError as exc:
        raise UsageError(f"--config: {exc}") from None


async def run_validate(args: argparse.Namespace) -> int:
    shapes = _load_shapes(args.expect_shapes)
    config = _load_config(args.config)

    async def one(source: str) -> int:
        with progress_reporter("validating", args.quiet) as progress:
            result = await tools.validate(
                _readable(source),
                expect_shapes=shapes,
                expect_layers=args.expect_layers or (),
                config=config,
                warn_abs=args.warn_abs,
                progress=progress,
                **options_of(args),
            )
        if args.json:
            print_json(result.to_json(load=args.stats))
        else:
            print_validation(result)
            if args.stats:
                print(f"load: {result.load.summary()}")
        return EXIT_OK if result.ok else EXIT_DIFFERENT

    return await _each(args, one)


def _is_directory(dst: str) -> bool:
    """Whether ``cp`` writes into ``dst`` rather than as it: a trailing slash (a local directory,
    an S3 prefix, an HTTP folder; of a URL's path, a query after it or not, where an S3 key,
    which has none, runs to its end), a bucket alone (``s3://bucket``), or an existing local
    directory (a path or a ``file://`` URL), as ``cp`` and ``aws s3 cp`` take them."""
    if dst == STDIO:
        return False
    local = local_path(dst)
    if local is not None:
        return local.endswith("/") or os.path.isdir(local)
    parts = split_address(dst)  # the path says, before any query (an upload's token)
    return parts.path.endswith("/") or (parts.scheme.lower() == "s3" and parts.path == "/")


def _source_name(src: str, dst: str) -> str:
    """The name a copy of ``src`` takes in the directory or prefix ``dst``."""
    local = local_path(src, UnsupportedSourceError)  # a file:// URL's, as its reader opens it
    path = split_address(src).path if local is None else local
    name = posixpath.basename(path.rstrip("/"))
    if not name or src == "/dev/stdin" or src.lower().startswith("tcp://"):
        shown = STDIO if src == "/dev/stdin" else redact(src)
        raise UsageError(
            f"{redact(dst)} is a directory: name the file to write in it ({shown} has no name "
            "to take)"
        )
    return name


def _copy_options(args: argparse.Namespace, progress: Any) -> dict[str, Any]:
    return {
        "include": args.include or None,
        "dtype": args.dtype,
        "quantize": args.quantize,
        "dequantize": args.dequantize,
        "checksums": True if args.checksums else None,
        "progress": progress,
        **options_of(args),
    }


@contextmanager
def _include_named(args: argparse.Namespace) -> Iterator[None]:
    """A name ``--include`` gives that the source does not hold is the option's error."""
    try:
        yield
    except TensorNotFoundError as exc:
        if not args.include:
            raise
        said = surrogates_as_bytes(str(exc).removeprefix("include= "))  # the names' reprs
        raise UsageError(f"--include {said} (stream-st ls {args.src} lists them)") from None


async def run_cp(args: argparse.Namespace) -> int:
    src = one_source_arg(args.src)
    into = _is_directory(args.dst)
    if args.json and args.dst == STDIO:
        raise UsageError("--json prints to standard output, where the copy goes: drop one")
    if is_index(src) and not args.merge:
        if not into:
            raise UsageError(
                f"{redact(args.src)} is a sharded checkpoint: copy it into a directory or prefix "
                "(a destination ending in /) to mirror its shards and index, or merge it into one "
                "file with --merge"
            )
        with progress_reporter("copying", args.quiet) as progress, _include_named(args):
            written = await tools.mirror(src, args.dst, **_copy_options(args, progress))
        done = f"copied {plural(len(written) - 1, 'shard')} and the index to {args.dst}"
        _report_copy(args, done, {"written": written}, last_stats())
        return EXIT_OK
    if into:
        name = _source_name(src, args.dst)
        if is_index(src):  # --merge: one file, named as the index less its suffix
            if not name.endswith(INDEX_SUFFIX):
                raise UsageError(
                    f"{redact(args.src)} is a manifest: name the file to merge it into"
                )
            name = name[: -len(INDEX_SUFFIX)]
        args.dst = address_in(args.dst, name)
    elif is_index(src) and args.dst.endswith(INDEX_SUFFIX):
        raise UsageError(
            f"--merge writes one safetensors file, not an index: name it other than {args.dst}"
        )
    made: list[str] = []  # local directories made for the copy, removed if it fails
    try:
        local = local_path(args.dst)
        if into and local is not None:
            make_directory(os.path.dirname(local), made)
        dst = await _destination(args.dst)
        with progress_reporter("copying", args.quiet) as progress, _include_named(args):
            try:
                copied = await tools.cp(_readable(src), dst, **_copy_options(args, progress))
            except TransportError as exc:
                if args.dst == STDIO and isinstance(exc.__cause__, BrokenPipeError):
                    raise exc.__cause__ from None  # the reader went away (``| head``): exit 141
                cause = exc.__cause__
                if (
                    isinstance(dst, PipeSink | SocketSink)
                    and exc.url == dst.name
                    and isinstance(cause, OSError)
                ):
                    raise OutputError(cause, exc.position) from cause  # as every command says it
                raise
    except BaseException:  # failed, interrupted or stopped: nothing left at DST, no directory
        for directory in reversed(made):
            with suppress(OSError):  # no longer empty, or gone: leave it
                os.rmdir(directory)
        raise
    header = copied.header
    done = f"copied {plural(len(header), 'tensor')}, {header.file_size:,} bytes to {args.dst}"
    how = "quantized" if args.quantize else "dequantized" if args.dequantize else None
    if how is None and args.dtype:
        how = f"converted to {args.dtype.upper()}"
    if how is not None:
        done += f"; {copied.converted or 'nothing'} {how}"
    record = {"tensors": len(header), "bytes": header.file_size, "converted": copied.converted}
    _report_copy(args, done, record, copied.load)
    return EXIT_OK


def _report_copy(
    args: argparse.Namespace, done: str, record: dict[str, Any], load: LoadStats | None
) -> None:
    """What ``cp`` says once done: ``done`` on standard error (unless ``-q``), the read's
    statistics with ``--stats``; with ``--json``, one record on standard output instead."""
    if args.json:
        record = {"source": redact(args.src), "destination": redact(args.dst), **record}
        if "written" in record:
            record["written"] = [redact(address) for address in record["written"]]
        if args.stats and load is not None:
            record["load"] = load.to_json()
        print_json(record)
        return
    if not args.quiet:
        print(shown(redact(done)), file=sys.stderr)  # DST's name cannot drive the terminal
    if args.stats and load is not None:
        print(f"load: {load.summary()}", file=sys.stderr)


async def run_serve(args: argparse.Namespace) -> int:
    """Serve a checkpoint over HTTP until stopped (SIGINT, SIGTERM: see ``app``)."""
    from ..server import serving
    from ..server.app import TOKEN_ENV, token_problem

    token = args.token  # checked as parsed
    if token is None and (token := os.environ.get(TOKEN_ENV)) is not None:
        problem = token_problem(token)  # a variable set empty must not serve without a token
        if problem is not None:
            raise UsageError(f"{TOKEN_ENV} is {problem}: set it to the token, or unset it")
    checksums = False if args.no_checksums else args.checksums or None
    async with serving(
        args.path,
        host=args.host,
        port=args.port,
        token=token,
        name=args.name,
        checksums=checksums,
    ) as server:
        needs = ", bearer token required" if token else ""
        print(
            f"serving {server.url} ({plural(len(server.header), 'tensor')}, "
            f"{human(server.size)}{needs}); Ctrl-C stops",
            flush=True,
        )
        await anyio.sleep_forever()
    return EXIT_OK  # pragma: no cover - only a signal ends it


async def run_demo_command(args: argparse.Namespace) -> int:
    if not args.synthetic:
        return await run_model_demo(args)
    if args.text is not None or args.context is not None:
        raise UsageError(
            "--text and --context choose what the model scores: use them without --synthetic"
        )
    codecs = args.codecs or ("none", "int8", "int4")
    layers = 22 if args.layers is None else args.layers
    seq = 2048 if args.seq is None else args.seq
    results = await run_demo(layers, seq, codecs, **limits_of(args))
    if args.json:
        print_json(
            {
                "layers": layers,
                "seq": seq,
                "transfers": [
                    {
                        **{k: v for k, v in asdict(r).items() if k != "start"},  # a clock's
                        "transfer_time": r.transfer_time,
                        "overlap_efficiency": r.overlap_efficiency,
                    }
                    for r in results
                ],
            }
        )
    else:
        print_report(results, layers, seq)
    return EXIT_OK


async def run_model_demo(args: argparse.Namespace) -> int:
    from .demo import print_model_report, problems, run_model_demo

    if args.layers is not None or args.seq is not None:
        raise UsageError("--layers and --seq size the synthetic cache: use them with --synthetic")
    text = None
    if args.text is not None:
        try:
            text = await anyio.Path(args.text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise UsageError(f"cannot read --text {args.text}: {detail}") from None
    codecs = args.codecs or ("none", "f16", "int8", "int4")
    with status_line("stream-st demo", args.quiet) as progress:
        demo = await run_model_demo(
            text, context=args.context, codecs=codecs, progress=progress, **limits_of(args)
        )
    if args.json:
        print_json(demo.to_json())
    else:
        print_model_report(demo)
    return EXIT_DIFFERENT if problems(demo) else EXIT_OK  # the verdict CHECK


async def run_completion(args: argparse.Namespace) -> int:
    argcomplete = argcomplete_module()
    if argcomplete is None:
        raise UsageError("shell completion needs argcomplete: pip install -e '.[cli]'")
    print(argcomplete.shellcode([PROG], shell=args.shell), end="")
    return EXIT_OK


def argcomplete_module() -> Any:
    """The argcomplete module (the ``cli`` extra), or None when it is not installed."""
    try:
        import argcomplete
    except ImportError:
        return None
    return argcomplete
