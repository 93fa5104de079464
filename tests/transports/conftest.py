"""Fixtures of the transport tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ..servers.hub_server import FakeHub


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    """A test Hub, named by ``HF_ENDPOINT`` and ``HF_TOKEN``, with every cache place (``HF_HOME``,
    ``HF_HUB_CACHE``, ``STREAM_ST_CACHE``) under the test's own directory."""
    with FakeHub() as running:
        monkeypatch.setenv("HF_ENDPOINT", running.endpoint)
        monkeypatch.setenv("HF_TOKEN", running.token)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
        monkeypatch.setenv("STREAM_ST_CACHE", str(tmp_path / "st-cache"))
        yield running
