"""``tools.validate`` and its parts: exact statistics, the structural checks, a model's config."""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import anyio
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import tools
from stream_st.core import digests
from stream_st.core.moments import Moments, moments_of
from stream_st.tools.validate import (
    ModelConfig,
    check_layer_sequence,
    tensor_stats,
    validate_dtype_consistency,
)

from ..ctrl_c import run_script
from ..servers.hub_server import FakeHub

Arrays = dict[str, np.ndarray[Any, Any]]
VALIDATE = sys.modules["stream_st.tools.validate"]  # the module (tools.validate is the function)
COMMAND = shutil.which("stream-st", path=str(Path(sys.executable).parent)) or "stream-st"


def reference(values: np.ndarray[Any, Any]) -> tuple[float, float, float, float]:
    """min, max, mean, std of the finite values, by numpy in float64."""
    wide = np.asarray(values).astype(np.float64)
    finite = wide[np.isfinite(wide)]
    return float(finite.min()), float(finite.max()), float(finite.mean()), float(finite.std())


def assert_exact(found: Moments, values: np.ndarray[Any, Any], rtol: float = 1e-12) -> None:
    low, high, mean, std = reference(values)
    assert (found.low, found.high) == (low, high)
    assert found.std is not None
    assert math.isclose(found.std, std, rel_tol=rtol), (found.std, std)
    assert math.isclose(found.mean, mean, rel_tol=rtol, abs_tol=rtol * std), (found.mean, mean)


# -- statistics -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_std_of_values_far_from_zero_is_exact(dtype: type) -> None:
    """1000 +- 0.01: the mean of squares minus the squared mean loses six digits here."""
    rng = np.random.default_rng(7)
    values: np.ndarray[Any, Any] = (1000 + 0.01 * rng.standard_normal(300_001)).astype(dtype)
    wide = values.astype(np.float64)
    naive = math.sqrt(np.mean(wide * wide) - np.mean(wide) ** 2)
    assert abs(naive / wide.std() - 1) > 1e-7  # the data defeats the old formula
    assert_exact(moments_of(values), values)
    stats = tensor_stats("x", "F32", [values.size], values)
    assert stats.std is not None and math.isclose(stats.std, wide.std(), rel_tol=1e-12)


def test_an_outlier_first_and_drifting_chunks_stay_exact() -> None:
    rng = np.random.default_rng(3)
    values = np.concatenate(
        [[1e6], 5 + 1e-3 * rng.standard_normal(200_000), -3 + rng.standard_normal(200_000)]
    ).astype(np.float64)
    assert_exact(moments_of(values), values)


NARROW = [np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]


@pytest.mark.parametrize("dtype", NARROW, ids=lambda d: np.dtype(d).name)
def test_narrow_floats_are_summarised_as_their_values(dtype: type) -> None:
    rng = np.random.default_rng(1)
    values: np.ndarray[Any, Any] = (rng.standard_normal(150_000) * 2).astype(dtype)
    assert_exact(moments_of(values), values.astype(np.float32))


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int32, np.uint16, np.int64, np.bool_])
def test_integers_and_booleans(dtype: type) -> None:
    values: np.ndarray[Any, Any] = np.random.default_rng(2).integers(0, 100, 100_003).astype(dtype)
    assert_exact(moments_of(values), values)


async def test_booleans_of_any_nonzero_byte_are_summarised_as_0_and_1(tmp_path: Path) -> None:
    """A BOOL tensor's bytes other than 0 and 1 are true, as numpy and the reference load them:
    its statistics are those of 0 and 1, not of the bytes."""
    raw = np.random.default_rng(3).integers(0, 256, 200_000, dtype=np.uint8)
    raw[:4] = [0, 2, 255, 1]
    entry = {"dtype": "BOOL", "shape": [raw.size], "data_offsets": [0, raw.size]}
    header = json.dumps({"m": entry})
    path = tmp_path / "bool.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header.encode() + raw.tobytes())
    loaded = reference_numpy.load_file(str(path))["m"]
    stats = (await tools.validate(path)).tensors[0]
    assert (stats.min, stats.max) == (0, 1)
    assert stats.mean == np.mean(loaded) and stats.std is not None
    assert math.isclose(stats.std, float(np.std(loaded)), rel_tol=1e-12)


def test_complex_values_are_summarised_by_magnitude() -> None:
    values = np.array([3 + 4j, 1j, -2, np.nan], dtype=np.complex64)
    found = moments_of(values)
    assert (found.count, found.nan, found.low, found.high) == (3, 1, 1.0, 5.0)


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_complex_magnitudes_are_taken_in_float64(dtype: type) -> None:
    """C64 magnitudes were taken in float32 (``np.abs`` of complex64): min, max, mean and std
    were off float64 magnitudes by ~1e-9, where validate.md has them float64. Here over several
    chunks, NaN and Inf parts counted apart, and through a strided view: mean and std as numpy's
    float64 magnitudes give them to 1e-12, min and max within a unit in the last place of Python's
    ``math.hypot`` (correctly rounded here; numpy's ``abs`` of complex128 is often a unit off)."""
    rng = np.random.default_rng(7)
    values: np.ndarray[Any, Any] = (
        rng.standard_normal(200_001) + 1j * rng.standard_normal(200_001)
    ).astype(dtype)
    values[[4, 150_000]] = [complex(np.inf, 1), complex(1, np.nan)]
    for part in (values, values[::2]):
        found = tensor_stats("z", "C64", [part.size], part)
        assert (found.nan, found.inf) == (1, 1)
        magnitudes = np.abs(part.astype(np.complex128))  # numpy's, in float64
        finite = magnitudes[np.isfinite(magnitudes)]
        assert found.mean is not None and found.std is not None
        assert math.isclose(found.mean, float(finite.mean()), rel_tol=1e-12)
        assert math.isclose(found.std, float(finite.std()), rel_tol=1e-12)
        hypot = (math.hypot(z.real, z.imag) for z in part.tolist())
        exact = [m for m in hypot if math.isfinite(m)]
        low, high = min(exact), max(exact)
        assert found.min is not None and found.max is not None
        assert abs(found.min - low) <= math.ulp(low) and abs(found.max - high) <= math.ulp(high)


async def test_a_complex_tensor_of_one_magnitude_is_not_called_constant(tmp_path: Path) -> None:
    """``[1, -1, 1j, -1j]`` was warned about as "constant 1", where only its values' magnitudes
    (the statistics a complex tensor has) are: the warning says so, an all-zero one as before."""
    path = tmp_path / "c.safetensors"
    tensors = {
        "w": np.array([3 + 4j, 5, -5j], np.complex64),
        "z": np.array([1, -1, 1j, -1j], np.complex64),
        "zero": np.zeros(3, np.complex64),
        "real": np.full(3, 5.0, np.float32),
    }
    await stream_st.save(path, tensors)
    result = await tools.validate(path)
    assert sorted(result.warnings) == [
        "real: constant 5",
        "w: constant magnitude 5",
        "z: constant magnitude 1",
        "zero: all zeros",
    ]


def test_nan_and_inf_are_counted_apart_and_left_out() -> None:
    rng = np.random.default_rng(4)
    values = rng.standard_normal(200_000).astype(np.float32)
    values[[5, 70_000, 199_999]] = np.nan
    values[[6, 100_000]] = np.inf
    values[131_072] = -np.inf  # the first value of a chunk
    found = moments_of(values)
    assert (found.nan, found.inf, found.count) == (3, 3, 200_000 - 6)
    assert_exact(found, values)
    stats = tensor_stats("x", "F32", [values.size], values)
    assert (stats.nan, stats.inf) == (3, 3)


def test_no_finite_value_leaves_the_statistics_empty() -> None:
    values = np.array([np.nan, np.inf, -np.inf], dtype=np.float16)
    stats = tensor_stats("x", "F16", [3], values)
    assert (stats.min, stats.max, stats.mean, stats.std) == (None, None, None, None)
    assert (stats.nan, stats.inf) == (1, 2)
    packed = tensor_stats("p", "F4", [4], np.zeros(2, np.uint8))
    assert packed.min is None and packed.nan == 0


def test_parts_merge_to_the_whole() -> None:
    values = np.random.default_rng(5).standard_normal(500_000) * 3 + 7
    total = Moments()
    for start in range(0, values.size, 123_457):
        total.merge(moments_of(values, start, start + 123_457))
    assert total.count == values.size
    assert_exact(total, values)
    empty = moments_of(values, 10, 10)
    assert empty.count == 0 and empty.std is None


# -- validate over files --------------------------------------------------------------------------


async def test_big_tensors_in_parts_and_small_ones_whole_match_numpy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With tiny parts and a tiny memory bound every path runs: parts merged, the event loop
    waiting for room in the queue, parts bigger than the bound."""
    monkeypatch.setattr(VALIDATE, "SEGMENT", 10_000)
    monkeypatch.setattr(VALIDATE, "IN_FLIGHT", 30_000)
    rng = np.random.default_rng(6)
    tensors: Arrays = {
        f"t{i:02}": (rng.standard_normal(int(rng.integers(1, 60_000))) * i + 1000).astype(
            np.float32
        )
        for i in range(40)
    }
    tensors["t05"][17] = np.nan
    tensors["empty"] = np.zeros((0, 3), np.float32)
    path = tmp_path / "m.safetensors"
    reference_numpy.save_file(tensors, str(path))
    seen: list[tuple[int, int]] = []
    result = await tools.validate(path, progress=lambda b, t: seen.append((b, t)))
    by_name = {t.name: t for t in result.tensors}
    assert set(by_name) == set(tensors)
    for name, values in tensors.items():
        stats = by_name[name]
        if values.size == 0:
            assert stats.min is None
            continue
        low, high, mean, std = reference(values)
        assert (stats.min, stats.max) == (low, high)
        assert stats.std is not None and math.isclose(stats.std, std, rel_tol=1e-12)
        assert stats.mean is not None and math.isclose(stats.mean, mean, rel_tol=1e-12)
    assert result.errors == ["t05: 1 NaN value"]
    assert seen[-1] == (sum(a.nbytes for a in tensors.values()), len(tensors))
    assert result.load is not None and result.load.tensors == len(tensors)


def parts_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A file of 20 tensors of 3 parts each, the queue holding about one part."""
    monkeypatch.setattr(VALIDATE, "SEGMENT", 10_000)
    monkeypatch.setattr(VALIDATE, "IN_FLIGHT", 50_000)
    rng = np.random.default_rng(8)
    tensors = {f"t{i:02}": rng.standard_normal(30_000).astype(np.float32) for i in range(20)}
    path = tmp_path / "m.safetensors"
    reference_numpy.save_file(tensors, str(path))
    return path


async def assert_no_thread_waits_for_room() -> None:
    """No thread left blocked waiting for room in the queue (one abandoned by a cancellation
    ends once the workers have made room or ended)."""

    def waiting() -> bool:
        for frame in sys._current_frames().values():
            stack = traceback.extract_stack(frame)
            if any(entry.name == "_wait_for_room" for entry in stack):
                return True
        return False

    for _ in range(100):
        if not waiting():
            return
        await anyio.sleep(0.05)
    raise AssertionError("a thread still waits for room")


async def test_cancelled_validation_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled while parts are queued and the event loop waits for room: the workers finish
    what is queued and end, and the cancellation comes through."""
    path = parts_file(tmp_path, monkeypatch)
    seen: list[int] = []
    with anyio.fail_after(30), anyio.CancelScope() as scope:

        def progress(done: int, tensors: int) -> None:
            seen.append(tensors)
            if tensors == 3:
                scope.cancel()

        await tools.validate(path, progress=progress)
    assert scope.cancelled_caught
    assert 3 <= seen[-1] < 20
    await assert_no_thread_waits_for_room()


async def test_a_failing_worker_fails_the_validation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception in a worker ends the validation with it (no hang with the event loop
    waiting for room that the failed worker, the only one, would have made)."""
    path = parts_file(tmp_path, monkeypatch)
    monkeypatch.setattr(VALIDATE, "_workers", lambda: 1)
    calls = 0

    def failing(values: np.ndarray[Any, Any], start: int = 0, stop: int | None = None) -> Moments:
        nonlocal calls
        calls += 1
        if calls == 5:
            raise MemoryError("no room for the scratch")
        return moments_of(values, start, stop)

    monkeypatch.setattr(VALIDATE, "moments_of", failing)
    with anyio.fail_after(30), pytest.raises(MemoryError, match="no room"):
        await tools.validate(path)
    await assert_no_thread_waits_for_room()


async def test_a_hub_file_failing_its_sha256_is_invalid(hub: FakeHub) -> None:
    """A Hub file whose bytes were damaged after the Hub (its CDN's copy), with no digests of
    its own: validate checks it against the Hub's SHA-256 (X-Linked-Etag) as load does, an
    error after every tensor is summarised; the intact file is valid."""
    data = reference_numpy.save({"w": np.arange(1000, dtype=np.float32).reshape(10, 100)})
    hub.push("org/m", {"model.safetensors": data})
    url = "hf://org/m/model.safetensors"
    assert (await tools.validate(url)).ok
    damaged = bytearray(data)
    damaged[-5] ^= 0x40
    hub.cdn.objects[f"/{hashlib.sha256(data).hexdigest()}"] = bytes(damaged)
    result = await tools.validate(url)
    assert [t.name for t in result.tensors] == ["w"]
    assert not result.ok
    assert len(result.errors) == 1
    assert "does not match the Hub's SHA-256 (X-Linked-Etag)" in result.errors[0]
    with pytest.raises(stream_st.IntegrityError, match="does not match the Hub's SHA-256"):
        await stream_st.load(url)


async def test_a_checksummed_file_failing_only_the_hubs_sha256_names_no_tensor(
    hub: FakeHub, tmp_path: Path
) -> None:
    """Every tensor of a checksummed Hub file matches its digest, but the bytes are not the
    Hub's (a metadata value changed): the digests line says the check failed, not "0 tensors"."""
    path = tmp_path / "m.safetensors"
    tensors = {"w": np.arange(1000, dtype=np.float32)}
    await stream_st.save(path, tensors, metadata={"note": "aaaa"}, checksums=True)
    data = path.read_bytes()
    hub.push("org/m", {"model.safetensors": data})
    hub.cdn.objects[f"/{hashlib.sha256(data).hexdigest()}"] = data.replace(b"aaaa", b"bbbb")
    result = await tools.validate("hf://org/m/model.safetensors")
    assert not result.ok
    assert result.digests.endswith(": FAILED (see the errors)")
    assert "does not match the Hub's SHA-256" in result.errors[0]


async def test_results_come_in_file_order(tmp_path: Path) -> None:
    tensors = {f"w{i}": np.full(1000 * (i % 5 + 1), i, np.float32) for i in range(12)}
    path = tmp_path / "m.safetensors"
    reference_numpy.save_file(tensors, str(path))
    header = await stream_st.read_header(path)
    result = await tools.validate(path)
    assert [t.name for t in result.tensors] == header.names()


def layered(layers: list[int], parts: tuple[str, ...] = ("q_proj", "k_proj")) -> Arrays:
    return {
        f"model.layers.{n}.self_attn.{part}.weight": np.ones((2, 2), np.float32) * (n + 1)
        for n in layers
        for part in parts
    }


async def test_a_whole_layer_missing_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    reference_numpy.save_file(layered([0, 1, 3]), str(path))
    result = await tools.validate(path)
    assert not result.ok
    assert result.errors == ["model.layers.N: layer 2 missing (layers 0-1, 3 present)"]
    reference_numpy.save_file(layered([4, 5, 6]), str(path))  # a run of layers: a shard
    assert (await tools.validate(path)).ok


def test_layer_sequence_per_stack() -> None:
    names = [f"encoder.layer.{n}.w" for n in (0, 1, 2)] + [
        f"decoder.layers.{n}.w" for n in (0, 2, 3, 6)
    ]
    assert check_layer_sequence(names) == [
        "decoder.layers.N: layers 1, 4-5 missing (layers 0, 2-3, 6 present)"
    ]
    assert check_layer_sequence(["embed.weight"]) == []


def test_dtype_consistency() -> None:
    assert validate_dtype_consistency({"a": "BF16", "b": "BF16", "codes": "I8"}) == []
    mixed = {"a": "BF16", "b": "BF16", "c": "BF16", "norm": "F32"}
    assert validate_dtype_consistency(mixed) == [
        "floating-point tensors in 2 dtypes: BF16 (3 tensors), F32 (1: ['norm'])"
    ]
    assert validate_dtype_consistency(mixed, "F32") == [
        "floating-point tensors not in the expected F32: BF16 (3: ['a', 'b', 'c'])"
    ]


async def test_validate_warns_about_mixed_dtypes(tmp_path: Path) -> None:
    tensors: Arrays = {
        "a": np.ones(3, ml_dtypes.bfloat16) * 2,
        "b": np.arange(4, dtype=np.float32),
        "c": np.arange(4, dtype=np.float32),
    }
    path = tmp_path / "m.safetensors"
    reference_numpy.save_file(tensors, str(path))
    result = await tools.validate(path)
    assert result.ok
    assert "floating-point tensors in 2 dtypes: F32 (2 tensors), BF16 (1: ['a'])" in result.warnings


# -- a model's config -----------------------------------------------------------------------------

CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 16,
    "intermediate_size": 40,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 3,
    "vocab_size": 50,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def model_tensors(config: dict[str, Any] = CONFIG) -> Arrays:
    rng = np.random.default_rng(0)
    shapes = ModelConfig.from_json(config).shapes()
    return {name: rng.standard_normal(s).astype(np.float32) for name, s in shapes.items()}


def test_config_shapes_come_from_the_llama_model() -> None:
    config = ModelConfig.from_json(CONFIG)
    shapes = config.shapes()
    assert shapes["model.embed_tokens.weight"] == (50, 16)
    assert shapes["lm_head.weight"] == (50, 16)
    assert shapes["model.layers.2.self_attn.k_proj.weight"] == (8, 16)  # 2 heads of 4
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (16, 40)
    assert len(shapes) == 2 + 3 * 9 + 1
    assert config.parameter_count() == 2 * 50 * 16 + 16 + 3 * (
        2 * 16 + 2 * 16 * 16 + 2 * 8 * 16 + 3 * 40 * 16
    )
    tied = ModelConfig.from_json({**CONFIG, "tie_word_embeddings": True})
    assert "lm_head.weight" not in tied.shapes()
    assert tied.parameter_count() == config.parameter_count() - 50 * 16
    assert ModelConfig.from_json({**CONFIG, "num_key_value_heads": None}).num_key_value_heads == 4


async def test_a_model_that_matches_its_config_is_valid(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    reference_numpy.save_file(model_tensors(), str(path))
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(CONFIG))
    for config in (CONFIG, config_path, str(config_path), ModelConfig.from_json(CONFIG)):
        result = await tools.validate(path, config=config)
        assert (result.errors, result.warnings) == ([], [])


async def validate_with(tmp_path: Path, tensors: Arrays, **changes: Any) -> tools.Validation:
    path = tmp_path / "m.safetensors"
    reference_numpy.save_file(tensors, str(path))
    return await tools.validate(path, config={**CONFIG, **changes})


async def test_a_shape_the_config_contradicts_is_an_error(tmp_path: Path) -> None:
    tensors = model_tensors()
    tensors["model.layers.1.mlp.up_proj.weight"] = np.arange(41 * 16, dtype=np.float32).reshape(
        41, 16
    )
    result = await validate_with(tmp_path, tensors)
    assert result.errors == [
        "model.layers.1.mlp.up_proj.weight: shape [41, 16], the config gives [40, 16]"
    ]
    assert result.warnings == ["parameter count 9,792 differs from the config's 9,776 (+0.2%)"]


async def test_missing_parts_and_extra_layers_are_errors(tmp_path: Path) -> None:
    tensors = model_tensors()
    del tensors["model.layers.0.self_attn.v_proj.weight"]
    tensors["model.layers.3.input_layernorm.weight"] = np.ones(16, np.float32)
    result = await validate_with(tmp_path, tensors)
    assert result.errors == [
        "layers 3 beyond the config's 3 layers",
        "layer 0 has no tensor for self_attn.v_proj",
    ]


async def test_layers_missing_around_those_present_are_warnings(tmp_path: Path) -> None:
    """A shard holding layers 1-2 and the head: the config's other tensors are not there."""
    tensors = {
        name: array
        for name, array in model_tensors().items()
        if ".layers.0." not in name and "embed" not in name
    }
    result = await validate_with(tmp_path, tensors)
    assert result.ok
    assert result.warnings[:2] == [
        "expected layers missing: 0 of the config's 3 (layers 1-2 present)",
        "expected tensors missing: ['model.embed_tokens.weight']",
    ]
    assert result.warnings[2].startswith("parameter count 6,256 differs")


async def test_a_hole_is_an_error_with_a_config_too(tmp_path: Path) -> None:
    tensors = {n: a for n, a in model_tensors().items() if ".layers.1." not in n}
    result = await validate_with(tmp_path, tensors)
    assert result.errors == ["model.layers.N: layer 1 missing (layers 0, 2 present)"]
    assert not any("expected layers missing" in w for w in result.warnings)


async def test_tied_heads_unknown_tensors_and_dtypes_are_warnings(tmp_path: Path) -> None:
    tensors = model_tensors()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.arange(2, dtype=np.float32)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.float16)
    result = await validate_with(tmp_path, tensors, tie_word_embeddings=True)
    assert result.ok
    assert result.warnings == [
        "lm_head.weight present, though the config ties it to the embeddings",
        "1 tensor the config does not describe: ['model.layers.0.self_attn.rotary_emb.inv_freq']",
        "parameter count 9,778 differs from the config's 8,976 (+8.9%)",
        "floating-point tensors not in the expected F32: F16 (1: ['model.norm.weight'])",
    ]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_size": "16"}, "hidden_size must be a positive integer"),
        ({"vocab_size": 0}, "vocab_size must be a positive integer"),
        ({"num_hidden_layers": True}, "num_hidden_layers must be a positive integer"),
        ({"num_key_value_heads": 3}, "not a Llama configuration: 4 attention heads, 3 key/v"),
        ({"head_dim": 8}, "head_dim 8 is not hidden_size / num_attention_heads"),
        # "false" was read as true (bool of a non-empty string): a JSON boolean or nothing
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be True or False"),
        ({"tie_word_embeddings": 0}, "tie_word_embeddings must be True or False"),
    ],
)
def test_a_config_no_llama_model_has_is_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(stream_st.UsageError, match=message):
        ModelConfig.from_json({**CONFIG, **changes})


@pytest.mark.parametrize("vocab", [1, 2])
def test_a_config_of_a_small_vocabulary_is_taken(vocab: int) -> None:
    """The Llama decoder's default token ids (1 and 2), which the config never gave, were
    checked against its vocabulary: a vocabulary of 1 or 2 was refused."""
    assert ModelConfig.from_json({**CONFIG, "vocab_size": vocab}).vocab_size == vocab


async def test_the_config_dtype_is_read_as_transformers_reads_it(tmp_path: Path) -> None:
    """A ``"torch_dtype": null`` hid the config's ``"dtype"`` (no dtype, so a BF16 file passed
    without the dtype warning); where both are given, transformers keeps ``dtype``."""
    plain = {key: value for key, value in CONFIG.items() if key != "torch_dtype"}
    cases: list[tuple[dict[str, str | None], str | None]] = [
        ({"dtype": "float32"}, "F32"),
        ({"torch_dtype": None, "dtype": "float32"}, "F32"),
        ({"torch_dtype": "float32", "dtype": None}, "F32"),
        ({"torch_dtype": "float32", "dtype": "bfloat16"}, "BF16"),
        ({"torch_dtype": "bfloat16", "dtype": "float32"}, "F32"),
        ({"torch_dtype": None, "dtype": None}, None),
    ]
    for dtypes, expected in cases:
        assert ModelConfig.from_json({**plain, **dtypes}).dtype == expected, dtypes
    path = tmp_path / "m.safetensors"
    narrow = {name: array.astype(ml_dtypes.bfloat16) for name, array in model_tensors().items()}
    reference_numpy.save_file(narrow, str(path))
    result = await tools.validate(path, config={**plain, "torch_dtype": None, "dtype": "float32"})
    assert [warning.split(":")[0] for warning in result.warnings] == [
        "floating-point tensors not in the expected F32"
    ]


def test_an_unreadable_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(stream_st.SafetensorsError, match="cannot read the model config"):
        ModelConfig.read(tmp_path / "nope.json")
    bad = tmp_path / "config.json"
    bad.write_text("[1, 2]")
    with pytest.raises(stream_st.UsageError, match="must be a JSON object"):
        ModelConfig.read(bad)


# -- the command ----------------------------------------------------------------------------------


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [COMMAND, *args], capture_output=True, text=True, timeout=120, env=dict(os.environ)
    )


def test_the_command_checks_a_config_and_reports_the_read(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    reference_numpy.save_file(model_tensors(), str(path))
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    good = run("validate", "-q", "--config", str(config), "--stats", str(path))
    assert good.returncode == 0, good.stdout + good.stderr
    assert "valid: 30 tensors, 0 errors, 0 warnings" in good.stdout
    assert good.stdout.splitlines()[-1].startswith("load: 30 tensors, ")
    record = json.loads(run("validate", "--json", "--stats", str(path)).stdout)
    assert record["load"]["tensors"] == 30
    assert record["load"]["bytes_read"] == path.stat().st_size
    assert "load" not in json.loads(run("validate", "--json", str(path)).stdout)
    config.write_text(json.dumps({**CONFIG, "intermediate_size": 48}))
    bad = run("validate", "-q", "--config", str(config), str(path))
    assert bad.returncode == 1
    assert "the config gives [48, 16]" in bad.stdout
    config.write_text("{")
    broken = run("validate", "-q", "--config", str(config), str(path))
    assert broken.returncode == 2 and "cannot read the model config" in broken.stderr


CTRL_C_EVERYWHERE = """
import sys, anyio, numpy as np, safetensors.numpy as reference
from stream_st import tools
from stream_st.core import digests
from tests.ctrl_c import everywhere

VALIDATE = sys.modules["stream_st.tools.validate"]
VALIDATE.SEGMENT, VALIDATE.IN_FLIGHT = 10_000, 50_000  # parts, the queue holding about one
path = sys.argv[1]
rng = np.random.default_rng(8)
reference.save_file({f"t{i}": rng.random(30_000).astype(np.float32) for i in range(6)}, path)

async def check(at):
    await tools.validate(path)

print(anyio.run(everywhere, check, VALIDATE.__file__, backend="trio"))
"""


def test_ctrl_c_anywhere_in_the_validation_under_trio_never_hangs(tmp_path: Path) -> None:
    """Ctrl-C under trio raises KeyboardInterrupt wherever the event loop's thread runs, in
    Python code too: a validation, interrupted at each place of its code in turn, ends every
    time. Raised in ``threading.Condition.__enter__`` after the acquire, the lock stayed held:
    the workers blocked on it and the validation waited for them for ever."""
    tried = run_script(CTRL_C_EVERYWHERE, str(tmp_path / "m.safetensors"))
    assert tried >= 20  # the trace reached the queue's lock


async def test_a_dataset_s_columns_are_validated_shard_by_shard(tmp_path: Path) -> None:
    """A batch-mode dataset repeats its columns in every shard: validate refused it ("in more
    than one shard"), and reading it by name alone would have checked every shard's tensor
    against the last shard's digest. Each shard's tensor is now checked against its own header
    and digest, and reported as ``x (shard N)``, as ``diff`` names it."""
    async with stream_st.open_dataset_writer(
        tmp_path / "d", target_shard_size=1, checksums=True
    ) as writer:
        for shard in range(3):
            await writer.write_batch({"x": np.full((4 - shard, 2), shard, np.float32)}, 4 - shard)
    manifest = tmp_path / "d" / "dataset_manifest.json"
    result = await tools.validate(manifest, expect_shapes={"x": [4, 2]})
    assert [(t.name, t.min, t.shape) for t in result.tensors] == [
        ("x (shard 0)", 0, [4, 2]),
        ("x (shard 1)", 1, [3, 2]),
        ("x (shard 2)", 2, [2, 2]),
    ]
    assert result.digests == "xxh3-128: 3 tensors verified"
    assert result.errors == [
        "x (shard 1): shape [3, 2], expected [4, 2]",
        "x (shard 2): shape [2, 2], expected [4, 2]",
    ]
    second = sorted((tmp_path / "d").glob("*.safetensors"))[1]  # shard 1: its data comes last
    data = bytearray(second.read_bytes())
    data[-4:] = np.float32(5).tobytes()
    second.write_bytes(bytes(data))
    result = await tools.validate(manifest)
    assert result.digests == "xxh3-128: FAILED (1 tensor of 3)"
    (error,) = result.errors
    assert error.startswith("x (shard 1): does not match its xxh3-128 digest (recorded ")
    assert [(t.name, t.max) for t in result.tensors][1] == ("x (shard 1)", 5)


async def test_deadline_bounds_the_summaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The summaries were no wait for the transport: a 512 MiB tensor was summarised to its
    end (seconds) past deadline=0.3. Its data is a hole: made and mapped at once. Each part's
    summary is slowed to 0.1 s here (128 parts: 3.2 s on four threads), so the deadline passes
    before the summaries end on any machine (a fast one summarised all the zeros within 0.3 s)."""
    path = tmp_path / "big.safetensors"
    size = 512 << 20
    header = json.dumps({"x": {"dtype": "F32", "shape": [size // 4], "data_offsets": [0, size]}})
    text = header.encode().ljust(-(-len(header) // 8) * 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text)
    os.truncate(path, path.stat().st_size + size)
    summarised: list[int] = []

    def slow(array: Any, start: int = 0, stop: int | None = None) -> Moments:
        summarised.append(start)
        time.sleep(0.1)
        return moments_of(array, start, stop)

    monkeypatch.setattr(importlib.import_module("stream_st.tools.validate"), "moments_of", slow)
    with pytest.raises(stream_st.ReadTimeoutError, match=r"deadline of 1 s passed"):
        await tools.validate(path, deadline=1)
    assert len(summarised) < 128


async def test_deadline_bounds_a_big_tensors_digest_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checksummed big tensor's digest, which validate checks on the file's mapping, was
    hashed to its end past the deadline, where the reader's check of the same view stops
    between two slices. Each 1 MiB slice's hash slowed down to 0.05 s here: 32 of them."""
    path = tmp_path / "big.safetensors"
    await stream_st.save(path, {"x": np.ones(32 << 20, np.uint8)}, checksums=True)
    fresh = digests.Digests.hasher
    hashed: list[int] = []

    class Slow:
        def __init__(self, hasher: Any) -> None:
            self.hasher = hasher

        def update(self, data: Any) -> None:
            hashed.append(len(data))
            time.sleep(0.05)
            self.hasher.update(data)

        def digest(self) -> bytes:
            return bytes(self.hasher.digest())

    monkeypatch.setattr(digests, "HASH_SLICE", 1 << 20)
    monkeypatch.setattr(digests.Digests, "hasher", lambda self: Slow(fresh(self)))
    with pytest.raises(stream_st.ReadTimeoutError, match=r"deadline of 0\.5 s passed"):
        await tools.validate(path, deadline=0.5)
    assert len(hashed) < 32


async def test_expect_layers_checks_each_stack_apart(tmp_path: Path) -> None:
    """Layers were grouped by their number alone: a decoder's layer 1 lacking q_proj passed,
    the encoder's layer 1 holding one."""
    parts = ("q_proj", "k_proj")
    tensors = {
        f"model.{stack}.layers.{n}.self_attn.{part}.weight": np.ones(2, np.float32)
        for stack in ("encoder", "decoder")
        for n in (0, 1)
        for part in parts
    }
    del tensors["model.decoder.layers.1.self_attn.q_proj.weight"]
    path = tmp_path / "m.safetensors"
    reference_numpy.save_file(tensors, str(path))
    result = await tools.validate(path, expect_layers=list(parts))
    assert result.errors == ["layer model.decoder.layers.1 has no tensor for q_proj"]
