"""S3-compatible object stores over our HTTP client: addresses, configuration, SigV4 signing.

Configuration follows the standard AWS environment and files, each overridable in code:

* endpoint: ``endpoint_url=`` > ``AWS_ENDPOINT_URL_S3`` > ``AWS_ENDPOINT_URL`` > the profile's
  ``endpoint_url`` > ``https://s3.<region>.amazonaws.com``;
* region: ``region=`` > ``AWS_REGION`` > ``AWS_DEFAULT_REGION`` > the profile's ``region`` >
  ``us-east-1``;
* profile: ``profile=`` > ``AWS_PROFILE`` > ``AWS_DEFAULT_PROFILE`` > ``default``; a profile
  named but in neither file is an error; the endpoint, region and credentials all come from
  that one profile (botocore's chain is asked for its keys, where botocore alone would prefer
  ``AWS_DEFAULT_PROFILE``);
* unsigned requests (public buckets): ``anonymous=True`` > ``AWS_NO_SIGN_REQUEST=1`` (or the
  command line's ``--no-sign-request``, :func:`unsigned_requests`); ``anonymous=False`` signs
  whatever the environment says;
* credentials: ``access_key_id=``/``secret_access_key=``/``session_token=`` > the AWS credential
  chain. With botocore installed (the ``s3`` extra) that is botocore's, the AWS CLI's: the
  environment, the shared files and profiles, SSO, ``credential_process``, web identity, container
  and instance metadata (keys in the environment are taken directly, as the chain would, unless
  ``profile=`` names one in code). It is consulted on first use, once per configuration, in a
  worker thread (:meth:`S3Config.ready`), and credentials that expire are refreshed before they
  do. Without botocore, or with ``environ=`` given in code (botocore reads the process
  environment), the chain is ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``
  > the shared credentials file (``AWS_SHARED_CREDENTIALS_FILE``, default ``~/.aws/credentials``)
  > the config file (``AWS_CONFIG_FILE``, default ``~/.aws/config``), in the profile.

No credentials anywhere, when requests are to be signed, is a :class:`~stream_st.CredentialsError`
before the first request goes out, never a silently unsigned request. So is a key id, secret or
session token holding a line break or another character an HTTP header cannot carry (a token
wrapped over two lines in a credentials file would send its second line as a header of its
own): the error names the key and where it came from, never its value. A broken configuration is
one too: an unknown profile, an unreadable file, a region that is no region name (it goes into
AWS's host name) or an endpoint that is no http(s) URL when the configuration is resolved (named
by where it came from), a failing credential process (named by its exit status, never by what it
printed, which may hold a secret) or credentials still expired once refreshed, on first use or
at a refresh.

Only the keys come from the chain: the signing (SigV4, below) and the transport are ours.

A custom endpoint is addressed path-style (``endpoint/bucket/key``), AWS itself virtual-hosted
(``https://bucket.s3.region.amazonaws.com/key``). Not public API.
"""

from __future__ import annotations

import configparser
import datetime as _dt
import hashlib
import hmac
import importlib.util
import os
import re
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import quote, urlsplit

import anyio

from ..._util import call_soon_from_thread
from ...errors import (
    MASK,
    ArgumentTypeError,
    CredentialsError,
    SafetensorsError,
    UnsupportedSourceError,
    UsageError,
    redact,
)
from ..http.target import Target
from ..options import UNLIMITED, Clock, credential_problem

__all__ = ["CredentialChain", "S3Config", "parse_s3_url", "unsigned_requests"]

UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"


_BUCKET = re.compile(r"[A-Za-z0-9._-]+")
"""What a bucket name may hold (S3's rules, with the upper case and ``_`` of legacy names)."""

_REGION = re.compile(r"[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?")
"""What a region name may be, as botocore checks it: it goes into AWS's host name, where an
``@``, ``:`` or ``/`` would send the signed request (and the session token) to another host."""


def region_problem(region: str) -> str | None:
    """Why ``region`` is no region name (shown: a region is no secret); None when it is one."""
    if _REGION.fullmatch(region):
        return None
    return f"{region!r} is not a region name (letters, digits and inner '-', at most 63)"


_HOST = re.compile(r"[\w.~-]+|[0-9a-f.]*:[0-9a-f:.]*(?:%[\w.~-]+)?", re.IGNORECASE)
"""A host name (letters, digits, ``-``, ``.``, ``_``, ``~``: no space, no escape) or an IPv6
address, a zone after ``%`` allowed (``urlsplit`` gives it without its brackets)."""


def endpoint_problem(url: str) -> str | None:
    """Why ``url`` is no endpoint (not shown: it may hold a password); None when it is one."""
    try:
        parts = urlsplit(url)
    except ValueError:  # an unclosed [ of an IPv6 address
        parts = urlsplit("")
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        return "not an http:// or https:// URL with a host"
    if not _HOST.fullmatch(parts.hostname):  # "a b", "a%ffb": no request could reach it
        return "a URL whose host is not a host name or an IP address"
    try:
        _ = parts.port
    except ValueError:  # not a number, or out of range
        return "a URL whose port is not a number from 0 to 65535"
    return None


def check_profile(profile: str) -> None:
    """CredentialsError when the AWS profile ``profile`` is in neither AWS file (or a file
    cannot be read), as :meth:`S3Config.resolve` would find it: for a command line to refuse a
    named profile once, before any source is read."""
    _profile(os.environ, profile)


def parse_s3_url(
    url: str, unsupported: type[SafetensorsError] = UnsupportedSourceError
) -> tuple[str, str]:
    """``s3://bucket/key`` -> ``(bucket, key)``; ``unsupported`` is raised for anything else.

    The key is everything after the bucket's ``/``, as the AWS CLI takes it: an S3 key may hold
    ``?``, ``#``, ``%`` and more, so an ``s3://`` URL has no query and no fragment, and nothing
    in it is percent-decoded (``s3://b/m?v=2`` is the key ``m?v=2``). It must be Unicode text
    (UTF-8, which S3 keys are): a lone surrogate is refused here, before any request."""
    scheme, sep, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    if not sep or scheme.lower() != "s3" or not bucket or not key:
        raise unsupported(f"expected s3://bucket/key, got {url!r}")
    if not _BUCKET.fullmatch(bucket):
        raise unsupported(
            f"{url!r}: {bucket!r} is not a bucket name (letters, digits, '.', '-' and '_')"
        )
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise unsupported(
            f"{url!r}: the key is not valid Unicode text ({exc.reason} at {exc.start})"
        ) from None
    return bucket, key


_UNSIGNED: ContextVar[bool] = ContextVar("stream_st_unsigned_s3", default=False)

_ASK_UNSIGNED = (
    "for a public bucket, ask for unsigned requests (--no-sign-request, AWS_NO_SIGN_REQUEST=1 "
    "or S3Config.resolve(anonymous=True))"
)


@contextmanager
def unsigned_requests() -> Iterator[None]:
    """Within the block, configurations resolved from the environment send unsigned requests, as
    with ``AWS_NO_SIGN_REQUEST=1`` (the command line's ``--no-sign-request``)."""
    token = _UNSIGNED.set(True)
    try:
        yield
    finally:
        _UNSIGNED.reset(token)


def _one_line(exc: BaseException) -> str:
    """``exc``'s message on one line, without trailing punctuation."""
    return " ".join(str(exc).split()).rstrip(" :") or type(exc).__name__


def _env_flag(env: Mapping[str, str], name: str) -> bool:
    """The boolean environment variable ``name``: 1/true/yes/on or 0/false/no/off (or unset)."""
    value = env.get(name, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise UsageError(f"{name} must be 1/true/yes/on or 0/false/no/off, got {value!r}")


def _ini(path: Path) -> configparser.ConfigParser:
    """The INI file at ``path``, empty if there is none; CredentialsError if it cannot be read."""
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    try:
        with path.open(encoding="utf-8") as file:
            parser.read_file(file)
    except FileNotFoundError:
        pass
    except configparser.MissingSectionHeaderError as exc:
        # configparser's messages quote the line, which may hold a secret: only its number
        raise CredentialsError(
            f"cannot read the AWS file {path}: line {exc.lineno} comes before any [section]"
        ) from None
    except configparser.ParsingError as exc:
        lines = ", ".join(str(lineno) for lineno, _ in exc.errors)
        raise CredentialsError(
            f"cannot read the AWS file {path}: neither a [section] nor name = value at line {lines}"
        ) from None
    except (OSError, UnicodeDecodeError, configparser.Error) as exc:
        raise CredentialsError(f"cannot read the AWS file {path}: {_one_line(exc)}") from None
    return parser


class _Section(NamedTuple):
    """A profile's section of an AWS file, and where it is (for messages)."""

    values: dict[str, str]
    where: str  # "the profile 'dev' in /home/me/.aws/credentials"


def _profile(env: Mapping[str, str], profile: str) -> tuple[_Section, _Section]:
    """``profile``'s sections of the AWS config and shared credentials files named by ``env``;
    CredentialsError when the profile is not ``default`` and neither file has it."""
    home = Path(env.get("HOME", "~")).expanduser()
    config_file = Path(env.get("AWS_CONFIG_FILE", home / ".aws" / "config")).expanduser()
    credentials_file = Path(
        env.get("AWS_SHARED_CREDENTIALS_FILE", home / ".aws" / "credentials")
    ).expanduser()
    config, stored = _ini(config_file), _ini(credentials_file)
    section = "default" if profile == "default" else f"profile {profile}"
    if profile != "default" and not (config.has_section(section) or stored.has_section(profile)):
        raise CredentialsError(
            f"the AWS profile {profile!r} is in neither {config_file} nor {credentials_file}"
        )
    return (
        _Section(
            dict(config[section]) if config.has_section(section) else {},
            f"the profile {profile!r} in {config_file}",
        ),
        _Section(
            dict(stored[profile]) if stored.has_section(profile) else {},
            f"the profile {profile!r} in {credentials_file}",
        ),
    )


_KEY_NAMES = ("access_key_id", "secret_access_key", "session_token")
"""The names of :class:`Keys`' fields."""

_GIVEN = ("access_key_id=", "secret_access_key=", "session_token=")
"""Where keys given in code come from, for messages."""

_Stored = tuple[tuple[str | None, str | None, str | None], tuple[str, str, str]]


def _stored_keys(env: Mapping[str, str], *sections: _Section) -> _Stored:
    """The first key, secret and token found together in ``env``, then in ``sections``, with
    where each came from (``AWS_SESSION_TOKEN``, ``aws_session_token of the profile...``); Nones
    if none has both key and secret."""
    sources = [(env, "")] + [(section.values, f" of {section.where}") for section in sections]
    for source, where in sources:
        names = [_spelling(source, name) for name in _KEY_NAMES]
        key, secret, token = (source.get(name) for name in names)
        if key and secret:
            key_at, secret_at, token_at = (name + where for name in names)
            return (key, secret, token), (key_at, secret_at, token_at)
    return (None, None, None), _GIVEN


def _spelling(source: Mapping[str, str], name: str) -> str:
    """How ``source`` spells the key ``name``: ``AWS_SESSION_TOKEN`` (the environment's) or
    ``aws_session_token`` (the files')."""
    upper = f"AWS_{name.upper()}"
    return upper if source.get(upper) else f"aws_{name}"


def _first(*candidates: tuple[str | None, str]) -> tuple[str | None, str]:
    """The first of ``candidates`` whose value is set (not empty), as (value, where it came
    from); (None, "") when none is."""
    return next(((value, at) for value, at in candidates if value), (None, ""))


class Keys(NamedTuple):
    """The credentials one request is signed with."""

    access_key_id: str
    secret_access_key: str
    session_token: str | None = None

    def __repr__(self) -> str:  # the key id names whose keys; the rest is secret
        token = None if self.session_token is None else MASK
        return (
            f"Keys(access_key_id={self.access_key_id!r}, secret_access_key={MASK!r}, "
            f"session_token={token!r})"
        )

    def checked(self, origins: tuple[str, str, str]) -> Keys:
        """These keys, if every one can go in an HTTP header as it is (the key id and token do):
        else a :class:`~stream_st.CredentialsError` naming the key and where it came from
        (``origins``, one for each), never its value. A line break (a token wrapped over two
        lines in a credentials file) would send the rest as a header of its own."""
        for value, name, origin in zip(self, _KEY_NAMES, origins, strict=True):
            problem = None if value is None else credential_problem(value)
            if problem is not None:
                label = name.replace("_", " ")
                raise CredentialsError(f"the AWS {label} from {origin} holds {problem}")
        return self


class CredentialChain:
    """The credentials botocore's chain finds for ``profile`` (None: none named anywhere, so
    botocore's default; :meth:`S3Config.resolve` passes the one it resolved, so that botocore,
    which prefers ``AWS_DEFAULT_PROFILE``, never takes the keys of another profile than the one
    the endpoint and region came from). Looked for on the first :meth:`keys`, once; credentials
    that expire (SSO, web identity, a credential process, container and instance roles) are
    refreshed by botocore as they near their expiry. Both may block (files, processes, the
    network): while :meth:`due` says so, async code calls :meth:`keys` in a worker thread
    (:meth:`S3Config.ready`)."""

    def __init__(self, profile: str | None = None) -> None:
        self.profile = profile
        self._lock = threading.Lock()  # one search, however many threads ask at once
        self._searched = False
        self._found: Any = None  # botocore's credentials, once searched; None if none found
        self._helper: subprocess.Popen[bytes] | None = None  # the last credential_process run

    @staticmethod
    def available() -> bool:
        """Whether botocore is installed."""
        return importlib.util.find_spec("botocore") is not None

    def due(self) -> bool:
        """Whether :meth:`keys` may block: the chain was not searched yet, or the credentials
        found are about to expire."""
        if not self._searched:
            return True
        refresh_needed = getattr(self._found, "refresh_needed", None)
        return refresh_needed is not None and bool(refresh_needed())

    def keys(self) -> Keys:
        """The current credentials; CredentialsError when there are none or the chain fails."""
        from botocore.exceptions import BotoCoreError
        from botocore.session import Session

        try:
            with self._lock:
                if not self._searched:
                    session = Session(profile=self.profile)
                    self._watch_helper(session)
                    self._found = session.get_credentials()
                    self._searched = True
            frozen = None if self._found is None else self._found.get_frozen_credentials()
        except (BotoCoreError, OSError, ValueError, RuntimeError) as exc:
            # RuntimeError: botocore's "refreshed credentials are still expired"
            raise CredentialsError(
                f"cannot get AWS credentials{self._named()}: {self._failure(exc)}"
            ) from None
        if frozen is None or not frozen.access_key or not frozen.secret_key:
            raise CredentialsError(
                f"no AWS credentials found{self._named()} (environment, AWS files and profiles, "
                f"SSO, credential_process, web identity, container and instance metadata); "
                f"{_ASK_UNSIGNED}"
            )
        keys = Keys(frozen.access_key, frozen.secret_key, frozen.token or None)
        method = getattr(self._found, "method", None) or "botocore"
        origin = f"the AWS credential chain ({method}){self._named()}"
        return keys.checked((origin, origin, origin))

    def _named(self) -> str:
        return "" if self.profile is None else f" for the profile {self.profile!r}"

    def _watch_helper(self, session: Any) -> None:
        """Have ``session``'s ``credential_process`` provider start its helper through
        :meth:`_run_helper`, where this botocore has that provider as this code knows it (its
        private ``_popen``); else leave it as it is (a failing helper is then told as botocore
        tells it)."""
        from botocore.exceptions import BotoCoreError

        try:
            provider = session.get_component("credential_provider").get_provider("custom-process")
        except (BotoCoreError, KeyError):
            return
        if hasattr(provider, "_popen"):
            provider._popen = self._run_helper

    def _run_helper(self, *args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start a ``credential_process`` helper for botocore, kept to tell its exit status
        (:meth:`_failure`)."""
        self._helper = subprocess.Popen(*args, **kwargs)
        return self._helper

    def _failure(self, exc: BaseException) -> str:
        """What made the chain fail with ``exc``, for a message: a ``credential_process`` that
        failed by its exit status alone, never by its error output, which botocore quotes (a
        helper may print a secret there)."""
        from botocore.exceptions import BotoCoreError, CredentialRetrievalError

        helper = self._helper
        if isinstance(exc, CredentialRetrievalError) and helper is not None and helper.returncode:
            return (
                f"{exc.kwargs.get('provider')}: the credential_process exited with status "
                f"{helper.returncode} (its output is not shown)"
            )
        detail = _one_line(exc)
        return detail if isinstance(exc, BotoCoreError) else f"{type(exc).__name__}: {detail}"


async def _in_daemon_thread(function: Callable[[], object]) -> None:
    """Call ``function`` in a daemon thread of its own and wait for it to return (raising what
    it raises). A cancellation ends the wait at once, the thread left to end by itself; a
    daemon, it never keeps the process from exiting (as anyio's worker threads, joined at exit,
    would while a credential process hangs)."""
    token = anyio.lowlevel.current_token()
    done = anyio.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            function()
        except BaseException as exc:  # raised in the waiting task, if it still waits
            failure.append(exc)
        finally:
            call_soon_from_thread(token, done.set)

    threading.Thread(target=run, name="stream_st AWS credentials", daemon=True).start()
    await done.wait()
    if failure:
        raise failure[0]


@dataclass(frozen=True)
class S3Config:
    """Where and as whom to talk to an S3-compatible store. See the module docstring.

    Requests are signed with the keys given, else with those ``chain`` finds; ``anonymous``
    sends them unsigned. With neither keys nor a chain, signing is a CredentialsError."""

    endpoint_url: str
    region: str
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    path_style: bool = True
    anonymous: bool = False
    chain: CredentialChain | None = field(default=None, repr=False, compare=False)
    origins: tuple[str, str, str] = field(default=_GIVEN, repr=False, compare=False)
    """Where each of the keys given came from, for messages: ``AWS_SESSION_TOKEN``, the profile
    and file, or (by default) the argument's name."""

    def __repr__(self) -> str:  # no secret: the keys masked, the endpoint's password too
        secret = None if self.secret_access_key is None else MASK
        token = None if self.session_token is None else MASK
        return (
            f"S3Config(endpoint_url={redact(self.endpoint_url)!r}, region={self.region!r}, "
            f"access_key_id={self.access_key_id!r}, secret_access_key={secret!r}, "
            f"session_token={token!r}, path_style={self.path_style!r}, "
            f"anonymous={self.anonymous!r})"
        )

    @classmethod
    def resolve(
        cls,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        profile: str | None = None,
        anonymous: bool | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> S3Config:
        """The configuration the arguments, the environment (``environ``, by default
        ``os.environ``) and the AWS files give; see the module docstring. Credentials from
        botocore's chain are looked for later, on first use."""
        given = {
            "endpoint_url": endpoint_url,
            "region": region,
            "access_key_id": access_key_id,
            "secret_access_key": secret_access_key,
            "session_token": session_token,
            "profile": profile,
        }
        for what, value in given.items():
            if value is not None and not isinstance(value, str):
                raise ArgumentTypeError(
                    f"S3Config {what}= takes a string, got {type(value).__name__}"
                )
        env = os.environ if environ is None else environ
        named = profile or env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE")
        config, stored = _profile(env, named or "default")
        origins = _GIVEN
        found, region_at = _first(
            (region, "region="),
            (env.get("AWS_REGION"), "AWS_REGION"),
            (env.get("AWS_DEFAULT_REGION"), "AWS_DEFAULT_REGION"),
            (config.values.get("region"), f"the region of {config.where}"),
        )
        region = found or "us-east-1"
        custom, custom_at = _first(
            (endpoint_url, "endpoint_url="),
            (env.get("AWS_ENDPOINT_URL_S3"), "AWS_ENDPOINT_URL_S3"),
            (env.get("AWS_ENDPOINT_URL"), "AWS_ENDPOINT_URL"),
            (config.values.get("endpoint_url"), f"the endpoint_url of {config.where}"),
        )
        problem = region_problem(region)
        if problem is not None:
            raise CredentialsError(f"the AWS region from {region_at}: {problem}")
        problem = None if custom is None else endpoint_problem(custom)
        if problem is not None:
            raise CredentialsError(f"the S3 endpoint from {custom_at} is {problem}")
        if (access_key_id is None) != (secret_access_key is None):
            raise CredentialsError("give both access_key_id and secret_access_key, or neither")
        if anonymous is None:
            anonymous = _UNSIGNED.get() or _env_flag(env, "AWS_NO_SIGN_REQUEST")
        chain = None
        if not anonymous and access_key_id is None:
            # Keys in the environment come first in botocore's chain too (unless a profile is
            # named in code): taken as they are, without importing botocore (0.1-0.3 s).
            in_env = profile is None and _stored_keys(env)[0][0] is not None
            if environ is None and not in_env and CredentialChain.available():
                chain = CredentialChain(named)  # the keys of the profile all else came from
            else:
                (access_key_id, secret_access_key, token), origins = _stored_keys(
                    env, stored, config
                )
                if session_token:  # given in code, with keys found elsewhere
                    origins = (origins[0], origins[1], _GIVEN[2])
                session_token = session_token or token
        return cls(
            endpoint_url=(custom or f"https://s3.{region}.amazonaws.com").rstrip("/"),
            region=region,
            access_key_id=access_key_id,
            secret_access_key=secret_access_key,
            session_token=session_token,
            path_style=custom is not None,
            anonymous=anonymous,
            chain=chain,
            origins=origins,
        )

    def keys(self) -> Keys | None:
        """The credentials to sign with now; None for unsigned requests. May block on first use
        of a chain (see :meth:`ready`); CredentialsError when there are none."""
        if self.anonymous:
            return None
        if self.access_key_id and self.secret_access_key:
            keys = Keys(self.access_key_id, self.secret_access_key, self.session_token)
            return keys.checked(self.origins)
        if self.chain is not None:
            return self.chain.keys()
        raise CredentialsError(
            "no AWS credentials found (environment, ~/.aws/credentials, ~/.aws/config; SSO, "
            "credential_process and instance roles need the s3 extra, botocore); "
            f"{_ASK_UNSIGNED}"
        )

    async def ready(self, clock: Clock = UNLIMITED, name: str | None = None) -> None:
        """Look for the credentials, or refresh them, in a daemon thread when that may block
        (botocore's chain, on first use and as they near their expiry), within ``clock``'s
        limits (reported for ``name``): :meth:`sign` after it does not block. Call it before
        signing from async code; at once when nothing is due."""
        if self.anonymous or self.chain is None or not self.chain.due():
            return
        with clock.waiting(name, stalled="no AWS credentials"):
            await _in_daemon_thread(self.chain.keys)

    def object_url(self, bucket: str, key: str, query: str = "") -> str:
        """The HTTP address of ``key`` in ``bucket`` (``query`` already encoded, without ``?``);
        of the bucket itself when ``key`` is empty."""
        path = "/" + quote(key, safe="/~") if key else ""
        if self.path_style:
            url = f"{self.endpoint_url}/{bucket}{path}"
        else:
            parts = urlsplit(self.endpoint_url)
            userinfo, at, host = parts.netloc.rpartition("@")  # the bucket names the host
            url = f"{parts.scheme}://{userinfo}{at}{bucket}.{host}{path or '/'}"
        return f"{url}?{query}" if query else url

    def sign(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        payload_hash: str = UNSIGNED_PAYLOAD,
        *,
        now: _dt.datetime | None = None,
    ) -> dict[str, str]:
        """``headers`` plus the AWS Signature Version 4 ones for this request (none when
        ``anonymous``)."""
        out = dict(headers)
        keys = self.keys()
        if keys is None:
            return out
        moment = now or _dt.datetime.now(_dt.UTC)
        amz_date = moment.strftime("%Y%m%dT%H%M%SZ")
        day = amz_date[:8]
        parts = urlsplit(url)
        out["x-amz-date"] = amz_date
        out["x-amz-content-sha256"] = payload_hash
        if keys.session_token:
            out["x-amz-security-token"] = keys.session_token
        # Every header given is signed (Range included), with the host as the request carries
        # it (lower case, IDNA, no user info, no default port), not as the endpoint is written.
        host = Target.parse(url).authority
        signed = {"host": host, **{k.lower(): " ".join(v.split()) for k, v in out.items()}}
        names = sorted(signed)
        canonical_headers = "".join(f"{k}:{signed[k]}\n" for k in names)
        signed_headers = ";".join(names)
        # The query is already percent-encoded by whoever built the URL.
        query = "&".join(
            sorted(item if "=" in item else item + "=" for item in parts.query.split("&") if item)
        )
        canonical = "\n".join(
            [
                method,
                quote(parts.path or "/", safe="/-_.~%"),
                query,
                canonical_headers,
                signed_headers,
                payload_hash,
            ]
        )
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(
            ["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()]
        )
        key = ("AWS4" + keys.secret_access_key).encode()
        for part in (day, self.region, "s3", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        out["Authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={keys.access_key_id}/{scope}, "
            f"SignedHeaders={signed_headers}, Signature={signature}"
        )
        return out
