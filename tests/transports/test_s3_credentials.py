"""AWS credentials for s3:// sources: the whole chain, unsigned requests on request only.

Reads go to moto (``tests/servers/s3_server.py``) through a relay that keeps what the client
sent, so each test sees the headers that really went out. Instance metadata is never contacted
(``AWS_EC2_METADATA_DISABLED``); the container provider is pointed at a loopback server.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import stream_st
from stream_st.cli import exits as cli_exits
from stream_st.cli import main as cli_main
from stream_st.transports.s3.config import S3Config
from stream_st.transports.s3.source import S3Source

from .._util import sample_file
from ..servers._loopback import LoopbackServer
from ..servers.s3_server import MotoS3Server

URL = "s3://creds/m.safetensors"
PUBLIC = "s3://creds/public.safetensors"

CREDENTIAL_PROCESS = """\
import datetime, json, pathlib, sys

counter = pathlib.Path(sys.argv[1])
runs = int(counter.read_text()) + 1 if counter.exists() else 1
counter.write_text(str(runs))
if sys.argv[2] == "garbled":
    print("this is not JSON")
    sys.exit(0)
if sys.argv[2] == "fail":
    sys.exit(1)
expires = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=int(sys.argv[2]))
print(json.dumps({
    "Version": 1,
    "AccessKeyId": f"PROCESS{runs}",
    "SecretAccessKey": "secret",
    "SessionToken": f"TOKEN{runs}",
    "Expiration": expires.strftime("%Y-%m-%dT%H:%M:%SZ"),
}))
"""


class RecordingRelay(LoopbackServer):
    """Forwards each connection on 127.0.0.1 to ``port`` there; ``sent`` keeps every byte the
    clients sent."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.sent = bytearray()
        self._lock = threading.Lock()
        super().__init__()
        self.url = f"http://127.0.0.1:{self.port}"

    def gets(self) -> list[dict[str, str]]:
        """The headers (names in lower case) of each GET sent so far."""
        with self._lock:
            sent = bytes(self.sent)
        heads = re.findall(rb"GET [^\r\n]* HTTP/1\.1\r\n(.*?)\r\n\r\n", sent, re.DOTALL)
        return [
            {
                name.strip().lower(): value.strip()
                for name, _, value in (line.partition(":") for line in head.decode().split("\r\n"))
            }
            for head in heads
        ]

    def handle(self, client: socket.socket) -> None:
        with socket.create_connection(("127.0.0.1", self.upstream)) as server:
            peer = {client: server, server: client}
            with contextlib.suppress(OSError):
                while peer:
                    for sock in select.select(list(peer), [], [])[0]:
                        chunk = sock.recv(65536)
                        if not chunk:
                            peer.pop(sock).shutdown(socket.SHUT_WR)
                            continue
                        if sock is client:
                            with self._lock:
                                self.sent += chunk
                        peer[sock].sendall(chunk)


@pytest.fixture(scope="module")
def store(moto_s3: MotoS3Server) -> MotoS3Server:
    moto_s3.client().create_bucket(Bucket="creds")
    client = moto_s3.client()
    client.put_object(Bucket="creds", Key="m.safetensors", Body=sample_file())
    client.put_object(  # moto, like S3, refuses unsigned reads of private objects
        Bucket="creds", Key="public.safetensors", Body=sample_file(), ACL="public-read"
    )
    return moto_s3


@pytest.fixture
def relay(store: MotoS3Server) -> Iterator[RecordingRelay]:
    relay = RecordingRelay(store.port)
    yield relay
    relay.close()


@pytest.fixture
def home(relay: RecordingRelay, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An environment with no AWS settings but the endpoint (the relay) and an empty home: no
    credentials anywhere, instance metadata off. Returns the home directory."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ENDPOINT_URL", relay.url)
    return tmp_path


def write_profile(home: Path, name: str, *lines: str) -> None:
    """Append a profile section with ``lines`` to ``home``'s ~/.aws/config."""
    (home / ".aws").mkdir(exist_ok=True)
    with (home / ".aws" / "config").open("a") as config:
        config.write("\n".join([f"[profile {name}]", *lines, ""]))


def credential_process(home: Path, profile: str, mode: str) -> Path:
    """A profile whose credentials come from a process (``mode``: their lifetime in seconds,
    ``garbled`` or ``fail``); returns the file that counts its runs."""
    script = home / "credentials.py"
    script.write_text(CREDENTIAL_PROCESS)
    counter = home / f"{profile}.runs"
    command = shlex.join([sys.executable, str(script), str(counter), mode])
    write_profile(home, profile, f"credential_process = {command}")
    return counter


def credential_of(headers: dict[str, str]) -> str:
    """The access key a request was signed with."""
    match = re.search(r"Credential=([^/]+)/", headers["authorization"])
    assert match is not None
    return match[1]


class ContainerEndpoint(ThreadingHTTPServer):
    """A loopback server answering as the container credentials endpoint does, after ``delay``
    seconds."""

    delay = 0.0


@pytest.fixture
def container_credentials() -> Iterator[ContainerEndpoint]:
    class Handler(BaseHTTPRequestHandler):
        server: ContainerEndpoint

        def do_GET(self) -> None:
            time.sleep(self.server.delay)
            body = json.dumps(
                {
                    "AccessKeyId": "CONTAINER",
                    "SecretAccessKey": "secret",
                    "Token": "CONTAINERTOKEN",
                    "Expiration": "2099-01-01T00:00:00Z",
                }
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ContainerEndpoint(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


# ---------------------------------------------------------------- the chain


async def test_environment_shared_file_and_profile(
    home: Path, relay: RecordingRelay, monkeypatch: pytest.MonkeyPatch
) -> None:
    (home / ".aws").mkdir()
    (home / ".aws" / "credentials").write_text(
        "[default]\naws_access_key_id = FILE\naws_secret_access_key = s\n"
        "[dev]\naws_access_key_id = DEV\naws_secret_access_key = s\naws_session_token = DEVTOKEN\n"
    )
    await stream_st.read_header(URL)
    monkeypatch.setenv("AWS_PROFILE", "dev")
    await stream_st.read_header(URL)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "ENV")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    await stream_st.read_header(URL)
    gets = relay.gets()
    assert [credential_of(headers) for headers in gets] == ["FILE", "DEV", "ENV"]
    assert [headers.get("x-amz-security-token") for headers in gets] == [None, "DEVTOKEN", None]


async def test_every_key_comes_from_the_profile_the_endpoint_came_from(
    home: Path, relay: RecordingRelay, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AWS_PROFILE comes before AWS_DEFAULT_PROFILE for the keys too (botocore alone prefers
    AWS_DEFAULT_PROFILE: another profile's keys were sent to this one's endpoint)."""
    (home / ".aws").mkdir()
    (home / ".aws" / "credentials").write_text(
        "[dev]\naws_access_key_id = DEV\naws_secret_access_key = s\n"
        "[prod]\naws_access_key_id = PROD\naws_secret_access_key = s\n"
    )
    (home / ".aws" / "config").write_text(
        "[profile dev]\nregion = eu-west-3\n[profile prod]\nregion = us-east-1\n"
    )
    monkeypatch.setenv("AWS_PROFILE", "dev")
    monkeypatch.setenv("AWS_DEFAULT_PROFILE", "prod")
    config = S3Config.resolve()
    assert config.region == "eu-west-3"
    await stream_st.read_header(S3Source(URL, config=config))
    monkeypatch.delenv("AWS_PROFILE")
    await stream_st.read_header(URL)
    assert [credential_of(headers) for headers in relay.gets()] == ["DEV", "PROD"]


@pytest.mark.parametrize(
    ("setup", "where"),
    [
        ("environment token", "the AWS session token from AWS_SESSION_TOKEN holds a line break"),
        ("environment key", "the AWS access key id from AWS_ACCESS_KEY_ID holds a line break"),
        (
            "wrapped token, botocore",
            r"the AWS session token from the AWS credential chain \(shared-credentials-file\) "
            "holds a line break",
        ),
        (
            "wrapped token, no botocore",
            "the AWS session token from aws_session_token of the profile 'default' in "
            ".*/credentials holds a line break",
        ),
        ("code", "the AWS session token from session_token= holds characters beyond Latin-1"),
    ],
    ids=["environment token", "environment key", "botocore file", "own file", "code"],
)
async def test_keys_a_header_cannot_carry_are_refused(
    home: Path, relay: RecordingRelay, monkeypatch: pytest.MonkeyPatch, setup: str, where: str
) -> None:
    """A key or token holding a line break would inject a header: a CredentialsError naming
    where it came from (never the value), before any request."""
    config = None
    if setup.startswith("environment"):
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AK\r\nX-Injected: yes" if "key" in setup else "AK")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
        monkeypatch.setenv("AWS_SESSION_TOKEN", "tok\r\nX-Injected: yes")
    elif setup.startswith("wrapped"):  # configparser joins the lines with a newline
        (home / ".aws").mkdir()
        (home / ".aws" / "credentials").write_text(
            "[default]\naws_access_key_id = AK\naws_secret_access_key = s\n"
            "aws_session_token = part1\n  X-Injected: yes\n"
        )
        if "no botocore" in setup:  # environ= given: the files read here, not by botocore
            config = S3Config.resolve(environ={**os.environ})
            assert config.chain is None
    else:
        config = S3Config.resolve(
            access_key_id="AK", secret_access_key="s", session_token="t\u4e00"
        )
    with pytest.raises(stream_st.CredentialsError) as info:
        await stream_st.read_header(URL if config is None else S3Source(URL, config=config))
    assert re.fullmatch(where + ".*", str(info.value))
    assert "X-Injected" not in str(info.value) and "\u4e00" not in str(info.value)
    assert relay.sent == b""


async def test_keys_with_whitespace_at_an_end_are_refused(
    home: Path, relay: RecordingRelay
) -> None:
    """A key pasted with a tab or a no-break space at an end: text a header carries, but not
    the key (the server strips a header's value, the signature is made with it): refused as
    such before any request, where it went out and came back an unexplained refusal; the
    value never shown."""
    for keys in (
        {"access_key_id": "AK", "secret_access_key": "s3cr3t\t"},
        {"access_key_id": "AK", "secret_access_key": "s", "session_token": "\u00a0t0ken"},
    ):
        config = S3Config.resolve(**keys)  # type: ignore[arg-type]
        with pytest.raises(
            stream_st.CredentialsError, match="whitespace at its start or end"
        ) as info:
            await stream_st.read_header(S3Source(URL, config=config))
        assert "s3cr3t" not in str(info.value) and "t0ken" not in str(info.value)
    assert relay.sent == b""


async def test_credential_process(home: Path, relay: RecordingRelay) -> None:
    counter = credential_process(home, "proc", "7200")
    config = S3Config.resolve(profile="proc")
    assert not counter.exists()  # looked for on first use, not before
    for _ in range(3):  # one configuration, three reads: one search
        await stream_st.read_header(S3Source(URL, config=config))
    assert counter.read_text() == "1"
    assert {credential_of(h) for h in relay.gets()} == {"PROCESS1"}
    assert {h["x-amz-security-token"] for h in relay.gets()} == {"TOKEN1"}


async def test_expiring_credentials_are_refreshed(home: Path, relay: RecordingRelay) -> None:
    # Credentials this close to their expiry are refreshed before every request that uses them.
    counter = credential_process(home, "short", str(12 * 60))
    config = S3Config.resolve(profile="short")
    await stream_st.read_header(S3Source(URL, config=config))
    await stream_st.read_header(S3Source(URL, config=config))
    used = [credential_of(headers) for headers in relay.gets()]
    assert len(set(used)) == 2 and int(counter.read_text()) >= 3


async def test_container_credentials(
    home: Path,
    relay: RecordingRelay,
    container_credentials: ContainerEndpoint,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = container_credentials.server_address[1]
    monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", f"http://127.0.0.1:{port}/creds")
    arrays = await stream_st.load(URL)
    assert arrays
    assert {credential_of(h) for h in relay.gets()} == {"CONTAINER"}
    assert {h["x-amz-security-token"] for h in relay.gets()} == {"CONTAINERTOKEN"}
    # Looking for credentials is a wait like any other: the read's limits bound it.
    container_credentials.delay = 0.8
    with pytest.raises(stream_st.ReadTimeoutError, match=r"no AWS credentials for 0\.2 s"):
        await stream_st.read_header(S3Source(URL, timeout=0.2))


async def test_web_identity(
    home: Path, relay: RecordingRelay, monkeypatch: pytest.MonkeyPatch
) -> None:
    # STS (moto's, behind the same endpoint) exchanges the token for temporary credentials.
    (home / "token").write_text("a-web-identity-token")
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(home / "token"))
    monkeypatch.setenv("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/reader")
    monkeypatch.setenv("AWS_ROLE_SESSION_NAME", "test")
    await stream_st.read_header(URL)
    (headers,) = relay.gets()
    assert credential_of(headers).startswith("ASIA") and headers["x-amz-security-token"]


# ---------------------------------------------------------------- no credentials, unsigned


async def test_no_credentials_is_an_error_before_any_request(
    home: Path, relay: RecordingRelay
) -> None:
    with pytest.raises(stream_st.CredentialsError) as info:
        await stream_st.read_header(URL)
    message = str(info.value)
    assert "no AWS credentials found" in message and "--no-sign-request" in message
    assert "\n" not in message
    assert relay.sent == b""
    with pytest.raises(stream_st.CredentialsError, match="AWS_NO_SIGN_REQUEST=1"):
        S3Config.resolve(environ={"HOME": str(home)}).sign("GET", "http://h/b/k", {})


async def test_unsigned_requests_on_request(
    home: Path, relay: RecordingRelay, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "ENV")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    await stream_st.read_header(S3Source(PUBLIC, config=S3Config.resolve(anonymous=True)))
    monkeypatch.setenv("AWS_NO_SIGN_REQUEST", "1")
    await stream_st.read_header(PUBLIC)
    await stream_st.read_header(S3Source(PUBLIC, config=S3Config.resolve(anonymous=False)))
    signed = ["authorization" in headers for headers in relay.gets()]
    assert signed == [False, False, True]
    monkeypatch.setenv("AWS_NO_SIGN_REQUEST", "maybe")
    with pytest.raises(stream_st.UsageError, match="AWS_NO_SIGN_REQUEST must be"):
        S3Config.resolve()


def test_no_sign_request_on_the_command_line(
    home: Path, relay: RecordingRelay, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["inspect", URL]) == cli_exits.EXIT_ERROR
    error = capsys.readouterr().err
    assert "no AWS credentials found" in error and error.count("\n") == 1
    for command in (["inspect"], ["hash", "--content"], ["validate"], ["diff", PUBLIC]):
        assert cli_main([*command, "--no-sign-request", PUBLIC]) == cli_exits.EXIT_OK
    copy = str(home / "copy.safetensors")
    assert cli_main(["cp", "-q", "--no-sign-request", PUBLIC, copy]) == cli_exits.EXIT_OK
    assert relay.gets() and all("authorization" not in h for h in relay.gets())
    assert S3Config.resolve().chain is not None  # the flag lasts for its command only


# ---------------------------------------------------------------- broken configuration


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        ("unknown profile", r"the AWS profile 'nope' is in neither .*/config nor .*/credentials"),
        ("garbled process output", r"cannot get AWS credentials for the profile 'p': JSONDecode"),
        ("failing process", r"cannot get AWS credentials for the profile 'p': .*custom-process"),
    ],
)
async def test_broken_configuration_is_a_one_line_error(
    home: Path, relay: RecordingRelay, setup: str, expected: str
) -> None:
    if setup == "unknown profile":
        config = None
        with pytest.raises(stream_st.CredentialsError) as info:
            S3Config.resolve(profile="nope")
    else:
        credential_process(home, "p", "garbled" if "garbled" in setup else "fail")
        config = S3Config.resolve(profile="p")
        with pytest.raises(stream_st.CredentialsError) as info:
            await stream_st.read_header(S3Source(URL, config=config))
    assert re.fullmatch(expected + ".*", str(info.value))
    assert "\n" not in str(info.value) and relay.sent == b""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "[default]\naws_access_key_id = K\naws_secret_access_key SEKRET\n",
            "neither a [section] nor name = value at line 3",
        ),
        ("aws_secret_access_key = SEKRET\n[default]\n", "line 1 comes before any [section]"),
        (
            "[default]\naws_secret_access_key SEKRET\nx\n[default\n",
            "neither a [section] nor name = value at line 2, 3, 4",
        ),
    ],
)
def test_an_unreadable_credentials_file_is_named_not_quoted(
    home: Path, text: str, expected: str
) -> None:
    """A malformed AWS file is refused naming it and the line numbers, never the lines' text
    (configparser's message quoted the line, the secret key in it)."""
    (home / ".aws").mkdir()
    (home / ".aws" / "credentials").write_text(text)
    with pytest.raises(stream_st.CredentialsError) as info:
        S3Config.resolve()
    assert str(info.value) == (
        f"cannot read the AWS file {home / '.aws' / 'credentials'}: {expected}"
    )
    assert "SEKRET" not in str(info.value)


@pytest.mark.parametrize(
    "given",
    [
        {"access_key_id": 123, "secret_access_key": "s"},
        {"access_key_id": "k", "secret_access_key": b"s"},
        {"session_token": 1.5},
        {"region": ["us-east-1"]},
        {"endpoint_url": 8080},
        {"profile": 0},
    ],
)
def test_settings_given_in_code_are_strings(given: dict[str, object]) -> None:
    """A setting of another type given in code is an ``ArgumentTypeError`` naming it, when
    resolved (a number as a key failed later, with an internal error)."""
    name = next(what for what, value in given.items() if not isinstance(value, str))
    with pytest.raises(stream_st.ArgumentTypeError, match=f"{name}="):
        S3Config.resolve(**given)  # type: ignore[arg-type]


def test_without_botocore_the_environment_and_files(home: Path, tmp_path: Path) -> None:
    (home / ".aws").mkdir()
    (home / ".aws" / "credentials").write_text(
        "[default]\naws_access_key_id = FILE\naws_secret_access_key = s\n"
    )
    credential_process(home, "proc", "7200")
    child = """
import json, sys
sys.modules["botocore"] = None  # not installed
import stream_st
from stream_st.transports.s3.config import S3Config
found = S3Config.resolve()
out = {"key": found.access_key_id, "chain": found.chain is not None}
try:
    S3Config.resolve(profile="proc").sign("GET", "http://h/b/k", {})
except stream_st.CredentialsError as exc:
    out["error"] = str(exc)
print(json.dumps(out))
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run(
        [sys.executable, "-c", child], env=env, capture_output=True, text=True, check=True
    )
    out = json.loads(done.stdout)
    assert out["key"] == "FILE" and not out["chain"]
    assert "no AWS credentials found" in out["error"] and "s3 extra" in out["error"]
    assert not (tmp_path / "proc.runs").exists()


def test_keys_in_the_environment_are_taken_without_the_chain(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "ENVKEY")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    found = S3Config.resolve()
    assert found.chain is None and found.keys() == ("ENVKEY", "s", None)
    # A profile named in code is botocore's to resolve (its chain then skips the environment).
    credential_process(home, "p", "7200")
    assert S3Config.resolve(profile="p").chain is not None
