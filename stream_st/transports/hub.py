"""``hf://`` addresses: files in Hugging Face Hub repositories, read over HTTP(S).

Addresses::

    hf://{org}/{repo}[@{revision}]/{path}             a model repository
    hf://datasets/{org}/{repo}[@{revision}]/{path}    a dataset repository

A Space (``hf://spaces/...``) is neither: refused (:class:`~stream_st.UnsupportedSourceError`).

The revision (a branch, tag or commit; default ``main``) is percent-decoded, so one holding ``/``
is written encoded: ``hf://org/repo@refs%2Fpr%2F1/model.safetensors``. The path is taken as
written, like an S3 key. The Hub is ``HF_ENDPOINT`` (default ``https://huggingface.co``); the
token is ``HF_TOKEN``, else the file ``$HF_HOME/token`` (``HF_HOME`` defaults to
``$XDG_CACHE_HOME/huggingface``, that to ``~/.cache/huggingface``).

How a file is read (:class:`HubSource`, an :class:`~stream_st.HttpSource`):

* The first ranged GET goes to the Hub's resolve URL
  (``{endpoint}/{org}/{repo}/resolve/{revision}/{path}``). The Hub serves small files itself
  (an index) and answers large (LFS) ones with a redirect to a signed, expiring CDN URL. The
  redirect is not followed blindly: every later range of the read goes straight to the CDN URL,
  so resolution costs one request per read (header-only: Hub + CDN = 2 requests per file).
* The token is sent to the Hub's origin (scheme, host, port) only: requests there never follow a
  redirect by themselves, and nothing sent anywhere else carries it.
* A CDN URL that expires during a read (403 or 410) is resolved again, once per failure, at
  the commit the file was first served from (``X-Repo-Commit``), not at the branch, which may
  have moved meanwhile. Every later request to the Hub is asked at that commit too; an answer
  naming another commit or another ETag (``X-Linked-Etag``, else ``ETag``: ``hub_etag``)
  than the first is a :class:`~stream_st.SourceChangedError`: one read never mixes two
  versions of the file.
* A 401 or 403 from the Hub is an :class:`~stream_st.HTTPStatusError` saying the repository is
  private or gated and how to pass a token.
* ``X-Repo-Commit`` pins what a file was read at: an index's shards are read at the commit the
  index came from (:attr:`HubSource.pinned`), however the branch moves meanwhile.
* ``X-Linked-Etag`` on the redirect of an LFS file is its SHA-256 (the LFS oid): a read of every
  byte of the file is checked against it (:meth:`HubSource.object_digest`), at the end.
"""

from __future__ import annotations

import hashlib
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Unpack
from urllib.parse import quote, unquote

import anyio

from ..core.digests import ObjectDigest
from ..errors import (
    ArgumentTypeError,
    CacheMissError,
    HTTPStatusError,
    SafetensorsError,
    SourceChangedError,
    TransportError,
    UnsupportedSourceError,
    UsageError,
    string,
)
from .base import Source
from .cache.config import hub_offline
from .http import HTTPClient, Response, Target
from .http.redirect import REDIRECTS, credential_header, redirected
from .http.source import HttpSource
from .options import Clock, LimitOptions, credential_problem

__all__ = [
    "DEFAULT_ENDPOINT",
    "HubClient",
    "HubFile",
    "HubSource",
    "checked_token",
    "hub_endpoint",
    "hub_etag",
    "hub_token",
]

DEFAULT_ENDPOINT = "https://huggingface.co"
"""The public Hub's base URL: :func:`hub_endpoint` unless ``HF_ENDPOINT`` names another."""
DEFAULT_REVISION = "main"
MAX_HUB_HOPS = 5
"""Redirects within the Hub (a renamed repository) followed before giving up."""

_EXPIRED = frozenset({403, 410})
_REFUSED = frozenset({401, 403})


@dataclass(frozen=True)
class HubFile:
    """A file in a Hub repository: what an ``hf://`` address names."""

    repo_type: str  # "model" or "dataset"
    repo_id: str  # "org/repo"
    revision: str
    path: str

    @classmethod
    def parse(cls, url: str) -> HubFile:
        """Split an ``hf://`` address (see the module docstring)."""
        url = string("url", url)
        rest = url[len("hf://") :] if url[:5].lower() == "hf://" else None
        if rest is None:
            raise UnsupportedSourceError(f"expected an hf:// address, got {url!r}")
        if rest.startswith("spaces/"):  # not taken for the model repository 'spaces/{org}'
            raise UnsupportedSourceError(
                f"{url!r}: a Space is neither a model nor a dataset repository; hf:// reads "
                "files of those only (hf://org/repo/path, hf://datasets/org/repo/path)"
            )
        repo_type = "dataset" if rest.startswith("datasets/") else "model"
        if repo_type == "dataset":
            rest = rest[len("datasets/") :]
        parts = rest.split("/", 2)
        if len(parts) < 3 or not all(parts):
            raise UnsupportedSourceError(
                f"expected hf://[datasets/]org/repo[@revision]/path, got {url!r}"
            )
        org, repo, path = parts
        repo, at, revision = repo.partition("@")
        try:  # strict: bad escapes were each made U+FFFD, and two revisions one
            revision = unquote(revision, errors="strict") if at else DEFAULT_REVISION
        except UnicodeDecodeError:
            raise UnsupportedSourceError(
                f"{url!r}: a revision whose %-escapes are not UTF-8 text"
            ) from None
        if not repo or not revision:
            raise UnsupportedSourceError(f"empty repository name or revision in {url!r}")
        for part in (org, repo, *revision.split("/"), *path.split("/")):
            if part in ("", ".", ".."):  # the cache lays these out as folders: none may climb
                raise UnsupportedSourceError(
                    f"{url!r}: a name, revision or path with an empty, '.' or '..' part"
                )
            if not part.isprintable():  # a NUL no file name can hold, a newline...
                raise UnsupportedSourceError(
                    f"{url!r}: a name, revision or path with a control character"
                )
        repo_id = f"{org}/{repo}"
        if "--" in repo_id or ".." in repo_id:  # refused as huggingface_hub's validate_repo_id
            raise UnsupportedSourceError(
                f"{url!r}: a repository name holding '--' or '..', which the Hub refuses (the "
                "cache would keep 'a/b--c' and 'a--b/c' in one folder)"
            )
        return cls(repo_type, repo_id, revision, path)

    def address(self, revision: str | None = None) -> str:
        """The ``hf://`` address of this file, at ``revision`` (default: its own)."""
        revision = self.revision if revision is None else revision
        prefix = "datasets/" if self.repo_type == "dataset" else ""
        at = "" if revision == DEFAULT_REVISION else "@" + quote(revision, safe="")
        return f"hf://{prefix}{self.repo_id}{at}/{self.path}"

    def resolve_url(self, endpoint: str, revision: str | None = None) -> str:
        """The Hub's URL for this file, at ``revision`` (default: its own): the Hub serves the
        file or redirects to where it is."""
        revision = self.revision if revision is None else revision
        prefix = "/datasets" if self.repo_type == "dataset" else ""
        return (
            f"{endpoint.rstrip('/')}{prefix}/{quote(self.repo_id)}/resolve/"
            f"{quote(revision, safe='')}/{quote(self.path)}"
        )


def _setting(environ: Mapping[str, str] | None, name: str) -> str:
    """Variable ``name`` of ``environ`` (``os.environ`` when None), "" when unset;
    :class:`~stream_st.ArgumentTypeError` for an ``environ`` that is no mapping or holds other
    than a str there (they failed as a bare ``AttributeError``)."""
    env = os.environ if environ is None else environ
    if not isinstance(env, Mapping):
        raise ArgumentTypeError(
            f"environ takes a mapping of variable names to values or None (os.environ), "
            f"got {type(env).__name__}"
        )
    value = env.get(name, "")
    if not isinstance(value, str):
        raise ArgumentTypeError(f"environ[{name!r}] must be a str, got {type(value).__name__}")
    return value


def hub_endpoint(environ: Mapping[str, str] | None = None) -> str:
    """The Hub's base URL: ``HF_ENDPOINT``, else the public Hub."""
    return (_setting(environ, "HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hub_token(environ: Mapping[str, str] | None = None) -> str | None:
    """The token to send to the Hub: ``HF_TOKEN``, else the token file in ``HF_HOME``; None
    when neither holds one. A token holding a line break or another control character (it would
    inject a header) is a :class:`~stream_st.UsageError` naming where it came from."""
    token = _setting(environ, "HF_TOKEN").strip()
    if token:
        return checked_token(token, "HF_TOKEN")
    home = _setting(environ, "HF_HOME") or os.path.join(
        _setting(environ, "XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "huggingface"
    )
    path = Path(home, "token")
    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return checked_token(token, str(path)) if token else None


def checked_token(token: object, where: str = "token=") -> str:
    """``token`` if it is a str a header can carry; :class:`~stream_st.ArgumentTypeError` for
    another type, :class:`~stream_st.UsageError` for a control character (a line break would
    inject a header). The token itself is never shown."""
    if not isinstance(token, str):
        raise ArgumentTypeError(f"a Hub token is a str, not {type(token).__name__} ({where})")
    problem = credential_problem(token)
    if problem is not None:
        raise UsageError(f"the Hub token from {where} holds {problem}")
    return token


def _origin(url: str) -> tuple[str, str, int] | None:
    """The origin (scheme, host, port) a request to ``url`` goes to, as the client connects to
    it; None for a URL too broken to tell (its request fails later, with a clear error)."""
    try:
        return Target.parse(url).origin
    except SafetensorsError:
        return None


class HubClient(HTTPClient):
    """An HTTP client that sends the Hub's token to the Hub's origin and nowhere else.

    While ``HF_HUB_OFFLINE`` is set a request to the Hub is a
    ``CacheMissError`` (a ``SourceNotFoundError``), none goes out. A request to the Hub carries
    ``Authorization: Bearer <token>`` and never follows a redirect
    by itself (the caller decides where to go next, without the token); requests elsewhere (the
    CDN a file is served from) go without any header that proves who asks (the caller's
    ``Authorization``, ``Cookie``, ``x-amz-*``...), as a redirect to another origin drops them.
    """

    def __init__(self, endpoint: str, token: str | None) -> None:
        super().__init__()
        self._hub = _origin(endpoint)
        self._token = token
        self._offline = hub_offline()  # HF_HUB_OFFLINE: the Hub is never asked

    def on_hub(self, url: str) -> bool:
        """Whether ``url`` is on the Hub's origin (scheme, host and port)."""
        origin = _origin(url)
        return origin is not None and origin == self._hub

    @property
    def has_token(self) -> bool:
        """Whether the client was given a token to send to the Hub."""
        return self._token is not None

    async def request(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str] | None = None,
        body: bytes | None = None,
        *,
        follow_redirects: bool = True,
        clock: Clock | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> Response:
        if self.on_hub(url):
            if self._offline:  # a read that no cache answered (a process group's, say)
                raise CacheMissError(
                    f"{url}: HF_HUB_OFFLINE is set, so the Hub is not asked; read it once "
                    "online with cache= to keep a copy (read offline from then on)",
                    url=url,
                )
            follow_redirects = False
            if self._token is not None:
                headers = {**(headers or {}), "Authorization": f"Bearer {self._token}"}
        elif headers:  # the CDN: another origin, which a caller's credentials never reach
            headers = {k: v for k, v in headers.items() if not credential_header(k)}
        return await super().request(
            method,
            url,
            headers,
            body,
            follow_redirects=follow_redirects,
            clock=clock,
            ssl_context=ssl_context,
        )


class HubSource(HttpSource):
    """A file in a Hub repository, named by an ``hf://`` address (see the module docstring).

    ``endpoint`` and ``token`` default to the environment's (:func:`hub_endpoint`,
    :func:`hub_token`); ``token=""`` sends none. The other options are
    :class:`~stream_st.HttpSource`'s. After the first request, ``commit`` holds the commit the
    Hub served the file from (``X-Repo-Commit``), when it said: every later request to the Hub
    asks at that commit; ``etag``, the file's ETag the Hub named (``hub_etag``). Either set
    before the read (as the cache does from its ``HEAD``) holds its answers to it.
    """

    def __init__(
        self,
        url: str,
        *,
        endpoint: str | None = None,
        token: str | None = None,
        retries: int = 3,
        backoff: float = 0.25,
        concurrency: int | None = None,
        part_size: int = 8 << 20,
        **limits: Unpack[LimitOptions],
    ) -> None:
        self.file = HubFile.parse(url)
        if endpoint is not None and not isinstance(endpoint, str):
            raise ArgumentTypeError(f"endpoint is a URL (str), not {type(endpoint).__name__}")
        endpoint = hub_endpoint() if endpoint is None else endpoint.rstrip("/")
        token = hub_token() if token is None else checked_token(token) or None
        self._hub = HubClient(endpoint, token)
        self._endpoint = endpoint
        self.commit: str | None = None
        self.sha256: str | None = None  # the file's SHA-256, if the Hub said (X-Linked-Etag)
        self.etag: str | None = None  # the file's ETag, if the Hub said (see hub_etag)
        super().__init__(
            self._resolve_url,
            client=self._hub,
            retries=retries,
            backoff=backoff,
            concurrency=concurrency,
            part_size=part_size,
            name=url,
            **limits,
        )
        self._owns_client = True
        self._resolving = anyio.Lock()

    @property
    def _resolve_url(self) -> str:
        """Where the Hub is asked for the file: at the commit it was first served from, once
        known (a branch that moved meanwhile is not followed), else at the address's revision."""
        return self.file.resolve_url(self._endpoint, self.commit)

    @property
    def home(self) -> str:
        return self.pinned

    @property
    def pinned(self) -> str:
        """This file's ``hf://`` address at the commit it was read from (once known), so that
        files next to it are read from that same commit."""
        return self.name if self.commit is None else self.file.address(self.commit)

    async def _get(self, start: int, end: int | None) -> Response | None:
        """GET the range from where the file is: the Hub's answer until it redirects elsewhere,
        then the resolved URL, resolved again when it has expired."""
        renewed = False
        while True:
            url = self.url
            if self._hub.on_hub(url):
                async with self._resolving:  # one resolution at a time; the rest use its URL
                    if self.url == url:
                        response = await self._resolve(start, end)
                        if self._hub.on_hub(self.url):
                            return response  # the Hub serves this file itself
                continue
            try:
                return await super()._get(start, end)
            except HTTPStatusError as exc:
                if exc.status not in _EXPIRED or renewed:
                    raise
            renewed = True
            if self.url == url:  # the signed URL expired: ask the Hub again
                self.url = self._resolve_url

    async def _accept(self, response: Response, position: int) -> Response:
        """A redirect from the Hub is its resolution, for :meth:`_resolve` to follow; any other
        answer is checked as :class:`~stream_st.HttpSource` checks it."""
        if response.status in REDIRECTS and self._hub.on_hub(self.url):
            return response
        return await super()._accept(response, position)

    async def _resolve(self, start: int, end: int | None) -> Response | None:
        """Ask the Hub for the range; follow its redirects within the Hub. Returns the Hub's own
        answer, or None once ``url`` is the place elsewhere it redirected to. Its redirects are
        held to the client's policy (``stream_st.transports.http.redirect``): no downgrade to plain
        http,
        no unusable ``Location``. It asks at the commit first served from, once known, where it
        would ask at the address's revision (a URL the Hub redirected to within itself is kept:
        its answers are held to that commit too, by :meth:`_check_version`)."""
        if self.url == self.file.resolve_url(self._endpoint, None):
            self.url = self._resolve_url
        for _ in range(MAX_HUB_HOPS + 1):
            try:
                response = await super()._get(start, end)
            except HTTPStatusError as exc:
                if exc.status in _REFUSED:
                    raise self._refused(exc.status) from None
                raise
            if response is None:
                return None
            await self._check_version(response, start)
            location = response.headers.get("location")
            if response.status not in REDIRECTS or not location:
                return response
            await response.discard()
            self.url = redirected(Target.parse(self.url), location, {})[0].url
            if not self._hub.on_hub(self.url):
                return None
        raise TransportError(f"more than {MAX_HUB_HOPS} redirects within the Hub", url=self.name)

    async def _check_version(self, response: Response, position: int) -> None:
        """Take the commit (``X-Repo-Commit``), SHA-256 (``X-Linked-Etag``) and ETag
        (``hub_etag``) the Hub's answer names; :class:`SourceChangedError` (``response``
        closed) where one differs from what an earlier answer of this read named, or what was
        set before it (:attr:`commit`, :attr:`etag`)."""
        headers = response.headers
        commit = headers.get("x-repo-commit") or None
        sha256 = _sha256_of(headers.get("x-linked-etag", ""))
        etag = hub_etag(headers) or None
        for what, first, now in (
            ("commit", self.commit, commit),
            ("SHA-256", self.sha256, sha256),
            ("ETag", self.etag, etag),
        ):
            if first is not None and now is not None and now != first:
                await response.aclose()
                raise SourceChangedError(
                    f"the file changed on the Hub during the read: {what} {first}, then {now}",
                    url=self.name,
                    position=position,
                )
        self.commit = self.commit or commit
        self.sha256 = self.sha256 or sha256
        self.etag = self.etag or etag

    async def object_digest(self) -> ObjectDigest | None:
        """The file's SHA-256 from the Hub (``X-Linked-Etag``, an LFS file's oid), if it gave
        one."""
        if self.sha256 is None:
            return None
        return ObjectDigest(
            "the Hub's SHA-256 (X-Linked-Etag)", bytes.fromhex(self.sha256), hashlib.sha256
        )

    def _refused(self, status: int) -> HTTPStatusError:
        """The one-line error for a Hub that refused the file (401/403)."""
        if self._hub.has_token and status == 401:  # the Hub's answer for a missing repository
            hint = (
                "the repository does not exist (check its name), or the token was refused or has "
                "no access to it"
            )
        elif self._hub.has_token:
            hint = (
                "the token was refused or has no access to this repository (a gated one needs "
                "its terms accepted on the Hub)"
            )
        else:
            hint = (
                "the repository is private or gated, or does not exist: set HF_TOKEN or log in "
                "with `hf auth login` to send a token"
            )
        reason = "Unauthorized" if status == 401 else "Forbidden"
        return HTTPStatusError(status, reason, url=self.name, detail=hint)


def hub_etag(headers: Mapping[str, str]) -> str:
    """The file's ETag an answer of the Hub names, as the Hugging Face cache names its blob
    (and ``huggingface_hub`` reads it): ``X-Linked-Etag`` (an LFS file's SHA-256), else
    ``ETag``, with no ``W/`` and no quotes; "" when none."""
    value = headers.get("x-linked-etag") or headers.get("etag") or ""
    return value.removeprefix("W/").strip().strip('"')


def _sha256_of(etag: str) -> str | None:
    """The SHA-256 an ``X-Linked-Etag`` holds (64 hex digits, quoted), or None."""
    value = etag.removeprefix("W/").strip('"').lower()
    if len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return value
    return None


async def source_for(url: str, clock: Clock) -> Source:
    """The registry's factory: an ``hf://`` file on the Hugging Face Hub."""
    return HubSource(url)
