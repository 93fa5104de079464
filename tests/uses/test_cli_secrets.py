"""The command never prints a URL's password or a signed query, whatever it prints an address
in: a heading, a hash line, a JSON record, an error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from stream_st.cli import main

from ..servers.http_server import RangeHTTPServer
from ..transports.test_secrets import (
    SECRET,
    BasicAuthServer,
    protected,
    server,
    with_credentials,
)

__all__ = ["protected", "server"]  # the fixtures, used by name below


@pytest.mark.parametrize(
    "command",
    [
        ["inspect"],
        ["inspect", "--json"],
        ["hash"],
        ["hash", "--json"],
        ["hash", "--file"],
        ["hash", "--format", "weight-inspect"],
        ["validate", "-q"],
        ["validate", "--json"],
    ],
)
def test_no_password_in_what_the_command_prints(
    protected: BasicAuthServer, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    url = with_credentials(protected.url("/m.safetensors"))
    assert main([*command, url]) == 0
    out, err = capsys.readouterr()
    assert SECRET not in out + err
    assert "alice:***@" in out
    if "--json" in command:
        json.loads(out)


def test_no_password_in_an_error(
    protected: BasicAuthServer, capsys: pytest.CaptureFixture[str]
) -> None:
    url = with_credentials(protected.url("/missing.safetensors"))
    assert main(["inspect", url]) == 2
    out, err = capsys.readouterr()
    assert SECRET not in out + err and "alice:***@" in err


@pytest.mark.parametrize("flags", [[], ["--json"]])
def test_no_password_in_what_cp_prints(
    protected: BasicAuthServer,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    flags: list[str],
) -> None:
    """A copy's line and record (a mirror's shards too) name the destination without it."""
    one = tmp_path / "one.safetensors"
    one.write_bytes(protected.objects["/m.safetensors"])
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": dict.fromkeys(load_file(one), one.name)}))
    for src, dst in ((one, "/copy.safetensors"), (index, "/mirror/")):
        assert main(["cp", *flags, str(src), with_credentials(protected.url(dst))]) == 0
        out, err = capsys.readouterr()
        assert SECRET not in out + err and "alice:***@" in out + err
        if flags:
            json.loads(out)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["cp", "http://127.0.0.1:9/model.safetensors.index.json?token=T", "{dir}/out.safetensors"],
         "/model.safetensors.index.json?token=*** is a sharded checkpoint: copy it into a "
         "directory or prefix"),
        (["cp", "--merge", "http://127.0.0.1:9/dataset_manifest.json?sig=T", "{dir}/"],
         "/dataset_manifest.json?sig=*** is a manifest: name the file to merge it into"),
        (["cp", "tcp://127.0.0.1:9", "http://127.0.0.1:9/up/?X-Amz-Signature=T"],
         "/up/?X-Amz-Signature=*** is a directory: name the file to write in it "
         "(tcp://127.0.0.1:9 has no name to take)"),
        (["show", "{url}?token=T", "nosuch"],
         "/m.safetensors?token=*** has no tensor 'nosuch' (stream-st ls "),
        (["validate", "--max-tensor-bytes", "10", "{url}?token=T"],
         "/m.safetensors?token=***: tensor 'a' declares 200000 bytes"),
    ],
    ids=["sharded", "manifest", "directory", "no tensor", "validate"],
)  # fmt: skip
def test_an_error_naming_a_signed_address_keeps_its_reason(
    server: RangeHTTPServer,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    args: list[str],
    said: str,
) -> None:
    """An error whose message begins with an address holding a signed parameter (``token=``,
    ``sig=``) said the masked address alone: the reason was masked as the parameter's value
    (``http://h/model.safetensors.index.json?token=***``), or lost its ``:``."""
    url = server.url("/m.safetensors")
    filled = [a.format(dir=tmp_path, url=url).replace("=T", f"={SECRET}") for a in args]
    assert main(filled) == 2
    out, err = capsys.readouterr()
    assert SECRET not in out + err
    assert said in err, err
