"""The command line: every subcommand, its arguments, examples and shell completion."""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from .._util import package_version
from ..transports.options import checked_number
from .commands import (
    argcomplete_module,
    parse_index,
    run_completion,
    run_cp,
    run_demo_command,
    run_diff,
    run_hash,
    run_inspect,
    run_ls,
    run_serve,
    run_show,
    run_validate,
)
from .exits import EXIT_ERROR
from .options import (
    ca_bundle,
    comma_list,
    endpoint_arg,
    header_line,
    host_arg,
    limit_arg,
    name_arg,
    number_arg,
    port_arg,
    profile_arg,
    region_arg,
    size_arg,
    token_arg,
)
from .output import PROG

__all__ = ["EXAMPLES", "SHELLS", "SOURCES", "build_parser"]


SOURCES = "files, directories, URLs or - (stdin)"
"""What a command taking several sources takes, for its help."""


SHELLS = ("bash", "zsh", "fish", "tcsh")
"""The shells ``stream-st completion`` writes a script for (argcomplete's)."""


def complete(parser: argparse.ArgumentParser) -> None:
    """Answer the shell's completion request and exit, when this run is one: the scripts of
    ``stream-st completion`` run the command with ``_ARGCOMPLETE`` set, the words typed so far
    in ``COMP_LINE``, and read the candidates back (subcommands, options, choices, paths)."""
    if "_ARGCOMPLETE" not in os.environ:
        return
    argcomplete = argcomplete_module()
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
    "  stream-st hash --file model.safetensors > model.sha256   # sha256sum's line\n"
    "  stream-st hash --check model.sha256   # as sha256sum -c\n"
    "  stream-st hash --format weight-inspect model.safetensors\n"
    "  cat model.safetensors | stream-st hash --file -\n"
    "  stream-st hash --json path/to/model-dir/ | jq -r .structural_hash",
    "diff": "stream-st diff a.safetensors b.safetensors\n"
    "  stream-st diff --content --json a.safetensors s3://bucket/b.safetensors",
    "validate": "stream-st validate model.safetensors\n"
    "  stream-st validate --config config.json --stats model.safetensors\n"
    "  stream-st validate path/to/model-dir/\n"
    "  stream-st validate --expect-shapes shapes.json \\\n"
    "      --expect-layers q_proj,k_proj,v_proj,o_proj model.safetensors",
    "cp": "stream-st cp s3://bucket/model.safetensors model.safetensors\n"
    "  stream-st cp --endpoint-url http://localhost:9000 m.safetensors s3://bucket/m.safetensors\n"
    "  stream-st cp model.safetensors - | ssh host stream-st cp - /dst/model.safetensors\n"
    "  stream-st cp --dtype bf16 model.safetensors http://host/upload/model-bf16.safetensors\n"
    "  stream-st cp --quantize int8 --include lm_head.weight m.safetensors tcp://peer:9000\n"
    "  stream-st cp --dequantize q8.safetensors restored.safetensors\n"
    "  stream-st cp --checksums model.safetensors s3://bucket/model.safetensors\n"
    "  stream-st cp hf://org/repo/model.safetensors models/   # into a directory, as cp\n"
    "  stream-st cp m.safetensors s3://bucket/models/   # s3://bucket/models/m.safetensors\n"
    "  stream-st cp path/to/sharded-model/ s3://bucket/model/   # every shard, the index last\n"
    "  stream-st cp --merge model.safetensors.index.json merged.safetensors",
    "serve": "stream-st serve model.safetensors   # http://127.0.0.1:8000/model.safetensors\n"
    "  stream-st serve --host 0.0.0.0 --port 9000 path/to/sharded-model/\n"
    "  stream-st serve --port 0 --checksums model.safetensors   # any free port, digests added\n"
    "  stream-st serve model.safetensors   # with $STREAM_ST_SERVE_TOKEN set: a bearer token",
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
        "  130 interrupted, 143/129 stopped by SIGTERM/SIGHUP (cleaned up as for\n"
        "  SIGINT), 141 output pipe closed early",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
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
        if name in ("completion", "serve"):
            return sub
        limits = sub.add_argument_group(
            "time limits (seconds; --timeout 30 for each transfer by default, others none)"
            if name == "demo"
            else "time limits (seconds; none by default)"
        )
        limits.add_argument(
            "--timeout",
            type=limit_arg("timeout"),
            metavar="SECONDS",
            help="the longest any one wait may last",
        )
        limits.add_argument(
            "--deadline",
            type=limit_arg("deadline"),
            metavar="SECONDS",
            help="the longest the whole command may take",
        )
        limits.add_argument(
            "--speed-limit",
            type=limit_arg("speed_limit"),
            metavar="BYTES",
            help="fail a transfer slower than BYTES/s for --speed-time seconds (as curl)",
        )
        limits.add_argument(
            "--speed-time",
            type=limit_arg("speed_time"),
            metavar="SECONDS",
            help="seconds of waiting over which --speed-limit applies (default 30)",
        )
        if name == "demo":  # it reads no source: what it receives it sends itself
            return sub
        caps = sub.add_argument_group("allocation caps (none by default)")
        caps.add_argument(
            "--max-tensor-bytes",
            type=size_arg,
            metavar="SIZE",
            help="refuse a tensor declaring more than SIZE bytes (e.g. 4G), before allocating it",
        )
        caps.add_argument(
            "--max-total-bytes",
            type=size_arg,
            metavar="SIZE",
            help="refuse a read whose tensors declare more than SIZE bytes in all",
        )
        return sub

    demo = command(
        "demo",
        "a real model's KV cache streamed over loopback TCP layer by layer, checked by perplexity",
        run_demo_command,
    )
    demo.add_argument(
        "--text", metavar="FILE", help="score this UTF-8 text (default: a built-in one)"
    )
    demo.add_argument(
        "--context",
        type=int,
        metavar="TOKENS",
        help="tokens prefilled on the sender (default 256, fewer for a short --text so that "
        "at least 64 tokens are scored)",
    )
    demo.add_argument(
        "--codecs",
        type=comma_list,
        help="codecs to run, in order (default none,f16,int8,int4; --synthetic: none,int8,int4)",
    )
    demo.add_argument("--json", action="store_true", help="the report as one JSON record")
    demo.add_argument(
        "--synthetic",
        action="store_true",
        help="a TinyLlama-shaped cache of random projections instead of the model",
    )
    demo.add_argument(
        "--layers",
        type=int,
        metavar="N",
        help="--synthetic: number of layers (default 22, at most 1024)",
    )
    demo.add_argument(
        "--seq",
        type=int,
        metavar="TOKENS",
        help="--synthetic: sequence length (default 2048; layers x seq x 1 KiB at most 1 GiB)",
    )

    inspect = command(
        "inspect", "show the header: tensors, sizes, parameters, metadata", run_inspect
    )
    inspect.add_argument("sources", nargs="+", metavar="SOURCE", help=SOURCES)
    inspect.add_argument("--json", action="store_true", help="one JSON record per source")

    listing = command("ls", "list tensor names, one per line", run_ls)
    listing.add_argument("sources", nargs="+", metavar="SOURCE", help=SOURCES)

    show = command("show", "print a tensor's values (summarized when big)", run_show)
    show.add_argument("source", help="file, directory, URL or - (stdin)")
    show.add_argument("name", help="the tensor's name")
    show.add_argument(
        "--slice",
        type=parse_index,
        metavar="INDEX",
        help="numpy-style indices, e.g. 0:4, 1,0:8 or ...,0",
    )
    show.add_argument("--json", action="store_true", help="the values as one JSON record")

    hashing = command("hash", "structural hash of the header; --content hashes the data", run_hash)
    hashing.add_argument("sources", nargs="+", metavar="SOURCE", help=SOURCES)
    hashing.add_argument("--content", action="store_true", help="also hash the data, streamed")
    hashing.add_argument(
        "--file",
        action="store_true",
        help="the sha256 of every byte of the input, as sha256sum's line (with --json: added)",
    )
    hashing.add_argument(
        "--format",
        choices=("stream-st", "weight-inspect"),
        default="stream-st",
        help="whose structural hash: ours (default), or the weight-inspect tool's ID "
        "(wi:safetensors:0:...) as its 'id' command computes it",
    )
    hashing.add_argument(
        "-c",
        "--check",
        action="store_true",
        help="read sha256sum lists (SOURCE: the lists) and check every source they name, as "
        "sha256sum -c (remote sources too)",
    )
    hashing.add_argument("--json", action="store_true", help="one JSON record per source")

    differ = command("diff", "compare two files: tensors, metadata; --content the bytes", run_diff)
    differ.add_argument("a", metavar="A", help="file, directory, URL or - (stdin)")
    differ.add_argument("b", metavar="B", help="the same, compared with A")
    differ.add_argument("--content", action="store_true", help="also compare common tensors' bytes")
    differ.add_argument("--json", action="store_true", help="the differences as one JSON record")

    check = command(
        "validate", "stream every tensor: statistics, NaN/Inf, expectations", run_validate
    )
    check.add_argument("sources", nargs="+", metavar="SOURCE", help=SOURCES)
    check.add_argument("--json", action="store_true", help="one JSON record per source")
    check.add_argument("--expect-shapes", metavar="JSON", help="file mapping names to shapes")
    check.add_argument(
        "--expect-layers",
        type=comma_list,
        metavar="PARTS",
        help="comma-separated parts every layer must have",
    )
    check.add_argument(
        "--config",
        metavar="JSON",
        help="a Llama-family model's config.json: check shapes, layers, parameter count against it",
    )
    check.add_argument(
        "--stats",
        action="store_true",
        help="also print the read's statistics (bytes, seconds, throughput, time waited)",
    )
    check.add_argument(
        "--warn-abs",
        type=number_arg("warn_abs", lambda value: checked_number("warn_abs", value)),
        default=1e4,
        metavar="VALUE",
        help="warn about values beyond this (default 1e4)",
    )

    copy = command("cp", "stream-copy between any source and destination", run_cp)
    copy.add_argument("src", help="file, directory, URL or - (stdin)")
    copy.add_argument(
        "dst",
        help="path, file://, tcp://host:port, http(s):// (PUT), s3://, - (stdout); a trailing / "
        "or an existing directory: into it, under the source's name",
    )
    copy.add_argument(
        "--include", action="append", metavar="NAME", help="copy only this tensor (repeatable)"
    )
    copy.add_argument(
        "--merge",
        action="store_true",
        help="merge a sharded checkpoint into one file (else it is mirrored into DST/, every "
        "shard and then the index)",
    )
    converting = copy.add_mutually_exclusive_group()
    copy.add_argument(
        "--dtype",
        choices=("bf16", "f16", "f32"),
        help="convert F16/BF16/F32/F64 tensors (F8, F6 and F4 ones are copied as they are, "
        "with a warning)",
    )
    converting.add_argument(
        "--quantize",
        choices=("int8",),
        help="per-tensor symmetric int8 of F16/BF16/F32/F64 tensors, scales as siblings",
    )
    copy.add_argument(
        "--checksums",
        action="store_true",
        help="record each tensor's digest: a source's digests kept, of its algorithm; "
        "xxh3-128 for a source without",
    )
    converting.add_argument(
        "--dequantize",
        action="store_true",
        help="restore floating-point tensors from int8/int4 codes (to --dtype if given)",
    )
    copy.add_argument(
        "--stats",
        action="store_true",
        help="also print the read's statistics (bytes, seconds, throughput, time waited)",
    )
    copy.add_argument(
        "--json",
        action="store_true",
        help="print what was copied as one JSON record (with --stats: the read's statistics)",
    )

    serving = command(
        "serve", "serve a checkpoint over HTTP as one safetensors file, with ranges", run_serve
    )
    serving.add_argument(
        "path", help="a safetensors file, a sharded checkpoint's *.index.json or a model directory"
    )
    serving.add_argument(
        "--host",
        type=host_arg,
        default="127.0.0.1",
        help="the address to listen on (default 127.0.0.1)",
    )
    serving.add_argument(
        "--port", type=port_arg, default=8000, help="the port to listen on (default 8000; 0: any)"
    )
    serving.add_argument(
        "--token",
        type=token_arg,
        help="ask every request for 'Authorization: Bearer TOKEN', TOKEN visible ASCII (else "
        "$STREAM_ST_SERVE_TOKEN, which keeps it off the command line)",
    )
    serving.add_argument(
        "--name",
        type=name_arg,
        help="serve at /NAME.safetensors (default: the file's or the index's name)",
    )
    digesting = serving.add_mutually_exclusive_group()
    digesting.add_argument(
        "--checksums",
        action="store_true",
        help="every tensor carries a digest (xxh3-128, computed at start where the file has "
        "none); without it a file's own digests are served as they are",
    )
    digesting.add_argument(
        "--no-checksums", action="store_true", help="serve no digests, not even the file's"
    )

    completion = command(
        "completion", "print a shell completion script (needs argcomplete)", run_completion
    )
    completion.add_argument("shell", choices=SHELLS)

    # the cache: --cache and `stream-st cache` (stream_st/cli/cache.py)
    from .cache import add_cache_command, add_cache_option

    add_cache_command(commands)
    for sub in (inspect, check, copy):
        add_cache_option(sub)

    # a no-op where nothing is shown (inspect, ls, show), as a script passing it to all expects
    for sub in (inspect, listing, show, hashing, differ, check, copy, demo):
        sub.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    for sub in (inspect, listing, show, hashing, differ, check, copy):
        remote = sub.add_argument_group("remote sources and destinations")
        remote.add_argument(
            "-H",
            "--header",
            action="append",
            type=header_line,
            metavar="'NAME: VALUE'",
            help="send this header with every HTTP or S3 request (repeatable)",
        )
        remote.add_argument(
            "--ca-bundle",
            type=ca_bundle,
            metavar="FILE",
            help="trust the CA certificates in this PEM file for https (instead of the system's)",
        )
        remote.add_argument(
            "--no-sign-request",
            action="store_true",
            help="send s3:// requests unsigned (public buckets), as AWS_NO_SIGN_REQUEST=1",
        )
        remote.add_argument(
            "--endpoint-url",
            type=endpoint_arg,
            metavar="URL",
            help="the S3-compatible store s3:// addresses go to (MinIO, R2...), as the AWS CLI's "
            "(else AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, the profile's endpoint_url)",
        )
        remote.add_argument(
            "--region",
            type=region_arg,
            metavar="REGION",
            help="the S3 region (else AWS_REGION, AWS_DEFAULT_REGION, the profile's, us-east-1)",
        )
        remote.add_argument(
            "--profile",
            type=profile_arg,
            metavar="NAME",
            help="the AWS profile for s3:// credentials and settings (else AWS_PROFILE)",
        )
    return parser
