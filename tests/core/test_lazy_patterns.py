"""Regular expressions that only errors or rare inputs need are compiled on first use
(:class:`stream_st._regex.LazyPattern`), not when the drop-ins are imported: compiling them cost
2-3 ms of each fresh process's import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stream_st._regex import LazyPattern
from stream_st.errors import redact

_SPY = """
import json, re, sys
import numpy as np
compiled = []
plain = re._compile
def spy(pattern, flags):
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.endswith((re.__file__, "_regex.py")):
        frame = frame.f_back
    if frame is not None and "stream_st" in frame.f_code.co_filename:
        compiled.append(frame.f_code.co_filename.replace("\\\\", "/").rsplit("stream_st/", 1)[1])
    return plain(pattern, flags)
re._compile = spy
import stream_st.numpy
path = sys.argv[1]
stream_st.numpy.save_file({"a": np.arange(3.0)}, path, metadata={"format": "np"})
stream_st.numpy.load_file(path)
with stream_st.numpy.safe_open(path, "np") as f:
    f.get_tensor("a")
    f.metadata()
parser = stream_st.core.header._COMPILED_PIECE is not None
print(json.dumps({"compiled": sorted(set(compiled)), "parser": parser}))
"""


def test_a_plain_save_and_load_compile_no_error_or_rare_path_pattern(tmp_path: Path) -> None:
    """In a fresh process, importing ``stream_st.numpy`` and saving, loading and opening a file
    with metadata compiles only the JSON scanner's whitespace and short-object patterns: none of
    the errors' secret masks and, where the package was built with its C parser, none of the
    header's patterns for unknown dtypes or long metadata (without it, the Python parse reads
    every header with them)."""
    path = str(tmp_path / "a.safetensors")
    done = subprocess.run(
        [sys.executable, "-c", _SPY, path], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    spied = json.loads(done.stdout.splitlines()[-1])
    compiled = spied["compiled"]
    assert "errors.py" not in compiled, compiled
    assert "core/header.py" not in compiled or not spied["parser"], compiled
    assert "core/strict_json.py" in compiled  # the spy saw the patterns a load needs


def test_a_lazy_pattern_compiles_once_and_masks_as_before() -> None:
    pattern = LazyPattern(r"a+", 0)
    assert pattern.compiled is pattern.compiled
    assert pattern.compiled.fullmatch("aaa")
    assert repr(pattern) == "LazyPattern('a+')"
    masked = redact(
        "https://user:hunter2@host/p?X-Amz-Signature=abc Authorization: Bearer abcdefghij"
    )
    assert "hunter2" not in masked and "abc " not in masked and "abcdefghij" not in masked


def test_an_error_message_is_masked_on_first_use_in_a_fresh_process() -> None:
    """The first error a process raises compiles the masks it needs and still masks."""
    script = (
        "import stream_st\n"
        "try:\n"
        "    raise stream_st.TransportError('failed', url='https://u:hunter2@h/x?token=t0ken')\n"
        "except stream_st.TransportError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "hunter2" not in done.stdout and "t0ken" not in done.stdout
    assert "u:***@h" in done.stdout


@pytest.mark.parametrize("text", ["\\u00e9", '"\\""'])
def test_escaped_text_still_counts_strings(text: str) -> None:
    """The JSON scanner's escape pattern, now compiled on first use, still counts strings."""
    from stream_st.core.strict_json import string_count

    assert string_count(json.dumps({text: "v"})) == 2
