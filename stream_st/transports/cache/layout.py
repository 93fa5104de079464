"""Where each entry lives on disk.

``http(s)://`` and ``s3://`` objects, under the cache's ``directory``::

    objects/<key>/lock                    the entry's lock
    objects/<key>/<version>.safetensors   the copy (complete and verified)
    objects/<key>/<version>.json          its record
    objects/<key>/<version>.part          a partial copy (sparse), and
    objects/<key>/<version>.part.json     the ranges it holds
    objects/<key>/.growing                what the copy's writer has written so far

``<key>`` hashes the address (:func:`~.keys.object_key`), ``<version>`` its ETag, Last-Modified
and size. ``hf://`` files, under ``hub_directory``, in the Hugging Face layout::

    models--<org>--<name>/blobs/<etag>                     the file (LFS: etag = SHA-256)
    models--<org>--<name>/snapshots/<commit>/<path>        a relative link to the blob
    models--<org>--<name>/refs/<revision>                  the commit a branch or tag was at
    models--<org>--<name>/.stream_st/<etag>.json           stream_st's record of the blob
    models--<org>--<name>/.stream_st/<etag>.part(.json)    a partial copy
    .locks/models--<org>--<name>/<etag>.lock               the lock huggingface_hub takes too

An ETag may hold dots (huggingface_hub names blobs by any): the files of ``.stream_st`` are
told apart by their endings (:func:`hub_file`), and no ETag that ends in ``.part`` names a blob
(its record would be the partial copy's record of another).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .config import Cache
from .store import Record, put_in_place, remove_quietly

__all__ = ["COMMIT", "PAIRS", "HubEntry", "ObjectEntry", "hub_file", "partner", "repo_folder"]

COMMIT = re.compile(r"[0-9a-f]{40}")
"""A full commit id: a revision that names one commit for good."""


@dataclass(frozen=True)
class ObjectEntry:
    """The files of one version of an object (see the module)."""

    folder: Path
    version: str

    @classmethod
    def of(cls, cache: Cache, key: str, version: str = "") -> ObjectEntry:
        return cls(cache.directory / "objects" / key, version)

    def at(self, version: str) -> ObjectEntry:
        return ObjectEntry(self.folder, version)

    @property
    def lock(self) -> Path:
        return self.folder / "lock"

    @property
    def growing(self) -> Path:
        """Where the writer of a copy publishes its progress (see :mod:`.follow`)."""
        return self.folder / ".growing"

    @property
    def data(self) -> Path:
        return self.folder / f"{self.version}.safetensors"

    @property
    def record(self) -> Path:
        return self.folder / f"{self.version}.json"

    @property
    def part(self) -> Path:
        return self.folder / f"{self.version}.part"

    @property
    def part_record(self) -> Path:
        return self.folder / f"{self.version}.part.json"

    def versions(self) -> Iterator[str]:
        """The versions with a complete copy here: a record and the copy it describes."""
        names = set(self._names())
        for name in sorted(names):
            if (
                name.endswith(".json")
                and not name.endswith(".part.json")
                and partner(name) in names
            ):
                yield name[: -len(".json")]

    def partials(self) -> Iterator[str]:
        """The versions with a partial copy here: the copy and the record of its ranges."""
        names = set(self._names())
        for name in sorted(names):
            if name.endswith(".part.json") and partner(name) in names:
                yield name[: -len(".part.json")]

    def _names(self) -> list[str]:
        try:
            return os.listdir(self.folder)
        except OSError:
            return []

    def clean(self, keep: str | None = None) -> None:
        """Remove what no one will use (call it holding the lock): leftovers of writers that
        died (:meth:`leftovers`) and, with ``keep``, every version but that one. Records go
        before their copies: one killed in between leaves a copy no record names (a leftover),
        never a record of a copy that is gone, which would be listed as a copy."""
        names = self._names()
        left = set(self.leftovers(names))
        for name in sorted(names, key=lambda name: not name.endswith(".json")):
            if name == "lock":
                continue
            if name in left or (keep is not None and name.split(".", 1)[0] != keep):
                remove_quietly(self.folder / name)

    def leftovers(self, names: list[str] | None = None) -> list[str]:
        """The names of the files here that only a writer holding the lock uses, left when no
        one holds it by one that died or was killed: temporary files, the ``.growing`` file,
        and either half of a copy and its record without the other (a partial copy whose
        ranges were never recorded, a copy moved into place whose record was never written, a
        record whose copy was removed). ``names``: the folder's, if known."""
        if names is None:
            names = self._names()
        present = set(names)

        def left(name: str) -> bool:
            if name == "lock":
                return False
            if name.startswith(".") or name.endswith(".tmp"):
                return True
            other = partner(name)
            return other is not None and other not in present

        return sorted(filter(left, names))

    def commit(self, part: Path, record: Record) -> None:
        """Move the finished ``part`` into place and record it; other versions go."""
        from .store import fingerprint

        os.replace(part, self.data)
        try:
            record.fingerprint = fingerprint(self.data)
            record.save(self.record)
        except OSError:  # a copy no record names would be kept for ever, unseen: not kept
            remove_quietly(self.data)
            raise
        remove_quietly(self.part_record)
        self.clean(keep=self.version)


PAIRS = ((".part.json", ".part"), (".json", ".safetensors"))
"""The files of an object entry that go in pairs: a record and the copy it describes."""


def partner(name: str) -> str | None:
    """The other file of the pair ``name`` (a file of an object entry) is one of (see
    :data:`PAIRS`); None for a file of no pair."""
    for record, copy in PAIRS:
        if name.endswith(record):
            return name[: -len(record)] + copy
        if name.endswith(copy):
            return name[: -len(copy)] + record
    return None


HUB_ENDINGS = (".part.json", ".part", ".json")
"""The endings of the files of a Hub repository's ``.stream_st`` folder after the blob's ETag
(see the module), the longest first."""


def hub_file(name: str) -> tuple[str, str] | None:
    """The ETag and ending (one of :data:`HUB_ENDINGS`) of the file ``name`` of a Hub
    repository's ``.stream_st`` folder; None for a name of no such file."""
    for ending in HUB_ENDINGS:
        if name.endswith(ending) and len(name) > len(ending):
            return name[: -len(ending)], ending
    return None


def repo_folder(repo_type: str, repo_id: str) -> str:
    """The Hugging Face cache's folder name of a repository: ``models--org--name``."""
    return f"{repo_type}s--" + repo_id.replace("/", "--")


@dataclass(frozen=True)
class HubEntry:
    """A file of a Hub repository in the Hugging Face cache layout (see the module)."""

    root: Path  # the hub cache directory
    folder: str  # models--org--name
    path: str  # the file's path in the repository

    @property
    def storage(self) -> Path:
        return self.root / self.folder

    def ref(self, revision: str) -> Path:
        return self.storage / "refs" / revision

    def commit_of(self, revision: str) -> str | None:
        """The commit ``revision`` names: itself when a full commit id, else what its ref
        file holds; None when unknown here."""
        if COMMIT.fullmatch(revision):
            return revision
        try:
            commit = self.ref(revision).read_text().strip()
        except OSError:
            return None
        return commit if COMMIT.fullmatch(commit) else None

    def pointer(self, commit: str) -> Path:
        return self.storage / "snapshots" / commit / Path(*self.path.split("/"))

    def blob(self, etag: str) -> Path:
        return self.storage / "blobs" / etag

    def record(self, etag: str) -> Path:
        return self.storage / ".stream_st" / f"{etag}.json"

    def part(self, etag: str) -> Path:
        return self.storage / ".stream_st" / f"{etag}.part"

    def part_record(self, etag: str) -> Path:
        return self.storage / ".stream_st" / f"{etag}.part.json"

    def lock(self, etag: str) -> Path:
        return self.root / ".locks" / self.folder / f"{etag}.lock"

    def blob_of(self, commit: str) -> str | None:
        """The blob name the snapshot of ``commit`` links this file to; None when none."""
        pointer = self.pointer(commit)
        try:
            target = os.readlink(pointer)
        except OSError:
            return None
        return Path(target).name

    def link(self, commit: str, etag: str, revision: str) -> None:
        """Make the snapshot of ``commit`` point at the blob ``etag`` (a relative link, as
        huggingface_hub makes), and ``revision``'s ref name ``commit``."""
        pointer = self.pointer(commit)
        pointer.parent.mkdir(parents=True, exist_ok=True)
        target = os.path.relpath(self.blob(etag), pointer.parent)
        put_in_place(pointer, lambda temp: os.symlink(target, temp))
        if revision != commit:
            ref = self.ref(revision)
            ref.parent.mkdir(parents=True, exist_ok=True)
            put_in_place(ref, lambda temp: temp.write_text(commit))
