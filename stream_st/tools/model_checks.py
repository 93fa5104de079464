"""The checks of a checkpoint's structure that need no tensor's values: layers lacking a part or
missing between others, floating-point tensors in several dtypes, and a Llama-family model's
``config.json`` (:class:`ModelConfig`): the shapes, layers, parameter count and dtype it implies.
:func:`stream_st.tools.validate.validate` runs them on a file's header; the names are
importable from :mod:`stream_st.tools.validate` too.

Every check costs what the file's own tensors do, however large the numbers it is given: a
config's counts (up to :data:`LARGEST`) are looked up and counted, not listed name by name, and
layers missing between two far apart (``layers.0``, ``layers.1000000000000``) are told by the
ends of their runs.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypeVar

from ..core.header import TensorInfo
from ..core.strict_json import decode_json
from ..errors import (
    NAMES_SHOWN,
    ArgumentTypeError,
    SafetensorsError,
    UsageError,
    boolean,
    redact,
    some_names,
)
from .common import plural

if TYPE_CHECKING:
    from ..models.llm.model import LlamaConfig

__all__ = [
    "ModelConfig",
    "check_layer_sequence",
    "check_layers",
    "validate_dtype_consistency",
]

_T = TypeVar("_T")

_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.([0-9]{1,4000})\.")
"""A layer's tensor: ``...layers.N.`` (N in ASCII digits, fewer than Python reads as an int)."""


def check_layers(names: Iterable[str], required: Sequence[str]) -> list[str]:
    """For every layer found in ``names`` (``...layers.N....``), per stack (an encoder's and a
    decoder's layers apart, as :func:`check_layer_sequence` tells them), the ``required`` name
    parts (e.g. ``q_proj``) that no tensor of that layer contains; a layer is named by its
    number where the file has one stack, by its whole prefix (``model.decoder.layers.1``)
    where it has several."""
    layers: dict[tuple[str, int], list[str]] = {}
    for name in names:
        match = _LAYER.search(name)
        if match:
            layers.setdefault((name[: match.start(1)], int(match.group(1))), []).append(name)
    several = len({stack for stack, _ in layers}) > 1
    problems = []
    for stack, layer in sorted(layers):
        missing = [part for part in required if not any(part in n for n in layers[stack, layer])]
        if missing:
            named = f"{stack}{layer}" if several else str(layer)
            problems.append(f"layer {named} has no tensor for {', '.join(missing)}")
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


def _runs(numbers: Iterable[int]) -> list[tuple[int, int]]:
    """The runs of consecutive ``numbers``, first and last: ``(0, 3), (7, 7)`` for 0-3 and 7."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and runs[-1][1] == n - 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return [(a, b) for a, b in runs]


def _text(runs: Iterable[tuple[int, int]]) -> str:
    """``0-3, 7, 9-10`` for the runs ``(0, 3), (7, 7), (9, 10)``."""
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _spans(numbers: Iterable[int]) -> str:
    """``0-3, 7, 9-10`` for 0, 1, 2, 3, 7, 9, 10."""
    return _text(_runs(numbers))


def _holes(runs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The runs of numbers between ``runs`` (in order): taken from their ends, however many
    numbers they are."""
    return [(a[1] + 1, b[0] - 1) for a, b in itertools.pairwise(runs)]


def check_layer_sequence(names: Iterable[str]) -> list[str]:
    """Whole layers missing between layers present, per stack: a file with tensors of
    ``model.layers.0``, ``1`` and ``3`` lacks layer 2. Layers before the first or after the last
    present are not looked for (a shard, a pipeline stage holds a run of layers)."""
    problems = []
    for stack, present in sorted(_layer_stacks(names).items()):
        runs = _runs(present)
        holes = _holes(runs)  # from the runs' ends: a file naming layers 0 and 10**12 is cheap
        if holes:
            many = len(holes) > 1 or holes[0][0] != holes[0][1]
            problems.append(
                f"{stack}N: layer{'s' if many else ''} {_text(holes)} missing "
                f"(layers {_text(runs)} present)"
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
    """``BF16 (289 tensors), F32 (2: ['a', 'b'])``: the most common dtype counted, the others
    named (the first ``shown`` of each, see :func:`~stream_st.errors.some_names`)."""
    ordered = sorted(by_dtype.items(), key=lambda item: (-len(item[1]), item[0]))
    parts = []
    for rank, (dtype, names) in enumerate(ordered):
        if rank == 0 and len(ordered) > 1:
            parts.append(f"{dtype} ({plural(len(names), 'tensor')})")
        else:
            parts.append(f"{dtype} ({len(names)}: {some_names(names, shown)})")
    return ", ".join(parts)


_TORCH_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}


LARGEST = 2**63 - 1
"""The largest number a :class:`ModelConfig` takes (``int64``'s largest): no safetensors file
could hold a model of more."""


def _count(what: str, value: object) -> int:
    """``value`` if it is an int (not a bool) from 1 to :data:`LARGEST`;
    :class:`~stream_st.ArgumentTypeError` for another type, :class:`~stream_st.UsageError` for a
    number out of range, ``what`` named in the message."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{what} must be a positive integer, not {value!r}")
    if not 1 <= value <= LARGEST:
        shown = f"{value!r}" if value < 0 or value.bit_length() <= 128 else "a larger one"
        raise UsageError(f"{what} must be a positive integer up to 2**63 - 1, not {shown}")
    return value


@dataclass(frozen=True)
class ModelConfig:
    """What a Hugging Face ``config.json`` of a Llama-family model (Llama, Mistral, SmolLM, ...)
    says about its weights: the numbers that fix every shape, whether the output head shares the
    embeddings, and the dtype the weights are saved in (a safetensors code, if the config says).

    Shapes and names are those of :class:`stream_st.models.llm.LlamaConfig`; weights named as
    Hugging Face saves ``LlamaForCausalLM`` (``model.embed_tokens.weight``,
    ``model.layers.N.self_attn.q_proj.weight``, ..., ``model.norm.weight``, ``lm_head.weight``).
    Every number is an ``int`` from 1 to :data:`LARGEST` (:class:`~stream_st.ArgumentTypeError`
    for another type, :class:`~stream_st.UsageError` for another number, when made).
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    dtype: str | None = None

    def __post_init__(self) -> None:
        for number in fields(self)[:6]:
            _count(f"ModelConfig.{number.name}", getattr(self, number.name))

    @classmethod
    def from_json(cls, config: Mapping[str, Any], *, source: str = "the config") -> ModelConfig:
        """The configuration a parsed ``config.json`` gives; :class:`~stream_st.UsageError` for
        a missing or malformed number (not an integer from 1 to :data:`LARGEST`), one no Llama
        model has, or a ``tie_word_embeddings`` that is not a JSON boolean (``"false"`` would
        be true). The dtype is ``dtype``'s, or ``torch_dtype``'s where ``dtype`` is missing or
        null: transformers keeps ``dtype`` where both are given."""
        shown = redact(source)  # what messages begin with: an address, masked alone
        if not isinstance(config, Mapping):
            raise UsageError(f"{shown} must be a JSON object")

        def typed(check: Callable[[str, object], _T], key: str, default: object) -> _T:
            value = config.get(key)
            value = default if value is None else value
            try:
                return check(f"{shown}: {key}", value)
            except ArgumentTypeError as exc:  # a wrong type in a file: the file's error
                raise UsageError(str(exc)) from None

        def number(key: str, default: int | None = None) -> int:
            return typed(_count, key, default)

        heads = number("num_attention_heads")
        saved = config.get("dtype")
        if saved is None:
            saved = config.get("torch_dtype")
        found = cls(
            hidden_size=number("hidden_size"),
            num_hidden_layers=number("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=number("num_key_value_heads", heads),
            intermediate_size=number("intermediate_size"),
            vocab_size=number("vocab_size"),
            tie_word_embeddings=typed(boolean, "tie_word_embeddings", False),
            dtype=_TORCH_DTYPES.get(str(saved)),
        )
        head_dim = config.get("head_dim")
        if head_dim is not None and head_dim != found.hidden_size // heads:
            raise UsageError(
                f"{shown}: head_dim {head_dim} is not hidden_size / num_attention_heads "
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
                bos_token_id=0,  # no part of names and shapes: any id of the vocabulary
                eos_token_id=0,
            )
        except ModelError as exc:  # the heads
            raise UsageError(str(exc)) from None

    def tensor_count(self) -> int:
        """How many weights the model has: the embeddings, nine a layer, the final norm and,
        unless tied, the head."""
        head = 0 if self.tie_word_embeddings else 1
        return 2 + len(_layer_parts()) * self.num_hidden_layers + head

    def names(self) -> Iterator[str]:
        """Every weight's name, in the model's order, one at a time (as many as
        :meth:`tensor_count`: take what is needed)."""
        from ..models.llm.model import LM_HEAD

        yield from self.llama().each_name()
        if not self.tie_word_embeddings:
            yield LM_HEAD

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight the model has and its shape (``lm_head.weight`` unless tied): a dict of
        :meth:`tensor_count` entries, which :meth:`check` does not build (it looks up the
        file's own names)."""
        llama = self.llama()
        return {name: llama.shape(name) for name in self.names()}

    def parameter_count(self) -> int:
        """Values in all the model's weights (the tied head counted once), from the shapes of
        one layer's weights: no name is made for every layer."""
        from ..models.llm.model import EMBEDDINGS, FINAL_NORM

        llama = self.llama()
        layer = sum(math.prod(llama.shape(name)) for name in llama.layer_names(0))
        ends = math.prod(llama.shape(EMBEDDINGS)) + math.prod(llama.shape(FINAL_NORM))
        head = 0 if self.tie_word_embeddings else math.prod(llama.shape(EMBEDDINGS))
        return ends + head + layer * self.num_hidden_layers

    def _position(self, name: str) -> int | None:
        """Where weight ``name`` comes in :meth:`names`, None for a name the model has not."""
        from ..models.llm.model import EMBEDDINGS, FINAL_NORM, LM_HEAD

        total = self.num_hidden_layers
        if name == EMBEDDINGS:
            return 0
        if name == FINAL_NORM:
            return 1 + len(_layer_parts()) * total
        if name == LM_HEAD:
            return None if self.tie_word_embeddings else 2 + len(_layer_parts()) * total
        match = _LAYER_WEIGHT.fullmatch(name)
        if match is None:
            return None
        layer, part = int(match[1]), _layer_parts().get(match[2])
        if part is None or layer >= total:
            return None
        return 1 + len(_layer_parts()) * layer + part

    def check(self, infos: Mapping[str, TensorInfo]) -> tuple[list[str], list[str]]:
        """Errors and warnings for a file's tensors (``{name: info}``) against this config.
        The work is that of the file's tensors, however many the config's numbers imply: each
        name of the file is looked up, and what the config expects beyond them (missing layers,
        the parameter count) is counted, not listed."""
        from ..models.llm.model import LM_HEAD

        errors: list[str] = []
        warnings: list[str] = []
        llama = self.llama()
        positions = {name: self._position(name) for name in infos}
        expected = sorted((p, name) for name, p in positions.items() if p is not None)
        if not expected:  # not this model: nothing else to say
            return [_nothing_matches(self, infos)], []
        for _, name in expected:
            shape = llama.shape(name)
            if tuple(infos[name].shape) != shape:
                errors.append(
                    f"{name}: shape {list(infos[name].shape)}, the config gives {list(shape)}"
                )
        layers = _layer_stacks(n for n in infos if n.startswith("model.layers.")).get(
            "model.layers.", set()
        )
        total = self.num_hidden_layers
        beyond = sorted(n for n in layers if n >= total)
        if beyond:
            errors.append(f"layers {_spans(beyond)} beyond the config's {total} layers")
        for layer in sorted(n for n in layers if n < total):
            lacking = [
                part
                for part, name in zip(_layer_parts(), llama.layer_names(layer), strict=True)
                if name not in infos
            ]
            if lacking:
                errors.append(f"layer {layer} has no tensor for {', '.join(lacking)}")
        absent = _absent(layers, total)
        if absent:
            warnings.append(
                f"expected layers missing: {_text(absent)} of the config's {total} "
                f"(layers {_spans(layers) if layers else 'none'} present)"
            )
        outside = [n for n in self._ends() if n not in infos and self._position(n) is not None]
        if outside:
            warnings.append(f"expected tensors missing: {some_names(outside)}")
        if self.tie_word_embeddings and LM_HEAD in infos:
            warnings.append(f"{LM_HEAD} present, though the config ties it to the embeddings")
        unknown = [
            n for n, p in positions.items() if p is None and n != LM_HEAD and not _beyond(n, total)
        ]
        if unknown:
            warnings.append(
                f"{plural(len(unknown), 'tensor')} the config does not describe: "
                f"{some_names(unknown)}"
            )
        count = sum(info.nelements for info in infos.values())
        want = self.parameter_count()
        if count != want:
            warnings.append(
                f"parameter count {count:,} differs from the config's {want:,} "
                f"({(count - want) / want:+.1%})"
            )
        if self.dtype is not None:
            warnings.extend(validate_dtype_consistency(infos.values(), self.dtype))
        return errors, warnings

    def _ends(self) -> list[str]:
        """The weights outside the layers, in the model's order (the head even if tied)."""
        from ..models.llm.model import EMBEDDINGS, FINAL_NORM, LM_HEAD

        return [EMBEDDINGS, FINAL_NORM, LM_HEAD]


@functools.cache
def _layer_parts() -> dict[str, int]:
    """Each part of a layer (``self_attn.q_proj``) and its place among the layer's weights."""
    from ..models.llm.model import LAYER_PARTS

    return {part: index for index, part in enumerate(LAYER_PARTS)}


_LAYER_WEIGHT = re.compile(r"model\.layers\.(0|[1-9][0-9]{0,3999})\.(.+)\.weight")
"""A layer's weight as the model names it (the layer's number as written, in ASCII digits)."""


def _absent(layers: set[int], total: int) -> list[tuple[int, int]]:
    """The runs of the config's ``total`` layers missing before the first of ``layers`` or
    after the last (all of them without any): from the ends, however many."""
    if not layers:
        return [(0, total - 1)]
    first, last = min(layers), max(layers)
    runs = [(0, min(first, total) - 1), (last + 1, total - 1)]
    return [(a, b) for a, b in runs if a <= b]


def _beyond(name: str, total: int) -> bool:
    """Whether ``name`` is in a layer at or past ``total`` (reported as an error already)."""
    match = _LAYER.search(name)
    return match is not None and name.startswith("model.layers.") and int(match[1]) >= total


def _nothing_matches(config: ModelConfig, infos: Mapping[str, TensorInfo]) -> str:
    """The error for a file none of whose tensors the config names (a config for another model,
    or another naming of the same one): some names of each side (the config's first few, not
    all of them made)."""
    held = f"{plural(len(infos), 'tensor')}: {some_names(list(infos))}" if infos else "no tensor"
    first = list(itertools.islice(config.names(), NAMES_SHOWN))
    return (
        "no tensor of the file is one the config names (a config for another model?): the "
        f"config expects {plural(config.tensor_count(), 'tensor')}, the first "
        f"{some_names(first)}; the file holds {held}"
    )
