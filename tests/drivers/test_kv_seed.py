"""receive_kv reads caches other programs write: seed-style names, no stream_st metadata."""

from __future__ import annotations

import json
import struct
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import ml_dtypes
import numpy as np
import pytest

import stream_st
from stream_st.core.codecs import CODECS, Int4Codec
from stream_st.kv import KVLayout, receive_kv, send_kv

Array = np.ndarray[Any, Any]
CODES = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint8): "U8",
}
SEED_META = {"compression": "INT4", "group_size": "64", "original_dtype": "float32"}


def seed_cache(layers: int, seq: int = 8, dtype: Any = np.float32) -> dict[str, Array]:
    rng = np.random.default_rng(layers * 1000 + seq)
    out: dict[str, Array] = {}
    for layer in range(layers):
        for part in ("key", "value"):
            out[f"layer_{layer}_{part}"] = rng.standard_normal((1, 4, seq, 64)).astype(dtype)
    return out


def raw_file(tensors: dict[str, tuple[str, list[int], bytes]], meta: dict[str, str]) -> bytes:
    """A safetensors file laid out by hand, as a program without stream_st would write it."""
    header: dict[str, Any] = {"__metadata__": meta} if meta else {}
    data = b""
    for name, (dtype, shape, blob) in tensors.items():
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [len(data), len(data) + len(blob)],
        }
        data += blob
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


async def receive_all(source: Any, **options: Any) -> tuple[Any, dict[int, tuple[Array, Array]]]:
    got: dict[int, tuple[Array, Array]] = {}
    with anyio.fail_after(20):
        async with receive_kv(source, **options) as kv_in:
            async for layer, key, value in kv_in:
                got[layer] = (key, value)
    return kv_in, got


async def test_the_seeds_own_example_is_received(tmp_path: Path) -> None:
    """22 layers of F32 [1, 4, seq, 64] with the seed's metadata, in the reference writer's
    order (layer_0, layer_1, layer_10, ... layer_2, ...): every layer, in order, exactly."""
    tensors = seed_cache(22)
    path = tmp_path / "kv_cache.safetensors"
    await stream_st.save(path, tensors, metadata=SEED_META)
    order = (await stream_st.read_header(path)).names()
    assert order[2:4] == ["layer_10_key", "layer_10_value"]  # not layer order on disk
    kv_in, got = await receive_all(path, max_ahead=0)
    assert list(got) == list(range(22))
    for times in (kv_in.received_at, kv_in.verified_at):  # by layer, not by arrival
        assert len(times) == 22 and times[10] < times[2]
        layers = [int(name.split("_")[1]) for name in order[::2]]
        assert [times[layer] for layer in layers] == sorted(times)
    for layer, (key, value) in got.items():
        assert key.dtype == np.float32 and key.shape == (1, 4, 8, 64)
        assert np.array_equal(key, tensors[f"layer_{layer}_key"])
        assert np.array_equal(value, tensors[f"layer_{layer}_value"])
    assert kv_in.integrity == "unverified" and not kv_in.verified
    layout = kv_in.layout
    assert (layout.style, layout.codec, layout.dtype, layout.digest) == (
        "seed",
        "none",
        "F32",
        False,
    )
    assert layout.num_layers == 22 and layout.shape == (1, 4, 8, 64)
    assert any("'INT4'" in note and "read as they are" in note for note in layout.notes)


async def test_require_digests_refuses_an_unverified_cache(tmp_path: Path) -> None:
    path = tmp_path / "kv.safetensors"
    await stream_st.save(path, seed_cache(2), metadata=SEED_META)
    with pytest.raises(stream_st.IntegrityError, match="no digests"):
        async with receive_kv(path, require_digests=True):
            pass
    sent = tmp_path / "sent.safetensors"  # a transfer sent without digests is refused too
    layout = KVLayout(num_layers=1, shape=(1, 4, 8, 64), digest=False)

    async def one() -> Any:
        yield 0, np.zeros(layout.shape, np.float16), np.ones(layout.shape, np.float16)

    await send_kv(sent, layout, one())
    with pytest.raises(stream_st.IntegrityError, match="no digests"):
        async with receive_kv(sent, require_digests=True):
            pass


async def test_checksummed_seed_cache_is_verified_per_tensor(tmp_path: Path) -> None:
    tensors = seed_cache(3)
    path = tmp_path / "kv.safetensors"
    await stream_st.save(path, tensors, metadata=SEED_META, checksums="sha256")
    kv_in, got = await receive_all(path, require_digests=True)
    assert kv_in.integrity == "tensor-digests" and kv_in.verified
    assert np.array_equal(got[2][1], tensors["layer_2_value"])
    header = await stream_st.read_header(path)
    data = bytearray(path.read_bytes())
    data[header.data_start + header["layer_1_key"].start + 7] ^= 0x01
    delivered = []
    with pytest.raises(stream_st.IntegrityError):
        async with receive_kv(bytes(data)) as kv_damaged:
            async for layer, _, _ in kv_damaged:
                delivered.append(layer)
    assert 1 not in delivered


async def test_a_keyword_that_is_no_time_limit_is_refused(tmp_path: Path) -> None:
    """Every keyword went on to open_stream: ``verify=False`` was taken silently, the receiver
    still said ``integrity='tensor-digests'``, ``verified``, and handed out a damaged layer;
    ``include=`` was taken too."""
    path = tmp_path / "kv.safetensors"
    await stream_st.save(path, seed_cache(2), metadata=SEED_META, checksums="sha256")
    header = await stream_st.read_header(path)
    data = bytearray(path.read_bytes())
    data[header.data_start + header["layer_0_key"].start + 7] ^= 0x01
    for options in ({"verify": False}, {"include": ["layer_0_key"]}):
        with pytest.raises(stream_st.ArgumentTypeError, match="unknown option"):
            async with receive_kv(bytes(data), require_digests=True, **options):
                pass
    kv_in, got = await receive_all(path, require_digests=True, timeout=10)  # a limit is taken
    assert kv_in.verified and list(got) == [0, 1]


@pytest.mark.parametrize(
    ("stored", "original", "delivered"),
    [
        (np.float16, None, np.float16),
        (np.float16, "float32", np.float32),
        (ml_dtypes.bfloat16, "torch.bfloat16", ml_dtypes.bfloat16),
        (np.float32, "float16", np.float16),
    ],
)
async def test_original_dtype_is_the_dtype_handed_out(
    stored: Any, original: str | None, delivered: Any
) -> None:
    tensors = seed_cache(2, dtype=stored)
    meta = {"original_dtype": original} if original else {}
    kv_in, got = await receive_all(raw_file(as_raw(tensors), meta))
    assert got[1][0].dtype == np.dtype(delivered)
    assert np.array_equal(got[1][0], tensors["layer_1_key"].astype(delivered))
    assert kv_in.layout.dtype == CODES[np.dtype(delivered)]


def as_raw(tensors: dict[str, Array]) -> dict[str, tuple[str, list[int], bytes]]:
    return {name: (CODES[a.dtype], list(a.shape), a.tobytes()) for name, a in tensors.items()}


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("original", ["float32", "float16", "bfloat16"])
async def test_encoded_seed_caches_decode_as_the_codec_does(codec: str, original: str) -> None:
    tensors = seed_cache(3, dtype=np.dtype(original))
    wire: dict[str, Array] = {}
    enc = CODECS[codec] if codec == "int8" else Int4Codec(group_size=32)
    for name, array in tensors.items():
        wire.update(enc.encode(name, array))
    meta = {"compression": codec.upper(), "original_dtype": original}
    if codec == "int4":
        meta["group_size"] = "32"
    kv_in, got = await receive_all(raw_file(as_raw(wire), meta))
    assert kv_in.layout.codec == codec and kv_in.layout.style == "seed"
    for layer, (key, value) in got.items():
        for part, array in (("key", key), ("value", value)):
            expected = enc.decode(f"layer_{layer}_{part}", wire, original)
            assert array.dtype == expected.dtype == np.dtype(original)
            assert np.array_equal(array, expected)
    assert kv_in.layout.group_size == (32 if codec == "int4" else 64)


def f32(shape: list[int], fill: float = 0.5) -> tuple[str, list[int], bytes]:
    return ("F32", shape, np.full(shape, fill, np.float32).tobytes())


SHAPE = [1, 4, 2, 64]
I8 = ("I8", SHAPE, bytes(512))
SCALE = ("F32", [1], np.float32(2.0).tobytes())


@pytest.mark.parametrize(
    ("tensors", "meta", "message"),
    [
        ({}, {}, "no KV metadata and no layer_"),
        ({"weight": f32(SHAPE)}, {}, "'weight' is not layer_"),
        ({"layer_0_key": f32(SHAPE)}, {}, r"layer 0 has \['key'\]"),
        ({"layer_0_key": f32(SHAPE), "layer_0_value": f32([1, 4, 3, 64])}, {}, "layer_0 makes"),
        (
            {
                "layer_0_key": f32(SHAPE),
                "layer_0_value": f32(SHAPE),
                "layer_2_key": f32(SHAPE),
                "layer_2_value": f32(SHAPE),
            },
            {},
            r"layers \[1\] are missing",
        ),
        ({"layer_01_key": f32(SHAPE), "layer_01_value": f32(SHAPE)}, {}, "'layer_01_key' is not"),
        ({"layer_0_key": f32([4, 64]), "layer_0_value": f32([4, 64])}, {}, "KV layout needs"),
        (
            {
                "layer_0_key": ("I32", SHAPE, bytes(2048)),
                "layer_0_value": ("I32", SHAPE, bytes(2048)),
            },
            {},
            "layer_0_key is I32",
        ),
        (
            {"layer_0_key": f32(SHAPE), "layer_0_value": f32(SHAPE)},
            {"compression": "ZSTD"},
            "unknown compression 'ZSTD'",
        ),
        ({"layer_0_key": I8, "layer_0_value": I8}, {"compression": "INT8"}, "has .'key', 'value'."),
        (
            {
                "layer_0_key": I8,
                "layer_0_key.scale": SCALE,
                "layer_0_value": I8,
                "layer_0_value.scale": SCALE,
            },
            {"compression": "INT4"},
            "tensors are INT8 codes",
        ),
        (
            {"layer_0_key": f32(SHAPE), "layer_0_value": f32(SHAPE)},
            {"compression": "INT4", "group_size": "sixty-four"},
            "'sixty-four' is not a positive",
        ),
        (
            {"layer_0_key": f32(SHAPE), "layer_0_value": f32(SHAPE)},
            {"compression": "INT4", "group_size": "064"},  # a decimal as str() writes it
            "'064' is not a positive",
        ),
        # a group_size that is no decimal, though neither the tensors nor compression say INT4
        # (was: read without a word)
        (
            {"layer_0_key": f32(SHAPE), "layer_0_value": f32(SHAPE)},
            {"group_size": "abc"},
            "group_size 'abc' is not a positive",
        ),
        (
            {"layer_0_key": f32(SHAPE), "layer_0_value": f32(SHAPE)},
            {"compression": "NONE", "group_size": "064"},
            "group_size '064' is not a positive",
        ),
        (
            {
                "layer_0_key": I8,
                "layer_0_key.scale": SCALE,
                "layer_0_value": I8,
                "layer_0_value.scale": SCALE,
            },
            {"compression": "INT8", "group_size": "+64"},
            r"group_size '\+64' is not a positive",
        ),
        (
            {"layer_0_key": f32(SHAPE), "layer_0_value": f32(SHAPE)},
            {"original_dtype": "int8"},
            "original_dtype 'int8' is not",
        ),
        (
            {
                "layer_0_key": ("U8", [1, 4, 2, 32], bytes(256)),
                "layer_0_key.scales": ("F16", [1, 4, 2, 1], bytes(16)),
                "layer_0_value": ("U8", [1, 4, 2, 32], bytes(256)),
                "layer_0_value.scales": ("F16", [1, 4, 2, 1], bytes(16)),
            },
            {"compression": "INT4", "group_size": "32"},
            "group_size 32, the INT4 scales' shape says 64",
        ),
    ],
)
async def test_bad_seed_caches_are_header_errors(
    tensors: dict[str, tuple[str, list[int], bytes]], meta: dict[str, str], message: str
) -> None:
    with anyio.fail_after(10), pytest.raises(stream_st.HeaderError, match=message):
        async with receive_kv(raw_file(tensors, meta)):
            pass


ORIGINALS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


@pytest.mark.parametrize(
    ("original", "code"),
    [
        *ORIGINALS.items(),
        *[(f"torch.{name}", code) for name, code in ORIGINALS.items()],
        *[(code, code) for code in ORIGINALS.values()],
    ],
)
async def test_original_dtype_is_named_as_the_format_names_it(original: str, code: str) -> None:
    """float32 / float16 / bfloat16, with or without ``torch.``, or a code F32 / F16 / BF16."""
    kv_in, got = await receive_all(raw_file(as_raw(seed_cache(1)), {"original_dtype": original}))
    assert kv_in.layout.dtype == code and CODES[got[0][0].dtype] == code


@pytest.mark.parametrize(
    "original",
    ["half", "single", "float", "e", "<f2", "f4", "torch.F16", "torch.half", "torch.float"],
)
async def test_original_dtype_in_another_spelling_is_refused(original: str) -> None:
    """Was: numpy's and torch's other names of a float (``half``, ``e``, ``<f2``,
    ``torch.half``...) and a code after ``torch.`` were taken, where the format names only
    float32 / float16 / bfloat16, with or without ``torch.``, or a code."""
    with (
        anyio.fail_after(10),
        pytest.raises(stream_st.HeaderError, match=f"original_dtype '{original}' is not"),
    ):
        async with receive_kv(raw_file(as_raw(seed_cache(1)), {"original_dtype": original})):
            pass


async def test_a_huge_layer_number_is_refused_at_once() -> None:
    tensors = {"layer_99999999999999_key": f32(SHAPE), "layer_99999999999999_value": f32(SHAPE)}
    with anyio.fail_after(5), pytest.raises(stream_st.HeaderError, match=r"layers \[0\] are"):
        async with receive_kv(raw_file(tensors, {})):
            pass


async def test_a_scale_that_cannot_decode_fails_that_layer() -> None:
    zero = ("F32", [1], np.float32(0.0).tobytes())
    tensors = {
        "layer_0_key": I8,
        "layer_0_key.scale": SCALE,
        "layer_0_value": I8,
        "layer_0_value.scale": SCALE,
        "layer_1_key": I8,
        "layer_1_key.scale": zero,
        "layer_1_value": I8,
        "layer_1_value.scale": SCALE,
    }
    delivered = []
    with anyio.fail_after(10), pytest.raises(stream_st.errors.CodecError, match="scale must be"):
        async with receive_kv(raw_file(tensors, {"compression": "INT8"})) as kv_in:
            async for layer, key, _ in kv_in:
                assert key.dtype == np.float32 and not key.any()
                delivered.append(layer)
    assert delivered == [0]


async def test_values_decoded_beyond_the_dtype_are_counted_in_a_warning() -> None:
    """An INT8 layer whose scale is finite and > 0 but tiny decodes beyond F16's range: it was
    handed out all Inf with numpy's bare overflow RuntimeWarning; a StreamStWarning counts the
    values lost, as cp(dequantize=True)'s does."""
    codes = ("I8", [1, 1, 2, 4], np.full(8, 100, np.int8).tobytes())
    tiny = ("F32", [1], np.float32(1e-30).tobytes())
    tensors = {"layer_0_key": codes, "layer_0_key.scale": SCALE}
    tensors |= {"layer_0_value": codes, "layer_0_value.scale": tiny}
    meta = {"compression": "INT8", "original_dtype": "float16"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, got = await receive_all(raw_file(tensors, meta))
    assert np.isinf(got[0][1]).all() and np.isfinite(got[0][0]).all()
    assert [(w.category, str(w.message)) for w in caught] == [
        (
            stream_st.StreamStWarning,
            "tensor 'layer_0_value': 8 finite values beyond F16's range became infinite",
        )
    ]


async def test_nan_and_inf_carried_as_they_were_are_not_counted(tmp_path: Path) -> None:
    """NaN and +-Inf are no finite values lost: a "none" F16 transfer carrying them arrived
    bit-identical, yet each was counted as a finite value that "became infinite"; an F32 seed
    cache decoded as its F16 ``original_dtype`` counts only the finite value beyond F16's range."""
    layout = KVLayout(num_layers=1, shape=(1, 1, 2, 4), dtype="F16")
    sent = np.array([np.nan, np.inf, -np.inf, 1, 2, 3, 4, 5], np.float16).reshape(layout.shape)
    path = tmp_path / "kv.safetensors"
    await send_kv(path, layout, [(0, sent, sent.copy())])
    wide = np.array([np.nan, np.inf, -np.inf, 1e6, 2, 3, 4, 5], np.float32)
    blob = ("F32", [1, 1, 2, 4], wide.tobytes())
    seed = raw_file({"layer_0_key": blob, "layer_0_value": blob}, {"original_dtype": "float16"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, carried = await receive_all(path)
        _, narrowed = await receive_all(seed)
    for got in carried[0]:
        assert got.view(np.uint16).tobytes() == sent.view(np.uint16).tobytes()
    assert [(w.category, str(w.message)) for w in caught] == [
        (
            stream_st.StreamStWarning,
            f"tensor 'layer_0_{part}': 1 finite values beyond F16's range became infinite",
        )
        for part in ("key", "value")
    ]
    beyond = np.array([np.nan, np.inf, -np.inf, np.inf, 2, 3, 4, 5], np.float16)
    assert np.array_equal(narrowed[0][0].reshape(-1), beyond, equal_nan=True)


async def test_a_stream_st_transfer_still_needs_all_its_metadata(tmp_path: Path) -> None:
    """A header with any kv_* key is a stream_st transfer: no falling back to inference."""
    tensors = {"layer_0_key": f32(SHAPE), "layer_0_value": f32(SHAPE)}
    with pytest.raises(stream_st.HeaderError, match="bad or missing KV metadata"):
        async with receive_kv(raw_file(tensors, {"kv_dtype": "F32"})):
            pass


async def test_truncated_seed_cache_hands_out_what_arrived(tmp_path: Path) -> None:
    tensors = seed_cache(4)
    path = tmp_path / "kv.safetensors"
    await stream_st.save(path, tensors, order="plan")
    data = path.read_bytes()[:-100]

    async def chunks() -> AsyncIterator[bytes]:  # a stream whose length is not known up front
        for start in range(0, len(data), 4096):
            yield data[start : start + 4096]

    delivered = []
    with anyio.fail_after(10), pytest.raises(stream_st.TruncatedStreamError):
        async with receive_kv(chunks()) as kv_in:
            async for layer, key, _ in kv_in:
                assert np.array_equal(key, tensors[f"layer_{layer}_key"])
                delivered.append(layer)
    assert delivered == [0, 1, 2]
