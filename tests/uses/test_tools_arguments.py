"""The commands' library functions check their arguments before anything is read or written:
a wrong type is an :class:`~stream_st.ArgumentTypeError` naming the argument, where a bare
``TypeError`` came from deep inside (or after the destination was opened)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stream_st
import stream_st.numpy as st_np
from stream_st import tools


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "a.safetensors"
    st_np.save_file({"a": np.zeros(3, np.float32), "b": np.ones(2, np.float32)}, path)
    return path


NOT_CALLABLE: Any = 5

CALLS: dict[str, Callable[[Path, Path], Awaitable[Any]]] = {
    "cp": lambda src, dst: tools.cp(src, dst, progress=NOT_CALLABLE),
    "content_digests": lambda src, dst: tools.content_digests(src, progress=NOT_CALLABLE),
    "hash": lambda src, dst: tools.hash(src, content=True, progress=NOT_CALLABLE),
    "diff": lambda src, dst: tools.diff(src, src, content=True, progress=NOT_CALLABLE),
}


@pytest.mark.parametrize("call", CALLS)
async def test_a_progress_that_is_no_callable_is_refused_first(
    source: Path, tmp_path: Path, call: str
) -> None:
    """cp(progress=5) and content_digests(progress=5) raised "'int' object is not callable"
    at the first tensor, cp's destination opened."""
    dst = tmp_path / "out.safetensors"
    with pytest.raises(stream_st.ArgumentTypeError, match="progress takes a callable"):
        await CALLS[call](source, dst)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]


async def test_content_digests_takes_what_include_takes(source: Path) -> None:
    """include=5 raised "'int' object is not iterable"; one name was taken as its letters."""
    with pytest.raises(stream_st.ArgumentTypeError, match="include= takes"):
        await tools.content_digests(source, include=5)  # type: ignore[arg-type]
    every = await tools.content_digests(source)
    assert await tools.content_digests(source, include="a") == {"a": every["a"]}
    assert await tools.content_digests(source, include=iter(["b"])) == {"b": every["b"]}  # type: ignore[arg-type]
    assert await tools.content_digests(source, include=lambda name: name == "b") == {
        "b": every["b"]
    }


async def test_structural_hash_takes_a_headers_tensors(source: Path) -> None:
    """structural_hash(None) raised "'NoneType' object is not iterable"; names alone raised an
    AttributeError."""
    header = await stream_st.read_header(source)
    assert tools.structural_hash(header.tensors) == tools.structural_hash(iter(header.tensors))
    for wrong, match in ((None, "got NoneType"), (["a"], "got an entry of type str")):
        with pytest.raises(stream_st.ArgumentTypeError, match=f"structural_hash takes.*{match}"):
            tools.structural_hash(wrong)  # type: ignore[arg-type]


async def test_cp_takes_include_as_an_iterator(source: Path, tmp_path: Path) -> None:
    """cp(include=<iterator or generator>) spent it checking it and wrote a file with no
    tensor; read once, it selects as a list does."""
    for i, include in enumerate((iter(["b"]), (name for name in ["b"]))):
        dst = tmp_path / f"out{i}.safetensors"
        await tools.cp(source, dst, include=include)  # type: ignore[arg-type]
        assert list(st_np.load_file(dst)) == ["b"]


async def test_cp_refusals_name_the_keywords(source: Path, tmp_path: Path) -> None:
    """cp(dequantize=True) of a file not quantized said '--dequantize: the source is not
    quantized', and cp(dequantize=True, include="a") of a quantized one '--include leaves out
    'a.scale'': the command's options, not the keywords the caller gave; both are named."""
    q8 = tmp_path / "q8.safetensors"
    await tools.cp(source, q8, quantize="int8")
    dst = tmp_path / "out.safetensors"
    for src, options, named in (
        (source, {"dtype": "f64"}, "dtype= (--dtype) must be one of"),
        (source, {"quantize": "int4"}, "quantize= (--quantize) supports int8"),
        (source, {"dequantize": True}, "dequantize= (--dequantize): the source is not"),
        (q8, {"quantize": "int8"}, "dequantize it first (dequantize=, --dequantize)"),
        (q8, {"dequantize": True, "include": "a"}, "include= (--include) leaves out 'a.scale'"),
    ):
        with pytest.raises(stream_st.UsageError, match=re.escape(named)):
            await tools.cp(src, dst, **options)
        assert not dst.exists()


def test_model_sources_takes_a_path(source: Path, tmp_path: Path) -> None:
    """model_sources(Path(directory)) and model_sources(Path(file)) raised "argument of type
    'PosixPath' is not iterable", where every other tool takes a Path, and model_sources(None) a
    bare TypeError too: a path is taken as its string is; anything else is refused, named."""
    assert tools.model_sources(tmp_path) == tools.model_sources(str(tmp_path)) == [str(source)]
    assert tools.model_sources(source) == tools.model_sources(str(source)) == [str(source)]
    for wrong in (None, b"a.safetensors", 5):
        with pytest.raises(
            stream_st.ArgumentTypeError,
            match=f"model_sources takes a path or URL .*, got {type(wrong).__name__}$",
        ):
            tools.model_sources(wrong)  # type: ignore[arg-type]


def test_a_folder_that_cannot_be_listed_is_a_transport_error(tmp_path: Path) -> None:
    """A local folder whose listing fails (here out of descriptors: EMFILE; EACCES or a damaged
    folder alike) raised a bare OSError, and the command printed a traceback (exit 3); it is a
    TransportError naming the folder, as the command's other I/O failures are (exit 2)."""
    st_np.save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / "m.safetensors"))
    script = f"""
import os, resource, sys
from stream_st import tools
from stream_st.errors import TransportError
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) - 1, hard))
try:
    tools.model_sources({str(tmp_path)!r})
except TransportError as exc:
    print(type(exc).__name__, exc.url == {str(tmp_path)!r}, str(exc).startswith("listing failed"))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["TransportError", "True", "True"]


def test_a_folder_s_held_names_are_no_part_of_its_checkpoint(tmp_path: Path) -> None:
    """A writer killed mid-commit leaves its held files (``.<tag>.partial.<name>``, and what the
    commit set aside) beside the checkpoint: they were counted, so a whole earlier index was
    "several indexes" and a lone file lost to a dead writer's index. They are skipped."""
    st_np.save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / "model.safetensors"))
    held = tmp_path / ".0123abcd.partial.model.safetensors.index.json"
    held.write_text('{"weight_map": {}}')
    (tmp_path / ".0123abcd.partial.aside.model-00001-of-00002.safetensors").write_bytes(b"x")
    assert tools.model_sources(tmp_path) == [str(tmp_path / "model.safetensors")]
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    assert tools.model_sources(tmp_path) == [str(tmp_path / "model.safetensors.index.json")]
