"""The demo's limits: ``--deadline`` bounds the whole demo, and the allocation caps, which
bound what a source makes a read allocate, are not offered on a command that reads none."""

from __future__ import annotations

import time
from typing import Any

import pytest

import stream_st
import stream_st.models.llm
from stream_st.cli import demo, main


def test_the_deadline_bounds_the_whole_demo(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``demo --deadline`` was applied to each transfer alone: the work around them (the
    states made, the model loaded, the context recomputed) ran past it, and the demo exited
    with 0."""
    made = demo._weights

    def slow(seq: int, seed: int = 0) -> Any:
        time.sleep(0.5)
        return made(seq, seed)

    monkeypatch.setattr(demo, "_weights", slow)
    argv = ["demo", "-q", "--synthetic", "--layers", "1", "--seq", "8", "--codecs", "none"]
    assert main([*argv, "--deadline", "0.2"]) == 2
    assert capsys.readouterr() == ("", "stream-st: error: the deadline of 0.2 s passed\n")
    assert main([*argv, "--deadline", "30"]) == 0  # the transfers still run under one


async def test_the_model_demo_gives_up_a_load_its_deadline_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Loading the model, in a worker thread, is left to finish alone when the deadline
    passes: the demo ends then, not once the load is done."""
    monkeypatch.setattr(stream_st.models.llm, "load_tokenizer", lambda: time.sleep(3))
    began = time.monotonic()
    with pytest.raises(stream_st.ReadTimeoutError, match=r"^the deadline of 0\.2 s passed$"):
        await demo.run_model_demo(deadline=0.2)
    assert time.monotonic() - began < 2


@pytest.mark.parametrize("cap", ["--max-tensor-bytes", "--max-total-bytes"])
def test_the_demo_offers_no_allocation_caps(cap: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``demo --max-tensor-bytes 1`` was taken and ignored (every tensor it received is
    larger): the demo reads no source, what it receives it sends itself."""
    argv = ["demo", "-q", "--synthetic", "--layers", "1", "--seq", "8", "--codecs", "none"]
    with pytest.raises(SystemExit) as exited:
        main([*argv, cap, "1"])
    assert exited.value.code == 2
    assert f"unrecognized arguments: {cap} 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    shown = capsys.readouterr().out
    assert "--deadline" in shown and cap not in shown


def test_the_demo_help_says_each_transfer_s_default_timeout(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``demo --help`` said its time limits were none by default, where each transfer has a
    30 s ``--timeout`` unless given; another command's help still says none."""
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "--timeout 30 for each transfer by default, others none" in capsys.readouterr().out
    assert demo._whole_run({})[1] == {"timeout": 30}
    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    assert "time limits (seconds; none by default)" in capsys.readouterr().out
