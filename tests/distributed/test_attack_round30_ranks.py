"""Group loads found wrong by an attack (round 30), in real gloo groups.

A rank whose load was cancelled by asyncio's own cancellation (``asyncio.timeout``,
``Task.cancel``: it goes through anyio's shields) left a gate or a gather half done: every rank
then waited until the group's timeout and raised :class:`~stream_st.RankLostError`, and the
group could not be used again. Now the collective is finished first, as under anyio's
cancellation: the others raise :class:`~stream_st.RankFailedError` ("it was cancelled") at once,
the cancelled rank gets its own cancellation, and the group stays in step.

A rank that owned a tensor (reading it whole to cut another rank's slice) and wanted a
contiguous slice of it itself read that slice's bytes a second time; and a rank read its ranges
in the order of its reads, not of their offsets (a stripe that spans a tensor it reads alone):
from a sequential source (a FIFO, an async iterator) both were a seek back, and every rank
raised. Now each rank reads each byte once, in offset order."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

from safetensors.torch import save_file as reference_save  # noqa: E402

from ._group import free_port, spawn  # noqa: E402

GROUP_TIMEOUT = 5
"""The scenarios' group waits this long: a rank left behind makes the others wait that long."""

HEAD = """
import asyncio, datetime, json, os, sys, threading, time
import anyio, torch, torch.distributed as dist
import stream_st, stream_st.torch
from stream_st.sharded.ranks_group import RankGroup
from stream_st.transports.base import Source
from stream_st.transports.file.source import FileSource
from tests.distributed._worker import init

params = json.loads(open(sys.argv[1]).read())
rank = int(sys.argv[2])
init(params["port"], rank, 2, 60)
group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=params["timeout"]))
state = {"arm": None, "asked": None, "got": 0, "slow": 0.0, "where": None, "how": None}
state.update(count=0, calls=0, met=False)
reads = []

def counted(read):
    async def read_into_at(self, offset, buffer):
        if state["slow"]:
            await anyio.sleep(state["slow"])
        got = await read(self, offset, buffer)
        reads.append((offset, offset + got))
        return got
    return read_into_at

FileSource.read_into_at = counted(FileSource.read_into_at)
Source.read_into_at = counted(Source.read_into_at)

def described(exc):
    named = getattr(exc, "rank", None)
    return {"error": type(exc).__name__, "message": str(exc), "named": named}

report = {}
"""
"""Each rank: the group (waiting ``timeout`` seconds), reads counted (and slowed down while
``state["slow"]``), errors described."""

CANCEL = """
agree, gather = RankGroup.agree, RankGroup.gather

def note(path, said):
    with open(path + ".part", "w") as out:
        out.write(said)
    os.replace(path + ".part", path)

def note_once_cancelled(path):
    if state["asked"]():
        note(path, "cancelled")
    else:
        asyncio.get_running_loop().call_later(0.01, note_once_cancelled, path)

async def met(arming, collective):
    if state["where"] is None or state["met"]:
        return await collective()
    state["calls"] += 1
    path = os.path.join(params["dir"], f"{state['where']}-{state['how']}-{state['calls']}")
    if rank == 1:
        if arming:
            state["met"] = True
            state["arm"]()
            note_once_cancelled(path)
        else:
            note(path, "entered")
        return await collective()
    held = time.monotonic() + params["hold"]
    while not os.path.exists(path):
        if time.monotonic() > held:
            state["met"] = True
            raise RuntimeError(f"rank 1 did not come to collective {state['calls']}")
        await asyncio.sleep(0.01)
    with open(path) as said:
        state["met"] = said.read() == "cancelled"
    return await collective()

async def arming_agree(self, failure=None):
    got, where = state["got"], state["where"]
    arming = failure is None and (
        (where == "gate" and got) or (where == "end" and got == state["count"])
    )
    return await met(arming, lambda: agree(self, failure))

async def arming_gather(self, value, failure=None):
    return await met(state["where"] == "open", lambda: gather(self, value, failure))

RankGroup.agree, RankGroup.gather = arming_agree, arming_gather

async def consume(src):
    async with stream_st.open_stream(src, framework="pt", process_group=group) as stream:
        async for name, tensor in stream:
            state["got"] += 1
    return state["got"]

async def cancelled(src, how):
    loop = asyncio.get_running_loop()
    result = {}
    try:
        if rank == 0:
            result["got"] = await consume(src)
        elif how == "timeout":
            async with asyncio.timeout(None) as scope:
                state["arm"] = lambda: scope.reschedule(loop.time() + params["after"])
                state["asked"] = scope.expired
                result["got"] = await consume(src)
        else:
            task, asked = asyncio.create_task(consume(src)), []

            def cancel():
                asked.append(task.cancel())

            state["arm"] = lambda: loop.call_later(params["after"], cancel)
            state["asked"] = lambda: bool(asked)
            result["got"] = await task
    except BaseException as exc:
        result.update(described(exc))
    try:  # a cancellation asked again of the task is raised within its scope, not here
        await asyncio.sleep(0.05)
    except asyncio.CancelledError:
        result["leaked"] = True
    return result

for where, how in params.get("cancels", []):
    state.update(where=where, how=how, got=0, count=params["count"], calls=0, met=False)
    state["slow"] = params["slow"] if rank == 1 and where == "gate" else 0.0
    result = asyncio.run(cancelled(params["src"], how))
    state.update(slow=0.0, arm=None, asked=None, where=None)
    try:
        result["again"] = len(stream_st.torch.load_file(params["src"], process_group=group))
    except Exception as exc:
        result["again"] = described(exc)
    report[f"{where}-{how}"] = result
"""
"""Rank 1 cancelled by asyncio (``cancels``: where, how) ``after`` seconds into a collective
where it waits for rank 0: it notes each collective of the load it comes to in a file (rank 0
comes to each only once that note is there), and the one it is to be cancelled in only once
the cancellation has been asked of its task, so that it lands inside the collective however
slow the machine (rank 0 gives up after ``hold`` seconds without a note, a hang guard); then
both load the file again."""

READ = """
def source(kind, name):
    path = os.path.join(params["dir"], f"{name}.safetensors")
    if kind == "file":
        return path
    data = open(path, "rb").read()
    if kind == "fifo":
        path = os.path.join(params["dir"], f"{name}.fifo{rank}")
        os.mkfifo(path)

        def feed():
            try:
                with open(path, "wb") as pipe:
                    pipe.write(data)
            except BrokenPipeError:
                pass

        threading.Thread(target=feed, daemon=True).start()
        return path

    async def chunks():
        yield data

    return chunks()

async def read_once(src, options):
    out = {}
    async with stream_st.open_stream(src, framework="pt", process_group=group, **options) as s:
        async for name, tensor in s:
            out[name] = tensor.tolist()
    return out

for case, kind in params.get("reads", []):
    options = dict(params["options"][case][rank])
    if "slices" in options:
        options["slices"] = {k: tuple(v) for k, v in options["slices"].items()}
    del reads[:]
    try:
        result = {"got": asyncio.run(read_once(source(kind, case), options))}
    except Exception as exc:
        result = described(exc)
    result["reads"] = list(reads)
    report[f"{case}-{kind}"] = result
"""
"""Each of ``reads`` (case, kind) read from a file, a FIFO or an async iterator, with each
rank's ``options`` of the case; every read of the source reported."""

TAIL = """
with open(os.path.join(params["dir"], f"rank{rank}.json"), "w") as out:
    json.dump(report, out)
dist.destroy_process_group()
"""


def run_ranks(tmp: Path, **params: Any) -> list[dict[str, Any]]:
    """Run the scenarios ``params`` name as two ranks in one group; each rank's report."""
    script = tmp / "rank.py"
    script.write_text(HEAD + CANCEL + READ + TAIL)
    spec = tmp / "params.json"
    spec.write_text(
        json.dumps({**params, "port": free_port(), "timeout": GROUP_TIMEOUT, "dir": str(tmp)})
    )
    _, errors = spawn([[sys.executable, str(script), str(spec), str(rank)] for rank in range(2)])
    reports = []
    for rank in range(2):
        path = tmp / f"rank{rank}.json"
        assert path.exists(), errors[rank][-3000:]
        reports.append(json.loads(path.read_text()))
    return reports


COUNT = 16

CANCELS = [("gate", "timeout"), ("gate", "task"), ("open", "timeout"), ("end", "timeout")]
"""Where rank 1 is cancelled (at a gate mid-load, reading ahead meanwhile; at the gather of
headers; at the last gate), and how (``asyncio.timeout``; ``Task.cancel`` of the task)."""


@pytest.fixture(scope="module")
def cancels(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every run of :data:`CANCELS`, one after another in one group: rank 1 waits for rank 0 in
    a collective, where asyncio cancels rank 1, rank 0 held out of it until then; then every
    rank loads the file again with the same group."""
    tmp = tmp_path_factory.mktemp("cancel")
    src = tmp / "layers.safetensors"
    gen = torch.Generator().manual_seed(30)
    layers = {f"layer{i:02d}": torch.randn(192, 256, generator=gen) for i in range(COUNT)}
    reference_save(layers, str(src))
    return run_ranks(
        tmp,
        src=str(src),
        cancels=CANCELS,
        count=COUNT,
        after=0.2,
        hold=30,
        slow=0.1,  # rank 1 reads slowly: it still reads ahead when the gate it waits at ends
    )


@pytest.mark.parametrize(("where", "how"), CANCELS)
def test_a_rank_cancelled_by_asyncio_fails_the_group_at_once(
    cancels: list[dict[str, Any]], where: str, how: str
) -> None:
    """Cancelled mid-load (or at the gather of headers), rank 1 raises its own cancellation
    (``TimeoutError`` out of ``asyncio.timeout``, ``CancelledError`` out of the cancelled
    task) and rank 0 ``RankFailedError`` naming it, both well within the group's timeout (they
    waited for it and raised ``RankLostError``); the group loads again. Cancelled at the last
    gate, the load is over for every rank: rank 0 has every tensor, and rank 1 too (as under
    anyio, where no checkpoint came before its block ended) or raises its cancellation; nothing
    of it is left to cancel the task past its ``asyncio.timeout`` block."""
    first, second = (report[f"{where}-{how}"] for report in cancels)
    for result in (first, second):
        assert result["again"] == COUNT, result
        assert not result.get("leaked"), result
    expected = "TimeoutError" if how == "timeout" else "CancelledError"
    if where == "end":
        assert first == {"got": COUNT, "again": COUNT}, first
        assert second.get("got") == COUNT or second.get("error") == expected, second
        return
    assert second.get("error") == expected, second
    assert first.get("error") == "RankFailedError", first
    assert first["named"] == 1 and "rank 1 failed: it was cancelled" in first["message"], first


OPTIONS: dict[str, list[dict[str, Any]]] = {
    "slices": [{"slices": {"w": [0, 0, 2]}}, {"slices": {"w": [1, 1, 2]}}],
    "include": [{}, {"include": ["a", "c"]}],
}
"""Per case, each rank's options: ``slices`` (rank 0 wants a contiguous part of ``w`` and owns
it, reading it whole to cut rank 1's part); ``include`` (rank 0 reads ``b`` alone, between the
stripes it shares: one of them spans it)."""

SMALL = {"a": 5, "b": 7, "c": 5}
"""The ``include`` case's tensors and their bytes (a stripe is a byte or two)."""


def _small() -> dict[str, Any]:
    """:data:`SMALL`'s tensors, each numbered from ten times its place."""
    return {
        name: torch.arange(size, dtype=torch.uint8) + 10 * place
        for place, (name, size) in enumerate(SMALL.items())
    }


READS = [(case, kind) for case in OPTIONS for kind in ("file", "fifo", "aiter")]


@pytest.fixture(scope="module")
def reads(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every run of :data:`READS`, one after another in one group."""
    tmp = tmp_path_factory.mktemp("reads")
    reference_save({"w": torch.arange(4096.0).reshape(64, 64)}, str(tmp / "slices.safetensors"))
    reference_save(_small(), str(tmp / "include.safetensors"))
    return run_ranks(tmp, reads=READS, options=OPTIONS)


def _expected(case: str, rank: int) -> dict[str, Any]:
    if case == "include":
        every = {name: tensor.tolist() for name, tensor in _small().items()}
        return every if rank == 0 else {"a": every["a"], "c": every["c"]}
    whole = torch.arange(4096.0).reshape(64, 64)
    dim, part, parts = OPTIONS["slices"][rank]["slices"]["w"]
    return {"w": torch.tensor_split(whole, parts, dim=dim)[part].tolist()}


@pytest.mark.parametrize(("case", "kind"), READS)
def test_each_rank_reads_each_byte_once_in_offset_order(
    reads: list[dict[str, Any]], case: str, kind: str
) -> None:
    """Each rank gets what it asked for, from a file, a FIFO or an async iterator alike, and
    reads no byte twice, its reads in offset order (rank 0 read its part of ``w`` again after
    the whole tensor; read ``c``'s first bytes before ``b``: from a sequential source each was
    a seek back, and every rank raised ``RankFailedError``)."""
    for rank, report in enumerate(reads):
        result = report[f"{case}-{kind}"]
        assert result.get("got") == _expected(case, rank), result
        spans = [tuple(span) for span in result["reads"] if span[1] > span[0]]
        assert spans == sorted(spans), spans
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans
