"""The ``stream-st`` command: the entry point (:mod:`.app`), the command line (:mod:`.parser`),
what each subcommand does (:mod:`.commands`), what it prints (:mod:`.output`), its network
options (:mod:`.options`), and the demo (:mod:`.demo`)."""

from .app import main

__all__ = ["main"]
