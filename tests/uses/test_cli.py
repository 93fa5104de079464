"""The stream-st command end to end, through its real entry point in a subprocess."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import tools
from stream_st.cli import commands, main, output
from stream_st.cli.parser import build_parser
from stream_st.tools import content_digests

from ..servers.http_server import RangeHTTPServer
from ..servers.s3_server import CREDENTIALS, MotoS3Server

COMMAND = shutil.which("stream-st", path=str(Path(sys.executable).parent)) or "stream-st"

TENSORS: dict[str, np.ndarray[Any, Any]] = {
    "model.layers.0.self_attn.q_proj.weight": np.arange(16, dtype=np.float32).reshape(4, 4),
    "model.layers.0.self_attn.k_proj.weight": np.ones((4, 4), dtype=np.float16),
    "model.embed_tokens.weight": np.arange(8, dtype=np.int32).reshape(2, 4),
}


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [COMMAND, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    reference_numpy.save_file(TENSORS, str(path), metadata={"format": "np", "note": "ü"})
    return path


def test_help_everywhere() -> None:
    """Every command's --help has examples, and every example is a command line the parser
    takes as it is (so the help keeps up with the options)."""
    top = run("--help")
    assert top.returncode == 0 and "exit status" in top.stdout
    listed = re.search(r"\{(.+?)\}", run("completion", "--help").stdout)  # the shells
    assert listed is not None and listed.group(1) == "bash,zsh,fish,tcsh"
    commands = re.findall(r"^    (\w+)", top.stdout, flags=re.MULTILINE)
    assert set(commands) >= {"demo", "inspect", "ls", "show", "hash", "diff", "validate", "cp"}
    parser = build_parser()
    for command in commands:
        result = run(command, "--help")
        assert result.returncode == 0, command
        examples = result.stdout.partition("examples:\n")[2]
        lines = examples.replace("\\\n", " ").splitlines()
        assert len(lines) >= 2, command
        for line in lines:
            if line.strip().startswith("eval "):
                continue
            ours = next(p for p in line.split("|") if p.strip().startswith("stream-st "))
            words = shlex.split(ours.split(" > ")[0], comments=True)
            assert words[:2] == ["stream-st", command], line
            parser.parse_args(words[1:])  # exits (SystemExit) on an option that is not there


def test_inspect_table_and_json(model: Path) -> None:
    table = run("inspect", str(model))
    assert table.returncode == 0, table.stderr
    assert "3 tensors, 40 parameters" in table.stdout
    assert "model.embed_tokens.weight" in table.stdout and "note: ü" in table.stdout
    result = run("inspect", "--json", str(model))
    found = json.loads(result.stdout)
    assert found["tensor_count"] == 3
    assert found["parameter_count"] == 40
    assert found["metadata"] == {"format": "np", "note": "ü"}
    assert {t["name"]: t["shape"] for t in found["tensors"]} == {
        n: list(a.shape) for n, a in TENSORS.items()
    }
    assert found["data_bytes"] == sum(a.nbytes for a in TENSORS.values())


@pytest.mark.parametrize(
    "argv", [["inspect"], ["ls"], ["show", "model.embed_tokens.weight"]], ids=" ".join
)
def test_commands_showing_no_progress_take_quiet_as_the_others_do(
    argv: list[str], model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``-q`` is a no-op for the commands that show no progress (it was "unrecognized
    arguments"): their output is the same with it."""
    command, *rest = argv
    assert main([command, str(model), *rest]) == 0
    plain = capsys.readouterr()
    assert main([command, "-q", str(model), *rest]) == 0
    assert capsys.readouterr() == plain


def test_inspect_over_http_reads_only_the_header(model: Path) -> None:
    with RangeHTTPServer(objects={"/m.safetensors": model.read_bytes()}) as server:
        result = run("inspect", "--json", server.url("/m.safetensors"))
        assert json.loads(result.stdout)["tensor_count"] == 3
        server.settle()
        assert len(server.requests) == 1


def test_inspect_on_s3(model: Path, moto_s3: MotoS3Server) -> None:
    client = moto_s3.client()
    client.create_bucket(Bucket="cli")
    client.put_object(Bucket="cli", Key="m.safetensors", Body=model.read_bytes())
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": moto_s3.endpoint_url}
    result = run("inspect", "--json", "s3://cli/m.safetensors", env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["tensor_count"] == 3
    hashed = run("hash", "--content", "--json", "s3://cli/m.safetensors", env=env)
    local = run("hash", "--content", "--json", str(model))
    assert json.loads(hashed.stdout)["content_hash"] == json.loads(local.stdout)["content_hash"]


GOLDEN_STRUCTURAL = "8fe9ad84e0ba10cffced8586ed58e803ba03374d6dc7f53865ccaa8ac847fad2"


def relaid(path: Path) -> bytes:
    """The same tensors with another JSON key order and another data layout."""
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8 : 8 + n])
    data = path.read_bytes()[8 + n :]
    names = sorted((k for k in header if k != "__metadata__"), reverse=True)
    out: dict[str, Any] = {}
    blob = b""
    for name in names:
        start, end = header[name]["data_offsets"]
        out[name] = {
            "shape": header[name]["shape"],
            "data_offsets": [len(blob), len(blob) + end - start],
            "dtype": header[name]["dtype"],
        }
        blob += data[start:end]
    out["__metadata__"] = header["__metadata__"]
    text = json.dumps(out).encode()
    return struct.pack("<Q", len(text)) + text + blob


def test_golden_structural_hash_follows_its_definition() -> None:
    document = {
        "format": "safetensors",
        "tensors": [
            {"name": n, "dtype": d, "shape": list(a.shape), "byte_length": a.nbytes}
            for n, d, a in sorted(
                (n, {"float32": "f32", "float16": "f16", "int32": "i32"}[str(a.dtype)], a)
                for n, a in TENSORS.items()
            )
        ],
    }
    text = json.dumps(document, sort_keys=True, separators=(",", ":"))
    assert hashlib.sha256(text.encode()).hexdigest() == GOLDEN_STRUCTURAL


def test_hash_is_golden_and_independent_of_layout(model: Path, tmp_path: Path) -> None:
    first = json.loads(run("hash", "--content", "--json", str(model)).stdout)
    again = json.loads(run("hash", "--content", "--json", str(model)).stdout)
    assert first == again
    assert first["structural_hash"] == GOLDEN_STRUCTURAL
    other = tmp_path / "other.safetensors"
    other.write_bytes(relaid(model))
    moved = json.loads(run("hash", "--content", "--json", str(other)).stdout)
    assert moved["structural_hash"] == first["structural_hash"]
    assert moved["content_hash"] == first["content_hash"]
    plain = run("hash", str(model))
    assert plain.stdout.split()[1] == GOLDEN_STRUCTURAL


def test_diff_exit_status_and_json(model: Path, tmp_path: Path) -> None:
    same = run("diff", "--content", str(model), str(model))
    assert same.returncode == 0 and "equal" in same.stdout
    changed = dict(TENSORS)
    changed["model.embed_tokens.weight"] = np.zeros((2, 4), dtype=np.int32)  # content only
    changed["model.layers.0.self_attn.k_proj.weight"] = np.ones((4, 2), dtype=np.float16)
    del changed["model.layers.0.self_attn.q_proj.weight"]
    changed["extra"] = np.zeros(1, dtype=np.uint8)
    other = tmp_path / "other.safetensors"
    reference_numpy.save_file(changed, str(other), metadata={"format": "pt"})
    result = run("diff", "--content", "--json", str(model), str(other))
    assert result.returncode == 1
    found = json.loads(result.stdout)
    assert found["added"] == ["extra"]
    assert found["removed"] == ["model.layers.0.self_attn.q_proj.weight"]
    assert found["changed"] == {
        "model.layers.0.self_attn.k_proj.weight": {
            "shape": [[4, 4], [4, 2]],
            "byte_length": [32, 16],
        }
    }
    assert found["metadata_removed"] == ["note"]
    assert found["metadata_changed"] == {"format": ["np", "pt"]}
    assert found["content_differs"] == ["model.embed_tokens.weight"]
    text = run("diff", str(model), str(other))
    assert text.returncode == 1 and "+ extra" in text.stdout


def test_validate_finds_nan_inf_and_expectations(tmp_path: Path) -> None:
    crafted: dict[str, np.ndarray[Any, Any]] = {
        "model.layers.0.q_proj.weight": np.array([1.0, np.nan, 2.0, np.nan], dtype=np.float32),
        "model.layers.0.k_proj.weight": np.array([np.inf, -np.inf, 0.5], dtype=np.float16),
        "model.layers.1.q_proj.weight": np.zeros(4, dtype=np.float32),
        "model.layers.1.k_proj.weight": np.array([1, 2], dtype=np.int8),
    }
    path = tmp_path / "crafted.safetensors"
    reference_numpy.save_file(crafted, str(path))
    result = run("validate", "--json", str(path))
    assert result.returncode == 1
    found = json.loads(result.stdout)
    stats = {t["name"]: t for t in found["tensors"]}
    assert stats["model.layers.0.q_proj.weight"]["nan"] == 2
    assert stats["model.layers.0.q_proj.weight"]["min"] == 1.0
    assert stats["model.layers.0.k_proj.weight"]["inf"] == 2
    assert stats["model.layers.1.k_proj.weight"]["mean"] == 1.5
    assert any("NaN" in e for e in found["errors"]) and any("Inf" in e for e in found["errors"])
    assert any("all zeros" in w for w in found["warnings"])
    clean = {
        "a.layers.0.q_proj": np.ones(3, np.float32),
        "a.layers.0.k_proj": np.ones(2, np.float32),
    }
    good = tmp_path / "good.safetensors"
    reference_numpy.save_file(clean, str(good))
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"a.layers.0.q_proj": [3], "a.layers.0.k_proj": [2]}))
    ok = run(
        "validate", "--expect-shapes", str(shapes), "--expect-layers", "q_proj,k_proj", str(good)
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "valid: 2 tensors, 0 errors" in ok.stdout
    shapes.write_text(json.dumps({"a.layers.0.q_proj": [4]}))
    wrong = run("validate", "--expect-shapes", str(shapes), "--expect-layers", "v_proj", str(good))
    assert wrong.returncode == 1
    assert "expected [4]" in wrong.stdout and "no tensor for v_proj" in wrong.stdout
    shapes.write_text('{"a.layers.0.q_proj": [4], "a.layers.0.q_proj": [3]}')  # the last won
    twice = run("validate", "--expect-shapes", str(shapes), str(good))
    assert twice.returncode == 2 and "duplicate key 'a.layers.0.q_proj'" in twice.stderr


def test_errors_are_one_line_with_exit_status_2(tmp_path: Path) -> None:
    missing = run("inspect", str(tmp_path / "nope.safetensors"))
    assert missing.returncode == 2
    assert missing.stderr.count("\n") == 1 and "nope.safetensors" in missing.stderr
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00[]")
    result = run("validate", str(bad))
    assert result.returncode == 2 and "begin with '{'" in result.stderr
    assert run("frobnicate").returncode == 2


LIMIT_OPTIONS = [
    ["--timeout", "nan"],
    ["--timeout", "-1"],
    ["--timeout", "soon"],
    ["--deadline", "nan"],
    ["--deadline", "-2"],
    ["--speed-limit", "inf"],
    ["--speed-limit", "-5"],
    ["--speed-time", "0"],
    ["--speed-time", "inf"],
]
COMMAND_LINES = {
    "inspect": ["inspect", "{model}"],
    "hash": ["hash", "--content", "{model}"],
    "diff": ["diff", "--content", "{model}", "{model}"],
    "validate": ["validate", "{model}"],
    "cp": ["cp", "{model}", "{out}"],
    "demo": ["demo", "--synthetic", "--layers", "1", "--seq", "8", "--codecs", "none"],
}
OTHER_BAD_VALUES = [
    ["demo", "--synthetic", "--seq", "0"],
    ["demo", "--synthetic", "--seq", "x"],
    ["demo", "--synthetic", "--layers", "0"],
    ["demo", "--synthetic", "--layers", "-3"],
    ["demo", "--synthetic", "--codecs", ","],
    ["demo", "--synthetic", "--codecs", "none,NONE"],
    ["demo", "--synthetic", "--codecs", "int3"],
    ["validate", "--warn-abs", "nan", "{model}"],
    ["validate", "--warn-abs", "-1", "{model}"],
    ["cp", "--dtype", "f64", "{model}", "{out}"],
    ["inspect"],
    ["demo", "--synthetic", "--text", "{model}"],  # were ignored
    ["demo", "--synthetic", "--context", "99999"],
    ["cache", "ls", "--dir", "{model}"],  # a file: listed as an empty cache
    ["cache", "rm", "--dir", "{model}", "*"],
]


def _status_and_stderr(
    argv: list[str], capsys: pytest.CaptureFixture[str], **paths: Path
) -> tuple[int, str]:
    """Run the command in this process: its exit status and what it wrote to stderr."""
    try:
        status = main([arg.format(**paths) for arg in argv])
    except SystemExit as exc:  # argparse leaves through exit()
        status = int(exc.code or 0)
    return status, capsys.readouterr().err


@pytest.mark.parametrize("option", LIMIT_OPTIONS, ids=" ".join)
@pytest.mark.parametrize("command", COMMAND_LINES)
def test_bad_limit_values_exit_2_with_one_line(
    command: str,
    option: list[str],
    model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "out.safetensors"
    argv = [*COMMAND_LINES[command], *option]
    status, stderr = _status_and_stderr(argv, capsys, model=model, out=out)
    assert (status, stderr.count("\n")) == (2, 1), stderr
    assert stderr.startswith("stream-st") and "error" in stderr
    assert not out.exists()


@pytest.mark.parametrize("argv", OTHER_BAD_VALUES, ids=" ".join)
def test_bad_option_values_exit_2_with_one_line(
    argv: list[str], model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.safetensors"
    status, stderr = _status_and_stderr(argv, capsys, model=model, out=out)
    assert (status, stderr.count("\n")) == (2, 1), stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["validate", "--expect-layers", ",,", "{model}"],
        ["validate", "--expect-layers", "", "{model}"],
        ["demo", "--synthetic", "--layers", "1", "--seq", "8", "--codecs", ""],
    ],
    ids=" ".join,
)
def test_an_empty_list_is_refused(
    argv: list[str], model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--expect-layers ,,`` checked nothing and ``--codecs ''`` ran the default codecs, both
    silently: a list naming nothing is refused, naming the option."""
    status, stderr = _status_and_stderr(argv, capsys, model=model)
    assert (status, stderr.count("\n")) == (2, 1), stderr
    option = next(arg for arg in argv if arg in ("--expect-layers", "--codecs"))
    assert f"argument {option}: names nothing" in stderr


def test_expect_shapes_takes_minus_zero_for_zero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--expect-shapes '{"z": [-0, 3]}'`` was refused as "a dimension must be an integer >= 0,
    got -0" (the strict reader keeps -0 apart from 0); it is the integer 0, as json.loads reads
    it, where -0.0 is still no integer."""
    path = tmp_path / "empty.safetensors"
    reference_numpy.save_file({"z": np.zeros((0, 3), np.float32)}, str(path))
    shapes = tmp_path / "shapes.json"
    shapes.write_text('{"z": [-0, 3]}')
    argv = ["validate", "-q", "--expect-shapes", "{shapes}", "{path}"]
    assert _status_and_stderr(argv, capsys, shapes=shapes, path=path) == (0, "")
    shapes.write_text('{"z": [-0.0, 3]}')
    status, stderr = _status_and_stderr(argv, capsys, shapes=shapes, path=path)
    assert status == 2 and "must be an integer >= 0, got -0.0" in stderr


def test_a_list_takes_spaces_after_its_commas(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--expect-layers 'q_proj, k_proj'`` failed every layer for lacking `` k_proj`` and
    ``--codecs 'none, int8'`` refused `` int8``: each name is stripped, as the check that a
    list names something strips it."""
    argv = ["validate", "-q", "--expect-layers", "q_proj, k_proj ,", str(model)]
    assert main(argv) == 0, capsys.readouterr().out
    assert "valid: 3 tensors, 0 errors" in capsys.readouterr().out
    parsed = build_parser().parse_args(["demo", "--synthetic", "--codecs", " none, int8 "])
    assert parsed.codecs == ("none", "int8")


@pytest.mark.parametrize("option", [["--token", ""], ["--host", ""]], ids=["token", "host"])
def test_serve_refuses_an_empty_token_or_host(option: list[str], model: Path) -> None:
    """``--token "$TOKEN"`` with the variable unset served with no token at all (the library
    refuses an empty one); ``--host ""`` listened on every interface. Both served until
    stopped: the timeout ends them."""
    env = {k: v for k, v in os.environ.items() if k != "STREAM_ST_SERVE_TOKEN"}
    result = subprocess.run(
        [COMMAND, "serve", str(model), "--port", "0", *option],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert f"argument {option[0]}: empty" in result.stderr and result.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("option", "said"),
    [
        (["--port", "99999"], "must be in 0-65535 (0: any free port), got 99999"),
        (["--port", "-1"], "must be in 0-65535 (0: any free port), got -1"),
        (["--port", "http"], "not an integer: 'http'"),
        (["--name", "a/b"], "must be a plain file name in UTF-8, without '/'"),
        (["--name", ""], "must be a plain file name"),
    ],
    ids=["port too big", "port negative", "port not a number", "name with a slash", "name empty"],
)
def test_serve_refuses_a_bad_port_or_name_before_reading_the_source(
    option: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``serve --port 99999 bad.safetensors`` reported the file's header error (a good file's:
    ``port must be ...``, not naming ``--port``), and ``--name a/b`` was refused as ``name must
    be ...``: both are refused as the command line is parsed, naming the option."""
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"garbage")
    status, stderr = _status_and_stderr(["serve", str(bad), *option], capsys)
    assert status == 2 and f"argument {option[0]}: {said}" in stderr, stderr
    assert "bad.safetensors" not in stderr and stderr.count("\n") == 1


def test_limits_reach_the_command(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["validate", "--deadline", "0", "{model}"]
    status, stderr = _status_and_stderr(argv, capsys, model=model)
    assert status == 2 and "deadline of 0 s passed" in stderr
    argv = ["inspect", "--timeout", "5", "--deadline", "60", "--speed-limit", "1", "{model}"]
    assert _status_and_stderr(argv, capsys, model=model) == (0, "")


@pytest.mark.parametrize("tensors", [3, 3000], ids=["in the flush at exit", "mid-output"])
def test_closed_output_pipe_exits_quietly(tmp_path: Path, tensors: int) -> None:
    path = tmp_path / "many.safetensors"
    reference_numpy.save_file({f"t{i:05d}": np.zeros(1, np.uint8) for i in range(tensors)}, path)
    read_end, write_end = os.pipe()
    os.close(read_end)  # as `| head -1` does once it has its line
    try:
        result = subprocess.run(
            [COMMAND, "inspect", str(path)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (141, "")


@pytest.mark.parametrize("taken", [0, 100], ids=["before the first byte", "mid-copy"])
def test_cp_to_a_closed_output_pipe_exits_quietly(tmp_path: Path, taken: int) -> None:
    """``stream-st cp f.st - | head -c 100``: 141 and nothing on stderr, as the other commands."""
    path = tmp_path / "big.safetensors"
    reference_numpy.save_file({"t": np.zeros(1 << 18, np.float32)}, path)  # 1 MiB: the pipe fills
    process = subprocess.Popen(
        [COMMAND, "cp", "-q", str(path), "-"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert process.stdout is not None and process.stderr is not None
    assert len(process.stdout.read(taken)) == taken
    process.stdout.close()  # as `head` does once it has its bytes
    try:
        assert (process.wait(timeout=120), process.stderr.read()) == (141, b"")
    finally:
        process.kill()
        process.stderr.close()


STDOUT_COMMANDS = [
    ["inspect", "{model}"],
    ["ls", "{model}"],
    ["show", "{model}", "model.embed_tokens.weight"],
    ["hash", "{model}"],
    ["hash", "-c", "{sums}"],
    ["validate", "-q", "{model}"],
    ["diff", "{model}", "{model}"],
    ["cp", "-q", "--json", "{model}", "{out}"],
    ["cp", "-q", "{model}", "-"],
    ["cache", "ls", "--dir", "{cache}"],
    ["--help"],
]


@pytest.mark.parametrize("stdout", ["full", "closed"])
@pytest.mark.parametrize("argv", STDOUT_COMMANDS, ids=" ".join)
def test_output_that_cannot_be_written_is_an_error_with_exit_status_2(
    argv: list[str], stdout: str, model: Path, tmp_path: Path
) -> None:
    """Standard output on a full disk (``> /dev/full``) or closed (``>&-``): one line naming
    it, exit status 2 (it was an internal error's traceback, exit 3, or the cache's error)."""
    if stdout == "full" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    sums = tmp_path / "sums"
    sums.write_text(f"{hashlib.sha256(model.read_bytes()).hexdigest()}  {model}\n")
    (tmp_path / "c").mkdir()  # an empty cache, listed
    paths = {"model": model, "sums": sums, "out": tmp_path / "out", "cache": tmp_path / "c"}
    args = [arg.format(**paths) for arg in argv]
    redirect = "> /dev/full" if stdout == "full" else ">&-"
    result = subprocess.run(
        ["sh", "-c", f'"$@" {redirect}', "sh", COMMAND, *args],
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )
    reason = "No space left on device" if stdout == "full" else "Bad file descriptor"
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    # cp's own write to standard output says where it stopped (it said "write failed: ...")
    where = ", at byte 0" if argv[-1] == "-" and stdout == "full" else ""
    assert result.stderr == f"stream-st: error: cannot write standard output: {reason}{where}\n"


def test_unexpected_exception_is_an_internal_error_with_exit_status_3(
    model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def broken(*args: Any, **kwargs: Any) -> None:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(commands, "headers_of", broken)
    assert main(["inspect", str(model)]) == 3
    stderr = capsys.readouterr().err
    assert "Traceback" in stderr and "ZeroDivisionError: a bug" in stderr
    assert stderr.rstrip().endswith(
        "stream-st: internal error (a bug, please report it with the traceback above)"
    )
    assert "3 internal error" in build_parser().format_help()


def test_cp_checksums_help_says_a_sources_digests_are_kept(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``cp --help`` said --checksums records "each tensor's digest (xxh3-128)", where a
    source's digests are kept, of its algorithm, xxh3-128 only for a source without."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["cp", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert "a source's digests kept, of its algorithm; xxh3-128 for a source without" in said


async def test_content_hash_of_a_truncated_stream_raises_our_error(model: Path) -> None:
    data = model.read_bytes()[:-10]

    async def chunks() -> AsyncIterator[bytes]:
        for at in range(0, len(data), 4096):
            yield data[at : at + 4096]

    with pytest.raises(stream_st.TruncatedStreamError):
        await content_digests(chunks())  # hashing runs beside the reading, in a task group


def test_cp_round_trip_conversion_and_quantization(model: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy.safetensors"
    result = run("cp", str(model), str(copy))
    assert result.returncode == 0, result.stderr
    assert copy.read_bytes() == model.read_bytes()  # byte-exact
    bf16 = tmp_path / "bf16.safetensors"
    assert run("cp", "--dtype", "bf16", str(model), str(bf16)).returncode == 0
    found = json.loads(run("inspect", "--json", str(bf16)).stdout)
    dtypes = {t["name"]: t["dtype"] for t in found["tensors"]}
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == "BF16"
    assert dtypes["model.embed_tokens.weight"] == "I32"  # not floating point: unchanged
    assert "converted_to" in found["metadata"]
    q8 = tmp_path / "q8.safetensors"
    only = "model.layers.0.self_attn.q_proj.weight"
    assert run("cp", "--quantize", "int8", "--include", only, str(model), str(q8)).returncode == 0
    quantized = reference_numpy.load_file(str(q8))
    assert sorted(quantized) == [only, only + ".scale"]
    scale = quantized[only + ".scale"][0]
    assert scale == np.float32(127 / 15)
    np.testing.assert_allclose(quantized[only] / scale, TENSORS[only], atol=0.5 / scale)


def test_cp_conversions_refused_together_name_the_options(model: Path, tmp_path: Path) -> None:
    """The command said 'choose one of dtype=, quantize= and dequantize=': Python's keywords,
    not its options."""
    result = run("cp", "--quantize", "int8", "--dtype", "bf16", str(model), str(tmp_path / "q"))
    assert result.returncode == 2
    assert "choose one of --dtype, --quantize and --dequantize" in result.stderr
    assert not (tmp_path / "q").exists()


def test_cp_reports_its_read_with_stats_and_json(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "copy.safetensors"
    assert main(["cp", "-q", "--stats", str(model), str(copy)]) == 0
    out, err = capsys.readouterr()
    assert out == "" and re.fullmatch(r"load: 3 tensors, .* waited [0-9.]+ s\n", err)
    assert main(["cp", "--json", "--stats", str(model), str(copy)]) == 0
    out, err = capsys.readouterr()
    record = json.loads(out)
    assert record["tensors"] == 3 and record["bytes"] == model.stat().st_size
    assert record["load"]["bytes_read"] == model.stat().st_size and "load" not in err
    assert main(["cp", "--json", str(model), "-"]) == 2
    assert "--json prints to standard output" in capsys.readouterr().err


def test_cp_between_servers_and_interrupted_copy(model: Path, tmp_path: Path) -> None:
    with RangeHTTPServer(objects={"/m.safetensors": model.read_bytes()}) as server:
        assert (
            run("cp", server.url("/m.safetensors"), server.url("/up.safetensors")).returncode == 0
        )
        assert server.objects["/up.safetensors"] == model.read_bytes()
        server.close_after = model.stat().st_size - 10  # the source breaks in the last tensor
        server.no_range = True
        target = tmp_path / "broken.safetensors"
        failed = run("cp", server.url("/m.safetensors"), str(target))
    assert failed.returncode == 2
    assert not target.exists() and list(tmp_path.iterdir()) == [model]


def _run_with_stdin(
    args: list[str], data: bytes, *, terminal: bool, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    """The command with ``data`` piped to its stdin; stderr a terminal (a progress bar is drawn)
    or a pipe, its text in the result; ``env`` added to the environment."""
    reader, writer = os.openpty() if terminal else os.pipe()
    try:
        result = subprocess.run(
            [COMMAND, *args],
            input=data,
            stdout=subprocess.PIPE,
            stderr=writer,
            timeout=120,
            env={**os.environ, **(env or {})},
        )
        os.close(writer)
        writer = -1
        chunks = []
        with contextlib.suppress(OSError):  # a terminal's end reads EIO once drained
            while chunk := os.read(reader, 1 << 16):
                chunks.append(chunk)
        result.stderr = b"".join(chunks)
        return result
    finally:
        if writer >= 0:
            os.close(writer)
        os.close(reader)


@pytest.mark.parametrize("terminal", [False, True], ids=["no bar", "progress bar"])
def test_commands_read_a_pipe_once(model: Path, tmp_path: Path, terminal: bool) -> None:
    """The progress bar's totals are looked up by reading the header first; a pipe gives its
    bytes once, so that look-up took the header the command itself then missed."""
    data = model.read_bytes()
    content_line = run("hash", "--content", str(model)).stdout.splitlines()[1]
    out = tmp_path / "copy.safetensors"
    for args, want in [
        (["validate", "/dev/stdin"], b"valid: 3 tensors"),
        (["hash", "--content", "/dev/stdin"], content_line.split()[1].encode()),
        (["diff", "--content", "/dev/stdin", str(model)], b"equal (content compared)"),
        (["cp", "/dev/stdin", str(out)], b""),
    ]:
        result = _run_with_stdin(args, data, terminal=terminal)
        assert result.returncode == 0 and want in result.stdout, (args, result)
    assert out.read_bytes() == data


async def test_diff_content_reads_each_source_once(model: Path) -> None:
    """tools.diff(content=True) compares the headers and then the bytes of the same open
    streams: an async iterator of chunks is read once, never a second time from its middle."""
    data = model.read_bytes()

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(data), 100):
            yield data[start : start + 100]

    result = await tools.diff(chunks(), str(model), content=True)
    assert result.equal and result.content_compared


def test_the_progress_bar_makes_no_request_of_its_own(model: Path) -> None:
    """The bar takes its totals from the header the command reads: with a bar, validate makes
    the same requests as without one (each answer takes 1 s: a look-up of its own would pass
    the deadline of 1.5 s)."""
    with RangeHTTPServer(objects={"/model.safetensors": model.read_bytes()}, latency=1.0) as server:
        args = ["validate", "--deadline", "1.5", server.url("/model.safetensors")]
        result = _run_with_stdin(args, b"", terminal=True)
        with_bar = len(server.requests)
        assert run(*args).returncode == 0
        without_bar = len(server.requests) - with_bar
    assert result.returncode == 0 and b"3/3 tensors" in result.stderr, result
    assert with_bar == without_bar


@pytest.mark.parametrize(
    ("text", "index"),
    [
        ("...,1", (..., 1)),
        ("1,...", (1, ...)),
        ("0,...,-1", (0, ..., -1)),
        ("...,0:2", (..., slice(0, 2))),
        ("...", (...,)),
        ("0,1,2,...", (0, 1, 2, ...)),
    ],
)
def test_show_slice_takes_an_ellipsis_as_numpy_does(
    text: str, index: tuple[Any, ...], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--slice`` took ints and slices only; ``...`` (as the reference's ``get_slice`` and
    numpy take it) was "expected numpy-style indices"."""
    values = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    path = tmp_path / "b.safetensors"
    reference_numpy.save_file({"b": values}, str(path))
    assert main(["show", "--json", str(path), "b", f"--slice={text}"]) == 0
    assert json.loads(capsys.readouterr().out)["values"] == values[index].tolist()


def test_show_slice_after_an_ellipsis_is_checked_against_the_last_axes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "b.safetensors"
    reference_numpy.save_file({"b": np.zeros((2, 3, 4), np.int8)}, str(path))
    assert main(["show", str(path), "b", "--slice=...,4"]) == 2
    assert "index 4 is out of range for axis 2 of size 4" in capsys.readouterr().err
    # more indices than axes: said so, where an axis before the first was named
    assert main(["show", str(path), "b", "--slice=...,1,2,3,4"]) == 2
    err = capsys.readouterr().err
    assert "too many indices" in err and "out of range" not in err, err


def test_cache_ls_and_rm_escape_an_address(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``cache ls`` and ``cache rm`` printed a copy's address as it was: an escape sequence or
    a bidirectional override in it reached the terminal (validate showed it escaped)."""
    cache = str(tmp_path / "c")
    objects = {"/e%1B[31m%E2%80%AEred.safetensors": model.read_bytes()}
    with RangeHTTPServer(objects=objects, etag="strong") as running:
        url = running.url("/e\x1b[31m\u202ered.safetensors")
        assert main(["validate", "-q", "--cache-dir", cache, url]) == 0
    capsys.readouterr()
    assert main(["cache", "ls", "--dir", cache]) == 0
    listed = capsys.readouterr().out
    assert main(["cache", "rm", "--all", "--dir", cache]) == 0
    removed = capsys.readouterr().out
    for out in (listed, removed):
        assert "\x1b" not in out and "\u202e" not in out, out
        assert "/e\\x1b[31m\\u202ered.safetensors" in out, out


def test_cache_rm_takes_an_address_as_ls_lists_it(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``cache ls`` shows a backslash doubled (and escapes a control character): ``cache rm``
    of the address so listed matched nothing, only the raw one did."""
    cache = str(tmp_path / "c")
    with RangeHTTPServer(objects={"/a%5Cb.safetensors": model.read_bytes()}) as running:
        url = running.url("/a\\b.safetensors")
        assert main(["validate", "-q", "--cache-dir", cache, url]) == 0
    capsys.readouterr()
    assert main(["cache", "ls", "--dir", cache]) == 0
    listed = capsys.readouterr().out.splitlines()[1].split()[0]
    assert listed.endswith("/a\\\\b.safetensors"), listed
    assert main(["cache", "rm", "--dir", cache, listed]) == 0
    assert "removed" in capsys.readouterr().out


def test_cache_rm_takes_an_address_with_brackets_as_it_is(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``cache rm`` read ``[1]`` in a pattern as a class (fnmatch's): the address of
    ``a[1].safetensors`` (or of any IPv6 host) as ``cache ls`` lists it matched not itself but
    ``a1.safetensors``. Only ``*`` and ``?`` are wildcards."""
    cache = str(tmp_path / "c")
    objects = {"/a[1].safetensors": model.read_bytes(), "/a1.safetensors": model.read_bytes()}
    with RangeHTTPServer(objects=objects, etag="strong") as running:
        bracketed, plain = running.url("/a[1].safetensors"), running.url("/a1.safetensors")
        for url in (bracketed, plain):
            assert main(["validate", "-q", "--cache-dir", cache, url]) == 0
    capsys.readouterr()

    def listed() -> list[str]:
        assert main(["cache", "ls", "--json", "--dir", cache]) == 0
        return [json.loads(line)["address"] for line in capsys.readouterr().out.splitlines()]

    assert sorted(listed()) == sorted([bracketed, plain])
    assert main(["cache", "rm", "--dir", cache, bracketed]) == 0
    assert capsys.readouterr().out == f"removed {bracketed} (456 B)\n"
    assert listed() == [plain]
    assert main(["cache", "rm", "--dir", cache, "*/a?.safetensors"]) == 0
    assert capsys.readouterr().out == f"removed {plain} (456 B)\n"
    assert listed() == []


def test_cache_prune_names_its_option_and_takes_it_over_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--max-size abc`` said "not a size" without naming the option, and a bad
    ``STREAM_ST_CACHE_MAX`` refused ``--max-size 1G``, which overrides it."""
    cache = str(tmp_path / "c")
    os.mkdir(cache)
    status, stderr = _status_and_stderr(["cache", "prune", "--max-size", "abc"], capsys)
    assert status == 2 and "argument --max-size: not a size: 'abc'" in stderr, stderr
    monkeypatch.setenv("STREAM_ST_CACHE_MAX", "abc")
    assert main(["cache", "prune", "--dir", cache, "--max-size", "1G"]) == 0
    assert capsys.readouterr().out == "removed 0 copies, 0 B\n"
    status, stderr = _status_and_stderr(["cache", "prune", "--dir", cache], capsys)
    assert status == 2 and "STREAM_ST_CACHE_MAX in the environment" in stderr, stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["cache", "rm", "--all", "--dir", ""],
        ["cache", "--dir", "", "rm", "--all"],
        ["cache", "ls", "--cache-dir", ""],
        ["validate", "-q", "--cache-dir", "", "{url}"],
    ],
    ids=" ".join,
)
def test_an_empty_cache_dir_is_refused(
    argv: list[str],
    model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--cache-dir ''`` (``--dir "$DIR"`` with the variable unset) was taken as no option:
    ``cache rm --all --dir ''`` emptied the default cache, ``--cache-dir ''`` read with no
    cache; it is refused, as an empty ``--endpoint-url`` is, and the default cache is kept."""
    monkeypatch.setenv("STREAM_ST_CACHE", str(tmp_path / "default"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    with RangeHTTPServer(objects={"/m.safetensors": model.read_bytes()}) as running:
        url = running.url("/m.safetensors")
        assert main(["validate", "-q", "--cache", url]) == 0
        status, stderr = _status_and_stderr([arg.replace("{url}", url) for arg in argv], capsys)
    assert status == 2, stderr
    assert "--cache-dir: empty (an unset variable?)" in stderr, stderr
    assert main(["cache", "ls", "--json"]) == 0
    assert [json.loads(line)["address"] for line in capsys.readouterr().out.splitlines()] == [url]


@pytest.mark.parametrize(
    "argv",
    [
        ["cache", "ls", "--dir", "{missing}"],
        ["cache", "--cache-dir", "{missing}", "ls", "--json"],
        ["cache", "rm", "--all", "--dir", "{missing}"],
        ["cache", "rm", "--dir", "{missing}", "http://*"],
        ["cache", "prune", "--max-size", "1G", "--dir", "{missing}"],
    ],
    ids=" ".join,
)
def test_a_cache_dir_that_does_not_exist_is_refused(
    argv: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``cache ls --dir DIR`` of a directory that does not exist (a mistyped one) said "0
    copies", exit 0, as ``prune`` said "removed 0 copies" and ``rm`` that nothing matched: it is
    refused, naming it, exit 2. The default cache, never used yet, still lists 0 copies."""
    missing = tmp_path / "missing"
    status, stderr = _status_and_stderr(argv, capsys, missing=missing)
    assert status == 2 and stderr == f"stream-st: error: --dir {missing}: no such directory\n"
    assert not missing.exists()
    monkeypatch.setenv("STREAM_ST_CACHE", str(tmp_path / "default"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    assert main(["cache", "ls"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("0 copies, 0 B in ")


def test_show_maps_a_local_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """show read the whole tensor into new memory to print a few of its values: --slice 0:3 of
    a 3 GiB tensor took 13 s and 3 GiB; a local file's tensor is mapped, and only what is
    printed copied out of the file (by positioned reads: a truncation meanwhile is an error, not
    a SIGBUS)."""
    path = tmp_path / "m.safetensors"
    reference_numpy.save_file({"x": np.arange(1 << 20, dtype=np.int32)}, str(path))
    shown: list[np.ndarray[Any, Any]] = []
    real = output.show_values

    def recorded(args: Any, info: Any, array: np.ndarray[Any, Any]) -> None:
        shown.append(array)
        real(args, info, array)

    monkeypatch.setattr(commands, "show_values", recorded)
    assert main(["show", "--json", str(path), "x", "--slice", "2:5"]) == 0
    assert json.loads(capsys.readouterr().out)["values"] == [2, 3, 4]
    assert len(shown) == 1 and shown[0].shape == (3,)  # the slice alone, copied out of the file
