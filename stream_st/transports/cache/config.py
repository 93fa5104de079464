"""Where remote reads keep their local copies, and how: :class:`Cache`.

``cache=`` of :func:`~stream_st.open_stream` (and of every entry point that reads a URL) takes:

* ``True``: the default places (:meth:`Cache.default`);
* a directory (``str`` or ``os.PathLike``): everything under it (:meth:`Cache.at`);
* ``"offline"``: the default places, and no request at all (a copy is used as it is, a missing
  one is a :class:`CacheMissError`);
* a :class:`Cache`; ``None`` or ``False``: no cache.

The environment: ``STREAM_ST_CACHE`` (the directory of copies of ``http(s)://`` and ``s3://``
objects; default ``$XDG_CACHE_HOME/stream_st``, that defaulting to ``~/.cache``),
``HF_HUB_CACHE`` (``hf://`` files, in the Hugging Face cache layout; default ``$HF_HOME/hub``,
``HF_HOME`` defaulting to ``$XDG_CACHE_HOME/huggingface``), ``HF_HUB_OFFLINE=1`` (offline, as
``"offline"``), ``STREAM_ST_CACHE_MAX`` (a size cap: bytes, or a number with a unit, ``50G``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path

from ..._regex import LazyPattern
from ...errors import UsageError, boolean, integer_at_least, path_string

__all__ = ["Cache", "CacheLike", "hub_offline", "parse_size"]

_TRUE = frozenset({"1", "true", "yes", "on"})
_SIZE = LazyPattern(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(?:([kmgtp])(i?))?(b?)\s*", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(text: str) -> int:
    """Bytes from ``text``: a whole number of bytes, or a number with a unit. ``K``, ``M``,
    ``G``, ``T``, ``P`` alone or with ``iB`` are powers of 1024 (``50G`` is 50 GiB, as ``du``
    and ``ulimit`` count); with ``B`` alone (``50GB``) powers of 1000. A
    :class:`~stream_st.UsageError` for anything else."""
    match = _SIZE.compiled.fullmatch(text)
    if match is None:
        raise UsageError(f"not a size: {text!r} (expected bytes or a number with a unit: 50G)")
    number, unit, binary, byte = match.groups()
    decimal = bool(byte) and not binary and bool(unit)
    base = 1000 if decimal else 1024
    return int(Fraction(number) * base ** _POWERS[(unit or "").lower()])  # exact, any size


def _cache_home(env: Mapping[str, str]) -> Path:
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def _cap(env: Mapping[str, str]) -> int | None:
    """The cap ``STREAM_ST_CACHE_MAX`` sets (None if unset or blank); a
    :class:`~stream_st.UsageError` naming the variable for what is not a size (the message
    said only ``not a size: 'bogus'``, the command's too, with no word of where it came from)."""
    cap = env.get("STREAM_ST_CACHE_MAX", "").strip()
    if not cap:
        return None
    try:
        return parse_size(cap)
    except UsageError as exc:
        raise UsageError(f"STREAM_ST_CACHE_MAX in the environment: {exc}") from None


@dataclass(frozen=True)
class Cache:
    """Where copies go and how they are used.

    ``directory`` holds the copies of ``http(s)://`` and ``s3://`` objects (and the small
    records stream_st keeps); ``hub_directory`` the ``hf://`` files, in the Hugging Face cache
    layout (``huggingface_hub`` finds them there). ``offline``: no request is made; a copy is
    used as it is. ``max_size``: the cap, in bytes, on what stream_st keeps (least recently
    used copies go first once a new copy passes it); None for none.
    """

    directory: Path
    hub_directory: Path
    offline: bool = False
    max_size: int | None = None

    def __init__(
        self,
        directory: str | os.PathLike[str],
        hub_directory: str | os.PathLike[str],
        offline: bool = False,
        max_size: int | None = None,
    ) -> None:
        """Check the fields: each directory a ``str`` or ``os.PathLike`` (kept as a
        :class:`~pathlib.Path`), ``offline`` True or False, ``max_size`` None or a whole number
        of bytes >= 0; :class:`~stream_st.ArgumentTypeError` or
        :class:`~stream_st.UsageError` naming the field (they failed later, mid-read, or a
        string such as ``"no"`` was taken as true). Written here, not made by the dataclass, so
        that its types say what it takes, where the fields say what it keeps."""
        given = {"directory": directory, "hub_directory": hub_directory}
        for field, value in given.items():
            object.__setattr__(self, field, Path(path_string(f"Cache.{field}", value)))
        object.__setattr__(self, "offline", boolean("Cache.offline", offline))
        if max_size is not None:
            max_size = integer_at_least("Cache.max_size", max_size, 0, " (bytes)")
        object.__setattr__(self, "max_size", max_size)

    @classmethod
    def default(cls, environ: Mapping[str, str] | None = None) -> Cache:
        """The places and options the environment names (see the module)."""
        env = os.environ if environ is None else environ
        home = _cache_home(env)
        directory = Path(env.get("STREAM_ST_CACHE") or home / "stream_st")
        hub_home = Path(env.get("HF_HOME") or home / "huggingface")
        hub = Path(env.get("HF_HUB_CACHE") or hub_home / "hub")
        return cls(
            directory=directory.expanduser(),
            hub_directory=hub.expanduser(),
            offline=hub_offline(environ=env),
            max_size=_cap(env),
        )

    @classmethod
    def at(
        cls, directory: str | os.PathLike[str], environ: Mapping[str, str] | None = None
    ) -> Cache:
        """Everything under ``directory``: objects there, ``hf://`` files in its ``hub``
        folder (the layout ``HF_HOME`` would give); offline and the cap from the environment."""
        base = Path(directory).expanduser()
        return replace(cls.default(environ), directory=base, hub_directory=base / "hub")

    @classmethod
    def of(cls, value: object) -> Cache | None:
        """The cache a ``cache=`` argument names (see the module); None for none. A
        :class:`~stream_st.UsageError` for anything else."""
        if value is None or value is False:
            return None
        if value is True:
            return cls.default()
        if isinstance(value, Cache):
            return value
        if value == "offline":
            return replace(cls.default(), offline=True)
        if isinstance(value, str | os.PathLike) and os.fspath(value):
            return cls.at(value)
        raise UsageError(
            f"cache must be True, a directory, 'offline' or a Cache, got {type(value).__name__} "
            f"{value!r}"
        )


CacheLike = Cache | bool | str | os.PathLike[str] | None
"""What ``cache=`` accepts (see :meth:`Cache.of`)."""


def hub_offline(source: object = None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``HF_HUB_OFFLINE`` is set, and ``source`` (when given) an ``hf://`` address."""
    env = os.environ if environ is None else environ
    if source is not None and not (isinstance(source, str) and source[:5].lower() == "hf://"):
        return False
    return env.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE
