"""The eleventh attack, on the tools: diff of datasets, validate's config, integer statistics and
arguments. Each test failed before its mend."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from safetensors.numpy import save_file as reference_save

import stream_st
from stream_st import tools
from stream_st.cli import main
from stream_st.tools.model_checks import ModelConfig, check_layer_sequence

CONFIG = {
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 32,
    "tie_word_embeddings": True,
}


async def _dataset(path: Path, shards: int) -> Path:
    """A dataset of one column ``x``, one batch (one shard) of four rows each."""
    async with stream_st.open_dataset_writer(path, target_shard_size=1) as writer:
        for shard in range(shards):
            await writer.write_batch({"x": np.full(4, shard, np.float32)}, samples=4)
    return path / "dataset_manifest.json"


async def _checkpoint(path: Path, largest: int) -> Path:
    """A sharded checkpoint of the same three tensors, ``largest`` bytes a shard at most."""
    async with stream_st.open_sharded_writer(path, max_shard_size=largest) as writer:
        for name in ("a", "b", "c"):
            await writer.write(name, np.zeros(64, np.float32))
    (index,) = path.glob("*.index.json")
    return index


async def test_diff_tells_datasets_of_different_shard_counts_apart(tmp_path: Path) -> None:
    """Two datasets of 2 and 5 shards of column x were "equal": their tensors were put in one
    dict by name, the name every shard repeats kept once."""
    two = await _dataset(tmp_path / "two", 2)
    five = await _dataset(tmp_path / "five", 5)
    found = await tools.diff(two, five)
    assert not found.equal
    assert found.added == ["x (shard 2)", "x (shard 3)", "x (shard 4)"]
    assert (found.removed, found.changed) == ([], {})
    assert (await tools.diff(five, two)).removed == found.added
    assert (await tools.diff(five, five)).equal
    # names held once are compared by name, whichever shard holds them (as before)
    one_shard = await _checkpoint(tmp_path / "one", 1 << 20)
    three_shards = await _checkpoint(tmp_path / "three", 300)
    layouts = await tools.diff(one_shard, three_shards, content=True)
    assert layouts.equal and layouts.content_compared


def test_diff_command_says_datasets_differ(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``stream-st diff`` said "equal", exit 0, for datasets of 2 and 3 shards."""
    two = anyio.run(_dataset, tmp_path / "two", 2)
    three = anyio.run(_dataset, tmp_path / "three", 3)
    assert main(["diff", str(two), str(three)]) == 1
    assert capsys.readouterr().out.splitlines() == ["+ x (shard 2)"]
    assert main(["diff", "--json", str(three), str(two)]) == 1
    record = json.loads(capsys.readouterr().out)
    assert (record["removed"], record["equal"]) == (["x (shard 2)"], False)


CLI = "import sys; from stream_st.cli import main; sys.exit(main(sys.argv[1:]))"


def _bounded(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Python ``code`` run with ``args`` in a process of 2 GiB of address space at most, for
    60 s at most: what was unbounded before its mend fails the test, not the machine."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=limit,
    )


@pytest.mark.skipif(sys.platform != "linux", reason="limits the address space (Linux)")
def test_validate_config_counts_cost_what_the_file_holds(tmp_path: Path) -> None:
    """A config of 10**8 layers built every name it implies: a MemoryError, reported as an
    internal error (exit 3), after seconds (10**6 layers: 37 s and 1.75 GB)."""
    model = tmp_path / "tiny.safetensors"
    shapes = ModelConfig.from_json(CONFIG).shapes()
    reference_save({n: np.full(s, 0.5, np.float32) for n, s in shapes.items()}, str(model))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**CONFIG, "num_hidden_layers": 10**8}))
    done = _bounded(CLI, "validate", "-q", "--config", str(config), str(model))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "expected layers missing: 2-99999999 of the config's 100000000" in done.stdout
    other = tmp_path / "other.safetensors"
    reference_save({"a": np.zeros(3, np.float32)}, str(other))
    done = _bounded(CLI, "validate", "-q", "--config", str(config), str(other))
    assert done.returncode == 1, done.stderr[-2000:]
    assert "the config expects 900000002 tensors" in done.stdout


@pytest.mark.parametrize("layers", [2**63, 10**400])
def test_validate_config_refuses_numbers_no_model_has(layers: object) -> None:
    """Numbers beyond any model's were taken, to be counted up to (or to crash on)."""
    with pytest.raises(stream_st.UsageError, match="num_hidden_layers must be a positive"):
        ModelConfig.from_json({**CONFIG, "num_hidden_layers": layers})


def test_model_config_refuses_what_is_not_a_count() -> None:
    """ModelConfig(...) made directly took floats and negative numbers, a crash later."""
    numbers: dict[str, Any] = {k: v for k, v in CONFIG.items() if k != "tie_word_embeddings"}
    numbers["num_key_value_heads"] = 2
    with pytest.raises(stream_st.ArgumentTypeError, match=r"ModelConfig\.hidden_size"):
        ModelConfig(**{**numbers, "hidden_size": 8.0})
    with pytest.raises(stream_st.UsageError, match=r"ModelConfig\.num_hidden_layers"):
        ModelConfig(**{**numbers, "num_hidden_layers": -1})


@pytest.mark.skipif(sys.platform != "linux", reason="limits the address space (Linux)")
def test_layer_sequence_spans_far_layers_without_listing_them() -> None:
    """Layers 0 and 10**15 in a file's names made a set of every layer between them."""
    code = (
        "from stream_st.tools.model_checks import check_layer_sequence\n"
        "names = ['model.layers.0.a', 'model.layers.5.a', f'model.layers.{10**15}.a']\n"
        "print(check_layer_sequence(names))"
    )
    done = _bounded(code)
    assert done.returncode == 0, done.stderr[-2000:]
    found = f"layers 1-4, 6-{10**15 - 1} missing (layers 0, 5, {10**15} present)"
    assert done.stdout == repr([f"model.layers.N: {found}"]) + "\n"
    assert check_layer_sequence(["h.0.a", "h.2.a", "h.3.a"]) == [
        "h.N: layer 1 missing (layers 0, 2-3 present)"
    ]


def test_validate_min_and_max_of_64_bit_integers_are_exact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """min and max (documented exact) went through float64: 2**53 + 1 came out 2**53; the mean
    of [-2**63, 2**63 - 1, 5] was 0.0."""
    path = tmp_path / "ids.safetensors"
    arrays = {
        "ids": np.array([2**53 + 1, 2**53 + 3], np.int64),
        "ends": np.array([-(2**63), 2**63 - 1, 5], np.int64),
        "big": np.array([2**64 - 1, 2**64 - 3, 0], np.uint64),
    }
    reference_save(arrays, str(path))
    found = {t.name: t for t in anyio.run(tools.validate, path).tensors}
    for name, array in arrays.items():
        low, high = found[name].min, found[name].max
        assert (low, high) == (int(array.min()), int(array.max())), name
        assert type(low) is int and type(high) is int
    assert found["ends"].mean == 4 / 3
    assert found["big"].mean == (2**65 - 4) / 3
    assert main(["validate", "-q", "--json", str(path)]) == 0
    record = json.loads(capsys.readouterr().out)
    shown = {t["name"]: (t["min"], t["max"]) for t in record["tensors"]}
    assert shown["ids"] == (2**53 + 1, 2**53 + 3)
    assert shown["big"] == (0, 2**64 - 1)


@pytest.mark.parametrize(
    ("arguments", "refusal", "match"),
    [
        ({"expect_shapes": [("a", [3, 4])]}, stream_st.ArgumentTypeError, "expect_shapes takes"),
        ({"expect_shapes": {"a": 5}}, stream_st.ArgumentTypeError, r"expect_shapes\['a'\]"),
        ({"expect_shapes": {"a": [3, -4]}}, stream_st.UsageError, r"expect_shapes\['a'\]"),
        ({"expect_shapes": {"a": [True]}}, stream_st.ArgumentTypeError, r"expect_shapes\['a'\]"),
        ({"expect_shapes": {1: [3]}}, stream_st.ArgumentTypeError, "tensor names are str"),
        ({"expect_layers": "q_proj"}, stream_st.ArgumentTypeError, "expect_layers takes"),
        ({"progress": 5}, stream_st.ArgumentTypeError, "progress takes a callable"),
        ({"warn_abs": None}, stream_st.ArgumentTypeError, "warn_abs takes a number"),
        ({"warn_abs": "1"}, stream_st.ArgumentTypeError, "warn_abs takes a number"),
        ({"warn_abs": -1}, stream_st.UsageError, "warn_abs must be a number >= 0"),
    ],
)
async def test_validate_names_the_argument_it_cannot_take(
    tmp_path: Path, arguments: dict[str, Any], refusal: type[Exception], match: str
) -> None:
    """validate(expect_shapes=[...]) raised AttributeError, {'a': 5} and progress=5 TypeError;
    a negative or boolean dimension was compared as if a shape could have it; warn_abs=None
    was taken and compared with the first tensor's values (a bare TypeError)."""
    path = tmp_path / "a.safetensors"
    reference_save({"a": np.zeros((3, 4), np.float32)}, str(path))
    with pytest.raises(refusal, match=match):
        await tools.validate(path, **arguments)


async def test_validate_takes_warn_abs_of_any_real_number(tmp_path: Path) -> None:
    """validate(warn_abs=Fraction(1, 3)) passed the argument check, read the whole file, then
    failed formatting its warning (a bare TypeError); any Real number is taken as a float."""
    path = tmp_path / "a.safetensors"
    reference_save({"w": np.array([1.0, 5.0], np.float32)}, str(path))
    third: Any = Fraction(1, 3)  # a Real, not the float the signature names
    found = await tools.validate(path, warn_abs=third)
    assert [w for w in found.warnings if "(beyond 0.333333)" in w] != []


@pytest.mark.parametrize("shape", [[3, -4], [True, 4]])
def test_validate_expect_shapes_file_refuses_dimensions_no_shape_has(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], shape: list[Any]
) -> None:
    """--expect-shapes took [3, -4] and [true, 4]: the file was called invalid (exit 1), not the
    option (exit 2)."""
    path = tmp_path / "a.safetensors"
    reference_save({"a": np.zeros((3, 4), np.float32)}, str(path))
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"a": shape}))
    assert main(["validate", "-q", "--expect-shapes", str(shapes), str(path)]) == 2
    assert "--expect-shapes" in (error := capsys.readouterr().err) and "integers >= 0" in error
