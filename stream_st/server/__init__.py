"""Serving what a process holds: a safetensors file, a sharded checkpoint or tensors in memory,
presented over HTTP as one safetensors object that any reader loads with ranges.

    stream_st.serve("model.safetensors", port=8000)             # blocks; Ctrl-C stops it
    async with stream_st.serving(state_dict) as server:          # in an event loop
        arrays = await stream_st.load(server.url)

The HTTP side is aiohttp (the ``serve`` extra), imported only when a server starts.
"""

from .app import Server, serve, serving

__all__ = ["Server", "serve", "serving"]
