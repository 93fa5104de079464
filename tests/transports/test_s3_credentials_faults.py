"""Credentials that fail a write to S3, and a cancellation once the commit was answered.

A ``credential_process`` helper (a script in the test's directory) that hangs, prints a secret
as it fails, or hands out credentials already expired; writes go to moto
(``tests/servers/s3_server.py``) through a proxy where a test needs to see or slow a request.
Instance metadata is never contacted (``AWS_EC2_METADATA_DISABLED``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st.transports.s3.config import S3Config
from stream_st.transports.s3.sink import MIN_PART_SIZE, S3Sink

from ..servers.lossy_proxy import DelayingProxy, LossyProxy
from ..servers.s3_server import MotoS3Server
from ._s3_faults import bucket_store
from ._s3_faults import proxy as proxy
from .test_upload_faults import pending, s3_sink, stored, write

Arrays = dict[str, np.ndarray[Any, Any]]
BUCKET = "credfaults"
SMALL: Arrays = {"a": np.arange(12, dtype=np.float32)}
# Two parts of MIN_PART_SIZE: the first is sent as it fills, the second with the completion.
TWO_PARTS: Arrays = {f"w{i}": np.random.default_rng(i).random(400_000) for i in range(2)}
SECRET = "refresh_token=SECRET-FROM-THE-HELPER"

HELPER = f"""\
import datetime, json, os, pathlib, sys, time

here = pathlib.Path(sys.argv[0]).parent
mode = sys.argv[1]
if mode == "hang":
    (here / "helper.pid").write_text(str(os.getpid()))
    time.sleep(60)
if mode == "fail":
    print({SECRET!r}, file=sys.stderr)
    sys.exit(3)
# "expired", or "fresh" until the file "expire" appears: then expired credentials
expired = mode == "expired" or (here / "expire").exists()
now = datetime.datetime.now(datetime.UTC)
# 700 s: within botocore's advisory window, so that every use refreshes them
expires = now + datetime.timedelta(seconds=-60 if expired else 700)
print(json.dumps({{
    "Version": 1,
    "AccessKeyId": "HELPERKEY",
    "SecretAccessKey": "secret",
    "SessionToken": "token",
    "Expiration": expires.strftime("%Y-%m-%dT%H:%M:%SZ"),
}}))
"""


store = bucket_store(BUCKET)


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """An environment whose only AWS settings are a config file (in ``tmp_path``) with a profile
    per helper mode (``hang``, ``fail``, ``expired``, ``fresh``); returns its directory. A helper
    still hanging at the end is ended."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    script = tmp_path / "helper.py"
    script.write_text(HELPER)
    config = tmp_path / "config"
    config.write_text(
        "".join(
            f"[profile {mode}]\ncredential_process = {sys.executable} {script} {mode}\n"
            for mode in ("hang", "fail", "expired", "fresh")
        )
    )
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    yield tmp_path
    end_helper(tmp_path)


def end_helper(directory: Path) -> None:
    """End the hanging helper started for ``directory``'s profiles, if it still runs."""
    pid_file = directory / "helper.pid"
    if pid_file.exists():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def wait_for_helper(directory: Path) -> None:
    """Block until the hanging helper has started (a hang guard: 30 s)."""
    deadline = time.monotonic() + 30
    while not (directory / "helper.pid").exists():
        assert time.monotonic() < deadline, "the helper never started"
        time.sleep(0.01)


# ---------------------------------------------------------------- a helper that hangs


@pytest.mark.parametrize("arrays", [SMALL, TWO_PARTS], ids=["put", "create"])
async def test_a_cancellation_while_a_helper_hangs_ends_the_write_at_once(
    aws: Path, proxy: LossyProxy, key: str, arrays: Arrays
) -> None:
    """The credentials of the PutObject (or of the CreateMultipartUpload) are looked for before
    its request is seen through: cancelled meanwhile, the write ends at once with nothing sent,
    where it waited for abort_timeout (the credentials were looked for inside the shield)."""
    config = S3Config.resolve(profile="hang", endpoint_url=proxy.url)
    sink = S3Sink(f"s3://{BUCKET}/{key}", config=config, part_size=MIN_PART_SIZE)
    sink.abort_timeout = 5.0

    cancelled_at: list[float] = []

    async def cancel_once_the_helper_runs(scope: anyio.CancelScope) -> None:
        await anyio.to_thread.run_sync(wait_for_helper, aws)
        cancelled_at.append(time.monotonic())
        scope.cancel()

    with anyio.fail_after(30), anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:
            group.start_soon(cancel_once_the_helper_runs, scope)
            await write(sink, arrays)
    assert scope.cancelled_caught
    assert time.monotonic() - cancelled_at[0] < 2.0  # no abort_timeout waited for
    assert proxy.requests == []


def test_a_command_out_of_time_while_a_helper_hangs_exits_at_once(aws: Path) -> None:
    """``stream-st cp`` with ``--deadline 1``, its credential process hanging: the error, then
    the exit, within seconds, where the process lived on until the helper ended (the lookup's
    thread was joined at exit)."""
    source = aws / "small.safetensors"
    source.write_bytes(reference_numpy.save(SMALL))
    command = [sys.executable, "-m", "stream_st", "cp", str(source), f"s3://{BUCKET}/x"]
    environment = {**os.environ, "AWS_ENDPOINT_URL": "http://127.0.0.1:1"}
    started = time.monotonic()
    result = subprocess.run(
        [*command, "-q", "--profile", "hang", "--deadline", "1"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=30,  # the helper sleeps 60 s: a process waiting for it fails here
    )
    assert time.monotonic() - started < 20
    assert result.returncode == 2, result.stderr
    assert "deadline" in result.stderr


# ---------------------------------------------------------------- a helper that fails


async def test_a_failing_helpers_output_is_not_shown(aws: Path, proxy: LossyProxy) -> None:
    """A failing credential process is named by its exit status, never by what it printed
    (botocore quotes its error output, where a helper may print a secret)."""
    config = S3Config.resolve(profile="fail", endpoint_url=proxy.url)
    with pytest.raises(stream_st.CredentialsError) as info:
        await write(S3Sink(f"s3://{BUCKET}/failing", config=config), SMALL)
    message = str(info.value)
    assert "SECRET" not in message and "refresh_token" not in message
    assert "for the profile 'fail'" in message and "exited with status 3" in message
    assert proxy.requests == []


# ---------------------------------------------------------------- expired credentials


async def test_credentials_already_expired_are_a_credentials_error(
    aws: Path, proxy: LossyProxy
) -> None:
    """botocore's RuntimeError ("refreshed credentials are still expired") is a
    CredentialsError before any request, where it came out as itself (an internal error)."""
    config = S3Config.resolve(profile="expired", endpoint_url=proxy.url)
    with pytest.raises(stream_st.CredentialsError, match="still expired") as info:
        await write(S3Sink(f"s3://{BUCKET}/expired", config=config), SMALL)
    assert "for the profile 'expired'" in str(info.value)
    assert proxy.requests == []


class ExpiringAfterFirstPart(LossyProxy):
    """A :class:`LossyProxy` that has the helper hand out expired credentials from the first
    UploadPart on (the file ``expire`` in ``directory``)."""

    def __init__(self, upstream_port: int, directory: Path) -> None:
        super().__init__(upstream_port)
        self.directory = directory

    def _forward(self, request: bytes) -> bytes:
        if request.startswith(b"PUT ") and b"partNumber=1&" in request.split(b"\r\n", 1)[0]:
            (self.directory / "expire").touch()
        return super()._forward(request)


async def test_credentials_expiring_mid_upload_fail_the_abort_with_a_note(
    aws: Path, store: MotoS3Server, key: str
) -> None:
    """Refreshed credentials already expired at the second part: a CredentialsError, and the
    abort (which needs them too) failing leaves the upload pending, said in a note; before, a
    bare RuntimeError, and no note."""
    with ExpiringAfterFirstPart(store.port, aws) as proxy:
        config = S3Config.resolve(profile="fresh", endpoint_url=proxy.url)
        sink = S3Sink(f"s3://{BUCKET}/{key}", config=config, part_size=MIN_PART_SIZE)
        sink.abort_timeout = 5.0
        with pytest.raises(stream_st.CredentialsError, match="still expired") as info:
            await write(sink, TWO_PARTS)
    (upload_id,) = pending(store, key, BUCKET)
    notes = getattr(info.value, "__notes__", [])
    assert len(notes) == 1, notes
    assert f"aborting multipart upload {upload_id} of s3://{BUCKET}/{key} failed" in notes[0]
    assert notes[0].endswith("it may still be pending")
    store.client().abort_multipart_upload(Bucket=BUCKET, Key=key, UploadId=upload_id)


# ---------------------------------------------------------------- a cancellation once answered


async def test_a_task_cancelled_before_the_completes_answer_says_it_was_carried_out(
    store: MotoS3Server, key: str
) -> None:
    """asyncio's ``Task.cancel()`` while CompleteMultipartUpload is on its way, its answer
    coming within abort_timeout: the cancellation goes on, its note saying the object is the one
    written and nothing more, and no HEAD asks the store; the note said that its answer did not
    come, and a HEAD was sent."""
    completing = b"?uploadId="  # held once the store has answered it
    proxy = DelayingProxy(store.port, b"POST", lambda target: completing in target, 1.0, after=True)
    with proxy:
        sink = s3_sink(proxy, key, BUCKET)
        sink.abort_timeout = 10.0  # time enough for the answer, however busy the machine
        task = asyncio.create_task(write(sink, TWO_PARTS))
        await anyio.to_thread.run_sync(proxy.seen.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError) as info:
            await asyncio.wait_for(task, 30)  # a hang guard
        methods = [method for method, _, _ in proxy.requests]
    assert getattr(info.value, "__notes__", []) == [
        f"the CompleteMultipartUpload sent before the cancellation was carried out: the object "
        f"at s3://{BUCKET}/{key} is the one written"
    ]
    assert methods == ["POST", "PUT", "PUT", "POST"]
    assert stored(store, key, BUCKET) == reference_numpy.save(TWO_PARTS)
    assert pending(store, key, BUCKET) == []
