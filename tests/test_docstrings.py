"""The parameters of the writing and receiving entry points are each explained in their
docstrings, which the API page shows: ``open_dataset_writer``'s ``task_id``, ``receive_kv``'s
``max_ahead``, ``save``'s ``fsync`` and ``open_writer``'s ``metadata`` were named nowhere."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import stream_st


@pytest.mark.parametrize(
    "function",
    [
        stream_st.open_writer,
        stream_st.save,
        stream_st.open_dataset_writer,
        stream_st.receive_kv,
    ],
    ids=lambda function: function.__name__,
)
def test_every_parameter_is_named_in_the_docstring(function: Callable[..., Any]) -> None:
    doc = inspect.getdoc(function) or ""
    unnamed = [
        name
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
        and not re.search(rf"\b{re.escape(name)}\b", doc)
    ]
    assert not unnamed, f"{function.__name__}'s docstring does not name {unnamed}"


@pytest.mark.parametrize("function", [stream_st.open_writer, stream_st.save])
def test_fsync_is_said_to_flush_the_file_and_its_directory(function: Callable[..., Any]) -> None:
    """As the file sink does: the temporary file before the rename, the directory after."""
    doc = " ".join((inspect.getdoc(function) or "").split())
    assert re.search(r"``fsync=True``[^.]*before[^.]*directory", doc), doc


def test_open_writer_says_what_becomes_of_a_digest_record_in_metadata(tmp_path: Path) -> None:
    """It said a digest record copied into ``metadata=`` was dropped and ``checksums`` recorded
    the new file's, where with ``checksums`` such a record is a UsageError."""
    record = {"stream_st.digest": "xxh3-128", "stream_st.digest:x": "0" * 32, "k": "v"}

    async def write(checksums: bool) -> dict[str, str]:
        target = tmp_path / "out.safetensors"
        plan = [stream_st.TensorSpec("x", "F32", (3,))]
        async with stream_st.open_writer(
            target, plan, metadata=record, checksums=checksums
        ) as writer:
            await writer.write("x", np.ones(3, np.float32))
        return dict((await stream_st.read_header(target)).metadata)

    assert anyio.run(write, False) == {"k": "v"}  # left out
    with pytest.raises(stream_st.UsageError, match="is reserved for the digests"):
        anyio.run(write, True)
    doc = " ".join((inspect.getdoc(stream_st.open_writer) or "").split())
    assert "left out without ``checksums``, and is a :class:`~stream_st.UsageError` with it" in doc
