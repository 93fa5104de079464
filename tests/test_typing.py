"""The public type hints (the package ships ``py.typed``) as a user's code meets them: small
programs written as users write them, each checked by ``mypy --strict`` from outside the
repository, against the installed package. A program holds what must type-check and, marked
``# type: ignore[code]``, what must be refused: strict mypy reports an ignore that nothing
needed, so a hint that lets a mistake through (a misspelt name typed ``Any``) fails the program
as surely as a hint that refuses correct code."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PROGRAMS = {
    "framework_pt": """
        from typing import Any, assert_type

        import numpy as np
        import torch

        import stream_st
        from stream_st.sharded import ShardedStream


        async def read(path: str, group: Any) -> None:
            async with stream_st.open_stream(path, framework="pt") as stream:
                assert_type(stream, stream_st.TensorStream[torch.Tensor])
                async for name, tensor in stream:
                    assert_type(tensor, torch.Tensor)
                    tensor.to(torch.float16)
                    tensor.astype(np.float16)  # type: ignore[attr-defined]
            ranks = stream_st.open_stream(path, framework="torch", process_group=group)
            assert_type(ranks, stream_st.TensorStream[torch.Tensor])


        def shards(stream: ShardedStream[torch.Tensor]) -> stream_st.TensorStream[torch.Tensor]:
            return stream  # an index's stream, read with framework="pt"
    """,
    "framework_np": """
        from typing import Any, assert_type

        import numpy as np

        import stream_st


        async def read(path: str) -> None:
            async with stream_st.open_stream(path) as stream:
                async for name, array in stream:
                    assert_type(array, np.ndarray[Any, Any])
                    array.astype(np.float16)
            assert_type(
                stream_st.open_stream(path, framework="np"),
                stream_st.TensorStream[np.ndarray[Any, Any]],
            )


        def bare(stream: stream_st.TensorStream) -> stream_st.TensorStream[np.ndarray[Any, Any]]:
            return stream  # a bare TensorStream hands out numpy arrays
    """,
    "misspelt_names": """
        from typing import assert_type

        import stream_st
        import stream_st.compat
        import stream_st.numpy
        import stream_st.sharded

        stream_st.read_headr  # type: ignore[attr-defined]
        stream_st.TensorStrem  # type: ignore[attr-defined]
        stream_st.compat.safe_opn  # type: ignore[attr-defined]
        stream_st.sharded.ShardedStrem  # type: ignore[attr-defined]
        stream_st.numpy.load_fil  # type: ignore[attr-defined]
        stream_st.kv.send_kvv  # type: ignore[attr-defined]

        # What is imported on first use is still seen, with its type.
        assert_type(stream_st.__version__, str)
        stream_st.kv.send_kv
        stream_st.dtypes.DTYPES
        stream_st.compat.numpy.load_file
        stream_st.compat.deserialize
        stream_st.sharded.ShardIndex
    """,
    "numpy_dropin": """
        from typing import Any, assert_type

        import numpy as np

        import stream_st.numpy
        from stream_st.numpy import TensorSpec, deserialize, serialize, serialize_file

        data = stream_st.numpy.save({"a": np.zeros(3, np.float32)})
        stream_st.numpy.load(bytearray(data))
        stream_st.numpy.load(memoryview(data))
        assert_type(deserialize(data), list[tuple[str, dict[str, Any]]])
        spec = TensorSpec(dtype="F32", shape=[3], data_ptr=0, data_len=12)
        assert_type(serialize({"a": spec}), bytes)
        serialize_file({"a": spec}, "a.safetensors")
    """,
    "cache_paths": """
        import dataclasses
        import os
        from pathlib import Path
        from typing import assert_type

        import stream_st


        class Where(os.PathLike[str]):
            def __fspath__(self) -> str:
                return "cache"


        cache = stream_st.Cache(directory="cache", hub_directory=Path("cache/hub"))
        stream_st.Cache(Where(), Where(), offline=True, max_size=1 << 30)
        assert_type(cache.directory, Path)
        assert_type(dataclasses.replace(cache, offline=True), stream_st.Cache)
        stream_st.Cache(directory=b"cache", hub_directory="hub")  # type: ignore[arg-type]
    """,
    "validate_result": """
        from stream_st import tools


        async def check(path: str) -> None:
            result = await tools.validate(path)
            print(result.ok, len(result.tensors), result.load.summary())
    """,
    "safe_open_class": """
        from typing import Any, assert_type

        import numpy as np
        import torch

        import stream_st.compat
        import stream_st.numpy
        import stream_st.torch
        from stream_st.compat import safe_open


        def open_blob(path: str) -> safe_open:  # a class, as the reference's
            return safe_open(path, framework="pt")


        def either(path: str) -> safe_open | torch.nn.Module:
            with open_blob(path) as handle:
                assert_type(handle.keys(), list[str])
                handle.get_slice("a").get_shape()
                return handle


        assert_type(stream_st.torch.safe_open("a.safetensors", "pt"), safe_open[torch.Tensor])
        assert_type(
            stream_st.numpy.safe_open("a.safetensors", "np"), safe_open[np.ndarray[Any, Any]]
        )
        stream_st.torch.safe_open("a.safetensors", "pt", device=torch.device("cpu"), timeout=5)
        stream_st.compat._safe_open_handle(open("a.safetensors", "rb"), "np").metadata()
        stream_st.torch.safe_open("a.safetensors", "pt", timeot=5)  # type: ignore[call-overload]
        stream_st.torch.safe_open("a.safetensors")  # type: ignore[call-overload]
        np.asarray(safe_open("a.safetensors", "np").get_tensor("a"))
    """,
    "safe_open_tensors": """
        from typing import Any, assert_type

        import numpy as np
        import torch

        import stream_st.numpy
        import stream_st.torch
        from stream_st.compat import safe_open


        def read(path: str, framework: str) -> None:
            with stream_st.torch.safe_open(path, framework="pt") as f:
                assert_type(f.get_tensor("a"), torch.Tensor)
                assert_type(f.get_slice("a")[0:1], torch.Tensor)
                assert_type(f.get_tensors(), dict[str, torch.Tensor])
                assert_type(f.metadata(), dict[str, Any] | None)  # an index's: not only str
                f.get_tensor("a").no_such_method()  # type: ignore[attr-defined]
                text: str = f.get_tensor("a")  # type: ignore[assignment]
                rows: str = f.get_slice("a")[0:1]  # type: ignore[assignment]
            with stream_st.numpy.safe_open(path, framework="np") as g:
                assert_type(g.get_tensor("a"), np.ndarray[Any, Any])
                assert_type(g.get_slice("a")[0], np.ndarray[Any, Any])
                array: str = g.get_tensor("a")  # type: ignore[assignment]
            assert_type(safe_open(path, "torch"), safe_open[torch.Tensor])
            assert_type(safe_open(path, "numpy"), safe_open[np.ndarray[Any, Any]])
            assert_type(safe_open(path, framework), safe_open[Any])  # told when it runs
            assert_type(stream_st.torch.safe_open(path, "np"), safe_open[np.ndarray[Any, Any]])
    """,
    "tool_records": """
        from typing import assert_type

        from stream_st import tools


        async def records(path: str) -> None:
            found = await tools.hash(path, content=True, file=True)
            assert_type(found["structural_hash"], str)
            assert_type(found["tensor_count"], int)
            assert_type(found["content_hash"], str)
            assert_type(found["file_sha256"], str)
            found["content"]  # type: ignore[typeddict-item]
            ident = await tools.weight_inspect(path)
            assert_type(ident["id"], str)
            assert_type(ident["schema"], int)
            assert_type(ident["metadata_count"], int)
            digest: bytes = ident["structural_hash"]  # type: ignore[assignment]
    """,
    "torch_dropin_names": """
        from typing import Any, assert_type

        import torch

        import stream_st.torch
        from stream_st.torch import TensorSpec, deserialize, serialize, serialize_file

        stream_st.torch.load_fil  # type: ignore[attr-defined]
        assert_type(stream_st.torch._TYPES, dict[str, torch.dtype])
        assert_type(stream_st.torch._SIZE, dict[torch.dtype, int])
        assert_type(stream_st.torch._getdtype("F32"), torch.dtype)
        data = stream_st.torch.save({"a": torch.zeros(3)})
        assert_type(deserialize(data), list[tuple[str, dict[str, Any]]])
        spec = TensorSpec(dtype="F32", shape=[3], data_ptr=0, data_len=12)
        assert_type(serialize({"a": spec}), bytes)
        serialize_file({"a": spec}, "a.safetensors")
    """,
    "torch_load_buffers": """
        from typing import assert_type

        import torch

        import stream_st.torch

        data = stream_st.torch.save({"a": torch.zeros(3)})
        assert_type(stream_st.torch.load(bytearray(data)), dict[str, torch.Tensor])
        stream_st.torch.load(memoryview(data))
        stream_st.torch.load("a.safetensors")  # type: ignore[arg-type]
    """,
}
"""Each program, by the name its test goes under."""

NEEDS_TORCH = {
    "framework_pt",
    "safe_open_class",
    "safe_open_tensors",
    "torch_dropin_names",
    "torch_load_buffers",
}
"""The programs that import torch (skipped where it is missing)."""


@pytest.fixture(scope="module")
def mypy_errors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """What ``mypy --strict`` says of each program, run once for all of them (its own cache and
    no configuration: a user's project outside this one)."""
    folder = tmp_path_factory.mktemp("typing")
    files = []
    for name, text in PROGRAMS.items():
        (folder / f"{name}.py").write_text(textwrap.dedent(text), encoding="utf-8")
        files.append(f"{name}.py")
    options = ["--strict", "--config-file=", "--no-error-summary", "--cache-dir", "cache"]
    run = subprocess.run(
        [sys.executable, "-m", "mypy", *options, *files],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode in (0, 1), run.stderr + run.stdout  # 1: errors found, 2: mypy failed
    said: dict[str, list[str]] = {name: [] for name in PROGRAMS}
    for line in run.stdout.splitlines():
        said[Path(line.split(":", 1)[0]).stem].append(line)
    shutil.rmtree(folder / "cache", ignore_errors=True)
    return said


@pytest.mark.parametrize("program", PROGRAMS)
def test_a_users_program_type_checks_strictly(
    program: str, mypy_errors: dict[str, list[str]]
) -> None:
    if program in NEEDS_TORCH:
        pytest.importorskip("torch")
    assert mypy_errors[program] == []
