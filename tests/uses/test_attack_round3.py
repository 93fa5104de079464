"""More defects a demanding user met calling the public API and the command from the outside:
each test failed before its fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
import stream_st.numpy
from stream_st.kv import KVLayout, receive_kv, send_kv

from .._util import run_command
from ..servers.http_server import RangeHTTPServer

Array = np.ndarray[Any, Any]


async def test_kv_layout_shape_given_as_a_list_is_the_same_layout(tmp_path: Path) -> None:
    """A shape given as a list used to be kept as a list: every layer was then refused ("has
    shape [1, 2, 3, 4], the layout says [1, 2, 3, 4]") and the frozen layout was unhashable."""
    layout = KVLayout(num_layers=1, shape=[1, 2, 3, np.int64(4)])  # type: ignore[arg-type]
    assert layout == KVLayout(num_layers=1, shape=(1, 2, 3, 4))
    assert hash(layout) == hash(KVLayout(num_layers=1, shape=(1, 2, 3, 4)))
    key = np.arange(24, dtype=np.float16).reshape(1, 2, 3, 4)
    path = tmp_path / "kv.safetensors"
    await send_kv(path, layout, [(0, key, -key)])
    async with receive_kv(path) as received:
        got_key, got_value = await received.wait_for_layer(0)
    np.testing.assert_array_equal(got_key, key)
    np.testing.assert_array_equal(got_value, -key)


@pytest.mark.parametrize(
    ("num_layers", "shape", "error"),
    [
        (1, (1, 2, -3, 4), stream_st.UsageError),  # was accepted, layer_bytes -64
        (1.5, (1, 2, 3, 4), stream_st.ArgumentTypeError),  # was a bare TypeError at send
        (True, (1, 2, 3, 4), stream_st.ArgumentTypeError),
        (1, (1, 2, 3.0, 4), stream_st.ArgumentTypeError),
    ],
)
def test_kv_layout_refuses_what_is_not_a_layout(
    num_layers: Any, shape: Any, error: type[Exception]
) -> None:
    with pytest.raises(error):
        KVLayout(num_layers=num_layers, shape=shape)


def test_kv_layout_layer_bytes_of_a_huge_shape_does_not_wrap() -> None:
    """``layer_bytes`` multiplied in int64 and wrapped to 32 (the digest alone) for 2**80
    values a tensor."""
    layout = KVLayout(num_layers=1, shape=(2**40, 2**40, 1, 1))
    assert layout.layer_bytes == 2 * 2**80 * 2 + 32


cli = run_command


async def test_cache_prune_or_ls_with_a_pattern_is_refused_not_applied_to_every_copy(
    tmp_path: Path,
) -> None:
    """``cache prune 'http://other/*' --max-size 0`` pruned every copy: the pattern was ignored
    (patterns are rm's); ``cache rm`` of a pattern matching nothing exited 1 without a word."""
    data = reference_numpy.save({"t": np.arange(100, dtype=np.float32)})
    with RangeHTTPServer(objects={"/m.safetensors": data}, etag="strong") as server:
        url = server.url("/m.safetensors")
        await stream_st.load(url, cache=tmp_path)
    listed = cli("cache", "ls", "--dir", str(tmp_path))
    assert url in listed.stdout
    pruned = cli("cache", "prune", "http://other/*", "--max-size", "0", "--dir", str(tmp_path))
    assert pruned.returncode == 2, pruned
    assert "unrecognized arguments" in pruned.stderr
    assert url in cli("cache", "ls", "--dir", str(tmp_path)).stdout  # still there
    assert cli("cache", "ls", "http://other/*", "--dir", str(tmp_path)).returncode == 2
    removed = cli("cache", "rm", "http://nowhere/*", "--dir", str(tmp_path))
    assert removed.returncode == 1
    assert "no copy matches 'http://nowhere/*'" in removed.stderr


@pytest.mark.parametrize("order", ["reference", "plan"])
async def test_an_array_safetensors_cannot_carry_is_named(tmp_path: Path, order: str) -> None:
    """Saving a dict of many arrays, one of them strings, said "numpy dtype <U1 has no
    safetensors equivalent" without saying which one."""
    tensors = {"a": np.zeros(2), "labels": np.array(["x"])}
    with pytest.raises(stream_st.DtypeError, match="tensor 'labels': numpy dtype <U1"):
        await stream_st.save(tmp_path / "m.safetensors", tensors, order=order)  # type: ignore[arg-type]
    with pytest.raises(stream_st.DtypeError, match="tensor 'labels'"):
        stream_st.numpy.save(tensors)
    assert not list(tmp_path.iterdir())


def test_an_empty_destination_path_is_not_called_a_directory(tmp_path: Path) -> None:
    """``save_file(tensors, "")`` (an unset variable, say) said "the destination is a
    directory"."""
    with pytest.raises(stream_st.UsageError, match="empty path"):
        stream_st.numpy.save_file({"a": np.zeros(2)}, "")
    copied = cli("cp", str(write_file(tmp_path)), "")
    assert copied.returncode == 2 and "empty path" in copied.stderr, copied


def write_file(directory: Path) -> Path:
    """A small safetensors file in ``directory``, written by the reference."""
    path = directory / "m.safetensors"
    reference_numpy.save_file({"a": np.arange(4, dtype=np.float32)}, str(path))
    return path


async def test_listen_given_a_url_says_it_takes_a_host() -> None:
    """``listen("tcp://127.0.0.1:0")`` (``connect`` takes a URL) failed as "cannot listen: Name
    or service not known", url=tcp://[tcp://127.0.0.1:0]:0 (the URL taken for an IPv6 host)."""
    with pytest.raises(stream_st.UsageError, match="takes a host and a port"):
        async with stream_st.listen("tcp://127.0.0.1:0"):
            pass


def test_one_of_a_thing_is_not_counted_as_many(tmp_path: Path) -> None:
    """ "copied 1 tensors", "1 tensors, 4 parameters", "F16 (1 tensors)"."""
    path = write_file(tmp_path)
    assert "copied 1 tensor," in cli("cp", str(path), str(tmp_path / "b.safetensors")).stderr
    assert "  1 tensor, 4 parameters" in cli("inspect", str(path)).stdout
    from stream_st.tools.model_checks import validate_dtype_consistency

    assert validate_dtype_consistency({"a": "F16", "b": "F32", "c": "F32"}) == [
        "floating-point tensors in 2 dtypes: F32 (2 tensors), F16 (1: ['a'])"
    ]
    assert validate_dtype_consistency({"a": "F16", "b": "F32"}) == [
        "floating-point tensors in 2 dtypes: F16 (1 tensor), F32 (1: ['b'])"
    ]
