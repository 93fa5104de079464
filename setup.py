"""The compiled modules, which ``pyproject.toml`` cannot declare without a warning: the sums of
F16, BF16 and F32 values for the validator's statistics, in C with the GIL released
(``stream_st/core/_sums.c``), the reader of a header written as the reference writer writes it
and the layout of a plan's header (``stream_st/core/_compact.c``), the writer of a small file of
plain numpy arrays (``stream_st/core/_small.c``), and a local file's mapping and descriptor let
go in C (``stream_st/transports/file/_held.c``). Optional: without a C compiler (GCC or Clang)
the package installs all the same, and numpy computes the same sums, the Python parse reads
every header, the Python loop lays out every plan, the Python write makes every file, ctypes
maps every file, all slower. Everything else is in ``pyproject.toml``."""

from setuptools import Extension, setup


def _compiled(module: str) -> Extension:
    """``stream_st.<module>`` (dotted) from its ``.c`` file: optional, one build for every Python
    from 3.11 on (the stable ABI)."""
    path = "stream_st/" + module.replace(".", "/")
    return Extension(
        f"stream_st.{module}",
        [f"{path}.c"],
        depends=["stream_st/core/_text.h"],  # shared by the modules that write header text
        optional=True,
        py_limited_api=True,
        extra_compile_args=["-O3"],
    )


setup(
    ext_modules=[
        _compiled("core._sums"),
        _compiled("core._compact"),
        _compiled("core._small"),
        _compiled("transports.file._held"),
    ],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
