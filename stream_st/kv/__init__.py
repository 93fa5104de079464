"""Pipelined KV-cache transfer: layer 0 is in use at the receiver while the sender computes on.

A transfer is one plain safetensors message (any reader can open it) laid out as::

    layer_0_key, layer_0_value, layer_0_digest, layer_1_key, ... layer_{L-1}_digest

``layer_{i}_key`` / ``layer_{i}_value`` have shape ``[batch, n_kv_heads, seq, head_dim]`` in F16,
BF16 or F32, or the wire tensors of a codec (``stream_st.codecs``: INT8 adds ``.scale``, INT4 packs
codes in U8 and adds ``.scales``). ``layer_{i}_digest`` is U8 ``[32]``: the SHA-256 of every wire
byte of the layer's key and value tensors in plan order. Its size is fixed, so every offset is
known before any layer exists: the sender writes the header first, then each layer as soon as it
is produced, and fills the digest right after. The receiver checks the digest before it hands the
layer out, so a corrupted layer is never delivered as good.

``__metadata__`` records the codec (``compression``, ``group_size``, ``original_dtype``, ...), and
``kv_layers``, ``kv_shape``, ``kv_dtype``, ``kv_digest`` so a receiver knows the layout from the
header alone.

The receiver also reads seed-style caches other programs write: ``layer_{i}_key`` /
``layer_{i}_value`` (and codec siblings) with no ``kv_*`` metadata, in any order, the layout
inferred from names and shapes and reported unverified (no layer digests). The byte-level
specification, for implementations in other languages, is ``docs/kv-wire-format.md``.
"""

from __future__ import annotations

from ..errors import IntegrityError
from .layout import DIGEST_SIZE, KVLayout
from .receive import KVReceiver, receive_kv
from .send import SendReport, send_kv

__all__ = [
    "DIGEST_SIZE",
    "IntegrityError",
    "KVLayout",
    "KVReceiver",
    "SendReport",
    "receive_kv",
    "send_kv",
]
