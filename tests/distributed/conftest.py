"""A group of three ranks kept up for the whole run (see :class:`._group.Pool`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ._group import Pool


@pytest.fixture(scope="session")
def pool() -> Iterator[Pool]:
    started = Pool(3)
    yield started
    started.close()
