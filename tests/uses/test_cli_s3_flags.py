"""The S3 flags of every command taking an s3:// address: --endpoint-url, --region, --profile
(as the AWS CLI spells them), above the environment and the AWS files."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from ..servers.http_server import RangeHTTPServer
from ..servers.s3_server import CREDENTIALS, MotoS3Server
from ._cli import COMMAND, write_model

AWS_VARIABLES = [name for name in os.environ if name.startswith("AWS_")]


@pytest.fixture
def bare_env(tmp_path: Path) -> dict[str, str]:
    """No AWS settings anywhere: no variables, no files (HOME elsewhere)."""
    home = tmp_path / "home"
    home.mkdir()
    return {**dict.fromkeys(AWS_VARIABLES, ""), "HOME": str(home)}


def _without_empty(env: dict[str, str]) -> dict[str, str]:
    merged = {**os.environ, **env}
    return {k: v for k, v in merged.items() if v != "" or not k.startswith("AWS_")}


@pytest.fixture
def stored(tmp_path: Path, moto_s3: MotoS3Server) -> str:
    client = moto_s3.client()
    client.create_bucket(Bucket="flags")
    model = write_model(tmp_path / "model.safetensors")
    client.put_object(Bucket="flags", Key="m.safetensors", Body=model.read_bytes())
    return "s3://flags/m.safetensors"


def _run(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    done = subprocess.run(
        [COMMAND, *args], capture_output=True, text=True, timeout=120, env=_without_empty(env)
    )
    return done.returncode, done.stdout, done.stderr


def test_endpoint_url_on_every_command(
    stored: str, moto_s3: MotoS3Server, bare_env: dict[str, str], tmp_path: Path
) -> None:
    """Was "unrecognized arguments: --endpoint-url"."""
    env = {**bare_env, **CREDENTIALS}
    flag = ["--endpoint-url", moto_s3.endpoint_url]
    for args in (
        ["inspect", "--json", stored],
        ["ls", stored],
        ["show", stored, "model.embed_tokens.weight"],
        ["hash", stored],
        ["diff", stored, stored],
        ["validate", stored],
        ["cp", "-q", stored, str(tmp_path / "copy.safetensors")],
        ["cp", "-q", str(tmp_path / "copy.safetensors"), "s3://flags/copy.safetensors"],
    ):
        status, out, err = _run(*args, *flag, env=env)
        assert status == 0, (args, err)
    assert (tmp_path / "copy.safetensors").exists()
    status, out, _ = _run("inspect", "--json", "s3://flags/copy.safetensors", *flag, env=env)
    assert status == 0 and json.loads(out)["tensor_count"] == 3
    # the flag comes first: an environment naming another store is overridden
    wrong = {**env, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    assert _run("ls", stored, *flag, env=wrong)[0] == 0
    assert _run("ls", stored, "--timeout", "10", env=wrong)[0] == 2


def test_profile_gives_credentials_and_endpoint(
    stored: str, moto_s3: MotoS3Server, bare_env: dict[str, str], tmp_path: Path
) -> None:
    config, credentials = tmp_path / "config", tmp_path / "credentials"
    config.write_text(
        f"[profile moto]\nregion = us-east-1\nendpoint_url = {moto_s3.endpoint_url}\n"
    )
    credentials.write_text("[moto]\naws_access_key_id = testing\naws_secret_access_key = testing\n")
    env = {
        **bare_env,
        "AWS_CONFIG_FILE": str(config),
        "AWS_SHARED_CREDENTIALS_FILE": str(credentials),
    }
    status, out, err = _run("ls", stored, "--profile", "moto", env=env)
    assert status == 0, err
    assert "model.embed_tokens.weight" in out
    status, _, err = _run("ls", stored, "--profile", "nobody", env=env)
    assert status == 2 and "nobody" in err


def test_region_signs_the_requests(bare_env: dict[str, str], tmp_path: Path) -> None:
    """--region is the region requests are signed for (SigV4's credential scope)."""
    model = write_model(tmp_path / "model.safetensors")
    with RangeHTTPServer(objects={"/flags/m.safetensors": model.read_bytes()}) as server:
        env = {**bare_env, **CREDENTIALS}
        endpoint = server.url("")
        status, _, err = _run(
            "ls",
            "s3://flags/m.safetensors",
            "--region",
            "eu-west-3",
            "--endpoint-url",
            endpoint,
            env=env,
        )
        assert status == 0, err
        server.settle()
        signed = [h.get("authorization", "") for _, _, h in server.headers_seen]
        assert signed and all("/eu-west-3/s3/aws4_request" in a for a in signed), signed


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--endpoint-url", "notaurl", "not an http:// or https:// URL with a host"),
        ("--endpoint-url", "", "empty (an unset variable?)"),
        ("--endpoint-url", "http://host:abc", "a URL whose port is not a number from 0 to"),
        ("--endpoint-url", "http://host:70000", "a URL whose port is not a number from 0 to"),
        ("--endpoint-url", "http://a b:9000", "a URL whose host is not a host name or an IP"),
        ("--endpoint-url", "http://a%ffb:9000", "a URL whose host is not a host name or an IP"),
        ("--profile", "nosuch", "the AWS profile 'nosuch' is in neither"),
        ("--region", "x@127.0.0.1:9/", "'x@127.0.0.1:9/' is not a region name"),
        ("--region", "eu west 1", "'eu west 1' is not a region name"),
    ],
)
def test_a_bad_s3_flag_is_refused_once(
    flag: str, value: str, said: str, bare_env: dict[str, str]
) -> None:
    """A bad --endpoint-url, --profile or --region is refused as the command line is parsed,
    naming the flag, once (they were each source's error, without the flag's name, as a host
    with a space or an escape still was until it was checked; an empty --endpoint-url was taken
    as unset, a region holding '@host:port/' sent the signed request
    to that host)."""
    env = {**bare_env, **CREDENTIALS, "AWS_SESSION_TOKEN": "TOKEN-SECRET"}
    status, out, err = _run("inspect", "s3://b/k1", "s3://b/k2", flag, value, env=env)
    assert status == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and f"argument {flag}: {said}" in lines[0], err
    assert "SECRET" not in err
