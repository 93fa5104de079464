"""The compiled modules, which ``pyproject.toml`` cannot declare without a warning: the sums of
F16, BF16 and F32 values for the validator's statistics, in C with the GIL released
(``stream_st/core/_sums.c``), the reader of a header written as the reference writer writes it
(``stream_st/core/_compact.c``), and the writer of a small file of plain numpy arrays
(``stream_st/core/_small.c``). Optional: without a C compiler (GCC or Clang) the package
installs all the same, and numpy computes the same sums, the Python parse reads every header,
the Python write makes every file, all slower. Everything else is in ``pyproject.toml``."""

from setuptools import Extension, setup


def _compiled(name: str) -> Extension:
    """``stream_st.core.<name>`` from ``stream_st/core/<name>.c``: optional, one build for every
    Python from 3.11 on (the stable ABI)."""
    return Extension(
        f"stream_st.core.{name}",
        [f"stream_st/core/{name}.c"],
        depends=["stream_st/core/_text.h"],  # shared by the modules that write header text
        optional=True,
        py_limited_api=True,
        extra_compile_args=["-O3"],
    )


setup(
    ext_modules=[_compiled("_sums"), _compiled("_compact"), _compiled("_small")],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
