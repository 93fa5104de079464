"""The entry point of the ``stream-st`` command: parse, run the subcommand, map errors to exit
statuses.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence
from contextlib import nullcontext

import anyio

from ..errors import SafetensorsError
from ..transports.s3.config import unsigned_requests
from .output import EXIT_BROKEN_PIPE, EXIT_ERROR, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK
from .parser import build_parser, complete

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``stream-st`` command; returns the exit status."""
    parser = build_parser()
    complete(parser)
    args = parser.parse_args(argv)
    if args.command is None:  # a bare command shows what it can do
        parser.print_help()
        return EXIT_OK
    signing = unsigned_requests() if getattr(args, "no_sign_request", False) else nullcontext()
    try:
        with signing:
            status: int = anyio.run(args.handler, args)
        sys.stdout.flush()  # a closed pipe shows here, not in the flush at interpreter exit
    except SafetensorsError as exc:
        print(f"stream-st: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:
        # The reader went away (``| head``): stop quietly. As the Python docs recommend, point
        # stdout at devnull so the flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print("stream-st: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception:
        traceback.print_exc()
        print(
            "stream-st: internal error (a bug, please report it with the traceback above)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL
    return status
