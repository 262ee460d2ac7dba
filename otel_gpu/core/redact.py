"""Keeping credentials out of everything the agent exports: the one set of redaction rules.

Every path that can carry a command line or free text off the machine goes through here: the
``process.command`` attribute (:func:`command_attribute`), the SDK process detector's resource
attributes, log records, alert messages and webhook payloads (:func:`redact_text`,
:func:`redact_value`). A new secret shape is added here once and holds everywhere.

What is masked (docs/redaction.md), each replaced by ``***``:

- the value of a flag or ``KEY=VALUE`` pair whose *name* is secret (:func:`is_secret_name`):
  ``--hf_token X``, ``--db-pass=X``, ``-password X``, ``HF_TOKEN=X``, ``-Dpassword=X``;
- header values of secret headers (Authorization, Proxy-Authorization, Cookie, ``*-Key``,
  ``*-Token``, ...), keeping the auth scheme: ``Authorization: Bearer ***``;
- URL user-info (``https://***@host``) and secret query or fragment parameters
  (``?access_token=***``, ``#access_token=***``);
- ``user:password`` after ``--user`` / ``-u`` (curl), the key after ``wandb login``, the
  credential after a bare ``Bearer``;
- known token formats anywhere, keeping their public prefix (``hf_***``), long random-looking
  strings and PEM bodies (:mod:`otel_gpu.core.redact_formats`).

Rules work on whole arguments, so an executable, a script, a path or a model name
(``Qwen/Qwen2.5-0.5B-Instruct``) survives: only values judged secret are replaced.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar, cast

from otel_gpu.core.commandline import PYTHON, python_target
from otel_gpu.core.redact_formats import MASK, scrub_formats, scrub_pem
from otel_gpu.core.redact_formats import random_entropy_floor as random_entropy_floor

_T = TypeVar("_T")

# OTEL_GPU_PROCESS_COMMAND: what the process.command_line attribute (and the process resource
# detector's command line and arguments) hold; process.command is argv[0] in every mode.
COMMAND_REDACTED = "redacted"  # the command line with secrets masked
COMMAND_EXECUTABLE = "executable"  # the program only (and a Python script or -m module)
COMMAND_OFF = "off"  # no command line
COMMAND_MODES = (COMMAND_REDACTED, COMMAND_EXECUTABLE, COMMAND_OFF)

# -- secret names ------------------------------------------------------------------------------

# Words that are never credentials although they end like one (``bypass`` ends with "pass").
_NOT_SECRET_WORDS = frozenset({"bypass", "compass", "surpass", "overpass"})
# Tokenizer special tokens (``--pad_token "<|endoftext|>"``) are vocabulary, not credentials.
_SPECIAL_TOKEN_WORDS = frozenset({"pad", "eos", "bos", "unk", "sep", "cls", "mask", "special"})
# Dataset field names (``--input_key prompt``, OpenRLHF, TRL) and KV-cache terms are not keys.
_DATA_KEY_WORDS = frozenset(
    {
        "input", "output", "label", "text", "prompt", "response", "chosen", "rejected", "image",
        "sort", "metric", "column", "dataset", "query", "answer", "reward", "message", "messages",
        "system", "group", "partition", "primary",
    }
)  # fmt: skip
# Trailing words that still name the credential itself (``--api_key_b64 X``).
_VALUE_SUFFIX = re.compile(r"(?<=[a-z])[-_.]?(value|str|string|b64|base64|raw|hex)$", re.I)
# Query parameters of signed URLs (S3 presigned, Azure SAS, OAuth redirects).
_QUERY_SECRET_WORDS = frozenset({"sig", "signature", "sign", "code"})

# Header names of OTLP vendors whose last word is not a secret word (Honeycomb's team key).
_VENDOR_SECRET_NAMES = frozenset({("honeycomb", "team")})

_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
_PART = re.compile(r"[^A-Za-z0-9]+")


def _words(name: str) -> list[str]:
    """``--hubToken_v2`` -> ["hub", "token", "v", "2"]: split on punctuation and camelCase."""
    return [w.lower() for part in _PART.split(name) for w in _WORD.findall(part)]


def _without_version(words: list[str]) -> list[str]:
    """``--api_key2``, ``--hf_token_1``, ``--token-v2``: a trailing number or version still
    names the same credential, so it does not decide."""
    while len(words) > 1 and words[-1].isdigit():
        words = words[:-1]
        if len(words) > 1 and words[-1] == "v":
            words = words[:-1]
    return words


def _secret_word(w: str) -> bool:
    if w in _NOT_SECRET_WORDS:
        return False
    return (
        w.endswith(("token", "key", "secret", "secrets", "cookie", "cookies", "session"))
        or w.endswith(("pass", "passwd", "password", "passwords", "pwd", "auth"))
        or w.endswith(("credential", "credentials", "creds"))
        or w in ("pw", "passphrase", "passcode", "dsn")
        or w.startswith(("authoriz", "authoris", "authentic"))
    )


@functools.lru_cache(maxsize=4096)
def is_secret_name(name: str) -> bool:
    """Whether a flag, variable, header or parameter named ``name`` holds a credential.

    The name's *last* word decides (split on ``-``, ``_``, ``.`` and camelCase; a trailing
    ``value``/``b64``-like word is skipped): it is, or ends with, token, key, secret, pass /
    password / pwd, auth / authorization, credential(s), cookie or session. So ``--hf_token``,
    ``X-Api-Key``, ``AWS_SECRET_ACCESS_KEY`` and ``--db-pass`` are secret, while
    ``--tokenizer_name``, ``--max_tokens``, ``--token_file``, ``--num_key_value_heads`` and
    ``--moe_token_dispatcher_type`` are not; nor are special tokens (``--pad_token``) and
    dataset fields (``--input_key``). A trailing number or version (``--api_key2``,
    ``--token-v2``) is skipped; ``dsn`` and vendor headers (``x-honeycomb-team``) are secret.
    """
    words = _without_version(_words(_VALUE_SUFFIX.sub("", name)))
    if tuple(words[-2:]) in _VENDOR_SECRET_NAMES:
        return True
    if not words or not _secret_word(words[-1]):
        return False
    prev = words[-2] if len(words) > 1 else ""
    if words[-1] == "token" and prev in _SPECIAL_TOKEN_WORDS:
        return False
    return not (words[-1] == "key" and prev in _DATA_KEY_WORDS)


def _secret_query_name(name: str) -> bool:
    words = _words(name)
    return bool(words) and (words[-1] in _QUERY_SECRET_WORDS or is_secret_name(name))


# -- one argument ---------------------------------------------------------------------------------

_KV = re.compile(r"(-{0,2}[A-Za-z_][\w.-]*)=(.*)", re.S)
# A header, or a flag written like one (``--api-key: X``, ``--api-key:X``).
_HEADER = re.compile(r"([\[{(,\"'-]*)([A-Za-z][\w.-]*)([\"']?:[ \t]*)(.*)", re.S)
_FLAG = re.compile(r"-{1,2}([A-Za-z][\w.-]*)")
_FLAG_LIKE = re.compile(r"--?[A-Za-z]")
_SCHEME = re.compile(
    r"(bearer|basic|digest|token|bot|negotiate|ntlm|apikey|oauth|jwt|aws4-hmac-sha256)"
    r"(?:(\s+)(.*))?",
    re.I | re.S,
)
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/?#@\s]*@")
# Query parameters, and the fragment's (OAuth implicit flow: ``#access_token=X``).
_QUERY = re.compile(r"([?&;#])([^=&#;\s]+)=([^&#;\s]*)")
_LIST_SEP = re.compile(r"([,;&])")
_LITERALS = frozenset({"true", "false", "yes", "no", "on", "off", "none", "null", "0", "1"})
_USER_FLAGS = frozenset({"-u", "--user", "--proxy-user"})

# What an argument asks of the next one.
_NEXT_FREE = 0
_NEXT_VALUE = 1  # a secret flag's value: masked unless it is another flag
_NEXT_HEADER = 2  # a secret header's value: an auth scheme is kept, then the credential masked
_NEXT_USER = 3  # curl's user:password
_NEXT_LOGIN = 4  # `wandb login [--host URL] KEY`: the first positional that is not a URL

# Tools whose `login` subcommand takes the credential as a positional argument.
_LOGIN_TOOLS = frozenset({"wandb"})


def _mask_value(value: str) -> tuple[str, int]:
    """A secret's value masked; (text, what the next argument is) for a bare auth scheme."""
    if not value or value.lower() in _LITERALS:
        return value, _NEXT_FREE  # a boolean flag's value (--use_auth_token true) hides nothing
    m = _SCHEME.fullmatch(value)
    if m:
        if m.group(3):
            return f"{m.group(1)}{m.group(2)}{MASK}", _NEXT_FREE
        if m.group(2) is None:
            return value, _NEXT_VALUE  # "Bearer" alone: the credential is the next argument
    return MASK, _NEXT_FREE


def _scrub_url(text: str) -> str:
    text = _USERINFO.sub(lambda m: f"{m.group(1)}{MASK}@", text)
    return _QUERY.sub(
        lambda m: (
            f"{m.group(1)}{m.group(2)}={MASK}"
            if m.group(3) and _secret_query_name(m.group(2))
            else m.group()
        ),
        text,
    )


def _redact_piece(arg: str) -> tuple[str, int]:
    """One argument (or one piece of a list value) with the structural rules applied."""
    if "://" in arg:
        m = _KV.fullmatch(arg)
        if m and is_secret_name(m.group(1)):
            return f"{m.group(1)}={_mask_value(m.group(2))[0]}", _NEXT_FREE
        return _scrub_url(arg), _NEXT_FREE
    m = _KV.fullmatch(arg)
    if m:
        key, value = m.groups()
        if is_secret_name(key):
            masked, then = _mask_value(value)
            return f"{key}={masked}", then
        # KEY=a,b;c: each piece may be a pair or a header (OTEL_EXPORTER_OTLP_HEADERS=...).
        parts = _LIST_SEP.split(value)
        return key + "=" + "".join(
            p if i % 2 else _redact_piece(p)[0] for i, p in enumerate(parts)
        ), _NEXT_FREE
    m = _HEADER.fullmatch(arg)
    if m and is_secret_name(m.group(2)):
        lead, name, sep, value = m.groups()
        if not value:
            return arg, _NEXT_HEADER
        return f"{lead}{name}{sep}{_mask_value(value)[0]}", _NEXT_FREE
    m = _FLAG.fullmatch(arg)
    if m and is_secret_name(m.group(1)):
        return arg, _NEXT_VALUE
    if arg in _USER_FLAGS:
        return arg, _NEXT_USER
    if arg.lower() == "bearer":  # "Bearer X" outside a header (a log line, a curl in bash -c)
        return arg, _NEXT_VALUE
    return arg, _NEXT_FREE


def redact_args(args: Sequence[str]) -> list[str]:
    """``args`` with every credential replaced by ``***`` (see the module docstring)."""
    return list(_redacted(args))


def _redacted(args: Iterable[str]) -> Iterator[str]:
    expect = _NEXT_FREE
    previous = ""
    for arg in args:
        if arg == "login" and os.path.basename(previous) in _LOGIN_TOOLS:
            previous, expect = arg, _NEXT_LOGIN
            yield arg
            continue
        previous = arg
        if expect == _NEXT_LOGIN and (not arg or _FLAG_LIKE.match(arg) or "://" in arg):
            yield scrub_formats(_redact_piece(arg)[0])  # --relogin, --host URL: key to come
            continue
        if expect != _NEXT_FREE and arg and not _FLAG_LIKE.match(arg):
            if expect == _NEXT_USER:
                user, colon, password = arg.partition(":")
                text = f"{user}:{MASK}" if colon and not password.isdigit() else arg
                expect = _NEXT_FREE
            elif expect == _NEXT_HEADER and _SCHEME.fullmatch(arg):
                text, expect = arg, _NEXT_VALUE  # "Authorization:" "Bearer" "<credential>"
            else:
                text, expect = _mask_value(arg)
                # A cookie list split on spaces ("a=1;" "b=2") continues to the last pair.
                if text == MASK and arg.endswith((";", ",")):
                    expect = _NEXT_HEADER
            yield text
            continue
        text, expect = _redact_piece(arg)
        yield scrub_formats(text)


def redact_command(args: Sequence[str], max_len: int | None = None) -> str:
    """A command line joined with spaces, credentials masked; cut to ``max_len`` characters
    (the arguments past the cut are not even looked at: redaction only looks back)."""
    out: list[str] = []
    length = -1
    for arg in _redacted(args):
        out.append(arg)
        length += len(arg) + 1
        if max_len is not None and length >= max_len:
            break
    return " ".join(out)[:max_len]


_SPACE = re.compile(r"(\s+)")


def redact_text(text: str) -> str:
    """Free text (a joined command line, a log message, an alert) with credentials masked:
    split on whitespace and judged as a command line, the whitespace kept (a PEM block, which
    spans lines, is masked first)."""
    parts = _SPACE.split(scrub_pem(text))
    words = redact_args(parts[0::2])
    parts[0::2] = words
    return "".join(parts)


def redact_value(value: _T) -> _T:
    """An attribute or JSON value with every string in it redacted (dicts, lists, tuples)."""
    if isinstance(value, str):
        return cast(_T, redact_text(value))
    if isinstance(value, dict):
        return cast(_T, {k: redact_value(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return cast(_T, type(value)(redact_value(v) for v in value))
    return value


# -- the process.command attribute ----------------------------------------------------------------


def program(args: Sequence[str]) -> str:
    """The program: ``args[0]``, and for a Python interpreter its script or ``-m module``."""
    if not args:
        return ""
    shown = [args[0]]
    if PYTHON.match(os.path.basename(args[0])):
        kind, value, _ = python_target(args[1:])
        shown += {"module": ["-m", value], "code": ["-c"], "script": [value]}.get(kind, [])
    return " ".join(a for a in shown if a)


def command_attribute(
    args: Sequence[str], mode: str = COMMAND_REDACTED, max_len: int | None = None
) -> str | None:
    """``process.command_line`` for ``args`` under ``OTEL_GPU_PROCESS_COMMAND`` (``mode``), at
    most ``max_len`` characters."""
    if not args or mode == COMMAND_OFF:
        return None
    if mode == COMMAND_EXECUTABLE:
        return program(args)[:max_len]
    return redact_command(args, max_len)


def command_name(args: Sequence[str], max_len: int | None = None) -> str | None:
    """``process.command``: the command name, ``argv[0]`` (semconv), credentials masked as in
    any string we emit, at most ``max_len`` characters; None for an empty command line."""
    if not args or not args[0]:
        return None
    return redact_text(args[0])[:max_len]


_URL_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)?[^/?#@\s]*@")
_URL_PARAMETER = re.compile(r"([?&;#])([^=&#;\s]*)=([^&#;\s]*)")


def mask_url(url: str) -> str:
    """A URL (or ``host:port``) as an error message may echo it: user-info and the value of
    every query and fragment parameter masked, whatever their names (an endpoint that carries
    them at all carries a credential there)."""
    text = _URL_USERINFO.sub(lambda m: f"{m.group(1) or ''}{MASK}@", url)
    return _URL_PARAMETER.sub(lambda m: f"{m.group(1)}{m.group(2)}={MASK}", text)
