"""A Llama decoder in numpy: prefill layer by layer, scoring and greedy generation from a cache.

The model is the one Hugging Face's ``LlamaForCausalLM`` computes (RMSNorm, rotary position
embeddings in the ``rotate_half`` layout, grouped-query attention, SwiGLU), in float32, with
weights named as Hugging Face saves them (``model.embed_tokens.weight``,
``model.layers.N.self_attn.q_proj.weight``, ..., ``model.norm.weight``; ``lm_head.weight``
optional, the embeddings otherwise, as tied models do).

The unit of work is one layer over a block of tokens (:meth:`Llama.forward`): a :class:`Forward`
takes the tokens' embeddings, then runs layer 0, 1, ... each on top of that layer's cached keys and
values (or none, for a prefill) and returns the layer's keys and values, past and new, as soon as
the layer is done. So a prefill hands out each layer's cache while later layers still compute,
and a receiver can run layer ``l`` of a continuation as soon as layer ``l`` of the cache arrives.
Keys and values are ``[1, num_kv_heads, seq, head_dim]`` float32, keys after the rotation: the
layout of :class:`~stream_st.kv.KVLayout`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..._util import canonical_decimal
from ...core.header import Header
from ...core.strict_json import decode_json
from ...errors import ArgumentTypeError, HeaderError, boolean, integer_at_least, some_names
from ...errors import ModelError as ModelError
from ...kv import KVLayout
from .._checks import (
    check_ids,
    config_number,
    counts,
    epsilon,
    floating,
    integer_ids,
    short_repr,
)
from ..bert import Stage

Array = np.ndarray[Any, Any]
KVCache = list[tuple[Array, Array]]
"""Per layer, keys and values ``[1, num_kv_heads, seq, head_dim]``."""

EMBEDDINGS = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
LAYER_PARTS = (
    "input_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "post_attention_layernorm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
POSITIONS = 2**53
"""The positions a forward pass runs at are below this: its rotary angles, float64, are exact."""
CONFIG_KEY = "llama_config"
"""The ``__metadata__`` key of a checkpoint that holds the :class:`LlamaConfig` as JSON."""


_CONFIG_FIELDS = {
    "vocab_size": int,
    "hidden_size": int,
    "intermediate_size": int,
    "num_layers": int,
    "num_heads": int,
    "num_kv_heads": int,
    "rope_theta": float,
    "rms_norm_eps": float,
    "bos_token_id": int,
    "eos_token_id": int,
}
"""The fields of :class:`LlamaConfig` and what each holds."""


def token_ids(tokens: object, what: str = "tokens") -> Array:
    """``tokens`` as a flat int64 array; :class:`~stream_st.ArgumentTypeError` unless they are
    integers (a sequence or array of them, or one; floats would be truncated, a string is no
    id), :class:`ModelError` for more than one dimension (a batch would run as one sequence,
    its rows attending to the rows before)."""
    ids = integer_ids(tokens, what)
    if ids.ndim > 1:
        raise ModelError(
            f"{what} must be one sequence of ids, not an array of shape {list(ids.shape)}"
        )
    return ids.reshape(-1)


@dataclass(frozen=True)
class LlamaConfig:
    """The numbers of a Llama model the forward pass needs; :class:`ModelError` for numbers
    that make none (the beginning and end of sequence tokens too: ids in ``[0, vocab_size)``).
    numpy's numbers are taken and held as Python's (``int`` and ``float``), as JSON writes them."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    bos_token_id: int = 1
    eos_token_id: int = 2

    def __post_init__(self) -> None:
        sizes = (self.vocab_size, self.hidden_size, self.intermediate_size, self.num_layers)
        if not counts(*sizes, self.num_heads, self.num_kv_heads) or (
            not epsilon(self.rms_norm_eps)
            or not (epsilon(self.rope_theta) and self.rope_theta > 0)  # NaN, inf, 0: NaN logits
        ):
            raise ModelError(f"not a Llama configuration: {self}")
        if (
            self.hidden_size % self.num_heads
            or self.num_heads % self.num_kv_heads
            or self.head_dim % 2
        ):
            raise ModelError(
                f"not a Llama configuration: {self.num_heads} attention heads, "
                f"{self.num_kv_heads} key/value heads, hidden size {self.hidden_size} (the heads "
                "must divide the hidden size into an even head size, the key/value heads the "
                "heads)"
            )
        for name in ("bos_token_id", "eos_token_id"):  # -1 would never end generate
            value = getattr(self, name)
            integer = isinstance(value, int | np.integer) and not isinstance(value, bool)
            if not integer or not 0 <= value < self.vocab_size:
                raise ModelError(
                    f"not a Llama configuration: {name} {value!r} is no id in "
                    f"[0, {self.vocab_size})"
                )
        for name, kind in _CONFIG_FIELDS.items():  # numpy's numbers as Python's (frozen)
            object.__setattr__(self, name, kind(getattr(self, name)))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str]) -> LlamaConfig:
        """The configuration a checkpoint's ``__metadata__`` carries under :data:`CONFIG_KEY`,
        parsed by the header's strict, bounded JSON parser; :class:`ModelError` unless it is an
        object of the configuration's fields, integers where they are integers. Check it against
        the checkpoint's tensors (:meth:`check_header`) before sizing anything by it."""
        try:
            raw = decode_json(metadata[CONFIG_KEY], repr(CONFIG_KEY), strict=True)
        except (KeyError, HeaderError) as exc:
            raise ModelError(
                f"not a Llama checkpoint: bad or missing {CONFIG_KEY!r} ({exc})"
            ) from None
        if not isinstance(raw, dict):
            raise ModelError(f"not a Llama checkpoint: {CONFIG_KEY!r} is not a JSON object")
        values: dict[str, int | float] = {}
        for key, value in raw.items():
            kind = _CONFIG_FIELDS.get(key)
            if kind is None:
                raise ModelError(f"not a Llama checkpoint: {CONFIG_KEY!r} has an unknown {key!r}")
            values[key] = config_number(f"not a Llama checkpoint: {CONFIG_KEY!r}", key, value, kind)
        try:
            return cls(**values)  # type: ignore[arg-type]
        except TypeError as exc:  # a field missing
            raise ModelError(f"not a Llama checkpoint: bad {CONFIG_KEY!r} ({exc})") from None

    def check_header(self, header: Header) -> None:
        """:class:`ModelError` unless ``header`` declares exactly this model's weights, each of
        the shape it needs (``lm_head.weight`` optional). Costs what the header's tensors do,
        however large the numbers of the configuration: nothing is sized by them before."""
        self.check_count(len(header.tensors))
        for info in header.tensors:
            if info.shape != self.shape(info.name):
                raise ModelError(
                    f"{info.name} has shape {list(info.shape)} in the checkpoint, the "
                    f"configuration needs {list(self.shape(info.name))}"
                )
        missing = [name for name in self.names() if name not in header]
        if missing:
            raise ModelError(f"the checkpoint lacks {len(missing)} weights: {some_names(missing)}")

    def check_count(self, tensors: int) -> None:
        """:class:`ModelError` unless ``tensors``, the number a file holds, are enough for this
        configuration's weights: checked before anything is sized by ``num_layers`` (a
        damaged or hostile file can declare a billion layers and hold one)."""
        if 9 * self.num_layers + 2 > tensors:
            raise ModelError(
                f"the configuration has {self.num_layers} layers, the file holds {tensors} tensors"
            )

    def layer_names(self, layer: int) -> list[str]:
        return [f"model.layers.{layer}.{part}.weight" for part in LAYER_PARTS]

    def names(self) -> list[str]:
        """Every weight in the order the forward pass uses them (a checkpoint's plan order)."""
        return list(self.each_name())

    def each_name(self) -> Iterator[str]:
        """:meth:`names` one at a time (take what is needed of a config's many)."""
        yield EMBEDDINGS
        for layer in range(self.num_layers):
            yield from self.layer_names(layer)
        yield FINAL_NORM

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of weight ``name``; :class:`ModelError` for a name the model has not."""
        hidden, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        if name in (EMBEDDINGS, LM_HEAD):
            return (self.vocab_size, hidden)
        shapes = {
            "input_layernorm": (hidden,),
            "post_attention_layernorm": (hidden,),
            "self_attn.q_proj": (hidden, hidden),
            "self_attn.k_proj": (kv, hidden),
            "self_attn.v_proj": (kv, hidden),
            "self_attn.o_proj": (hidden, hidden),
            "mlp.gate_proj": (self.intermediate_size, hidden),
            "mlp.up_proj": (self.intermediate_size, hidden),
            "mlp.down_proj": (hidden, self.intermediate_size),
        }
        if name == FINAL_NORM:
            return (hidden,)
        prefix, _, part = name.removesuffix(".weight").partition(".layers.")
        layer, _, part = part.partition(".")
        number = canonical_decimal(layer) if prefix == "model" else None
        in_range = number is not None and number < self.num_layers
        if in_range and part in shapes and name in self.layer_names(int(layer)):  # ".weight" too
            return shapes[part]
        raise ModelError(f"{name!r} is not a weight of this Llama model")

    def kv_layout(
        self, seq: int, dtype: str = "F32", codec: str = "none", group_size: int = 64
    ) -> KVLayout:
        """The :class:`~stream_st.kv.KVLayout` of this model's cache of ``seq`` tokens."""
        shape = (1, self.num_kv_heads, seq, self.head_dim)
        return KVLayout(self.num_layers, shape, dtype, codec, group_size)


def floats(what: str, array: object) -> Array:
    """``array`` as a numpy array of floating point numbers, as given (not converted: float16,
    bfloat16 and float32 alike); :class:`ModelError` for anything else (integers, complex
    numbers, strings: float32 would truncate, drop the imaginary part or fail), ``what``
    naming it."""
    try:
        out = np.asarray(array)
    except (TypeError, ValueError) as exc:  # ragged
        raise ModelError(f"{what} is not an array of numbers: {exc}") from None
    if not floating(out.dtype):
        raise ModelError(f"{what} holds {out.dtype}, the model needs floating point")
    return out


def _past(layer: int, past: Sequence[object], shape: tuple[int, ...]) -> tuple[Array, Array]:
    """Keys and values of ``past``, layer ``layer`` of a cache, as given; :class:`ModelError`
    unless it is a pair of floating point numbers of ``shape``."""
    if not isinstance(past, list | tuple) or len(past) != 2:
        raise ModelError(f"layer {layer} of the cache is not a (keys, values) pair")
    key = floats(f"layer {layer}'s keys in the cache", past[0])
    value = floats(f"layer {layer}'s values in the cache", past[1])
    if key.shape != shape or value.shape != shape:
        raise ModelError(
            f"layer {layer}: the cache holds keys {list(key.shape)} and values "
            f"{list(value.shape)}, {list(shape)} expected"
        )
    return key, value


def _rms_norm(x: Array, weight: Array, eps: float) -> Array:
    variance = np.mean(x * x, axis=-1, keepdims=True)
    normed: Array = weight * (x / np.sqrt(variance + np.float32(eps)))
    return normed


def _rotate(x: Array, cos: Array, sin: Array) -> Array:
    """Rotary embedding, ``rotate_half`` layout: x * cos + [-x2, x1] * sin."""
    half = x.shape[-1] // 2
    rotated = np.concatenate((-x[..., half:], x[..., :half]), axis=-1)
    out: Array = x * cos + rotated * sin
    return out


class Llama:
    """The decoder: ``config`` and float32 ``weights`` by Hugging Face name (see the module
    docstring). ``partial=True`` accepts weights still missing (they are checked as added)."""

    def __init__(
        self, config: LlamaConfig, weights: Mapping[str, Array], *, partial: bool = False
    ) -> None:
        self.config = config
        self.weights: dict[str, Array] = {}
        for name, array in weights.items():
            self.add(name, array)
        if not partial and (missing := self.missing()):
            raise ModelError(f"the weights lack {len(missing)} tensors: {some_names(missing)}")
        self._inv_freq: Array | None = None  # made at the first rotation: sized by head_dim

    def add(self, name: str, array: Array) -> None:
        """Take one weight (as float32); :class:`ModelError` if the model has no such weight,
        it has another shape or its numbers are not floating point."""
        shape = self.config.shape(name)
        given = floats(name, array)
        if given.shape != shape:
            raise ModelError(f"{name} has shape {list(given.shape)}, the model needs {list(shape)}")
        self.weights[name] = given.astype(np.float32, copy=False)

    def missing(self, names: Sequence[str] | None = None) -> list[str]:
        """The weights (of ``names``, default all) not there yet."""
        return [n for n in (names or self.config.names()) if n not in self.weights]

    def weights_for(self, stage: str, names: Sequence[str]) -> list[Array]:
        """The weights ``names`` that ``stage`` of the forward pass runs on; :class:`ModelError`
        naming those not there (a model made with ``partial=True``)."""
        if missing := self.missing(names):
            raise ModelError(f"the model lacks weights for {stage}: {some_names(missing)}")
        return [self.weights[name] for name in names]

    def forward(self, tokens: Sequence[int] | Array, start: int = 0) -> Forward:
        """The forward pass of ``tokens`` at positions ``start``, ``start + 1``, ...; run its
        layers with :meth:`Forward.step`, on top of the keys and values of the positions before
        or of none (the tokens then attend to each other alone, rotated at their positions).
        :class:`ModelError` unless ``tokens`` are 1 or more ids of the vocabulary at positions
        below 2**53 (where the rotary angles, float64, are exact),
        :class:`~stream_st.ArgumentTypeError` for ids that are not integers."""
        ids = token_ids(tokens)
        start = integer_at_least("start", start, 0)
        if ids.size == 0:
            raise ModelError(f"tokens must be 1 or more ids in [0, {self.config.vocab_size})")
        check_ids(ids, self.config.vocab_size, "tokens")
        if start + ids.size > POSITIONS:
            raise ModelError(
                f"positions must be below 2**53, the {ids.size} tokens run from position {start}"
            )
        return Forward(self, ids, start)

    def prefill(self, tokens: Sequence[int] | Array) -> Iterator[tuple[int, Array, Array]]:
        """Yields ``(layer, key, value)`` as each layer of the prefill of ``tokens`` finishes."""
        run = self.forward(tokens)
        for layer in range(self.config.num_layers):
            key, value = run.step()
            yield layer, key, value

    def cache(self, tokens: Sequence[int] | Array) -> KVCache:
        """The whole cache of ``tokens``."""
        return [(key, value) for _, key, value in self.prefill(tokens)]

    def past_length(self, cache: KVCache | None) -> int:
        """How many positions ``cache`` holds (0 for none, or an empty one). :class:`ModelError`
        unless it holds one ``(keys, values)`` pair per layer of the model, keys and values of
        floating point numbers, every one of shape ``[1, num_kv_heads, seq, head_dim]``."""
        if cache is None:
            return 0
        if not isinstance(cache, list | tuple):
            raise ArgumentTypeError(
                f"a cache is a list of (keys, values) per layer, not {type(cache).__name__}"
            )
        if not cache:
            return 0
        layers = self.config.num_layers
        if len(cache) != layers:
            raise ModelError(f"the cache holds {len(cache)} layers, the model has {layers}")
        if not isinstance(cache[0], list | tuple) or len(cache[0]) != 2:
            raise ModelError("layer 0 of the cache is not a (keys, values) pair")
        shape = floats("layer 0's keys in the cache", cache[0][0]).shape
        c = self.config
        if len(shape) != 4 or (shape[0], shape[1], shape[3]) != (1, c.num_kv_heads, c.head_dim):
            raise ModelError(
                f"the cache holds keys {list(shape)}, [1, {c.num_kv_heads}, seq, {c.head_dim}] "
                "expected"
            )
        for layer, entry in enumerate(cache):
            _past(layer, entry, shape)  # every layer before any runs (generate grows them)
        return int(shape[2])

    def score(self, tokens: Sequence[int] | Array, cache: KVCache | None = None) -> Array:
        """Logits ``[len(tokens), vocab]`` of ``tokens`` run on top of ``cache`` (from the
        prefill of the tokens before them, one pair per layer: see :meth:`past_length`) or
        from position 0."""
        start = self.past_length(cache)
        run = self.forward(tokens, start)
        for layer in range(self.config.num_layers):
            run.step(None if not cache else cache[layer])
        return run.logits()

    def generate(
        self, tokens: Sequence[int] | Array, cache: KVCache | None, max_new_tokens: int
    ) -> list[int]:
        """Greedy generation: run ``tokens`` on top of ``cache`` (the prefill of the tokens
        before them, one pair per layer as :meth:`past_length` checks, or none), then pick the
        likeliest token ``max_new_tokens`` (an integer >= 0) times, stopping after the
        end-of-sequence token. ``tokens``, ``cache`` and the model's weights (one made with
        ``partial=True`` may lack some) are checked whatever the number.

        ``cache``, a list, is extended in place, a layer at a time: each layer's grown keys and
        values replace the layer's before the next layer runs, so the cache is held once, plus
        one layer (the caller's references to the layers replaced keep those alive). Running out
        of memory part way leaves the first layers grown: the cache is then unusable."""
        limit = integer_at_least("max_new_tokens", max_new_tokens, 0)
        if cache is not None and not isinstance(cache, list):
            raise ArgumentTypeError(
                f"generate extends its cache in place: a list, not {type(cache).__name__}"
            )
        run = self.forward(tokens, self.past_length(cache))
        self.weights_for("generate", self.config.names())  # before any layer of the cache grows
        cache = [] if cache is None else cache
        out: list[int] = []
        while len(out) < limit:
            for layer in range(self.config.num_layers):
                if layer < len(cache):
                    cache[layer] = run.step(cache[layer])  # the layer's keys before let go
                else:
                    cache.append(run.step())  # no cache given: the prefill
            out.append(int(np.argmax(run.logits(last_only=True)[-1])))
            if out[-1] == self.config.eos_token_id:
                break
            run = self.forward(out[-1:], self.past_length(cache))
        return out

    def _rope(self, start: int, seq: int) -> tuple[Array, Array]:
        if self._inv_freq is None:
            c = self.config
            half = np.arange(0, c.head_dim, 2, dtype=np.float64) / c.head_dim
            self._inv_freq = 1.0 / c.rope_theta**half
        angles = np.arange(start, start + seq, dtype=np.float64)[:, None] * self._inv_freq
        angles = np.concatenate((angles, angles), axis=-1)
        return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)

    def layer(
        self, layer: int, hidden: Array, start: int, past: tuple[Array, Array] | None
    ) -> tuple[Array, Array, Array]:
        """Layer ``layer`` on ``hidden`` ``[seq, hidden_size]`` at positions from ``start``,
        attending to ``past`` (keys and values of the positions before); returns the new hidden
        states and the layer's keys and values, past and new."""
        c = self.config
        w = self.weights_for(f"layer {layer}", c.layer_names(layer))
        attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down = w
        seq, heads, kv_heads, head_dim = hidden.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
        group = heads // kv_heads
        x = _rms_norm(hidden, attn_norm, c.rms_norm_eps)
        cos, sin = self._rope(start, seq)
        q = _rotate((x @ wq.T).reshape(seq, heads, head_dim).transpose(1, 0, 2), cos, sin)
        k = _rotate((x @ wk.T).reshape(seq, kv_heads, head_dim).transpose(1, 0, 2), cos, sin)
        v = (x @ wv.T).reshape(seq, kv_heads, head_dim).transpose(1, 0, 2)
        if past is not None:
            past_key, past_value = _past(layer, past, (1, kv_heads, start, head_dim))
            k = np.concatenate((past_key[0].astype(np.float32, copy=False), k), axis=1)
            v = np.concatenate((past_value[0].astype(np.float32, copy=False), v), axis=1)
        total = k.shape[1]
        # Query head h reads key/value head h // group: one matmul per key/value head.
        q = q.reshape(kv_heads, group * seq, head_dim)
        scores = (q @ k.transpose(0, 2, 1)) * np.float32(1.0 / math.sqrt(head_dim))
        scores = scores.reshape(kv_heads, group, seq, total)
        future = np.arange(total)[None, :] > (total - seq + np.arange(seq))[:, None]  # past or not
        scores += np.where(future, np.float32(-np.inf), np.float32(0))  # a ufunc: no GIL held
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        context = probs.reshape(kv_heads, group * seq, total) @ v
        context = context.reshape(heads, seq, head_dim).transpose(1, 0, 2).reshape(seq, -1)
        hidden = hidden + context @ wo.T
        x = _rms_norm(hidden, mlp_norm, c.rms_norm_eps)
        gate = x @ w_gate.T
        hidden = hidden + ((gate / (1 + np.exp(-gate))) * (x @ w_up.T)) @ w_down.T
        return hidden, k[None], v[None]


@dataclass
class Forward:
    """One forward pass of ``tokens`` at positions from ``start``, run a layer at a time."""

    model: Llama
    tokens: Array
    start: int
    hidden: Array | None = None
    layers_done: int = 0

    def __repr__(self) -> str:
        """The tokens' and hidden states' sizes and the progress: see
        :func:`~stream_st.models._checks.short_repr`."""
        return short_repr(self)

    def step(self, past: tuple[Array, Array] | None = None) -> tuple[Array, Array]:
        """Run the next layer on top of ``past``, that layer's keys and values of the positions
        before ``start`` (``None`` for a prefill); returns the layer's keys and values."""
        if self.layers_done == self.model.config.num_layers:
            raise ModelError("the forward pass has run every layer already")
        if self.hidden is None:
            self.hidden = self.model.weights_for("the embeddings", [EMBEDDINGS])[0][self.tokens]
        self.hidden, key, value = self.model.layer(self.layers_done, self.hidden, self.start, past)
        self.layers_done += 1
        return key, value

    def logits(self, *, last_only: bool = False) -> Array:
        """Logits ``[seq, vocab]`` (``[1, vocab]`` for the last token alone) after every layer."""
        if self.hidden is None or self.layers_done != self.model.config.num_layers:
            raise ModelError(
                f"the forward pass ran {self.layers_done} of {self.model.config.num_layers} layers"
            )
        head = LM_HEAD if LM_HEAD in self.model.weights else EMBEDDINGS  # tied without
        norm, output = self.model.weights_for("the logits", [FINAL_NORM, head])
        hidden = self.hidden[-1:] if last_only else self.hidden
        out: Array = _rms_norm(hidden, norm, self.model.config.rms_norm_eps) @ output.T
        return out


def perplexity(logits: Array, targets: Sequence[int] | Array) -> float:
    """exp(mean negative log-likelihood) of ``targets`` under ``logits`` ``[n, vocab]``, row ``i``
    predicting ``targets[i]`` (computed in float64). :class:`ModelError` unless there are ``n``
    targets, each an id in ``[0, vocab)`` (-1 is no id: it would score the last one), and the
    logits hold no NaN or +inf, nor a row of -inf alone (no probabilities); -inf masks a token
    (probability 0: a target of -inf gives an infinite perplexity);
    :class:`~stream_st.ArgumentTypeError` for targets or logits that are not numbers (logits
    that are complex numbers, whose imaginary parts would be dropped, voids or records
    included; ml_dtypes' floats are numbers)."""
    try:
        given = np.asarray(logits)
        real = given.dtype.kind in "iu" or floating(given.dtype)  # no void, no record
        wide = given.astype(np.float64) if real else None
    except (TypeError, ValueError) as exc:  # ragged
        raise ArgumentTypeError(f"logits must be an array of numbers: {exc}") from None
    if wide is None:
        raise ArgumentTypeError(f"logits must be an array of real numbers, not {given.dtype}")
    ids = token_ids(targets, "targets")
    if wide.ndim != 2 or wide.shape[0] != ids.size or ids.size == 0:
        raise ModelError(f"{ids.size} targets for logits of shape {list(wide.shape)}")
    check_ids(ids, wide.shape[1], "targets")
    top = wide.max(axis=-1)  # a NaN or +inf shows in its row's maximum, as a row of -inf
    if not np.isfinite(top).all():
        raise ModelError(
            "logits must be numbers with a finite maximum in each row, not NaN or +inf"
        )
    log_norm = top + np.log(np.exp(wide - top[:, None]).sum(axis=-1))
    return float(np.exp(np.mean(log_norm - wide[np.arange(ids.size), ids])))


@dataclass
class StreamingPrefill:
    """Prefill of ``tokens`` run stage by stage as the weights arrive (in a checkpoint's plan
    order: embeddings, layer 0, layer 1, ..., final norm): layer ``l`` runs as soon as its
    weights are in, and each weight is let go once used, except the embeddings (the output head
    of a tied model). Fed as :class:`~stream_st.bert.StreamingBert` is, e.g. by
    :func:`~stream_st.bert.run_streaming`; :meth:`output` gives the last token's logits.

    ``tied`` says whether the checkpoint lacks ``lm_head.weight`` (its output head is the
    embeddings): ``False`` waits for it wherever it comes (after the final norm, in a shard of
    its own); ``True`` runs the logits as soon as the final norm is in, and refuses an
    ``lm_head.weight``; ``None`` (the default) uses ``lm_head.weight`` if it comes, the
    embeddings once the weights have ended without it. Either way the logits are those of
    the loaded model's :meth:`Llama.forward` run to ``logits(last_only=True)``, bit for bit."""

    config: LlamaConfig
    tokens: Sequence[int] | Array
    stages: list[Stage] = field(default_factory=list)
    cache: KVCache = field(default_factory=list)
    tied: bool | None = field(default=None, kw_only=True)

    def __repr__(self) -> str:
        """The configuration, the number of tokens, of stages run and of layers cached: see
        :func:`~stream_st.models._checks.short_repr`."""
        return short_repr(self)

    def __post_init__(self) -> None:
        if self.tied is not None:  # numpy's bool_ as a bool: output() tells False by identity
            self.tied = boolean("tied", self.tied)
        self.model = Llama(self.config, {}, partial=True)
        self._run = self.model.forward(self.tokens)
        self._logits: Array | None = None
        self._head = [] if self.tied else [LM_HEAD]  # what the logits wait for beyond the norm

    def add(self, name: str, array: Array) -> None:
        """Take one weight without running anything."""
        if name == LM_HEAD and self.tied:
            raise ModelError(f"the checkpoint holds {LM_HEAD}, though tied=True said it has none")
        self.model.add(name, array)

    def _needed(self, head: bool = True) -> list[str]:
        """The weights the next stage needs (the logits' without ``lm_head.weight``, with
        ``head`` false)."""
        done = self._run.layers_done
        if done < self.config.num_layers:
            return [EMBEDDINGS, *self.config.layer_names(done)]
        return [EMBEDDINGS, FINAL_NORM, *(self._head if head else [])]

    @property
    def finished(self) -> bool:
        return self._logits is not None

    @property
    def ready(self) -> bool:
        """Whether the next stage has all its weights."""
        return not self.finished and not self.model.missing(self._needed())

    def run_ready(self) -> list[Stage]:
        """Run every stage whose weights have all arrived, in order. Returns the stages run."""
        ran: list[Stage] = []
        while self.ready:
            ready = time.perf_counter()
            layer = self._run.layers_done
            if layer < self.config.num_layers:
                self.cache.append(self._run.step())
                for name in self.config.layer_names(layer):
                    del self.model.weights[name]
                stage = f"layer {layer}"
            else:
                self._logits = self._run.logits(last_only=True)
                stage = "logits"
            ran.append(Stage(stage, ready, time.perf_counter()))
        self.stages.extend(ran)
        return ran

    def output(self) -> Array:
        """Logits ``[1, vocab]`` of the last token: its argmax is the first generated token.
        Called once the weights have ended (as :func:`~stream_st.bert.run_streaming` does):
        with ``tied=None``, a checkpoint that ended without ``lm_head.weight`` is tied, and its
        logits are run here; :class:`ModelError` if a weight never came."""
        last = self._run.layers_done == self.config.num_layers
        needed = [] if self.finished or not last else self._needed(head=False)
        if needed and self.tied is None and not self.model.missing(needed):
            self._head = []  # the weights ended without an output head: the embeddings
            self.run_ready()
        if self._logits is None:
            head = self._head if self.tied is False else []  # None: lm_head may never come
            awaited = self.model.missing([*self.config.names(), *head])
            missing = [n for n in awaited if n not in self._used()]
            raise ModelError(
                f"the weights ended early: {len(missing)} missing, {some_names(missing)}"
            )
        return self._logits

    def _used(self) -> set[str]:
        return {n for layer in range(self._run.layers_done) for n in self.config.layer_names(layer)}
