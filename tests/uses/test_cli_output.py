"""What the command prints: checksummed files in one line, every failing tensor, counts in
agreement, metadata values in diffs, ``show --json``'s values, text on a standard output that is
not UTF-8."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import anyio
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st.cli import main
from stream_st.cli.output import failed, human

from ..servers.http_server import RangeHTTPServer
from ._cli import COMMAND, run, write_model


def _checksummed(tmp_path: Path) -> Path:
    tmp_path.mkdir(exist_ok=True)
    tensors = {f"t{i}": np.full(64, i, np.float32) for i in range(4)}
    plain = write_model(tmp_path / "plain.safetensors", tensors)
    copy = tmp_path / "sums.safetensors"
    assert run("cp", "-q", "--checksums", str(plain), str(copy)).returncode == 0
    return copy


def test_inspect_folds_the_digests_into_one_line(tmp_path: Path) -> None:
    copy = _checksummed(tmp_path)
    text = run("inspect", str(copy)).stdout
    assert "stream_st.digest" not in text, text
    assert text.count("checksummed: xxh3-128 digests of 4 tensors, one each (checked as read)") == 1
    found = json.loads(run("inspect", "--json", str(copy)).stdout)  # all of it for scripts
    assert sum(k.startswith("stream_st.digest:") for k in found["metadata"]) == 4


def test_inspect_judges_each_shards_digests_on_its_own(tmp_path: Path) -> None:
    """A sharded source's merged metadata labels a digest (or algorithm) differing between
    shards ``key (shard N)``: a sound checksummed dataset showed as a damaged record, and shards
    of two algorithms as digests no read can check, the algorithm keys listed as metadata. Each
    shard's record is judged on its own, the algorithms and counts summed."""

    async def dataset() -> None:
        path = tmp_path / "d"
        async with stream_st.open_dataset_writer(path, target_shard_size=1, checksums=True) as w:
            for shard in range(2):
                await w.write_batch({"x": np.full(4, shard, np.float32)}, samples=4)

    async def mixed() -> None:
        await stream_st.save(tmp_path / "m" / "m-1.safetensors", {"a": np.ones(4)}, checksums=True)
        await stream_st.save(
            tmp_path / "m" / "m-2.safetensors", {"b": np.ones(4)}, checksums="sha256"
        )

    anyio.run(dataset)
    (tmp_path / "m").mkdir()
    anyio.run(mixed)
    index = {"weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors"}}
    (tmp_path / "m" / "m.safetensors.index.json").write_text(json.dumps(index))
    for source, said in [
        (tmp_path / "d" / "dataset_manifest.json", "xxh3-128 digests of 2 tensors"),
        (tmp_path / "m", "xxh3-128 and sha256 digests of 2 tensors"),
    ]:
        text = run("inspect", str(source)).stdout
        assert f"checksummed: {said}, one each (checked as read)" in text, text
        assert "stream_st." not in text, text


def test_validate_reports_every_tensor_failing_its_digest(tmp_path: Path) -> None:
    copy = _checksummed(tmp_path)
    header = anyio.run(stream_st.read_header, copy)
    data = bytearray(copy.read_bytes())
    for name in ("t1", "t3"):  # two tensors damaged: both named, every tensor reported
        data[header.data_start + header[name].start] ^= 0x01
    copy.write_bytes(bytes(data))
    result = run("validate", "--json", str(copy))
    assert result.returncode == 1
    found = json.loads(result.stdout)
    assert [t["name"] for t in found["tensors"]] == ["t0", "t1", "t2", "t3"]
    assert sum("does not match" in e for e in found["errors"]) == 2, found["errors"]
    assert "FAILED" in found["digests"]
    assert "valid" in run("validate", str(_checksummed(tmp_path / "x"))).stdout


def test_validate_names_a_tensor_failing_its_digest_as_its_other_findings(tmp_path: Path) -> None:
    """A tensor failing its digest was named by the read's error, quoted as ``repr`` quotes it,
    then escaped as validate's findings are: the name a\\b showed as 'a\\\\\\\\b', a repr of a
    repr. It is named as the table and the other findings name it, unquoted, once escaped."""
    names = ["a\\b", "q'\"x"]
    plain = write_model(tmp_path / "plain.safetensors", dict.fromkeys(names, np.ones(4)))
    copy = tmp_path / "sums.safetensors"
    assert run("cp", "-q", "--checksums", str(plain), str(copy)).returncode == 0
    header = anyio.run(stream_st.read_header, copy)
    data = bytearray(copy.read_bytes())
    for name in names:
        data[header.data_start + header[name].start] ^= 0x01
    copy.write_bytes(bytes(data))
    lines = run("validate", str(copy)).stdout.splitlines()
    for shown in ("a\\\\b", "q'\"x"):
        assert any(
            line.startswith(f"error: {shown}: does not match its xxh3-128 digest (")
            for line in lines
        ), lines
    found = json.loads(run("validate", "--json", str(copy)).stdout)["errors"]
    assert sorted(error.split(": does not match")[0] for error in found) == sorted(names)


def test_counts_agree_with_their_nouns(tmp_path: Path) -> None:
    path = write_model(
        tmp_path / "one.safetensors",
        {"inf": np.array([np.inf, 1.0], np.float32), "same": np.full(2, 3.0, np.float32)},
    )
    text = run("validate", str(path)).stdout
    assert "inf: 1 Inf value\n" in text and "1 Inf values" not in text
    assert "INVALID: 2 tensors, 1 error, 1 warning\n" in text, text


def test_diff_shows_metadata_values(tmp_path: Path) -> None:
    tensors = {"w": np.zeros(2, np.float32)}
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    reference_numpy.save_file(tensors, str(a), metadata={"gone": "old value", "same": "x"})
    reference_numpy.save_file(tensors, str(b), metadata={"new": "new value", "same": "y"})
    text = run("diff", str(a), str(b))
    assert text.returncode == 1
    assert "+ metadata new: 'new value'" in text.stdout
    assert "- metadata gone: 'old value'" in text.stdout
    assert "~ metadata same: 'x' -> 'y'" in text.stdout
    found = json.loads(run("diff", "--json", str(a), str(b)).stdout)
    assert found["metadata_values"] == {"gone": "old value", "new": "new value"}


def _two_shards(directory: Path, metadata: list[dict[str, str]]) -> Path:
    """A checkpoint of two shards in ``directory``, shard N's ``__metadata__`` ``metadata[N]``."""
    directory.mkdir()
    names = [f"model-0000{n}-of-00002.safetensors" for n in (1, 2)]
    for n, (name, meta) in enumerate(zip(names, metadata, strict=True)):
        reference_numpy.save_file({f"w{n}": np.zeros(2, np.float32)}, str(directory / name), meta)
    index = {"metadata": {}, "weight_map": {"w0": names[0], "w1": names[1]}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def test_diff_compares_a_metadata_key_shard_by_shard_where_its_shards_differ(
    tmp_path: Path,
) -> None:
    """Each side's shards' metadata were merged, the last shard's value winning: checkpoints
    whose first shards said note=alpha and note=beta were "equal". A key whose value differs
    between a side's shards is compared shard by shard, as tensors a dataset repeats are; a
    key of one value is compared by itself, whichever shard holds it."""
    a = _two_shards(tmp_path / "a", [{"note": "alpha", "k": "v"}, {"note": "same"}])
    b = _two_shards(tmp_path / "b", [{"note": "beta"}, {"note": "same", "k": "v"}])
    text = run("diff", str(a), str(b))
    assert (text.returncode, text.stdout) == (1, "~ metadata note (shard 0): 'alpha' -> 'beta'\n")
    found = json.loads(run("diff", "--json", str(a), str(b)).stdout)
    assert found["metadata_changed"] == {"note (shard 0)": ["alpha", "beta"]}
    assert not found["metadata_added"] and not found["metadata_removed"]
    c = _two_shards(tmp_path / "c", [{"note": "gamma"}, {"note": "gamma"}])
    text = run("diff", str(b), str(c))
    assert text.stdout.splitlines() == [
        "- metadata k: 'v'",
        "~ metadata note (shard 0): 'beta' -> 'gamma'",
        "~ metadata note (shard 1): 'same' -> 'gamma'",
    ]
    d = _two_shards(tmp_path / "d", [{"note": "gamma"}, {}])
    assert run("diff", str(c), str(d)).stdout == "equal\n"


def _as_json_wrote_it(values: np.ndarray[Any, Any]) -> Any:
    """The nested lists ``show --json`` wrote of a whole tensor, all at once: complex numbers
    as [real, imaginary], ml_dtypes' floats as float64, NaN and infinities as strings."""
    if values.dtype.kind == "c":
        values = np.stack([values.real, values.imag], axis=-1)
    elif values.dtype.kind == "V":
        values = values.astype(np.float64)

    def each(item: Any) -> Any:
        if isinstance(item, list):
            return [each(i) for i in item]
        return str(item) if isinstance(item, float) and not math.isfinite(item) else item

    return each(values.tolist())


SHOWN = {
    "special": np.array([1.5, np.nan, -0.0, np.inf, -np.inf], np.float32),
    "wide": np.arange(3 * 70_001, dtype=np.float32).reshape(3, 70_001) / 7,
    "long_rows": np.arange(2 * 70_000, dtype=np.float64).reshape(2, 70_000) / 3,
    "tall": np.arange(70_001 * 3, dtype=np.int64).reshape(70_001, 3) - 2**40,
    "cube": np.ones((3, 2, 40_000), np.float16),
    "pairs": (np.arange(70_003) + 1j * np.arange(70_003)).astype(np.complex64),
    "bf16": (np.arange(140_001) / 5).astype(ml_dtypes.bfloat16),
    "flags": np.arange(140_001) % 3 == 0,
    "big": np.array([2**64 - 1, 2**63], np.uint64),
    "empty": np.zeros((0, 3), np.float32),
    "empty_inside": np.zeros((3, 0, 2), np.float32),
    "scalar": np.array(2.5, np.float64),
}


def test_show_json_writes_the_values_as_it_did(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``show --json`` writes a tensor's values a run at a time, not all at once (see below),
    the same bytes as it wrote them all at once, whatever the shape or dtype, sliced or not."""
    path = write_model(tmp_path / "shown.safetensors", SHOWN)
    sliced: list[tuple[str, str, Any]] = [
        ("wide", "1", 1),
        ("wide", "::2,7:", (slice(None, None, 2), slice(7, None))),
        ("pairs", "3", 3),
    ]
    for name, slice_text, index in [(name, "", ()) for name in SHOWN] + sliced:
        flags = ["--slice", slice_text] if slice_text else []
        assert main(["show", "--json", *flags, str(path), name]) == 0
        values = SHOWN[name][index]
        record = {
            "name": name,
            "safetensors_dtype": stream_st.dtype_for(SHOWN[name].dtype).code,
            "tensor_shape": list(SHOWN[name].shape),
            "packed": False,
            "dtype": str(SHOWN[name].dtype),
            "shape": list(np.shape(values)),
            "values": _as_json_wrote_it(np.asarray(values)),
        }
        want = json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n"
        assert capsys.readouterr().out == want, (name, slice_text)


def test_show_json_holds_about_the_tensor_not_twenty_times_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The values of a whole tensor were made nested lists of Python numbers, then one JSON
    string: a 4 MB F32 tensor took some 90 MB (cli.md: a command holds about the largest tensor
    it reads). They are written a run at a time."""
    tensor = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)
    path = write_model(tmp_path / "w.safetensors", {"w": tensor, "small": tensor[:4]})
    written = tmp_path / "w.json"
    with written.open("w") as out:
        monkeypatch.setattr(sys, "stdout", out)
        assert main(["show", "--json", str(path), "small"]) == 0  # the modules it imports
        out.truncate(0)
        out.seek(0)
        tracemalloc.start()
        try:
            assert main(["show", "--json", str(path), "w"]) == 0
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert json.loads(written.read_text())["values"] == tensor.tolist()
    assert peak < 3 * tensor.nbytes, peak


@pytest.mark.parametrize(
    "env",
    [
        {"PYTHONIOENCODING": "ascii"},
        {"LC_ALL": "C", "PYTHONUTF8": "0"},
        {"PYTHONIOENCODING": "latin-1"},
    ],
    ids=["ascii", "C locale", "latin-1"],
)
def test_a_standard_output_not_utf8_gets_names_escaped(tmp_path: Path, env: dict[str, str]) -> None:
    """A name or value its encoding lacks ended the command in an internal error (exit 3, a
    traceback): text shows it escaped, as standard error does, and JSON in \\u escapes, exact."""
    names = {"café.w": np.zeros(1, np.float32), "€": np.ones(1, np.float32)}
    path = write_model(tmp_path / "cafe.safetensors", names)
    reference_numpy.save_file(names, str(path), metadata={"author": "Zoë €"})

    def output(*args: str) -> bytes:
        done = subprocess.run(
            [COMMAND, *args], capture_output=True, timeout=120, env={**os.environ, **env}
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    escaped = "café.w".encode("latin-1") if "latin-1" in env.values() else b"caf\\xe9.w"
    assert output("ls", str(path)) == escaped + b"\n\\u20ac\n"
    commands = [["inspect", "--json", str(path)], ["diff", "--json", str(path), str(path)]]
    if "LC_ALL" not in env:  # (a C locale reads a name in the arguments as ASCII)
        commands.append(["show", "--json", str(path), "€"])
    for args in commands:
        text = output(*args)
        assert text.isascii()
        record = json.loads(text)
        if args[0] == "inspect":
            assert [t["name"] for t in record["tensors"]] == sorted(names)
            assert record["metadata"] == {"author": "Zoë €"}
        elif args[0] == "show":
            assert record["name"] == "€" and record["values"] == [1.0]


def test_a_name_s_backslash_is_doubled_so_names_show_apart(tmp_path: Path) -> None:
    """Control characters were escaped, a backslash was not: the name ``a\\nb`` (a backslash)
    and ``a``, a newline, ``b`` showed alike in ls, diff and validate. Errors keep their names
    quoted as ``repr`` quotes them, backslashes doubled once."""
    literal, newline = "a\\nb", "a\nb"
    both = write_model(tmp_path / "both.safetensors", {literal: np.zeros(1), newline: np.ones(1)})
    assert run("ls", str(both)).stdout.splitlines() == ["a\\nb", "a\\\\nb"]
    one = write_model(tmp_path / "one.safetensors", {literal: np.zeros(1)})
    other = write_model(tmp_path / "other.safetensors", {newline: np.zeros(1)})
    assert run("diff", str(one), str(other)).stdout == "+ a\\nb\n- a\\\\nb\n"
    assert "a\\\\nb " in run("validate", str(both)).stdout
    missing = run("show", str(one), "no\\pe")
    assert "has no tensor 'no\\\\pe'" in missing.stderr


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (999, "999 B"),
        (999.4, "999 B"),
        (999.6, "1.0 kB"),
        (999_949, "999.9 kB"),
        (999_950, "1.0 MB"),
        (1_234_567, "1.2 MB"),
        (999_950_000_000, "1.0 TB"),
        (5 * 10**15, "5000.0 TB"),
    ],
)
def test_a_size_rounding_up_to_1000_takes_the_next_unit(size: float, text: str) -> None:
    """``human`` chose the unit before rounding: 999,950 bytes showed as ``1000.0 kB``, 999.6
    as ``1000 B``."""
    assert human(size) == text


def test_a_cache_that_cannot_be_used_is_one_warning_line(tmp_path: Path) -> None:
    """The cache's RuntimeWarning was printed as Python prints one: a file and line of
    stream_st's source, then that line of code."""
    model = write_model(tmp_path / "m.safetensors")
    blocker = tmp_path / "notadir"
    blocker.write_text("a file where the cache's folder would be")
    with RangeHTTPServer(objects={"/m.safetensors": model.read_bytes()}) as server:
        result = run("inspect", "--cache-dir", str(blocker / "c"), server.url("/m.safetensors"))
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith("stream-st: warning: the cache cannot be used (Not a dir")
    assert result.stderr.count("\n") == 1 and ".py:" not in result.stderr, result.stderr


def test_a_name_given_that_is_not_utf8_shows_its_bytes(tmp_path: Path) -> None:
    """A name on the command line holding a byte that is not UTF-8 showed in show's and cp
    --include's errors as repr writes Python's surrogate for it, '\\udcff', where a file name's
    byte shows as '\\xff'."""
    model = write_model(tmp_path / "m.safetensors")
    result = run("show", str(model), "bad\udcff")
    assert result.returncode == 2 and "has no tensor 'bad\\xff' (" in result.stderr, result.stderr
    result = run("cp", "--include", "\udcff", "--include", "a\\b", str(model), str(tmp_path / "o"))
    assert result.returncode == 2 and "header: ['a\\\\b', '\\xff'] (" in result.stderr
    result = run("show", str(model), "\\udcff")  # the name written so is a backslash and text
    assert "has no tensor '\\\\udcff' (" in result.stderr


def test_validate_s_findings_and_an_error_s_source_show_names_as_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """validate's warning and error lines, which name tensors unquoted, and the source's name an
    error line gives were escaped without a backslash doubled: the name a\\nb (a backslash) and
    a, a newline, b showed alike there, as nowhere else."""
    literal, newline = "a\\nb", "a\nb"
    model = write_model(
        tmp_path / "m.safetensors", {literal: np.zeros(2), newline: np.full(2, np.nan)}
    )
    lines = run("validate", str(model)).stdout.splitlines()
    assert "warning: a\\\\nb: all zeros" in lines and "error: a\\nb: 2 NaN values" in lines
    folder = tmp_path / "d\\x"
    folder.mkdir()
    (folder / "short.safetensors").write_bytes(model.read_bytes()[:20])
    result = run("inspect", str(folder / "short.safetensors"))  # the message names the source
    assert f" from {tmp_path}/d\\\\x/short.safetensors while" in result.stderr, result.stderr
    failed("d\\x/m.safetensors", stream_st.HeaderError("bad\nheader"))  # it does not
    assert capsys.readouterr().err == "stream-st: error: d\\\\x/m.safetensors: bad\\nheader\n"


def test_a_digest_algorithm_s_name_is_shown_escaped(tmp_path: Path) -> None:
    """The name of a file's digest algorithm (its ``stream_st.digest`` metadata) reached the
    terminal as it is in inspect's checksummed line and validate's digests line: an escape
    sequence drove the terminal, a newline forged a line of the output. It is escaped as a name
    is, its backslash doubled, each of a sharded checkpoint's algorithms too."""
    evil, literal = "\x1b]0;pwned\x07\x1b[31mRED\nforged line", "a\\nb"
    shards = _two_shards(
        tmp_path / "m",
        [
            {"stream_st.digest": evil, "stream_st.digest:w0": "00"},
            {"stream_st.digest": literal, "stream_st.digest:w1": "00"},
        ],
    )
    escaped = "\\x1b]0;pwned\\x07\\x1b[31mRED\\nforged line"
    for source, inspected, validated in [
        (shards / "model-00001-of-00002.safetensors", escaped, escaped),
        (shards, f"{escaped} and a\\\\nb", f"{escaped}, a\\\\nb"),  # validate's sorted
    ]:
        lines = run("inspect", str(source)).stdout.splitlines()
        said = f"  checksummed: {inspected} digests of "
        assert any(line.startswith(said) for line in lines), lines
        lines += run("validate", str(source)).stdout.splitlines()
        assert f"digests: {validated}: FAILED (see the errors)" in lines, lines
        assert not any(c in line for line in lines for c in "\x1b\x07"), lines
        assert not any(line.startswith("forged line") for line in lines), lines


def test_show_of_a_dataset_holds_one_shards_tensor_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``show NAME`` of a dataset (NAME in every shard) collected every shard's copy before
    printing any: memory grew with the shard count. Each is shown as it arrives, the one
    before let go by then."""
    import gc
    import weakref

    import stream_st.cli.commands as commands
    import stream_st.cli.output as output

    async def dataset() -> None:
        path = tmp_path / "d"
        async with stream_st.open_dataset_writer(path, target_shard_size=1) as writer:
            for shard in range(4):
                await writer.write_batch({"x": np.full(4, shard, np.float32)}, samples=4)

    anyio.run(dataset)
    shown: list[weakref.ref[Any]] = []
    held: list[int] = []
    show_values = output.show_values

    def counting(args: Any, info: Any, array: Any) -> None:
        gc.collect()
        held.append(sum(ref() is not None for ref in shown))  # earlier shards' still alive
        shown.append(weakref.ref(array))
        show_values(args, info, array)

    monkeypatch.setattr(commands, "show_values", counting)
    assert main(["show", str(tmp_path / "d" / "dataset_manifest.json"), "x"]) == 0
    assert held == [0, 0, 0, 0], held
    printed = capsys.readouterr().out
    assert printed.count("x: float32 [4]") == 4, printed


def test_out_of_descriptors_is_an_error_not_a_bug(tmp_path: Path) -> None:
    """The process out of file descriptors (the command's own event loop could not be made):
    a traceback and "internal error (a bug...)", exit 3; one line saying so, exit 2."""
    path = tmp_path / "m.safetensors"
    write_model(path, {"a": np.zeros(2, np.float32)})
    script = (
        "import os, resource, sys\n"
        "from stream_st.cli import main\n"
        f"main(['inspect', {str(path)!r}])  # every module the command needs imported\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir('/proc/self/fd')) - 1, hard))\n"
        f"sys.exit(main(['inspect', {str(path)!r}]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert "stream-st: error: Too many open files (see ulimit -n)" in done.stderr
    assert "internal error" not in done.stderr
