"""A fake Hugging Face Hub on 127.0.0.1 and its CDN on 127.0.0.2, for tests and measurements.

Both are :class:`~tests.servers.http_server.RangeHTTPServer` s (real sockets, threads, keep-alive,
Range)
that answer the way the Hub and its CDN do:

* the Hub answers ``GET``/``HEAD`` of ``/{org}/{repo}/resolve/{revision}/{path}`` (datasets:
  ``/datasets/{org}/{repo}/resolve/...``; a revision with ``/`` comes percent-encoded, e.g.
  ``refs%2Fpr%2F1``). An LFS file (``*.safetensors``) is answered ``302`` to the CDN with a signed,
  expiring query (``?expires=...&sig=...``) and ``X-Linked-Etag`` (its sha256), ``X-Linked-Size``,
  ``X-Repo-Commit``; any other file is served by the Hub itself (200/206, ``ETag``,
  ``X-Repo-Commit``). A private repo asked without its token is ``401``; a gated one asked with a
  token that was not granted access is ``403``; an unknown repo, revision or file is ``404``.
  A renamed repository (``renamed[(kind, old)] = new``) is answered ``307`` to its new name,
  with a relative ``Location``, as the Hub does.
* the CDN serves each LFS file at ``/{sha256}`` with Range, only with a valid signature:
  :meth:`FakeHub.expire` (or ``expire_after`` GETs) makes every URL signed so far answer
  ``expired_status`` (403, as CloudFront does; 410 also happens), with no ``ETag``; with
  ``cdn_etag``, the objects it serves carry one (their sha256), as CloudFront's do.

Every request to either is logged in :attr:`FakeHub.log` with its host and headers.

    with FakeHub() as hub:
        commit = hub.push("org/model", {"model.safetensors": data})
        hub.endpoint                       # http://127.0.0.1:PORT, for HF_ENDPOINT
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, quote, unquote

from .http_server import RangeHTTPServer

CDN_HOST = "127.0.0.2"
SIGNED_FOR = 3600.0
"""Seconds a signed CDN URL stays valid (unless expired by hand)."""


@dataclass(frozen=True)
class Seen:
    """One request as a server received it."""

    host: str  # the server's address: 127.0.0.1 (Hub) or 127.0.0.2 (CDN)
    method: str
    path: str  # as sent, still percent-encoded
    query: str
    headers: dict[str, str]  # names in lower case

    @property
    def range(self) -> str:
        return self.headers.get("range", "")


@dataclass
class Repo:
    """A repository: commits (each a full set of files) and refs naming them."""

    private: bool = False
    gated: bool = False
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)


@dataclass
class _Request:
    """A request being answered, and the connection to answer on."""

    connection: Any
    reader: Any
    method: str
    path: str
    query: str
    headers: dict[str, str]


class _Server(RangeHTTPServer):
    """A RangeHTTPServer that logs headers too and can add headers to the answers it serves."""

    def __init__(self, hub: FakeHub, host: str) -> None:
        super().__init__(host=host)
        self.hub = hub
        self._extra = threading.local()  # headers for the answer being sent on this thread

    def _answer(
        self, connection: Any, reader: Any, method: str, target: str, headers: dict[str, str]
    ) -> bool:
        path, _, query = target.partition("?")
        self.hub.log.append(Seen(self.host, method, path, query, dict(headers)))
        return self._route(_Request(connection, reader, method, path, query, headers))

    def _route(self, request: _Request) -> bool:
        raise NotImplementedError

    def _serve_object(self, request: _Request, key: str, extra: dict[str, str]) -> bool:
        """Serve ``objects[key]`` (Range and all) with ``extra`` headers."""
        self._extra.headers = extra
        try:
            return super()._answer(
                request.connection, request.reader, request.method, key, request.headers
            )
        finally:
            self._extra.headers = {}

    def _validators(self, path: str) -> dict[str, str]:
        """The object's own ETag (its sha256, among the ``extra`` headers) is the one conditional
        requests are checked against."""
        extra = getattr(self._extra, "headers", {})
        return {**super()._validators(path), **{k: v for k, v in extra.items() if k == "ETag"}}

    def _reply(self, request: _Request, status: int, headers: dict[str, str], body: bytes) -> bool:
        """A small answer of its own: ``status`` with ``headers`` and ``body``."""
        connection = request.connection
        self._send_head(connection, status, {**headers, "Content-Length": str(len(body))})
        if request.method != "HEAD":
            connection.sendall(body)
        return True

    def _send_head(self, connection: Any, status: int, headers: dict[str, str]) -> None:
        extra = getattr(self._extra, "headers", {})
        super()._send_head(connection, status, {**headers, **extra})


class _HubServer(_Server):
    def _route(self, request: _Request) -> bool:
        hub = self.hub
        parts = request.path.lstrip("/").split("/")
        kind = "dataset" if parts[0] == "datasets" else "model"
        parts = parts[1:] if kind == "dataset" else parts
        if len(parts) < 5 or parts[2] != "resolve" or request.method not in ("GET", "HEAD"):
            return self._error(request, 404, "EntryNotFound", "no such route")
        repo_id = unquote(parts[0]) + "/" + unquote(parts[1])
        moved_to = hub.renamed.get((kind, repo_id))
        if moved_to is not None:  # the Hub sends a renamed repository's clients on, relatively
            prefix = "/datasets" if kind == "dataset" else ""
            location = f"{prefix}/{moved_to}/" + "/".join(parts[2:])
            return self._reply(request, 307, {"Location": location}, b"Moved")
        revision, file = unquote(parts[3]), unquote("/".join(parts[4:]))
        repo = hub.repos.get((kind, repo_id))
        token = request.headers.get("authorization", "").removeprefix("Bearer ")
        if repo is None or (repo.private and token != hub.token):
            return self._error(request, 401, "RepoNotFound", "Repository not found")
        if repo.gated and token not in hub.granted:
            status = 403 if token else 401
            return self._error(request, status, "GatedRepo", "Access to it is gated")
        commit = repo.refs.get(revision, revision)
        files = repo.commits.get(commit)
        if files is None:
            return self._error(request, 404, "RevisionNotFound", "Invalid rev id")
        data = files.get(file)
        if data is None:
            return self._error(request, 404, "EntryNotFound", "Entry not found")
        sha = hashlib.sha256(data).hexdigest()
        common = {"X-Repo-Commit": commit, "ETag": f'"{sha}"'}
        if not hub.is_lfs(file):
            self.objects[f"/{sha}"] = data
            return self._serve_object(request, f"/{sha}", common)
        location = hub.sign(sha)
        return self._reply(
            request,
            302,
            {
                **common,
                "Location": location,
                "X-Linked-Etag": f'"{sha}"',
                "X-Linked-Size": str(len(data)),
            },
            f"Found. Redirecting to {location}".encode(),
        )

    def _error(self, request: _Request, status: int, code: str, text: str) -> bool:
        body = f'{{"error":"{text}"}}'.encode()
        headers = {"X-Error-Code": code, "X-Error-Message": text}
        return self._reply(request, status, headers, body)


class _CdnServer(_Server):
    def _route(self, request: _Request) -> bool:
        hub = self.hub
        if not hub.signature_valid(request.path, request.query):
            body = b"<Error><Code>AccessDenied</Code><Message>Request has expired</Message></Error>"
            return self._reply(request, hub.expired_status, {}, body)
        named = {"ETag": f'"{request.path.lstrip("/")}"'} if hub.cdn_etag else {}
        served = self._serve_object(request, request.path, named)
        if request.method == "GET" and hub.expire_after is not None:
            hub.expire_after -= 1
            if hub.expire_after == 0:  # every URL signed so far expires now
                hub.expire_after = None
                hub.expire()
        return served


class FakeHub:
    """The Hub (``127.0.0.1``) and its CDN (``127.0.0.2``); see the module docstring.

    ``token`` opens the private repos; ``granted`` lists the tokens that were given access to the
    gated ones. ``is_lfs(path)`` tells which files live on the CDN.
    """

    def __init__(self, *, token: str = "hf_secret_token") -> None:
        self.token = token
        self.granted: set[str] = {token}
        self.repos: dict[tuple[str, str], Repo] = {}
        self.renamed: dict[tuple[str, str], str] = {}
        self.log: list[Seen] = []
        self.expired_status = 403
        self.expire_after: int | None = None
        self.cdn_etag = False  # the CDN names each object's version with an ETag (CloudFront)
        self._key = b"cdn-signing-key"
        self._generation = 0
        self.hub = _HubServer(self, "127.0.0.1")
        self.cdn = _CdnServer(self, CDN_HOST)

    @staticmethod
    def is_lfs(path: str) -> bool:
        return path.endswith(".safetensors")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.hub.port}"

    def push(
        self,
        repo_id: str,
        files: dict[str, bytes],
        *,
        repo_type: str = "model",
        revision: str = "main",
        private: bool = False,
        gated: bool = False,
    ) -> str:
        """Commit ``files`` (over the files ``revision`` holds) and point ``revision`` at it;
        returns the commit's id. The first push creates the repository."""
        repo = self.repos.setdefault((repo_type, repo_id), Repo(private=private, gated=gated))
        before = repo.commits.get(repo.refs.get(revision, ""), {})
        merged = {**before, **files}
        digest = hashlib.sha1(repr((repo_id, revision, len(repo.commits))).encode())
        for name in sorted(merged):
            digest.update(name.encode() + b"\0" + merged[name])
        commit = digest.hexdigest()
        repo.commits[commit] = merged
        repo.refs[revision] = commit
        for data in merged.values():
            self.cdn.objects[f"/{hashlib.sha256(data).hexdigest()}"] = data
        return commit

    def url(self, repo_id: str, path: str, *, revision: str = "main", kind: str = "model") -> str:
        """The resolve URL of ``path`` (what the Hub's clients ask for)."""
        prefix = "/datasets" if kind == "dataset" else ""
        return f"{self.endpoint}{prefix}/{repo_id}/resolve/{quote(revision, safe='')}/{path}"

    # ---------------------------------------------------------------- signed CDN URLs

    def _signature(self, path: str, expires: str) -> str:
        message = f"{path}\n{expires}\n{self._generation}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def sign(self, sha: str) -> str:
        """A signed CDN URL for the object ``sha``, valid for :data:`SIGNED_FOR` seconds."""
        expires = str(int(time.time() + SIGNED_FOR))
        path = f"/{sha}"
        signature = self._signature(path, expires)
        return f"http://{CDN_HOST}:{self.cdn.port}{path}?expires={expires}&sig={signature}"

    def signature_valid(self, path: str, query: str) -> bool:
        fields = parse_qs(query)
        expires = fields.get("expires", ["0"])[0]
        signature = fields.get("sig", [""])[0]
        fresh = expires.isdigit() and int(expires) > time.time()
        return fresh and hmac.compare_digest(signature, self._signature(path, expires))

    def expire(self) -> None:
        """Every CDN URL signed so far expires now."""
        self._generation += 1

    # ---------------------------------------------------------------- requests seen

    def settle(self) -> None:
        """Wait until neither server is answering, so :attr:`log` is complete."""
        self.hub.settle()
        self.cdn.settle()

    def seen(self, host: str | None = None, method: str | None = None) -> list[Seen]:
        """The requests logged so far, to ``host`` and of ``method`` if given."""
        self.settle()
        return [
            r
            for r in self.log
            if (host is None or r.host == host) and (method is None or r.method == method)
        ]

    def start(self) -> FakeHub:
        self.cdn.start()
        self.hub.start()
        return self

    def stop(self) -> None:
        self.hub.stop()
        self.cdn.stop()

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
