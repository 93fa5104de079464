"""The command's network options (time limits, headers, CA bundle) as the library takes them."""

from __future__ import annotations

import argparse
import ssl

from ..transports.options import LimitOptions, TransportOptions

__all__ = []


def limits_of(args: argparse.Namespace) -> LimitOptions:
    """The time limits given on the command line (each checked where it is used)."""
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


def header_line(text: str) -> tuple[str, str]:
    """A ``--header 'Name: value'`` argument as (name, value); checked again where it is used."""
    name, colon, value = text.partition(":")
    if not colon or not name.strip():
        raise argparse.ArgumentTypeError(f"expected 'Name: value', got {text!r}")
    return name.strip(), value.strip()


def ca_bundle(path: str) -> ssl.SSLContext:
    """An SSL context trusting the certificates in the PEM file ``path`` (and no others)."""
    try:
        return ssl.create_default_context(cafile=path)
    except (OSError, ssl.SSLError) as exc:
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise argparse.ArgumentTypeError(f"cannot use {path!r} as a CA bundle: {detail}") from None
