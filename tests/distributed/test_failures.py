"""Failures in a real gloo group: a rank killed with SIGKILL, a source that stalls on one rank,
a rank given another file or a name the file lacks, a rank whose own code raises or that leaves
its stream early, caps a file is over. Every surviving rank raises a
:class:`~stream_st.SafetensorsError` naming the rank and the cause, at once (well within the
group's timeout: the pool's group waits 60 s); nothing hangs, and the group stays in step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

from safetensors.torch import load_file as reference_load  # noqa: E402
from safetensors.torch import save_file as reference_save  # noqa: E402

import stream_st.torch  # noqa: E402
from stream_st.sharded.ranks import stripe_size  # noqa: E402
from tests.servers.http_server import RangeHTTPServer  # noqa: E402

from ._group import ENV, ROOT, WAIT, Pool, free_port, run_group  # noqa: E402
from .test_load import assert_same, ok, write_index  # noqa: E402


@pytest.fixture
def layers(tmp_path: Path) -> Path:
    """Eight tensors of 256 KiB: many stripes, so a failure lands mid-load."""
    gen = torch.Generator().manual_seed(3)
    path = tmp_path / "layers.safetensors"
    reference_save({f"layer{i}": torch.randn(256, 256, generator=gen) for i in range(8)}, str(path))
    return path


def failed(report: dict[str, Any], kind: str, rank: int) -> str:
    """The message of ``report``'s error, checked to be ``kind`` naming ``rank``."""
    assert report.get("error") == kind, report
    assert report["distributed"] and report["safetensors_error"], report
    assert report["failed_rank"] == rank, report
    assert f"rank {rank}" in report["message"], report
    message: str = report["message"]
    return message


PROMPT = 30.0
"""A failure told to the group is raised well before the pool group's 60 s timeout."""


def test_a_killed_rank_is_named_by_the_others(tmp_path: Path, layers: Path) -> None:
    """In a group with a short timeout: raised within it at the latest."""
    stop = {"1": "kill"}
    reports = run_group(tmp_path, 3, mode="stream", src=str(layers), stop=stop, timeout=5)
    assert reports[1].get("died") == -9, reports[1]
    for survivor in (reports[0], reports[2]):
        assert "is gone" in failed(survivor, "RankLostError", 1)


@pytest.mark.parametrize(
    ("mode", "how"),
    [("load_file", "again"), ("load_model", "hook")],
    ids=["between-two-loads", "before-load-models-last-agreement"],
)
def test_a_rank_killed_after_the_first_gather_is_named(
    tmp_path: Path, layers: Path, mode: str, how: str
) -> None:
    """Killed between two loads on the group, or in load_model once its tensors came (before
    the last agreement, which a group of its own makes): the others name it by its process id,
    learnt at the group's first gather, where they named no rank."""
    stop = {"1": how}
    reports = run_group(tmp_path, 3, mode=mode, src=str(layers), stop=stop, timeout=5)
    assert reports[1].get("died") == -9, reports[1]
    for survivor in (reports[0], reports[2]):
        assert "is gone" in failed(survivor, "RankLostError", 1)


@pytest.mark.parametrize(("how", "told"), [("raise", "left its stream"), ("cancel", "cancelled")])
def test_a_rank_leaving_its_stream_fails_the_others_at_once(
    tmp_path: Path, layers: Path, pool: Pool, how: str, told: str
) -> None:
    """Rank 1's loop raises, or is cancelled, after its first tensor: it gets its own error (or
    cancellation) back; the others learn at their next gate, and the group goes on."""
    reports = pool.run(tmp_path, 3, mode="stream", src=str(layers), stop={"1": how})
    assert reports[1]["error"] == "Stopped", reports[1]
    for survivor in (reports[0], reports[2]):
        assert told in failed(survivor, "RankFailedError", 1)
    for report in reports:
        assert report["seconds"] < PROMPT, report
    again = pool.run(tmp_path, 3, mode="load_file", src=str(layers))
    for report in again:
        assert_same(ok(report), reference_load(str(layers)))


@pytest.mark.parametrize(
    ("params", "told"),
    [
        ({"include": [None, "!raise"]}, "LookupError: no rule for"),
        ({"options": [{}, {"device": "nowhere"}]}, "DeviceError: device='nowhere'"),
        ({"slices": [None, {"layer0": [5, 0, 2]}]}, "UsageError: slices= for 'layer0'"),
        ({"include": [None, 5]}, "ArgumentTypeError: include= takes"),
        ({"options": [{}, {"bogus": 1}]}, "ArgumentTypeError: unknown option(s) ['bogus']"),
        ({"options": [{}, {"cache": True}]}, "UsageError: cache= does not go with"),
        ({"mode": "stream", "options": [{}, {"bogus": 1}]}, "unknown option(s) ['bogus']"),
        ({"mode": "stream", "options": [{}, {"timeout": -1}]}, "UsageError: timeout"),
        ({"mode": "load_model", "options": [{}, {"assign": True}]}, "does not take assign=True"),
        ({"mode": "load_model", "options": [{}, {"strict": True}]}, "Unexpected key(s)"),
        ({"mode": "load_model", "broken": {"1": True}}, "AttributeError: 'NoneType'"),
    ],
)
def test_one_rank_failing_while_planning(
    tmp_path: Path, layers: Path, pool: Pool, params: dict[str, Any], told: str
) -> None:
    """A rank whose own code (its ``include=`` predicate), or argument, fails before any byte
    is exchanged, or whose model does not take what it loaded: every rank raises naming it, at
    once. Arguments refused before the group was joined (an unknown option, ``include=5``,
    ``assign=True``) left the others waiting until the group's timeout; a model refusing its
    tensors after the last gate left rank 0 returning while rank 1 raised."""
    params = {"mode": "load_file", **params}
    reports = pool.run(tmp_path, 2, src=str(layers), **params)
    for report in reports:
        assert told in failed(report, "RankFailedError", 1)
        assert report["seconds"] < PROMPT, report


@pytest.mark.parametrize("mode", ["load_file", "load_model"])
@pytest.mark.parametrize(
    ("option", "told"),
    [
        ({"verify": "yes"}, "ArgumentTypeError: verify must be True or False, got 'yes'"),
        ({"backend": "weird"}, "UsageError: backend must be one of ('mmap', 'pread')"),
    ],
    ids=["verify", "backend"],
)
def test_one_rank_refusing_a_load_argument(
    tmp_path: Path, layers: Path, pool: Pool, mode: str, option: dict[str, Any], told: str
) -> None:
    """``verify=`` refused as the stream is made, or ``backend=`` (unused with a group, checked
    as without one), on rank 1 alone: every rank raises naming it at once. Rank 1 raised the
    first alone, leaving rank 0 waiting until the group's timeout (5 s here), and the second was
    dropped unchecked."""
    reports = pool.run(tmp_path, 2, mode=mode, src=str(layers), options=[{}, option], timeout=5)
    for report in reports:
        assert told in failed(report, "RankFailedError", 1)
        assert report["seconds"] < PROMPT, report


def test_a_source_failing_on_one_rank_fails_every_rank(
    tmp_path: Path, layers: Path, pool: Pool
) -> None:
    data = layers.read_bytes()
    with (
        RangeHTTPServer(objects={"/m": data}) as good,
        RangeHTTPServer(objects={"/m": data}, stall_after=100_000, no_range=True) as stalled,
    ):
        srcs = [good.url("/m"), stalled.url("/m"), good.url("/m")]
        reports = pool.run(tmp_path, 3, mode="load_file", srcs=srcs, options={"timeout": 1.0})
        for report in reports:
            assert "ReadTimeoutError" in failed(report, "RankFailedError", 1)
            assert "tensors" not in report  # nobody handed out a partial model
        # The group is still in step: the next load works.
        again = pool.run(tmp_path, 3, mode="load_file", src=good.url("/m"))
    for report in again:
        assert_same(ok(report), reference_load(str(layers)))


def test_another_file_on_one_rank(tmp_path: Path, layers: Path, pool: Pool) -> None:
    other = tmp_path / "other.safetensors"
    reference_save({"layer0": torch.zeros(3)}, str(other))
    reports = pool.run(tmp_path, 2, mode="load_file", srcs=[str(layers), str(other)])
    for report in reports:
        assert "header differs" in failed(report, "RankFailedError", 1)


def test_a_name_the_file_lacks(tmp_path: Path, layers: Path, pool: Pool) -> None:
    include = [["layer0"], ["layer1", "nope"]]
    reports = pool.run(tmp_path, 2, mode="load_file", src=str(layers), include=include)
    for report in reports:
        assert "nope" in failed(report, "RankFailedError", 1)


def test_a_missing_source_on_one_rank(tmp_path: Path, layers: Path, pool: Pool) -> None:
    srcs = [str(layers), str(tmp_path / "absent.safetensors")]
    reports = pool.run(tmp_path, 2, mode="stream", srcs=srcs)
    for report in reports:
        assert "SourceNotFoundError" in failed(report, "RankFailedError", 1)


def refused(report: dict[str, Any], *words: str) -> None:
    assert report.get("error") == "AllocationError", report
    assert report["safetensors_error"] and not report["distributed"], report
    for word in words:
        assert word in report["message"], report


def test_caps_refuse_the_file_on_every_rank(tmp_path: Path, layers: Path, pool: Pool) -> None:
    """A cap one rank has (an argument, or set with ``using_caps``) refuses the file on every
    rank as a single load would, before anything is allocated; a file within the caps loads."""
    layer = 256 * 256 * 4
    reports = pool.run(
        tmp_path,
        3,
        mode="load_file",
        src=str(layers),
        options=[{}, {}, {"max_tensor_bytes": layer - 1}],
    )
    for report in reports:
        refused(report, "for rank 2", "'layer0'", f"max_tensor_bytes={layer - 1}")
    include = [["layer0"], ["layer1", "layer2"]]
    ambient = [[None, None], [None, 2 * layer - 1]]
    reports = pool.run(
        tmp_path, 2, mode="stream", src=str(layers), include=include, ambient=ambient
    )
    for report in reports:
        refused(report, "for rank 1", f"max_total_bytes={2 * layer - 1}")
    index = write_index(tmp_path, {f"layer{i}": torch.zeros(256, 256) for i in range(4)}, 2)
    over = [{}, {"max_total_bytes": 3 * layer}]  # the first shard fits, not the second
    reports = pool.run(tmp_path, 2, mode="load_file", src=str(index), options=over)
    for report in reports:
        refused(report, "m-2.safetensors, for rank 1", f"declare {4 * layer} bytes")
    fits = [{"max_tensor_bytes": layer, "max_total_bytes": 8 * layer}] * 2
    again = pool.run(tmp_path, 2, mode="load_file", src=str(layers), options=fits)
    for report in again:
        assert_same(ok(report), reference_load(str(layers)))


@pytest.mark.parametrize(("damage", "bad"), [("truncated", 1), ("flipped", 1), ("flipped", 2)])
def test_a_bad_copy_on_one_rank(tmp_path: Path, pool: Pool, damage: str, bad: int) -> None:
    """Rank ``bad`` reads its share from a copy that ends early, or has a byte changed in a file
    whose header records digests: found once stripes have moved, every rank raises naming the
    rank that read the bad bytes (not the first rank to find them), none hands out a model."""
    gen = torch.Generator().manual_seed(5)
    path = tmp_path / "sums.safetensors"
    layers = {f"layer{i}": torch.randn(256, 256, generator=gen) for i in range(8)}
    stream_st.torch.save_file(layers, str(path), checksums=True)
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        del data[len(data) * 3 // 4 :]
    else:  # a byte in the middle of a stripe rank ``bad`` reads, in a tensor whose bytes
        # ranks 1 and 2 read (stripe k is rank k's of 3)
        start = 8 + int.from_bytes(data[:8], "little")
        data[start + stripe_size(len(data) - start, 3) * (2 * bad + 1) // 2] ^= 0xFF
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(data)
    srcs = [str(copy) if rank == bad else str(path) for rank in range(3)]
    reports = pool.run(tmp_path, 3, mode="load_file", srcs=srcs)
    for report in reports:
        if damage == "truncated":  # rank 1 read a stripe its copy lacks
            assert "TruncatedStreamError" in failed(report, "RankFailedError", bad)
        else:  # rank ``bad`` sent bytes every rank found wrong
            message = failed(report, "RankFailedError", bad)
            assert f"IntegrityError: tensor 'layer1' from rank {bad}'s source" in message, report
        assert "tensors" not in report


DESTROYED = """
import datetime, sys
import torch, torch.distributed as dist
import stream_st, stream_st.torch

path, port = sys.argv[1], int(sys.argv[2])
dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
    timeout=datetime.timedelta(seconds=30),
)
group = dist.new_group([0])
dist.destroy_process_group(group)
for call in (
    lambda: stream_st.torch.load_file(path, process_group=group),
    lambda: stream_st.torch.load_model(torch.nn.Module(), path, process_group=group, strict=False),
):
    try:
        call()
        print("no error")
    except stream_st.UsageError as exc:
        print("UsageError:", exc)
dist.destroy_process_group()
"""


def test_a_destroyed_group_is_refused_as_misuse(tmp_path: Path) -> None:
    """A process group destroyed (``destroy_process_group(group)``) while the default one lives
    on, passed as ``process_group=``, raised torch's bare ValueError ("Group ... is not
    registered")."""
    path = tmp_path / "m.safetensors"
    reference_save({"a": torch.zeros(2)}, str(path))
    result = subprocess.run(
        [sys.executable, "-c", DESTROYED, str(path), str(free_port())],
        capture_output=True,
        text=True,
        timeout=WAIT,
        env=ENV,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all("not a live process group" in line for line in lines), lines


def test_a_rank_left_out_of_a_subgroup_is_told_so(tmp_path: Path) -> None:
    """``new_group`` gives a rank it leaves out torch's non-member sentinel (the int -100):
    passed on as ``process_group=``, it was refused as "got int", where the rank is not a
    member of the group."""
    path = tmp_path / "m.safetensors"
    reference_save({"a": torch.zeros(2)}, str(path))
    with pytest.raises(stream_st.UsageError, match="not a member of process_group"):
        stream_st.torch.load_file(path, process_group=dist.GroupMember.NON_GROUP_MEMBER)
