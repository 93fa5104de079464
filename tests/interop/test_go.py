"""Files exchanged with an independent Go implementation (tests/interop/go, standard library
only), both ways: plain files of every dtype, checksummed files, KV caches with each codec.

The Go program is built with ``go build`` into a temporary folder; without a Go toolchain these
tests are skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import stream_st
from stream_st.core.codecs import Int4Codec, get_codec, to_bfloat16
from stream_st.kv import KVLayout, receive_kv, send_kv

Array = np.ndarray[Any, Any]
BF16 = np.dtype(ml_dtypes.bfloat16)
GO_SOURCE = Path(__file__).parent / "go"
KV_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": BF16}


@pytest.fixture(scope="session")
def go_tool(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Go program, built once per session."""
    go = shutil.which("go")
    if go is None:
        pytest.skip("no Go toolchain: `go` is not on PATH (install golang-go to run these)")
    out = tmp_path_factory.mktemp("go") / "stinterop"
    env = {**os.environ, "GOTOOLCHAIN": "local", "GOPROXY": "off", "GOFLAGS": "-mod=mod"}
    if "GOCACHE" not in env and not os.access(Path.home(), os.W_OK):
        env["GOCACHE"] = str(tmp_path_factory.mktemp("gocache"))
    built = subprocess.run(
        [go, "build", "-o", str(out), "."],
        cwd=GO_SOURCE,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr
    return out


def go(tool: Path, *args: str | Path, ok: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one command of the Go program; assert it succeeded (or failed, with ``ok=False``)."""
    done = subprocess.run([str(tool), *map(str, args)], capture_output=True, text=True, timeout=120)
    if ok:
        assert done.returncode == 0, done.stderr
    else:
        assert done.returncode == 1, (done.returncode, done.stdout)
    return done


def same_floats(got: Array, expected: Array) -> None:
    """Equal values, NaN where NaN, and the same sign on zeros."""
    assert got.shape == expected.shape
    assert np.array_equal(got, expected, equal_nan=True)
    assert np.array_equal(np.signbit(got), np.signbit(expected))


async def damaged(path: Path, tensor: str, at: int = 3) -> Path:
    """A copy of ``path`` with one bit of ``tensor`` flipped."""
    header = await stream_st.read_header(path)
    data = bytearray(path.read_bytes())
    data[header.data_start + header[tensor].start + at] ^= 0x04
    out = path.with_name("damaged-" + path.name)
    out.write_bytes(bytes(data))
    return out


# ---------------------------------------------------------------- plain files


def every_dtype() -> dict[str, Array]:
    rng = np.random.default_rng(11)
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -2.5]
    f16 = np.concatenate(
        [
            np.array(specials, np.float16),
            np.array([2**-24, -(2**-24), 2**-14, 65504, 3 * 2**-20], np.float16),
            rng.standard_normal(50).astype(np.float16),
        ]
    )
    return {
        "f64": rng.standard_normal((3, 4)),
        "f32": np.concatenate(
            [np.array(specials, np.float32), rng.standard_normal(30, np.float32)]
        ),
        "f16": f16,
        "bf16": np.concatenate(
            [np.array(specials, BF16), np.array([1e-40, 3e38], BF16), to_bfloat16(rng.random(20))]
        ),
        "i8": np.arange(-128, 128, dtype=np.int8).reshape(16, 16),
        "u8": np.arange(256, dtype=np.uint8),
        "i16": np.array([-32768, -1, 0, 32767], np.int16),
        "u16": np.array([0, 1, 65535], np.uint16),
        "i32": np.array([-(2**31), 0, 2**31 - 1], np.int32),
        "u32": np.array([0, 2**32 - 1], np.uint32),
        "i64": np.array([-(2**53), 0, 2**53], np.int64),
        "u64": np.array([0, 2**53], np.uint64),
        "bool": np.array([True, False, True]),
        "scalar": np.array(7.5, np.float32),
        "empty": np.zeros((0, 5), np.float16),
    }


async def test_go_reads_every_dtype_stream_st_writes(go_tool: Path, tmp_path: Path) -> None:
    tensors = every_dtype()
    meta = {"origin": "stream_st", "text": "ünïcode ✓"}
    await stream_st.save(tmp_path / "in.safetensors", tensors, metadata=meta)
    go(go_tool, "to-f64", tmp_path / "in.safetensors", tmp_path / "out.safetensors")
    back = await stream_st.load(tmp_path / "out.safetensors")
    assert sorted(back) == sorted(tensors)
    for name, array in tensors.items():
        assert back[name].dtype == np.float64
        same_floats(back[name], np.asarray(array).astype(np.float64))
    assert (await stream_st.read_header(tmp_path / "out.safetensors")).metadata == meta


async def test_go_rounds_float32_to_f16_and_bf16_as_numpy_does(
    go_tool: Path, tmp_path: Path
) -> None:
    rng = np.random.default_rng(5)
    edges = np.array(
        [
            65504.0,
            65519.996,
            65520.0,
            1e-8,
            2**-25,
            2**-25 * 1.0000001,
            2**-24 * 1.5,
            2**-14 - 2**-25,
            1 + 2**-11,
            1 + 3 * 2**-11,
            1 + 2**-8,
            1 + 3 * 2**-8,
            3.4e38,
            -0.0,
            np.inf,
            -np.inf,
            np.nan,
            1e-45,
            -5.960464477539063e-08,
        ],
        np.float32,
    )
    bits = rng.integers(0, 2**32, 20_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([edges, bits, rng.standard_normal(5000, np.float32) * 1e-5])
    await stream_st.save(tmp_path / "f32.safetensors", {"x": x})
    with np.errstate(over="ignore"):  # beyond 65504: infinity, as the Go program gives too
        as_f16 = x.astype(np.float16)
    for dtype, expected in (("F16", as_f16), ("BF16", to_bfloat16(x))):
        out = tmp_path / f"{dtype}.safetensors"
        go(go_tool, "cast-f32", tmp_path / "f32.safetensors", out, dtype)
        got = (await stream_st.load(out))["x"]
        assert got.dtype == expected.dtype
        nan = np.isnan(expected.astype(np.float32))
        assert np.array_equal(np.isnan(got.astype(np.float32)), nan)
        assert np.array_equal(got[~nan].view(np.uint16), expected[~nan].view(np.uint16))


def formula(name: str, shape: tuple[int, ...]) -> Array:
    """The values the Go program's write-plain gives each tensor."""
    i = np.arange(int(np.prod(shape)), dtype=np.int64)
    quarter = ((i % 17) - 8).astype(np.float32) * np.float32(0.25)
    values: dict[str, Array] = {
        "f64": i * 0.1 - 3,
        "f32": quarter,
        "f16": quarter.astype(np.float16),
        "bf16": quarter.astype(BF16),
        "i8": (i * 37 % 251 - 125).astype(np.int8),
        "u8": (i * 37 % 251).astype(np.uint8),
        "i16": (i * 1237 % 65521 - 32760).astype(np.int16),
        "u16": (i * 1237 % 65521).astype(np.uint16),
        "i32": (i * 1000003 % 2147483647 - 1073741823).astype(np.int32),
        "u32": (i * 1000003 % 4294967291).astype(np.uint32),
        "i64": i * 1000000007 - 5000000000000,
        "u64": i.astype(np.uint64) * np.uint64(1000000007) + np.uint64(1 << 60),
        "bool": i % 3 == 0,
        "scalar": quarter,
        "empty": quarter,
    }
    return values[name].reshape(shape)


@pytest.mark.parametrize("checksum", [False, True], ids=["plain", "sha256"])
async def test_stream_st_reads_what_go_writes(
    go_tool: Path, tmp_path: Path, checksum: bool
) -> None:
    path = tmp_path / "go.safetensors"
    go(go_tool, "write-plain", *(["-checksum"] if checksum else []), path)
    header = await stream_st.read_header(path)
    assert header.data_start % 8 == 0
    assert header.metadata["note"] == 'ünïcode ✓ "quoted"'
    assert ("stream_st.digest" in header.metadata) == checksum
    tensors = await stream_st.load(path)  # digests, when recorded, are checked
    assert len(tensors) == 15
    for name, array in tensors.items():
        expected = formula(name, array.shape)
        assert array.dtype == expected.dtype, name
        assert np.array_equal(array, expected), name
    assert tensors["scalar"].shape == () and float(tensors["scalar"]) == -2.0
    if checksum:
        with pytest.raises(stream_st.IntegrityError, match="i32"):
            await stream_st.load(await damaged(path, "i32"))


async def test_go_verifies_sha256_files_stream_st_writes(go_tool: Path, tmp_path: Path) -> None:
    tensors = every_dtype()
    path = tmp_path / "sums.safetensors"
    await stream_st.save(path, tensors, checksums="sha256")
    report = json.loads(go(go_tool, "inspect", path).stdout)
    assert report["digests"] == "verified"
    assert [t["name"] for t in report["tensors"]] == (await stream_st.read_header(path)).names()
    by_name = {t["name"]: t for t in report["tensors"]}
    assert by_name["f16"]["sha256"] == hashlib.sha256(tensors["f16"].tobytes()).hexdigest()
    assert by_name["scalar"]["shape"] == [] and by_name["empty"]["shape"] == [0, 5]
    failed = go(go_tool, "inspect", await damaged(path, "u16", at=1), ok=False)
    assert '"u16": sha256 mismatch' in failed.stderr
    plain = tmp_path / "plain.safetensors"
    await stream_st.save(plain, {"x": np.ones(3)})
    assert json.loads(go(go_tool, "inspect", plain).stdout)["digests"] == "none"


# ---------------------------------------------------------------- KV caches


def kv_arrays(layer: int, shape: tuple[int, ...], dtype: np.dtype[Any]) -> tuple[Array, Array]:
    """Key and value with many exact INT8 ties (halves, max|x| = 127 so the scale is 1)."""
    rng = np.random.default_rng(layer)
    out = []
    for _ in range(2):
        x = rng.integers(-254, 255, shape).astype(np.float32) / 2
        x.reshape(-1)[0] = 127
        out.append(x.astype(dtype))
    return out[0], out[1]


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("codec", ["none", "int8", "int4"])
async def test_go_decodes_stream_st_transfers_bit_exactly(
    go_tool: Path, tmp_path: Path, codec: str, dtype: str
) -> None:
    layout = KVLayout(num_layers=3, shape=(1, 4, 8, 64), dtype=dtype, codec=codec, group_size=32)
    numpy_dtype = KV_DTYPES[dtype]

    async def layers() -> Any:
        for layer in range(3):
            yield (layer, *kv_arrays(layer, layout.shape, numpy_dtype))

    path = tmp_path / "kv.safetensors"
    await send_kv(path, layout, layers())
    got: dict[str, Array] = {}
    async with receive_kv(path) as kv_in:
        assert kv_in.integrity == "layer-sha256"
        async for layer, key, value in kv_in:
            got[f"layer_{layer}_key"], got[f"layer_{layer}_value"] = key, value
    out = tmp_path / "decoded.safetensors"
    go(go_tool, "kv-decode", path, out)
    decoded = await stream_st.load(out)
    assert (await stream_st.read_header(out)).metadata == {
        "integrity": "layer-sha256",
        "codec": codec,
    }
    assert sorted(decoded) == sorted(got)
    for name, array in got.items():
        assert decoded[name].dtype == array.dtype == numpy_dtype
        assert np.array_equal(decoded[name].view(np.uint8), array.view(np.uint8)), name
    failed = go(go_tool, "kv-decode", await damaged(path, "layer_1_value", 9), out, ok=False)
    assert "layer 1 failed its SHA-256 check" in failed.stderr


@pytest.mark.parametrize("style", ["stream_st", "seed", "seed+sha256"])
@pytest.mark.parametrize(
    ("codec", "dtype"),
    [
        ("none", "F32"),
        ("none", "F16"),
        ("none", "BF16"),
        ("int8", "F32"),
        ("int8", "F16"),
        ("int8", "BF16"),
        ("int4", "F32"),
        ("int4", "F16"),
        ("int4", "BF16"),
    ],
)
async def test_receive_kv_reads_caches_go_writes(
    go_tool: Path, tmp_path: Path, codec: str, dtype: str, style: str
) -> None:
    path, ref = tmp_path / "kv.safetensors", tmp_path / "ref.safetensors"
    group = 32 if dtype == "F16" else 64
    flags = ["-layers", "12", "-seq", "4", "-dtype", dtype, "-codec", codec]
    flags += ["-group", str(group), "-style", style.split("+")[0]]
    go(go_tool, "kv-write", *flags, *(["-checksum"] if "sha256" in style else []), path, ref)
    reference = await stream_st.load(ref)
    wire = await stream_st.load(path)
    encoder = Int4Codec(group_size=group) if codec == "int4" else get_codec(codec)
    got: dict[str, Array] = {}
    async with receive_kv(path, max_ahead=1) as kv_in:
        assert (
            kv_in.integrity
            == {
                "stream_st": "layer-sha256",
                "seed": "unverified",
                "seed+sha256": "tensor-digests",
            }[style]
        )
        assert kv_in.layout.num_layers == 12 and kv_in.layout.shape == (1, 4, 4, 64)
        assert (kv_in.layout.codec, kv_in.layout.dtype) == (codec, dtype)
        async for layer, key, value in kv_in:
            got[f"layer_{layer}_key"], got[f"layer_{layer}_value"] = key, value
    assert sorted(got) == sorted(reference)
    for name, original in reference.items():
        assert got[name].dtype == original.dtype == KV_DTYPES[dtype]
        ours = dict(encoder.encode(name, original))  # Go's encoder gives the same bytes
        for part, array in ours.items():
            assert wire[part].dtype == array.dtype, part
            assert np.array_equal(wire[part].view(np.uint8), array.view(np.uint8)), part
        expected = encoder.decode(name, ours, original.dtype)
        assert np.array_equal(got[name].view(np.uint8), expected.view(np.uint8)), name
        if codec == "none":
            assert np.array_equal(got[name], original)


async def test_receive_kv_reads_the_format_examples_own_metadata(
    go_tool: Path, tmp_path: Path
) -> None:
    """22 layers of F32 [1, 4, seq, 64] labelled compression INT4 (the example's own header)."""
    path, ref = tmp_path / "kv.safetensors", tmp_path / "ref.safetensors"
    go(
        go_tool,
        "kv-write",
        "-layers",
        "22",
        "-seq",
        "16",
        "-style",
        "seed",
        "-seed-example",
        path,
        ref,
    )
    header = await stream_st.read_header(path)
    assert header.metadata == {
        "compression": "INT4",
        "group_size": "64",
        "original_dtype": "float32",
    }
    assert header.names()[:4] == ["layer_0_key", "layer_0_value", "layer_10_key", "layer_10_value"]
    reference = await stream_st.load(ref)
    async with receive_kv(path) as kv_in:
        assert not kv_in.verified and kv_in.layout.codec == "none"
        assert kv_in.layout.notes and "'INT4'" in kv_in.layout.notes[0]
        count = 0
        async for layer, key, value in kv_in:
            assert key.shape == (1, 4, 16, 64) and key.dtype == np.float32
            assert np.array_equal(key, reference[f"layer_{layer}_key"])
            assert np.array_equal(value, reference[f"layer_{layer}_value"])
            count += 1
    assert count == 22
    go_view = go(go_tool, "kv-decode", path, tmp_path / "decoded.safetensors")
    assert go_view.returncode == 0
