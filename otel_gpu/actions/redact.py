"""Keeping webhook secrets out of logs and error messages.

Webhook URLs carry their credential in the path (Slack, Feishu) or the query (DingTalk's
access_token, WeCom's key), so a URL is only ever shown as ``scheme://host/…``.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import unquote, urlsplit

_MASK = "…"


def redact_url(url: str) -> str:
    """``https://hooks.slack.com/services/T/B/x`` -> ``https://hooks.slack.com/…``."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or "?"
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<invalid url>"
    scheme = parts.scheme or "?"
    return f"{scheme}://{host}{port}/{_MASK}"


def secret_fragments(url: str | None = None, extra: Iterable[str] = ()) -> list[str]:
    """Substrings that must never be shown: the URL, its path and query pieces, the extras.

    Fragments shorter than 4 characters are left out (masking them would garble ordinary
    text and they are not credentials).
    """
    pieces: list[str] = []
    if url:
        pieces.append(url)
        try:
            parts = urlsplit(url)
        except ValueError:
            parts = None
        if parts is not None:
            for seg in parts.path.split("/"):
                pieces.append(seg)
            for pair in parts.query.split("&"):
                pieces.append(pair)
                pieces.append(pair.partition("=")[2])
    pieces.extend(extra)
    out = set()
    for p in pieces:
        for form in (p, unquote(p)):
            if len(form) >= 4:
                out.add(form)
    # Longest first so a whole URL is masked before its pieces.
    return sorted(out, key=len, reverse=True)


def scrub(text: str, fragments: Iterable[str]) -> str:
    """``text`` with every fragment replaced by ``…`` (for exception strings from I/O)."""
    for frag in fragments:
        if frag and frag in text:
            text = text.replace(frag, _MASK)
    return text
