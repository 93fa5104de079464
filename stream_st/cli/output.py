"""What the command prints: progress bars and lines, JSON, sizes, errors (its exit statuses:
:mod:`.exits`)."""

from __future__ import annotations

import argparse
import codecs
import errno
import functools
import io
import itertools
import json
import math
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from types import EllipsisType
from typing import Any, TextIO, cast

import ml_dtypes
import numpy as np

from .. import tools
from ..core.digests import ALGORITHM_KEY, ALGORITHMS, DIGEST_KEY_PREFIX
from ..core.header import TensorInfo
from ..errors import SafetensorsError, StreamStWarning, UsageError, cites, redact
from ..tools.common import Progress, plural

__all__ = ["PROG", "STDIO", "OutputError"]


STDIO = "-"
"""The argument that means standard input (a source) or standard output (a destination)."""


class OutputError(Exception):
    """Standard output cannot be written (a full disk, a descriptor closed with ``>&-``, a pipe
    whose reader went away): the command's failure, reported once. Neither a
    :class:`~stream_st.SafetensorsError`, which a command going through several sources takes
    as one source's, nor an :class:`OSError`, which a command may take as its own (the cache's
    folder); the :class:`OSError` is its ``__cause__``, ``position`` the byte a copy to
    standard output stopped at."""

    def __init__(self, cause: OSError, position: int | None = None) -> None:
        reason = cause.strerror or str(cause)
        super().__init__(reason if position is None else f"{reason}, at byte {position}")


class _Output(io.TextIOBase):
    """Standard output as the command writes it: ``stream`` (None when the command was started
    with it closed, where Python drops whatever is printed), every failure to write it an
    :class:`OutputError`; a character its encoding lacks (an ``ascii`` or Latin-1 one: a C
    locale, ``PYTHONIOENCODING``) written escaped, ``\\xe9``, as standard error writes it."""

    def __init__(self, stream: TextIO | None) -> None:
        super().__init__()
        self.stream = stream

    @contextmanager
    def _failing(self) -> Iterator[TextIO]:
        """The stream, its :class:`OSError` (a closed one's: ``EBADF``) an :class:`OutputError`."""
        try:
            if self.stream is None:
                raise OSError(errno.EBADF, os.strerror(errno.EBADF))
            yield self.stream
        except OSError as exc:
            raise OutputError(exc) from exc

    @property
    def encoding(self) -> str:  # type: ignore[override]  # a plain attribute in io.TextIOBase
        """The stream's encoding (UTF-8 where it has none)."""
        return getattr(self.stream, "encoding", None) or "utf-8"

    def write(self, text: str) -> int:
        with self._failing() as stream:
            try:
                return stream.write(text)
            except UnicodeEncodeError:  # raised before a byte is written
                escaped = text.encode(self.encoding, "backslashreplace")
                return stream.write(escaped.decode(self.encoding))

    def write_bytes(self, data: bytes) -> None:
        """Write ``data`` as they are, past the encoding, into the stream's binary buffer after
        the text written before them; a stream with none (text in memory) takes them as UTF-8
        text, a byte that is not UTF-8 as the surrogate Python reads it into."""
        with self._failing() as stream:
            stream.flush()
            buffer = getattr(stream, "buffer", None)
            if buffer is None:
                stream.write(data.decode("utf-8", "surrogateescape"))
            else:
                buffer.write(data)
                buffer.flush()  # as the text before them, line by line on a terminal

    def flush(self) -> None:
        if self.stream is not None:  # a closed one holds nothing to flush
            with self._failing() as stream:
                stream.flush()

    def fileno(self) -> int:
        with self._failing() as stream:
            return stream.fileno()

    def isatty(self) -> bool:
        return self.stream is not None and self.stream.isatty()

    def close(self) -> None:
        """Leave standard output open (io's finalizer calls this): the command only writes."""


@contextmanager
def standard_output() -> Iterator[None]:
    """Within the block, standard output (``sys.stdout``) fails with :class:`OutputError`, and
    it is flushed as the block ends (whatever ends it: ``--help`` exits), so that a failure shows
    there, not in the flush at interpreter exit."""
    original = sys.stdout
    sys.stdout = cast(TextIO, _Output(original))
    try:
        yield
    finally:
        try:
            sys.stdout.flush()
        finally:
            sys.stdout = original


class _Errors(io.TextIOBase):
    """Standard error as the command writes it: ``stream``, until a write to it fails (a full
    disk, ``2>/dev/full``); what it cannot take is dropped from then on, as for standard error
    closed (``2>&-``), so that a line the command could not say never changes what it does: a
    copy that warns succeeds, an error exits with 2 (the :class:`OSError` escaping made it 1)."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self.stream = stream
        self.dropping = False

    def _try(self, call: Callable[[TextIO], object]) -> None:
        """``call`` on the stream, unless it failed before; its first failure, dropping."""
        if self.dropping:
            return
        try:
            call(self.stream)
        except OSError:
            self.dropping = True

    @property
    def encoding(self) -> str:  # type: ignore[override]  # a plain attribute in io.TextIOBase
        """The stream's encoding (UTF-8 where it has none)."""
        return getattr(self.stream, "encoding", None) or "utf-8"

    def write(self, text: str) -> int:
        self._try(lambda stream: stream.write(text))
        return len(text)

    def flush(self) -> None:
        self._try(lambda stream: stream.flush())

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return not self.dropping and self.stream.isatty()

    def close(self) -> None:
        """Leave standard error open (io's finalizer calls this)."""


@contextmanager
def standard_error() -> Iterator[None]:
    """Within the block, what standard error (``sys.stderr``) cannot take is dropped, with all
    that follows it (see :class:`_Errors`)."""
    original = sys.stderr
    sys.stderr = cast(TextIO, _Errors(original))
    try:
        yield
    finally:
        sys.stderr = original


def print_bytes(line: bytes) -> None:
    """``line`` and a line feed on the command's standard output (see :func:`standard_output`)
    as they are, whatever its encoding: a file name's bytes, as ``sha256sum`` writes them, where
    text its encoding lacks is written escaped."""
    cast(_Output, sys.stdout).write_bytes(line + b"\n")


def discard_output() -> None:
    """Point the file descriptor of standard output at the null device, so that what could not
    be written (a pipe closed, a disk full) is dropped by the flush at interpreter exit instead
    of failing there again, as the Python docs recommend for a closed pipe."""
    if sys.stdout is None:  # started closed: nothing is flushed at exit
        return
    with suppress(OSError, ValueError):  # no descriptor (output captured in memory)
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, sys.stdout.fileno())
        finally:
            os.close(null)


class _Bar:
    """A rich progress bar on stderr: bytes, rate, tensors and ETA, its totals set from the
    headers as soon as the command has read them (the ``totals`` of :mod:`stream_st.tools`)."""

    def __init__(self, label: str) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            DownloadColumn(),  # decimal units, as human and TransferSpeedColumn
            TransferSpeedColumn(),
            TextColumn("{task.fields[tensors]}{task.fields[of]} tensors"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self._label = label
        self._task = self._bar.add_task(label, total=None, tensors=0, of="")

    def totals(self, total_bytes: int, total_tensors: int) -> None:
        self._bar.update(self._task, total=total_bytes, of=f"/{total_tensors}")

    def note(self, text: str) -> None:
        """Show ``text`` (a short notice) after the label."""
        self._bar.update(self._task, description=f"{self._label} ({text})")

    def __call__(self, done_bytes: int, done: int) -> None:
        self._bar.update(self._task, completed=done_bytes, tensors=done)

    def __enter__(self) -> _Bar:
        self._bar.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._bar.stop()


class _Lines:
    """Plain progress lines on stderr, at most one a second, for a terminal without rich."""

    INTERVAL = 1.0

    def __init__(self, label: str) -> None:
        self._label = label
        self._of_bytes = self._of_tensors = ""
        self._began = self._shown = time.monotonic()
        self._done = (0, 0)

    def totals(self, total_bytes: int, total_tensors: int) -> None:
        self._of_bytes, self._of_tensors = f" of {human(total_bytes)}", f"/{total_tensors}"

    def note(self, text: str) -> None:
        """Show ``text`` (a short notice) after the label."""
        self._label = f"{self._label} ({text})"

    def __call__(self, done_bytes: int, done: int) -> None:
        self._done = (done_bytes, done)
        if time.monotonic() - self._shown >= self.INTERVAL:
            self.run_show()

    def run_show(self) -> None:
        self._shown = time.monotonic()
        done_bytes, done = self._done
        rate = done_bytes / max(self._shown - self._began, 1e-9)
        print(
            f"{self._label}: {human(done_bytes)}{self._of_bytes}, {done}{self._of_tensors} "
            f"tensors, {human(rate)}/s",
            file=sys.stderr,
            flush=True,
        )

    def __enter__(self) -> _Lines:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if exc_info[0] is None:
            self.run_show()


@contextmanager
def progress_reporter(label: str, quiet: bool) -> Iterator[Progress | None]:
    """Progress on stderr while a command moves data: a rich bar, or plain lines without rich;
    nothing when quiet or when stderr is not a terminal."""
    if quiet or not sys.stderr.isatty():
        yield None
        return
    try:
        report: _Bar | _Lines = _Bar(label)
    except ImportError:  # the cli extra is not installed
        report = _Lines(label)
    _NOTES.append(report.note)
    try:
        with report:
            yield report
    finally:
        _NOTES.remove(report.note)


_NOTES: list[Callable[[str], None]] = []
"""The running progress displays' :meth:`note` methods: a warning shows in them too."""

SHORT_NOTES = {"RangeIgnoredWarning": "server ignores ranges: reading it whole"}
"""What a warning of each category says in a progress line."""


@contextmanager
def warnings_as_lines() -> Iterator[None]:
    """Within the block, every warning shown (stream_st's own,
    :class:`~stream_st.StreamStWarning`, each once; a cache that cannot be used, a
    ``RuntimeWarning``) prints as one ``stream-st: warning: ...`` line on stderr, escaped as
    :func:`shown_message` escapes it, never as Python's two lines of a source file, and shows in the
    progress line."""

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        for note in _NOTES:
            note(SHORT_NOTES.get(category.__name__, "warning"))
        print(f"{PROG}: warning: {shown_message(str(message))}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():
        warnings.showwarning = show
        warnings.simplefilter("default", StreamStWarning)
        yield


def print_json(value: Any) -> None:
    """One JSON record on one line (a stream of them reads with ``jq`` or line by line), strict
    JSON: a float that is not finite (a standard deviation beyond float64's range) is ``null``,
    where Python's ``json`` would write ``Infinity`` or ``NaN``, which JSON has not. Text goes
    out as it is on a UTF-8 standard output, else (an ``ascii`` or Latin-1 one) in ``\\u00e9``
    escapes, which every encoding carries."""
    print(_json_text(value))


def _json_text(value: Any) -> str:
    """``value`` as :func:`print_json` writes it, without the line's end: every character
    :func:`shown` escapes (a control or format character, U+2028: ``json`` writes all but
    U+0000 to U+001F as they are) in a JSON escape, so the record parses to the same text."""
    ascii_only = not _utf8_output()
    text = json.dumps(
        _strict(value), ensure_ascii=ascii_only, separators=(",", ":"), allow_nan=False
    )
    return _escape_unprintable(text, _json_escape)  # in strings alone: the rest is ASCII


def _json_escape(character: str) -> str:
    """``character`` as a JSON escape, ``\\u009b``; past U+FFFF as its UTF-16 surrogate pair,
    ``\\udb40\\udc01``, as JSON writes it."""
    code = ord(character)
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def _utf8_output() -> bool:
    """Whether standard output is written in UTF-8 (so carries any text)."""
    try:
        return codecs.lookup(getattr(sys.stdout, "encoding", None) or "utf-8").name == "utf-8"
    except LookupError:
        return False


def _strict(value: Any) -> Any:
    """``value`` with every float that is not finite made None, and every text that holds bytes
    no UTF-8 can (a file name's, kept by Python as surrogates) shown with those bytes escaped
    (``bad\\xffname``), in lists and dicts too."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        if value.isascii():
            return value
        try:
            value.encode()
        except UnicodeEncodeError:
            return value.encode(errors="surrogateescape").decode(errors="backslashreplace")
        return value
    if isinstance(value, dict):
        return {_strict(key): _strict(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_strict(item) for item in value]
    return value


def human(n: float) -> str:
    """A size in decimal units, as the progress bars show them: in the first unit where it
    rounds below 1000 (999,950 bytes is ``1.0 MB``, not ``1000.0 kB``)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        text = f"{n:.0f}" if unit == "B" else f"{n:.1f}"
        if abs(float(text)) < 1000 or unit == "TB":
            return f"{text} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def shown(text: str) -> str:
    """``text`` (a tensor name, a metadata key or value from a file, a file name) as a terminal
    may be given it: control and format characters (an escape sequence, a newline that would
    forge a line of the output, a bidirectional override) escaped as Python escapes them, a
    byte of a file name that is not UTF-8 (a surrogate Python keeps it as) as ``\\xff``, a
    backslash doubled (so the name ``a\\nb`` and ``a``, a newline, ``b`` show apart), the
    rest as it is."""
    return shown_message(text.replace("\\", "\\\\"))


def shown_message(text: str) -> str:
    """A message (an error's, a warning's) escaped as :func:`shown` escapes a name, its
    backslashes left as they are: the names in it are quoted as ``repr`` quotes them, their
    backslashes doubled already."""
    return _escape_unprintable(text, _escaped)


def _escape_unprintable(text: str, escape: Callable[[str], str]) -> str:
    """``text`` with every character that is not printable (as ``str.isprintable`` says: a
    control or format character, a line or paragraph separator, a space but U+0020, a
    surrogate, one for private use or unassigned) written as ``escape`` writes it: the one
    notion of what the command's output escapes, its text's and its JSON's. In one pass of
    :func:`_unprintable` over the text, at C's speed where there is nothing to escape."""
    if text.isprintable():
        return text

    def escaped(match: re.Match[str]) -> str:
        found = match[0]
        return found if found.isprintable() else escape(found)  # printable past U+FFFF

    return _unprintable().sub(escaped, text)


@functools.cache
def _unprintable() -> re.Pattern[str]:
    """What :func:`_escape_unprintable` looks for: a character up to U+FFFF that is not
    printable, or any past U+FFFF (their ranges, hundreds, would make the test of every
    character slow: one is judged as it is found, in text seldom past U+FFFF). Made on its
    first use from ``str.isprintable`` itself (some 40 ms), so it follows Python's Unicode
    tables; one character a match (a run, ``[...]+``, takes ``re`` three times as long)."""
    ranges, start = [], 0
    for printable, run in itertools.groupby(map(chr, range(0x10000)), str.isprintable):
        end = start + sum(1 for _ in run)
        if not printable:
            ranges.append(f"\\u{start:04x}-\\u{end - 1:04x}")
        start = end
    return re.compile(f"[{''.join(ranges)}\\U00010000-\\U0010ffff]")


def _escaped(character: str) -> str:
    """One character that :func:`shown` escapes, as Python escapes it; a byte that is not
    UTF-8, which Python reads into a surrogate from U+DC80 to U+DCFF, as the byte."""
    if "\udc80" <= character <= "\udcff":
        return f"\\x{ord(character) - 0xDC00:02x}"
    return character.encode("unicode_escape").decode()


_REPR_ESCAPE = re.compile(r"\\(?:udc([89a-f][0-9a-f])|.)")
"""One escape of a ``repr``: a surrogate's (``\\udcff``, a byte Python read that is not UTF-8,
its two hex digits kept), or any other's, its backslash and the letter after it."""


def surrogates_as_bytes(text: str) -> str:
    """``text``, holding ``repr``s of names (an error's message), with the escape a ``repr``
    gives a byte of an argument that is not UTF-8, ``\\udcff``, written as :func:`shown` writes
    the byte, ``\\xff``; every backslash of ``text`` starts an escape of its ``repr``s."""
    return _REPR_ESCAPE.sub(lambda m: f"\\x{m[1]}" if m[1] else m[0], text)


def brief(value: str, limit: int = 200) -> str:
    """A metadata value as ``repr`` shows it, cut to about ``limit`` characters."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value):,} characters)"


def without_digests(metadata: Mapping[str, str]) -> dict[str, str]:
    """``metadata`` (a checkpoint's, merged from its shards') without the keys of its digests:
    those of a shard, and those labelled ``key (shard N)`` where shards differ in them."""
    return {
        k: v
        for k, v in metadata.items()
        if not k.startswith((DIGEST_KEY_PREFIX, ALGORITHM_KEY + " (shard ")) and k != ALGORITHM_KEY
    }


def digests_line(shards: Sequence[tuple[Mapping[str, str], Collection[str]]]) -> str | None:
    """What the digests of ``shards`` (each a shard header's own metadata and its tensors'
    names) say in one line: the algorithms (named by a file's metadata, so each escaped as
    :func:`shown` escapes a name), how many tensors have one, and whether a read can check them
    (not for an unknown algorithm, nor for a shard whose digests are not one for each of its
    tensors); None when there are none. Each shard's record is judged on its own."""
    algorithms: dict[str, None] = {}  # in shard order, each once
    digested = tensors = recorded = 0
    damaged = unchecked = False
    for metadata, names in shards:
        keys = {k[len(DIGEST_KEY_PREFIX) :] for k in metadata if k.startswith(DIGEST_KEY_PREFIX)}
        algorithm = metadata.get(ALGORITHM_KEY)
        if not keys and algorithm is None:
            continue
        algorithms[shown(algorithm) if algorithm else "no algorithm named"] = None
        digested, tensors, recorded = digested + len(keys), tensors + len(set(names)), recorded + 1
        unchecked |= algorithm not in ALGORITHMS
        damaged |= keys != set(names)
    if not recorded:
        return None
    line = f"{' and '.join(algorithms)} digests of {plural(digested, 'tensor')}"
    if recorded < len(shards):
        line += f" in {recorded} of {len(shards)} shards"
    if unchecked:
        return f"{line}, which no read can check (read with verify=False)"
    if damaged:
        return f"{line} of {tensors}: a damaged record, reads refuse it"
    return f"{line}, one each (checked as read)"


def failed(source: str, exc: SafetensorsError) -> None:
    """Report one source's error on one line, naming the source where the message does not. The
    source's name (from a file or a list) is shown as :func:`shown` shows a name, where the
    message names it too: it cannot forge a line, nor two names show alike."""
    text, source = str(exc), redact(source)
    named = cites(text, source) or (source == "/dev/stdin" and "stdin" in text)
    name = shown(source)
    message = text.replace(source, name) if named else f"{name}: {text}"
    print(f"stream-st: error: {shown_message(message)}", file=sys.stderr)


VALUES_CHUNK = 1 << 16
"""About how many of a tensor's values ``show --json`` turns into text at a time."""


def _write_values(values: np.ndarray[Any, Any]) -> None:
    """Write ``values`` to standard output as the JSON of its nested lists (:func:`json_values`
    of :func:`plain`'s ``tolist``), a run of :data:`VALUES_CHUNK` values or so at a time: the
    text of a whole tensor, and its values as Python objects, held at once took some twenty
    times the tensor's size."""
    write = sys.stdout.write
    if values.size <= VALUES_CHUNK:  # a scalar, an empty tensor: all at once
        write(_values_text(values))
        return
    write("[")
    row = values[0].size  # at least 1: none of the dimensions of so many values is 0
    if row > VALUES_CHUNK:  # one row at a time, each in runs
        for at in range(len(values)):
            if at:
                write(",")
            _write_values(values[at])
    else:  # rows, as many as make a run, at a time
        step = VALUES_CHUNK // row
        for at in range(0, len(values), step):
            if at:
                write(",")
            write(_values_text(values[at : at + step])[1:-1])
    write("]")


def _values_text(values: np.ndarray[Any, Any]) -> str:
    """The JSON of ``values``' nested lists, as :func:`print_json` writes them."""
    return json.dumps(
        json_values(np.asarray(plain(values)).tolist()), separators=(",", ":"), allow_nan=False
    )


def json_values(values: Any) -> Any:
    """Nested lists of plain numbers; NaN and infinities as the strings JSON lacks them as."""
    if isinstance(values, list):
        return [json_values(v) for v in values]
    if isinstance(values, float) and not math.isfinite(values):
        return str(values)
    return values


def plain(values: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``values`` in a dtype whose ``tolist`` gives JSON numbers: ml_dtypes' floats (bfloat16,
    float8) as float64, complex numbers as [real, imaginary] pairs."""
    if values.dtype.kind == "c":
        return np.stack([values.real, values.imag], axis=-1)
    if values.dtype.kind == "V":
        return values.astype(np.float64)
    return values


_F4_VALUES = np.dtype(ml_dtypes.float4_e2m1fn)
"""What an F4 tensor's values are shown as: one ``float4_e2m1fn`` per value."""


def _f4_values(packed: np.ndarray[Any, Any], shape: Sequence[int]) -> np.ndarray[Any, Any]:
    """The values of an F4 tensor of ``shape`` from its packed bytes (as the reader delivers
    them, two values a byte, low nibble first as torch's ``float4_e2m1fn_x2``), one
    ``float4_e2m1fn`` each, in ``shape``."""
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1)
    return codes.reshape(shape).view(_F4_VALUES)


def _in_range(
    index: tuple[int | slice | EllipsisType, ...], shape: Sequence[int]
) -> tuple[int | slice | EllipsisType, ...]:
    """``index`` when each of its integers lies within its axis (numpy words one too large for
    its own integers as a wrong kind of index); an IndexError naming the axis otherwise. The
    indices after an ellipsis are those of the last axes. Too many indices are left to numpy's
    error, which says so (an axis past an ellipsis would be named wrongly)."""
    if len(index) - (Ellipsis in index) > len(shape):
        return index
    axes = list(enumerate(index))
    if Ellipsis in index:
        at = index.index(Ellipsis)
        after = len(shape) - (len(index) - at - 1)  # the axis of the first index after it
        axes = axes[:at] + [(after + i, each) for i, each in enumerate(index[at + 1 :])]
    for axis, each in axes:
        if not (isinstance(each, int) and 0 <= axis < len(shape)):
            continue  # a slice, or an axis too many (numpy's error names it)
        size = shape[axis]
        if not -size <= each < size:
            raise IndexError(f"index {each} is out of range for axis {axis} of size {size}")
    return index


def show_values(args: argparse.Namespace, info: TensorInfo, array: np.ndarray[Any, Any]) -> None:
    """Print the tensor ``info`` (its ``--slice``), delivered as ``array``, numpy-style or as one
    JSON record. An F4 tensor's values are decoded from its packed bytes; an F6 tensor's are not
    (safetensors sets no order for the bits of its four values in three bytes): its bytes are
    shown, said to be packed, and ``--slice`` is refused."""
    code, shape = info.dtype, list(info.shape)
    packed = code != "F4" and info.dtype_info.packed
    if code == "F4":
        array = _f4_values(array, info.shape)
    elif packed and args.slice:
        raise UsageError(
            f"--slice indexes values, and {args.name!r} is {code}, whose values stream_st does "
            "not decode (safetensors sets no bit order for them): show it whole"
        )
    try:
        values = array[_in_range(args.slice, array.shape)] if args.slice else array
    except (IndexError, TypeError) as exc:
        raise UsageError(f"--slice does not fit shape {list(array.shape)}: {exc}") from None
    if args.json:  # one record, its values last, written as they are turned into text
        head = _json_text(
            {
                "name": args.name,
                "safetensors_dtype": code,
                "tensor_shape": shape,
                "packed": packed,
                "dtype": str(array.dtype),
                "shape": list(np.shape(values)),  # of what "values" holds: the slice's
            }
        )
        sys.stdout.write(f'{head[:-1]},"values":')
        _write_values(np.asarray(values))
        sys.stdout.write("}\n")
    elif packed:
        print(
            f"{shown(args.name)}: {code} {shape}, packed: {array.size} raw bytes, not values (four "
            "6-bit values in three bytes, in an order safetensors leaves open)"
        )
        print(np.array2string(array, threshold=200, edgeitems=3, formatter={"int": _hex}))
    else:
        decoded = f"F4 {shape} (float4_e2m1fn values, two a byte)" if code == "F4" else None
        print(f"{shown(args.name)}: {decoded or f'{array.dtype} {shape}'}")
        print(np.array2string(np.asarray(values), threshold=200, edgeitems=3))


def _hex(byte: np.integer[Any]) -> str:
    return f"0x{byte:02x}"


def print_validation(result: tools.Validation) -> None:
    """The source, its statistics table, its warnings and errors and its verdict. A warning or
    error names tensors unquoted (``w: 3 NaN values``), the digests line the file's algorithms: they
    are escaped as the names are (:func:`shown`), so that the names ``a\\nb`` and ``a``, a
    newline, ``b`` show apart."""
    print(f"{shown(result.source)}:")
    names = [shown(t.name) for t in result.tensors]
    width = max([len("name"), *map(len, names)])
    print(
        f"{'name':<{width}}  {'dtype':<8} {'min':>11} {'max':>11} {'mean':>11} "
        f"{'std':>11} {'nan':>6} {'inf':>6}"
    )

    def cell(value: float | None) -> str:
        return f"{value:>11.4g}" if value is not None else f"{'-':>11}"

    for name, t in zip(names, result.tensors, strict=True):
        print(
            f"{name:<{width}}  {t.dtype:<8} {cell(t.min)} {cell(t.max)} {cell(t.mean)} "
            f"{cell(t.std)} {t.nan:>6} {t.inf:>6}"
        )
    if any(t.nan or t.inf for t in result.tensors):
        print("(min, max, mean and std are of the finite values: NaN and Inf are counted apart)")
    for warning in result.warnings:
        print(f"warning: {shown(warning)}")
    for error in result.errors:
        print(f"error: {shown(error)}")
    print(f"digests: {shown(result.digests)}")
    print(
        f"{'valid' if result.ok else 'INVALID'}: {plural(len(result.tensors), 'tensor')}, "
        f"{plural(len(result.errors), 'error')}, {plural(len(result.warnings), 'warning')}"
    )


@contextmanager
def status_line(label: str, quiet: bool) -> Iterator[Callable[[str], None]]:
    """Report a long job's stage on stderr: a rich status line on a terminal where rich is
    installed (the ``cli`` extra), else one plain line per stage; nothing when quiet."""
    if quiet:
        yield lambda message: None
        return
    console = None
    with suppress(ImportError):
        from rich.console import Console

        console = Console(stderr=True)
    if console is None or not console.is_terminal:
        yield lambda message: print(f"{label}: {message}", file=sys.stderr)
        return
    with console.status(label) as status:
        yield status.update


PROG = "stream-st"
"""The command's name, as users type it (and as the completion scripts register it)."""
