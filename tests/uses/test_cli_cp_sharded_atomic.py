"""``stream-st cp INDEX DIR/`` is all or nothing: a copy that fails or is stopped half way leaves
the destination as it was (an older version of the same shard names included), never a mix."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
import stream_st.numpy
from stream_st.integrations.dataset import describe_dataset

from ..servers.http_server import RangeHTTPServer
from ..servers.s3_server import CREDENTIALS, MotoS3Server
from ._cli import COMMAND, run
from .test_cli_signals import trickling

INDEX = "model.safetensors.index.json"
SHARDS = {"m-1.safetensors": ("a", (4,)), "sub/m-2.safetensors": ("b", (256, 256))}
"""Shard -> its one tensor's name and shape; the second is 256 KiB, in a subdirectory."""


def _version(folder: Path, value: float) -> dict[str, bytes]:
    """A checkpoint in ``folder``, every element ``value``; returns each file's bytes."""
    files = {}
    for shard, (name, shape) in SHARDS.items():
        (folder / shard).parent.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, np.ndarray[Any, Any]] = {name: np.full(shape, value, np.float32)}
        reference_numpy.save_file(tensors, str(folder / shard))
        files[shard] = (folder / shard).read_bytes()
    weight_map = {name: shard for shard, (name, _) in SHARDS.items()}
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    files[INDEX] = (folder / INDEX).read_bytes()
    return files


def _contents(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones included) by relative path."""
    return {
        str(path.relative_to(folder)): path.read_bytes()
        for path in folder.rglob("*")
        if not path.is_dir()
    }


@pytest.fixture
def versions(tmp_path: Path) -> tuple[Path, dict[str, bytes], Path, dict[str, bytes]]:
    """``v1`` (values 1.0) and ``v2`` (2.0): the same shard names, other contents."""
    (tmp_path / "v1").mkdir()
    (tmp_path / "v2").mkdir()
    return (
        tmp_path / "v1",
        _version(tmp_path / "v1", 1.0),
        tmp_path / "v2",
        _version(tmp_path / "v2", 2.0),
    )


def test_a_missing_shard_leaves_the_destination_as_it_was(
    tmp_path: Path, versions: tuple[Path, dict[str, bytes], Path, dict[str, bytes]]
) -> None:
    """The first shard of the new version was committed over the old one before the second
    was found missing: a checkpoint half new, half old, that loaded without an error."""
    v1, old, v2, _ = versions
    dst = shutil.copytree(v1, tmp_path / "dst")
    (v2 / "sub" / "m-2.safetensors").unlink()
    failed = run("cp", "-q", str(v2 / INDEX), f"{dst}/")
    assert failed.returncode == 2, failed.stderr
    assert "m-2.safetensors" in failed.stderr
    assert _contents(dst) == old, "the destination changed"
    fresh = tmp_path / "fresh" / "deeper"
    assert run("cp", "-q", str(v2 / INDEX), f"{fresh}/").returncode == 2
    assert not (tmp_path / "fresh").exists(), "directories made for the copy were left"


def test_a_mirror_removes_the_single_file_and_the_shards_its_index_supersedes(
    tmp_path: Path, versions: tuple[Path, dict[str, bytes], Path, dict[str, bytes]]
) -> None:
    """A mirror of ``model.safetensors.index.json`` into a folder holding an older checkpoint
    as ``model.safetensors`` (and shards ``model-NNNNN-of-NNNNN.safetensors``) kept them beside
    the new index, and transformers, which takes ``model.safetensors`` before any index, loaded
    the old weights: the commit removes them, as the sharded writer's does; a mirror that
    fails leaves them."""
    _, _, v2, new = versions
    dst = tmp_path / "dst"
    dst.mkdir()
    tensors = {"a": np.full((4,), 1.0, np.float32), "b": np.full((2,), 1.0, np.float32)}
    reference_numpy.save_file(tensors, str(dst / "model.safetensors"))
    for number in (1, 2):
        reference_numpy.save_file(tensors, str(dst / f"model-0000{number}-of-00002.safetensors"))
    (dst / "m.safetensors").write_bytes(b"not ours")  # no name of the checkpoint's: kept
    old = _contents(dst)
    (v2 / "sub" / "m-2.safetensors").rename(tmp_path / "m-2.safetensors")
    failed = run("cp", "-q", str(v2 / INDEX), f"{dst}/")
    assert failed.returncode == 2, failed.stderr
    assert _contents(dst) == old, "a failed mirror changed the destination"
    (tmp_path / "m-2.safetensors").rename(v2 / "sub" / "m-2.safetensors")
    done = run("cp", "-q", str(v2 / INDEX), f"{dst}/")
    assert done.returncode == 0, done.stderr
    assert _contents(dst) == {**new, "m.safetensors": b"not ours"}


def test_a_folder_named_as_the_single_file_is_left_and_the_mirror_commits(
    tmp_path: Path, versions: tuple[Path, dict[str, bytes], Path, dict[str, bytes]]
) -> None:
    """A folder ``model.safetensors`` beside an older checkpoint is no single file a loader
    takes: the mirror leaves it, as the sharded writer does, where removing it failed in the
    middle of the commit, the older index gone and the new one never written."""
    v1, _, v2, new = versions
    dst = shutil.copytree(v1, tmp_path / "dst")
    (dst / "model.safetensors").mkdir()
    (dst / "model.safetensors" / "note").write_bytes(b"a user's")
    done = run("cp", "-q", str(v2 / INDEX), f"{dst}/")
    assert done.returncode == 0, done.stderr
    assert _contents(dst) == {**new, "model.safetensors/note": b"a user's"}


def test_a_single_file_that_cannot_be_removed_leaves_the_new_index_and_a_warning(
    tmp_path: Path,
    versions: tuple[Path, dict[str, bytes], Path, dict[str, bytes]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the superseded ``model.safetensors`` cannot be removed within the commit (a file
    system refusing it, the failure injected here), the commit goes on: the new index is written
    and a warning names the file, where the commit stopped half done with no index at all (the
    local folder's cleanup after the commit, not refused here, then removes it)."""
    from stream_st.errors import TransportError
    from stream_st.tools.cp import mirror
    from stream_st.transports import store

    v1, _, v2, new = versions
    dst = shutil.copytree(v1, tmp_path / "dst")
    reference_numpy.save_file({"a": np.ones(2, np.float32)}, str(dst / "model.safetensors"))

    remove = store.remove

    async def refused(address: str, *args: Any, **kwargs: Any) -> None:
        if address.endswith("/model.safetensors"):
            raise TransportError("removing failed: Operation not permitted", url=address)
        await remove(address, *args, **kwargs)

    monkeypatch.setattr(store, "remove", refused)
    with pytest.warns(stream_st.StreamStWarning, match="model.safetensors: not removed"):
        anyio.run(lambda: mirror(str(v2 / INDEX), f"{dst}/"))
    assert _contents(dst) == new


def test_a_file_url_destination_is_made_as_a_path_is(
    tmp_path: Path, versions: tuple[Path, dict[str, bytes], Path, dict[str, bytes]]
) -> None:
    """``cp INDEX file:///missing/dir/`` makes the directory, as a path's is made, where it failed
    with "no such directory"; a copy that fails removes what it made, as for a path."""
    v1, old, v2, _ = versions
    made = tmp_path / "new dir" / "deeper"
    done = run("cp", "-q", str(v1 / INDEX), f"{made.as_uri()}/")
    assert done.returncode == 0, done.stderr
    assert _contents(made) == old
    (v2 / "sub" / "m-2.safetensors").unlink()
    fresh = tmp_path / "fresh dir" / "deeper"
    failed = run("cp", "-q", str(v2 / INDEX), f"{fresh.as_uri()}/")
    assert failed.returncode == 2 and "m-2.safetensors" in failed.stderr, failed.stderr
    assert not (tmp_path / "fresh dir").exists(), "directories made for the copy were left"


def test_stopped_while_a_shard_streams_in_leaves_the_destination_as_it_was(
    tmp_path: Path, versions: tuple[Path, dict[str, bytes], Path, dict[str, bytes]]
) -> None:
    """SIGINT while the second shard came from a FIFO: the first, already copied, stayed."""
    v1, old, v2, new = versions
    dst = shutil.copytree(v1, tmp_path / "dst")
    slow = v2 / "sub" / "m-2.safetensors"
    slow.unlink()
    with trickling(slow, new["sub/m-2.safetensors"], 64 << 10) as fed:
        process = subprocess.Popen(
            [COMMAND, "cp", "-q", str(v2 / INDEX), f"{dst}/"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 60
        while not fed.is_set():  # the first shard is copied: the second is being read
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the copy did not start within a minute"
            time.sleep(0.05)
        time.sleep(0.2)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert _contents(dst) == old, "the destination changed"
    assert b"Traceback" not in stderr


def test_more_shards_than_the_soft_limit_on_open_files(tmp_path: Path) -> None:
    """Every shard is held open until all are written: the soft limit is raised to make room."""
    source, dst = tmp_path / "many", tmp_path / "dst"
    source.mkdir()
    weight_map = {}
    for i in range(80):
        reference_numpy.save_file({f"t{i}": np.full(2, i, np.float32)}, str(source / f"{i}.st"))
        weight_map[f"t{i}"] = f"{i}.st"
    (source / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 512:
        pytest.skip(f"the hard limit on open files is {hard}")
    result = subprocess.run(
        [COMMAND, "cp", "-q", str(source / INDEX), f"{dst}/"],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (48, hard)),
    )
    assert result.returncode == 0, result.stderr
    assert _contents(dst) == _contents(source)


def test_a_failed_mirror_to_s3_completes_no_upload(
    versions: tuple[Path, dict[str, bytes], Path, dict[str, bytes]], moto_s3: MotoS3Server
) -> None:
    """Each shard's upload was completed as soon as it was sent: the new first shard replaced
    the old one before the second was found missing."""
    v1, old, v2, _ = versions
    client = moto_s3.client()
    client.create_bucket(Bucket="atomic")
    for name, data in old.items():
        client.put_object(Bucket="atomic", Key=f"m/{name}", Body=data)

    def stored(prefix: str) -> dict[str, bytes]:
        listed = client.list_objects_v2(Bucket="atomic", Prefix=prefix)["Contents"]
        return {
            o["Key"][len(prefix) :]: client.get_object(Bucket="atomic", Key=o["Key"])["Body"].read()
            for o in listed
        }

    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": moto_s3.endpoint_url}
    # Held uploads with digests patched into their first part, then completed together.
    held = run("cp", "-q", "--checksums", str(v1 / INDEX), "s3://atomic/c/", env=env)
    assert held.returncode == 0, held.stderr
    for name, data in stored("c/").items():
        if name != INDEX:
            assert stream_st.numpy.load(data, verify=True), name  # digests checked
            assert b"xxh3" in data[:200], name
    (v2 / "sub" / "m-2.safetensors").unlink()
    failed = run("cp", "-q", str(v2 / INDEX), "s3://atomic/m/", env=env)
    assert failed.returncode == 2, failed.stderr
    assert stored("m/") == old
    assert not client.list_multipart_uploads(Bucket="atomic").get("Uploads")
    assert os.environ.get("AWS_ENDPOINT_URL") != moto_s3.endpoint_url


def test_a_mirror_to_s3_removes_the_single_file_its_index_supersedes(
    versions: tuple[Path, dict[str, bytes], Path, dict[str, bytes]], moto_s3: MotoS3Server
) -> None:
    """As into a local directory: an older ``model.safetensors`` under the prefix, which a
    loader takes before the index, was kept beside the new index."""
    _, _, v2, new = versions
    client = moto_s3.client()
    client.create_bucket(Bucket="single")
    client.put_object(Bucket="single", Key="m/model.safetensors", Body=b"old")
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": moto_s3.endpoint_url}
    done = run("cp", "-q", str(v2 / INDEX), "s3://single/m/", env=env)
    assert done.returncode == 0, done.stderr
    listed = client.list_objects_v2(Bucket="single", Prefix="m/")["Contents"]
    assert {o["Key"][2:] for o in listed} == set(new)


def test_an_http_destination_takes_each_shard_as_its_upload_ends(
    versions: tuple[Path, dict[str, bytes], Path, dict[str, bytes]],
) -> None:
    """A PUT cannot be held uncommitted: shards uploaded before a failure stay, the index never
    comes (as documented)."""
    _, old, v2, new = versions
    with RangeHTTPServer() as server:
        server.objects.update({f"/m/{name}": data for name, data in old.items()})
        (v2 / "sub" / "m-2.safetensors").unlink()
        assert run("cp", "-q", str(v2 / INDEX), server.url("/m/")).returncode == 2
        assert server.objects["/m/m-1.safetensors"] == new["m-1.safetensors"]
        assert server.objects[f"/m/{INDEX}"] == old[INDEX]


KILLED_MIRROR = """
import os, signal, sys, anyio
from stream_st.tools.cp import mirror

index, into, kill_at = sys.argv[1:]
calls = 0

def profile(frame, event, arg):  # a kill just before the kill_at-th call that names a file
    global calls
    if event == "c_call" and arg in (os.link, os.rename, os.replace, os.unlink):
        calls += 1
        if calls == int(kill_at):
            os.kill(os.getpid(), signal.SIGKILL)

sys.setprofile(profile)
anyio.run(lambda: mirror(index, into))
"""


def test_a_mirror_killed_at_any_step_of_its_commit_leaves_no_mix(
    tmp_path: Path, versions: tuple[Path, dict[str, bytes], Path, dict[str, bytes]]
) -> None:
    """A mirror over an older checkpoint of the same shard names, its process killed (SIGKILL)
    before each call that names, renames or removes a file in turn: the index there, if any,
    loads the old checkpoint or the new one, whole (it loaded new shards beside old ones, the
    older index still there, when killed between two shards' renames)."""
    v1, _, v2, _ = versions
    tensors = {"a": (4,), "b": (256, 256)}
    for kill_at in range(1, 100):
        dst = tmp_path / f"dst{kill_at}"
        shutil.copytree(v1, dst)
        killed = subprocess.run(
            [sys.executable, "-c", KILLED_MIRROR, str(v2 / INDEX), f"{dst}/", str(kill_at)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        )
        if (dst / INDEX).exists():
            loaded = stream_st.numpy.load_file(str(dst / INDEX))
            values = {float(loaded[name].reshape(-1)[0]) for name in tensors}
            assert len(values) == 1, f"killed at call {kill_at}: a mix of checkpoints"
        if killed.returncode == 0:
            assert values == {2.0}
            break
        assert killed.returncode == -signal.SIGKILL, (kill_at, killed.stderr)
    else:
        pytest.fail("the mirror never ended unkilled")


KILLED_S3_MIRROR = """
import os, signal, sys, anyio
from stream_st.tools.cp import mirror

index, into, kill_at = sys.argv[1:]
calls = set()  # a coroutine's frame is called again at each resumption

def profile(frame, event, arg):  # a kill just before the kill_at-th CompleteMultipartUpload
    if event == "call" and frame.f_code.co_name == "_complete" and frame not in calls:
        calls.add(frame)
        if len(calls) == int(kill_at):
            os.kill(os.getpid(), signal.SIGKILL)

sys.setprofile(profile)
anyio.run(lambda: mirror(index, into))
"""


def test_a_mirror_to_s3_killed_in_its_commit_leaves_no_mix(
    versions: tuple[Path, dict[str, bytes], Path, dict[str, bytes]], moto_s3: MotoS3Server
) -> None:
    """As into a local directory: a mirror over an older checkpoint of the same shard names on
    S3, killed before each CompleteMultipartUpload in turn, leaves an index there only if it
    loads one checkpoint whole (the older index stayed over the first new shard and the second
    old one, and loaded them)."""
    _, old, v2, _ = versions
    client = moto_s3.client()
    bucket = "killed"
    client.create_bucket(Bucket=bucket)
    env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": moto_s3.endpoint_url}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    for kill_at in range(1, 10):
        prefix = f"k{kill_at}/"
        for name, data in old.items():
            client.put_object(Bucket=bucket, Key=prefix + name, Body=data)
        into = f"s3://{bucket}/{prefix}"
        killed = subprocess.run(
            [sys.executable, "-c", KILLED_S3_MIRROR, str(v2 / INDEX), into, str(kill_at)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        keys = {
            o["Key"][len(prefix) :]
            for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
        }
        if INDEX in keys:
            shard_values = set()
            for shard, (name, _) in SHARDS.items():
                body = client.get_object(Bucket=bucket, Key=prefix + shard)["Body"].read()
                shard_values.add(float(reference_numpy.load(body)[name].reshape(-1)[0]))
            assert len(shard_values) == 1, f"killed at completion {kill_at}: a mix of checkpoints"
        if killed.returncode == 0:
            assert INDEX in keys and shard_values == {2.0}
            break
        assert killed.returncode == -signal.SIGKILL, (kill_at, killed.stderr)
    else:
        pytest.fail("the mirror never ended unkilled")


def test_the_deadline_bounds_the_whole_mirror_not_each_shard(tmp_path: Path) -> None:
    """``--deadline`` started again for each shard (each copied with a clock of its own), so a
    mirror of N shards could take N deadlines; one over it now fails, the destination as it was.
    Each answer of the source comes 0.5 s late: a shard alone (one request) is well within the
    deadline of 3 s, even on a loaded machine, the mirror (nine requests, 4.5 s) well beyond it."""
    names = [f"m-{i}.safetensors" for i in range(8)]

    def checkpoint(value: float) -> dict[str, bytes]:
        files = {}
        for i, name in enumerate(names):
            reference_numpy.save_file({f"t{i}": np.full(4, value, np.float32)}, str(tmp_path / "f"))
            files[name] = (tmp_path / "f").read_bytes()
        weight_map = {f"t{i}": name for i, name in enumerate(names)}
        files[INDEX] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
        return files

    dst = tmp_path / "dst"
    dst.mkdir()
    old = checkpoint(1.0)
    for name, data in old.items():
        (dst / name).write_bytes(data)
    served = {f"/c/{name}": data for name, data in checkpoint(2.0).items()}
    with RangeHTTPServer(objects=served, latency=0.5) as server:
        alone = run("cp", "-q", "--deadline", "3", server.url(f"/c/{names[0]}"), f"{tmp_path}/")
        assert alone.returncode == 0, alone.stderr
        failed = run("cp", "-q", "--deadline", "3", server.url(f"/c/{INDEX}"), f"{dst}/")
    assert failed.returncode == 2, failed.stderr
    assert "error: the deadline of 3 s passed" in failed.stderr  # ReadTimeoutError's message
    assert _contents(dst) == old, "the destination changed"


@pytest.mark.parametrize("served", [False, True], ids=["local", "http"])
def test_a_dataset_manifest_is_mirrored_as_it_is(tmp_path: Path, served: bool) -> None:
    """A dataset written by ``open_dataset_writer`` (its shards' headers padded to leave room)
    could not be mirrored: each shard was copied with the reference's header, a few bytes where
    the manifest counts 65552, and the copy refused with "the manifest says 65552 bytes". Its
    shards are now copied byte for byte, padding kept, with their digests checked as read."""
    src = tmp_path / "ds"

    async def write() -> None:
        async with stream_st.open_dataset_writer(src, checksums=True) as writer:
            for batch in range(3):
                await writer.write_batch({"x": np.arange(4, dtype=np.float32) + batch}, 4)

    anyio.run(write)
    files = _contents(src)
    assert len(files) == 4  # three shards and the manifest
    dst = tmp_path / "dst"
    with RangeHTTPServer(objects={f"/ds/{name}": data for name, data in files.items()}) as server:
        index = (
            server.url("/ds/dataset_manifest.json")
            if served
            else str(src / "dataset_manifest.json")
        )
        copied = run("cp", "-q", index, f"{dst}/")
    assert copied.returncode == 0, copied.stderr
    assert _contents(dst) == files
    described = anyio.run(describe_dataset, str(dst / "dataset_manifest.json"))
    assert [header.file_size for header in described.headers] == [65552] * 3
    assert [float(stream_st.numpy.load_file(shard)["x"][0]) for shard in described.shards] == [
        0.0,
        1.0,
        2.0,
    ]


def test_a_dataset_manifest_refused_a_change_names_the_options_given(tmp_path: Path) -> None:
    """``cp --include x ds/`` of a dataset manifest said "drop the conversions" where none was
    given; the refusal names the options that were."""
    src = tmp_path / "ds"

    async def write() -> None:
        async with stream_st.open_dataset_writer(src) as writer:
            await writer.write_batch({"x": np.arange(4, dtype=np.float32)}, 4)

    anyio.run(write)
    manifest = str(src / "dataset_manifest.json")
    for options, named in [
        (["--include", "x"], "drop include= (--include), or merge"),
        (["--dtype", "bf16", "--checksums"], "drop dtype= (--dtype), checksums= (--checksums),"),
    ]:
        refused = run("cp", "-q", *options, manifest, f"{tmp_path / 'dst'}/")
        assert refused.returncode == 2 and named in refused.stderr, refused.stderr
        assert "conversions" not in refused.stderr
    assert not (tmp_path / "dst").exists()
