"""Secrets kept out of what diffrl records (MLflow tags, params and config.yaml, log lines, error messages).

- A URL's credentials: `https://user:TOKEN@host/x.git` -> `https://***@host/x.git` (a git remote, an s3fs
  `s3://key:secret@bucket`, a judge's base_url), and the values of secret-like query parameters
  (`?token=...`, `&sig=...`, `X-Amz-Signature=...`) -> `***`.
- The value under a secret-like key (`storage_options` `key` / `secret` / `token` / `aws_secret_access_key` /
  `account_key` / `password`, any `api_key`) -> `***`. A name ending in `_env` names an environment variable,
  not its value, and is kept (`api_key_env`).
"""

from __future__ import annotations

import re
from typing import Any

MASK = "***"
_SECRET_WORDS = frozenset(
    {"password", "passwd", "pwd", "secret", "token", "credential", "credentials", "apikey", "sas", "sig", "signature"}
    | {"auth", "authorization", "cookie"}
)
_SECRET_PAIRS = frozenset({("api", "key"), ("access", "key"), ("account", "key"), ("private", "key")})
_SECRET_PAIRS |= frozenset({("secret", "key"), ("session", "key"), ("master", "key"), ("client", "key")})
# scheme://userinfo@ : the userinfo (user, user:password, a bare token) is what a URL carries as credentials
_URL_CREDENTIALS = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.\-]*://)(?P<userinfo>[^/?#@\s'\"]+)@")
_QUERY_PARAMETER = re.compile(r"(?P<lead>[?&;])(?P<name>[^=&#\s'\"]+)=(?P<value>[^&#\s'\"]*)")


def _words(name: str) -> list[str]:
    """'aws_secret_access_key' -> [aws, secret, access, key]; 'apiKey' -> [api, key]."""
    return [w for w in re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()) if w]


def is_secret_name(name: str) -> bool:
    """Whether a key or parameter named `name` holds a secret (token, password, api_key, s3fs `key`/`secret`)."""
    words = _words(str(name))
    if not words or words[-1] == "env":  # `api_key_env`: the variable's name, not the key
        return False
    if words == ["key"]:
        return True
    return any(w in _SECRET_WORDS for w in words) or any(pair in _SECRET_PAIRS for pair in zip(words, words[1:]))


def redact_text(text: str) -> str:
    """`text` with every URL's credentials and every secret-like query parameter's value replaced by ***."""
    text = _URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}{MASK}@", text)

    def parameter(m: re.Match) -> str:
        return f"{m['lead']}{m['name']}={MASK}" if is_secret_name(m["name"]) and m["value"] else m[0]

    return _QUERY_PARAMETER.sub(parameter, text)


def redact(value: Any) -> Any:
    """A copy of `value` (dicts, lists, tuples, strings, scalars) safe to record: under a secret-like key a set
    value becomes ***, and every string has its URL credentials removed (redact_text)."""
    if isinstance(value, dict):
        return {k: MASK if is_secret_name(k) and value[k] not in (None, "") else redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    if isinstance(value, str):
        return redact_text(value)
    return value
