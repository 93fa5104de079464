"""What an answer's status means to the caller: the errors for error statuses and lost answers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import HTTPNotFoundError, HTTPStatusError, OutcomeUnknownError, TransportError

if TYPE_CHECKING:
    from .framing import Response

__all__ = ["outcome_unknown", "raise_for_status"]


async def raise_for_status(response: Response, *, name: str | None = None) -> None:
    """Turn an error status into :class:`HTTPStatusError` (404: :class:`HTTPNotFoundError`).

    ``name`` is the address to report (e.g. ``s3://bucket/key``), by default the HTTP URL.
    """
    if response.status < 400:
        return
    try:
        detail = (await response.read_all(2048)).decode("utf-8", "replace").strip()
    except TransportError:
        detail = ""
    finally:
        await response.aclose()
    kind = HTTPNotFoundError if response.status == 404 else HTTPStatusError
    raise kind(response.status, response.reason, url=name or response.url, detail=detail[:300])


def outcome_unknown(
    request: str, failure: BaseException, url: str, more: str = ""
) -> OutcomeUnknownError:
    """The error for a final ``request`` whose answer was lost to ``failure`` (or unclear): the
    object may or may not have been stored at ``url``. ``more`` is added to the message."""
    reason = str(failure).split(", url=", 1)[0] or type(failure).__name__
    return OutcomeUnknownError(
        f"no clear answer to the {request} ({reason}): the object may or may not have been "
        f"stored{more}",
        url=url,
    )
