"""The ``stream-st`` command: inspect, ls, show, hash, diff, validate, cp, demo, completion.

Every command takes any source the library reads (a path, ``http(s)://``, ``s3://``, ``hf://``,
``tcp://``, a sharded ``*.index.json``, a model directory, ``-`` for standard input) and works
in constant memory; ``cp`` writes to ``-`` as standard output. Exit status: 0 success
(equal, valid); 1 a difference (``diff``) or failed validation (``validate``); 2 an error (bad
input, unreachable source, bad arguments); 3 an internal error (a bug: the traceback goes to
stderr); 130 interrupted; 141 the output pipe closed early (``| head``), as for a command killed
by SIGPIPE.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import ssl
import stat
import sys
import time
import traceback
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import asdict
from typing import Any, NoReturn

import anyio
import numpy as np

from .. import __version__, tools
from .._api import open_stream
from ..errors import SafetensorsError, TensorNotFoundError, UsageError
from ..transports.file.sink import PipeSink
from ..transports.options import LimitOptions, TransportOptions
from ..transports.registry import SinkLike
from ..transports.s3.config import unsigned_requests
from .demo import print_report, run_demo

EXIT_OK, EXIT_DIFFERENT, EXIT_ERROR, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 130, 141

SOURCES = "files, directories, URLs or - (stdin)"
"""What a command taking several sources takes, for its help."""

PROG = "stream-st"
"""The command's name, as users type it (and as the completion scripts register it)."""

STDIO = "-"
"""The argument that means standard input (a source) or standard output (a destination)."""


class _Bar:
    """A rich progress bar on stderr: bytes, rate, tensors and ETA, its totals set from the
    headers as soon as the command has read them (the ``totals`` of :mod:`stream_st.tools`)."""

    def __init__(self, label: str) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            DownloadColumn(),  # decimal units, as _human and TransferSpeedColumn
            TransferSpeedColumn(),
            TextColumn("{task.fields[tensors]}{task.fields[of]} tensors"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self._task = self._bar.add_task(label, total=None, tensors=0, of="")

    def totals(self, total_bytes: int, total_tensors: int) -> None:
        self._bar.update(self._task, total=total_bytes, of=f"/{total_tensors}")

    def __call__(self, done_bytes: int, done: int) -> None:
        self._bar.update(self._task, completed=done_bytes, tensors=done)

    def __enter__(self) -> _Bar:
        self._bar.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._bar.stop()


class _Lines:
    """Plain progress lines on stderr, at most one a second, for a terminal without rich."""

    INTERVAL = 1.0

    def __init__(self, label: str) -> None:
        self._label = label
        self._of_bytes = self._of_tensors = ""
        self._began = self._shown = time.monotonic()
        self._done = (0, 0)

    def totals(self, total_bytes: int, total_tensors: int) -> None:
        self._of_bytes, self._of_tensors = f" of {_human(total_bytes)}", f"/{total_tensors}"

    def __call__(self, done_bytes: int, done: int) -> None:
        self._done = (done_bytes, done)
        if time.monotonic() - self._shown >= self.INTERVAL:
            self._show()

    def _show(self) -> None:
        self._shown = time.monotonic()
        done_bytes, done = self._done
        rate = done_bytes / max(self._shown - self._began, 1e-9)
        print(
            f"{self._label}: {_human(done_bytes)}{self._of_bytes}, {done}{self._of_tensors} "
            f"tensors, {_human(rate)}/s",
            file=sys.stderr,
            flush=True,
        )

    def __enter__(self) -> _Lines:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if exc_info[0] is None:
            self._show()


@contextmanager
def _progress(label: str, quiet: bool) -> Iterator[tools.Progress | None]:
    """Progress on stderr while a command moves data: a rich bar, or plain lines without rich;
    nothing when quiet or when stderr is not a terminal."""
    if quiet or not sys.stderr.isatty():
        yield None
        return
    try:
        report: _Bar | _Lines = _Bar(label)
    except ImportError:  # the cli extra is not installed
        report = _Lines(label)
    with report:
        yield report


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
    """One JSON record on one line (a stream of them reads with ``jq`` or line by line)."""
    print(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def _human(n: float) -> str:
    """A size in decimal units, as the progress bars show them."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def _source(text: str) -> str:
    """A source argument as the library takes it: ``-`` is standard input."""
    return "/dev/stdin" if text == STDIO else text


def _one_source(text: str) -> str:
    """The one source an argument names (a model directory: its index or its only file)."""
    found = tools.model_sources(_source(text))
    if len(found) > 1:
        raise UsageError(
            f"{text} holds {len(found)} safetensors files and no index: name one of them"
        )
    return found[0]


async def _destination(text: str) -> SinkLike:
    """A destination argument as the library takes it: ``-`` is standard output, written
    through in place, never to a terminal. A pipe is opened anew (a descriptor of its own, set
    non-blocking without touching the one other processes share); anything else (a file
    redirected with ``>`` or ``>>``, a socket) is written through the inherited descriptor, so
    the bytes land at the shell's offset, appended under ``>>``."""
    if text != STDIO:
        return text
    if sys.stdout.isatty():
        raise UsageError("refusing to write safetensors to a terminal: redirect or pipe stdout")
    sys.stdout.flush()
    fd = sys.stdout.fileno()
    if stat.S_ISFIFO(os.fstat(fd).st_mode):
        return await PipeSink.open("/dev/stdout")
    return PipeSink(os.dup(fd), "standard output")


def _failed(source: str, exc: SafetensorsError) -> None:
    """Report one source's error on one line, naming the source where the message does not."""
    text = str(exc)
    named = source in text or (source == "/dev/stdin" and "stdin" in text)
    print(f"stream-st: error: {text if named else f'{source}: {text}'}", file=sys.stderr)


async def _each(args: argparse.Namespace, run: Callable[[str], Awaitable[int]]) -> int:
    """Run ``run`` on every source the arguments name (directories expanded), going on past a
    source that fails; the status is the worst: an error, else a difference, else success."""
    if len(args.sources) > 1 and args.sources.count(STDIO) + args.sources.count("/dev/stdin") > 1:
        raise UsageError("standard input can be read once: name '-' once")
    status = EXIT_OK
    for text in args.sources:
        try:
            sources = tools.model_sources(_source(text))
        except SafetensorsError as exc:
            _failed(text, exc)
            status = EXIT_ERROR
            continue
        for source in sources:
            try:
                found = await run(source)
            except SafetensorsError as exc:
                _failed(source, exc)
                found = EXIT_ERROR
            status = max(status, found)
    return status


async def _inspect(args: argparse.Namespace) -> int:
    async def one(source: str) -> int:
        result = await tools.inspect(source, **_options(args))
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
            width = max(len("name"), *(len(t["name"]) for t in result.tensors))
            print(f"  {'name':<{width}}  {'dtype':<11} {'shape':<22} {'bytes':>12}")
            for t in result.tensors:
                shape = str(t["shape"])
                print(f"  {t['name']:<{width}}  {t['dtype']:<11} {shape:<22} {t['bytes']:>12,}")
        return EXIT_OK

    return await _each(args, one)


async def _ls(args: argparse.Namespace) -> int:
    async def one(source: str) -> int:
        result = await tools.inspect(source, **_options(args))
        for t in result.tensors:
            print(t["name"])
        return EXIT_OK

    return await _each(args, one)


def _index(text: str) -> tuple[int | slice, ...]:
    """A ``--slice`` argument, numpy's basic indexing: ``0:4``, ``1``, ``:,0:2``, ``::2``."""
    index: list[int | slice] = []
    for part in text.split(","):
        try:
            if ":" not in part:
                index.append(int(part))
                continue
            bounds = [int(b) if b.strip() else None for b in part.split(":")]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected numpy-style indices, got {text!r}"
            ) from None
        if len(bounds) > 3:
            raise argparse.ArgumentTypeError(f"expected start:stop[:step], got {part!r}")
        index.append(slice(*bounds))
    return tuple(index)


def _json_values(values: Any) -> Any:
    """Nested lists of plain numbers; NaN and infinities as the strings JSON lacks them as."""
    if isinstance(values, list):
        return [_json_values(v) for v in values]
    if isinstance(values, float) and not math.isfinite(values):
        return str(values)
    return values


def _plain(values: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``values`` in a dtype whose ``tolist`` gives JSON numbers: ml_dtypes' floats (bfloat16,
    float8) as float64, complex numbers as [real, imaginary] pairs."""
    if values.dtype.kind == "c":
        return np.stack([values.real, values.imag], axis=-1)
    if values.dtype.kind == "V":
        return values.astype(np.float64)
    return values


async def _show(args: argparse.Namespace) -> int:
    source = _one_source(args.source)
    try:
        async with open_stream(source, include=[args.name], **_options(args)) as stream:
            async for _, array in stream:
                _show_values(args, array)
    except TensorNotFoundError:
        raise UsageError(
            f"{args.source} has no tensor {args.name!r} (stream-st ls {args.source} lists them)"
        ) from None
    return EXIT_OK


def _show_values(args: argparse.Namespace, array: np.ndarray[Any, Any]) -> None:
    """Print the tensor ``args.name`` (its ``--slice``), numpy-style or as one JSON record."""
    try:
        values = array[args.slice] if args.slice else array
    except (IndexError, TypeError) as exc:
        raise UsageError(f"--slice does not fit shape {list(array.shape)}: {exc}") from None
    if args.json:
        _print_json(
            {
                "name": args.name,
                "dtype": str(array.dtype),
                "shape": list(array.shape),
                "values": _json_values(np.asarray(_plain(values)).tolist()),
            }
        )
    else:
        print(f"{args.name}: {array.dtype} {list(array.shape)}")
        print(np.array2string(np.asarray(values), threshold=200, edgeitems=3))


async def _hash(args: argparse.Namespace) -> int:
    async def one(source: str) -> int:
        with _progress("hashing", args.quiet or not args.content) as progress:
            result = await tools.hash(
                source,
                content=args.content,
                file=args.file,
                progress=progress,
                **_options(args),
            )
        if args.json:
            _print_json(result)
        else:
            print(f"structural {result['structural_hash']}  {source}")
            if "content_hash" in result:
                print(f"content    {result['content_hash']}  {source}")
            if "file_sha256" in result:
                print(f"file       {result['file_sha256']}  {source}")
        return EXIT_OK

    return await _each(args, one)


async def _diff(args: argparse.Namespace) -> int:
    a, b = _one_source(args.a), _one_source(args.b)
    if a == b == "/dev/stdin":
        raise UsageError("standard input can be read once: name '-' once")
    with _progress("comparing", args.quiet or not args.content) as progress:
        result = await tools.diff(a, b, content=args.content, progress=progress, **_options(args))
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
    shapes = _load_shapes(args.expect_shapes)

    async def one(source: str) -> int:
        with _progress("validating", args.quiet) as progress:
            result = await tools.validate(
                source,
                expect_shapes=shapes,
                expect_layers=[p for p in (args.expect_layers or "").split(",") if p],
                warn_abs=args.warn_abs,
                progress=progress,
                **_options(args),
            )
        if args.json:
            _print_json(result.to_json())
        else:
            _print_validation(result)
        return EXIT_OK if result.ok else EXIT_DIFFERENT

    return await _each(args, one)


def _print_validation(result: tools.Validation) -> None:
    """The source, its statistics table and verdict."""
    print(f"{result.source}:")
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
    print(f"digests: {result.digests}")
    print(
        f"{'valid' if result.ok else 'INVALID'}: {len(result.tensors)} tensors, "
        f"{len(result.errors)} errors, {len(result.warnings)} warnings"
    )


def _into_directory(src: str, dst: str) -> str:
    """``cp``'s destination: an existing local directory receives a file of the source's name,
    as coreutils' ``cp`` does; any other destination is taken as it is."""
    if dst == STDIO or "://" in dst or not os.path.isdir(dst):
        return dst
    name = os.path.basename(urllib.parse.urlsplit(src).path if "://" in src else src)
    if not name.endswith(".safetensors") or src == "/dev/stdin":
        raise UsageError(f"{dst} is a directory: name the file to write in it")
    return os.path.join(dst, name)


async def _cp(args: argparse.Namespace) -> int:
    src = _one_source(args.src)
    args.dst = _into_directory(src, args.dst)
    dst = await _destination(args.dst)
    with _progress("copying", args.quiet) as progress:
        copied = await tools.cp(
            src,
            dst,
            include=args.include or None,
            dtype=args.dtype,
            quantize=args.quantize,
            dequantize=args.dequantize,
            checksums=True if args.checksums else None,
            progress=progress,
            **_options(args),
        )
    if not args.quiet:
        header = copied.header
        done = f"copied {len(header)} tensors, {header.file_size:,} bytes to {args.dst}"
        how = "quantized" if args.quantize else "dequantized" if args.dequantize else None
        if how is None and args.dtype:
            how = f"converted to {args.dtype.upper()}"
        if how is not None:
            done += f"; {copied.converted or 'nothing'} {how}"
        print(done, file=sys.stderr)
    return EXIT_OK


async def _demo_command(args: argparse.Namespace) -> int:
    if not args.synthetic:
        return await _model_demo_command(args)
    codecs = tuple(c for c in (args.codecs or "none,int8,int4").split(",") if c)
    layers = 22 if args.layers is None else args.layers
    seq = 2048 if args.seq is None else args.seq
    results = await run_demo(layers, seq, codecs, **_limits(args))
    if args.json:
        _print_json(
            {
                "layers": layers,
                "seq": seq,
                "transfers": [
                    {
                        **{k: v for k, v in asdict(r).items() if k != "start"},  # a clock's
                        "transfer_time": r.transfer_time,
                        "overlap_efficiency": r.overlap_efficiency,
                    }
                    for r in results
                ],
            }
        )
    else:
        print_report(results, layers, seq)
    return EXIT_OK


@contextmanager
def _status(label: str, quiet: bool) -> Iterator[Callable[[str], None]]:
    """Report a long job's stage on stderr: a rich status line on a terminal where rich is
    installed (the ``cli`` extra), else one plain line per stage; nothing when quiet."""
    if quiet:
        yield lambda message: None
        return
    console = None
    with suppress(ImportError):
        from rich.console import Console

        console = Console(stderr=True)
    if console is None or not console.is_terminal:
        yield lambda message: print(f"{label}: {message}", file=sys.stderr)
        return
    with console.status(label) as status:
        yield status.update


async def _model_demo_command(args: argparse.Namespace) -> int:
    from .demo import print_model_report, run_model_demo

    if args.layers is not None or args.seq is not None:
        raise UsageError("--layers and --seq size the synthetic cache: use them with --synthetic")
    text = None
    if args.text is not None:
        try:
            text = await anyio.Path(args.text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise UsageError(f"cannot read --text {args.text}: {detail}") from None
    codecs = tuple(c for c in (args.codecs or "none,f16,int8,int4").split(",") if c)
    with _status("stream-st demo", args.quiet) as progress:
        demo = await run_model_demo(
            text, context=args.context, codecs=codecs, progress=progress, **_limits(args)
        )
    if args.json:
        _print_json(demo.to_json())
    else:
        print_model_report(demo)
    return EXIT_OK


SHELLS = ("bash", "zsh", "fish", "tcsh")
"""The shells ``stream-st completion`` writes a script for (argcomplete's)."""


async def _completion(args: argparse.Namespace) -> int:
    argcomplete = _argcomplete()
    if argcomplete is None:
        raise UsageError("shell completion needs argcomplete: pip install -e '.[cli]'")
    print(argcomplete.shellcode([PROG], shell=args.shell), end="")
    return EXIT_OK


def _argcomplete() -> Any:
    """The argcomplete module (the ``cli`` extra), or None when it is not installed."""
    try:
        import argcomplete
    except ImportError:
        return None
    return argcomplete


def _complete(parser: argparse.ArgumentParser) -> None:
    """Answer the shell's completion request and exit, when this run is one: the scripts of
    ``stream-st completion`` run the command with ``_ARGCOMPLETE`` set, the words typed so far
    in ``COMP_LINE``, and read the candidates back (subcommands, options, choices, paths)."""
    if "_ARGCOMPLETE" not in os.environ:
        return
    argcomplete = _argcomplete()
    if argcomplete is not None:
        argcomplete.autocomplete(parser)  # writes the candidates and exits
    sys.exit(EXIT_ERROR)  # not installed: no candidates


EXAMPLES = {
    "inspect": "stream-st inspect model.safetensors\n"
    "  stream-st inspect *.safetensors\n"
    "  stream-st inspect --json s3://bucket/model.safetensors | jq .tensor_count\n"
    "  stream-st inspect https://host/repo/model.safetensors.index.json\n"
    "  cat model.safetensors | stream-st inspect -",
    "ls": "stream-st ls model.safetensors\n  stream-st ls path/to/model-dir/ | grep q_proj",
    "show": "stream-st show model.safetensors lm_head.weight\n"
    "  stream-st show model.safetensors lm_head.weight --slice 0:2,0:8\n"
    "  stream-st show --json model.safetensors embed.weight --slice 0 | jq .values",
    "hash": "stream-st hash a.safetensors b.safetensors c.safetensors\n"
    "  stream-st hash --content http://host/m.safetensors\n"
    "  stream-st hash --file model.safetensors   # also the sha256sum of the file\n"
    "  stream-st hash --json path/to/model-dir/ | jq -r .structural_hash",
    "diff": "stream-st diff a.safetensors b.safetensors\n"
    "  stream-st diff --content --json a.safetensors s3://bucket/b.safetensors",
    "validate": "stream-st validate model.safetensors\n"
    "  stream-st validate path/to/model-dir/\n"
    "  stream-st validate --expect-shapes shapes.json \\\n"
    "      --expect-layers q_proj,k_proj,v_proj,o_proj model.safetensors",
    "cp": "stream-st cp s3://bucket/model.safetensors model.safetensors\n"
    "  stream-st cp model.safetensors - | ssh host stream-st cp - /dst/model.safetensors\n"
    "  stream-st cp --dtype bf16 model.safetensors http://host/upload/model-bf16.safetensors\n"
    "  stream-st cp --quantize int8 --include lm_head.weight m.safetensors tcp://peer:9000\n"
    "  stream-st cp --dequantize q8.safetensors restored.safetensors\n"
    "  stream-st cp --checksums model.safetensors s3://bucket/model.safetensors\n"
    "  stream-st cp hf://org/repo/model.safetensors models/   # into a directory, as cp",
    "demo": "stream-st demo\n"
    "  stream-st demo -q --text essay.txt --context 512 --json | jq .transfers\n"
    "  stream-st demo --synthetic --layers 4 --seq 512 --codecs none,int4",
    "completion": "stream-st completion bash > ~/.local/share/bash-completion/completions/"
    "stream-st\n  stream-st completion zsh > ~/.zfunc/_stream-st   # fpath=(~/.zfunc $fpath)\n"
    "  stream-st completion fish > ~/.config/fish/completions/stream-st.fish\n"
    '  eval "$(stream-st completion bash)"   # this shell only',
}


class _Parser(argparse.ArgumentParser):
    """Reports a bad command line in one line, exit status 2, like every other error; a
    mistyped subcommand or choice names the nearest one."""

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        choices = action.choices
        if choices is not None and value not in choices:
            names = [str(choice) for choice in choices]
            near = difflib.get_close_matches(str(value), names, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise argparse.ArgumentError(
                action, f"invalid choice: {value!r} ({hint}choose from {', '.join(names)})"
            )

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Read and write safetensors files as streams. Sources: paths, "
        "model directories, http(s)://, s3://, hf://, tcp://, *.index.json, - (stdin).",
        epilog="exit status: 0 success, 1 different/invalid, 2 error, 3 internal error (a bug),\n"
        "  130 interrupted, 141 output pipe closed early",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
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
        if name == "completion":
            return sub
        limits = sub.add_argument_group("time limits (seconds; none by default)")
        limits.add_argument(
            "--timeout", type=float, metavar="SECONDS", help="the longest any one wait may last"
        )
        limits.add_argument(
            "--deadline",
            type=float,
            metavar="SECONDS",
            help="the longest the whole command may take",
        )
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
        "a real model's KV cache streamed over loopback TCP layer by layer, checked by perplexity",
        _demo_command,
    )
    demo.add_argument(
        "--text", metavar="FILE", help="score this UTF-8 text (default: a built-in one)"
    )
    demo.add_argument(
        "--context",
        type=int,
        default=256,
        metavar="TOKENS",
        help="tokens prefilled on the sender (default 256)",
    )
    demo.add_argument(
        "--codecs",
        help="codecs to run, in order (default none,f16,int8,int4; --synthetic: none,int8,int4)",
    )
    demo.add_argument("--json", action="store_true", help="the report as one JSON record")
    demo.add_argument(
        "--synthetic",
        action="store_true",
        help="a TinyLlama-shaped cache of random projections instead of the model",
    )
    demo.add_argument(
        "--layers", type=int, metavar="N", help="--synthetic: number of layers (default 22)"
    )
    demo.add_argument(
        "--seq", type=int, metavar="TOKENS", help="--synthetic: sequence length (default 2048)"
    )

    inspect = command("inspect", "show the header: tensors, sizes, parameters, metadata", _inspect)
    inspect.add_argument("sources", nargs="+", metavar="SOURCE", help=SOURCES)
    inspect.add_argument("--json", action="store_true", help="one JSON record per source")

    listing = command("ls", "list tensor names, one per line", _ls)
    listing.add_argument("sources", nargs="+", metavar="SOURCE", help=SOURCES)

    show = command("show", "print a tensor's values (summarized when big)", _show)
    show.add_argument("source", help="file, directory, URL or - (stdin)")
    show.add_argument("name", help="the tensor's name")
    show.add_argument(
        "--slice", type=_index, metavar="INDEX", help="numpy-style indices, e.g. 0:4 or 1,0:8"
    )
    show.add_argument("--json", action="store_true", help="the values as one JSON record")

    hashing = command("hash", "structural hash of the header; --content hashes the data", _hash)
    hashing.add_argument("sources", nargs="+", metavar="SOURCE", help=SOURCES)
    hashing.add_argument("--content", action="store_true", help="also hash the data, streamed")
    hashing.add_argument(
        "--file", action="store_true", help="also the sha256 of the file's bytes (as sha256sum)"
    )
    hashing.add_argument("--json", action="store_true", help="one JSON record per source")

    differ = command("diff", "compare two files: tensors, metadata; --content the bytes", _diff)
    differ.add_argument("a", metavar="A", help="file, directory, URL or - (stdin)")
    differ.add_argument("b", metavar="B", help="the same, compared with A")
    differ.add_argument("--content", action="store_true", help="also compare common tensors' bytes")
    differ.add_argument("--json", action="store_true", help="the differences as one JSON record")

    check = command("validate", "stream every tensor: statistics, NaN/Inf, expectations", _validate)
    check.add_argument("sources", nargs="+", metavar="SOURCE", help=SOURCES)
    check.add_argument("--json", action="store_true", help="one JSON record per source")
    check.add_argument("--expect-shapes", metavar="JSON", help="file mapping names to shapes")
    check.add_argument(
        "--expect-layers", metavar="PARTS", help="comma-separated parts every layer must have"
    )
    check.add_argument(
        "--warn-abs",
        type=float,
        default=1e4,
        metavar="VALUE",
        help="warn about values beyond this (default 1e4)",
    )

    copy = command("cp", "stream-copy between any source and destination", _cp)
    copy.add_argument("src", help="file, directory, URL or - (stdin)")
    copy.add_argument(
        "dst", help="path, file://, tcp://host:port, http(s):// (PUT), s3://, - (stdout)"
    )
    copy.add_argument(
        "--include", action="append", metavar="NAME", help="copy only this tensor (repeatable)"
    )
    converting = copy.add_mutually_exclusive_group()
    copy.add_argument(
        "--dtype", choices=("bf16", "f16", "f32"), help="convert floating-point tensors"
    )
    converting.add_argument(
        "--quantize", choices=("int8",), help="per-tensor symmetric int8, scales as siblings"
    )
    copy.add_argument(
        "--checksums", action="store_true", help="record each tensor's digest (xxh3-128)"
    )
    converting.add_argument(
        "--dequantize",
        action="store_true",
        help="restore floating-point tensors from int8/int4 codes (to --dtype if given)",
    )

    completion = command(
        "completion", "print a shell completion script (needs argcomplete)", _completion
    )
    completion.add_argument("shell", choices=SHELLS)

    for sub in (hashing, differ, check, copy, demo):
        sub.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    for sub in (inspect, listing, show, hashing, differ, check, copy):
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
    parser = build_parser()
    _complete(parser)
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
