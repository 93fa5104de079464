"""The checks of a checkpoint's structure that need no tensor's values: layers lacking a part or
missing between others, floating-point tensors in several dtypes, and a Llama-family model's
``config.json`` (:class:`ModelConfig`): the shapes, layers, parameter count and dtype it implies.
:func:`stream_st.tools.validate.validate` runs them on a file's header; the names are
importable from :mod:`stream_st.tools.validate` too.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.header import TensorInfo
from ..core.strict_json import decode_json
from ..errors import SafetensorsError, UsageError
from .common import plural

if TYPE_CHECKING:
    from ..models.llm.model import LlamaConfig

__all__ = [
    "ModelConfig",
    "check_layer_sequence",
    "check_layers",
    "validate_dtype_consistency",
]

_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)\.")


def check_layers(names: Iterable[str], required: Sequence[str]) -> list[str]:
    """For every layer index found in ``names`` (``...layers.N....``), the ``required`` name
    parts (e.g. ``q_proj``) that no tensor of that layer contains."""
    layers: dict[int, list[str]] = {}
    for name in names:
        match = _LAYER.search(name)
        if match:
            layers.setdefault(int(match.group(1)), []).append(name)
    problems = []
    for layer in sorted(layers):
        missing = [part for part in required if not any(part in n for n in layers[layer])]
        if missing:
            problems.append(f"layer {layer} has no tensor for {', '.join(missing)}")
    if required and not layers:
        problems.append("no layered tensors found (names like 'layers.N.')")
    return problems


def _layer_stacks(names: Iterable[str]) -> dict[str, set[int]]:
    """The layer indices found in ``names``, per stack: the name up to ``layers.`` (so an
    encoder's and a decoder's layers are told apart)."""
    stacks: dict[str, set[int]] = {}
    for name in names:
        match = _LAYER.search(name)
        if match:
            stacks.setdefault(name[: match.start(1)], set()).add(int(match.group(1)))
    return stacks


def _spans(numbers: Iterable[int]) -> str:
    """``0-3, 7, 9-10`` for 0, 1, 2, 3, 7, 9, 10."""
    spans: list[list[int]] = []
    for n in sorted(numbers):
        if spans and spans[-1][1] == n - 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def check_layer_sequence(names: Iterable[str]) -> list[str]:
    """Whole layers missing between layers present, per stack: a file with tensors of
    ``model.layers.0``, ``1`` and ``3`` lacks layer 2. Layers before the first or after the last
    present are not looked for (a shard, a pipeline stage holds a run of layers)."""
    problems = []
    for stack, present in sorted(_layer_stacks(names).items()):
        holes = set(range(min(present), max(present) + 1)) - present
        if holes:
            problems.append(
                f"{stack}N: layer{'s' if len(holes) > 1 else ''} {_spans(holes)} missing "
                f"(layers {_spans(present)} present)"
            )
    return problems


_FLOAT_CODES = frozenset({"F16", "BF16", "F32", "F64"}) | {
    f"F8_{k}" for k in ("E5M2", "E4M3", "E8M0", "E4M3FNUZ", "E5M2FNUZ")
}


def validate_dtype_consistency(
    tensors: Mapping[str, str] | Iterable[TensorInfo], expected: str | None = None
) -> list[str]:
    """Problems with the floating-point dtypes of a model's tensors (``{name: dtype code}`` or
    :class:`~stream_st.TensorInfo` rows): empty when they share one dtype (``expected``, a
    safetensors code such as ``"BF16"``, if given). Integer, boolean and packed tensors
    (quantized codes, masks) are not compared."""
    pairs = (
        tensors.items() if isinstance(tensors, Mapping) else ((t.name, t.dtype) for t in tensors)
    )
    by_dtype: dict[str, list[str]] = {}
    for name, dtype in pairs:
        if dtype in _FLOAT_CODES:
            by_dtype.setdefault(dtype, []).append(name)
    if expected is not None:
        others = {d: names for d, names in by_dtype.items() if d != expected}
        if others:
            return [f"floating-point tensors not in the expected {expected}: {_listing(others)}"]
        return []
    if len(by_dtype) > 1:
        return [f"floating-point tensors in {len(by_dtype)} dtypes: {_listing(by_dtype)}"]
    return []


def _listing(by_dtype: Mapping[str, list[str]], shown: int = 3) -> str:
    """``BF16 (289 tensors), F32 (2: a, b)``: the most common dtype counted, the others named."""
    ordered = sorted(by_dtype.items(), key=lambda item: (-len(item[1]), item[0]))
    parts = []
    for rank, (dtype, names) in enumerate(ordered):
        if rank == 0 and len(ordered) > 1:
            parts.append(f"{dtype} ({plural(len(names), 'tensor')})")
        else:
            parts.append(f"{dtype} ({len(names)}: {_some(names, shown)})")
    return ", ".join(parts)


def _some(names: Sequence[str], shown: int = 3) -> str:
    """The first ``shown`` of ``names`` and how many more: ``a, b, c, ... 18 more``."""
    more = f", ... {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


_TORCH_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}


@dataclass(frozen=True)
class ModelConfig:
    """What a Hugging Face ``config.json`` of a Llama-family model (Llama, Mistral, SmolLM, ...)
    says about its weights: the numbers that fix every shape, whether the output head shares the
    embeddings, and the dtype the weights are saved in (a safetensors code, if the config says).

    Shapes and names are those of :class:`stream_st.models.llm.LlamaConfig`; weights named as
    Hugging Face saves ``LlamaForCausalLM`` (``model.embed_tokens.weight``,
    ``model.layers.N.self_attn.q_proj.weight``, ..., ``model.norm.weight``, ``lm_head.weight``).
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    dtype: str | None = None

    @classmethod
    def from_json(cls, config: Mapping[str, Any], *, source: str = "the config") -> ModelConfig:
        """The configuration a parsed ``config.json`` gives; :class:`~stream_st.UsageError` for
        a missing or malformed number, or one no Llama model has."""
        if not isinstance(config, Mapping):
            raise UsageError(f"{source} must be a JSON object")

        def number(key: str, default: int | None = None) -> int:
            value = config.get(key)
            value = default if value is None else value
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{source}: {key} must be a positive integer, not {value!r}")
            return value

        heads = number("num_attention_heads")
        found = cls(
            hidden_size=number("hidden_size"),
            num_hidden_layers=number("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=number("num_key_value_heads", heads),
            intermediate_size=number("intermediate_size"),
            vocab_size=number("vocab_size"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            dtype=_TORCH_DTYPES.get(str(config.get("torch_dtype", config.get("dtype")))),
        )
        head_dim = config.get("head_dim")
        if head_dim is not None and head_dim != found.hidden_size // heads:
            raise UsageError(
                f"{source}: head_dim {head_dim} is not hidden_size / num_attention_heads "
                f"({found.hidden_size} / {heads}): not supported"
            )
        found.llama()  # the numbers make a model
        return found

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """The configuration in the ``config.json`` file at ``path``."""
        try:
            with open(path, "rb") as f:
                parsed = decode_json(f.read(), f"model config {os.fspath(path)}")
        except (OSError, SafetensorsError) as exc:
            raise UsageError(f"cannot read the model config {os.fspath(path)}: {exc}") from None
        return cls.from_json(parsed, source=os.fspath(path))

    def llama(self) -> LlamaConfig:
        """The :class:`~stream_st.models.llm.LlamaConfig` of these numbers."""
        from ..models.llm.model import LlamaConfig, ModelError

        try:
            return LlamaConfig(
                vocab_size=self.vocab_size,
                hidden_size=self.hidden_size,
                intermediate_size=self.intermediate_size,
                num_layers=self.num_hidden_layers,
                num_heads=self.num_attention_heads,
                num_kv_heads=self.num_key_value_heads,
            )
        except ModelError:
            raise UsageError(
                f"not a Llama configuration: {self.num_attention_heads} attention heads, "
                f"{self.num_key_value_heads} key/value heads, hidden size {self.hidden_size} "
                "(the heads must divide the hidden size into an even head size, the key/value "
                "heads the heads)"
            ) from None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight the model has and its shape (``lm_head.weight`` unless tied)."""
        from ..models.llm.model import LM_HEAD

        llama = self.llama()
        names = llama.names() + ([] if self.tie_word_embeddings else [LM_HEAD])
        return {name: llama.shape(name) for name in names}

    def parameter_count(self) -> int:
        """Values in all the model's weights (the tied head counted once)."""
        return _values_in(self.shapes())

    def check(self, infos: Mapping[str, TensorInfo]) -> tuple[list[str], list[str]]:
        """Errors and warnings for a file's tensors (``{name: info}``) against this config."""
        from ..models.llm.model import LAYER_PARTS, LM_HEAD

        errors: list[str] = []
        warnings: list[str] = []
        llama = self.llama()
        expected = self.shapes()
        for name, shape in expected.items():
            info = infos.get(name)
            if info is not None and tuple(info.shape) != shape:
                errors.append(f"{name}: shape {list(info.shape)}, the config gives {list(shape)}")
        if not any(name in infos for name in expected):  # not this model: nothing else to say
            return [_nothing_matches(expected, infos)], []
        layers = _layer_stacks(n for n in infos if n.startswith("model.layers.")).get(
            "model.layers.", set()
        )
        total = self.num_hidden_layers
        beyond = sorted(n for n in layers if n >= total)
        if beyond:
            errors.append(f"layers {_spans(beyond)} beyond the config's {total} layers")
        for layer in sorted(n for n in layers if n < total):
            names = llama.layer_names(layer)
            lacking = [
                part for part, name in zip(LAYER_PARTS, names, strict=True) if name not in infos
            ]
            if lacking:
                errors.append(f"layer {layer} has no tensor for {', '.join(lacking)}")
        inside = range(min(layers), max(layers) + 1) if layers else range(0)
        absent = [n for n in range(total) if n not in layers and n not in inside]
        if absent:
            warnings.append(
                f"expected layers missing: {_spans(absent)} of the config's {total} "
                f"(layers {_spans(layers) if layers else 'none'} present)"
            )
        outside = [n for n in expected if not n.startswith("model.layers.") and n not in infos]
        if outside:
            warnings.append(f"expected tensors missing: {', '.join(outside)}")
        if self.tie_word_embeddings and LM_HEAD in infos:
            warnings.append(f"{LM_HEAD} present, though the config ties it to the embeddings")
        described = set(expected) | {LM_HEAD}
        unknown = [n for n in infos if n not in described and not _beyond(n, total)]
        if unknown:
            warnings.append(
                f"{plural(len(unknown), 'tensor')} the config does not describe: {_some(unknown)}"
            )
        count = sum(info.nelements for info in infos.values())
        want = _values_in(expected)
        if count != want:
            warnings.append(
                f"parameter count {count:,} differs from the config's {want:,} "
                f"({(count - want) / want:+.1%})"
            )
        if self.dtype is not None:
            warnings.extend(validate_dtype_consistency(infos.values(), self.dtype))
        return errors, warnings


def _values_in(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """How many values tensors of ``shapes`` hold."""
    return sum(math.prod(shape) for shape in shapes.values())


def _beyond(name: str, total: int) -> bool:
    """Whether ``name`` is in a layer at or past ``total`` (reported as an error already)."""
    match = _LAYER.search(name)
    return match is not None and name.startswith("model.layers.") and int(match[1]) >= total


def _nothing_matches(expected: Mapping[str, object], infos: Mapping[str, TensorInfo]) -> str:
    """The error for a file none of whose tensors the config names (a config for another model,
    or another naming of the same one): some names of each side."""
    held = f"{plural(len(infos), 'tensor')}: {_some(list(infos))}" if infos else "no tensor"
    return (
        "no tensor of the file is one the config names (a config for another model?): the "
        f"config expects {plural(len(expected), 'tensor')}: {_some(list(expected))}; "
        f"the file holds {held}"
    )
