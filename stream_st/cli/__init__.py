"""The ``stream-st`` command: the entry point (:mod:`.app`), the command line (:mod:`.parser`),
what each subcommand does (:mod:`.commands`), what it prints (:mod:`.output`), its exit statuses
(:mod:`.exits`), its network options (:mod:`.options`), and the demo (:mod:`.demo`).

This module imports none of them but :mod:`.exits` until :func:`main` runs, so that an
interrupt (Ctrl-C) while they load ends the command as one during its work does, not with a
traceback."""

from __future__ import annotations

from .exits import interrupted

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``stream-st`` command (``argv``: its arguments, else the process's);
    returns the exit status."""
    try:
        from .app import main as run
    except KeyboardInterrupt:
        return interrupted()
    except RuntimeError as exc:  # Python 3.11 wraps one raised in a class's __set_name__
        if isinstance(exc.__cause__, KeyboardInterrupt):
            return interrupted()
        raise
    return run(argv)
