"""Configurations read from files or peers: checked against the tensors before anything is sized
by them, and parsed by the strict bounded parser (deep nesting is a SafetensorsError)."""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stream_st
import stream_st.numpy
from stream_st.kv import KVLayout, receive_kv, send_kv
from stream_st.models.bert import BertConfig
from stream_st.models.llm import LlamaConfig, ModelError, read_checkpoint

DEEP = "[" * 100_000 + "]" * 100_000


def checkpoint(config: Any, tensors: dict[str, list[int]] | None = None) -> bytes:
    """A file whose ``llama_config`` is ``config`` (a dict, or raw text) and whose F32 tensors
    have the given shapes (zeros)."""
    tensors = {"model.norm.weight": [4]} if tensors is None else tensors
    text = config if isinstance(config, str) else json.dumps(config)
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "llama_config": text}}
    offset = 0
    for name, shape in tensors.items():
        size = 4 * int(np.prod(shape))
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + bytes(offset)


HUGE = {
    "vocab_size": 4,
    "hidden_size": 2**31,
    "intermediate_size": 4,
    "num_layers": 1,
    "num_heads": 1,
    "num_kv_heads": 1,
}


async def test_a_huge_config_is_refused_before_any_allocation() -> None:
    data = checkpoint(HUGE)
    assert len(data) < 300
    tracemalloc.start()
    try:
        with pytest.raises(ModelError, match="configuration"):
            await read_checkpoint(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


async def test_a_config_of_a_billion_layers_is_refused_by_the_tensor_count() -> None:
    with pytest.raises(ModelError, match="10000000000 layers"):
        await read_checkpoint(checkpoint({**HUGE, "hidden_size": 4, "num_layers": 10**10}))


async def test_a_config_that_matches_its_tensors_still_reads() -> None:
    config = LlamaConfig(8, 4, 6, 1, 2, 1)
    shapes = {name: list(config.shape(name)) for name in config.names()}
    model = await read_checkpoint(checkpoint(json.loads(config.to_json()), shapes))
    assert model.config == config and not model.missing()


@pytest.mark.parametrize(
    "text",
    [DEEP, '{"hidden_size": 4.0}', '{"hidden_size": true}', '{"a": 1, "a": 2}', "[1]"],
    ids=["deep", "float", "bool", "duplicate", "not an object"],
)
async def test_a_bad_llama_config_is_a_model_error(text: str) -> None:
    with pytest.raises(ModelError, match="llama_config"):
        await read_checkpoint(checkpoint(text))


async def test_deeply_nested_kv_shape_is_a_header_error(tmp_path: Path) -> None:
    path = tmp_path / "kv.safetensors"
    layout = KVLayout(num_layers=1, shape=(1, 2, 4, 8))

    async def produce() -> Any:
        zeros = np.zeros(layout.shape, layout.numpy_dtype)
        yield 0, zeros, zeros

    await send_kv(path, layout, produce())
    header = await stream_st.read_header(path)
    tensors = {
        t.name: {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.start, t.end]}
        for t in header.tensors
    }
    for shape in (DEEP, '{"1": 2}'):
        blob = json.dumps({"__metadata__": {**header.metadata, "kv_shape": shape}, **tensors})
        data = path.read_bytes()[header.data_start :]
        message = struct.pack("<Q", len(blob)) + blob.encode() + data
        with pytest.raises(stream_st.HeaderError, match="kv_shape"):
            async with receive_kv(message):
                pass


def test_deeply_nested_bert_config_is_a_safetensors_error(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(DEEP)
    with pytest.raises(stream_st.SafetensorsError, match="nested"):
        BertConfig.from_json(path)
    path.write_text('{"hidden_size": "x", "num_attention_heads": 1, "num_hidden_layers": 1}')
    with pytest.raises(stream_st.SafetensorsError, match="not a BERT configuration"):
        BertConfig.from_json(path)


async def test_an_index_naming_a_tensor_twice_is_refused(tmp_path: Path) -> None:
    """``{"weight_map": {"a": "one", "a": "two"}}`` is no index: a parser that keeps the last
    key would read ``a`` from the second shard without a word about the first."""
    for shard, value in (("one", 1.0), ("two", 2.0)):
        stream_st.numpy.save_file({"a": np.full(2, value, np.float32)}, tmp_path / f"{shard}.st")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"a": "one.st", "a": "two.st"}}')
    with pytest.raises(stream_st.HeaderError, match="duplicate key 'a'"):
        await stream_st.load(index)
    index.write_text('{"weight_map": {"a": "one.st"}, "metadata": ' + DEEP + "}")
    with pytest.raises(stream_st.HeaderError, match="nested"):
        await stream_st.load(index)
