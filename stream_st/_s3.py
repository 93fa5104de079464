"""S3-compatible object stores over our HTTP client: addresses, configuration, SigV4 signing.

Configuration follows the standard AWS environment and files, each overridable in code:

* endpoint: ``endpoint_url=`` > ``AWS_ENDPOINT_URL_S3`` > ``AWS_ENDPOINT_URL`` > the profile's
  ``endpoint_url`` > ``https://s3.<region>.amazonaws.com``;
* region: ``region=`` > ``AWS_REGION`` > ``AWS_DEFAULT_REGION`` > the profile's ``region`` >
  ``us-east-1``;
* credentials: ``access_key_id=``/``secret_access_key=``/``session_token=`` >
  ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN`` > the shared credentials
  file (``AWS_SHARED_CREDENTIALS_FILE``, default ``~/.aws/credentials``) > the config file
  (``AWS_CONFIG_FILE``, default ``~/.aws/config``), in the profile ``profile=`` > ``AWS_PROFILE``
  > ``default``. Without credentials, requests are sent unsigned (public buckets).

A custom endpoint is addressed path-style (``endpoint/bucket/key``), AWS itself virtual-hosted
(``https://bucket.s3.region.amazonaws.com/key``). Not public API.
"""

from __future__ import annotations

import configparser
import datetime as _dt
import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit

from .errors import UnsupportedSourceError

__all__ = ["S3Config", "parse_s3_url"]

UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> ``(bucket, key)``."""
    parts = urlsplit(url)
    key = parts.path.lstrip("/")
    if parts.scheme.lower() != "s3" or not parts.netloc or not key:
        raise UnsupportedSourceError(f"expected s3://bucket/key, got {url!r}")
    return parts.netloc, key


def _profile_section(path: Path, section: str) -> dict[str, str]:
    """``section`` of the INI file at ``path``; empty if the file is missing or unreadable."""
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(path)
    except (configparser.Error, UnicodeDecodeError):
        return {}
    return dict(parser[section]) if parser.has_section(section) else {}


@dataclass(frozen=True)
class S3Config:
    """Where and as whom to talk to an S3-compatible store. See the module docstring."""

    endpoint_url: str
    region: str
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    path_style: bool = True

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
        environ: Mapping[str, str] | None = None,
    ) -> S3Config:
        env = os.environ if environ is None else environ
        profile = profile or env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
        home = Path(env.get("HOME", "~")).expanduser()
        config_file = Path(env.get("AWS_CONFIG_FILE", home / ".aws" / "config")).expanduser()
        credentials_file = Path(
            env.get("AWS_SHARED_CREDENTIALS_FILE", home / ".aws" / "credentials")
        ).expanduser()
        config = _profile_section(
            config_file, "default" if profile == "default" else f"profile {profile}"
        )
        stored = _profile_section(credentials_file, profile)

        region = (
            region
            or env.get("AWS_REGION")
            or env.get("AWS_DEFAULT_REGION")
            or config.get("region")
            or "us-east-1"
        )
        custom = (
            endpoint_url
            or env.get("AWS_ENDPOINT_URL_S3")
            or env.get("AWS_ENDPOINT_URL")
            or config.get("endpoint_url")
        )
        if access_key_id is None and secret_access_key is None:
            for source in (env, stored, config):
                key = source.get("AWS_ACCESS_KEY_ID") or source.get("aws_access_key_id")
                secret = source.get("AWS_SECRET_ACCESS_KEY") or source.get("aws_secret_access_key")
                if key and secret:
                    access_key_id, secret_access_key = key, secret
                    session_token = session_token or (
                        source.get("AWS_SESSION_TOKEN") or source.get("aws_session_token")
                    )
                    break
        return cls(
            endpoint_url=(custom or f"https://s3.{region}.amazonaws.com").rstrip("/"),
            region=region,
            access_key_id=access_key_id,
            secret_access_key=secret_access_key,
            session_token=session_token,
            path_style=custom is not None,
        )

    def object_url(self, bucket: str, key: str, query: str = "") -> str:
        """The HTTP address of ``key`` in ``bucket`` (``query`` already encoded, without ``?``);
        of the bucket itself when ``key`` is empty."""
        path = "/" + quote(key, safe="/~") if key else ""
        if self.path_style:
            url = f"{self.endpoint_url}/{bucket}{path}"
        else:
            parts = urlsplit(self.endpoint_url)
            url = f"{parts.scheme}://{bucket}.{parts.netloc}{path or '/'}"
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
        """``headers`` plus the AWS Signature Version 4 ones for this request."""
        out = dict(headers)
        if not self.access_key_id or not self.secret_access_key:
            return out
        moment = now or _dt.datetime.now(_dt.UTC)
        amz_date = moment.strftime("%Y%m%dT%H%M%SZ")
        day = amz_date[:8]
        parts = urlsplit(url)
        out["x-amz-date"] = amz_date
        out["x-amz-content-sha256"] = payload_hash
        if self.session_token:
            out["x-amz-security-token"] = self.session_token
        # Every header given is signed (Range included), with the host.
        signed = {"host": parts.netloc, **{k.lower(): " ".join(v.split()) for k, v in out.items()}}
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
        key = ("AWS4" + self.secret_access_key).encode()
        for part in (day, self.region, "s3", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        out["Authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={self.access_key_id}/{scope}, "
            f"SignedHeaders={signed_headers}, Signature={signature}"
        )
        return out
