"""docs/cli.md against the command itself: a row for every command, the options of the
commands without the shared options named there, the shared options claimed for exactly the
commands that take them, and the completion example as ``stream-st completion --help`` gives
it."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from stream_st.cli.parser import build_parser

PAGE = (Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text(encoding="utf-8")


def _commands() -> dict[str, argparse.ArgumentParser]:
    """Each subcommand's parser, by name."""
    return _subparsers(build_parser())


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _long_options(parser: argparse.ArgumentParser) -> set[str]:
    """The long options of ``parser`` and of its own subcommands (``cache ls --json``)."""
    options = {
        option
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }
    for sub in _subparsers(parser).values():
        options |= _long_options(sub)
    return options


def _reads_a_checkpoint(parser: argparse.ArgumentParser) -> bool:
    return "--no-sign-request" in parser._option_string_actions


def test_every_command_has_a_row_naming_its_options_where_it_has_no_shared_ones() -> None:
    """A command without the shared options (time limits, ``-q``...: serve, cache, completion)
    has its options named in its row: serve's ``--name`` and the whole ``cache`` command were
    missing from the table."""
    for name, parser in _commands().items():
        rows = [line for line in PAGE.splitlines() if line.startswith(f"| `stream-st {name}")]
        assert rows, f"cli.md has no row for stream-st {name}"
        if "--timeout" not in parser._option_string_actions:
            missing = {option for option in _long_options(parser) if option not in "".join(rows)}
            assert not missing, f"cli.md's row for {name} does not name {sorted(missing)}"


def test_the_shared_options_are_claimed_for_the_commands_that_take_them() -> None:
    """cli.md said every command took any source, ``-q``, ``--no-sign-request``,
    ``--endpoint-url``, ``--region`` and ``--profile``: serve, completion, cache and demo take
    none of them but demo's ``-q``."""
    sentence = re.search(r"Every command that reads a checkpoint \(([^)]*)\) takes any", PAGE)
    assert sentence is not None, "cli.md does not say which commands read any source"
    named = set(re.findall(r"`(\w+)`", sentence[1]))
    assert named == {name for name, parser in _commands().items() if _reads_a_checkpoint(parser)}


def test_the_zsh_completion_example_is_the_command_s_own() -> None:
    epilog = _commands()["completion"].epilog or ""
    ours = re.search(r"stream-st completion zsh >\s+(\S+)", PAGE)
    theirs = re.search(r"stream-st completion zsh >\s+(\S+)", epilog)
    assert ours is not None and theirs is not None
    assert ours[1].strip("`") == theirs[1]
    assert "fpath=(~/.zfunc $fpath)" in PAGE and "fpath=(~/.zfunc $fpath)" in epilog
