"""Secrets recognised by their shape, wherever they stand: known token formats (keeping their
public prefix), long random-looking strings and PEM blocks. Part of the one set of redaction
rules (:mod:`otel_gpu.core.redact`), which applies these to every argument and free text."""

from __future__ import annotations

import math
import re

MASK = "***"

# A token starts a word ("task-..." is not "sk-..."), or follows a percent-escape ("%20hf_...").
# The named group of each format is its public prefix, shown before the mask.
_EDGE = r"(?:(?<![A-Za-z0-9_-])|(?<=%[0-9A-Fa-f]{2}))"
_FORMATS = re.compile(
    "|".join(
        _EDGE + p
        for p in (
            r"(?P<hf>hf_)[A-Za-z0-9]{30,}",  # Hugging Face
            r"(?P<gh>gh[pousr]_)[A-Za-z0-9]{30,}",  # GitHub classic (PAT, OAuth, app, refresh)
            r"(?P<ghf>github_pat_)[A-Za-z0-9_]{30,}",  # GitHub fine-grained
            r"(?P<sk>sk-(?:ant-|proj-|svcacct-|admin-)?)[A-Za-z0-9_-]{20,}",  # OpenAI, Anthropic
            r"(?P<slack>xox[abposre]-|xapp-)[A-Za-z0-9-]{10,}",  # Slack bot/user/app tokens
            r"(?P<aws>AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}(?![A-Za-z0-9])",  # AWS access key id
            r"(?P<gl>gl(?:pat|ptt|dt|rt|cbt|soat|oas)-)[A-Za-z0-9_-]{20,}",  # GitLab
            r"(?P<goog>AIza)[0-9A-Za-z_-]{35}",  # Google API key
            r"(?P<stripe>[rs]k_(?:live|test)_)[0-9A-Za-z]{16,}",  # Stripe
            r"(?P<pypi>pypi-)AgE[A-Za-z0-9_-]{50,}",  # PyPI upload token
            r"(?P<npm>npm_)[A-Za-z0-9]{36}",  # npm
            r"(?P<jwt>eyJ)[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*",  # JWT
        )
    )
)
# Candidates for the randomness test: runs of base64url-ish characters. "/" and "." end a run,
# so paths, hosts and model names are judged piece by piece (a base64 secret holding "/" is
# caught by its flag or variable name instead).
# "=" only ends a run (base64 padding): in ``name=VALUE`` the value is judged alone.
_RUN = re.compile(r"[A-Za-z0-9+_-]{20,}={0,2}")
_SEPARATORS = re.compile(r"[+=_-]")
_HEX = re.compile(r"[0-9a-fA-F-]+")
_WORDS = re.compile(r"[A-Z]?[a-z]{3,}")
RANDOM_MIN_LEN = 20  # characters
RANDOM_MAX_WORDY = 0.6  # share of characters in words ("Causal", "model"); random base62: < 0.5
# Names joined from short pieces ("sft-Qwen2-0-5B-lr3e-4", a pod's "trainer-7f9c8d6b5-x2k9p")
# are not keys: the longest piece between - _ + = needs this many characters, unless all three
# character classes are present and separators are sparse (base64url: one in 32 on average).
RANDOM_MIN_PIECE = 16


def random_entropy_floor(n: int) -> float:
    """Bits per character a random base62 string of length ``n`` reaches 99 times in 100
    (3.6 at 20 characters, 4.2 at 32, 4.5 at 40), lowered by a margin; capped at 4.3."""
    return min(4.3, 3.5 + 0.04 * (n - RANDOM_MIN_LEN))


def _looks_random(run: str) -> bool:
    """A credential-like random string: 20+ characters of at least two of lower case, upper
    case and digits, a piece of 16+ between separators (or sparse separators), not made of
    words (``LlamaForCausalLM``), and Shannon entropy above :func:`random_entropy_floor`.
    Hex (git SHAs, UUIDs, hashes) is kept."""
    n = len(run)
    classes = any(c.islower() for c in run) + any(c.isupper() for c in run)
    classes += any(c.isdigit() for c in run)
    if n < RANDOM_MIN_LEN or classes < 2 or _HEX.fullmatch(run):
        return False
    separators = len(_SEPARATORS.findall(run))
    longest = max(len(piece) for piece in _SEPARATORS.split(run))
    if longest < RANDOM_MIN_PIECE and not (classes == 3 and separators * 6 <= n):
        return False
    if sum(len(w) for w in _WORDS.findall(run)) >= RANDOM_MAX_WORDY * n:
        return False
    counts: dict[str, int] = {}
    for c in run:
        counts[c] = counts.get(c, 0) + 1
    entropy = -sum(k / n * math.log2(k / n) for k in counts.values())
    return entropy >= random_entropy_floor(n)


def _format_sub(m: re.Match[str]) -> str:
    prefix = next((g for g in m.groups() if g is not None), "")
    return prefix + MASK


def _run_sub(m: re.Match[str]) -> str:
    return MASK if _looks_random(m.group()) else m.group()


# A PEM block's body (a private key pasted into an argument or a message); a block cut short
# (a command line cut at its length limit) is masked to the end.
_PEM = re.compile(r"(-----BEGIN [A-Z0-9 ]{1,40}-----)(.+?)(-----END [A-Z0-9 ]{1,40}-----|\Z)", re.S)


def scrub_pem(text: str) -> str:
    """``text`` with the body of every PEM block masked (header and footer kept)."""
    if "-----BEGIN " not in text:
        return text
    return _PEM.sub(lambda m: f"{m.group(1)}{MASK}{m.group(3)}", text)


def scrub_formats(text: str) -> str:
    """``text`` with every PEM body, known token and random-looking run masked."""
    if len(text) < 10:  # shorter than every format and every random run
        return text
    text = scrub_pem(text)
    text = _FORMATS.sub(_format_sub, text)
    return _RUN.sub(_run_sub, text)
