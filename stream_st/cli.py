"""The ``stream-st`` command: demo, inspect, hash, diff, validate, cp.

Every command takes any source the library reads (a path, ``http(s)://``, ``s3://``, ``hf://``,
``tcp://``, a sharded ``*.index.json``) and works in constant memory. Exit status: 0 success
(equal, valid); 1 a difference (``diff``) or failed validation (``validate``); 2 an error (bad
input, unreachable source, bad arguments); 3 an internal error (a bug: the traceback goes to
stderr); 130 interrupted; 141 the output pipe closed early (``| head``), as for a command killed
by SIGPIPE.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import stat
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, NoReturn

import anyio

from . import tools
from ._limits import LimitOptions, TransportOptions
from ._s3 import unsigned_requests
from .demo import print_report, run_demo
from .errors import SafetensorsError, UsageError
from .sources import path_from_url

if TYPE_CHECKING:
    from rich.console import Console

EXIT_OK, EXIT_DIFFERENT, EXIT_ERROR, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 130, 141


@contextmanager
def _progress(
    label: str, total_bytes: int | None, total_tensors: int | None, quiet: bool
) -> Iterator[tools.Progress | None]:
    """A rich progress bar on stderr (bytes, rate, tensors, ETA), or nothing when quiet or when
    stderr is not a terminal."""
    from rich.console import Console

    console = Console(stderr=True)
    if not _bar_shown(quiet, console):
        yield None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TextColumn(
            "{task.fields[tensors]}"
            + ("" if total_tensors is None else f"/{total_tensors}")
            + " tensors"
        ),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(label, total=total_bytes, tensors=0)

        def update(done_bytes: int, done: int) -> None:
            bar.update(task, completed=done_bytes, tensors=done)

        yield update


def _limits(args: argparse.Namespace) -> LimitOptions:
    """The time limits given on the command line (each checked where it is used)."""
    return LimitOptions(
        timeout=args.timeout,
        deadline=args.deadline,
        speed_limit=args.speed_limit,
        speed_time=args.speed_time,
    )


def _options(args: argparse.Namespace) -> TransportOptions:
    """The time limits, ``--header`` lines and ``--ca-bundle`` given on the command line."""
    return TransportOptions(
        **_limits(args), headers=dict(args.header or ()), ssl_context=args.ca_bundle
    )


def _header_line(text: str) -> tuple[str, str]:
    """A ``--header 'Name: value'`` argument as (name, value); checked again where it is used."""
    name, colon, value = text.partition(":")
    if not colon or not name.strip():
        raise argparse.ArgumentTypeError(f"expected 'Name: value', got {text!r}")
    return name.strip(), value.strip()


def _ca_bundle(path: str) -> ssl.SSLContext:
    """An SSL context trusting the certificates in the PEM file ``path`` (and no others)."""
    try:
        return ssl.create_default_context(cafile=path)
    except (OSError, ssl.SSLError) as exc:
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise argparse.ArgumentTypeError(f"cannot use {path!r} as a CA bundle: {detail}") from None


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, ensure_ascii=False))


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


async def _inspect(args: argparse.Namespace) -> int:
    result = await tools.inspect(args.source, **_options(args))
    if args.json:
        _print_json(result.to_json())
        return EXIT_OK
    print(f"{result.source}")
    shards = f" in {result.shards} shards" if result.shards > 1 else ""
    print(
        f"  {result.tensor_count} tensors{shards}, {result.parameter_count:,} parameters, "
        f"{_human(result.data_bytes)} of data, header {_human(result.header_bytes)}"
    )
    if result.metadata:
        print("  metadata:")
        for key, value in result.metadata.items():
            print(f"    {key}: {value}")
    if result.tensors:
        width = max(len(t["name"]) for t in result.tensors)
        print(f"  {'name':<{width}}  {'dtype':<11} {'shape':<22} {'bytes':>12}")
        for t in result.tensors:
            shape = str(t["shape"])
            print(f"  {t['name']:<{width}}  {t['dtype']:<11} {shape:<22} {t['bytes']:>12,}")
    return EXIT_OK


def _bar_shown(quiet: bool, console: Console | None = None) -> bool:
    """Whether a progress bar is drawn: not when quiet or when stderr is not a terminal."""
    if quiet:
        return False
    from rich.console import Console

    return (console or Console(stderr=True)).is_terminal


def _read_once(source: str) -> bool:
    """Whether ``source`` gives its bytes only once: a tcp:// peer sends its message once, a
    pipe, FIFO or device (``/dev/stdin``) hands each byte to one reader."""
    if source.lower().startswith("tcp://"):
        return True
    if "://" in source and not source.lower().startswith("file://"):
        return False
    try:
        path = path_from_url(source) if "://" in source else source
        return not stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError, SafetensorsError):
        return False  # the command itself reports it


async def _totals(
    sources: Sequence[str], limits: TransportOptions, quiet: bool
) -> tuple[int | None, int | None, TransportOptions]:
    """Bytes and tensors to expect from ``sources``, for the progress bar, and the limits left
    for the command itself: the look-up counts against its deadline.

    Nothing is looked up when no bar is drawn, and the totals are unknown when a source gives
    its bytes only once (the look-up would take the header the command then reads).
    """
    if not _bar_shown(quiet) or any(_read_once(source) for source in sources):
        return None, None, limits
    began = time.monotonic()
    total = count = 0
    for source in sources:
        found = await tools.inspect(source, **limits)
        total, count = total + found.data_bytes, count + found.tensor_count
    deadline = limits.get("deadline")
    if isinstance(deadline, float) and deadline > 0:  # a bad value is reported where it is used
        limits = {**limits, "deadline": max(0.0, deadline - (time.monotonic() - began))}
    return total, count, limits


async def _hash(args: argparse.Namespace) -> int:
    total, count, limits = await _totals(
        [args.source] if args.content else [], _options(args), args.quiet
    )
    with _progress("hashing", total, count, args.quiet) as progress:
        result = await tools.hash(args.source, content=args.content, progress=progress, **limits)
    if args.json:
        _print_json(result)
    else:
        print(f"structural {result['structural_hash']}  {args.source}")
        if "content_hash" in result:
            print(f"content    {result['content_hash']}  {args.source}")
    return EXIT_OK


async def _diff(args: argparse.Namespace) -> int:
    sources = [args.a, args.b] if args.content else []
    total, count, limits = await _totals(sources, _options(args), args.quiet)
    with _progress("comparing", total, count, args.quiet) as progress:
        result = await tools.diff(args.a, args.b, content=args.content, progress=progress, **limits)
    if args.json:
        _print_json(result.to_json())
    else:
        for name in result.added:
            print(f"+ {name}")
        for name in result.removed:
            print(f"- {name}")
        for name, changes in result.changed.items():
            detail = ", ".join(f"{key} {a} -> {b}" for key, (a, b) in changes.items())
            print(f"~ {name}: {detail}")
        for key in result.metadata_added:
            print(f"+ metadata {key}")
        for key in result.metadata_removed:
            print(f"- metadata {key}")
        for key, (a, b) in result.metadata_changed.items():
            print(f"~ metadata {key}: {a!r} -> {b!r}")
        for name in result.content_differs:
            print(f"~ {name}: content differs")
        if result.equal:
            compared = " (content compared)" if result.content_compared else ""
            print(f"equal{compared}")
    return EXIT_OK if result.equal else EXIT_DIFFERENT


def _load_shapes(path: str | None) -> dict[str, list[int]] | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            shapes = json.load(f)
    except (OSError, ValueError) as exc:
        raise SafetensorsError(f"cannot read expected shapes from {path}: {exc}") from None
    if not isinstance(shapes, dict) or not all(
        isinstance(v, list) and all(isinstance(d, int) for d in v) for v in shapes.values()
    ):
        raise SafetensorsError(f"{path} must map tensor names to shapes (lists of integers)")
    return shapes


async def _validate(args: argparse.Namespace) -> int:
    total, count, limits = await _totals([args.source], _options(args), args.quiet)
    with _progress("validating", total, count, args.quiet) as progress:
        result = await tools.validate(
            args.source,
            expect_shapes=_load_shapes(args.expect_shapes),
            expect_layers=[p for p in (args.expect_layers or "").split(",") if p],
            warn_abs=args.warn_abs,
            progress=progress,
            **limits,
        )
    if args.json:
        _print_json(result.to_json())
    else:
        width = max((len(t.name) for t in result.tensors), default=4)
        print(
            f"{'name':<{width}}  {'dtype':<8} {'min':>11} {'max':>11} {'mean':>11} "
            f"{'std':>11} {'nan':>6} {'inf':>6}"
        )

        def cell(value: float | None) -> str:
            return f"{value:>11.4g}" if value is not None else f"{'-':>11}"

        for t in result.tensors:
            print(
                f"{t.name:<{width}}  {t.dtype:<8} {cell(t.min)} {cell(t.max)} {cell(t.mean)} "
                f"{cell(t.std)} {t.nan:>6} {t.inf:>6}"
            )
        for warning in result.warnings:
            print(f"warning: {warning}")
        for error in result.errors:
            print(f"error: {error}")
        print(
            f"{'valid' if result.ok else 'INVALID'}: {len(result.tensors)} tensors, "
            f"{len(result.errors)} errors, {len(result.warnings)} warnings"
        )
    return EXIT_OK if result.ok else EXIT_DIFFERENT


async def _cp(args: argparse.Namespace) -> int:
    total, count, limits = await _totals([args.src], _options(args), args.quiet)
    with _progress("copying", total, count, args.quiet) as progress:
        header = await tools.cp(
            args.src,
            args.dst,
            include=args.include or None,
            dtype=args.dtype,
            quantize=args.quantize,
            progress=progress,
            **limits,
        )
    if not args.quiet:
        print(
            f"copied {len(header)} tensors, {header.file_size:,} bytes to {args.dst}",
            file=sys.stderr,
        )
    return EXIT_OK


async def _demo_command(args: argparse.Namespace) -> int:
    if not args.synthetic:
        return await _model_demo_command(args)
    codecs = tuple(c for c in (args.codecs or "none,int8,int4").split(",") if c)
    layers = 22 if args.layers is None else args.layers
    seq = 2048 if args.seq is None else args.seq
    results = await run_demo(layers, seq, codecs, **_limits(args))
    print_report(results, layers, seq)
    return EXIT_OK


async def _model_demo_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .demo import print_model_report, run_model_demo

    if args.layers is not None or args.seq is not None:
        raise UsageError("--layers and --seq size the synthetic cache: use them with --synthetic")
    text = None
    if args.text is not None:
        try:
            text = await anyio.Path(args.text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"cannot read --text {args.text}: {exc}") from None
    codecs = tuple(c for c in (args.codecs or "none,f16,int8,int4").split(",") if c)
    console = Console(stderr=True)
    with console.status("stream-st demo") if console.is_terminal else nullcontext() as status:

        def progress(message: str) -> None:
            if status is None:
                print(f"stream-st demo: {message}", file=sys.stderr)
            else:
                status.update(message)

        demo = await run_model_demo(
            text, context=args.context, codecs=codecs, progress=progress, **_limits(args)
        )
    if args.json:
        print(json.dumps(demo.to_json(), indent=2))
    else:
        print_model_report(demo)
    return EXIT_OK


EXAMPLES = {
    "inspect": "stream-st inspect model.safetensors\n"
    "  stream-st inspect --json s3://bucket/model.safetensors\n"
    "  stream-st inspect https://host/repo/model.safetensors.index.json",
    "hash": "stream-st hash model.safetensors\n  stream-st hash --content http://host/m.safetensors",
    "diff": "stream-st diff a.safetensors b.safetensors\n"
    "  stream-st diff --content --json a.safetensors s3://bucket/b.safetensors",
    "validate": "stream-st validate model.safetensors\n"
    "  stream-st validate --expect-shapes shapes.json \\\n"
    "      --expect-layers q_proj,k_proj,v_proj,o_proj model.safetensors",
    "cp": "stream-st cp s3://bucket/model.safetensors model.safetensors\n"
    "  stream-st cp --dtype bf16 model.safetensors http://host/upload/model-bf16.safetensors\n"
    "  stream-st cp --quantize int8 --include lm_head.weight m.safetensors tcp://peer:9000",
    "demo": "stream-st demo\n  stream-st demo --text essay.txt --context 512 --json\n"
    "  stream-st demo --synthetic --layers 4 --seq 512 --codecs none,int4",
}


class _Parser(argparse.ArgumentParser):
    """Reports a bad command line in one line, exit status 2, like every other error."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="stream-st",
        description="Read and write safetensors files as streams. "
        "Sources: paths, http(s)://, s3://, hf://, tcp://, *.index.json.",
        epilog="exit status: 0 success, 1 different/invalid, 2 error, 3 internal error (a bug),\n"
        "  130 interrupted, 141 output pipe closed early",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(
        name: str, help_text: str, handler: Callable[[argparse.Namespace], Any]
    ) -> argparse.ArgumentParser:
        sub = commands.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog="examples:\n  " + EXAMPLES[name],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sub.set_defaults(handler=handler)
        limits = sub.add_argument_group("time limits (seconds; none by default)")
        limits.add_argument("--timeout", type=float, help="the longest any one wait may last")
        limits.add_argument("--deadline", type=float, help="the longest the whole command may take")
        limits.add_argument(
            "--speed-limit",
            type=float,
            metavar="BYTES",
            help="fail a transfer slower than BYTES/s for --speed-time seconds (as curl)",
        )
        limits.add_argument(
            "--speed-time",
            type=float,
            metavar="SECONDS",
            help="seconds of waiting over which --speed-limit applies (default 30)",
        )
        return sub

    demo = command(
        "demo",
        "a real model's KV cache streamed over loopback TCP layer by layer, checked by "
        "perplexity (default)",
        _demo_command,
    )
    demo.add_argument(
        "--text", metavar="FILE", help="score this UTF-8 text (default: a built-in one)"
    )
    demo.add_argument(
        "--context", type=int, default=256, help="tokens prefilled on the sender (default 256)"
    )
    demo.add_argument(
        "--codecs",
        help="codecs to run, in order (default none,f16,int8,int4; --synthetic: none,int8,int4)",
    )
    demo.add_argument("--json", action="store_true", help="machine-readable output")
    demo.add_argument(
        "--synthetic",
        action="store_true",
        help="a TinyLlama-shaped cache of random projections instead of the model",
    )
    demo.add_argument("--layers", type=int, help="--synthetic: number of layers (default 22)")
    demo.add_argument("--seq", type=int, help="--synthetic: sequence length (default 2048)")

    inspect = command("inspect", "show the header: tensors, sizes, parameters, metadata", _inspect)
    inspect.add_argument("source")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")

    hashing = command("hash", "structural hash of the header; --content hashes the data", _hash)
    hashing.add_argument("source")
    hashing.add_argument("--content", action="store_true", help="also hash the data, streamed")

    differ = command("diff", "compare two files: tensors, metadata; --content the bytes", _diff)
    differ.add_argument("a")
    differ.add_argument("b")
    differ.add_argument("--content", action="store_true", help="also compare common tensors' bytes")

    check = command("validate", "stream every tensor: statistics, NaN/Inf, expectations", _validate)
    check.add_argument("source")
    check.add_argument("--expect-shapes", metavar="JSON", help="file mapping names to shapes")
    check.add_argument(
        "--expect-layers", metavar="PARTS", help="comma-separated parts every layer must have"
    )
    check.add_argument(
        "--warn-abs", type=float, default=1e4, help="warn about values beyond this (1e4)"
    )

    copy = command("cp", "stream-copy between any source and destination", _cp)
    copy.add_argument("src")
    copy.add_argument("dst", help="path, file://, tcp://host:port, http(s):// (PUT), s3://")
    copy.add_argument(
        "--include", action="append", metavar="NAME", help="copy only this tensor (repeatable)"
    )
    copy.add_argument(
        "--dtype", choices=("bf16", "f16", "f32"), help="convert floating-point tensors"
    )
    copy.add_argument(
        "--quantize", choices=("int8",), help="per-tensor symmetric int8, scales as siblings"
    )

    for sub in (hashing, differ, check):
        sub.add_argument("--json", action="store_true", help="machine-readable output")
    for sub in (hashing, differ, check, copy):
        sub.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    for sub in (inspect, hashing, differ, check, copy):
        remote = sub.add_argument_group("remote sources and destinations")
        remote.add_argument(
            "-H",
            "--header",
            action="append",
            type=_header_line,
            metavar="'NAME: VALUE'",
            help="send this header with every HTTP or S3 request (repeatable)",
        )
        remote.add_argument(
            "--ca-bundle",
            type=_ca_bundle,
            metavar="FILE",
            help="trust the CA certificates in this PEM file for https (instead of the system's)",
        )
        remote.add_argument(
            "--no-sign-request",
            action="store_true",
            help="send s3:// requests unsigned (public buckets), as AWS_NO_SIGN_REQUEST=1",
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``stream-st`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.command is None:
        args = build_parser().parse_args(["demo"])
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
