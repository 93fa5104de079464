"""The command never prints a URL's password or a signed query, whatever it prints an address
in: a heading, a hash line, a JSON record, an error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from stream_st.cli import main

from ..transports.test_secrets import SECRET, BasicAuthServer, protected, with_credentials

__all__ = ["protected"]  # the fixture, used by name below


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
