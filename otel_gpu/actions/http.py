"""The one HTTP POST the webhook sender makes: stdlib only, bounded in time and size."""

from __future__ import annotations

import email.utils
import math
import time
import urllib.error
import urllib.request

from otel_gpu.actions.notifiers import HttpRequest

_MAX_REPLY_BYTES = 64 * 1024


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Webhooks do not redirect; following one would resend the payload elsewhere."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        return None


def build_opener() -> urllib.request.OpenerDirector:
    """An opener that honours *_proxy / no_proxy variables and never follows redirects."""
    return urllib.request.build_opener(_NoRedirect())


def post(
    opener: urllib.request.OpenerDirector, req: HttpRequest, timeout: float
) -> tuple[int, dict[str, str], bytes]:
    """POST ``req``; returns (status, headers with lower-case names, body up to 64 KiB).

    Raises TimeoutError when no reply came within ``timeout`` seconds, OSError for connection
    failures. Non-2xx replies are returned, not raised.
    """
    r = urllib.request.Request(req.url, data=req.body, headers=req.headers, method="POST")
    start = time.monotonic()
    try:
        resp = opener.open(r, timeout=timeout)
    except urllib.error.HTTPError as e:
        with e:
            return e.code, _headers(e.headers), _read(e, start, timeout)
    except urllib.error.URLError as e:
        if isinstance(e.reason, TimeoutError):
            raise e.reason from None
        raise
    with resp:
        return resp.status, _headers(resp.headers), _read(resp, start, timeout)


def retry_after_s(value: str | None, now: float) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or HTTP-date); None if absent or bad.

    ``now`` is the wall clock (Unix seconds), needed for the HTTP-date form.
    """
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - now
    return max(0.0, seconds) if not math.isnan(seconds) else None


def _headers(msg: object) -> dict[str, str]:
    items = getattr(msg, "items", None)
    return {} if items is None else {str(k).lower(): str(v) for k, v in items()}


def _read(resp: object, start: float, timeout: float) -> bytes:
    # The socket timeout bounds each read, not the total; stop reading once the request's time
    # is spent so a trickling server cannot hold the sender.
    chunks: list[bytes] = []
    size = 0
    read = getattr(resp, "read", None)
    if read is None:
        return b""
    try:
        while size < _MAX_REPLY_BYTES and time.monotonic() - start < timeout:
            chunk = read(4096)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except (OSError, ValueError):
        pass  # the status is what matters; a broken body is judged as empty
    return b"".join(chunks)
