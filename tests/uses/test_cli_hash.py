"""``stream-st hash``: the sha256 of every byte of any input, sha256sum's lines and ``--check``."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy
from anyio.abc import SocketAttribute, SocketStream

from stream_st import tools
from stream_st.transports.registry import SourceLike

from ..servers.http_server import RangeHTTPServer
from ._cli import COMMAND, TENSORS, run, write_model

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_model(tmp_path / "model.safetensors")


def _file_sha256_of(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    found: str = json.loads(result.stdout)["file_sha256"]
    return found


@pytest.mark.parametrize("content", [False, True], ids=["structure", "content"])
def test_file_sha256_of_a_pipe_a_fifo_and_a_redirect(
    model: Path, tmp_path: Path, content: bool
) -> None:
    """The header read first used to be missing from the file's hash of a pipe (the data section
    only), and with --content the whole input (the hash of nothing)."""
    data = model.read_bytes()
    want = hashlib.sha256(data).hexdigest()
    flags = ["hash", "--json", "--file", *(["--content"] if content else [])]
    assert _file_sha256_of(run(*flags, str(model))) == want
    with model.open("rb") as redirected:  # < model.safetensors
        assert _file_sha256_of(run(*flags, "-", stdin=redirected)) == want
    piped = subprocess.Popen(["cat", str(model)], stdout=subprocess.PIPE)  # cat model | ...
    assert piped.stdout is not None
    try:
        result = run(*flags, "-", stdin=piped.stdout)
    finally:
        piped.stdout.close()
        piped.wait()
    assert _file_sha256_of(result) == want
    assert want != EMPTY_SHA256
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def feed() -> None:
        with fifo.open("wb") as f:
            f.write(data)

    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        assert _file_sha256_of(run(*flags, str(fifo))) == want
    finally:
        feeder.join(timeout=30)


@pytest.mark.parametrize("cut", ["short", "longer"])
def test_file_sha256_of_a_pipe_or_fifo_refuses_a_file_of_other_size(
    model: Path, tmp_path: Path, cut: str
) -> None:
    """A file missing its last bytes, or with bytes past its data, is refused through a pipe or
    a FIFO as it is as a file argument, with the reader's error (the header alone was parsed,
    the rest hashed, its size never compared with the header's: exit 0, a hash)."""
    data = model.read_bytes()
    damaged = tmp_path / f"{cut}.safetensors"
    damaged.write_bytes(data[:-4] if cut == "short" else data + b"extra")
    n = len(data)
    want = (
        f"reached byte {n - 4}, expected data up to byte {n} (4 bytes missing)"
        if cut == "short"
        else f"5 bytes follow the last tensor (the header describes {n} bytes, the source has "
        f"{n + 5})"
    )
    as_file = run("hash", "--file", str(damaged))
    assert as_file.returncode == 2 and want in as_file.stderr
    with damaged.open("rb") as redirected:
        piped = subprocess.Popen(["cat"], stdin=redirected, stdout=subprocess.PIPE)
        assert piped.stdout is not None
        try:
            result = run("hash", "--file", "-", stdin=piped.stdout)
        finally:
            piped.stdout.close()
            piped.wait()
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert want in result.stderr and "/dev/stdin" in result.stderr
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    feeder = threading.Thread(target=lambda: fifo.write_bytes(damaged.read_bytes()))
    feeder.start()
    try:
        result = run("hash", "--file", "--json", str(fifo))
    finally:
        feeder.join(timeout=30)
    assert (result.returncode, result.stdout) == (2, "") and want in result.stderr


def test_structural_hash_refuses_a_known_code_in_lower_case(model: Path, tmp_path: Path) -> None:
    """A dtype "f32" (the reference refuses the file) was kept as an unknown code and, the
    structural hash lower-casing dtypes, hashed as F32: a file no reader takes shared a valid
    file's hash. It is refused, as the reading commands refuse it."""
    lower = tmp_path / "lower.safetensors"
    lower.write_bytes(model.read_bytes().replace(b'"F32"', b'"f32"', 1))
    for args in (["hash"], ["hash", "--file"], ["ls"], ["inspect"]):
        result = run(*args, str(lower))
        assert result.returncode == 2, result.stdout
        assert "unknown safetensors dtype 'f32'" in result.stderr
        assert "codes are upper case ('F32')" in result.stderr


def test_structural_hash_keeps_an_unknown_code_s_case(model: Path, tmp_path: Path) -> None:
    """The structural hash lower-cased every dtype code, so a file of the unknown code "i4" and
    one of "I4" (both refused by the reference) hashed alike: an unknown code is hashed as
    written, a known one lower-cased as before."""
    hashes: list[str] = []
    for code in (b'"i4" ', b'"I4" '):
        path = tmp_path / f"{code[1:3].decode()}{len(hashes)}.safetensors"
        path.write_bytes(model.read_bytes().replace(b'"F32"', code, 1))
        result = run("hash", "--json", str(path))
        assert result.returncode == 0, result.stderr
        hashes.append(json.loads(result.stdout)["structural_hash"])
    assert hashes[0] != hashes[1]


def test_file_line_is_sha256sums_and_check_takes_it(model: Path, tmp_path: Path) -> None:
    """--file printed two labelled lines; now sha256sum's line, which sha256sum -c and
    hash --check both accept, and hash --check answers sha256sum -c's way."""
    sums = tmp_path / "sums.sha256"
    result = run("hash", "--file", model.name, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    want = hashlib.sha256(model.read_bytes()).hexdigest()
    assert result.stdout == f"{want}  {model.name}\n"
    sums.write_text(result.stdout)
    assert run("hash", "--check", str(sums), cwd=tmp_path).stdout == f"{model.name}: OK\n"
    if shutil.which("sha256sum"):
        checked = subprocess.run(
            ["sha256sum", "-c", str(sums)], cwd=tmp_path, capture_output=True, text=True
        )
        assert checked.returncode == 0 and checked.stdout == f"{model.name}: OK\n"
    with model.open("rb") as stdin:
        assert run("hash", "--file", "-", stdin=stdin).stdout == f"{want}  -\n"
    (tmp_path / "other.safetensors").write_bytes(model.read_bytes()[:-1] + b"\x01")
    sums.write_text(
        f"{want}  {model.name}\n{want} *other.safetensors\nnot a line\n{want}  missing\n"
    )
    bad = run("hash", "-c", str(sums), cwd=tmp_path)
    assert bad.returncode == 2, bad.stderr
    assert bad.stdout.splitlines() == [
        f"{model.name}: OK",
        "other.safetensors: FAILED",
        "missing: FAILED open or read",
    ]
    assert "1 computed checksum did NOT match" in bad.stderr
    assert "1 line is improperly formatted" in bad.stderr
    sums.write_text(f"{want}  {model.name}\n{want}  other.safetensors\n")
    assert run("hash", "-c", str(sums), cwd=tmp_path).returncode == 1


@pytest.mark.parametrize("option", ["--content", "--file", "--check"])
def test_weight_inspect_format_refuses_what_it_does_not_do(
    option: str, model: Path, tmp_path: Path
) -> None:
    """``hash --format weight-inspect --check LIST`` ignored the format, checking the list's
    sha256 lines (exit 0), where ``--file`` and ``--content`` were refused: so is ``--check``."""
    sums = tmp_path / "sums.sha256"
    sums.write_text(run("hash", "--file", str(model)).stdout)
    source = str(sums if option == "--check" else model)
    result = run("hash", "--format", "weight-inspect", option, source)
    assert (result.returncode, result.stdout) == (2, ""), result.stdout
    assert "weight-inspect hashes the header only: no --content, --file or --check" in (
        result.stderr
    )


def test_check_reads_remote_sources(model: Path, tmp_path: Path) -> None:
    """--check compares what an http(s):// (or s3://, hf://) source serves with the list."""
    want = hashlib.sha256(model.read_bytes()).hexdigest()
    with RangeHTTPServer(objects={"/m.safetensors": model.read_bytes()}) as server:
        url = server.url("/m.safetensors")
        sums = tmp_path / "sums"
        sums.write_text(f"{want}  {url}\n")
        result = run("hash", "--check", str(sums))
        assert result.returncode == 0 and result.stdout == f"{url}: OK\n", result.stderr
        listed = run("hash", "--file", url)
        assert listed.stdout == f"{want}  {url}\n"


def test_hash_of_a_directory_escapes_its_file_names(model: Path, tmp_path: Path) -> None:
    """A file name in a model directory was printed raw: a newline forged a line, an escape
    sequence reached the terminal, a byte not UTF-8 showed as ``\\udcff``, not ``\\xff``."""
    folder = tmp_path / "dir"
    folder.mkdir()
    forged = f"x\nstructural {'0' * 64}  trusted.safetensors\n\x1b[2Kz.safetensors"
    escaped = f"x\\nstructural {'0' * 64}  trusted.safetensors\\n\\x1b[2Kz.safetensors"
    shutil.copy(model, folder / forged)
    shutil.copy(model, folder / os.fsdecode(b"bad\xffname.safetensors"))
    for argv in (["hash"], ["hash", "--content"], ["hash", "--format", "weight-inspect"]):
        result = subprocess.run(
            [COMMAND, *argv, str(folder)], capture_output=True, timeout=120, check=True
        )
        lines = result.stdout.decode("ascii").splitlines()  # nothing but ASCII left
        assert len(lines) == (4 if "--content" in argv else 2), lines
        assert "\x1b" not in result.stdout.decode()
        assert lines[0].endswith(f"{folder}/bad\\xffname.safetensors"), lines
        assert lines[-1].endswith(f"{folder}/{escaped}"), lines


def test_check_hashes_any_file_where_file_reads_safetensors(tmp_path: Path) -> None:
    """As documented: --check is sha256sum -c's, whatever a listed file holds (a model
    repository's config.json), where --file hashes a safetensors source as every hash does."""
    config = tmp_path / "config.json"
    config.write_text("{}")
    sums = tmp_path / "sums"
    sums.write_text(f"{hashlib.sha256(b'{}').hexdigest()}  {config.name}\n")
    checked = run("hash", "-c", str(sums), cwd=tmp_path)
    assert (checked.returncode, checked.stdout) == (0, "config.json: OK\n"), checked.stderr
    refused = run("hash", "--file", config.name, cwd=tmp_path)
    assert refused.returncode == 2 and "safetensors" in refused.stderr, refused.stderr


def test_check_splits_lines_at_line_feeds_alone(model: Path, tmp_path: Path) -> None:
    """A listed name holding U+2028, U+0085, a form feed or a vertical tab (each a line break to
    str.splitlines) is one line, as sha256sum -c reads it, where --check split the line there
    and could not check the file; a list with CRLF line ends (written on Windows) is read."""
    want = hashlib.sha256(model.read_bytes()).hexdigest()
    names = ["a\u2028b.safetensors", "c\x85d.safetensors", "e\x0cf.safetensors", "g\x0bh"]
    for name in names:
        shutil.copy(model, tmp_path / name)
    sums = tmp_path / "sums"
    sums.write_bytes("".join(f"{want}  {name}\n" for name in names).encode())
    if shutil.which("sha256sum"):
        theirs = subprocess.run(["sha256sum", "-c", str(sums)], cwd=tmp_path, capture_output=True)
        assert theirs.returncode == 0, theirs.stderr
    checked = run("hash", "--check", str(sums), cwd=tmp_path)
    assert checked.returncode == 0 and checked.stderr == "", checked.stderr
    assert checked.stdout.count(": OK\n") == len(names), checked.stdout
    sums.write_bytes(f"{want}  {model.name}\r\n{want}  {names[0]}\r\n".encode())
    checked = run("hash", "--check", str(sums), cwd=tmp_path)
    assert checked.returncode == 0 and checked.stdout.count(": OK\n") == 2, checked.stderr


def test_check_skips_comment_lines_as_sha256sum_does(model: Path, tmp_path: Path) -> None:
    """A list's line whose first character is ``#`` (a comment) was counted as improperly
    formatted, with a warning sha256sum -c (--strict too) does not give; it is skipped, as there.
    A ``#`` after a space begins no comment; a list of comments alone holds no checksum line."""
    want = hashlib.sha256(model.read_bytes()).hexdigest()
    sums = tmp_path / "sums"
    for text, warned in (
        (f"# release 1\n#\n#\r\n{want}  {model.name}\n", ""),
        (f" # indented\n{want}  {model.name}\n", "WARNING: 1 line is improperly formatted\n"),
    ):
        sums.write_text(text, newline="")
        if shutil.which("sha256sum"):
            theirs = subprocess.run(
                ["sha256sum", "-c", str(sums)], cwd=tmp_path, capture_output=True, text=True
            )
            assert (theirs.returncode, theirs.stdout) == (0, f"{model.name}: OK\n")
            assert theirs.stderr.removeprefix("sha256sum: ") == warned
        checked = run("hash", "--check", str(sums), cwd=tmp_path)
        assert (checked.returncode, checked.stdout) == (0, f"{model.name}: OK\n"), checked.stderr
        assert checked.stderr.removeprefix("stream-st: ") == warned
    sums.write_text("# comments alone\n")
    checked = run("hash", "--check", str(sums), cwd=tmp_path)
    assert (checked.returncode, checked.stdout) == (2, ""), checked.stderr
    assert "no properly formatted SHA256 checksum lines found" in checked.stderr


@pytest.mark.parametrize("encoding", ["utf-8", "ascii", "latin-1"])
def test_file_line_holds_the_names_bytes_whatever_the_output_encoding(
    model: Path, tmp_path: Path, encoding: str
) -> None:
    """A name the output's encoding could not carry was written escaped with no leading
    backslash (``caf\\xe9``, ``bad\\udcffname``), or in that encoding (Latin-1's byte E9): the
    line named another file. Now the name's bytes, which hash --check and sha256sum -c read."""
    want = hashlib.sha256(model.read_bytes()).hexdigest()
    for name in (b"caf\xc3\xa9.safetensors", b"bad\xffname.safetensors"):
        shutil.copy(model, tmp_path / os.fsdecode(name))
        listed = subprocess.run(
            [COMMAND, "hash", "--file", os.fsdecode(name)],
            cwd=tmp_path,
            capture_output=True,
            timeout=120,
            env={**os.environ, "PYTHONIOENCODING": encoding},
        )
        assert listed.stdout == f"{want}  ".encode() + name + b"\n", listed.stderr
        (tmp_path / "sums").write_bytes(listed.stdout)
        checked = run("hash", "--check", "sums", cwd=tmp_path)
        assert checked.returncode == 0 and checked.stdout.endswith(": OK\n"), checked
        if shutil.which("sha256sum"):
            coreutils = subprocess.run(
                ["sha256sum", "-c", "sums"], cwd=tmp_path, capture_output=True
            )
            assert coreutils.returncode == 0, coreutils


def test_check_goes_on_past_a_list_it_cannot_read(model: Path, tmp_path: Path) -> None:
    """A missing list, or a directory given as one, ended the command (exit 2) before the
    lists after it were checked; now it is said and the others checked, as sha256sum -c does."""
    want = hashlib.sha256(model.read_bytes()).hexdigest()
    (tmp_path / "good.sha").write_text(f"{want}  {model.name}\n")
    (tmp_path / "folder").mkdir()
    for unreadable in ("missing.sha", "folder"):
        checked = run("hash", "--check", unreadable, "good.sha", cwd=tmp_path)
        assert checked.returncode == 2, checked.stderr
        assert checked.stdout == f"{model.name}: OK\n"
        assert checked.stderr.startswith("stream-st: error: cannot read checksum list: ")
        assert f"url={unreadable}" in checked.stderr


def _sparse_model(path: Path, size: int) -> Path:
    """A safetensors file of one U8 tensor of ``size`` zero bytes, its data a hole (fast to make
    and to read)."""
    header = json.dumps({"x": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}})
    text = header.encode().ljust(-(-len(header) // 8) * 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text)
    os.truncate(path, path.stat().st_size + size)
    return path


@pytest.mark.parametrize("check", [False, True], ids=["file", "check"])
def test_deadline_bounds_hashing_a_local_file(tmp_path: Path, check: bool) -> None:
    """A local file's bytes after the header were hashed with no look at the deadline: a big
    file ran to its end, whatever --deadline said."""
    big = _sparse_model(tmp_path / "big.safetensors", 2 << 30)
    if check:
        listing = tmp_path / "SHA256SUMS"
        listing.write_text(f"{'0' * 64}  {big}\n")
        args = ["hash", "--check", str(listing)]
    else:
        args = ["hash", "--file", str(big)]
    result = run(*args, "--deadline", "0.2")
    assert result.returncode == 2, result
    assert "deadline of 0.2 s passed" in result.stderr


@pytest.mark.parametrize("content", [False, True], ids=["structure", "content"])
@pytest.mark.parametrize("given", ["url", "stream"])
async def test_file_sha256_of_a_connection_is_its_message_s(content: bool, given: str) -> None:
    """A connection was hashed to its end, not its message's: a peer that sent a message and
    kept the connection open (as between a Connection's messages) made ``hash --file`` wait for
    its close (a ReadTimeoutError with a timeout, every byte of the message there), and a second
    message after the first was refused as trailing bytes; every other read stops at the
    message's end and leaves the rest unread, so the next message can be read."""
    first = reference_numpy.save(TENSORS)
    second = reference_numpy.save({"other": TENSORS["model.embed_tokens.weight"]})
    done = anyio.Event()

    async def peer(stream: SocketStream) -> None:
        async with stream:
            await stream.send(first + second)
            await done.wait()  # the connection stays open until the test has its answers

    async def hashed(source: SourceLike) -> str:
        found = await tools.hash(source, file=True, content=content, timeout=5)
        result: str = found["file_sha256"]
        return result

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with listener, anyio.create_task_group() as group:
        group.start_soon(listener.serve, peer)
        port = listener.extra(SocketAttribute.local_port)
        with anyio.fail_after(4):  # under the timeout: a wait for the peer's close fails here
            if given == "url":
                assert await hashed(f"tcp://127.0.0.1:{port}") == hashlib.sha256(first).hexdigest()
            else:  # the caller's stream, read message after message
                async with await anyio.connect_tcp("127.0.0.1", port) as stream:
                    assert await hashed(stream) == hashlib.sha256(first).hexdigest()
                    assert await hashed(stream) == hashlib.sha256(second).hexdigest()
        done.set()
        group.cancel_scope.cancel()


def test_a_checksum_list_on_a_socket_is_read(tmp_path: Path) -> None:
    """``hash --check -`` where standard input is a socket (inetd, ``socat EXEC:``): the list
    was opened anew as ``/dev/stdin``, which a socket refuses (``No such device or
    address``); it is read to the peer's end, as a checkpoint on ``-`` is."""
    model = write_model(tmp_path / "listed.safetensors", {"w": np.ones(4, np.float32)})
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(f"{digest}  {model}\n".encode())
        theirs.shutdown(socket.SHUT_WR)
        done = subprocess.run(
            [COMMAND, "hash", "--check", "-"], stdin=ours.fileno(), capture_output=True, timeout=60
        )
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode() == f"{model}: OK\n"
