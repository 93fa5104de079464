"""The one compiled module, which ``pyproject.toml`` cannot declare without a warning: the sums of
F16, BF16 and F32 values for the validator's statistics, in C with the GIL released
(``stream_st/core/_sums.c``). Optional: without a C compiler (GCC or Clang) the package installs
all the same, and numpy computes the same sums, slower. Everything else is in ``pyproject.toml``."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "stream_st.core._sums",
            ["stream_st/core/_sums.c"],
            optional=True,
            py_limited_api=True,  # one build for every Python from 3.11 on
            extra_compile_args=["-O3"],
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
