"""nginx from the system serving a folder of files on 127.0.0.1, over HTTP and HTTPS.

    with NginxServer(root, folder) as nginx:        # in a fixture: running(NginxServer(...))
        nginx.url("model.safetensors")              # http://127.0.0.1:PORT/model.safetensors
        nginx.url("model.safetensors", tls=True)    # https://, certificate for 127.0.0.1
        nginx.client_context()                      # an ssl.SSLContext trusting the fixture's CA
        nginx.requests()                            # what nginx logged (see LoggedRequest)

Everything nginx writes (configuration, pid file, logs, temporary files, certificates) is in
``folder``; it runs as the current user in one process (``master_process off``), so it needs no
root and never switches users. Both ports serve the same locations, each one way a real
deployment differs from a plain static server:

``/``           the files in ``root``: ranges, ETag and Last-Modified as nginx serves them;
``/gzip/``      the same files with ``gzip on`` for ``application/octet-stream``: nginx answers
                ``Accept-Encoding: gzip`` with a whole gzip body (200, chunked), even to a Range;
``/precompressed/`` the same files, each answered with its ``NAME.gz`` beside it where there is
                one, labelled ``Content-Encoding: gzip`` whatever the client accepts
                (``gzip_static always``), ranges of the compressed bytes included;
``/slow/``      the same files at ``rate`` bytes per second per connection (``limit_rate``);
``/trickle/``   the same files: the first ``TRICKLE_AFTER`` bytes of each answer at once, then
                one byte per second (a stall in the middle of a body);
``/stall/``     proxied to an upstream that accepts connections and never answers (a stall
                before any answer);
``/close/``     the same files, each answer closing its connection (``keepalive_timeout 0``).

The TLS certificate is signed by a CA the fixture makes (with the ``cryptography`` package, or
the ``openssl`` command where that is missing): :meth:`NginxServer.client_context` trusts it.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import ipaddress
import re
import secrets
import socket
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple
from urllib.parse import quote

from .daemon import Daemon

TRICKLE_AFTER = 16 << 10
"""Bytes of each ``/trickle/`` answer sent at full speed before it slows to one byte a second."""

LOCATIONS = ("/", "/gzip/", "/precompressed/", "/slow/", "/trickle/", "/stall/", "/close/")

_LOG_FORMAT = r"\t".join(
    (
        "$scheme",
        "$request_method",
        "$uri",
        "$http_range",
        "$status",
        "$body_bytes_sent",
        "$http_accept_encoding",
    )
)
"""nginx's access log format: the fields of LoggedRequest, tab-separated."""
_STATUS = re.compile(rb"requests\s+(\d+) \d+ \d+\s+Reading: (\d+) Writing: (\d+)")


class LoggedRequest(NamedTuple):
    """One request as nginx logged it when it ended (a header nginx did not get is '')."""

    scheme: str
    method: str
    path: str
    range: str
    status: int
    sent: int  # body bytes sent
    accept_encoding: str

    @classmethod
    def parse(cls, line: str) -> LoggedRequest:
        scheme, method, path, range_, status, sent, accept_encoding = (
            "" if value == "-" else value for value in line.split("\t")
        )
        return cls(scheme, method, path, range_, int(status), int(sent), accept_encoding)


class NginxServer(Daemon):
    """nginx serving ``root`` (see the module); its own files live in ``folder``."""

    program = "nginx"
    port_count = 2  # HTTP, HTTPS

    def __init__(self, root: Path, folder: Path, *, rate: int = 256 << 10) -> None:
        super().__init__(folder)
        self.root = root
        self.rate = rate
        self.ca_file, cert_file, key_file = make_certificates(folder)
        # Accepts connections into its backlog and never answers: the upstream of /stall/.
        self._silent = socket.create_server(("127.0.0.1", 0))
        self._tls = f'ssl_certificate "{cert_file}"; ssl_certificate_key "{key_file}";'

    @property
    def tls_port(self) -> int:
        return self.ports[1]

    def url(self, name: str, *, location: str = "/", tls: bool = False) -> str:
        """The URL of the file ``name`` in ``root`` under ``location`` (one of LOCATIONS)."""
        assert location in LOCATIONS, location
        scheme, port = ("https", self.tls_port) if tls else ("http", self.port)
        return f"{scheme}://127.0.0.1:{port}{location}{quote(name)}"

    def client_context(self) -> ssl.SSLContext:
        """A client TLS context that trusts the certificate of the HTTPS port."""
        return ssl.create_default_context(cafile=str(self.ca_file))

    def configure(self, ports: list[int]) -> list[str]:
        folder = self.folder
        plain, tls = ports
        temp = "\n".join(
            f'{kind}_temp_path "{folder / kind}";'
            for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        (folder / "locations.conf").write_text(f"""
root "{self.root}";
location /gzip/ {{ alias "{self.root}/"; gzip on; gzip_types application/octet-stream;
                  gzip_min_length 1; }}
location /precompressed/ {{ alias "{self.root}/"; gzip_static always; }}
location /slow/ {{ alias "{self.root}/"; limit_rate {self.rate}; }}
location /trickle/ {{ alias "{self.root}/"; limit_rate_after {TRICKLE_AFTER}; limit_rate 1; }}
location /stall/ {{ proxy_pass http://127.0.0.1:{self._silent.getsockname()[1]}/; }}
location /close/ {{ alias "{self.root}/"; keepalive_timeout 0; }}
location = /nginx-status {{ stub_status; access_log off; }}
""")
        (folder / "nginx.conf").write_text(f"""
master_process off;
pid "{folder / "nginx.pid"}";
error_log "{folder / "error.log"}" warn;
events {{ worker_connections 256; }}
http {{
    {temp}
    types {{ application/json json; }}
    default_type application/octet-stream;
    log_format fields "{_LOG_FORMAT}";
    access_log "{folder / "access.log"}" fields;
    server {{ listen 127.0.0.1:{plain}; include "{folder / "locations.conf"}"; }}
    server {{ listen 127.0.0.1:{tls} ssl; {self._tls} include "{folder / "locations.conf"}"; }}
}}
""")
        return ["-p", str(folder), "-c", str(folder / "nginx.conf"), "-g", "daemon off;"]

    def stop(self) -> None:
        super().stop()
        self._silent.close()

    # ---------------------------------------------------------------- the access log

    def status(self) -> tuple[int, int, int]:
        """nginx's counters: connections accepted so far, requests being read, requests being
        answered; this query is one of the connections and one of the answers."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/nginx-status") as answer:
            match = _STATUS.search(answer.read())
        assert match is not None
        accepted, reading, writing = map(int, match.groups())
        return accepted, reading, writing

    def settle(self, timeout: float = 5.0) -> None:
        """Wait until nginx answers no request but the status one, so the log is complete."""
        give_up = time.monotonic() + timeout
        while self.status()[1:] != (0, 1) and time.monotonic() < give_up:
            time.sleep(0.02)

    def requests(self) -> list[LoggedRequest]:
        """Every request logged since the last :meth:`clear_log`, once nginx has settled."""
        self.settle()
        text = (self.folder / "access.log").read_text()
        return [LoggedRequest.parse(line) for line in text.splitlines()]

    def clear_log(self) -> None:
        """Forget the requests logged so far (nginx appends to the emptied file)."""
        self.settle()
        (self.folder / "access.log").write_bytes(b"")


# -------------------------------------------------------------------- certificates


def make_certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a certificate it signs for 127.0.0.1 and localhost, valid for a day, in PEM
    files in ``folder``: (CA certificate, server certificate, server key)."""
    files = folder / "ca.pem", folder / "server.pem", folder / "server.key"
    if importlib.util.find_spec("cryptography") is None:
        certificates_by_openssl(*files)
    else:
        certificates_by_cryptography(*files)
    return files


def certificates_by_cryptography(ca_file: Path, cert_file: Path, key_file: Path) -> None:
    """:func:`make_certificates` with the ``cryptography`` package."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def name(text: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])

    now = dt.datetime.now(dt.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())

    def builder(subject: str, public: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(name("stream_st test CA"))
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        )

    ca = (
        builder("stream_st test CA", ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    server = (
        builder("127.0.0.1", key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_file.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def certificates_by_openssl(ca_file: Path, cert_file: Path, key_file: Path) -> None:
    """:func:`make_certificates` with the ``openssl`` command (its scratch files beside them)."""
    folder = ca_file.parent
    ca_key, request, extensions = folder / "ca.key", folder / "server.csr", folder / "server.ext"
    extensions.write_text(
        "basicConstraints=critical,CA:FALSE\n"
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        "extendedKeyUsage=serverAuth\n"
        "subjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid\n"
    )
    new_key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    ca = ["-days", "1", "-subj", "/CN=stream_st test CA"]
    ca += ["-addext", "keyUsage=critical,keyCertSign,cRLSign"]
    ca += ["-addext", "basicConstraints=critical,CA:TRUE,pathlen:0"]
    signed = ["-days", "1", "-CA", ca_file, "-CAkey", ca_key, "-extfile", extensions]
    signed += ["-set_serial", f"0x{secrets.token_hex(16)}"]
    for command in (
        ["req", "-x509", *new_key, *ca, "-keyout", ca_key, "-out", ca_file],
        ["req", *new_key, "-subj", "/CN=127.0.0.1", "-keyout", key_file, "-out", request],
        ["x509", "-req", "-in", request, *signed, "-out", cert_file],
    ):
        subprocess.run(["openssl", *map(str, command)], check=True, capture_output=True)
