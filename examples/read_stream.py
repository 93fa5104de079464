"""Read a safetensors file as a stream: header first, then each tensor as its bytes arrive.

    python examples/read_stream.py model.safetensors [name ...]

Without a path it writes a small demo file to a temporary directory and reads that.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import anyio
import numpy as np

import stream_st


def _demo_file(directory: str) -> Path:
    path = Path(directory) / "demo.safetensors"
    specs = [stream_st.TensorSpec(f"layer_{i}.weight", "F32", (64, 64)) for i in range(4)]
    prefix, header = stream_st.build_header(specs, {"made_by": "examples/read_stream.py"})
    with path.open("wb") as f:
        f.write(prefix)
        for i, _ in enumerate(header):
            f.write(np.full((64, 64), i, dtype="<f4").tobytes())
    return path


async def main(path: str, names: list[str]) -> None:
    async with stream_st.open_stream(path, include=names or None) as stream:
        header = stream.header
        print(f"{path}: {len(header)} tensors, {header.data_size} data bytes")
        print(f"metadata: {header.metadata}")
        async for name, array in stream:
            print(
                f"  {name:<24} {array.dtype!s:<8} {list(array.shape)!s:<14} mean={array.mean():.4g}"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", help="the file to read (default: a small demo file)")
    parser.add_argument("names", nargs="*", help="read only these tensors (default: all)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        target = args.path if args.path is not None else str(_demo_file(tmp))
        try:
            anyio.run(main, target, args.names)
        except stream_st.SafetensorsError as exc:  # one line, exit status 2, as stream-st says it
            print(f"read_stream.py: error: {exc}", file=sys.stderr)
            sys.exit(2)
