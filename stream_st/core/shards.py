"""What a shard name in an index or manifest may be, and the one address it gives.

An index or manifest may come from anywhere, and its shard names are opened and requested on
the reader's behalf, so they are held to one rule (:func:`shard_name`): a relative path of plain
names that stays inside the index's directory however it is read. Each reading a file system, a
URL parser or a server may apply is checked: the name as written, each percent-decoding of it
(a server decodes once, a proxy or a second parser again; at most :data:`MAX_DECODINGS`) and
the NFKC form of each. None may hold a control character, ``\\``, ``:``, ``?`` or ``#``, begin
with ``/`` or ``~``, or have an empty, ``.`` or ``..`` part. The name itself is checked, never
what it resolves to, so symlinks inside the directory (the Hugging Face cache layout) keep
working.

:func:`shard_address` then joins an accepted name to the index's directory so that it means the
same file wherever the index is, and checks that the address it built stays there. Not public API.
"""

from __future__ import annotations

import os
import posixpath
import re
import stat
import unicodedata
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard
from urllib.parse import SplitResult, quote, unquote, urlsplit, urlunsplit

from .._regex import LazyPattern
from ..errors import HeaderError, UsageError, redact, unreadable

__all__ = [
    "FORMAT_VERSION",
    "HELD_NAME",
    "INDEX_NAME",
    "INDEX_SUFFIX",
    "MANIFEST_DTYPES",
    "MANIFEST_NAME",
    "SAFETENSORS_VERSION",
    "SHARD_NAME",
    "ShardEntry",
    "address_path",
    "holds_safetensors",
    "is_index",
    "join_address",
    "literal_scheme",
    "manifest_document",
    "scheme_of",
    "shard_address",
    "shard_file_name",
    "shard_name",
    "shard_position",
    "split_address",
]

MAX_DECODINGS = 3
"""Percent-decodings a name may take before it stops changing: no real name needs one, and each
costs a pass over the name."""

_REFUSED = frozenset("\\:?#")
"""Characters that change what a path or URL points at: a Windows separator, a drive or URL
scheme, a query, a fragment."""


def _readings(name: str) -> Iterator[str | None]:
    """``name`` as written, each percent-decoding of it in turn, and the NFKC form of each; None
    last if it still decodes to something new after :data:`MAX_DECODINGS`."""
    for _ in range(MAX_DECODINGS + 1):
        yield name
        yield unicodedata.normalize("NFKC", name)
        decoded = unquote(name)
        if decoded == name:
            return
        name = decoded
    yield None


def _problem(reading: str | None) -> str | None:
    """Why ``reading`` of a shard name could point outside the index's directory, if it could."""
    if reading is None:
        return f"is still percent-encoded after {MAX_DECODINGS} decodings"
    if not reading.isprintable():
        return "holds a control or invisible character"
    refused = sorted(_REFUSED.intersection(reading))
    if refused:
        return f"holds {refused[0]!r}"
    if reading.startswith(("/", "~")):
        return "is not a relative path"
    if any(part in ("", ".", "..") for part in reading.split("/")):
        return "has an empty, '.' or '..' part"
    return None


def shard_name(shard: object, index: str) -> str:
    """``shard`` if it may name a shard next to ``index``, else :class:`HeaderError`."""
    if not isinstance(shard, str) or not shard:
        raise HeaderError(f"{index}: a shard name must be a non-empty string, got {shard!r}")
    for reading in _readings(shard):
        problem = _problem(reading)
        if problem is not None:
            read_as = "" if reading in (None, shard) else f" (read as {reading!r})"
            raise HeaderError(
                f"{index}: shard name {shard!r}{read_as} {problem}: it must be a relative path "
                "that stays next to the index"
            )
    return shard


_SCHEME = LazyPattern(r"[A-Za-z][A-Za-z0-9+.-]*(?=://)")
"""A URL scheme (RFC 3986: a letter, then letters, digits, ``+``, ``-`` or ``.``) before
``://``."""


def scheme_of(address: object) -> str | None:
    """The lower-cased URL scheme of ``address``, a string that begins with a scheme and
    ``://``, else None: any other string is a path, ``://`` in it or not (``dir/with://x`` is
    the file ``x`` in the folder ``dir/with:``, as the reference reads and writes it)."""
    if isinstance(address, str) and "://" in address:
        found = _SCHEME.compiled.match(address)
        if found is not None:
            return found.group().lower()
    return None


def split_address(url: str) -> SplitResult:
    """``url``'s parts, as ``urlsplit`` gives them, but where the scheme names its object as
    written (:func:`literal_scheme`: ``s3://bucket/key``, ``hf://org/repo/path``) the path runs
    from the first ``/`` after the scheme to the end: an S3 key or a Hub path may hold ``?`` and
    ``#``, so it has no query and no fragment. A URL that ``urlsplit`` cannot read (an unclosed
    ``[``) is a :class:`UsageError`."""
    scheme = scheme_of(url)
    if scheme is not None and literal_scheme(scheme):
        netloc, _, path = url[len(scheme) + 3 :].partition("/")
        return SplitResult(url[: len(scheme)], netloc, "/" + path, "", "")
    try:
        return urlsplit(url)
    except ValueError as exc:  # a bracketed host unclosed or not an IPv6 address
        raise UsageError(f"invalid URL {url!r}: {unreadable(url, exc)}") from None


def address_path(address: str) -> str:
    """The path ``address`` names: a plain path whole (``#`` and ``?`` are part of a file name
    there), a URL's path as :func:`split_address` gives it (still percent-encoded)."""
    return address if scheme_of(address) is None else split_address(address).path


def shard_address(index: str, shard: str) -> str:
    """The address of ``shard`` (a name from the index) in the directory of ``index``.

    A plain path, ``s3://`` key or ``hf://`` path is joined as written; in a ``file://`` or
    ``http(s)://`` URL the name is percent-encoded, since those transports decode it again.
    ``shard`` goes through :func:`shard_name` first, and the address must lie in the index's
    directory as its transport will read it: same scheme, host and query, no part that climbs out.
    """
    shard = shard_name(shard, index)
    if scheme_of(index) is None:
        address = posixpath.join(posixpath.dirname(index), shard)
    else:
        parts = split_address(index)
        name = shard if literal_scheme(parts.scheme) else quote(shard)
        path = posixpath.join(posixpath.dirname(parts.path), name)
        address = join_address(parts.scheme, parts.netloc, path, parts.query)
    if not _inside(index, address):
        raise HeaderError(
            f"{redact(index)}: shard {shard!r} resolves to {redact(address)} outside the index"
        )
    return address


def join_address(scheme: str, netloc: str, path: str, query: str) -> str:
    """The address of these parts (an ``s3://`` key or ``hf://`` path as written, with no
    query: see :func:`split_address`)."""
    if literal_scheme(scheme):
        return f"{scheme}://{netloc}{path}"
    return urlunsplit((scheme, netloc, path, query, ""))


def literal_scheme(scheme: str) -> bool:
    """Whether a URL of ``scheme`` names its object by the path as written (an S3 key, a path
    in a Hub repository)."""
    return scheme.lower() in ("s3", "hf")


def _inside(index: str, address: str) -> bool:
    """Whether ``address``, read the way its transport reads it, is in ``index``'s directory."""
    if scheme_of(index) is not None:
        home, there = split_address(index), split_address(address)
        if (there.scheme, there.netloc, there.query, there.fragment) != (
            home.scheme,
            home.netloc,
            home.query,
            "",
        ):
            return False
        decode = str if literal_scheme(home.scheme) else unquote
        directory, target = decode(posixpath.dirname(home.path)), decode(there.path)
    else:
        directory, target = posixpath.dirname(index), address
    prefix = directory.rstrip("/") + "/" if directory else ""
    rest = target[len(prefix) :]
    return (
        target.startswith(prefix)
        and rest not in ("", ".", "..")
        and posixpath.normpath(rest) == rest
        and not rest.startswith(("/", "../"))
    )


FORMAT_VERSION = "1.0"


SAFETENSORS_VERSION = "1.0"


INDEX_NAME = "_tensor_index.parquet"


MANIFEST_DTYPES = (
    "F16", "F32", "F64", "BF16", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64"
)  # fmt: skip
"""The dtypes the dataset layout's manifest schema allows (``BOOL`` and the 8-bit floats are
not among them): the only ones a dataset's columns may have."""


SHARD_NAME = re.compile(r"part-([0-9]{5,4000})-([0-9]{4,4000})-[^/]+\.safetensors")
r"""What :func:`shard_file_name` makes; in a directory without a manifest, the shards. ASCII
digits, as many as ``int`` reads (``\d`` takes other scripts' digits)."""


def shard_file_name(task: int, index: int, tag: str) -> str:
    """``part-{task:05d}-{index:04d}-{tag}.safetensors``: the ``index``-th shard sealed by task
    ``task``, whose writer drew the unique ``tag`` (a UUID)."""
    return f"part-{task:05d}-{index:04d}-{tag}.safetensors"


def shard_position(name: str) -> tuple[int, int] | None:
    """The task and index a shard's ``name`` carries (see :func:`shard_file_name`); None for a
    name of another form."""
    match = SHARD_NAME.fullmatch(name)
    return None if match is None else (int(match[1]), int(match[2]))


@dataclass(frozen=True)
class ShardEntry:
    """One shard as the manifest lists it."""

    shard_path: str
    samples_count: int
    bytes: int


def manifest_document(
    shards: Sequence[ShardEntry], schema: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """The ``dataset_manifest.json`` document for ``shards`` (in reading order) and ``schema``
    (name -> ``{"dtype", "shape"}``)."""
    return {
        "format_version": FORMAT_VERSION,
        "safetensors_version": SAFETENSORS_VERSION,
        "total_samples": sum(shard.samples_count for shard in shards),
        "total_bytes": sum(shard.bytes for shard in shards),
        "shards": [
            {"shard_path": s.shard_path, "samples_count": s.samples_count, "bytes": s.bytes}
            for s in shards
        ],
        "schema": {name: dict(entry) for name, entry in schema.items()},
    }


INDEX_SUFFIX = ".index.json"


MANIFEST_NAME = "dataset_manifest.json"


HELD_NAME = re.compile(r"\.\.?[0-9a-f]{8}\.partial\..+")
"""What a sharded or dataset writer holds in its directory until its commit, the hidden
temporary file of one (``..<tag>.partial.<name>.<random>.tmp``) and what its commit sets aside
included: none is part of a checkpoint, and a writer's sweep removes those of one killed."""


def holds_safetensors(head: bytes, size: int) -> bool:
    """Whether bytes beginning with ``head`` (9 of them at least), ``size`` in all, are a
    safetensors file rather than JSON: a little-endian length that fits in ``size``, then ``{``.
    JSON never passes: its first 8 bytes are printable text, which read as a length exceeds any
    file."""
    return head[8:9] == b"{" and int.from_bytes(head[:8], "little") <= size - 8


def _local_safetensors(address: str) -> bool:
    """Whether ``address`` (a path or ``file://`` URL) is a local regular file whose bytes are a
    safetensors file (:func:`holds_safetensors`); False for anything else, remote or unreadable
    (the reader then says what is wrong with it)."""
    if scheme_of(address) is not None:
        parts = split_address(address)
        if parts.scheme.lower() != "file" or parts.netloc not in ("", "localhost"):
            return False
        address = unquote(parts.path)
    try:
        if not stat.S_ISREG(os.stat(address).st_mode):
            return False  # a FIFO or a device: not opened here, where a read could block
        with open(address, "rb") as file:
            return holds_safetensors(file.read(9), os.fstat(file.fileno()).st_size)
    except (OSError, ValueError):  # ValueError: a NUL in the path
        return False


def is_index(source: object) -> TypeGuard[str | os.PathLike[str]]:
    """True for a ``str`` or path naming a ``*.index.json`` or ``dataset_manifest.json``, unless
    it is a local file whose bytes are a safetensors file (as ``save_file`` or ``stream-st cp``
    write under any name): that is read as the file it is. A remote address is judged by its
    name alone."""
    text = source if isinstance(source, str) else getattr(source, "__fspath__", lambda: "")()
    if not isinstance(text, str) or "json" not in text:  # most sources: no URL to split
        return False
    try:
        path = address_path(text)
    except ValueError:  # not a URL at all: the transports will say what is wrong with it
        return False
    named = path.endswith(INDEX_SUFFIX) or posixpath.basename(path) == MANIFEST_NAME
    return named and not _local_safetensors(text)
