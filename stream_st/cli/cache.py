"""``stream-st cache ls|rm|prune`` and the ``--cache`` option of ``inspect``, ``validate`` and
``cp`` (see ``docs/cache.md``)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from .._api import using_cache
from ..errors import SafetensorsError, UsageError
from ..transports.cache import Cache
from .exits import EXIT_DIFFERENT, EXIT_OK
from .options import directory_arg, size_arg
from .output import PROG, human, print_json, shown

if TYPE_CHECKING:
    from ..transports.cache.manage import Entry

__all__ = ["add_cache_command", "add_cache_option"]

Handler = Callable[[argparse.Namespace], Awaitable[int]]


def _cache_of(args: argparse.Namespace) -> Cache:
    env: dict[str, str] = dict(os.environ)
    if getattr(args, "max_size", None) is not None:  # the option's cap, not the environment's
        env.pop("STREAM_ST_CACHE_MAX", None)
    directory = getattr(args, "dir", None)
    return Cache.default(env) if directory is None else Cache.at(directory, env)


def add_cache_option(sub: argparse.ArgumentParser) -> None:
    """``--cache``, ``--cache-dir DIR`` and ``--offline`` on ``sub``, whose handler then reads
    remote sources through the cache."""
    group = sub.add_argument_group("local copies of remote sources (see stream-st cache)")
    group.add_argument(
        "--cache",
        action="store_true",
        help="keep a verified local copy of a remote source, and read it next time after one "
        "conditional request (STREAM_ST_CACHE, HF_HUB_CACHE)",
    )
    group.add_argument(
        "--cache-dir",
        metavar="DIR",
        type=directory_arg,
        help="as --cache, with the copies in DIR",
    )
    group.add_argument(
        "--offline",
        action="store_true",
        help="as --cache, with no request at all: only the copies (as HF_HUB_OFFLINE=1)",
    )
    handler: Handler = sub.get_default("handler")

    async def cached(args: argparse.Namespace) -> int:
        chosen: Cache | None = None
        if args.cache or args.cache_dir is not None or args.offline:
            chosen = Cache.default() if args.cache_dir is None else Cache.at(args.cache_dir)
            if args.offline:
                chosen = dataclasses.replace(chosen, offline=True)
        with using_cache(chosen):
            return await handler(args)

    sub.set_defaults(handler=cached)


def _pattern(text: str) -> re.Pattern[str]:
    """``cache rm``'s ``PATTERN``: ``*`` any characters, ``?`` one, every other character
    itself (a ``[`` too: an IPv6 host, ``a[1].safetensors``), so that an address as ``cache ls``
    lists it matches itself."""
    parts = (".*" if c == "*" else "." if c == "?" else re.escape(c) for c in text)
    return re.compile("".join(parts), re.DOTALL)


def _age(seconds: float) -> str:
    ago = max(0.0, time.time() - seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if ago >= size:
            return f"{ago / size:.0f}{unit} ago"
    return f"{ago:.0f}s ago"


async def run_cache(args: argparse.Namespace) -> int:
    cache = _cache_of(args)
    if cache.directory.exists() and not cache.directory.is_dir():  # not an empty cache
        raise UsageError(f"cannot use the cache in {cache.directory}: not a directory")
    if getattr(args, "dir", None) is not None and not cache.directory.exists():
        # the cache named must be there (a mistyped --dir listed 0 copies); the default one,
        # never used yet, is empty
        raise UsageError(f"--dir {cache.directory}: no such directory")
    try:
        return _run_cache(args, cache)
    except OSError as exc:
        if isinstance(exc, SafetensorsError):
            raise
        raise UsageError(
            f"cannot use the cache in {cache.directory} ({exc.strerror or exc}: {exc.filename})"
        ) from exc


def _said(removed: list[Entry], busy: list[Entry]) -> int:
    """Print what ``cache rm`` or ``cache prune`` removed and the copies it left (``busy``:
    another process is writing them); the exit status: 1 where one was left."""
    for entry in removed:
        print(f"removed {shown(entry.shown)} ({human(entry.size)})")
    for entry in busy:
        print(f"left {shown(entry.shown)}: another process is writing it")
    return EXIT_DIFFERENT if busy else EXIT_OK


def _run_cache(args: argparse.Namespace, cache: Cache) -> int:
    from ..transports.cache.manage import entries, prune, remove

    if args.action == "ls":
        found = entries(cache)
        if args.json:
            for entry in found:
                print_json(
                    {
                        "address": entry.shown,
                        "size": entry.size,
                        "last_used": entry.last_used,
                        "complete": entry.complete,
                        "leftover": entry.leftover,
                        "writing": entry.writing,
                    }
                )
            return EXIT_OK
        width = max([len("address"), *(len(shown(e.shown)) for e in found)])
        print(f"{'address':<{width}}  {'size':>9}  {'last used':>10}  state")
        for entry in reversed(found):
            state = (
                "complete"
                if entry.complete
                else "leftover"
                if entry.leftover
                else "writing"
                if entry.writing
                else "partial"
            )
            used = _age(entry.last_used)
            print(f"{shown(entry.shown):<{width}}  {human(entry.size):>9}  {used:>10}  {state}")
        total = sum(e.size for e in found)
        print(f"{len(found)} copies, {human(total)} in {cache.directory} and {cache.hub_directory}")
        return EXIT_OK
    if args.action == "rm":
        if not args.patterns and not args.all:
            raise UsageError("name the addresses to remove (patterns, as * and ?) or give --all")
        patterns = [_pattern(p) for p in args.patterns]
        chosen = [  # an address as it is, or as ls shows it (a backslash doubled, escapes)
            e
            for e in entries(cache)
            if args.all
            or any(p.fullmatch(e.shown) or p.fullmatch(shown(e.shown)) for p in patterns)
        ]
        if not chosen:
            what = (
                "the cache holds no copy"
                if args.all
                else "no copy matches " + " or ".join(repr(p) for p in args.patterns)
            )
            print(
                f"{PROG}: {what} (in {cache.directory}; {PROG} cache ls lists them)",
                file=sys.stderr,
            )
            return EXIT_DIFFERENT
        busy = [e for e in chosen if not remove(e)]
        return _said([e for e in chosen if e not in busy], busy)
    cap = cache.max_size if args.max_size is None else args.max_size
    if cap is None:
        raise UsageError("give --max-size SIZE (or set STREAM_ST_CACHE_MAX)")
    left: list[Entry] = []
    removed = prune(cache, cap, left=left)
    status = _said(removed, left)
    print(f"removed {len(removed)} copies, {human(sum(e.size for e in removed))}")
    return status


def add_cache_command(commands: Any) -> argparse.ArgumentParser:
    """The ``cache`` subcommand, on ``commands`` (the parser's subparsers): ``ls``, ``rm`` and
    ``prune``, each a command of its own, so that its options go before or after its
    arguments (``cache rm --dir DIR PATTERN``)."""
    sub: argparse.ArgumentParser = commands.add_parser(
        "cache",
        help="list, remove and prune the local copies kept by --cache",
        description="list, remove and prune the local copies kept by --cache (copies of "
        "http(s):// and s3:// objects in STREAM_ST_CACHE, hf:// files stream_st kept in the "
        "Hugging Face cache)",
        epilog="examples:\n  stream-st cache ls\n  stream-st cache rm 'hf://org/model@*'\n"
        "  stream-st cache prune --max-size 50G",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub.set_defaults(handler=run_cache)
    where = "the cache given to --cache-dir DIR"
    sub.add_argument("--dir", "--cache-dir", metavar="DIR", type=directory_arg, help=where)
    actions = sub.add_subparsers(dest="action", metavar="{ls,rm,prune}", required=True)
    listing = actions.add_parser("ls", help="list the copies")
    listing.add_argument("--json", action="store_true", help="one JSON record per copy")
    removing = actions.add_parser("rm", help="remove copies by address")
    removing.add_argument("patterns", nargs="*", metavar="PATTERN", help="addresses (* and ?)")
    removing.add_argument("--all", action="store_true", help="every copy")
    pruning = actions.add_parser("prune", help="remove the least recently used copies")
    pruning.add_argument(
        "--max-size", metavar="SIZE", type=size_arg, help="keep at most SIZE (50G)"
    )
    for action in (listing, removing, pruning):  # after the action too; else the cache's
        action.add_argument(
            "--dir",
            "--cache-dir",
            metavar="DIR",
            type=directory_arg,
            default=argparse.SUPPRESS,
            help=where,
        )
    return sub
