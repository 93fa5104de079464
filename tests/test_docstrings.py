"""The parameters of the writing and receiving entry points are each explained in their
docstrings, which the API page shows: ``open_dataset_writer``'s ``task_id``, ``receive_kv``'s
``max_ahead``, ``save``'s ``fsync`` and ``open_writer``'s ``metadata`` were named nowhere."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

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
