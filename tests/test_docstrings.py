"""The parameters of the writing and receiving entry points are each explained in their
docstrings, which the API page shows: ``open_dataset_writer``'s ``task_id``, ``receive_kv``'s
``max_ahead``, ``save``'s ``fsync`` and ``open_writer``'s ``metadata`` were named nowhere.

Every member the API page lists has a docstring: mkdocstrings leaves one without off the page,
without a word (``KVLayout.plan``, ``Header.from_tensors``, the codecs' methods were missing)."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import stream_st


@pytest.mark.parametrize(
    "function",
    [
        stream_st.open_writer,
        stream_st.save,
        stream_st.open_dataset_writer,
        stream_st.receive_kv,
        stream_st.KVLayout,
        stream_st.HttpSource,
        stream_st.S3Sink,
        stream_st.Connection.open_stream,
        stream_st.Connection.messages,
    ],
    ids=lambda function: function.__qualname__,
)
def test_every_parameter_is_named_in_the_docstring(function: Callable[..., Any]) -> None:
    """A class's parameters in its class docstring: the one the API page shows."""
    doc = inspect.getdoc(function) or ""
    unnamed = [
        name
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
        and name != "self"
        and not re.search(rf"\b{re.escape(name)}\b", doc)
    ]
    assert not unnamed, f"{function.__qualname__}'s docstring does not name {unnamed}"


@pytest.mark.parametrize("function", [stream_st.open_writer, stream_st.save])
def test_fsync_is_said_to_flush_the_file_and_its_directory(function: Callable[..., Any]) -> None:
    """As the file sink does: the temporary file before the rename, the directory after."""
    doc = " ".join((inspect.getdoc(function) or "").split())
    assert re.search(r"``fsync=True``[^.]*before[^.]*directory", doc), doc


def test_open_writer_says_what_becomes_of_a_digest_record_in_metadata(tmp_path: Path) -> None:
    """It said a digest record copied into ``metadata=`` was dropped and ``checksums`` recorded
    the new file's, where with ``checksums`` such a record is a UsageError."""
    record = {"stream_st.digest": "xxh3-128", "stream_st.digest:x": "0" * 32, "k": "v"}

    async def write(checksums: bool) -> dict[str, str]:
        target = tmp_path / "out.safetensors"
        plan = [stream_st.TensorSpec("x", "F32", (3,))]
        async with stream_st.open_writer(
            target, plan, metadata=record, checksums=checksums
        ) as writer:
            await writer.write("x", np.ones(3, np.float32))
        return dict((await stream_st.read_header(target)).metadata)

    assert anyio.run(write, False) == {"k": "v"}  # left out
    with pytest.raises(stream_st.UsageError, match="is reserved for the digests"):
        anyio.run(write, True)
    doc = " ".join((inspect.getdoc(stream_st.open_writer) or "").split())
    assert "left out without ``checksums``, and is a :class:`~stream_st.UsageError` with it" in doc


ROOT = Path(__file__).resolve().parent.parent
_TARGET = re.compile(r"^::: (\S+)\n((?:    .*\n)*)", re.M)


def _api_targets() -> dict[str, tuple[str, ...] | None]:
    """Each ``::: target`` of ``docs/api.md`` and the members its ``members:`` option names
    (none for ``false``), None without the option: mkdocstrings then chooses them."""
    page = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    targets: dict[str, tuple[str, ...] | None] = {}
    for match in _TARGET.finditer(page):
        option = re.search(r"^ +members: (.+)$", match.group(2), re.M)
        value = option.group(1).strip() if option else None
        targets[match.group(1)] = (
            None
            if value is None
            else ()
            if value == "false"
            else tuple(name.strip() for name in value.strip("[]").split(","))
        )
    return targets


API_TARGETS = _api_targets()


@pytest.fixture(scope="module")
def package() -> Any:
    """stream_st as mkdocstrings reads it: griffe's static view of the sources."""
    griffe = pytest.importorskip("griffe", reason="the docs extra is not installed")
    return griffe.load("stream_st", search_paths=[str(ROOT)])


def _final(obj: Any) -> Any:
    """The object an alias (an imported name) stands for; any other object itself."""
    return obj.final_target if obj.is_alias else obj


def _shown(obj: Any, names: tuple[str, ...] | None) -> list[str]:
    """The public members of ``obj`` the API page renders: ``names`` if given, else a module's
    ``__all__`` (its own objects without one) but for submodules, a class's own members."""
    if names is None and obj.is_module:
        exported = obj.exports
        listed = (
            [str(name) for name in exported]
            if exported is not None
            else [name for name, member in obj.members.items() if not member.is_alias]
        )
        names = tuple(name for name in listed if not _final(obj.members[name]).is_module)
    elif names is None and obj.is_class:
        names = tuple(obj.members)
    return [name for name in names or () if not name.startswith("_")]


def _rendered(
    identifier: str, obj: Any, parent: Any, names: tuple[str, ...] | None
) -> Iterator[tuple[str, Any, Any]]:
    """``(identifier, object, its parent)`` for ``obj`` and each member under it the page
    renders, nested classes' members too."""
    yield identifier, obj, parent
    for name in _shown(obj, names):
        yield from _rendered(f"{identifier}.{name}", _final(obj.members[name]), obj, None)


def _target(package: Any, identifier: str) -> Any:
    """The object ``::: identifier`` renders."""
    if identifier == package.path:
        return package
    return _final(package[identifier.removeprefix(package.path + ".")])


@pytest.fixture(scope="module")
def on_page(package: Any) -> set[str]:
    """The canonical paths of every object the API page renders."""
    return {
        obj.path
        for identifier, names in API_TARGETS.items()
        for _, obj, _ in _rendered(identifier, _target(package, identifier), None, names)
    }


def _documented(obj: Any, parent: Any, on_page: set[str]) -> bool:
    """Whether ``obj`` has a docstring, or a method or property without one is documented on a
    base class the page renders. A class's fields and instance attributes (no property) are
    not checked: its class docstring is where they are described, when they are."""
    if obj.docstring:
        return True
    if parent is None or not parent.is_class:
        return False
    if obj.is_attribute and "property" not in obj.labels:
        return True
    return any(
        base.path in on_page and obj.name in base.members and bool(base.members[obj.name].docstring)
        for base in parent.mro()
    )


@pytest.mark.parametrize("target", API_TARGETS)
def test_every_member_the_api_page_lists_has_a_docstring(
    package: Any, on_page: set[str], target: str
) -> None:
    """``show_if_no_docstring`` is false: a member without a docstring is silently left off
    ``docs/api.md``'s page (``Int4Codec.encode``, ``KVLayout.plan``, ``kv.DIGEST_SIZE``...)."""
    missing = [
        identifier
        for identifier, obj, parent in _rendered(
            target, _target(package, target), None, API_TARGETS[target]
        )
        if not _documented(obj, parent, on_page)
    ]
    assert not missing, f"no docstring, so not on the API page: {missing}"
