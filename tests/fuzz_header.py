"""Fuzz target for the header core: any bytes in, a Header or a SafetensorsError out.

Short run: part of the test suite (``tests/test_fuzz.py``). Long run (documented in the README)::

    python -m tests.fuzz_header --seconds 600          # hypothesis, as long as you like
    python -m tests.fuzz_header --atheris -- -max_total_time=600   # coverage-guided, if installed

Each input is also fed through the streaming reader from bytes and from 3-byte chunks, so the
framing is fuzzed with the header. No exception other than SafetensorsError, no hang, memory
bounded (the reader never allocates more than the input can fill).
"""

from __future__ import annotations

import argparse
import contextlib
import struct
import sys
import time
from collections.abc import AsyncIterator

import anyio

import stream_st
from stream_st.header import parse_header, parse_header_length

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


def _hypothesis_run(seconds: float) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from .test_fuzz import header_like

    deadline = time.monotonic() + seconds
    rounds = 0
    while time.monotonic() < deadline:
        given(st.one_of(st.binary(max_size=512), header_like()))(
            settings(
                max_examples=2000,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )(check)
        )()
        rounds += 1
    print(f"fuzz_header: {rounds * 2000} inputs, no failure")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--atheris", action="store_true", help="use atheris (pip install atheris)")
    args, rest = parser.parse_known_args()
    if args.atheris:
        import atheris

        atheris.Setup([sys.argv[0], *rest[1:]], check)
        atheris.Fuzz()
    else:
        _hypothesis_run(args.seconds)


if __name__ == "__main__":
    main()
