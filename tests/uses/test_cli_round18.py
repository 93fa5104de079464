"""The command's defects found by the eighteenth attack: a serve token from an empty variable,
``demo --layers`` unbounded, ``file://`` destinations of ``cp``, ``--header`` values checked per
request, file names shown unescaped."""

from __future__ import annotations

import hashlib
import os
import resource
import subprocess
from pathlib import Path

import pytest

from stream_st.cli import main

from ..servers.http_server import RangeHTTPServer
from ..servers.s3_server import CREDENTIALS, MotoS3Server
from ._cli import COMMAND, run, write_model


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_model(tmp_path / "model.safetensors")


@pytest.mark.parametrize("token", ["", "two words"], ids=["empty", "not a token"])
def test_serve_refuses_a_bad_token_from_its_variable(token: str, model: Path) -> None:
    """``STREAM_ST_SERVE_TOKEN=`` (set, empty) served with no authentication at all, where
    ``--token ''`` is refused: the variable is checked as the option is, before serving (a
    server started would run until the timeout ends it)."""
    result = subprocess.run(
        [COMMAND, "serve", "--port", "0", str(model)],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "STREAM_ST_SERVE_TOKEN": token},
    )
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert result.stderr.startswith("stream-st: error: STREAM_ST_SERVE_TOKEN is ")
    assert result.stderr.count("\n") == 1
    assert not token or token not in result.stderr  # never shown


@pytest.mark.parametrize(
    "header",
    ["X-Note: caf\u00e9 \u2603", "X-Note: a\x01b", "X-Note: a\x7fb", "X\x7f: v", "\u2603: v"],
    ids=["not latin-1", "control", "delete", "control in the name", "name not latin-1"],
)
def test_a_header_no_request_can_carry_is_refused_once(header: str, model: Path) -> None:
    """A ``-H`` value Latin-1 cannot encode was refused by each source's request, once per
    source (and taken without a word for a local one); a control character other than a line
    break was sent. Either is the option's error, once, before any source is read."""
    data = model.read_bytes()
    with RangeHTTPServer(objects={"/a.safetensors": data, "/b.safetensors": data}) as http:
        urls = [http.url("/a.safetensors"), http.url("/b.safetensors")]
        for sources in (urls, [str(model), str(model)]):
            result = run("inspect", "-q", "-H", header, *sources)
            assert (result.returncode, result.stdout) == (2, ""), result.stderr
            assert "argument -H/--header: " in result.stderr
            assert result.stderr.count("\n") == 1, result.stderr
        http.settle()
        assert http.requests == []


def test_a_name_not_utf8_is_escaped_in_a_single_source_error(model: Path, tmp_path: Path) -> None:
    """``show``, ``cp`` and ``diff`` reported their errors with a file name's byte that is not
    UTF-8 as Python's surrogate (``\\udcff``), where the docs (and the commands taking several
    sources) escape it as the byte (``bad\\xffname``)."""
    odd = tmp_path / os.fsdecode(b"bad\xffname.safetensors")
    odd.write_bytes(model.read_bytes())
    for argv in (
        ["show", str(odd), "nope"],
        ["cp", "-q", "--include", "zz", str(odd), str(tmp_path / "out.safetensors")],
    ):
        result = subprocess.run(
            [COMMAND, *argv], capture_output=True, timeout=120, stdin=subprocess.DEVNULL
        )
        stderr = result.stderr.decode("utf-8")  # no surrogate: UTF-8 throughout
        assert result.returncode == 2, stderr
        assert "bad\\xffname.safetensors" in stderr and stderr.count("\n") == 1


def _limited_memory() -> None:
    """Run in the child: at most 3 GiB of address space, so that a demo allocating without end
    fails in it, not the machine."""
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


@pytest.mark.parametrize(
    ("layers", "seq", "said"),
    [
        ("99999999999", "1", "layers must be at most 1024, got 99999999999"),
        (
            "64",
            "16385",
            "a cache of 64 layers of 16,385 tokens holds 1,073,807,360 bytes, over the demo's "
            "1,073,741,824: fewer layers or a shorter seq",
        ),
    ],
    ids=["layers", "layers x seq"],
)
def test_the_synthetic_demo_refuses_a_cache_beyond_its_bounds(
    layers: str, seq: str, said: str
) -> None:
    """``demo --synthetic --layers 99999999999`` planned every layer's wire tensors, allocating
    until the OOM killer came (a MemoryError and "internal error" under a memory limit); the
    layers and the cache's bytes are bounded, refused before anything is computed (exit 2)."""
    argv = ["demo", "--synthetic", "-q", "--codecs", "none", "--layers", layers, "--seq", seq]
    result = subprocess.run(
        [COMMAND, *argv], capture_output=True, text=True, timeout=60, preexec_fn=_limited_memory
    )
    assert (result.returncode, result.stdout, result.stderr) == (
        2,
        "",
        f"stream-st: error: {said}\n",
    )


def test_cp_into_a_file_url_directory_as_into_a_path(model: Path, tmp_path: Path) -> None:
    """A ``file://`` destination naming an existing directory failed ("the destination is a
    directory") and one ending in ``/`` that did not exist failed ("no such directory"), where
    the same paths are written into (made if missing): the URL's path is taken as the path."""
    (tmp_path / "there").mkdir()
    for dst, landed in (
        (tmp_path / "there", tmp_path / "there" / model.name),
        (tmp_path / "new" / "deeper", tmp_path / "new" / "deeper" / model.name),
    ):
        assert main(["cp", "-q", str(model), dst.as_uri() + "/" * (dst.name == "deeper")]) == 0
        assert landed.read_bytes() == model.read_bytes()
    failed = main(["cp", "-q", "--include", "zz", str(model), (tmp_path / "gone").as_uri() + "/"])
    assert failed == 2 and not (tmp_path / "gone").exists()  # the directory made is removed


def test_cp_into_a_file_url_directory_keeps_a_name_url_escapes_would_change(
    model: Path, tmp_path: Path
) -> None:
    """A source named ``a%41#b.safetensors`` copied into ``file:///dir/`` was written as
    ``dir/aA`` (its name joined unquoted into the URL, which the file transport decodes): it
    lands under its own name, as into a plain path."""
    named = tmp_path / "a%41#b.safetensors"
    named.write_bytes(model.read_bytes())
    (tmp_path / "into").mkdir()
    assert main(["cp", "-q", str(named), (tmp_path / "into").as_uri() + "/"]) == 0
    assert os.listdir(tmp_path / "into") == [named.name]


def test_cp_takes_an_s3_key_to_its_end(model: Path, moto_s3: MotoS3Server) -> None:
    """An S3 key holds ``?`` as any other character (the reader's, and ``aws s3 cp``'s): to
    ``s3://b/dir/?x=1`` the command wrote ``dir/?x=1/model.safetensors``, its path before the
    ``?`` taken as a prefix; it writes the key ``dir/?x=1``, and into a prefix only where the
    key ends in ``/``."""
    client = moto_s3.client()
    client.create_bucket(Bucket="round18-keys")
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": moto_s3.endpoint_url}
    for dst in ("s3://round18-keys/dir/?x=1", "s3://round18-keys/pre/?x=1/"):
        result = run("cp", "-q", str(model), dst, env=env)
        assert result.returncode == 0, result.stderr
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="round18-keys")["Contents"]]
    assert sorted(keys) == ["dir/?x=1", "pre/?x=1/model.safetensors"]


def test_hash_file_and_cp_escape_a_name_that_would_drive_the_terminal(
    model: Path, tmp_path: Path
) -> None:
    """``hash --file`` (of a model directory, whose file names nobody typed) and ``cp``'s
    ``copied ... to DST`` line wrote a name's escape sequence raw to the terminal: escaped as
    the other commands show it, on ``sha256sum``'s escaped line, which ``hash --check`` reads
    back."""
    folder = tmp_path / "dir"
    folder.mkdir()
    name = "a\x1b[2Jb\\c.safetensors"  # an escape sequence and a backslash
    (folder / name).write_bytes(model.read_bytes())
    listed = run("hash", "--file", "dir", cwd=tmp_path)
    want = hashlib.sha256(model.read_bytes()).hexdigest()
    assert listed.stdout == f"\\{want}  dir/a\\x1b[2Jb\\\\c.safetensors\n", listed.stderr
    (tmp_path / "sums").write_text(listed.stdout)
    checked = run("hash", "--check", "sums", cwd=tmp_path)
    # the backslash doubled, as every name shown (a\\nb is not a, a newline, b)
    assert (checked.returncode, checked.stdout) == (0, "dir/a\\x1b[2Jb\\\\c.safetensors: OK\n")
    copied = run("cp", str(model), str(folder / "\x1b]0;title\x07.safetensors"))
    assert copied.returncode == 0, copied.stderr
    assert copied.stderr.endswith("/dir/\\x1b]0;title\\x07.safetensors\n"), copied.stderr
    assert "\x1b" not in copied.stderr and "\x07" not in copied.stderr
    spaced = folder.parent / "spaced"
    spaced.mkdir()
    (spaced / "u\u00a0v.safetensors").write_bytes(model.read_bytes())  # a no-break space
    plain = run("hash", "--file", "spaced", cwd=tmp_path)
    assert plain.stdout == f"{want}  spaced/u\u00a0v.safetensors\n", plain.stdout  # sha256sum's
