"""The decoder's KV cache over :func:`~stream_st.send_kv` / :func:`~stream_st.receive_kv`,
pipelined: the sender sends each layer as the prefill produces it; the receiver runs layer ``l``
of the continuation as soon as layer ``l`` of the cache has arrived and passed its check.

Both sides compute in worker threads (numpy releases the GIL), so the event loop keeps moving
bytes meanwhile. With both ends in one process, run them under :func:`one_blas_thread`: BLAS
threads of one end would otherwise spin on the cores the other end computes on.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Unpack

import anyio
import numpy as np

from ...connection import Connection
from ...errors import UsageError
from ...kv import KVLayout, KVReceiver, SendReport, send_kv
from ...transports.options import LimitOptions
from ...transports.registry import SinkLike
from .model import Llama

__all__ = ["continue_received", "one_blas_thread", "send_prefill"]

Array = np.ndarray[Any, Any]


async def send_prefill(
    dst: Connection | SinkLike,
    model: Llama,
    tokens: Sequence[int] | Array,
    layout: KVLayout,
    **limits: Unpack[LimitOptions],
) -> SendReport:
    """Prefill ``tokens`` and send each layer's keys and values through ``layout`` (its dtype
    and codec) as soon as the layer is done; see :func:`~stream_st.send_kv`. ``layout`` must
    be the model's for ``len(tokens)`` tokens (:meth:`~stream_st.llm.LlamaConfig.kv_layout`):
    :class:`~stream_st.UsageError` before anything is computed or sent otherwise."""
    run = model.forward(tokens)
    check_layout(model, layout, run.tokens.size, "the layout to send")

    async def layers() -> AsyncIterator[tuple[int, Array, Array]]:
        for layer in range(model.config.num_layers):
            key, value = await anyio.to_thread.run_sync(run.step)
            dtype = layout.numpy_dtype
            yield layer, key.astype(dtype, copy=False), value.astype(dtype, copy=False)

    return await send_kv(dst, layout, layers(), **limits)


async def continue_received(
    incoming: KVReceiver,
    model: Llama,
    tokens: Sequence[int] | Array,
    *,
    done_at: list[float] | None = None,
    each_layer: Callable[[int, Array, Array], None] | None = None,
) -> Array:
    """Run ``tokens`` on top of the cache ``incoming`` delivers, layer ``l`` as soon as layer
    ``l`` is verified; returns their logits ``[len(tokens), vocab]``. ``done_at`` gets the
    ``time.perf_counter()`` at which each layer finished; ``each_layer`` is then called with
    the layer's number, keys and values (to check what arrived, say).

    The transfer's layout (its header) must be a cache of this model: as many layers, keys and
    values ``[1, num_kv_heads, seq, head_dim]``. :class:`~stream_st.UsageError` before anything
    runs otherwise (a cache of another model scored as this one's gives numbers, all wrong).
    Only the layout is compared: another model's cache of the same layout (as many layers, keys
    of the same shape) is taken, and gives wrong logits."""
    check_layout(model, incoming.layout, incoming.layout.shape[2], "the incoming transfer")
    run = model.forward(tokens, incoming.layout.shape[2])
    for layer in range(model.config.num_layers):
        key, value = await incoming.wait_for_layer(layer)
        await anyio.to_thread.run_sync(run.step, (key, value))
        incoming.release(layer)
        if done_at is not None:
            done_at.append(time.perf_counter())
        if each_layer is not None:
            each_layer(layer, key, value)
    logits: Array = await anyio.to_thread.run_sync(run.logits)
    return logits


def check_layout(model: Llama, layout: KVLayout, seq: int, what: str) -> None:
    """:class:`~stream_st.UsageError` unless ``layout`` carries ``model``'s cache of ``seq``
    tokens: its number of layers, keys and values ``[1, num_kv_heads, seq, head_dim]``."""
    c = model.config
    expected = (1, c.num_kv_heads, seq, c.head_dim)
    if layout.num_layers != c.num_layers or tuple(layout.shape) != expected:
        raise UsageError(
            f"{what} carries {layout.num_layers} layers of keys and values "
            f"{list(layout.shape)}; this model's cache of {seq} tokens is {c.num_layers} layers "
            f"of {list(expected)}"
        )


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """numpy's BLAS limited to one thread per call while the block runs (``threadpoolctl``, in
    the ``llm`` extra; without it, nothing changes). A layer over a few hundred tokens gains
    little from a second BLAS thread, and a sender and a receiver that share the cores each
    keep one busy this way instead of four threads contending for two."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield
