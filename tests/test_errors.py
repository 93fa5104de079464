"""stream_st's errors cross process boundaries: each pickles and unpickles as itself (its class,
message and attributes), so a pool's worker that raises one hands it to the caller."""

from __future__ import annotations

import multiprocessing
import pickle
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
import stream_st.numpy
from stream_st import errors
from stream_st.compat import _errors as compat_errors
from stream_st.models import _checks as model_checks

SECRET_URL = "https://user:pw@host/m.safetensors?X-Amz-Signature=s3cr3t"


def public_classes() -> list[type[BaseException]]:
    """Every exception class stream_st.errors names, and every error of stream_st's declared
    elsewhere (the drop-ins', the model checks')."""
    named = [getattr(errors, name) for name in errors.__all__]
    found = [kind for kind in named if isinstance(kind, type) and issubclass(kind, BaseException)]
    for module in (compat_errors, model_checks):
        found += [
            kind
            for kind in vars(module).values()
            if isinstance(kind, type)
            and issubclass(kind, stream_st.SafetensorsError)
            and kind.__module__ == module.__name__
        ]
    return found


def example(kind: type[BaseException]) -> BaseException:
    """An error of class ``kind``, made with the arguments its constructor takes."""
    error: BaseException
    if kind is compat_errors.NoSuchFileError:
        error = kind("m.safetensors")
    elif issubclass(kind, errors.HTTPStatusError):
        error = kind(404, "Not Found", url=SECRET_URL, detail="no such key", body=b"<Error/>")
    elif issubclass(kind, errors.TransportError):
        error = kind("connection reset", url=SECRET_URL, position=12)
    elif issubclass(kind, errors.DistributedError):
        error = kind("rank 1 failed", rank=1, cause="HeaderError: bad")
    elif kind is errors.HeaderTooLargeError:
        error = kind(10**9, 10**8, writing=True)
    elif kind is errors.TruncatedStreamError:
        error = kind("tensor 'a'", name="a", offset=10, expected=20, source=SECRET_URL)
    elif kind is errors.WriterError:
        error = kind("unknown tensor", name="a")
    elif kind is errors.IntegrityError:
        error = kind("digest mismatch", name="a", source=SECRET_URL, layer=3)
    elif kind is compat_errors.UnencodableTextError:
        try:
            "\udcff".encode("utf-8")
        except UnicodeEncodeError as cause:
            error = kind("tensor name", cause)
    elif kind is compat_errors.FileClosedError:
        error = kind()
    else:
        error = kind("something went wrong")
    return error


def state(error: BaseException) -> dict[str, Any]:
    """What an error says and holds: its class, message, args and attributes, and the fields a
    built-in base keeps outside its ``__dict__`` (an ``OSError``'s, a ``UnicodeError``'s)."""
    fields = ["errno", "strerror", "filename", "filename2"] if isinstance(error, OSError) else []
    if isinstance(error, UnicodeError):
        fields += ["encoding", "object", "start", "end", "reason"]
    return {
        "class": type(error),
        "str": str(error),
        "args": error.args,
        "attributes": vars(error),
        **{field: getattr(error, field) for field in fields},
    }


@pytest.mark.parametrize("kind", public_classes(), ids=lambda kind: kind.__name__)
def test_every_error_pickles_as_itself(kind: type[BaseException]) -> None:
    """Pickle called the class with ``args`` alone, which those whose constructors take other
    arguments (keyword-only ones, a message's parts) refused as the error was unpickled."""
    error = example(kind)
    error.add_note("a note")
    copy = pickle.loads(pickle.dumps(error))
    assert state(copy) == state(error)
    assert copy.__notes__ == ["a note"]
    assert "s3cr3t" not in str(copy) and "pw" not in str(copy)
    assert state(errors.rebuilt(error)) == state(error)  # the same making, in this process


def test_the_public_classes_are_all_found() -> None:
    names = {kind.__name__ for kind in public_classes()}
    assert {"SafetensorsError", "TruncatedStreamError", "RankLostError"} <= names
    assert {"UnencodableTextError", "NoSuchFileError", "ModelError"} <= names


def read_truncated() -> object:
    """Read a file cut short: raises :class:`~stream_st.TruncatedStreamError`."""
    data = reference_numpy.save({"a": np.zeros(100, np.float32)})[:-10]
    return stream_st.numpy.load(data)


def raise_example(kind: type[BaseException]) -> None:
    raise example(kind)


def test_an_error_raised_in_a_worker_process_reaches_the_caller() -> None:
    """A worker raising an error whose constructor takes other arguments than its ``args``
    broke the pool (BrokenProcessPool: its result could not be unpickled) where the caller
    was to get the error itself."""
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn) as pool:
        with pytest.raises(stream_st.TruncatedStreamError) as caught:
            pool.submit(read_truncated).result(timeout=120)
        assert (caught.value.name, caught.value.expected - caught.value.offset) == ("a", 10)
        for kind in public_classes():
            with pytest.raises(kind) as raised:
                pool.submit(raise_example, kind).result(timeout=120)
            assert state(raised.value) == state(example(kind))
