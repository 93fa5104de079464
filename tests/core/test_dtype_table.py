"""The one dtype table: every dtype fact, the torch name included, comes from ``DTYPES``."""

from __future__ import annotations

import numpy as np
import pytest

from stream_st.core import arrays
from stream_st.core.dtypes import DTYPES

torch = pytest.importorskip("torch")


def test_torch_names_come_from_the_one_table() -> None:
    assert not hasattr(arrays, "_TORCH_NAMES")  # no second table
    named = {code for code, row in DTYPES.items() if row.torch is not None}
    assert set(arrays.torch_dtypes()) == named
    assert named == set(DTYPES) - {"F6_E2M3", "F6_E3M2"}


@pytest.mark.parametrize("code", [c for c, row in DTYPES.items() if row.torch and not row.packed])
def test_torch_dtype_matches_numpy_width(code: str) -> None:
    row = DTYPES[code]
    dtype = getattr(torch, str(row.torch))
    assert arrays.torch_dtype(code) is dtype
    assert arrays.torch_code(dtype) == code
    assert torch.empty((), dtype=dtype).element_size() == np.dtype(row.numpy).itemsize
