"""``--json`` records write a file's control and format characters escaped, as the plain output
shows them escaped: C1 controls (U+009B, the terminal's CSI), bidirectional overrides (U+202E),
U+2028 and U+2029, which Python's ``json`` writes as they are (it escapes U+0000 to U+001F
alone), are ``\\uXXXX`` escapes (a surrogate pair past U+FFFF), so that the record parses to the
same text and cannot drive the terminal."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from stream_st.cli import output

from ._cli import run, write_model

HIDDEN = (
    "\x7f"  # DEL: a control character json writes as it is
    "\x85\x9b"  # C1 controls: NEL, CSI
    "\xa0"  # a no-break space, which the plain output escapes too
    "\xad\u200b\u202e\ufeff"  # format characters: soft hyphen, zero width space, RLO, BOM
    "\u2028\u2029"  # the line and paragraph separators
    "\u0378"  # unassigned
    "\U000e0001"  # a format character past U+FFFF: LANGUAGE TAG
    "\U000f0000"  # private use, past U+FFFF
)
"""One of each kind of character the plain output escapes and ``json`` writes as it is."""

NAME = f"w{HIDDEN}é漢😀"
"""A tensor name holding them, and printable text past ASCII, which stays as it is."""

METADATA = {"k": f"\x9b31mred{HIDDEN}", f"key{HIDDEN}": "v"}


@pytest.fixture
def hidden(tmp_path: Path) -> Path:
    """A file whose name, tensor name and metadata hold :data:`HIDDEN`."""
    path = tmp_path / f"m{HIDDEN}é.safetensors"
    save_file({NAME: np.arange(4, dtype=np.float32)}, str(path), metadata=METADATA)
    return path


def _records(stdout: str) -> list[str]:
    """The lines of ``stdout``, each checked to hold no character a terminal would act on."""
    lines = stdout.splitlines()  # splits at U+2028 and U+0085 too: none may be there
    assert stdout == "".join(f"{line}\n" for line in lines), stdout
    for line in lines:
        assert line.isprintable(), [c for c in line if not c.isprintable()]
    return lines


def test_every_json_record_escapes_control_and_format_characters(
    hidden: Path, tmp_path: Path
) -> None:
    other = write_model(tmp_path / "other.safetensors")
    for args in (
        ["inspect", "--json", str(hidden)],
        ["show", "--json", str(hidden), NAME],
        ["validate", "--json", str(hidden)],
        ["diff", "--json", str(hidden), str(other)],
        ["hash", "--json", str(hidden)],
    ):
        result = run(*args, env={"PYTHONIOENCODING": "utf-8"})
        assert result.returncode in (0, 1), (args, result.stderr)
        (line,) = _records(result.stdout)
        for escaped in ("\\u009b", "\\u202e", "\\u2028", "\\udb40\\udc01", "é"):
            assert escaped in line, (args, escaped, line)  # printable text as it is
        parsed = json.dumps(json.loads(line), ensure_ascii=False)
        assert str(hidden) in parsed or NAME in parsed, args  # the same text, parsed back
    inspected = json.loads(run("inspect", "--json", str(hidden)).stdout)
    assert inspected["metadata"] == METADATA and inspected["tensors"][0]["name"] == NAME
    assert json.loads(run("show", "--json", str(hidden), NAME).stdout)["name"] == NAME


def test_ascii_output_escapes_del_too(hidden: Path) -> None:
    """Standard output not UTF-8: every character past ASCII escaped, and DEL."""
    result = run("inspect", "--json", str(hidden), env={"PYTHONIOENCODING": "ascii"})
    (line,) = _records(result.stdout)
    assert line.isascii() and "\x7f" not in line and "\\u007f" in line
    assert json.loads(line)["metadata"] == METADATA


def test_json_escapes_what_the_plain_output_escapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A character is escaped in a record where :func:`~stream_st.cli.output.shown` escapes it,
    and only there (one notion of what to escape); past U+FFFF as a surrogate pair."""
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # no encoding: taken as UTF-8
    planes = (*range(0x2200), *range(0xD7F0, 0xD800), *range(0xE000, 0x10000))
    samples = [*map(chr, planes), "\U000e0001", "\U000f0000", "\U0010ffff", "\U0001f600"]
    for character in samples:
        text = output._json_text(character)
        assert json.loads(text) == character and text.isprintable(), repr(character)
        if character != '"':
            escaped = text != f'"{character}"'
            assert escaped == (output.shown(character) != character), repr(character)
    assert output._json_text("\U000e0001") == '"\\udb40\\udc01"'
    assert output._json_text("\x7f\u2028") == '"\\u007f\\u2028"'
    assert output._json_text("\U0001f600") == '"\U0001f600"'


def test_print_json_escapes_keys_and_values_in_one_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """A record's keys are escaped as its values are, in lists and dicts."""
    printed = io.StringIO()
    monkeypatch.setattr(sys, "stdout", printed)
    output.print_json({NAME: [METADATA, 1.5, None]})
    (line,) = _records(printed.getvalue())
    assert json.loads(line) == {NAME: [METADATA, 1.5, None]}
