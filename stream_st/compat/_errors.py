"""The exceptions the drop-in raises where the reference raises a built-in type.

``SafetensorError`` (the reference's one exception class) is :class:`~stream_st.SafetensorsError`
itself, so ``except SafetensorError`` catches every error stream_st raises. Where the reference
raises ``ValueError``, ``TypeError``, ``IndexError``, ``KeyError``, ``AttributeError``,
``UnicodeEncodeError`` or ``FileNotFoundError``, the drop-in raises a class deriving from both
that type and :class:`~stream_st.SafetensorsError`: code written for either library catches it.
"""

from __future__ import annotations

from ..errors import (
    DeviceError,
    DtypeError,
    HeaderError,
    SafetensorsError,
    SourceNotFoundError,
    UsageError,
)

__all__ = [
    "DeviceError",
    "FileClosedError",
    "InvalidTensorsError",
    "MetaTensorError",
    "NoSuchFileError",
    "NotAModuleError",
    "SafetensorError",
    "SliceError",
    "SliceOverflowError",
    "SliceTypeError",
    "SliceValueError",
    "TorchDtypeError",
    "UnencodableTextError",
    "UnsignedOverflowError",
    "WrongTypeError",
]

SafetensorError = SafetensorsError
"""The reference's exception class: here the root of every stream_st error."""


class InvalidTensorsError(UsageError, ValueError):
    """What was given to save is not a dict of dense, contiguous tensors: the reference's
    ``ValueError`` (and stream_st's :class:`~stream_st.UsageError`, as before)."""


class UnsignedOverflowError(SafetensorsError, OverflowError):
    """A dimension, ``data_ptr`` or ``data_len`` given to :class:`~stream_st.compat.TensorSpec`
    that is negative or past 64 bits (the reference's ``OverflowError``: it takes them as
    unsigned 64-bit integers)."""


class WrongTypeError(SafetensorsError, TypeError):
    """An argument of the wrong type: metadata that is not ``str`` to ``str``, a ``serialize``
    entry that is not a :class:`~stream_st.compat.TensorSpec` (the reference's ``TypeError``)."""


class TorchDtypeError(DtypeError, KeyError):
    """A torch tensor given to save whose dtype safetensors cannot carry (``complex128``,
    ``qint8``, ``uint4``...), or a tensor of a dtype torch has none for (``F6_E2M3``) in
    the bytes given to ``stream_st.torch.load``: the reference's ``KeyError``, and a
    :class:`~stream_st.DtypeError` as stream_st's own writers raise."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class UnencodableTextError(HeaderError, UnicodeEncodeError):
    """A tensor name or metadata text given to save that UTF-8 cannot encode (a lone
    surrogate): the reference's ``UnicodeEncodeError`` (its fields are ``cause``'s), and the
    :class:`~stream_st.HeaderError` stream_st's own writers raise."""

    def __init__(self, what: str, cause: UnicodeEncodeError) -> None:
        UnicodeEncodeError.__init__(
            self, cause.encoding, cause.object, cause.start, cause.end, cause.reason
        )
        self.message = f"{what} must be valid Unicode text: {cause}"

    def __str__(self) -> str:
        return self.message


class SliceError(SafetensorsError, IndexError):
    """An index of ``get_slice(name)[...]`` outside the tensor, or more indexes than it has
    dimensions."""


class SliceOverflowError(SliceError, OverflowError):
    """A numpy slice bound of ``get_slice(name)[...]`` before the first row (``[-10:2]`` of 7
    rows, any negative one on a 0-d tensor) or of 2**64 or more, or a step outside a signed
    64-bit integer (2**63 or more, below -2**63): the reference's ``OverflowError`` (it takes
    every bound as a 64-bit unsigned integer, a step as a signed one), and the ``IndexError``
    any other index outside the tensor is."""


class SliceTypeError(SafetensorsError, TypeError):
    """An index ``get_slice(name)[...]`` does not take (a float, a non-empty list)."""


class SliceValueError(SafetensorsError, ValueError):
    """A slice torch refuses in ``get_slice(name)[...]``: a step of zero, or negative."""


class MetaTensorError(UsageError, NotImplementedError):
    """A tensor on the ``meta`` device given to save: it holds no data (a ``NotImplementedError``,
    as the reference raises)."""


class NotAModuleError(UsageError, AttributeError):
    """Something given to ``save_model`` or ``load_model`` that has no ``state_dict`` (a dict,
    ``None``): the reference's ``AttributeError``."""


class FileClosedError(UsageError):
    """The ``safe_open`` handle was used after it was closed."""

    def __init__(self) -> None:
        super().__init__("File is closed")


class NoSuchFileError(SourceNotFoundError):
    """The local file to open does not exist; worded as the reference words it."""

    def __init__(self, name: str) -> None:
        super().__init__(f"No such file or directory: {name}", url=name)
