"""One rank of a test's process group: ``python -m tests.distributed._worker PARAMS RANK`` runs
one scenario in a group of its own; ``python -m tests.distributed._worker --serve PORT RANK
WORLD`` joins a group that stays up and runs each scenario whose ``PARAMS`` path comes on its
standard input (answering ``done`` on its standard output): a scenario of fewer ranks runs on a
group of the first ranks (made with ``new_group``), the others sit it out.

``PARAMS`` is a JSON file: ``world``, ``port``, ``timeout`` (seconds, the group's; a pool's group
has 60 unless it is given: the scenario then runs on a group of its own), ``backend`` (``gloo``,
or ``nccl``: rank R on CUDA device R modulo the count; a group of its own only), ``mode``
(``load_file``, ``load_model``, ``stream``), ``src`` (or ``srcs``: one per rank), ``options``
(keywords of ``load_file``, ``load_model`` or ``open_stream``: the same for all, or one mapping
per rank), ``model`` (load_model mode: the name of the model's class in
``test_load``, ``Model`` unless given), ``into`` (stream mode: ``{name: [buffer, count]}``, the
same for all: names of one buffer number are given one float32 tensor of ``count`` zeros as
``into=``), ``broken`` (``{rank: true}``, load_model mode: that rank gives None for the model), and
per rank ``include`` (``"!raise"``: a predicate that raises; ``{"once": names}``: an iterator of
the names), ``slices`` (``{name: [dim, part, parts]}``), ``ambient`` (``[max_tensor_bytes,
max_total_bytes]`` set with ``using_caps``), ``env``; ``reference`` (a safetensors file: each
tensor got is compared bit for bit, on its own device, with that file's, sliced as asked, the names
that differ reported); ``stop`` (``{rank: how}``, stream mode: once it has its first tensor the
rank kills itself with SIGKILL, ``"kill"``, or raises :class:`Stopped` out of its loop,
``"raise"``; ``"leave"``: it raises :class:`Stopped` in the ``async with`` before its loop;
``"close"``: it leaves the ``async with`` before its loop, raising nothing; ``"die"``: it kills
itself there, with SIGKILL; load_file mode, ``"again"``: every rank loads the file, then this one
kills itself before the others load it again; load_model mode, ``"hook"``: it kills itself in its
model's load post-hook, once every tensor has come, before the load's last agreement); ``opens``
(stream mode: the stream is opened from that many tasks at once before its ``async with``; the rank
reports ``opened``, the tensor names of the header each got); ``out`` (a folder). A stream-mode
rank reports ``closed``: whether its stream was closed (its source let go of) once its ``async
with`` was left, with or without an error.
The rank writes what it got to ``out/rank<R>.safetensors`` (and the order to ``out/rank<R>.json``),
or its error to ``out/rank<R>.json``, with the seconds the scenario took it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import anyio


def _slices(raw: dict[str, list[int]] | None) -> dict[str, tuple[int, int, int]] | None:
    if raw is None:
        return None
    return {name: (dim, part, parts) for name, (dim, part, parts) in raw.items()}


class Stopped(Exception):
    """What a rank told to ``stop`` raises once it has its first tensor."""


async def _stream(
    src: str,
    group: Any,
    include: Any,
    slices: Any,
    stop: str | None,
    options: dict[str, Any],
    report: dict[str, Any],
    opens: int = 1,
) -> dict[str, Any]:
    import stream_st

    got: dict[str, Any] = {}
    opened = stream_st.open_stream(
        src, framework="pt", process_group=group, include=include, slices=slices, **options
    )
    try:
        if opens > 1:
            report["opened"] = await _open_at_once(opened, opens)
        async with opened as stream:
            if stop == "leave":
                raise Stopped("left before iterating")
            if stop == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            if stop == "close":
                return got
            await _loop(stream, got, stop)
    finally:
        report["closed"] = opened._closed
    return got


async def _open_at_once(stream: Any, opens: int) -> list[list[str]]:
    """``stream.open()`` called from ``opens`` tasks at once: the names of each one's header."""
    names: list[list[str]] = []

    async def opener() -> None:
        names.append(list((await stream.open()).names()))

    async with anyio.create_task_group() as group:
        for _ in range(opens):
            group.start_soon(opener)
    return names


async def _loop(stream: Any, got: dict[str, Any], stop: str | None) -> None:
    """Iterate ``stream`` into ``got``, stopping as ``stop`` says."""
    with anyio.CancelScope() as scope:
        async for name, tensor in stream:
            got[name] = tensor
            if stop == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if stop == "raise":
                raise Stopped(f"stopped after {name}")
            if stop == "cancel":
                scope.cancel()
    if scope.cancelled_caught:
        raise Stopped("cancelled")


def _raising(name: str) -> bool:
    """An ``include=`` predicate that fails (``include: "!raise"``)."""
    raise LookupError(f"no rule for {name}")


def _unequal(got: dict[str, Any], reference: str, slices: Any) -> list[str]:
    """The names of ``got`` whose bytes differ from ``reference``'s tensor (its slice, where
    ``slices`` asks for one), compared on the tensor's own device."""
    import torch
    from safetensors.torch import load_file

    from tests.distributed.test_load import raw

    every = {device: load_file(reference, device=device) for device in _devices(got)}
    unequal = []
    for name, tensor in got.items():
        expected = every[str(tensor.device)][name]
        if slices and name in slices:
            dim, part, parts = slices[name]
            expected = torch.tensor_split(expected, parts, dim=dim)[part]
        if expected.dtype != tensor.dtype or not torch.equal(raw(expected), raw(tensor)):
            unequal.append(name)
    return unequal


def _devices(got: dict[str, Any]) -> list[str]:
    return sorted({str(tensor.device) for tensor in got.values()})


def init(port: int, rank: int, world: int, timeout: float, backend: str = "gloo") -> None:
    import torch.distributed as dist

    if backend == "nccl":
        import torch

        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
    )


def main() -> None:
    if sys.argv[1] == "--serve":
        serve(*map(int, sys.argv[2:5]))
        return
    params = json.loads(Path(sys.argv[1]).read_text())
    rank = int(sys.argv[2])
    # Ranks start seconds apart on a busy machine: the group they meet in waits long, the one
    # the scenario runs in for its own timeout.
    init(params["port"], rank, params["world"], 60, params.get("backend", "gloo"))
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=params.get("timeout", 30))
    scenario(params, rank, dist.new_group(list(range(params["world"])), timeout=timeout))
    dist.destroy_process_group()


def serve(port: int, rank: int, world: int) -> None:
    import torch.distributed as dist

    init(port, rank, world, 60)
    groups = {size: dist.new_group(list(range(size))) for size in range(2, world)}
    groups[world] = dist.group.WORLD
    for line in sys.stdin:
        params = json.loads(Path(line.strip()).read_text())
        size = params["world"]
        group = groups[size]
        if "timeout" in params:  # a group of the scenario's own, waiting that long
            timeout = datetime.timedelta(seconds=params["timeout"])
            group = dist.new_group(list(range(size)), timeout=timeout)
        if rank < size:
            scenario(params, rank, group)
            if "timeout" in params:
                dist.destroy_process_group(group)
        print("done", flush=True)


def scenario(params: dict[str, Any], rank: int, group: Any) -> None:
    """Run one scenario as ``rank`` of ``group``; write the report."""
    import torch
    import torch.distributed as dist

    import stream_st.torch
    from stream_st import DistributedError
    from stream_st.reader.caps import Caps, using_caps

    saved = dict(os.environ)
    os.environ.update(params.get("env", {}))
    out = Path(params["out"])
    world = params["world"]
    src = params["srcs"][rank] if "srcs" in params else params["src"]
    include = params.get("include", [None] * world)[rank]
    if include == "!raise":
        include = _raising
    elif isinstance(include, dict):  # {"once": names}: an iterator, spent by one look
        include = iter(include["once"])
    slices = _slices(params.get("slices", [None] * world)[rank])
    options = params.get("options", {})
    if isinstance(options, list):
        options = options[rank]
    if "into" in params:  # {name: [buffer, count]}: one tensor per buffer number
        buffers: dict[int, Any] = {}
        into = {n: buffers.setdefault(b, torch.zeros(c)) for n, (b, c) in params["into"].items()}
        options = {**options, "into": into}
    ambient = Caps(*params.get("ambient", [[None, None]] * world)[rank])
    report: dict[str, Any] = {"rank": rank, "stream_st": stream_st.__file__}
    context = contextlib.ExitStack()
    stop = params.get("stop", {}).get(str(rank))
    started = time.monotonic()
    try:
        context.enter_context(using_caps(ambient))
        if params["mode"] == "load_file":
            if "again" in params.get("stop", {}).values():
                stream_st.torch.load_file(src, process_group=group, **options)
                if stop == "again":
                    os.kill(os.getpid(), signal.SIGKILL)
            got = stream_st.torch.load_file(
                src, process_group=group, include=include, slices=slices, **options
            )
        elif params["mode"] == "load_model":
            from tests.distributed import test_load

            model = getattr(test_load, params.get("model", "Model"))()
            if stop == "hook":
                model.register_load_state_dict_post_hook(
                    lambda *_: os.kill(os.getpid(), signal.SIGKILL)
                )
            before = {name: t.data_ptr() for name, t in model.state_dict().items()}
            broken = params.get("broken", {}).get(str(rank))  # not a model: fails before the group
            given: Any = None if broken else model
            missing, unexpected = stream_st.torch.load_model(
                given, src, process_group=group, include=include, **{"strict": False, **options}
            )
            got = {name: t.clone() for name, t in model.state_dict().items()}
            report["in_place"] = sorted(
                name for name, t in model.state_dict().items() if t.data_ptr() == before[name]
            )
            report["missing"] = sorted(missing)
            report["unexpected"] = sorted(unexpected)
        else:
            opens = params.get("opens", 1)
            got = asyncio.run(_stream(src, group, include, slices, stop, options, report, opens))
        report["names"] = list(got)
        report["devices"] = _devices(got)
        if "reference" in params:
            report["unequal"] = _unequal(got, params["reference"], slices)
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in got.items()}, str(out / f"rank{rank}.safetensors"))
    except Exception as exc:
        report["error"] = type(exc).__name__
        report["message"] = str(exc)
        report["distributed"] = isinstance(exc, DistributedError)
        report["safetensors_error"] = isinstance(exc, stream_st.SafetensorsError)
        report["failed_rank"] = getattr(exc, "rank", None)
    finally:
        context.close()
        report["seconds"] = time.monotonic() - started
        os.environ.clear()
        os.environ.update(saved)
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    if "error" not in report:
        dist.barrier(group=group)


if __name__ == "__main__":
    main()
