"""Fixtures shared by the S3 upload fault tests (test_upload_faults, test_s3_part_reset,
test_s3_credentials_faults): the moto server with a module's own bucket, and a
:class:`~tests.servers.lossy_proxy.LossyProxy` in front of it."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from ..servers.lossy_proxy import LossyProxy
from ..servers.s3_server import MotoS3Server


def bucket_store(bucket: str) -> Callable[[MotoS3Server], MotoS3Server]:
    """A module's fixture ``store``: the session's moto server, with ``bucket`` made once for
    the module (``store = bucket_store(BUCKET)``)."""

    @pytest.fixture(scope="module")
    def store(moto_s3: MotoS3Server) -> MotoS3Server:
        moto_s3.client().create_bucket(Bucket=bucket)
        return moto_s3

    return store


@pytest.fixture
def proxy(store: MotoS3Server) -> Iterator[LossyProxy]:
    """A :class:`LossyProxy` in front of the module's ``store``, for one test."""
    with LossyProxy(store.port) as proxy:
        yield proxy
