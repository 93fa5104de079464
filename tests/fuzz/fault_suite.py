"""Fault-injection suite: reads and writes through ``tests/servers/fault_proxy.py``, every promise
checked.

    python -m tests.fuzz.fault_suite --cases 300 --seed 1     # random cases, one table of counts
    python -m tests.fuzz.fault_suite --replay 17              # one case again, with its traceback

Each case is drawn from its seed: a medium (HTTP reads plain, with ``include=`` and with parallel
ranges; S3 reads, single-PUT and multipart writes on moto; ``tcp://`` reads and writes; HTTP
uploads; local files), a fault (reset, stall, truncate, flip, drop or duplicate bytes at a random
offset of the client-to-server or server-to-client bytes, on the first connection that reaches it
or on every connection; or a cancellation of the caller at a random moment) and runs once. Checked
for every case:

1. every error raised is a ``SafetensorsError`` (or the caller's own cancellation), and nothing
   hangs past the guard;
2. every array yielded has its header's shape and dtype (no short tensor);
3. a failed write leaves nothing at the destination (no file or temporary file, no stored HTTP
   upload, no S3 object and no pending multipart upload), unless it raised
   ``OutcomeUnknownError``, or its error's note says that its CreateMultipartUpload named no
   upload (:data:`UNNAMED_UPLOAD`: that one upload, which no writer can tell from another's, may
   be left pending; an upload whose abort failed may not); a TCP peer never receives a complete
   message of a failed write;
4. no file descriptor or asyncio task outlives the case, and nothing unraisable (a
   ``ResourceWarning``, a task destroyed while pending) was reported meanwhile;
5. (``--concurrent N``) N streams at once, some cancelled, stay within a memory bound.

Corrupted data bytes cannot be detected in a plain safetensors file (no checksums): a success that
delivered other bytes is counted as "wrong (undetectable)", not as a violation. The exit status is
1 when any violation occurred; each is printed with its seed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import random
import re
import resource
import socket
import sys
import tempfile
import time
import traceback
import tracemalloc
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import OutcomeUnknownError, SafetensorsError, TensorSpec
from stream_st.transports.http.source import HttpSource
from stream_st.transports.s3.config import S3Config
from stream_st.transports.s3.sink import MIN_PART_SIZE, S3Sink
from stream_st.transports.s3.source import S3Source

from ..servers._loopback import LoopbackServer
from ..servers.fault_proxy import CORRUPTIONS, CUTS, Direction, Fault, FaultKind, FaultProxy
from ..servers.http_server import RangeHTTPServer
from ..servers.s3_server import CREDENTIALS, MotoS3Server

Arrays = dict[str, np.ndarray[Any, Any]]

TIMEOUT = 0.5
"""Each network wait's bound in the code under test: a stall must end in ReadTimeoutError."""

GUARD = 20.0
"""A case still running after this many seconds hangs: a violation."""

BUCKET = "faults"

UNNAMED_UPLOAD = re.compile(
    r"CreateMultipartUpload for \S+: .*; the upload it may have made has no known id"
)
"""The note on an S3 write's error whose CreateMultipartUpload named no upload (its answer lost,
a 5xx, a 200 without an UploadId): the one upload a failed write may leave pending. The note on
an abort that failed or timed out also says "may still be pending", but such an upload is the
sink's to abort: left pending, it is a violation."""


def _payload() -> Arrays:
    """A ~250 kB file: several dtypes, a scalar, an empty tensor, one past the first 64 KiB."""
    rng = np.random.default_rng(0)
    return {
        "embed": rng.standard_normal((64, 256)).astype(np.float32),
        "w1": rng.standard_normal((128, 128)).astype(np.float16),
        "b1": np.arange(100, dtype=np.int64),
        "scalar": np.array(2.5),
        "flags": np.array([True, False, True, True, False, False, True]),
        "empty": np.zeros((0, 4), np.float16),
        "big": rng.integers(0, 256, 150_000, dtype=np.uint8),
    }


PAYLOAD = _payload()
METADATA = {"origin": "fault-suite"}
PAYLOAD_FILE: bytes = reference_numpy.save(PAYLOAD, metadata=METADATA)
MULTIPART = {"blob": np.random.default_rng(1).integers(0, 256, MIN_PART_SIZE + (1 << 20), np.uint8)}
MULTIPART_FILE: bytes = reference_numpy.save(MULTIPART, metadata=METADATA)
INCLUDE = {"w1", "big", "flags"}

KINDS: tuple[str, ...] = ("reset", "stall", "truncate", "flip", "drop", "duplicate", "cancel")


@dataclass(frozen=True)
class Medium:
    """Where bytes go: ``reads`` (or writes) ``tensors``, through the proxy to ``server``."""

    name: str
    server: str  # "http", "s3", "tcp-send", "tcp-collect" or "" (a local file: no proxy)
    writes: bool
    directions: tuple[Direction, ...]
    tensors: Arrays = field(default_factory=lambda: PAYLOAD, repr=False, compare=False)

    @property
    def file(self) -> bytes:
        return MULTIPART_FILE if self.tensors is MULTIPART else PAYLOAD_FILE


MEDIA = {
    m.name: m
    for m in (
        Medium("http", "http", False, ("down", "up")),
        Medium("http-include", "http", False, ("down", "up")),
        Medium("http-parallel", "http", False, ("down", "up")),
        Medium("s3-read", "s3", False, ("down", "up")),
        Medium("tcp-read", "tcp-send", False, ("down",)),
        Medium("http-upload", "http", True, ("up", "down")),
        Medium("s3-put", "s3", True, ("up", "down")),
        Medium("s3-multipart", "s3", True, ("up", "down"), MULTIPART),
        Medium("tcp-write", "tcp-collect", True, ("up",)),
        Medium("file-read", "", False, ()),
        Medium("file-write", "", True, ()),
    )
}


@dataclass(frozen=True)
class Case:
    """One run, drawn from ``seed``: the medium and the fault (``position`` is a fraction of the
    traffic in the fault's direction; for ``cancel``, of the clean run's duration)."""

    seed: int
    medium: Medium
    kind: str
    direction: Direction
    position: float
    count: int
    mask: int
    every_connection: bool

    @classmethod
    def draw(cls, seed: int) -> Case:
        rng = random.Random(seed)
        medium = MEDIA[rng.choice(sorted(MEDIA))]
        kind = rng.choice(KINDS) if medium.directions else "cancel"
        return cls(
            seed=seed,
            medium=medium,
            kind=kind,
            direction=rng.choice(medium.directions) if medium.directions else "down",
            position=rng.random() * 1.2 if kind == "cancel" else rng.random(),
            count=rng.choice((1, 1, 1, 2, 7)),
            mask=rng.randrange(1, 256),
            every_connection=kind in CUTS and rng.random() < 0.25,
        )

    def describe(self) -> str:
        where = "" if self.kind == "cancel" else f" {self.direction} x{self.count}"
        every = " every-connection" if self.every_connection else ""
        what = f"{self.medium.name} {self.kind}{where}{every}"
        return f"seed {self.seed}: {what} @{self.position:.3f}"


@dataclass
class Result:
    """How a case ended: ``verdict`` is correct, error, wrong, artifact or violation."""

    case: Case
    verdict: str
    detail: str = ""
    fired: bool = True
    elapsed: float = 0.0  # seconds the operation itself ran


class Violation(Exception):
    """A promise was broken; the message says which."""


# ---------------------------------------------------------------------- servers and leaks


class Collector(LoopbackServer):
    """Keeps every byte each connection sent, until it closed or was reset."""

    def __init__(self) -> None:
        self.received: list[bytes] = []
        super().__init__()

    def handle(self, connection: socket.socket) -> None:
        data = bytearray()
        try:
            while chunk := connection.recv(1 << 16):
                data += chunk
        finally:  # reset or not, what arrived is what the peer got
            self.received.append(bytes(data))


class Sender(LoopbackServer):
    """Sends ``data`` to each client, then waits for the client to close."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        super().__init__()

    def handle(self, connection: socket.socket) -> None:
        connection.sendall(self._data)
        connection.shutdown(socket.SHUT_WR)
        while connection.recv(1 << 16):
            pass


def open_fds() -> dict[int, str]:
    """This process's file descriptors and what each points at."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the directory's own descriptor, closed by now
            found[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return found


@contextmanager
def watched() -> Iterator[list[str]]:
    """Collect what is reported unraisable (``ResourceWarning`` in ``__del__``, a pending task
    destroyed) while the block runs; the caller checks the list."""
    reports: list[str] = []
    previous = sys.unraisablehook

    def hook(report: Any) -> None:
        reports.append(f"unraisable: {report.exc_type.__name__}: {report.exc_value}")

    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: reports.append(context["message"]))
    sys.unraisablehook = hook
    try:
        yield reports
    finally:
        sys.unraisablehook = previous
        loop.set_exception_handler(None)


async def settled_fds(before: dict[int, str], patience: float = 3.0) -> dict[int, str]:
    """The descriptors still open beyond ``before`` once the servers' threads had time to let
    go of theirs (up to ``patience`` seconds); empty when nothing leaked."""
    extra: dict[int, str] = {}
    for _ in range(max(1, int(patience / 0.05))):
        gc.collect()
        extra = {fd: what for fd, what in open_fds().items() if before.get(fd) != what}
        if not extra:
            break
        await anyio.sleep(0.05)
    return extra


# ---------------------------------------------------------------------- the operations


def plan_of(tensors: Arrays) -> list[TensorSpec]:
    return [
        TensorSpec(name, stream_st.dtype_for(a.dtype).code, a.shape) for name, a in tensors.items()
    ]


async def read_checked(src: Any, include: set[str] | None = None) -> Arrays:
    """Every tensor of ``src``, each checked against its header entry as it arrives."""
    arrays: Arrays = {}
    async with stream_st.open_stream(src, include=include, timeout=TIMEOUT) as stream:
        header = stream.header
        async for name, array in stream:
            info = header[name]
            if array.shape != info.array_shape or array.dtype != info.array_dtype:
                raise Violation(
                    f"tensor {name!r} yielded as {array.dtype}{list(array.shape)}, header says "
                    f"{info.array_dtype}{list(info.array_shape)}"
                )
            arrays[name] = array
    return arrays


async def write_all(dst: Any, tensors: Arrays) -> None:
    """Write ``tensors`` to ``dst``, byte-identical to the reference's file of them."""
    plan = plan_of(tensors)
    async with stream_st.open_writer(
        dst, plan, metadata=METADATA, order="reference", timeout=TIMEOUT
    ) as writer:
        for info in writer.header.tensors:
            await writer.write(info.name, tensors[info.name])


def layout(arrays: Arrays) -> list[tuple[str, str, tuple[int, ...]]]:
    """Names, dtypes and shapes: what a header says."""
    return sorted((name, str(a.dtype), a.shape) for name, a in arrays.items())


def same(got: Arrays, want: Arrays) -> bool:
    return got.keys() == want.keys() and all(
        got[n].dtype == want[n].dtype and np.array_equal(got[n], want[n]) for n in want
    )


class Suite:
    """The servers every case shares, the clean runs' measurements, and running one case."""

    def __init__(self, stack: ExitStack, workdir: Path) -> None:
        self.workdir = workdir
        self.http = stack.enter_context(RangeHTTPServer(objects={"/model": PAYLOAD_FILE}))
        self.s3 = stack.enter_context(MotoS3Server())
        self.boto = self.s3.client()
        self.boto.create_bucket(Bucket=BUCKET)
        self.boto.put_object(Bucket=BUCKET, Key="model", Body=PAYLOAD_FILE)
        self.sender = Sender(PAYLOAD_FILE)
        stack.callback(self.sender.stop)
        self.calibration: dict[str, tuple[dict[str, int], float]] = {}

    @staticmethod
    def s3_config(port: int) -> S3Config:
        return S3Config.resolve(
            endpoint_url=f"http://127.0.0.1:{port}",
            region=CREDENTIALS["AWS_DEFAULT_REGION"],
            access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            environ={},
        )

    def operation(self, case: Case, port: int) -> Callable[[], Awaitable[Arrays | None]]:
        """The read or write of ``case`` through 127.0.0.1:``port``."""
        name, seed, tensors = case.medium.name, case.seed, case.medium.tensors

        def source(**options: Any) -> HttpSource:
            url = f"http://127.0.0.1:{port}/model"
            return HttpSource(url, backoff=0.01, **options)  # limits: read_checked

        reads: dict[str, Callable[[], Awaitable[Arrays]]] = {
            "http": lambda: read_checked(source()),
            "http-include": lambda: read_checked(source(), INCLUDE),
            "http-parallel": lambda: read_checked(source(concurrency=3, part_size=32768)),
            "s3-read": lambda: read_checked(
                S3Source(
                    f"s3://{BUCKET}/model",
                    config=self.s3_config(port),
                    backoff=0.01,
                )
            ),
            "tcp-read": lambda: read_checked(f"tcp://127.0.0.1:{port}"),
            "file-read": lambda: read_checked(self.workdir / "model.safetensors"),
        }
        if name in reads:
            return reads[name]
        if name == "http-upload":
            dst: Any = f"http://127.0.0.1:{port}/upload/{seed}"
        elif name.startswith("s3-"):
            dst = S3Sink(
                f"s3://{BUCKET}/out-{seed}",
                config=self.s3_config(port),
                part_size=MIN_PART_SIZE,
            )
        elif name == "tcp-write":
            dst = f"tcp://127.0.0.1:{port}"
        else:
            dst = self.workdir / "out" / f"{seed}.safetensors"

        async def write() -> None:
            await write_all(dst, tensors)

        return write

    def target(self, medium: Medium, collector: Collector | None) -> int:
        if medium.server == "http":
            return self.http.port
        if medium.server == "s3":
            return self.s3.port
        if medium.server == "tcp-send":
            return self.sender.port
        assert collector is not None
        return collector.port

    def stored(self, case: Case, collector: Collector | None) -> tuple[bytes | None, int]:
        """What a write left at its destination, and how many multipart uploads are pending;
        removes it, so the next case starts clean."""
        name, seed = case.medium.name, case.seed
        if name == "http-upload":
            self.http.settle()
            return self.http.objects.pop(f"/upload/{seed}", None), 0
        if name.startswith("s3-"):
            key = f"out-{seed}"
            uploads = self.boto.list_multipart_uploads(Bucket=BUCKET, Prefix=key).get("Uploads", [])
            for upload in uploads:
                self.boto.abort_multipart_upload(
                    Bucket=BUCKET, Key=key, UploadId=upload["UploadId"]
                )
            try:
                data: bytes = self.boto.get_object(Bucket=BUCKET, Key=key)["Body"].read()
            except self.boto.exceptions.NoSuchKey:
                return None, len(uploads)
            self.boto.delete_object(Bucket=BUCKET, Key=key)
            return data, len(uploads)
        if name == "tcp-write":
            assert collector is not None
            return (collector.received[0] if collector.received else None), 0
        folder, final = self.workdir / "out", f"{seed}.safetensors"
        leftovers = sorted(p.name for p in folder.iterdir())
        found = (folder / final).read_bytes() if final in leftovers else None
        for path in folder.iterdir():
            path.unlink()
        if leftovers not in ([], [final]):
            raise Violation(f"files left beside the destination: {leftovers}")
        return found, 0

    async def calibrate(self) -> None:
        """Run every medium once, clean: its traffic per direction and its duration."""
        (self.workdir / "model.safetensors").write_bytes(PAYLOAD_FILE)
        (self.workdir / "out").mkdir(exist_ok=True)
        for medium in MEDIA.values():
            case = Case(0, medium, "none", "down", 0.0, 1, 0, False)
            result, carried = await self.run_once(case, Fault())
            if result.verdict != "correct":
                raise RuntimeError(f"clean run of {medium.name} failed: {result.detail}")
            self.calibration[medium.name] = (carried, result.elapsed)

    async def run(self, case: Case) -> Result:
        """Run ``case`` (measuring the clean runs first, once) and judge it."""
        if not self.calibration:
            await self.calibrate()
        carried, duration = self.calibration[case.medium.name]
        if case.kind == "cancel":
            result, _ = await self.run_once(case, Fault(), case.position * duration)
            return result
        offset = int(case.position * carried[case.direction])
        kind: FaultKind = case.kind  # type: ignore[assignment]
        fault = Fault(kind, case.direction, offset, case.count, case.mask, case.every_connection)
        result, _ = await self.run_once(case, fault)
        return result

    async def run_once(
        self, case: Case, fault: Fault, cancel_after: float | None = None
    ) -> tuple[Result, dict[str, int]]:
        """Run ``case`` with ``fault`` and judge it; the proxy's traffic per direction."""
        before_fds, before_tasks = open_fds(), len(asyncio.all_tasks())
        collector = Collector() if case.medium.server == "tcp-collect" else None
        proxy = None
        if case.medium.server:
            proxy = FaultProxy(("127.0.0.1", self.target(case.medium, collector)), fault)
            proxy.start()
        operation = self.operation(case, proxy.port if proxy else 0)
        with watched() as reports:
            began = time.perf_counter()
            outcome, value = await guarded(operation, cancel_after)
            elapsed = time.perf_counter() - began
            if proxy is not None:
                proxy.stop()
            if collector is not None:
                collector.stop()
            leaked = await settled_fds(before_fds)
            gc.collect()
        fired = proxy.fired if proxy is not None and fault.kind != "none" else True
        carried = dict(proxy.carried) if proxy is not None else {}
        try:
            stored, pending = self.stored(case, collector) if case.medium.writes else (None, 0)
            verdict, detail = judge(case, outcome, value, stored, pending)
            problems = [f"fd left open: {what}" for what in leaked.values()]
            if len(asyncio.all_tasks()) > before_tasks:
                problems.append(f"{len(asyncio.all_tasks()) - before_tasks} task(s) left running")
            problems += reports
            if problems:
                verdict, detail = (
                    "violation",
                    "; ".join([*problems, detail][: len(problems) + bool(detail)]),
                )
        except Violation as exc:
            verdict, detail = "violation", str(exc)
        return Result(case, verdict, detail, fired, elapsed), carried


async def guarded(
    operation: Callable[[], Awaitable[Any]], cancel_after: float | None
) -> tuple[str, Any]:
    """``("ok", value)``, ``("raised", exception)``, ``("cancelled", None)`` when the caller's
    cancellation (after ``cancel_after`` s) ended it, or ``("hang", None)`` past the guard."""
    with anyio.move_on_after(GUARD):
        try:
            with anyio.CancelScope() as scope:
                if cancel_after is not None:
                    scope.deadline = anyio.current_time() + cancel_after
                value = await operation()
                return "ok", value
            return "cancelled", None
        except Exception as exc:
            return "raised", exc
    return "hang", None


def judge(
    case: Case, outcome: str, value: Any, stored: bytes | None, pending: int
) -> tuple[str, str]:
    """The verdict on one case's outcome and what it left at the destination."""
    kind, medium = case.kind, case.medium
    if isinstance(value, Violation):
        raise value
    if outcome == "hang":
        raise Violation(f"still running after {GUARD} s")
    if outcome == "raised" and not isinstance(value, SafetensorsError):
        text = "".join(traceback.format_exception_only(value)).strip()
        raise Violation(f"raised {type(value).__module__}.{text}")
    error = f"{type(value).__name__}: {value}" if outcome == "raised" else outcome
    if not medium.writes:
        if outcome != "ok":
            return "error", error
        want = {n: a for n, a in PAYLOAD.items() if medium.name != "http-include" or n in INCLUDE}
        if same(value, want):
            return "correct", ""
        if kind in CORRUPTIONS and layout(value) == layout(want):
            return "wrong", "delivered other tensor data, no error"
        if kind in CORRUPTIONS:
            raise Violation(f"a corrupted header was accepted: {layout(value)}")
        raise Violation(f"{kind}: the read succeeded with other tensors")
    if pending:
        notes = getattr(value, "__notes__", ())
        if pending > 1 or not any(UNNAMED_UPLOAD.match(note) for note in notes):
            raise Violation(f"{pending} multipart upload(s) left pending ({error})")
        error += f" ({pending} multipart upload(s) left pending, as its note says)"
    expected = medium.file
    if medium.name == "tcp-write":
        return judge_peer(case, outcome, error, stored or b"")
    if outcome == "ok":
        if stored == expected:
            return "correct", ""
        if stored is not None and kind in CORRUPTIONS and case.direction == "up":
            return "wrong", "stored other bytes, no error"
        got = "nothing" if stored is None else f"{len(stored)} other bytes"
        raise Violation(f"the write succeeded and the destination holds {got}")
    if stored is None or isinstance(value, OutcomeUnknownError):
        return "error", error
    if kind in CORRUPTIONS and case.direction == "down":
        return "wrong", f"stored, but the answer was corrupted into: {error}"
    if kind in CORRUPTIONS and stored != expected:
        return "wrong", f"other bytes stored, and: {error}"
    if medium.server == "s3" and kind in CUTS and case.direction == "up" and stored != expected:
        return "artifact", f"moto stored a request cut short ({len(stored)} bytes; {error})"
    if outcome == "cancelled" and stored == expected:
        # The store committed before the cancellation could stop it: all of the object, never
        # a part, and the caller's cancellation stays a cancellation.
        return "error", "cancelled during the commit, which the store completed"
    raise Violation(f"the write failed ({error}) but the destination holds {len(stored)} bytes")


def judge_peer(case: Case, outcome: str, error: str, received: bytes) -> tuple[str, str]:
    """A TCP write: the peer must never receive a complete message of a failed write."""
    complete = received == case.medium.file
    if outcome != "ok":
        if complete:
            raise Violation(f"the write failed ({error}) but the peer received all of it")
        return "error", error
    if complete:
        return "correct", ""
    if case.kind in CORRUPTIONS:
        return "wrong", "the peer received other bytes"
    try:
        reference_numpy.load(received)
    except Exception as exc:  # cut on the way: the peer sees it end early
        return "error", f"peer: {type(exc).__name__}"
    raise Violation(f"{case.kind}: the peer received a different complete message")


# ---------------------------------------------------------------------- many streams at once


async def concurrent_streams(suite: Suite, count: int, seed: int) -> tuple[list[str], str]:
    """``count`` HTTP streams at once, a quarter cancelled at random; violations and figures."""
    rng = random.Random(seed)
    largest = max(a.nbytes for a in PAYLOAD.values())
    bound = count * (largest + (256 << 10)) + (16 << 20)
    problems: list[str] = []
    counts: Counter[str] = Counter()
    before_fds = open_fds()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    async def one(index: int) -> None:
        deadline = rng.uniform(0, 0.5) if rng.random() < 0.25 else None
        src = HttpSource(suite.http.url("/model"))
        outcome, value = await guarded(lambda: drain(src), deadline)
        counts[outcome] += 1
        if outcome == "hang" or (outcome == "raised" and not isinstance(value, SafetensorsError)):
            problems.append(f"stream {index}: {outcome} {value!r}")

    with watched() as reports:
        tracemalloc.start()
        async with anyio.create_task_group() as group:
            for index in range(count):
                group.start_soon(one, index)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        leaked = await settled_fds(before_fds)
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    problems += [f"fd left open: {what}" for what in leaked.values()] + reports
    if peak > bound:
        problems.append(f"traced memory peak {peak >> 20} MiB over the bound {bound >> 20} MiB")
    figures = (
        f"{count} concurrent HTTP streams: {dict(counts)}; traced peak {peak / 2**20:.1f} MiB "
        f"(bound {bound / 2**20:.1f} MiB), max RSS growth {rss_growth / 1024:.1f} MiB"
    )
    return problems, figures


async def drain(src: HttpSource) -> None:
    """Read every tensor and drop it; the last must match the payload."""
    async with stream_st.open_stream(src, timeout=5.0) as stream:
        async for name, array in stream:
            if not np.array_equal(array, PAYLOAD[name]):
                raise Violation(f"tensor {name!r} differs")


# ---------------------------------------------------------------------- driving it


@contextmanager
def suite_environment() -> Iterator[Suite]:
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        yield Suite(stack, Path(tmp))


async def run_cases(suite: Suite, seeds: Sequence[int]) -> list[Result]:
    return [await suite.run(Case.draw(seed)) for seed in seeds]


def table(results: Sequence[Result]) -> str:
    """Counts per medium and fault kind, and in all."""
    columns = ("correct", "error", "wrong", "artifact", "violation")
    rows: dict[tuple[str, str], Counter[str]] = {}
    for r in sorted(results, key=lambda r: (r.case.medium.name, r.case.kind)):
        for key in ((r.case.medium.name, r.case.kind), ("all", "all")):
            row = rows.setdefault(key, Counter())
            row[r.verdict] += 1
            row["unfired"] += not r.fired
    rows[("all", "all")] = rows.pop(("all", "all"))  # last
    titles = ("cases", "correct", "clean err", "wrong*", "server*", "VIOLATIONS", "unfired")
    head = f"{'medium':<14}{'fault':<10}" + "".join(f"{t:>11}" for t in titles)
    lines = [head, "-" * len(head)]
    for (medium, kind), row in rows.items():
        cells = [sum(row[c] for c in columns), *(row[c] for c in columns), row["unfired"]]
        lines.append(f"{medium:<14}{kind:<10}" + "".join(f"{n:>11}" for n in cells))
    lines.append("wrong* = other tensor data delivered or stored: undetectable without checksums")
    lines.append("server* = the test server (moto) stored a request whose head was cut short")
    lines.append("unfired = the traffic never reached the fault's offset (a clean run)")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> int:
    with suite_environment() as suite:
        if args.replay is not None:
            results = await run_cases(suite, [args.replay])
            result = results[0]
            print(f"{result.case.describe()}: {result.verdict} {result.detail}")
            return int(result.verdict == "violation")
        seeds = range(args.seed, args.seed + args.cases)
        results = await run_cases(suite, seeds)
        print(table(results))
        violations = [r for r in results if r.verdict == "violation"]
        for r in violations:
            print(f"VIOLATION {r.case.describe()}: {r.detail}  (--replay {r.case.seed})")
        if args.concurrent:
            problems, figures = await concurrent_streams(suite, args.concurrent, args.seed)
            print(figures)
            for problem in problems:
                print(f"VIOLATION concurrent: {problem}")
            return int(bool(violations or problems))
        return int(bool(violations))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=200, help="random cases to run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first case")
    parser.add_argument("--replay", type=int, default=None, help="run the case of this seed")
    parser.add_argument(
        "--concurrent", type=int, default=256, help="streams at once for the memory case (0: skip)"
    )
    sys.exit(anyio.run(main_async, parser.parse_args()))


if __name__ == "__main__":
    main()
