"""stream_st._util.task_group: failures come out as themselves, not as exception groups."""

from __future__ import annotations

import os

import anyio
import pytest

from stream_st import TruncatedStreamError
from stream_st._util import process_running, task_group


async def test_the_first_failure_comes_out_plain_with_its_own_context() -> None:
    async def fails() -> None:
        try:
            raise KeyError("missing")
        except KeyError:
            raise TruncatedStreamError("x", name="x", offset=1, expected=2) from None

    async def handles() -> None:
        try:
            raise OSError("first")
        except OSError:
            raise ValueError("second")  # noqa: B904 - its implicit context is the point

    with pytest.raises(TruncatedStreamError) as info:
        async with task_group() as group:
            group.start_soon(fails)
            await anyio.sleep(5)  # cancelled by the failure
    assert info.value.__suppress_context__ and info.value.__cause__ is None

    with pytest.raises(ValueError, match="second") as raised:
        async with task_group() as group:
            group.start_soon(handles)
    assert isinstance(raised.value.__context__, OSError)  # "during handling of" kept


async def test_a_failure_in_the_body_comes_out_plain() -> None:
    with pytest.raises(LookupError, match="body"):
        async with task_group() as group:
            group.start_soon(anyio.sleep, 5)
            raise LookupError("body")


@pytest.mark.parametrize("pid", [2**40, 2**70, 10**99])
def test_a_pid_past_the_system_s_is_no_running_process(pid: int) -> None:
    """A pid read from a cache's or a group's files past what the system takes (a damaged or
    crafted file): os.kill raised a bare OverflowError."""
    assert process_running(pid) is False
    assert process_running(os.getpid()) is True
