"""The command's network options (time limits, headers, CA bundle) as the library takes them."""

from __future__ import annotations

import argparse
import os
import ssl
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..errors import UsageError
from ..reader.caps import Caps, using_caps
from ..transports.cache.config import parse_size
from ..transports.options import (
    LimitOptions,
    Limits,
    Transport,
    TransportOptions,
)
from ..transports.s3.config import check_profile, endpoint_problem, region_problem

__all__ = []


def limits_of(args: argparse.Namespace) -> LimitOptions:
    """The time limits given on the command line (each checked as it was parsed)."""
    return LimitOptions(
        timeout=args.timeout,
        deadline=args.deadline,
        speed_limit=args.speed_limit,
        speed_time=args.speed_time,
    )


def options_of(args: argparse.Namespace) -> TransportOptions:
    """The time limits, ``--header`` lines and ``--ca-bundle`` given on the command line."""
    return TransportOptions(
        **limits_of(args), headers=dict(args.header or ()), ssl_context=args.ca_bundle
    )


def number_arg(name: str, check: Callable[[float], object]) -> Callable[[str], float]:
    """The argparse type of an option that takes a number, as the library's keyword ``name``
    takes it: ``check`` raises :class:`~stream_st.UsageError` for a value it refuses. A bad value
    is refused as the command line is parsed, naming the option, before any source is read (a
    command reading several sources would otherwise report it as each source's error)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        with _refused_as(name):
            check(value)
        return value

    return parse


@contextmanager
def _refused_as(name: str) -> Iterator[None]:
    """A :class:`~stream_st.UsageError` the library's check of its keyword ``name`` raises
    within, as argparse's error for the option: its message less the leading ``name`` (argparse
    names the option before it)."""
    try:
        yield
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{name} ")) from None


def limit_arg(name: str) -> Callable[[str], float]:
    """The argparse type of the time limit ``name`` (``timeout``, ``deadline``, ...)."""
    return number_arg(name, lambda value: Limits.of({name: value}))


def comma_list(text: str) -> tuple[str, ...]:
    """The argparse type of an option taking a comma-separated list (``--codecs none,int8``):
    its names, each stripped of the spaces around it (``'q_proj, k_proj'``), empty ones left
    out; a list naming nothing (``''``, ``,,``) is refused, where it was taken as no list."""
    names = tuple(name for part in text.split(",") if (name := part.strip()))
    if not names:
        raise argparse.ArgumentTypeError(
            f"names nothing ({text!r}): give one or more, comma-separated"
        )
    return names


def token_arg(text: str) -> str:
    """A ``serve --token`` argument: a bearer token the server takes, else refused without
    being shown (``--token "$TOKEN"`` with the variable unset must not serve without one)."""
    from ..server.app import token_problem  # the server's modules, only when a token is given

    empty = "empty (an unset variable?): give the token, or leave --token out"
    return _taken(text, token_problem(text) if text else empty)


def host_arg(text: str) -> str:
    """A ``serve --host`` argument: an address the server listens on, refused where the
    library refuses it (empty: every interface, asked for by name as 0.0.0.0)."""
    from ..server.app import host_problem  # the server's modules, only when serving

    return _taken(text, host_problem(text))


def port_arg(text: str) -> int:
    """A ``serve --port`` argument: an integer from 0 (any free port) to 65535, refused as the
    command line is parsed, naming the option, before the source is read."""
    from ..server.app import port_problem  # the server's modules, only when serving

    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    _taken(text, port_problem(port))
    return port


def name_arg(text: str) -> str:
    """A ``serve --name`` argument, refused where the library refuses ``name=`` (a ``/``,
    surrounding spaces, a control character), naming the option; taken as given (the server
    drops a trailing ``.safetensors`` itself)."""
    from ..server.served import checked_name  # the server's modules, only when serving

    with _refused_as("name"):
        checked_name(text)
    return text


def directory_arg(text: str) -> str:
    """A ``--cache-dir DIR`` (``cache --dir DIR``) argument: an empty one is refused, not taken
    as no option (``cache rm --all --dir "$DIR"`` with the variable unset would empty the
    default cache)."""
    return _taken(text, None if text else "empty (an unset variable?): give the directory")


def _taken(text: str, problem: str | None) -> str:
    """``text``, an argument a ``*_problem`` check found nothing wrong with; else refused with
    what the check said (argparse prints it after the option's name)."""
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def header_line(text: str) -> tuple[str, str]:
    """A ``--header 'Name: value'`` argument as (name, value), checked as every request's
    headers are (a valid name), and as a header's value must be to go out at all (no control
    character, nothing Latin-1 cannot encode): refused here, once, not by each source's
    request; the value is never shown (it may be a token)."""
    name, colon, value = text.partition(":")
    if not colon or not name.strip():  # not shown: the whole may be a token
        missing = "a name before the colon" if colon else "the colon"
        raise argparse.ArgumentTypeError(f"expected 'Name: value', without {missing}")
    name, value = name.strip(), value.strip()
    try:
        Transport.of({name: value})
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name, value


def ca_bundle(path: str) -> ssl.SSLContext:
    """An SSL context trusting the certificates in the PEM file ``path`` (and no others)."""
    try:
        return ssl.create_default_context(cafile=path)
    except (OSError, ssl.SSLError) as exc:
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise argparse.ArgumentTypeError(f"cannot use {path!r} as a CA bundle: {detail}") from None


AWS_FLAGS = {
    "endpoint_url": "AWS_ENDPOINT_URL_S3",
    "region": "AWS_REGION",
    "profile": "AWS_PROFILE",
}
"""The command's S3 flags (``--endpoint-url``, ``--region``, ``--profile``, spelled as the AWS
CLI spells them) and the environment variable each stands for, above every other source."""


def endpoint_arg(text: str) -> str:
    """An ``--endpoint-url`` argument: an http(s) URL with a host (an empty one is refused, not
    taken as unset: ``--endpoint-url "$URL"`` with the variable unset would go to AWS)."""
    return _taken(text, endpoint_problem(text) if text else "empty (an unset variable?)")


def region_arg(text: str) -> str:
    """A ``--region`` argument: a region name, as botocore takes it (it goes into the host
    name of AWS's endpoint)."""
    return _taken(text, region_problem(text))


def profile_arg(text: str) -> str:
    """A ``--profile`` argument: a profile the AWS files have (``default`` always is)."""
    try:
        check_profile(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


@contextmanager
def aws_settings(args: argparse.Namespace) -> Iterator[None]:
    """Within the block, the S3 flags given on the command line override the environment and the
    AWS files, as the AWS CLI's do: each is set as the variable that comes first (so botocore's
    credential chain sees the profile too), and the environment is restored afterwards."""
    given = {
        variable: value
        for flag, variable in AWS_FLAGS.items()
        if (value := getattr(args, flag, None)) is not None
    }
    saved = {variable: os.environ.get(variable) for variable in given}
    os.environ.update(given)
    try:
        yield
    finally:
        for variable, value in saved.items():
            if value is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = value


def size_arg(text: str) -> int:
    """A size argument: bytes, or a number with a unit (``4G``, ``500MB``; see
    :func:`~stream_st.transports.cache.parse_size`)."""
    try:
        return parse_size(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@contextmanager
def caps_of(args: argparse.Namespace) -> Iterator[None]:
    """Every read of the command capped by ``--max-tensor-bytes`` / ``--max-total-bytes``."""
    caps = Caps.of(getattr(args, "max_tensor_bytes", None), getattr(args, "max_total_bytes", None))
    with using_caps(caps):
        yield
