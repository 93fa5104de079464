"""Fuzzing: the header core on any bytes, and whole files against the reference ``safetensors``.

Short runs are part of the test suite (``tests/fuzz/test_fuzz.py``). Long runs (documented in
``docs/architecture.md``)::

    python -m tests.fuzz.fuzz_header --seconds 480   # whole-file mutation fuzzer (fuzz_files.py)
    python -m tests.fuzz.fuzz_header --inputs 1000000 --seed 7 --findings fuzz-findings
    python -m tests.fuzz.fuzz_header --hypothesis --seconds 600   # hypothesis inputs, header core
    python -m tests.fuzz.fuzz_header --atheris -- -max_total_time=600   # coverage-guided

The mutation fuzzer exits 1 if it found anything and writes each reproducer (``.bin``, with a
``.txt`` naming the broken promise and the chunking) to ``--findings``. The header target
:func:`check` also feeds each input through the streaming reader from bytes and from 3-byte
chunks. No exception other than SafetensorsError, no hang, memory bounded (the reader never
allocates more than the input can fill).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import struct
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

import stream_st
from stream_st.core.header import parse_header, parse_header_length

if TYPE_CHECKING:
    from .fuzz_files import Report

MAX_HEADER = 1 << 16


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(data), 3):
        yield data[start : start + 3]


async def _read(data: bytes) -> None:
    for source in (data, _chunks(data)):
        try:
            async for _ in stream_st.open_stream(source, max_header_size=MAX_HEADER):
                pass
        except stream_st.SafetensorsError:
            pass


def check(data: bytes) -> None:
    """Raise if the core or the reader misbehaves on ``data``."""
    with contextlib.suppress(stream_st.SafetensorsError):
        parse_header_length(data[:8], max_header_size=MAX_HEADER)
    try:
        header = parse_header(data)
    except stream_st.SafetensorsError:
        pass
    else:  # accepted: it must be self-consistent
        end = 0
        for info in header:
            assert info.start == end and info.end >= info.start
            end = info.end
    framed = struct.pack("<Q", len(data)) + data
    anyio.run(_read, framed)


def hypothesis_run(seconds: float | None, inputs: int | None, round_size: int = 2000) -> int:
    """Run :func:`check` on hypothesis inputs, ``round_size`` a round, until time or inputs
    run out; the number of inputs checked."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from .test_fuzz import header_like

    count = 0

    def counted(data: bytes) -> None:
        nonlocal count
        count += 1
        check(data)

    # Decorated once: hypothesis refuses settings applied twice to the same function.
    round_of_checks = settings(
        max_examples=round_size,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )(given(st.one_of(st.binary(max_size=512), header_like()))(counted))
    began = time.monotonic()
    while (seconds is None or time.monotonic() - began < seconds) and (
        inputs is None or count < inputs
    ):
        round_of_checks()
    print(f"fuzz_header: {count} inputs in {time.monotonic() - began:.0f} s, no failure")
    return count


def _mutation_run(args: argparse.Namespace) -> int:
    """Run the whole-file differential fuzzer; 1 if it found anything."""
    from .fuzz_files import fuzz

    def progress(report: Report) -> None:
        print(f"... {report.inputs} inputs, {len(report.findings)} kinds of finding", flush=True)

    seconds = args.seconds if args.seconds is not None or args.inputs is not None else 60.0
    report = asyncio.run(
        fuzz(
            seed=args.seed,
            inputs=args.inputs,
            seconds=seconds,
            findings=args.findings,
            progress=progress,
        )
    )
    print(report.summary())
    if report.findings:
        print(f"reproducers written to {args.findings}/")
    return 1 if report.findings else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, help="stop after this long (default 60)")
    parser.add_argument("--inputs", type=int, help="stop after this many inputs")
    parser.add_argument("--seed", type=int, default=0, help="seed of the mutation fuzzer")
    parser.add_argument(
        "--findings", type=Path, default=Path("fuzz-findings"), help="where reproducers go"
    )
    parser.add_argument(
        "--hypothesis", action="store_true", help="hypothesis inputs for the header core"
    )
    parser.add_argument("--atheris", action="store_true", help="use atheris (pip install atheris)")
    args, rest = parser.parse_known_args()
    if args.atheris:
        import atheris

        atheris.Setup([sys.argv[0], *rest[1:]], check)
        atheris.Fuzz()
    elif args.hypothesis:
        hypothesis_run(args.seconds, args.inputs)
    else:
        sys.exit(_mutation_run(args))


if __name__ == "__main__":
    main()
