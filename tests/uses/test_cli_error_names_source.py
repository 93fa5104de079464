"""An error about one of several sources names it, even where its name is a piece of the
message (``d`` in ``directory``, ``files`` in ``no safetensors files``): both the error's
``url=`` and the command's line took any such piece as the message naming the source, and said
``no safetensors files in this directory`` for four directories without a name; a message that
does name the source (``no such file: model``) still names it once."""

from __future__ import annotations

from pathlib import Path

import pytest

from stream_st import SourceNotFoundError, TransportError

from ._cli import run

NAMES = ("d", "files", "safetensors", "no", "index", "emptydir")
"""Directories whose names are pieces of the message about them."""


def _errors(stderr: str) -> list[str]:
    """The error lines of ``stderr``, each with its ``stream-st: error: `` cut off."""
    lines = stderr.splitlines()
    assert all(line.startswith("stream-st: error: ") for line in lines), stderr
    return [line.removeprefix("stream-st: error: ") for line in lines]


def test_each_empty_directory_is_named(tmp_path: Path) -> None:
    for name in NAMES:
        (tmp_path / name).mkdir()
    result = run("inspect", *NAMES, cwd=tmp_path)
    assert result.returncode == 2
    errors = _errors(result.stderr)
    said = "no safetensors files in this directory (no *.safetensors, no index)"
    assert errors == [f"{said}, url={name}" for name in NAMES]


def test_each_unreadable_listed_name_is_named(tmp_path: Path) -> None:
    for name in ("o", "d", "read"):
        (tmp_path / name).mkdir()
    (tmp_path / "sums").write_text("".join(f"{'0' * 64}  {name}\n" for name in ("o", "d", "read")))
    result = run("hash", "--check", "sums", cwd=tmp_path)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "WARNING" not in line]
    assert _errors("\n".join(errors)) == [
        f"cannot read a directory, url={name}" for name in ("o", "d", "read")
    ]


def test_a_list_named_as_a_word_of_its_error_is_named(tmp_path: Path) -> None:
    for name in ("o", "lines", "found"):
        (tmp_path / name).write_text("not a checksum line\n")
    result = run("hash", "--check", "o", "lines", "found", cwd=tmp_path)
    assert result.returncode == 2
    assert _errors(result.stderr) == [
        f"{name}: no properly formatted SHA256 checksum lines found"
        for name in ("o", "lines", "found")
    ]


def test_a_missing_source_is_named_once(tmp_path: Path) -> None:
    for name in ("model", "missing.safetensors"):
        result = run("ls", name, cwd=tmp_path)
        assert result.returncode == 2
        assert _errors(result.stderr) == [f"no such file: {name}"]


@pytest.mark.parametrize(
    ("message", "url", "text"),
    [
        ("cannot read a directory", "d", "cannot read a directory, url=d"),
        ("cannot read a directory", "directory", "cannot read a directory, url=directory"),
        ("cannot read a directory", "cannot", "cannot read a directory, url=cannot"),
        ("read failed: Is a directory", "failed", "read failed: Is a directory, url=failed"),
        ("no such file: model", "model", "no such file: model"),
        ("model: Permission denied", "model", "model: Permission denied"),
        ("no such file: /m.safetensors", "/m.safetensors", "no such file: /m.safetensors"),
        ("cannot read m.st: Permission denied", "m.st", "cannot read m.st: Permission denied"),
        ("s3://b/k changed on the server", "s3://b/k", "s3://b/k changed on the server"),
        ("no such file: /m.safetensorsx", "/m.safetensors", None),
        ("expected an hf:// address, got 'a b'", "a b", None),
        ("invalid path 'a\\x00b': null byte", "a\x00b", "invalid path 'a\\x00b': null byte"),
    ],
)
def test_a_transport_error_names_its_address_once(message: str, url: str, text: str | None) -> None:
    error = TransportError(message, url=url)
    assert str(error) == (text or f"{message}, url={url}")
    assert str(SourceNotFoundError(message, url=url, position=3)).endswith(", at byte 3")


def test_cites_reads_a_named_address_and_nothing_else() -> None:
    from stream_st.errors import cites

    assert cites("x, url=d", "d") and cites("x, url=d, at byte 3", "d")
    assert not cites("no safetensors files in this directory", "files")
    assert not cites("no safetensors files in this directory", "d")
    assert not cites("anything", "")
