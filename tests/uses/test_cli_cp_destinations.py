"""``stream-st cp`` destinations as ``cp`` and ``aws s3 cp`` take them, and sharded checkpoints
mirrored (every shard, the index last) or merged on request."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy as reference_numpy
from safetensors import safe_open

import stream_st
from stream_st.tools import mirror

from ..servers.s3_server import CREDENTIALS, MotoS3Server
from ._cli import run, write_model

SHARDS: dict[str, dict[str, np.ndarray[Any, Any]]] = {
    "model-00001-of-00002.safetensors": {"a": np.arange(4, dtype=np.float32)},
    "model-00002-of-00002.safetensors": {"b": np.ones((2, 2), np.float32), "c": np.zeros(3)},
}
INDEX = "model.safetensors.index.json"
KEPT = "kept_tensors"


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    weight_map = {}
    for shard, tensors in SHARDS.items():
        reference_numpy.save_file(tensors, str(folder / shard))
        weight_map.update(dict.fromkeys(tensors, shard))
    (folder / INDEX).write_text(
        json.dumps({"metadata": {"total_size": 60}, "weight_map": weight_map})
    )
    return folder


def _s3_env(moto_s3: MotoS3Server) -> dict[str, str]:
    return {**CREDENTIALS, "AWS_ENDPOINT_URL": moto_s3.endpoint_url}


def test_into_a_directory_or_prefix_under_the_sources_name(
    tmp_path: Path, moto_s3: MotoS3Server
) -> None:
    """A trailing slash meant nothing: an object named p/ and a file named newdir."""
    model = write_model(tmp_path / "m.safetensors")
    result = run("cp", "-q", str(model), str(tmp_path / "newdir") + "/")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "newdir" / "m.safetensors").read_bytes() == model.read_bytes()
    existing = tmp_path / "existing"
    existing.mkdir()
    assert run("cp", "-q", str(model), str(existing)).returncode == 0
    assert (existing / "m.safetensors").read_bytes() == model.read_bytes()
    client = moto_s3.client()
    client.create_bucket(Bucket="dest")
    env = _s3_env(moto_s3)
    result = run("cp", "-q", str(model), "s3://dest/p/", env=env)
    assert result.returncode == 0, result.stderr
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="dest")["Contents"]]
    assert keys == ["p/m.safetensors"]
    assert run("cp", "-q", str(model), "s3://dest/exact.bin", env=env).returncode == 0
    body = client.get_object(Bucket="dest", Key="exact.bin")["Body"].read()
    assert body == model.read_bytes()
    assert (
        run("cp", "-q", "-", str(tmp_path / "newdir") + "/", stdin=model.open("rb")).returncode == 2
    )


def test_a_file_url_source_gives_the_name_of_the_file_it_reads(tmp_path: Path) -> None:
    """``cp file:///d/sp%20ace.safetensors OUT/`` read ``sp ace.safetensors`` but named the
    copy ``sp%20ace.safetensors``: the URL's name was taken undecoded."""
    model = write_model(tmp_path / "sp ace.safetensors")
    result = run("cp", "-q", model.as_uri(), str(tmp_path / "out") + "/")
    assert result.returncode == 0, result.stderr
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["sp ace.safetensors"]


def test_a_file_url_index_is_mirrored_under_the_name_it_is_read_by(
    checkpoint: Path, tmp_path: Path
) -> None:
    """Mirroring ``file:///d/my%20model.safetensors.index.json`` wrote the index as
    ``my%20model.safetensors.index.json``: its name was the URL's, undecoded."""
    index = (checkpoint / INDEX).rename(checkpoint / f"my {INDEX}")
    result = run("cp", "-q", index.as_uri(), str(tmp_path / "out") + "/")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([*SHARDS, index.name])


@pytest.mark.parametrize(
    ("into", "said"),
    [
        ("afile/", "a file is in the way, url={tmp}/afile"),
        ("afile/sub/", "a file is in the way, url={tmp}/afile"),
        ("a" * 300 + "/", "File name too long"),
    ],
    ids=["a file", "under a file", "a name too long"],
)
def test_a_directory_that_cannot_be_made_is_an_error(tmp_path: Path, into: str, said: str) -> None:
    """os.makedirs' own exception escaped as an internal error (exit 3, a traceback)."""
    model = write_model(tmp_path / "m.safetensors")
    (tmp_path / "afile").write_text("hi")
    result = run("cp", "-q", str(model), f"{tmp_path}/{into}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert f"cannot make the directory: {said.format(tmp=tmp_path)}" in result.stderr
    assert (tmp_path / "afile").read_text() == "hi"


def test_a_failed_copy_into_a_new_directory_leaves_no_directory(tmp_path: Path) -> None:
    """The directories made for the copy were left when it failed."""
    model = write_model(tmp_path / "m.safetensors")
    text = tmp_path / "notes.txt"
    text.write_text("not safetensors")
    assert run("cp", "-q", str(text), f"{tmp_path}/new1/").returncode == 2
    assert run("cp", "-q", "--include", "nope", str(model), f"{tmp_path}/new2/a/b/").returncode == 2
    (tmp_path / "old").mkdir()
    assert run("cp", "-q", str(text), f"{tmp_path}/old/new/").returncode == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors", "notes.txt", "old"]
    assert list((tmp_path / "old").iterdir()) == []  # the directory it did not make is kept


def test_a_sharded_checkpoint_is_mirrored_index_last(checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    for source in (str(checkpoint), str(checkpoint / INDEX)):
        result = run("cp", "-q", source, str(out) + "/")
        assert result.returncode == 0, result.stderr
        assert sorted(p.name for p in out.iterdir()) == sorted([*SHARDS, INDEX])
        for name in [*SHARDS, INDEX]:
            assert (out / name).read_bytes() == (checkpoint / name).read_bytes(), name
        index_time = (out / INDEX).stat().st_mtime_ns
        assert all((out / s).stat().st_mtime_ns <= index_time for s in SHARDS)
    converted = tmp_path / "bf16"
    result = run("cp", "-q", "--dtype", "bf16", "--include", "a", str(checkpoint), f"{converted}/")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in converted.iterdir()) == sorted([INDEX, next(iter(SHARDS))])
    index = json.loads((converted / INDEX).read_text())
    assert index["weight_map"] == {"a": next(iter(SHARDS))}
    assert index["metadata"]["total_size"] == 8
    listed = run("inspect", "--json", str(converted / INDEX))
    assert [t["dtype"] for t in json.loads(listed.stdout)["tensors"]] == ["BF16"]


def test_a_mirror_quantizes_and_dequantizes(checkpoint: Path, tmp_path: Path) -> None:
    """``cp --quantize int8 INDEX DIR/`` (and ``--dequantize``) failed on every shard copied
    whole ('the shard's tensors differ from those the index assigns it': the copy, with its
    ``.scale`` tensors, was checked against the source's index); the mirror round-trips, with a
    swapped index still refused before a shard is written. Tensors ``--dequantize`` would pair
    otherwise than as quantized across shards (an I8 ``x`` in one beside ``x.scale`` in another,
    or a ``w.scale`` written into two) are refused, leaving nothing."""
    quantized, back = tmp_path / "q8", tmp_path / "back"
    done = run("cp", "-q", "--quantize", "int8", str(checkpoint / INDEX), f"{quantized}/")
    assert done.returncode == 0, done.stderr
    weight_map = json.loads((quantized / INDEX).read_text())["weight_map"]
    first, second = SHARDS
    assert weight_map == {
        **dict.fromkeys(["a", "a.scale"], first),
        **dict.fromkeys(["b", "b.scale", "c", "c.scale"], second),
    }
    done = run("cp", "-q", "--dequantize", str(quantized / INDEX), f"{back}/")
    assert done.returncode == 0, done.stderr
    for shard, tensors in SHARDS.items():
        found = reference_numpy.load_file(str(back / shard))
        assert sorted(found) == sorted(tensors)
        for name, array in tensors.items():
            assert found[name].dtype == array.dtype
            np.testing.assert_allclose(found[name], array, atol=3 / 127)
    swapped = json.loads((checkpoint / INDEX).read_text())
    swapped["weight_map"] = {"a": second, "b": first, "c": first}
    (checkpoint / INDEX).write_text(json.dumps(swapped))
    refused = run("cp", "-q", "--quantize", "int8", str(checkpoint / INDEX), f"{tmp_path}/no/")
    assert refused.returncode == 2 and "differ from those the index assigns" in refused.stderr
    split: list[tuple[str, dict[str, np.ndarray[Any, Any]], dict[str, np.ndarray[Any, Any]]]] = [
        ("tensor 'x', not", {"x": np.ones(2, np.int8)}, {"x.scale": np.ones(1, np.float32)}),
        ("'w.scale' into both", {"w": np.ones(2)}, {"w.scale": np.ones(1)}),
    ]
    for number, (named, *pair) in enumerate(split):
        folder = tmp_path / f"pair{number}"
        folder.mkdir()
        shards = {}
        for shard, part in zip(SHARDS, pair, strict=True):
            reference_numpy.save_file(part, str(folder / shard))
            shards.update(dict.fromkeys(part, shard))
        (folder / INDEX).write_text(json.dumps({"weight_map": shards}))
        refused = run("cp", "-q", "--quantize", "int8", str(folder / INDEX), f"{tmp_path}/no/")
        assert refused.returncode == 2 and named in refused.stderr, refused.stderr
    assert not (tmp_path / "no").exists()


def test_merging_is_asked_for(checkpoint: Path, tmp_path: Path) -> None:
    """A sharded checkpoint was merged into one file, even under the index's name."""
    target = tmp_path / INDEX
    refused = run("cp", "-q", str(checkpoint), str(target))
    assert refused.returncode == 2 and "--merge" in refused.stderr
    assert not target.exists()
    assert run("cp", "-q", "--merge", str(checkpoint), str(target)).returncode == 2
    assert not target.exists()
    merged = tmp_path / "merged.safetensors"
    assert run("cp", "-q", "--merge", str(checkpoint), str(merged)).returncode == 0
    assert sorted(reference_numpy.load_file(str(merged))) == ["a", "b", "c"]
    into = tmp_path / "into"
    assert run("cp", "-q", "--merge", str(checkpoint / INDEX), f"{into}/").returncode == 0
    assert [p.name for p in into.iterdir()] == ["model.safetensors"]


def test_mirror_to_s3(checkpoint: Path, moto_s3: MotoS3Server) -> None:
    client = moto_s3.client()
    client.create_bucket(Bucket="mirror")
    result = run("cp", "-q", str(checkpoint), "s3://mirror/m/", env=_s3_env(moto_s3))
    assert result.returncode == 0, result.stderr
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket="mirror")["Contents"])
    assert keys == sorted(f"m/{n}" for n in [*SHARDS, INDEX])
    back = run("ls", f"s3://mirror/m/{INDEX}", env=_s3_env(moto_s3))
    assert sorted(back.stdout.split()) == ["a", "b", "c"], back.stderr
    assert os.environ.get("AWS_ENDPOINT_URL") != moto_s3.endpoint_url


WEIGHTS = np.linspace(-3, 3, 32, dtype=np.float32).reshape(4, 8)


def _quantized(tmp_path: Path, shard_of: dict[str, str]) -> Path:
    """A file of ``w`` (F32) and ``b`` (I32) quantized to int8 by ``cp`` (``q.safetensors``),
    and split into the shards ``shard_of`` names for ``w``, ``w.scale`` and ``b``: their index."""
    source, quantized = tmp_path / "src.safetensors", tmp_path / "q.safetensors"
    reference_numpy.save_file({"w": WEIGHTS, "b": np.ones(2, np.int32)}, str(source))
    done = run("cp", "-q", "--quantize", "int8", str(source), str(quantized))
    assert done.returncode == 0, done.stderr
    codes = reference_numpy.load_file(str(quantized))
    folder = tmp_path / "quantized"
    folder.mkdir()
    for shard in set(shard_of.values()):
        part = {name: codes[name] for name, where in shard_of.items() if where == shard}
        reference_numpy.save_file(part, str(folder / shard), metadata=_metadata(quantized))
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": shard_of}))
    return folder / INDEX


def _mirrored_quantized(
    tmp_path: Path, tensors: dict[str, dict[str, np.ndarray[Any, Any]]]
) -> tuple[Path, Path]:
    """``tensors`` (each shard's) saved as a sharded checkpoint in ``src``, then mirrored by
    ``cp --quantize int8`` into ``q8``: the two folders."""
    src, quantized = tmp_path / "src", tmp_path / "q8"
    src.mkdir()
    for shard, part in tensors.items():
        reference_numpy.save_file(part, str(src / shard))
    weight_map = {name: shard for shard, part in tensors.items() for name in part}
    (src / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    done = run("cp", "-q", "--quantize", "int8", str(src / INDEX), f"{quantized}/")
    assert done.returncode == 0, done.stderr
    return src, quantized


def _metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), "np") as opened:
        metadata: dict[str, str] = opened.metadata()
    return metadata


def test_dtype_of_a_quantized_source_is_refused_without_dequantize(tmp_path: Path) -> None:
    """``cp --dtype bf16`` of a file quantized to int8 converted its F32 ``w.scale`` too, exit
    0, the copy still said compression INT8, and ``cp --dequantize`` of it failed ('INT8 scale
    must be float32'). It is refused, naming ``--dequantize``, before anything is written, in
    one file, a merge and a mirror alike; with ``--dequantize`` it rebuilds the tensors as
    BF16."""
    first, second = SHARDS
    index = _quantized(tmp_path, {"w": first, "w.scale": first, "b": second})
    quantized = tmp_path / "q.safetensors"
    out = tmp_path / "out"
    for source, merge in ((quantized, []), (index, ["--merge"]), (index, [])):
        refused = run("cp", "-q", "--dtype", "bf16", *merge, str(source), f"{out}/")
        assert refused.returncode == 2, refused.stderr
        assert "dtype= (--dtype): the source is quantized (INT8" in refused.stderr
        assert "add dequantize= (--dequantize)" in refused.stderr
        assert not out.exists()
    back = tmp_path / "back.safetensors"
    done = run("cp", "-q", "--dtype", "bf16", "--dequantize", str(quantized), str(back))
    assert done.returncode == 0, done.stderr
    with safe_open(str(back), "pt") as opened:
        assert str(opened.get_slice("w").get_dtype()) == "BF16"


def test_dequantize_refuses_codes_without_their_scale(tmp_path: Path) -> None:
    """``cp --dequantize --include w`` of a file quantized to int8 wrote ``w``'s I8 codes as
    the copy, exit 0, the codec's keys dropped (``dequantized_from: 0 tensors``: nothing said
    they were codes), in a mirror too; ``--include w.scale`` the scale alone. Both are refused,
    naming what is left out, before anything is written; a tensor not quantized is taken
    alone."""
    first = next(iter(SHARDS))
    index = _quantized(tmp_path, dict.fromkeys(["w", "w.scale", "b"], first))
    out = tmp_path / "out"
    for source in (tmp_path / "q.safetensors", index):
        for taken, left in (("w", "'w.scale'"), ("w.scale", "'w'")):
            refused = run("cp", "-q", "--dequantize", "--include", taken, str(source), f"{out}/")
            assert refused.returncode == 2, refused.stderr
            assert f"(--include) leaves out {left}: include {left} as well" in refused.stderr
            assert not out.exists()
    both = ("--include", "w", "--include", "w.scale")
    done = run("cp", "-q", "--dequantize", *both, str(index), f"{out}/")
    assert done.returncode == 0, done.stderr
    found = reference_numpy.load_file(str(out / first))
    np.testing.assert_allclose(found.pop("w"), WEIGHTS, atol=3 / 127)
    assert found == {}
    done = run(
        "cp", "-q", "--dequantize", "--include", "b", str(tmp_path / "q.safetensors"), f"{out}/"
    )
    assert done.returncode == 0, done.stderr
    assert list(reference_numpy.load_file(str(out / "q.safetensors"))) == ["b"]


def test_a_mirror_refuses_to_dequantize_a_tensor_split_between_shards(tmp_path: Path) -> None:
    """A quantized checkpoint whose ``w`` (I8 codes) and ``w.scale`` lie in different shards
    was mirrored by ``cp --dequantize`` with the pair copied as it was (I8 codes, exit 0), and
    with ``--include w`` the codes alone: a mirror rebuilds each shard's tensors from that shard.
    Both are refused before anything is written, the first naming the shards; ``--merge``
    rebuilds it, and a mirror leaving the pair out is taken."""
    first, second = SHARDS
    index = _quantized(tmp_path, {"w": first, "w.scale": second, "b": second})
    out = tmp_path / "out"
    refused = run("cp", "-q", "--dequantize", str(index), f"{out}/")
    assert refused.returncode == 2, refused.stderr
    assert f"tensor 'w' (in {first}) from 'w.scale' too (in {second})" in refused.stderr
    assert "(cp(), --merge)" in refused.stderr
    refused = run("cp", "-q", "--dequantize", "--include", "w", str(index), f"{out}/")
    assert refused.returncode == 2 and "(--include) leaves out 'w.scale'" in refused.stderr
    assert not out.exists()
    merged = tmp_path / "merged.safetensors"
    done = run("cp", "-q", "--dequantize", "--merge", str(index), str(merged))
    assert done.returncode == 0, done.stderr
    np.testing.assert_allclose(reference_numpy.load_file(str(merged))["w"], WEIGHTS, atol=3 / 127)
    done = run("cp", "-q", "--dequantize", "--include", "b", str(index), f"{out}/")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted([INDEX, second])


def test_a_shard_of_a_quantized_mirror_is_dequantized_alone(tmp_path: Path) -> None:
    """One shard of a mirror quantized by ``cp --quantize``, whose I8 tensor ``k`` was kept as it
    was, was refused by ``cp --dequantize`` (I8 tensor 'k' has no 'k.scale'): its
    ``quantized_tensors`` counts the whole checkpoint's tensors, so it could not say ``k`` was
    kept. The mirror names the tensors it kept (``kept_tensors``, in every shard), and each
    shard is dequantized alone; a shard whose I8 tensor it does not name, codes that lost their
    scale or a record that is no list of names, is still refused. Shards quantized each on its
    own, naming each its own, still merge."""
    first, second = SHARDS
    tensors: dict[str, dict[str, np.ndarray[Any, Any]]] = {
        first: {"a": WEIGHTS, "a2": -WEIGHTS, "k": np.arange(4, dtype=np.int8)},
        second: {"b": 2 * WEIGHTS, "k2": np.ones(2, np.int8)},
    }
    src, quantized = _mirrored_quantized(tmp_path, tensors)
    for shard, part in tensors.items():
        out = tmp_path / f"back-{shard}"
        done = run("cp", "-q", "--dequantize", str(quantized / shard), str(out))
        assert done.returncode == 0, done.stderr
        found = reference_numpy.load_file(str(out))
        assert sorted(found) == sorted(part)
        for name, array in part.items():
            assert found[name].dtype == array.dtype
            np.testing.assert_allclose(found[name], array, atol=6 / 127)
    recorded = [_metadata(quantized / shard) for shard in SHARDS]
    assert recorded[0] == recorded[1], recorded
    assert recorded[0]["kept_tensors"] == '["k","k2"]' and recorded[0]["quantized_tensors"] == "3"
    codes = reference_numpy.load_file(str(quantized / first))
    unnamed = {key: value for key, value in recorded[0].items() if key != "kept_tensors"}
    scaleless = {name: array for name, array in codes.items() if name != "a2.scale"}
    damaged: list[tuple[dict[str, np.ndarray[Any, Any]], dict[str, str], str]] = [
        (codes, unnamed, "I8 tensor 'k' has no 'k.scale'"),
        (scaleless, recorded[0], "I8 tensor 'a2' has no 'a2.scale'"),
        (codes, {**recorded[0], "kept_tensors": '"k"'}, "kept_tensors must be a JSON list"),
    ]
    for number, (part, metadata, said) in enumerate(damaged):
        path = tmp_path / f"damaged{number}.safetensors"
        reference_numpy.save_file(part, str(path), metadata=metadata)
        refused = run("cp", "-q", "--dequantize", str(path), str(tmp_path / "no.safetensors"))
        assert refused.returncode == 2 and said in refused.stderr, refused.stderr
    assert not (tmp_path / "no.safetensors").exists()
    apart = tmp_path / "apart"  # each shard quantized on its own: each names its own
    apart.mkdir()
    for shard in SHARDS:
        done = run("cp", "-q", "--quantize", "int8", str(src / shard), str(apart / shard))
        assert done.returncode == 0, done.stderr
    shutil.copy(quantized / INDEX, apart / INDEX)
    done = run("cp", "-q", "--merge", str(apart), str(tmp_path / "merged.safetensors"))
    assert done.returncode == 0, done.stderr


def test_a_quantized_file_or_shard_without_a_float_tensor_is_dequantized(tmp_path: Path) -> None:
    """A shard of a mirror quantized by ``cp --quantize`` that holds no float tensor (its
    record, ``compression: INT8`` and ``quantized_tensors``, the whole checkpoint's), or a file
    quantized with nothing to quantize (``quantized_tensors: 0``), was refused by ``cp
    --dequantize`` ("no tensor has its wire tensors"), and the file then by every conversion.
    Both are copied as they are, their record the dequantized one's; a file that says it is
    quantized without cp's record is still refused."""
    first, second = SHARDS
    tensors: dict[str, dict[str, np.ndarray[Any, Any]]] = {
        first: {"w": WEIGHTS},
        second: {"pos": np.arange(4, dtype=np.int64)},
    }
    src, quantized = _mirrored_quantized(tmp_path, tensors)
    alone = tmp_path / "alone.safetensors"
    done = run("cp", "-q", "--quantize", "int8", str(src / second), str(alone))
    assert done.returncode == 0 and _metadata(alone)["quantized_tensors"] == "0", done.stderr
    for number, source in enumerate([quantized / second, alone]):
        out = tmp_path / f"back{number}.safetensors"
        done = run("cp", "-q", "--dequantize", str(source), str(out))
        assert done.returncode == 0, done.stderr
        found = reference_numpy.load_file(str(out))
        assert list(found) == ["pos"] and found["pos"].tolist() == [0, 1, 2, 3]
        recorded = _metadata(out)
        assert "compression" not in recorded and "quantized_tensors" not in recorded
        assert recorded["dequantized_from"].startswith("0 tensors (compression=INT8")
        again = tmp_path / f"again{number}.safetensors"
        done = run("cp", "-q", "--quantize", "int8", str(out), str(again))
        assert done.returncode == 0, done.stderr
    unrecorded = tmp_path / "unrecorded.safetensors"
    reference_numpy.save_file(tensors[second], str(unrecorded), metadata={"compression": "INT8"})
    refused = run("cp", "-q", "--dequantize", str(unrecorded), str(tmp_path / "no.safetensors"))
    assert refused.returncode == 2 and "no tensor has its wire tensors" in refused.stderr
    assert not (tmp_path / "no.safetensors").exists()


def test_shards_quantized_apart_merge_into_a_file_dequantize_reads(tmp_path: Path) -> None:
    """Shards quantized each on its own (``quantized_tensors: 1`` in each, by chance alike, and
    each its own ``kept_tensors``) merged by ``cp --merge`` into a file saying
    ``quantized_tensors: 1`` while holding 2 quantized tensors, ``kept_tensors`` dropped:
    ``cp --dequantize`` of it, ``--dequantize --merge`` of the index and a dequantizing mirror
    were refused. The merge counts the shards' quantized tensors together and names every
    shard's kept ones, and each way dequantizes them; a mirror's shards, which record the whole
    checkpoint's counts, still merge to those counts."""
    first, second = SHARDS
    tensors: dict[str, dict[str, np.ndarray[Any, Any]]] = {
        first: {"a": WEIGHTS, "k": np.arange(4, dtype=np.int8)},
        second: {"b": 2 * WEIGHTS, "k2": np.ones(2, np.int8)},
    }
    src, apart, mirrored = tmp_path / "src", tmp_path / "apart", tmp_path / "mirrored"
    src.mkdir()
    apart.mkdir()
    for shard, part in tensors.items():
        reference_numpy.save_file(part, str(src / shard))
        done = run("cp", "-q", "--quantize", "int8", str(src / shard), str(apart / shard))
        assert done.returncode == 0, done.stderr
    weight_map = {name: shard for shard, part in tensors.items() for name in part}
    (src / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    done = run("cp", "-q", "--quantize", "int8", str(src / INDEX), f"{mirrored}/")
    assert done.returncode == 0, done.stderr
    shutil.copy(mirrored / INDEX, apart / INDEX)
    assert _metadata(apart / first)["quantized_tensors"] == "1"
    assert _metadata(apart / second)["quantized_tensors"] == "1"
    whole = {name: array for part in tensors.values() for name, array in part.items()}
    for folder, kept in ((apart, '["k","k2"]'), (mirrored, _metadata(mirrored / first)[KEPT])):
        merged = tmp_path / f"{folder.name}.safetensors"
        done = run("cp", "-q", "--merge", str(folder / INDEX), str(merged))
        assert done.returncode == 0, done.stderr
        recorded = _metadata(merged)
        assert (recorded["quantized_tensors"], recorded[KEPT]) == ("2", kept), recorded
        out = tmp_path / f"{folder.name}-back"
        out.mkdir()
        ways = [
            [str(merged), str(out / "file.safetensors")],
            ["--merge", str(folder / INDEX), str(out / "merged.safetensors")],
            [str(folder / INDEX), f"{out / 'mirror'}/"],
        ]
        for way in ways:
            done = run("cp", "-q", "--dequantize", *way)
            assert done.returncode == 0, done.stderr
        found = reference_numpy.load_file(str(out / "file.safetensors"))
        assert found.keys() == reference_numpy.load_file(str(out / "merged.safetensors")).keys()
        for shard in SHARDS:
            found.update(reference_numpy.load_file(str(out / "mirror" / shard)))
        assert sorted(found) == sorted(whole)
        for name, array in whole.items():
            assert found[name].dtype == array.dtype
            np.testing.assert_allclose(found[name], array, atol=6 / 127)


def test_a_mirror_of_shards_quantized_with_different_codecs_is_refused_by_name(
    tmp_path: Path,
) -> None:
    """Shards whose ``__metadata__`` name different codecs: a dequantizing mirror said the
    source was "not quantized (no compression key)"; it names the codecs, before anything is
    written."""
    first, second = SHARDS
    index = _quantized(tmp_path, {"w": first, "w.scale": first, "b": second})
    path = index.parent / second
    metadata = {**_metadata(path), "compression": "INT4"}
    reference_numpy.save_file(reference_numpy.load_file(str(path)), str(path), metadata=metadata)
    out = tmp_path / "out"
    refused = run("cp", "-q", "--dequantize", str(index), f"{out}/")
    assert refused.returncode == 2, refused.stderr
    assert "different codecs (compression 'INT4', 'INT8')" in refused.stderr
    assert not out.exists()


def test_a_converted_mirror_records_the_whole_conversion_in_every_shard(tmp_path: Path) -> None:
    """A mirror converted by ``cp --dtype``, ``--quantize`` or ``--dequantize`` recorded each
    shard's own counts and original dtype in its ``__metadata__`` (``converted_to: BF16 (2
    tensors...)`` in one, ``(1 tensors...)`` in the other; ``original_dtype`` float32 in one,
    float16 in the other), so ``cp --merge`` and ``serve`` refused stream-st's own mirrors.
    Every shard now records the whole checkpoint's (``original_dtypes`` naming each tensor's
    where they differ, as one file's), and such a mirror merges; a quantized mirror whose
    shards recorded their own (an older one) is dequantized each shard as its record says."""
    first, second = SHARDS
    src = tmp_path / "src"
    src.mkdir()
    tensors: dict[str, dict[str, np.ndarray[Any, Any]]] = {
        first: {"a": np.ones(4, np.float32), "b": np.full(4, 2, np.float32)},
        second: {"c": np.ones(4, np.float16), "d": np.arange(3, dtype=np.int32)},
    }
    for shard, part in tensors.items():
        reference_numpy.save_file(part, str(src / shard))
    weight_map = {name: shard for shard, part in tensors.items() for name in part}
    (src / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    dtypes = {"a": "float32", "b": "float32", "c": "float16"}
    originals = json.dumps(dtypes, separators=(",", ":"))
    steps: list[tuple[str, list[str], Path, dict[str, str]]] = [
        ("bf16", ["--dtype", "bf16"], src, {"converted_to": "BF16 (3 tensors, round to nearest"}),
        (
            "q8",
            ["--quantize", "int8"],
            src,
            {"quantized_tensors": "3", "original_dtypes": originals},
        ),
        (
            "back",
            ["--dequantize"],
            tmp_path / "q8",
            {"dequantized_from": "3 tensors (compression="},
        ),
    ]
    for into, options, source, record in steps:
        done = run("cp", "-q", *options, str(source), f"{tmp_path / into}/")
        assert done.returncode == 0, done.stderr
        found = [_metadata(tmp_path / into / shard) for shard in SHARDS]
        assert found[0] == found[1], found
        assert all(found[0][key].startswith(value) for key, value in record.items()), found[0]
        merged = tmp_path / f"{into}.safetensors"
        done = run("cp", "-q", "--merge", str(tmp_path / into), str(merged))
        assert done.returncode == 0, done.stderr
    back = reference_numpy.load_file(str(tmp_path / "back.safetensors"))
    assert {name: str(array.dtype) for name, array in back.items()} == {**dtypes, "d": "int32"}
    older = tmp_path / "older"  # each shard quantized on its own, as a mirror was
    older.mkdir()
    for shard in SHARDS:
        done = run("cp", "-q", "--quantize", "int8", str(src / shard), str(older / shard))
        assert done.returncode == 0, done.stderr
    shutil.copy(tmp_path / "q8" / INDEX, older / INDEX)
    done = run("cp", "-q", "--dequantize", str(older), f"{tmp_path / 'older-back'}/")
    assert done.returncode == 0, done.stderr
    found = [_metadata(tmp_path / "older-back" / shard) for shard in SHARDS]
    assert found[0] == found[1] and "quantized_tensors" not in found[0]["dequantized_from"]
    for shard, part in tensors.items():
        copied = reference_numpy.load_file(str(tmp_path / "older-back" / shard))
        assert {n: a.dtype for n, a in copied.items()} == {n: a.dtype for n, a in part.items()}


@pytest.mark.parametrize(
    "args",
    [
        ("cp", "M", "http://[::1/x.safetensors"),
        ("cp", "M", "tcp://[::1"),
        ("cp", "M", "http://[zz]/x"),
        ("cp", "http://[::1/x.safetensors", "D/"),
        ("cp", "M", "file://[::1/x"),
        ("inspect", "file://[::1/x.safetensors"),
    ],
)
def test_an_unreadable_url_is_a_usage_error(tmp_path: Path, args: tuple[str, ...]) -> None:
    """An unclosed or bad bracketed host as a destination, as a source copied into a folder or
    in a file:// URL crashed with an internal error (exit 3) where a source said so."""
    model = write_model(tmp_path / "m.safetensors")
    argv = [{"M": str(model), "D/": f"{tmp_path}/"}.get(arg, arg) for arg in args]
    done = run(*argv)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("stream-st: error: invalid URL "), done.stderr


async def test_an_unreadable_url_is_a_usage_error_in_the_library(checkpoint: Path) -> None:
    with pytest.raises(stream_st.UsageError, match="invalid URL 'http://"):
        await mirror(str(checkpoint / INDEX), "http://[::1/")
    with pytest.raises(stream_st.UsageError, match="invalid URL 'file://"):
        await stream_st.load("file://[::1/x.safetensors")
