"""The ``stream-st`` command: argument parsing and the subcommands (:mod:`.commands`), the demo
(:mod:`.demo`)."""

from .commands import main

__all__ = ["main"]
