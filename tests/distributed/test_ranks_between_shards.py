"""A sharded checkpoint read by a real gloo group, one rank failing between two shards: after
the first shard's last gate, before the second shard's gather of headers and wants.

A rank whose source of the first shard raised as it was closed, that was cancelled there, or
whose ``include=`` was interrupted on a name of the second shard raised on its own: the others
waited in the second shard's gather for it until the group's timeout and then raised
:class:`~stream_st.RankLostError`. Now the failure is told to them at that gather, as one that
comes while the next shard opens is (a bad header: every rank's error names the shard): every
rank raises at once, :class:`~stream_st.RankFailedError` naming the rank and the cause (the
failing rank its own cancellation or interrupt), and the group stays in step."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

from . import _group  # noqa: E402
from .test_load import write_index  # noqa: E402

GROUP_TIMEOUT = 120
"""The groups' timeout: a rank left waiting for a failed one would wait this long."""

JOIN = 60.0
"""How long the test waits for each rank, well under :data:`GROUP_TIMEOUT`: a rank still
waiting then is a hang, and fails the test."""

SCRIPT = """
import asyncio, datetime, json, os, sys
import anyio, torch.distributed as dist
import stream_st, stream_st.torch
from stream_st.transports.file.source import FileSource

params = json.loads(open(sys.argv[1]).read())
rank = int(sys.argv[2])
timeout = datetime.timedelta(seconds=params["timeout"])
address = f"tcp://127.0.0.1:{params['port']}"
dist.init_process_group("gloo", init_method=address, rank=rank, world_size=2, timeout=timeout)
group = dist.new_group([0, 1], timeout=timeout)
state = {"case": None, "scope": None}
closing = FileSource.aclose

async def failing_close(self):
    await closing(self)
    if rank == 1 and self.name.endswith("m-1.safetensors"):
        if state["case"] == "close":
            raise OSError("the first shard's source failed as it closed")
        if state["case"] == "cancel":
            state["scope"].cancel()
            await anyio.lowlevel.checkpoint()

FileSource.aclose = failing_close

def wanted(name):
    if rank == 1 and state["case"] == "interrupt" and name == params["second"]:
        raise KeyboardInterrupt
    return True

async def consume(src):
    got = []
    with anyio.CancelScope() as scope:
        state["scope"] = scope
        async with stream_st.open_stream(
            src, framework="pt", process_group=group, include=wanted
        ) as stream:
            async for name, tensor in stream:
                got.append(name)
    if scope.cancelled_caught:
        return {"error": "cancelled"}
    return {"got": got}

def described(exc):
    said = {"error": type(exc).__name__, "message": str(exc)}
    said["safetensors_error"] = isinstance(exc, stream_st.SafetensorsError)
    said["named"] = getattr(exc, "rank", None)
    return said

report = {}
for case in params["cases"]:
    state["case"] = case
    src = params["srcs"][case][rank]
    try:
        result = asyncio.run(consume(src))
    except BaseException as exc:
        result = described(exc)
    state["case"] = None
    dist.barrier()  # the other group: a rank left waiting in the load's never comes here
    try:
        result["again"] = len(stream_st.torch.load_file(params["good"], process_group=group))
    except Exception as exc:
        result["again"] = described(exc)
    report[case] = result

with open(os.path.join(params["dir"], f"rank{rank}.json"), "w") as out:
    json.dump(report, out)
dist.destroy_process_group()
"""
"""Each rank: every case of ``cases`` in turn, rank 1 failing between the two shards as the
case says, then both ranks meet in the default group and load the checkpoint again."""

CASES = ["close", "cancel", "interrupt", "header"]
"""How rank 1 fails: its source of the first shard raises as it is closed (``close``); it is
cancelled there (``cancel``); its ``include=`` raises ``KeyboardInterrupt`` on a name of the
second shard (``interrupt``); its own copy of the second shard has a bad header (``header``)."""

COUNT = 6
CUT = 3
"""Tensors in the checkpoint, the first ``CUT`` in its first shard."""


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's report of every case of :data:`CASES`, run one after another in one group."""
    tmp = tmp_path_factory.mktemp("between")
    gen = torch.Generator().manual_seed(31)
    every = {f"layer{i}": torch.randn(64, 64, generator=gen) for i in range(COUNT)}
    (tmp / "good").mkdir()
    (tmp / "bad").mkdir()
    good = write_index(tmp / "good", every, CUT)
    bad = write_index(tmp / "bad", every, CUT)
    second = bad.parent / "m-2.safetensors"
    raw = bytearray(second.read_bytes())
    raw[8] = ord("[")  # the header is no longer a JSON object
    second.write_bytes(bytes(raw))
    srcs = {case: [str(good), str(good)] for case in CASES}
    srcs["header"] = [str(good), str(bad)]
    script = tmp / "rank.py"
    script.write_text(SCRIPT)
    spec = tmp / "params.json"
    params = {"port": _group.free_port(), "timeout": GROUP_TIMEOUT, "dir": str(tmp)}
    params.update(cases=CASES, srcs=srcs, good=str(good), second=f"layer{CUT + 1}")
    spec.write_text(json.dumps(params))
    commands = [[sys.executable, str(script), str(spec), str(rank)] for rank in range(2)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_group, "WAIT", JOIN)
        try:
            codes, errors = _group.spawn(commands)
        except subprocess.TimeoutExpired:
            pytest.fail(f"a rank still waited after {JOIN} s: the group hung")
    assert codes == [0, 0], errors
    return [json.loads((tmp / f"rank{rank}.json").read_text()) for rank in range(2)]


OWN = {"close": "RankFailedError", "cancel": "cancelled", "interrupt": "KeyboardInterrupt"}
"""What rank 1 raises, failing as each case says."""

TOLD = {
    "close": "rank 1 failed: OSError: the first shard's source failed as it closed",
    "cancel": "rank 1 failed: it was cancelled",
    "interrupt": "rank 1 failed: KeyboardInterrupt",
}
"""What rank 0 is told, rank 1 failing as each case says."""


@pytest.mark.parametrize("case", CASES)
def test_a_rank_failing_between_shards_fails_every_rank_at_once(
    reports: list[dict[str, Any]], case: str
) -> None:
    """Rank 0 raises :class:`~stream_st.RankFailedError` naming rank 1 and its cause (it
    waited in the second shard's gather until the group's timeout), rank 1 its own error; then
    both load the checkpoint again in the same group."""
    first, second = (report[case] for report in reports)
    for result in (first, second):
        assert result["again"] == COUNT, result
    assert first["error"] == "RankFailedError" and first["safetensors_error"], first
    assert first["named"] == 1, first
    if case == "header":
        for result in (first, second):
            assert result["error"] == "RankFailedError" and result["named"] == 1, result
            assert result["message"].startswith("rank 1 failed: HeaderError: "), result
            assert "m-2.safetensors" in result["message"], result
        return
    assert first["message"] == TOLD[case], first
    assert second["error"] == OWN[case], second
    if case == "close":
        assert second["message"] == TOLD[case] and second["named"] == 1, second
