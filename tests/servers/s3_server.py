"""A real S3-compatible server on 127.0.0.1: moto's server mode, in a child process.

    with MotoS3Server() as s3:
        s3.endpoint_url           # http://127.0.0.1:PORT
        s3.client()               # a boto3 client for setting up buckets and checking results
        s3.config()               # stream_st's S3Config for it

The child serves until its standard input closes, so it never outlives the test run.
Run standalone: ``python -m tests.servers.s3_server`` prints the port and serves until stdin closes.
"""

from __future__ import annotations

import subprocess
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stream_st.transports.s3.config import S3Config

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class MotoS3Server:
    """moto's S3 API over HTTP in a child process, on an ephemeral port."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[str] | None = None
        self.port = 0

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MotoS3Server:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.servers.s3_server"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError(f"moto server did not start: {line!r}")
        self.port = int(line)
        return self

    def stop(self) -> None:
        if self._process is not None:
            if self._process.stdin is not None:
                self._process.stdin.close()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            if self._process.stdout is not None:
                self._process.stdout.close()
            self._process = None

    def client(self) -> Any:
        """A boto3 client of this server. It reads back what is stored as it is: moto keeps an
        upload without checking its checksum, so an object damaged on the way in (the fault
        suite's) must be read to be judged, not refused by the client's own check."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            config=Config(response_checksum_validation="when_required"),
        )

    def config(self) -> S3Config:
        """An :class:`~stream_st.transports.s3.config.S3Config` for this server, with its test
        credentials and nothing taken from the environment."""
        from stream_st.transports.s3.config import S3Config

        return S3Config.resolve(
            endpoint_url=self.endpoint_url,
            access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            environ={},
        )

    def __enter__(self) -> MotoS3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    print(server.get_host_and_port()[1], flush=True)
    try:
        sys.stdin.read()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
