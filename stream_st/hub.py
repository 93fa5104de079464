"""Moved to :mod:`stream_st.transports.hub`; this path re-exports it for the 0.1 series."""

from __future__ import annotations

from .transports.hub import DEFAULT_ENDPOINT, HubClient, HubFile, HubSource, hub_endpoint, hub_token

__all__ = ["DEFAULT_ENDPOINT", "HubClient", "HubFile", "HubSource", "hub_endpoint", "hub_token"]
