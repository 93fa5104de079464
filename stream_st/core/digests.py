"""Per-tensor digests: the key scheme in ``__metadata__``, the algorithms, and hashing while bytes
move.

A checksummed file is an ordinary safetensors file whose ``__metadata__`` also holds::

    "stream_st.digest": "xxh3-128"               the algorithm (a name from ALGORITHMS)
    "stream_st.digest:<tensor name>": "<hex>"   one per tensor: the digest of its bytes as they
                                                 lie in the file (its data_offsets range)

Every tensor has exactly one digest key and every digest key names a tensor, so a damaged name
shows too. A digest has a fixed length per algorithm, so a writer lays the header out with
placeholder digests before any data exists and patches the real ones in at the commit (a file, an
S3 upload); a sink that cannot go back (a socket, a pipe, an HTTP upload) needs them up front
(:meth:`Digests.compute`).

Hashing runs while the bytes move: a reader hashes a tensor in chunks, each chunk in a worker
thread while the next one is read (:func:`~stream_st.reader.read_hashing`; a local file's worker
threads hash each piece right after reading it, see
:class:`~stream_st.transports.file.readahead.InOrder`); a writer hashes what it writes while the
sink takes it (:class:`OrderedHash`).
"""

from __future__ import annotations

import importlib
import zlib
from collections.abc import Callable, Collection, Container, Coroutine, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import ArgumentTypeError, IntegrityError, UsageError, boolean
from .dtypes import wire_bytes
from .header import _SHORT, run_steps
from .layout import _metadata_members
from .steps import slices

if TYPE_CHECKING:
    import anyio

    from .header import Header

__all__ = [
    "ALGORITHMS",
    "ALGORITHM_KEY",
    "DEFAULT_ALGORITHM",
    "DIGEST_KEY_PREFIX",
    "Algorithm",
    "Digests",
    "Hasher",
    "ObjectDigest",
    "OrderedHash",
    "algorithm_named",
    "is_record_key",
]

ALGORITHM_KEY = "stream_st.digest"
"""The ``__metadata__`` key naming the digest algorithm of a checksummed file."""

DIGEST_KEY_PREFIX = "stream_st.digest:"
"""``DIGEST_KEY_PREFIX + name`` is the ``__metadata__`` key of tensor ``name``'s digest (hex)."""


class Hasher(Protocol):
    """An incremental hash: ``hashlib``'s interface, as far as used here."""

    def update(self, data: Any, /) -> None: ...

    def digest(self) -> bytes: ...


def is_record_key(key: object) -> bool:
    """Whether ``key`` is one of a digest record's: the keys a reader takes for the record
    (:data:`ALGORITHM_KEY`, and :data:`DIGEST_KEY_PREFIX` + a name), no others."""
    return isinstance(key, str) and (key == ALGORITHM_KEY or key.startswith(DIGEST_KEY_PREFIX))


def without_record(metadata: Mapping[str, str] | None) -> Mapping[str, str] | None:
    """``metadata`` without the keys of a digest record (``stream_st.digest``...): a record
    copied from another file's metadata describes that file's bytes, and written where no digest
    is recorded would make the new file fail its own check. ``metadata`` itself when it holds
    none (or is no mapping of names: refused when the header is built, as it would be)."""
    if not isinstance(metadata, Mapping) or not any(map(is_record_key, metadata)):
        return metadata
    return {key: value for key, value in metadata.items() if not is_record_key(key)}


@dataclass(frozen=True)
class Algorithm:
    """A digest algorithm: its ``name`` in files, its ``digest_size`` in bytes, and where it
    comes from (a module and the factory in it)."""

    name: str
    digest_size: int
    module: str
    factory: str
    package: str = ""  # the distribution to install when the module is missing ("": stdlib)

    def new(self) -> Hasher:
        """A fresh incremental hasher."""
        try:
            module = importlib.import_module(self.module)
        except ImportError:
            raise UsageError(
                f"the {self.name} digest needs the {self.package!r} package: "
                f"pip install {self.package}"
            ) from None
        hasher: Hasher = getattr(module, self.factory)()
        return hasher

    def placeholder(self) -> str:
        """A digest's text before it is known: as long as a real one."""
        return "0" * (2 * self.digest_size)


ALGORITHMS: dict[str, Algorithm] = {
    algo.name: algo
    for algo in (
        Algorithm("xxh3-128", 16, "xxhash", "xxh3_128", "xxhash"),
        Algorithm("sha256", 32, "hashlib", "sha256"),
        Algorithm("blake3", 32, "blake3", "blake3", "blake3"),
    )
}
"""Digest algorithms by name. ``xxh3-128`` (the default) detects random corruption at memory
speed; ``sha256`` and ``blake3`` are cryptographic, for a digest that must be hard to forge."""

DEFAULT_ALGORITHM = "xxh3-128"


def algorithm_named(name: str, option: str | None = None) -> Algorithm:
    """The algorithm called ``name``; :class:`~stream_st.UsageError` for an unknown one, naming
    the ``option`` that gave it (``"checksums="``), if any."""
    try:
        return ALGORITHMS[name]
    except (KeyError, TypeError):
        unknown = "unknown" if option is None else f"{option} names an unknown"
        raise UsageError(
            f"{unknown} digest algorithm {name!r}; choose one of {sorted(ALGORITHMS)}"
        ) from None


HASH_SLICE = 4 << 20
"""A worker thread hashes a buffer in slices of this size: the hash packages hold the GIL while
they work, and the event loop gets it back between slices."""

HASH_INLINE = 1 << 20
"""Buffers up to this size are hashed on the event loop's thread (cheaper than a thread hop)."""


def update_sliced(
    hasher: Hasher, view: memoryview, stop: Callable[[], object] | None = None
) -> None:
    """Feed ``view`` to ``hasher`` in slices of :data:`HASH_SLICE`, calling ``stop`` (which
    raises to end the work: a deadline passed) before each."""
    for start in range(0, len(view), HASH_SLICE):
        if stop is not None:
            stop()
        hasher.update(view[start : start + HASH_SLICE])


async def hash_view(
    hasher: Hasher, view: memoryview, stop: Callable[[], object] | None = None
) -> None:
    """Feed ``view`` to ``hasher``: at once when small, else in a worker thread, slice by slice
    (``stop``: see :func:`update_sliced`)."""
    if len(view) <= HASH_INLINE:
        hasher.update(view)
    else:
        import anyio.to_thread  # here: a write at once hashes with no event loop

        await anyio.to_thread.run_sync(update_sliced, hasher, view, stop)


def digest_of(algorithm: str, view: memoryview) -> str:
    """The hex digest of ``view`` by ``algorithm``, in one pass (slices of :data:`HASH_SLICE`)."""
    hasher = algorithm_named(algorithm).new()
    update_sliced(hasher, view)
    return hasher.digest().hex()


def digest_key(name: str) -> str:
    """The ``__metadata__`` key of tensor ``name``'s digest."""
    return DIGEST_KEY_PREFIX + name


@dataclass(frozen=True)
class Digests:
    """The digests of a file's tensors: the ``algorithm``'s name and ``values``, the hex digest
    per tensor name.

    Give one as ``checksums=`` to :func:`~stream_st.open_writer` when the destination cannot be
    patched at the end (a socket, a pipe, an HTTP upload): :meth:`compute` makes it from arrays.
    A reader finds one in a checksummed header (:meth:`from_header`).
    """

    algorithm: str = DEFAULT_ALGORITHM
    values: Mapping[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:
        """A bounded summary (a file may hold millions of tensors): the algorithm, how many
        digests, and the first few, shortened."""
        return (
            f"Digests(algorithm={_SHORT.repr(self.algorithm)}, n_tensors={len(self.values)}, "
            f"values={_SHORT.repr(self.values)})"
        )

    @classmethod
    def compute(cls, tensors: Mapping[str, Any], algorithm: str = DEFAULT_ALGORITHM) -> Digests:
        """The digests of ``{name: array}``, each over the array's bytes as a file holds them
        (little-endian). One pass over each array; run it in a worker thread for big ones.
        What :func:`~stream_st.save` refuses is refused here as there: not a mapping
        (:class:`~stream_st.ArgumentTypeError`), a value numpy makes no array of
        (:class:`~stream_st.UsageError`), one of a dtype safetensors cannot carry (an object or
        str array: :class:`~stream_st.DtypeError`)."""
        if not isinstance(tensors, Mapping):
            raise ArgumentTypeError(
                f"Digests.compute takes a mapping of names to arrays, got {type(tensors).__name__}"
            )
        values = {
            name: digest_of(algorithm, wire_bytes(_as_array(array, name)))
            for name, array in tensors.items()
        }
        return cls(algorithm_named(algorithm).name, values)

    @classmethod
    def from_header(cls, header: Header, quote: Callable[[str], str] = repr) -> Digests | None:
        """The digests a header records, or None if it records none.

        A record that cannot be checked (an unknown algorithm, a tensor without a digest, a
        digest for no tensor, a digest of the wrong form) raises
        :class:`~stream_st.IntegrityError`: the header itself is damaged or was not written
        by this scheme. Its message names a tensor as ``quote`` writes it: quoted, as errors
        name tensors, by default; a report that escapes its names itself gives its own.
        """
        return run_steps(cls.from_header_steps(header, quote))

    @classmethod
    def from_header_steps(
        cls, header: Header, quote: Callable[[str], str] = repr
    ) -> Generator[None, None, Digests | None]:
        """:meth:`from_header` as a generator that yields between two slices of the header's
        metadata and tensors (:func:`~stream_st.core.steps.slices`) and returns the digests: a
        reader on an event loop gives the loop its turn there (a header of 200,000 tensors took
        over half a second)."""
        metadata = header.metadata
        name = metadata.get(ALGORITHM_KEY)
        values: dict[str, str] = {}
        for keys in slices(list(metadata)):
            values |= {
                key[len(DIGEST_KEY_PREFIX) :]: metadata[key]
                for key in keys
                if key.startswith(DIGEST_KEY_PREFIX)
            }
            yield
        if name is None and not values:
            return None
        if name is None:
            raise IntegrityError(f"the header has tensor digests but no {ALGORITHM_KEY!r} key")
        if name not in ALGORITHMS:
            raise IntegrityError(
                f"the header's digests use {name!r}, which this version cannot check "
                f"(known: {sorted(ALGORITHMS)}); read with verify=False to skip the check"
            )
        digests = cls(name, values)
        yield from digests._names_checked(header.names(), header, len(header), quote)
        return digests

    def check_names(self, names: Collection[str]) -> None:
        """Raise :class:`~stream_st.IntegrityError` unless ``values`` holds one well-formed
        digest for each of ``names`` and nothing else."""
        distinct = frozenset(names)
        run_steps(self._names_checked(tuple(names), distinct, len(distinct)))

    def _names_checked(
        self,
        names: Sequence[str],
        among: Container[str],
        distinct: int,
        quote: Callable[[str], str] = repr,
    ) -> Generator[None, None, None]:
        """:meth:`check_names` of ``names`` (``among`` holds them too, for a quicker look-up;
        ``distinct`` of them differ) as a generator that yields between two slices of them,
        naming a tensor as ``quote`` writes it."""
        size = 2 * ALGORITHMS[self.algorithm].digest_size
        for part in slices(names):
            for name in part:
                value = self.values.get(name)
                if value is None:
                    raise IntegrityError(
                        f"tensor {quote(name)} has no digest in the header", name=name
                    )
                if len(value) != size or not _is_hex(value):
                    raise IntegrityError(
                        f"tensor {quote(name)}: its digest {value[:80]!r} is not {size} "
                        "lowercase hex digits",
                        name=name,
                    )
            yield
        if distinct != len(self.values):  # each name has its digest: one more is no tensor's
            extra = next(name for name in self.values if name not in among)
            raise IntegrityError(f"the header has a digest for no tensor: {quote(extra)}")

    def add_to(self, metadata: Mapping[str, str] | None, names: Collection[str]) -> dict[str, str]:
        """``metadata`` with these digests recorded for the tensors ``names``, in that order;
        placeholders stand for digests not known yet (``values`` empty). Digests given for
        other names, or metadata already holding digest keys, are a
        :class:`~stream_st.UsageError`; metadata the layout refuses is refused first, as it would
        be without digests."""
        _metadata_members(metadata)
        entries = dict(metadata or {})
        clash = next(filter(is_record_key, entries), None)
        if clash is not None:
            raise UsageError(
                f"metadata key {clash!r} is reserved for the digests that checksums= records"
            )
        if self.values:
            try:
                self.check_names(names)
            except IntegrityError as exc:
                raise UsageError(f"the digests given do not fit the plan: {exc}") from None
        placeholder = ALGORITHMS[self.algorithm].placeholder()
        entries[ALGORITHM_KEY] = self.algorithm
        for name in names:
            entries[digest_key(name)] = self.values.get(name, placeholder)
        return entries

    def hasher(self) -> Hasher:
        """A fresh hasher of this algorithm."""
        return ALGORITHMS[self.algorithm].new()

    def check_bytes(self, name: str, data: Any, source: str = "") -> None:
        """:meth:`check` of ``data``, tensor ``name``'s bytes as a file holds them (a buffer),
        hashed here, on the caller's thread."""
        hasher = self.hasher()
        hasher.update(data)
        self.check(name, hasher, source)

    async def check_view(
        self,
        name: str,
        array: Any,
        source: str = "",
        stop: Callable[[], object] | None = None,
    ) -> None:
        """:meth:`check` of a tensor already in memory (e.g. mapped from a file), hashed off the
        event loop when large (``stop``: see :func:`update_sliced`)."""
        self.check(name, await self._hashed(array, stop), source)

    async def view_mismatch(
        self, name: str, array: Any, stop: Callable[[], object] | None = None
    ) -> str | None:
        """:meth:`mismatch` of a tensor already in memory, hashed as :meth:`check_view` does
        (``stop`` too)."""
        return self.mismatch(name, await self._hashed(array, stop))

    async def _hashed(self, array: Any, stop: Callable[[], object] | None = None) -> Hasher:
        hasher = self.hasher()
        await hash_view(hasher, wire_bytes(array), stop)
        return hasher

    def check(self, name: str, hasher: Hasher, source: str = "") -> None:
        """Raise :class:`~stream_st.IntegrityError` unless ``hasher`` holds tensor ``name``'s
        recorded digest."""
        problem = self.mismatch(name, hasher)
        if problem is not None:
            where = f" from {source}" if source else ""
            raise IntegrityError(
                f"tensor {name!r}{where} {problem}; not delivered", name=name, source=source
            )

    def mismatch(self, name: str, hasher: Hasher) -> str | None:
        """How ``hasher`` differs from tensor ``name``'s recorded digest ("does not match its
        ... digest (recorded ..., got ...)"); None where it holds it."""
        got = hasher.digest().hex()
        if got == self.values[name]:
            return None
        return (
            f"does not match its {self.algorithm} digest (recorded {self.values[name]}, got {got})"
        )


def _is_hex(text: str) -> bool:
    return not text.strip("0123456789abcdef")  # what is left: not a lowercase hex digit


def _as_array(value: Any, name: str) -> Any:
    """``value`` as the array a writer writes for tensor ``name``, refused as the writer refuses
    it (:func:`~stream_st.core.arrays.as_array`, the dtype of its plan entry)."""
    from .arrays import as_array, spec_of
    from .layout import _dtype_of

    array = as_array(value, name)
    _dtype_of(spec_of(name, value, array))
    return array


def digests_for(checksums: bool | str | Digests) -> Digests | None:
    """What a writer's ``checksums=`` asks for: None (no digests), or the algorithm with the
    digests given up front (``values`` empty when they are to be computed while writing)."""
    if isinstance(checksums, str):
        return Digests(algorithm_named(checksums, "checksums=").name)
    if isinstance(checksums, Digests):
        algorithm_named(checksums.algorithm, "checksums=")
        values = checksums.values
        if not isinstance(values, Mapping):
            got = type(values).__name__
        else:
            items = values.items()
            bad = next(
                (i for i in items if not isinstance(i[0], str) or not isinstance(i[1], str)), None
            )
            if bad is None:
                return checksums
            got = f"{bad[0]!r:.80}: {type(bad[1]).__name__}"
        raise ArgumentTypeError(
            f"checksums=Digests(algorithm, values): values must map tensor names to hex digests "
            f"(str to str), got {got}"
        )
    return Digests() if asked_for(checksums) else None


def asked_for(checksums: object, takes: str = "an algorithm name or a Digests") -> bool:
    """Whether ``checksums=``, given as neither an algorithm's name nor a :class:`Digests`, asks
    for digests: True or False (numpy's ``bool_`` too, read as ``verify=`` is); a
    :class:`~stream_st.UsageError` naming what it takes (True, False, ``takes``) for another
    value."""
    try:
        return boolean("checksums", checksums)
    except ArgumentTypeError:
        raise UsageError(
            f"checksums must be True, False, {takes}, got {type(checksums).__name__}"
        ) from None


class OrderedHash:
    """One tensor's hash fed by pieces that may be written concurrently: :meth:`turn`, called
    when a piece's place is decided, returns the coroutine function that feeds it after the
    pieces placed before it, whenever it runs."""

    def __init__(self, hasher: Hasher) -> None:
        self.hasher = hasher
        self._last: anyio.Event | None = None

    def turn(self) -> Callable[[memoryview], Coroutine[Any, Any, None]]:
        import anyio

        before, mine = self._last, anyio.Event()
        self._last = mine

        async def feed(view: memoryview) -> None:
            try:
                if before is not None:
                    await before.wait()
                await hash_view(self.hasher, view)
            finally:
                mine.set()

        return feed


class Crc32:
    """CRC-32 (``zlib.crc32``, the polynomial of S3's ``x-amz-checksum-crc32``) as a
    :class:`Hasher`; its digest is the 4 bytes big-endian, as S3 encodes it."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: Any, /) -> None:
        self._value = zlib.crc32(data, self._value)

    def digest(self) -> bytes:
        return self._value.to_bytes(4, "big")


class PartedHash:
    """A "checksum of checksums" as a :class:`Hasher`: the bytes are cut into parts of
    ``part_size`` (the last one shorter), each part hashed by a fresh ``new()``, and the digest
    is ``new()`` over the parts' digests one after another (S3's composite checksum of a
    multipart upload)."""

    def __init__(self, new: Callable[[], Hasher], part_size: int) -> None:
        self._new = new
        self._part_size = part_size
        self._digests: list[bytes] = []  # of the parts done
        self._part = new()
        self._filled = 0  # bytes in the current part

    def update(self, data: Any, /) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self._part_size - self._filled)
            self._part.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self._part_size:
                self._digests.append(self._part.digest())
                self._part, self._filled = self._new(), 0

    def digest(self) -> bytes:
        last = [self._part.digest()] if self._filled else []
        outer = self._new()
        outer.update(b"".join(self._digests + last))
        return outer.digest()


@dataclass(frozen=True)
class ObjectDigest:
    """A digest of a whole object that its transport vouches for: an S3 object's checksum, the
    Hub's SHA-256 of a file. ``label`` names it in messages (e.g. ``"the store's CRC32
    (x-amz-checksum-crc32)"``); ``expected`` is the raw digest and ``new`` makes a hasher that
    yields it over every byte of the object, in order. With ``new`` None the transport named a
    digest that cannot be checked, and ``reason`` says why (an algorithm not installed, parts of
    unknown sizes).

    A reader that reads every byte (no ``include=``) feeds the hasher with the length prefix,
    the header and each tensor, and checks it after the last tensor: that is the earliest a
    whole-object digest can be known, so ``async for`` raises :class:`~stream_st.IntegrityError`
    after delivering the last tensor, and :func:`~stream_st.load` and ``cp`` raise before
    returning or committing.
    """

    label: str
    expected: bytes = b""
    new: Callable[[], Hasher] | None = None
    reason: str = ""

    def check(self, hasher: Hasher, source: str = "") -> None:
        """Raise :class:`~stream_st.IntegrityError` unless ``hasher`` holds ``expected``."""
        got = bytes(hasher.digest())
        if got != self.expected:
            where = f"{source}: " if source else ""
            raise IntegrityError(
                f"{where}the object does not match {self.label} (expected "
                f"{self.expected.hex()}, got {got.hex()}): a byte was damaged on the way",
                source=source,
            )
