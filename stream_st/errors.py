"""The exceptions stream_st raises, all in one place.

Every error raised for bad data or misuse derives from :class:`SafetensorsError`::

    SafetensorsError                  root: catch this to catch everything below
    ├── HeaderError                   the 8-byte length or the JSON header breaks the format
    │   ├── HeaderTooLargeError       the declared header length exceeds the configured limit
    │   └── UnknownDtypeError         a dtype code stream_st cannot read (also a DtypeError)
    ├── TruncatedStreamError          the source ended before the bytes the header promised
    ├── TrailingDataError             a whole object carries bytes after its last tensor
    ├── TensorNotFoundError           a requested tensor name is not in the header (also KeyError)
    ├── DtypeError                    a dtype code or numpy dtype that safetensors cannot carry
    ├── CodecError                    a tensor a KV codec cannot carry, or parts it cannot decode
    ├── DistributedError              a load over a torch.distributed group failed on some rank
    │   ├── RankFailedError           that rank reported the failure (its source, selection, ...)
    │   └── RankLostError             a collective failed: a rank died, hung or lost the network
    ├── UnsupportedSourceError        `open_stream` cannot tell how to read the given object
    ├── UnsupportedSinkError          `open_writer` cannot tell how to write to the given object
    ├── UsageError                    the API was used out of order (e.g. header before open)
    │   ├── ArgumentTypeError         an argument of the wrong type: a tensor name that is not a
    │   │                             string, a shape not of integers (also TypeError)
    │   ├── DeviceError               a device= torch cannot parse, "cuda:x", or a CPU but the
    │   │                             one, "cpu:1" (also ValueError)
    │   ├── UnsupportedDeviceError    a device= neither the CPU nor CUDA: "xla", "mps", "meta"
    │   │                             (also NotImplementedError)
    │   ├── UnsupportedFrameworkError a framework= of the reference's but "pt" and "np":
    │   │                             "flax", "tf", "mlx", "paddle" (also ImportError)
    │   └── CredentialsError          no credentials for a remote store, or its configuration
    │                                 (profile, files, credential process) is broken
    ├── AllocationError               a tensor could not be allocated (also MemoryError)
    ├── WriterError                   a writer used against its plan: unknown or repeated name,
    │                                 wrong dtype or shape, out of order on a stream, more or
    │                                 fewer bytes than planned, a tensor unwritten at close
    ├── IntegrityError                bytes do not match their recorded digest (a tensor's, a
    │                                 KV layer's, the whole object's): they are not delivered
    ├── ModelError                    weights or inputs that do not make a model of
    │                                 ``stream_st.llm`` or ``stream_st.bert`` (also ValueError)
    └── TransportError                the underlying I/O failed; carries the URL and position
        ├── SourceNotFoundError       the file or object does not exist (also FileNotFoundError)
        │   └── CacheMissError        offline, and no verified local copy of the object
        ├── HTTPStatusError           the server answered with an error status (``.status``)
        │   └── HTTPNotFoundError     HTTP 404 (also a SourceNotFoundError)
        ├── HTTPProtocolError         an answer that breaks HTTP or does not match the request
        ├── CertificateError          the server's TLS certificate failed verification
        ├── SourceChangedError        the object changed on the server during one read
        ├── ReadTimeoutError          a peer or server sent nothing for too long, the deadline
        │                             passed or the transfer stayed below the speed limit
        │                             (also TimeoutError)
        └── OutcomeUnknownError       a write's final answer was lost: the object may or may not
                                      have been stored at the destination

Messages name the tensor, the offsets and what was expected. They never show a secret an address
carries: every message and every address an error holds passes through ``redact`` (a URL's
password, a pre-signed URL's signature and credential), and so does every transport's ``name``.
"""

from __future__ import annotations

import operator
import os
import re
import reprlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

from ._regex import LazyPattern

__all__ = [
    "AllocationError",
    "ArgumentTypeError",
    "CacheMissError",
    "CacheWarning",
    "CertificateError",
    "CodecError",
    "CredentialsError",
    "DeviceError",
    "DistributedError",
    "DtypeError",
    "HTTPNotFoundError",
    "HTTPProtocolError",
    "HTTPStatusError",
    "HeaderError",
    "HeaderTooLargeError",
    "IntegrityError",
    "ModelError",
    "OutcomeUnknownError",
    "RangeIgnoredWarning",
    "RankFailedError",
    "RankLostError",
    "ReadTimeoutError",
    "SafetensorsError",
    "SourceChangedError",
    "SourceNotFoundError",
    "StreamStWarning",
    "TensorNotFoundError",
    "TrailingDataError",
    "TransportError",
    "TruncatedStreamError",
    "UnknownDtypeError",
    "UnsupportedDeviceError",
    "UnsupportedFrameworkError",
    "UnsupportedSinkError",
    "UnsupportedSourceError",
    "UsageError",
    "WriterError",
    "redact",
]

# ---------------------------------------------------------------- what a message may show

_SCHEME_SOURCE = r"(?<![A-Za-z0-9+.-])[0-9+.-]*+[A-Za-z][A-Za-z0-9+.-]*+://"
"""A scheme and its ``://``, read from the start of the run of characters a scheme may hold
(what comes before a letter there, ``1.`` in ``1.http://``, taken with it): one try a run, in
time linear in the text (tried from every word boundary of a run, ``a.a.a...``, as ``\\b``
would, it was quadratic: seconds for an error page of 64 KiB)."""

_SCHEME = LazyPattern(_SCHEME_SOURCE)

_USER = LazyPattern(r"[^/?#:]*")

_AUTHORITY = LazyPattern(r"[^/?#]*")


class _Reading(NamedTuple):
    """Where the parts of an address end, as :func:`redact` reads them: in a text quoting
    addresses (:data:`_IN_TEXT`), or in a text that is one address (:data:`_ONE_ADDRESS`)."""

    userinfo: LazyPattern[str]
    """``scheme://userinfo@``: the userinfo runs to the last ``@`` before the path, as URL
    parsers read it (a password with an unescaped ``@`` in it included)."""

    token: LazyPattern[str]
    """A run of text an address may fill."""

    chunk: LazyPattern[str]
    """What follows a ``?``, ``&``, ``;`` or ``#`` (``#access_token=...``: OAuth's implicit flow
    puts a token in the fragment) up to the next: a query's or fragment's parameter, a server
    splitting at ``;`` as at ``&``."""

    value: LazyPattern[str]
    """A parameter's value: up to the next ``&`` or ``#``, a ``;`` included (a server splitting
    the query at ``&`` alone reads it whole)."""


_CLOSING_SOURCE = r"(?:[,:)\]}]|[),.:;\]}]*+(?:[\s<>]|$))"
"""What follows a quote that closes a text's quoting (``repr``, JSON, markup): white space, an
angle bracket or the end, after any closing punctuation (``'...?token=abc'),``), or a ``,``,
``:``, ``)``, ``]`` or ``}`` (compact JSON, ``{"url":"...","email":"..."}``)."""

_IN_TEXT = _Reading(
    userinfo=LazyPattern(
        rf"(?P<scheme>{_SCHEME_SOURCE})(?P<userinfo>(?:[^/?#\s'\"]|['\"](?!{_CLOSING_SOURCE}))*)@"
    ),
    token=LazyPattern(rf"(?:[^\s'\"]|['\"](?!{_CLOSING_SOURCE}))+"),
    chunk=LazyPattern(r"[?&#;](?P<chunk>[^?&#;\s<>]*)"),
    value=LazyPattern(rf"(?:[^&#\s<>'\":]|:(?!\s)|['\"](?![&#'\"]|{_CLOSING_SOURCE}))*"),
)
"""An address a text quotes ends at white space, and a ``:`` right before it is the text's
(``{address}: reason``), not a parameter's value. A quote in a password or a parameter's value
is theirs (RFC 3986 allows ``'`` in both), unless it closes the text's quoting of the address
(:data:`_CLOSING_SOURCE`): a password does not run on into the next field of compact JSON
(``"url":"http://h","email":"a@b.c"``). An angle bracket is a password's too, and ends a
parameter (markup around the address)."""

_ONE_ADDRESS = _Reading(
    userinfo=LazyPattern(rf"(?P<scheme>{_SCHEME_SOURCE})(?P<userinfo>[^/?#]*)@"),
    token=LazyPattern(r".+"),
    chunk=LazyPattern(r"[?&#;](?P<chunk>[^?&#;]*)"),
    value=LazyPattern(r"[^&#]*"),
)
"""A text that is one address (:func:`_one_address`) is read whole: a space, a tab, a quote or
an angle bracket in a password or a parameter is theirs, as URL parsers read them."""


def _one_address(text: str) -> bool:
    """Whether :func:`redact` reads ``text`` as one address, white space and all (a
    transport's name, an error's ``url``): it starts with ``scheme://``, holds no line break
    but in a userinfo with no space in it (before the last ``@`` of its authority: URL parsers
    drop a line break, and a password read from a file keeps its newline; a line
    ``http://h:80 refused`` before one with an ``@`` in it is a text's), and nothing masked (a
    message quoting a name, ``{name}: ...``, is a text)."""
    if MASK in text or "://" not in text or not text[0].isalpha():
        return False
    scheme = _SCHEME.compiled.match(text)
    if scheme is None:
        return False
    authority = _AUTHORITY.compiled.match(text, scheme.end())
    assert authority is not None  # it matches the empty string
    host = max(text.rfind("@", scheme.end(), authority.end()) + 1, scheme.end())
    if text.find("\n", host) >= 0 or text.find("\r", host) >= 0:
        return False
    userinfo = text[scheme.end() : host]
    broken = "\n" in userinfo or "\r" in userinfo
    return not broken or (" " not in userinfo and "\t" not in userinfo)


_QUOTED = LazyPattern(
    r"(?<!\\)(?P<quote>['\"])(?P<address>[A-Za-z][A-Za-z0-9+.-]*+://"
    rf"(?:(?!(?P=quote))[^\\\r\n]|\\.)*+)(?P=quote)(?={_CLOSING_SOURCE})"
)
"""An address a text quotes as ``repr`` and JSON do: from a quote to the next one of its kind
on its line (but an escaped one, ``\\'``), where that one closes the quoting
(:data:`_CLOSING_SOURCE`: ``'...'),``, ``{"url":"...","a":1}``). :func:`redact`
reads it whole: a space in its password or in a parameter's value is theirs (``invalid URL
'http://a:it s@h:99999/m'``). Each try stops at the next quote of its kind, where the next try
starts: linear time."""


def _mask_cut_short(text: str, reading: _Reading) -> str:
    """``text`` with the password of an address whose authority (up to the first ``/``, ``?``
    or ``#``) holds a ``:`` and no ``@`` masked from that ``:`` to the last ``@`` of the run it
    is in: a password with an unescaped ``/``, ``?`` or ``#`` in it, which URL parsers read as
    a host and port (a port followed by a path with an ``@`` in it is masked too). In time
    linear in the text: each run's last ``@`` is found once, each authority scanned once (a
    pattern running to the last ``@`` from every address took quadratic time, seconds for an
    error page of 64 KiB). ``reading``: where an address ends."""
    pieces: list[str] = []
    done = 0
    for token in reading.token.compiled.finditer(text):
        last = text.rfind("@", token.start(), token.end())
        if last < 0:
            continue
        for scheme in _SCHEME.compiled.finditer(text, token.start(), last):
            user = _USER.compiled.match(text, scheme.end(), last)
            authority = _AUTHORITY.compiled.match(text, scheme.end(), last)
            assert user is not None and authority is not None  # both match the empty string
            if text[user.end()] == ":" and "@" not in authority[0]:  # "@" there: masked above
                pieces += [text[done : user.end() + 1], MASK]
                done = last
                break
    return "".join(pieces) + text[done:] if pieces else text


_DECODED_PARAMETER = LazyPattern(
    r"(?:^|%26|%3[Bb])(?P<name>(?:[^=%]|%(?!26|3[BbDd]))*)(?P<equals>=|%3[Dd])?"
)
"""A parameter within a chunk as a server decoding the query before splitting it reads it:
``%26`` and ``%3B`` split as ``&`` and ``;``, ``%3D`` ends a name as ``=``."""

_SECRET_WORDS = ("signature", "credential", "token", "secret", "password", "passwd", "apikey")
"""A query parameter whose name holds one of these (any case) carries a secret: ``X-Amz-Signature``,
``X-Amz-Credential``, ``X-Amz-Security-Token``, ``X-Goog-Signature``, ``access_token``..."""

MASK = "***"
"""What stands for a secret in a message."""

_AUTHORIZATION = LazyPattern(
    r"\b(?P<scheme>Bearer|BEARER|Basic|BASIC)(?P<gap>[ \t]+)"
    r"(?P<value>[A-Za-z0-9._~+/-]{8,}=*)(?![\w=~+/.-])"
    r"|\b(?P<aws>AWS4-HMAC-SHA256)[ \t]++"
    r"(?:(?!AWS4-HMAC-SHA256)[^\r\n'\"<>])*?Signature=[0-9A-Fa-f]+"
)
"""The credentials of an ``Authorization`` value quoted in a text without its header's name (an
error page echoing the request as a table): a ``Bearer`` token of 8 characters or more (not
``Bearer realm=``), a ``Basic`` user and password (a value with a digit in it, of 20 characters
or more, or Base64 of ``user:password``: not ``Basic authentication``), either scheme spelt so
or in capitals (``bearer``, ``basic`` alone are words: a tensor ``basic model.layers.0.weight``),
or an AWS signature with its key id (looked for up to the end of its line or the next
``AWS4-HMAC-SHA256``: from each of them to the end of the line took quadratic time). Quoted with
its name, ``Authorization: ...``, a value of a known scheme in any case, or a credential's of
none, is masked (:data:`_HEADER`)."""


SECRET_HEADERS = (
    "x-amz-security-token",
    "x-goog-security-token",
    "proxy-authorization",
    "cookie",
    "x-api-key",
    "api-key",
    "private-token",
    "x-auth-token",
    "x-amz-server-side-encryption-customer-key",
    "x-amz-copy-source-server-side-encryption-customer-key",
)
"""Request headers, besides ``Authorization``, whose value is a credential (an SSE-C key given
in ``headers=``: whoever holds it reads the object; not its ``-MD5`` digest): masked where a
text quotes them, never sent to another origin on a redirect."""

_AUTHORIZATION_SCHEMES = (
    "Bearer",
    "Basic",
    "Digest",
    "Negotiate",
    "NTLM",
    "Kerberos",
    "token",
    "AWS4-HMAC-SHA256",
    "AWS",
    "SharedKeyLite",
    "SharedKey",
    "HOBA",
    "Mutual",
    "SCRAM-SHA-256",
    "SCRAM-SHA-1",
    "OAuth",
    "DPoP",
    "GNAP",
    "PrivateToken",
    "Concealed",
    "vapid",
)
"""The ``Authorization`` schemes a masked value keeps, to tell which credential it was: IANA's
registry's, and those of NTLM, GitHub (``token``), AWS and Azure (``SharedKey``)."""

_PROSE_WORD = r"(?-i:(?:[A-Z]?[a-z]{1,18}|[A-Z]{1,19})(?![A-Za-z])[,.;:!?]?(?=[\s\"']|$))"
"""A word of prose: under 20 letters, in lower case, capitalized or in capitals, before white
space, a quote or the end (after a punctuation mark): not a credential (``Authorization: the
signature does not match``)."""

_HEADER = LazyPattern(
    rf"(?i)\b(?P<name>(?P<authorization>authorization)|{'|'.join(SECRET_HEADERS)})"
    r"(?P<gap>[\"']?[ \t]*:[ \t]*)(?P<quote>[\"'])?"
    rf"(?(authorization)(?P<scheme>(?:{'|'.join(_AUTHORIZATION_SCHEMES)})[ \t]+)?"
    rf"(?(scheme)|(?!{_PROSE_WORD})))"
    r"(?(quote)(?:(?!(?P=quote))[^\\\r\n]|\\.)++(?P<closing>(?P=quote))?"
    r"|[^\s<>;\"'][^\r\n<>]*)"
)
"""A request header that carries a credential, quoted with its value in a text (an error page
echoing the request, as lines, as JSON or as a ``repr``, ``"Authorization": "..."``): the
caller's ``Authorization`` of any scheme (``token``, ``Digest``, ``Negotiate``...), a session
token stream_st sends with a signed request, a cookie, an API key given in ``headers=``. A value
in quotes runs to the quote that ends it (but an escaped one), the next fields of a dict kept;
another to the end of its line, quotes included (Digest's ``response="..."``). An
``Authorization`` value keeps its scheme if it is a known one (:data:`_AUTHORIZATION_SCHEMES`,
any case), and is masked whole if not (``sk-abc def``); without a scheme, one whose first word
is prose (:data:`_PROSE_WORD`) is the text's, not a credential, and kept."""


def _mask_header(match: re.Match[str]) -> str:
    """A credential header's value masked (see :data:`_HEADER`)."""
    parts = (match["quote"], match["scheme"], MASK, match["closing"])
    return match["name"] + match["gap"] + "".join(part or "" for part in parts)


def _mask_userinfo(match: re.Match[str]) -> str:
    user, colon, _ = match["userinfo"].partition(":")
    return f"{match['scheme']}{user}:{MASK}@" if colon else match[0]


def _plain_parameter(name: str) -> str:
    """A query parameter's name as the secret checks read it: lower case, no ``_`` nor ``-``."""
    return name.lower().replace("_", "").replace("-", "")


def _secret_parameter(name: str) -> bool:
    key = _plain_parameter(name)
    return key in ("sig", "key") or key.endswith("key") or any(w in key for w in _SECRET_WORDS)


def _key_parameter(name: str) -> bool:
    """Whether query parameter ``name`` is masked for its ``key`` ending alone (``key``,
    ``fileKey``; not ``api_key`` nor ``secret_key``, which hold a word of a secret): a name that
    names an object as often as it authorizes a request."""
    key = _plain_parameter(name)
    return key.endswith("key") and not any(w in key for w in _SECRET_WORDS)


def _mask_authorization(match: re.Match[str]) -> str:
    if match["aws"]:
        return f"{match['aws']} {MASK}"
    value = match["value"]
    if match["scheme"].lower() == "basic" and not (
        len(value) >= 20 or any(c.isdigit() for c in value) or _basic_pair(value)
    ):
        return match[0]  # a word ("Basic authentication"), not a credential
    return f"{match['scheme']}{match['gap']}{MASK}"


def _basic_pair(value: str) -> bool:
    """Whether ``value`` is Base64 of ``user:password``, as a ``Basic`` credential is."""
    import base64  # here: importing this module (every other does) stays cheap

    try:
        return b":" in base64.b64decode(value, validate=True)
    except ValueError:
        return False


def _mask_parameters(text: str, reading: _Reading) -> str:
    """``text`` with the value of each query or fragment parameter whose name is a secret's
    (:func:`_secret_parameter`) masked, the name read percent-decoded each way a reader may read
    it: as ``parse_qsl`` (and so the cache's key) does, up to the first ``=`` (``%74oken`` is
    ``token``, ``x%3Dtoken`` is ``x=token``), and as a server decoding the query first does
    (``a=1%26token%3D...`` holds ``token``); a value masked from the first place either reading
    starts it. ``reading``: where an address ends. In time linear in the text."""
    from urllib.parse import unquote_plus  # here: it imports ipaddress, ~5 ms

    pieces: list[str] = []
    done = start = 0
    while found := reading.chunk.compiled.search(text, start):
        chunk, begin = found["chunk"], found.start("chunk")
        start = found.end()
        equals = chunk.find("=")
        masked_from = None
        if equals >= 0 and _secret_parameter(unquote_plus(chunk[:equals])):
            masked_from = begin + equals + 1
        for parameter in _DECODED_PARAMETER.compiled.finditer(chunk):
            if masked_from is not None and begin + parameter.end() >= masked_from:
                break
            if parameter["equals"] and _secret_parameter(unquote_plus(parameter["name"])):
                masked_from = begin + parameter.end()
                break
        if masked_from is None:
            continue
        value = reading.value.compiled.match(text, masked_from)
        assert value is not None  # it matches the empty string
        if value.end() > masked_from:
            pieces += [text[done:masked_from], MASK]
            done = start = value.end()
    return "".join(pieces) + text[done:] if pieces else text


_E = TypeVar("_E", bound=BaseException)


def rebuilt(error: _E, *args: object) -> _E:
    """A new error like ``error``: of its class, with ``args`` (``error``'s own if none are
    given), its attributes and notes; no traceback, cause or context (the raise that raises it
    gives them). Built without the class's constructor (see :func:`_built`)."""
    copy = _built(type(error), args or error.args, error.__dict__, _filenames(error))
    if notes := getattr(error, "__notes__", None):
        copy.__notes__ = list(notes)  # a note added to one is not the other's
    return copy


def _built(
    kind: type[_E],
    args: tuple[object, ...],
    attributes: dict[str, object],
    filenames: tuple[object, object],
) -> _E:
    """An error of class ``kind`` with ``args``, ``attributes`` and, an ``OSError``, its file
    names, built without the class's constructor, which may not take ``args`` back
    (keyword-only arguments, a message it composes); what a built-in base keeps outside
    ``__dict__`` (a ``UnicodeError``'s fields, an ``OSError``'s) is set as that base sets it.
    :func:`rebuilt` makes a copy with it, and unpickling an error of stream_st's
    (:meth:`SafetensorsError.__reduce__`) the error pickled."""
    # The built-in type it is laid out as (its __base__), whose __new__ kind(...) calls: an
    # AllocationError's Exception, where MemoryError.__new__, first in its MRO, refuses it.
    solid: Any = kind
    while solid.__module__ != "builtins":
        solid = solid.__base__
    copy: _E = solid.__new__(kind, *args)
    for base in kind.__mro__:  # the first built-in one: a TransportError's OSError
        if base.__module__ == "builtins" and issubclass(base, BaseException):
            try:
                base.__init__(copy, *args)
            except TypeError:  # new args a UnicodeError's five cannot be: a message alone
                BaseException.__init__(copy, *args)
            break
    copy.__dict__.update(attributes)
    if isinstance(copy, OSError):  # its file names: not in args
        for field, name in zip(("filename", "filename2"), filenames, strict=True):
            if name is not None:  # None set is shown ("None: None")
                setattr(copy, field, name)
    return copy


def _filenames(error: BaseException) -> tuple[object, object]:
    """An ``OSError``'s file names, which its ``args`` do not hold; None for another error."""
    if isinstance(error, OSError):
        return error.filename, error.filename2
    return None, None


def _mask_addresses(text: str, reading: _Reading) -> str:
    """``text`` with the passwords and the signed parameters of the addresses in it masked,
    ``reading`` telling where an address ends."""
    if "@" in text:
        text = _mask_cut_short(reading.userinfo.compiled.sub(_mask_userinfo, text), reading)
    if "=" in text or "%3" in text:
        text = _mask_parameters(text, reading)
    return text


def _mask_quoted(match: re.Match[str]) -> str:
    """An address a text quotes (:data:`_QUOTED`) masked as one address, in its quotes."""
    quote = match["quote"]
    return f"{quote}{_mask_addresses(match['address'], _ONE_ADDRESS)}{quote}"


def redact(text: str) -> str:
    """``text`` (an address, or a message quoting any number of them) with the secrets an address
    can carry masked: the password of ``scheme://user:password@host`` (the user name stays, to
    tell whose), and the value of a query parameter that signs or
    authenticates a request (``X-Amz-Signature``, ``X-Amz-Credential``, ``X-Amz-Security-Token``,
    ``Signature``, ``sig``, ``key`` and any name holding ``token``, ``secret``, ``password`` or
    ``credential``; its name read percent-decoded, ``%74oken`` as ``token``, and after a ``;``
    as after a ``&``), and the credentials of an ``Authorization`` value quoted in it (of any
    scheme after ``Authorization:``, but prose, ``Authorization: the signature does not
    match``; ``Bearer``, ``Basic``, an AWS signature without it: an error page may echo the
    request), as are the values of headers that carry one (``X-Amz-Security-Token``,
    ``Cookie``, ``X-Api-Key``, ``Proxy-Authorization``, ...) quoted as ``name: value``, a value
    in quotes up to its closing quote. A quote in a password or a parameter's value is masked
    with it, and so is an angle bracket in a password; a text that is one address (it starts
    with ``scheme://``, holds no line break but in its password and nothing masked yet: a
    transport's name, an error's ``url``) is read whole, a space, a tab, a line break or an
    angle bracket in a password or a value masked with it, and so is an address a text quotes
    as ``repr`` and JSON do (``invalid URL '...'``, ``"url": "..."``). Elsewhere a value ends at
    white space, a ``:`` before it the text's (``{address}: reason``). In time linear in the
    text. Masking again changes nothing. Every error's message passes through it; use it
    wherever an address is shown, and on the address alone where a message begins with it
    (``f"{redact(url)} is ..."``): the message read as one address, a signed value would run
    to its end."""
    if _one_address(text):
        text = _mask_addresses(text, _ONE_ADDRESS)
    else:
        if "://" in text and ("'" in text or '"' in text):
            text = _QUOTED.compiled.sub(_mask_quoted, text)
        text = _mask_addresses(text, _IN_TEXT)
    folded = text.lower()
    if "bearer" in folded or "basic" in folded or "aws4-" in folded:
        text = _AUTHORIZATION.compiled.sub(_mask_authorization, text)
    if ":" in text:
        text = _HEADER.compiled.sub(_mask_header, text)
    return text


def unreadable(url: str, exc: ValueError) -> str:
    """What ``exc``, raised reading ``url``, says is wrong with it, where that cannot show a
    password: a URL naming credentials (an ``@``) gets a fixed reason, since Python's may quote
    a piece of one (a password with an unescaped ``/``, ``?`` or ``#`` ends the address's
    authority early, its start read as a port: ``Port could not be cast to integer value as
    's3cr'``)."""
    if "@" in url:
        return "its host, port or a character cannot be read (the details could quote its password)"
    return str(exc)


class SafetensorsError(Exception):
    """Root of every error stream_st raises for bad data, misuse or failed I/O. Its message
    shows no secret an address carries (see ``redact``). Every class can also be built from a
    message alone, ``type(error)(message)``, its other attributes then unknown (0, None or
    empty): as torch's ``DataLoader`` re-raises the error of a worker process, where a class
    refusing that became a bare ``RuntimeError``."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(redact(arg) if isinstance(arg, str) else arg for arg in args))

    def __reduce__(self) -> tuple[Callable[..., SafetensorsError], tuple[object, ...]]:
        """Pickled (to or from another process: a pool's worker that raised it) as its class,
        ``args``, attributes and file names, unpickled without the class's constructor
        (:func:`_built`): pickle's default called it with ``args``, which those taking other
        arguments (keyword-only ones, the parts of a message they compose) refused."""
        return _built, (type(self), self.args, self.__dict__, _filenames(self))


class HeaderError(SafetensorsError, ValueError):
    """The length prefix or the JSON header does not follow the safetensors format."""


IMPLAUSIBLE_HEADER_LENGTH = 1 << 32
"""A declared header length from here up is no safetensors file's (the reference refuses more
than 100 MB): the first 8 bytes of a text file, an archive or an executable read that way."""


RAISE_THE_LIMIT = " (raise max_header_size if the file is trusted)"
"""What :class:`HeaderTooLargeError` advises a reader that takes ``max_header_size``."""


class HeaderTooLargeError(HeaderError):
    """The declared header length exceeds ``max_header_size``; nothing was allocated for it.
    Raised by a writer too (``writing=True``) for a header over the default limit, before the
    destination is opened. ``fixed``: the reader takes no ``max_header_size`` (the drop-ins,
    as the reference), so the message does not advise raising it."""

    def __init__(
        self, declared: int | str, limit: int = 0, *, writing: bool = False, fixed: bool = False
    ) -> None:
        if isinstance(declared, str):  # a message alone (see SafetensorsError): sizes unknown
            super().__init__(declared)
            self.declared = self.limit = 0
            return
        if writing:  # refused by a writer: no reader (the reference's included) would take it
            message = (
                f"the header would be {declared} bytes, over the {limit} bytes readers take "
                "(the reference's too): write fewer or shorter names, or less metadata"
            )
        elif declared >= IMPLAUSIBLE_HEADER_LENGTH:
            message = "not a safetensors file (its first 8 bytes are not a header length)"
        else:
            message = f"header length {declared} bytes exceeds the limit of {limit} bytes"
            if not fixed:
                message += RAISE_THE_LIMIT
        super().__init__(message)
        self.declared = declared
        self.limit = limit


class TruncatedStreamError(SafetensorsError, EOFError):
    """The source ended before every promised byte arrived.

    ``name`` is the tensor being read (``None`` while reading the header), ``offset`` the absolute
    byte position in the file reached and ``expected`` the absolute position that had to be reached.
    """

    def __init__(
        self,
        what: str,
        *,
        name: str | None = None,
        offset: int | None = None,
        expected: int | None = None,
        source: str = "",
    ) -> None:
        if offset is None or expected is None:  # a message alone (see SafetensorsError)
            super().__init__(what)
            self.name, self.offset, self.expected, self.source = name, 0, 0, redact(source)
            return
        where = f" from {source}" if source else ""
        missing = expected - offset
        super().__init__(
            f"stream ended{where} while reading {what}: reached byte {offset}, "
            f"expected data up to byte {expected} ({missing} byte{'' if missing == 1 else 's'} "
            "missing)"
        )
        self.name = name
        self.offset = offset
        self.expected = expected
        self.source = redact(source)


class TrailingDataError(SafetensorsError):
    """A whole object (file, bytes, iterator) has bytes after the end of its last tensor."""


class TensorNotFoundError(SafetensorsError, KeyError):
    """A tensor name asked for (``include=``, ``header[name]``) is not in the header."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


NAMES_SHOWN = 8
"""How many names :func:`some_names` shows unless told."""

NAME_CHARACTERS = 100
"""The most characters :func:`some_names` shows of one name, its quotes included."""

_NAME = reprlib.Repr()
_NAME.maxstring = _NAME.maxother = NAME_CHARACTERS


def some_names(names: Sequence[str], shown: int = NAMES_SHOWN) -> str:
    """``names`` for a message or a ``repr``, bounded whatever their number and length (under a
    thousand characters for the default ``shown``): the first ``shown`` (all of them if no more),
    each quoted as ``repr`` quotes it (a line break or a bidirectional override shows as its
    escape), and how many more (``['a', 'b']``, ``['a', ..., 'h'] and 99992 more``). A name of
    over :data:`NAME_CHARACTERS` is cut in the middle (``'model.emb...weight'``), in time bounded
    whatever its length (a name can be megabytes)."""
    first = list(names[:shown])
    more = len(names) - len(first)
    listed = f"[{', '.join(map(_NAME.repr, first))}]"
    return f"{listed} and {more} more" if more else listed


class DtypeError(SafetensorsError, ValueError):
    """A dtype that safetensors cannot carry, or a safetensors code numpy cannot hold."""


class UnknownDtypeError(HeaderError, DtypeError):
    """A header names a dtype code stream_st does not know (a packed ``I4`` or ``I2``, say):
    both a :class:`HeaderError` (the file cannot be read) and a :class:`DtypeError`.
    Header-only reads may keep such tensors (``unknown_dtypes="keep"``); reading their data
    raises it, naming the tensor and its dtype."""


class UnsupportedSourceError(SafetensorsError, TypeError):
    """``open_stream`` was given an object or URL scheme it does not know how to read."""


class UsageError(SafetensorsError, RuntimeError):
    """The API was used out of order, e.g. the header was asked for before the stream opened."""


class DeviceError(UsageError, ValueError):
    """A ``device=`` that names no device torch knows (``"cuda:x"``, ``"foo"``), or a CPU but
    the one (``"cpu:1"``): the reference's ``ValueError`` (for ``"cuda:x"``), and the
    :class:`UsageError` every other refused device is."""


class UnsupportedDeviceError(UsageError, NotImplementedError):
    """A ``device=`` torch knows that is neither the CPU nor CUDA (``"xla"``, ``"mps"``,
    ``"meta"``): stream_st hands tensors out on those two only. Also a
    ``NotImplementedError``, as torch raises for the reference on ``"xla"``."""


class UnsupportedFrameworkError(UsageError, ImportError):
    """A ``framework=`` the reference has that stream_st does not hand tensors out for
    (``"tf"``, ``"tensorflow"``, ``"flax"``, ``"jax"``, ``"mlx"``, ``"paddle"``): refused as
    the handle opens. Also an ``ImportError``, as the reference's ``ModuleNotFoundError`` where
    that library is not installed."""


class ArgumentTypeError(UsageError, TypeError):
    """An argument of the wrong type: a tensor name that is not a string, a shape that is not a
    sequence of integers, an ``include=`` that is neither names nor a predicate. A
    :class:`UsageError` and a ``TypeError``, as the reference (and Python) raise for it."""


def boolean(what: str, value: object) -> bool:
    """``value`` as a ``bool`` if it is one (numpy's ``bool_`` too, seen by its dtype: no numpy
    import here); :class:`ArgumentTypeError` for anything else (a string such as ``"no"`` would
    otherwise be taken as true)."""
    if value is True or value is False:
        return value
    dtype = getattr(value, "dtype", None)
    if getattr(dtype, "kind", None) == "b" and getattr(value, "shape", None) == ():
        return bool(value)
    raise ArgumentTypeError(f"{what} must be True or False, got {value!r}")


def integer_at_least(what: str, value: object, least: int, unit: str = "") -> int:
    """``value`` as an ``int`` if it is an integer (numpy's too) of at least ``least``;
    :class:`ArgumentTypeError` for any other type (a bool, a float, a string: compared with a
    number they were a bare ``TypeError``, or taken as 1), :class:`UsageError` if it is less.
    ``unit`` follows the bound in the message (`` (bytes)``)."""
    if type(value) is int and value >= least:  # the common case: no call, no message
        return value
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)  # type: ignore[arg-type]  # numpy's integers too
    except TypeError:
        number = None
    if number is not None and number >= least:
        return number
    message = f"{what} must be an integer >= {least}{unit}, got {value!r}"
    raise ArgumentTypeError(message) if number is None else UsageError(message)


def string(what: str, value: object) -> str:
    """``value`` if it is a ``str``; :class:`ArgumentTypeError` naming ``what`` for anything
    else (None or a number, which failed later as a bare ``TypeError``). The message shows the
    type only: the value may be an address with a secret in it."""
    if isinstance(value, str):
        return value
    raise ArgumentTypeError(f"{what} must be a string, got {type(value).__name__}")


def path_string(what: str, value: object) -> str:
    """``value``, a path given as a ``str`` or an ``os.PathLike`` of one, as a ``str``;
    :class:`ArgumentTypeError` naming ``what`` for anything else (None, bytes, a number)."""
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    if isinstance(text, str):
        return text
    raise ArgumentTypeError(f"{what} must be a str or os.PathLike, got {type(value).__name__}")


class CredentialsError(UsageError):
    """No credentials were found for a remote store that needs them, or its configuration (a
    profile, a credentials file, a credential process) is broken."""


class AllocationError(SafetensorsError, MemoryError):
    """A tensor the header declares could not be allocated."""


_WORDS = LazyPattern(r"[\w '-]*")
"""An address that may be words of a message's own (``files``, ``d``, ``no index``): letters,
digits, ``_``, ``-``, ``'`` and spaces alone."""

_AS_FIELD = r"(?:^|(?<=: )|(?<=url=)){}(?=$|[:,])"
"""Where a message cites an address that may be words of its own (:data:`_WORDS`), ``{}``: as
a field of it, after its start, ``": "`` or ``url=``, and before a colon, a comma or its end."""

_SET_OFF = r"(?:^|(?<=[\s'\"`(\[<=])){}(?=$|[\s'\"`)\]>:,;])"
"""Where a message cites any other address, ``{}``: set off from the text around it by white
space, quotes or brackets, ``=`` before it, or a colon, comma or semicolon after it."""


def cites(message: str, address: str) -> bool:
    """Whether ``message`` names ``address`` (a source's, a destination's), so that what reports
    the message need not name it again. An address that may be words of the message's own
    (:data:`_WORDS`: ``d``, ``files``) is named only as a field of it (``no such file: model``,
    ``model: Permission denied``, ``..., url=model``), not where it is a word or a piece of one
    (``files`` and ``d`` in ``no safetensors files in this directory``); any other
    (``m.safetensors``, ``s3://b/k``) wherever it stands apart from the text around it
    (``cannot read m.safetensors: ...``, ``s3://b/k changed on the server``), or as ``repr``
    quotes it (``'a\\x00b'``). Read from the text alone: an address that is also, set off the
    same way, a piece of the message's own counts as named."""
    if not address:
        return False
    if _WORDS.compiled.fullmatch(address):
        where = _AS_FIELD
    elif repr(address) in message:
        return True
    else:
        where = _SET_OFF
    return re.search(where.format(re.escape(address)), message) is not None


class TransportError(SafetensorsError, OSError):
    """The underlying I/O failed. ``url`` names the source, ``position`` the byte offset reached."""

    def __init__(self, message: str, *, url: str = "", position: int | None = None) -> None:
        self._message = redact(message)
        self.url = redact(url)
        self.position = position
        super().__init__(self._text())

    @property
    def reason(self) -> str:
        """What failed, without the address and the position (see ``url`` and ``position``)."""
        return self._message

    def _text(self) -> str:
        parts = [self._message]
        if self.url and not cites(self._message, self.url):  # named once
            parts.append(f"url={self.url}")
        if self.position is not None:
            parts.append(f"at byte {self.position}")
        return ", ".join(parts)

    def report_as(self, url: str) -> None:
        """Name ``url`` instead as the address the error is about: the one its caller gave, where
        the address actually requested (a redirect's, a signed one) is not to be shown."""
        self.url = redact(url)
        self.args = (redact(self._text()),)


class SourceNotFoundError(TransportError, FileNotFoundError):
    """The file or object named does not exist."""


class ReadTimeoutError(TransportError, TimeoutError):
    """A connection, peer or server did not answer within the configured timeout."""


class UnsupportedSinkError(SafetensorsError, TypeError):
    """``open_writer`` was given an object or URL scheme it does not know how to write to."""


class WriterError(SafetensorsError, ValueError):
    """A writer was used against its plan; the write is aborted and nothing is committed.

    ``name`` is the tensor concerned, or ``None`` when the problem is not about one tensor.
    """

    def __init__(self, message: str, *, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name


class IntegrityError(SafetensorsError):
    """Bytes do not match the digest recorded for them; they were not delivered, nor anything
    after them.

    ``name`` is the tensor concerned (``None`` for the whole object or the header's digest
    record), ``source`` where it was read from, ``layer`` the layer of a KV transfer.
    """

    def __init__(
        self, message: str, *, name: str | None = None, source: str = "", layer: int | None = None
    ) -> None:
        super().__init__(message)
        self.name = name
        self.source = redact(source)
        self.layer = layer


class ModelError(SafetensorsError, ValueError):
    """Weights or a model file that do not make the model (``stream_st.llm``,
    ``stream_st.bert``): a tensor missing or misshapen, a configuration missing or unsupported,
    a GGUF file that cannot be read (cut short, say), token ids (or perplexity targets, token
    types) outside the rows of the weights they index, inputs of shapes that do not go
    together, a cache of another number of layers or shape than the model's. Token ids that are
    not integers (floats, a string) are an :class:`~stream_st.ArgumentTypeError` instead."""


class OutcomeUnknownError(TransportError):
    """The answer to a write's final request (an upload, S3's CompleteMultipartUpload) was lost.

    The destination may or may not hold the complete object now: check it before relying on it
    or writing again. Raised instead of a plain :class:`TransportError` whenever the writer cannot
    tell whether the object was stored.
    """


class HTTPStatusError(TransportError):
    """The server answered with an error status. ``status`` holds it, ``url`` the address,
    ``body`` the start of the answer's body (``detail`` is the one line the message shows)."""

    def __init__(
        self,
        status: int | str,
        reason: str = "",
        *,
        url: str = "",
        detail: str = "",
        body: bytes = b"",
    ) -> None:
        if isinstance(status, str):  # a message alone (see SafetensorsError): no status known
            super().__init__(status, url=url)
            self.status, self.body = 0, b""
            return
        message = f"HTTP {status} {reason}".rstrip()
        if detail:
            message += f": {detail}"
        super().__init__(message, url=url)
        self.status = status
        self.body = _redacted_body(body)


_REQUEST_BYTES = LazyPattern(rb"(<CanonicalRequestBytes>)[^<]*(</CanonicalRequestBytes>)")
"""An S3 ``SignatureDoesNotMatch`` answer's hex of the request it signed (the session token in
it, as hex, which :func:`redact` cannot see)."""

_CANONICAL_REQUEST = LazyPattern(rb"<CanonicalRequest>[^<]*</CanonicalRequest>")
"""An S3 ``SignatureDoesNotMatch`` answer's text of the request it signed, every signed header
one a line (:data:`_SIGNED_HEADER`): all those given in ``headers=``, which stream_st signs."""

_SIGNED_HEADER = LazyPattern(rb"(?m)^(?P<name>[^:\s<]+):(?P<value>[^\n<]*)")
"""A header's line in a canonical request: its name (in lower case; any characters but a colon,
whitespace or ``<``, as ``headers=`` takes them: ``x_token``, ``x.auth.key``), a colon, its
value. Tried only where a line starts, never past its end: in time linear in the request."""

_PLAIN_SIGNED_HEADERS = frozenset(
    {
        "host",
        "range",
        "content-length",
        "content-md5",
        "content-type",
        "if-match",
        "if-none-match",
        "if-unmodified-since",
        "x-amz-content-sha256",
        "x-amz-copy-source",
        "x-amz-date",
    }
)
"""The headers whose value a canonical request S3 echoes shows (:func:`_redacted_body`): those
that tell where, when and what was asked, no secret. Any other's is masked: a caller's header
may carry a credential under a name no list here knows."""


def _mask_signed_header(match: re.Match[bytes]) -> bytes:
    """A header's line in a canonical request (:data:`_SIGNED_HEADER`), its value masked unless
    it is one of :data:`_PLAIN_SIGNED_HEADERS`' (or empty)."""
    if not match["value"] or match["name"].decode("latin-1") in _PLAIN_SIGNED_HEADERS:
        return match[0]
    return match["name"] + b":" + MASK.encode()


def _mask_canonical_request(match: re.Match[bytes]) -> bytes:
    """A canonical request S3 echoes (:data:`_CANONICAL_REQUEST`), its headers' values masked
    but those of :data:`_PLAIN_SIGNED_HEADERS`."""
    return _SIGNED_HEADER.compiled.sub(_mask_signed_header, match[0])


def _redacted_body(body: bytes) -> bytes:
    """``body`` with the secrets :func:`redact` masks masked (an S3 error page echoes the
    request it refused, ``x-amz-security-token:`` included), the value of every header of the
    canonical request it echoes masked (an SSE-C key, a caller's token under any name) but
    those of :data:`_PLAIN_SIGNED_HEADERS`, and the request's bytes in hex left out; bytes as
    they were elsewhere (Latin-1 keeps every byte). In time linear in the body."""
    body = _REQUEST_BYTES.compiled.sub(rb"\1" + MASK.encode() + rb"\2", body)
    body = _CANONICAL_REQUEST.compiled.sub(_mask_canonical_request, body)
    return redact(body.decode("latin-1")).encode("latin-1")


class HTTPNotFoundError(HTTPStatusError, SourceNotFoundError):
    """HTTP 404: there is nothing at the address."""


class HTTPProtocolError(TransportError):
    """The server's answer breaks HTTP/1.1 (status line, body framing) or what was asked
    (e.g. a range other than the one requested). Retrying the same request will not help."""


class SourceChangedError(TransportError):
    """The object at a URL changed while it was being read: a later request of the same read
    found another version (another ETag or Last-Modified than the first answer's). Nothing of
    the new version is delivered mixed with the old; read again from the start.
    """


class CertificateError(TransportError):
    """The server's TLS certificate failed verification (untrusted, expired, another name).
    Never retried: trust it with ``ssl_context=`` (``--ca-bundle``) if it is the right server."""


class CodecError(SafetensorsError, ValueError):
    """A tensor a codec cannot carry (NaN/Inf, wrong dtype or shape) or wire parts it cannot
    decode (missing, wrong dtype or shape, invalid scale)."""


class DistributedError(SafetensorsError):
    """A load over a process group failed on some rank. ``rank`` is that rank in the group (None
    when it could not be told), ``cause`` what went wrong there."""

    def __init__(self, message: str, *, rank: int | None = None, cause: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.cause = cause


class RankFailedError(DistributedError):
    """A rank reported a failure (its source, its selection, a digest): every rank raises it."""


class RankLostError(DistributedError):
    """A collective failed: a rank died, hung past the group's timeout, or the network broke."""


class CacheMissError(SourceNotFoundError):
    """The cache is offline (``cache="offline"``, ``HF_HUB_OFFLINE=1``) and holds no usable copy
    of the object asked for."""


class StreamStWarning(UserWarning):
    """Root of the warnings stream_st gives: a read or write that works, but worse than asked
    (silence them all with ``warnings.simplefilter("ignore", StreamStWarning)``)."""


class CacheWarning(StreamStWarning, RuntimeWarning):
    """The local-copy cache could not be used (a folder that is a file, not writable) or a copy
    could not be kept (a full disk): the read goes on without it. Also a ``RuntimeWarning``."""


class RangeIgnoredWarning(StreamStWarning):
    """An HTTP server answered a Range request with the whole object (200, not 206): the read
    goes on from the first byte, so a header or a slice costs the whole object's transfer."""
