"""What is in the cache, and taking things out: :func:`entries`, :func:`remove`, :func:`prune`
(``stream-st cache ls|rm|prune``).

Listed are the copies stream_st keeps: every object entry, and the Hub blobs stream_st wrote or
checked (those with its record); partial copies are listed as such, and so are the leftovers of
a writer that was killed (a preallocated partial copy whose ranges were never recorded, a copy
moved into place whose record was never written, a record whose copy was removed, its progress
file, temporary files), and a folder made in a copy's place, with the copy's record, as
damaged, while no one holds their entry's lock; while one does, the files of a first copy
being written, as such. Removing an entry takes its lock first: an entry being
written by another process is left alone (and said so). :func:`prune` removes every such
leftover, whatever the cap.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..._util import process_running
from ...errors import redact
from ..http.status import ascii_number
from .config import Cache
from .layout import HubEntry, ObjectEntry, hub_file, partner
from .store import EntryLock, Record, read_json

__all__ = ["Entry", "entries", "prune", "remove", "total_size"]


@dataclass
class Entry:
    """One copy in the cache. ``shown``: its address (an ``hf://`` one pinned to its commit,
    its path's signed values masked as errors show them: :func:`~stream_st.errors.redact`);
    ``size``: bytes on disk (a partial copy: bytes held); ``last_used``: seconds since the
    epoch; ``complete``: False for a partial copy; ``files``: what removing it removes;
    ``lock``: the entry's lock file; ``leftover``: what a killed writer left (see the module),
    ``size`` then its bytes on disk; ``writing``: a first copy another process is writing,
    ``size`` its bytes on disk so far (counted by no cap, removed by no one)."""

    shown: str
    size: int
    last_used: float
    complete: bool
    files: list[Path] = field(default_factory=list)
    lock: Path | None = None
    links: list[Path] = field(default_factory=list)
    leftover: bool = False
    writing: bool = False

    @property
    def kind(self) -> str:
        return "hub" if self.shown.startswith("hf://") else "object"


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _held(state: object) -> int:
    if not isinstance(state, dict):
        return 0
    with contextlib.suppress(TypeError, ValueError):
        return sum(int(end) - int(start) for start, end in state.get("ranges", []))
    return 0


def _object_entries(cache: Cache) -> list[Entry]:
    root = cache.directory / "objects"
    found: list[Entry] = []
    try:
        keys = sorted(os.listdir(root))
    except OSError:
        return found
    for key in keys:
        entry = ObjectEntry.of(cache, key)
        before = len(found)
        damaged: list[str] = []  # a copy that is no file (a folder) and its record: leftovers
        for version in entry.versions():
            at = entry.at(version)
            if not at.data.is_file():
                damaged += [at.record.name, at.data.name]
                continue
            record = Record.load(at.record)
            if record is None:
                continue
            found.append(
                Entry(
                    record.shown,
                    record.size,
                    _mtime(at.record),
                    True,
                    [at.data, at.record],
                    at.lock,
                )
            )
        for version in entry.partials():
            at = entry.at(version)
            if not at.part.is_file():
                damaged += [at.part_record.name, at.part.name]
                continue
            state = read_json(at.part_record)
            shown = _recorded_address(state) or _shown_of(entry) or f"(partial copy {key})"
            found.append(
                Entry(
                    shown,
                    _held(state),
                    _mtime(at.part_record),
                    False,
                    [at.part, at.part_record],
                    at.lock,
                )
            )
        names = sorted(entry.leftovers() + damaged)
        left = _leftover(entry.folder, names, entry.lock, first=len(found) == before)
        if left is not None:
            label = _left_by(entry, names) or f"objects/{key}"
            what = (
                "being written"
                if left.writing
                else "damaged"
                if any(path.is_dir() for path in left.files)
                else "left by a killed writer"
            )
            left.shown = f"{label} ({what})"
            found.append(left)
    return found


def _left_by(entry: ObjectEntry, names: list[str]) -> str | None:
    """The address of what a writer left in ``entry`` (``names``): as its progress file, or
    a record among them, or a copy's record beside them, names it."""
    records = [entry.folder / name for name in names if name.endswith(".json")]
    for path in (entry.growing, *records):
        shown = _recorded_address(read_json(path))
        if shown is not None:
            return shown
    return _shown_of(entry)


def _unlocked(lock: Path) -> bool:
    """Whether no one holds the lock at ``lock`` (a lock file that cannot be opened: unknown,
    taken as held)."""
    if not lock.exists():
        return True
    probe = EntryLock(lock)
    try:
        if not probe.try_acquire():
            return False
    except OSError:
        return False
    probe.release()
    return True


def _on_disk(path: Path) -> int:
    """The bytes ``path`` takes on disk (a preallocated partial copy: all of them)."""
    try:
        return path.lstat().st_blocks * 512
    except OSError:
        return 0


def _leftover(folder: Path, names: list[str], lock: Path, *, first: bool) -> Entry | None:
    """One entry of the files ``names`` in ``folder`` that only a writer uses, when there are
    any: what a killed writer left, where no one holds ``lock``; else, where they are the
    ``first`` copy of their entry (no other is listed), the copy being written (``writing``);
    else None."""
    if not names:
        return None
    unlocked = _unlocked(lock)
    if not unlocked and not first:
        return None
    files = [folder / name for name in names]
    used = max((_mtime(path) for path in files), default=0.0)
    size = sum(_on_disk(path) for path in files)
    return Entry("", size, used, False, files, lock, leftover=unlocked, writing=not unlocked)


def _recorded_address(state: object) -> str | None:
    """The address a partial copy's record names (None in records written before it did)."""
    shown = state.get("shown") if isinstance(state, dict) else None
    return shown if isinstance(shown, str) and shown else None


def _shown_of(entry: ObjectEntry) -> str | None:
    for version in entry.versions():
        record = Record.load(entry.at(version).record)
        if record is not None:
            return record.shown
    return None


def _links_to(storage: Path, etag: str) -> list[Path]:
    """The snapshot links of a Hub repository folder that point at blob ``etag``."""
    links: list[Path] = []
    for folder, _, names in os.walk(storage / "snapshots"):
        for name in names:
            path = Path(folder, name)
            with contextlib.suppress(OSError):
                if path.is_symlink() and Path(os.readlink(path)).name == etag:
                    links.append(path)
    return links


def _hub_entries(cache: Cache) -> list[Entry]:
    root = cache.hub_directory
    found: list[Entry] = []
    try:
        folders = sorted(os.listdir(root))
    except OSError:
        return found
    for folder in folders:
        mine = root / folder / ".stream_st"
        if "--" not in folder or not mine.is_dir():
            continue
        names = sorted(os.listdir(mine))
        hub = HubEntry(root, folder, "")
        found.extend(_hub_leftovers(hub, mine, names))
        for name in names:
            parsed = hub_file(name)
            if parsed is None or name.startswith("."):  # a temporary file: a leftover, if any
                continue
            etag, ending = parsed
            if ending == ".json":
                record = Record.load(mine / name)
                if record is None or not hub.blob(etag).is_file():
                    continue
                extra = record.extra
                shown = record.shown
                if extra.get("repo_id"):
                    prefix = "datasets/" if extra.get("repo_type") == "dataset" else ""
                    at = f"{extra['repo_id']}@{extra.get('commit', '')}"
                    shown = f"hf://{prefix}{at}/{extra.get('path', '')}"
                found.append(
                    Entry(
                        redact(shown),
                        record.size,
                        _mtime(mine / name),
                        True,
                        [hub.blob(etag), mine / name],
                        hub.lock(etag),
                        _links_to(root / folder, etag),
                    )
                )
            elif ending == ".part.json":
                state = read_json(mine / name)
                shown = _recorded_address(state) or f"hf:// {folder} (partial copy of {etag[:12]})"
                found.append(
                    Entry(
                        redact(shown),
                        _held(state),
                        _mtime(mine / name),
                        False,
                        [hub.part(etag), mine / name],
                        hub.lock(etag),
                    )
                )
    return found


def _hub_leftovers(hub: HubEntry, mine: Path, names: list[str]) -> list[Entry]:
    """What killed writers left in a Hub repository's ``.stream_st`` folder (``mine``): a
    partial copy of a blob whose ranges were never recorded, temporary files of processes gone
    (``.<etag>.json.<pid>.tmp``); one entry per blob whose lock no one holds."""
    by_etag: dict[str, list[str]] = {}
    for name in names:
        if name.startswith(".") and name.endswith(".tmp"):
            written, _, pid = name[1:].removesuffix(".tmp").rpartition(".")
            if not process_running(ascii_number(pid)):
                etag = (hub_file(written) or (written, ""))[0]
                by_etag.setdefault(etag, []).append(name)
        elif name.endswith(".part") and f"{name}.json" not in names:
            by_etag.setdefault(name.removesuffix(".part"), []).append(name)
    found = []
    for etag, left in by_etag.items():
        first = f"{etag}.part" in left  # a blob's first copy, or what was left of one
        entry = _leftover(mine, left, hub.lock(etag), first=first)
        if entry is not None:
            what = "being written:" if entry.writing else "left by a killed writer of"
            entry.shown = f"hf:// {hub.folder} ({what} {etag[:12]})"
            found.append(entry)
    return found


def entries(cache: Cache) -> list[Entry]:
    """Every copy in ``cache`` (see the module), least recently used first."""
    found = _object_entries(cache) + _hub_entries(cache)
    found.sort(key=lambda entry: entry.last_used)
    return found


def total_size(cache: Cache) -> int:
    """Bytes the copies in ``cache`` hold (not those being written)."""
    return sum(entry.size for entry in entries(cache) if not entry.writing)


def remove(entry: Entry) -> bool:
    """Remove ``entry``'s files (and a Hub blob's snapshot links; a folder made in a copy's
    place, with what it holds); False, removing nothing, when another process holds its lock
    (it is being written); ``OSError`` where one cannot be removed."""
    lock = EntryLock(entry.lock) if entry.lock is not None else None
    if lock is not None and not lock.try_acquire():
        return False
    try:
        for path in (*entry.links, *entry.files):  # asked for: a file left is an error
            if entry.leftover and _paired(path):
                continue  # a writer came and made it whole since: a partial or complete copy
            with contextlib.suppress(FileNotFoundError):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
    finally:
        if lock is not None:
            lock.release()
    return True


def _paired(path: Path) -> bool:
    """Whether ``path`` and the other file of the pair it is one of (see
    :func:`.layout.partner`: a copy and its record) are both there, as files (a folder in a
    copy's place is none)."""
    other = partner(path.name)
    return other is not None and path.is_file() and path.with_name(other).is_file()


def prune(
    cache: Cache,
    max_size: int,
    *,
    keep: tuple[Path, ...] = (),
    left: list[Entry] | None = None,
) -> list[Entry]:
    """Remove what killed writers left (see the module), then the least recently used copies
    until those left hold at most ``max_size`` bytes; copies whose files are in ``keep``, and
    those being written, stay. Returns those removed; appends to ``left``, where given, those
    it would have removed but another process holds (see :func:`remove`)."""
    found = [entry for entry in entries(cache) if not entry.writing]
    total = sum(entry.size for entry in found)
    removed: list[Entry] = []
    for entry in sorted(found, key=lambda entry: not entry.leftover):  # leftovers first
        if total <= max_size and not entry.leftover:
            break
        if any(path in keep for path in entry.files):
            continue
        if remove(entry):
            total -= entry.size
            removed.append(entry)
        elif left is not None:
            left.append(entry)
    return removed
