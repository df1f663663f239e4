"""What a run never writes or prints resolved: credentials.

A config value is a secret when its key looks like one (`api_key`, `hf_token`, `password`, a header named
`Authorization`, ...) or when it came from the environment (`${oc.env:VAR}`, as the docs advise for keys). The
records of a run (a checkpoint's config fingerprint, the W&B config) keep such a value as it was written: the
interpolation, or for a value typed in clear a hash (`sha256:...`, so that a changed key still reads as a change);
every line the commands print or hand to W&B has the resolved values blanked out (`redact`).

    secrets = find_secrets(cfg)            # the composed DictConfig, interpolations unresolved
    remember(secrets.values)               # from now on redact() blanks them out
    record = secrets.recorded(composed)    # the resolved config with each secret as written or hashed
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SECRET_MARKERS = ("api_key", "apikey", "secret", "password", "passwd", "authorization", "cookie")  # anywhere in a key
# ...and keys that end in one of these words: hf_token, access_token, token; not max_new_tokens or tokenizer
SECRET_SUFFIX = re.compile(r"(^|[^a-z0-9])(token|access_?key|private_?key|credentials?|auth)$")
SECRET_ENV = ("WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "OPENAI_API_KEY")
REDACTED = "<redacted>"
SHORTEST = 6  # a shorter value is not blanked out of free text (it would blank out words); records still hide it
_ENV_INTERPOLATION = re.compile(r"\$\{\s*oc\.env\s*:")

_remembered: set[str] = set()


def is_secret_key(key: Any) -> bool:
    """Whether a config key (its last part) names a credential."""
    key = str(key).lower()
    return any(m in key for m in SECRET_MARKERS) or bool(SECRET_SUFFIX.search(key))


def hashed(value: Any) -> str:
    """How a record keeps a secret typed in clear: a hash, equal for equal values."""
    return "sha256:" + hashlib.sha256(str(value).encode()).hexdigest()[:16]


def remember(values) -> None:
    """Secret values of this process's config: `redact` blanks them out of every line from now on."""
    _remembered.update(v for v in values if isinstance(v, str) and len(v) >= SHORTEST)


def secret_values() -> list[str]:
    """The credentials of this process (the environment's and the config's), longest first."""
    found = {v for v in (os.environ.get(k, "") for k in SECRET_ENV) if len(v) >= 8} | _remembered
    return sorted(found, key=len, reverse=True)


def is_recorded_secret(value: Any) -> bool:
    """Whether a recorded value is a secret as records keep it: an environment interpolation or a hash."""
    return isinstance(value, str) and (value.startswith("sha256:") or bool(_ENV_INTERPOLATION.search(value)))


def redact(text: str, values: list[str] | None = None) -> str:
    for value in secret_values() if values is None else values:
        text = text.replace(value, REDACTED)
    return text


def _split_override(override: str) -> tuple[str, str, str] | None:
    """(prefix and key, "=", value) of a command-line override `[+|++|~]KEY=VALUE`; None without a value."""
    key, sep, value = str(override).partition("=")
    return (key, sep, value) if sep else None


def hidden_overrides(overrides) -> list[str]:
    """Command-line overrides as records keep them (as written, unresolved): a secret's value typed in clear is
    hashed, so that a changed key still reads as a changed command; an interpolation stays as written."""
    hidden = []
    for override in overrides or []:
        parts = _split_override(override)
        if parts and is_secret_key(parts[0].rsplit(".", 1)[-1]) and "${" not in parts[2]:
            override = f"{parts[0]}={hashed(parts[2])}"
        hidden.append(str(override))
    return hidden


def remember_overrides(written, resolved) -> None:
    """The secrets of a command's overrides (`written` as typed, `resolved` with interpolations resolved, in the
    same order): a value under a secret's name or from an environment interpolation; `redact` blanks them out."""
    for raw, value in zip(written or [], resolved or [], strict=False):
        raw_parts, parts = _split_override(raw), _split_override(value)
        if raw_parts and parts and (is_secret_key(raw_parts[0].rsplit(".", 1)[-1])
                                    or _ENV_INTERPOLATION.search(raw_parts[2])):
            remember([parts[2]])


def redact_log_records() -> None:
    """Every log record of this process (Hydra's launcher lists each job's overrides) has the secrets `redact`
    knows blanked out of its message; once per process."""
    global _log_records_redacted
    if _log_records_redacted:
        return
    import logging

    make = logging.getLogRecordFactory()

    def redacted_record(*args, **kwargs):
        record = make(*args, **kwargs)
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        return record

    logging.setLogRecordFactory(redacted_record)
    _log_records_redacted = True


_log_records_redacted = False


@dataclass(frozen=True)
class Secrets:
    """The secret leaves of a config: dotted key -> what records keep (the interpolation, or a hash), and the
    resolved values."""

    recorded_as: Mapping[str, str] = field(default_factory=dict)
    values: tuple[str, ...] = ()

    def recorded(self, composed: Mapping) -> dict:
        """`composed` (resolved, plain values) with every secret leaf as records keep it."""
        return _replaced(dict(composed), "", self.recorded_as)

    def names(self, key: str) -> bool:
        """Whether dotted `key` is a secret or holds one."""
        return any(k == key or k.startswith(key + ".") for k in self.recorded_as)


def _replaced(node, prefix: str, recorded_as: Mapping[str, str]):
    if isinstance(node, Mapping):
        items = [(str(k), v) for k, v in node.items()]
    elif isinstance(node, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(node)]
    else:
        return node
    out = {}
    for key, value in items:
        dotted = f"{prefix}.{key}" if prefix else key
        out[key] = recorded_as[dotted] if dotted in recorded_as else _replaced(value, dotted, recorded_as)
    return out if isinstance(node, Mapping) else list(out.values())


def find_secrets(cfg) -> Secrets:
    """The secrets of a composed OmegaConf config (interpolations unresolved; Hydra's own part skipped)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    recorded_as: dict[str, str] = {}
    values: list[str] = []

    def visit(node, prefix: str, secret: bool) -> None:
        items = (node.items_ex(resolve=False) if isinstance(node, DictConfig)
                 else enumerate(node._iter_ex(resolve=False)))
        for key, _ in items:
            dotted = f"{prefix}.{key!s}" if prefix else str(key)
            if dotted == "hydra":
                continue
            child = node._get_node(key)
            under = secret or is_secret_key(key)
            if isinstance(child, (DictConfig, ListConfig)) and not child._is_none() and not child._is_missing():
                visit(child, dotted, under)
                continue
            raw = child._value()
            from_env = isinstance(raw, str) and bool(_ENV_INTERPOLATION.search(raw))
            if not (under or from_env) or raw is None:
                continue
            try:
                value = OmegaConf.select(node, str(key), throw_on_missing=False)
            except Exception:  # noqa: BLE001  an interpolation that does not resolve is refused elsewhere
                value = None
            recorded_as[dotted] = raw if from_env or (isinstance(raw, str) and "${" in raw) else hashed(value)
            if isinstance(value, str) and not (from_env and not under and os.path.exists(value)):
                values.append(value)  # an environment path (${oc.env:HOME}/data) is no credential to blank out

    if isinstance(cfg, DictConfig):
        visit(cfg, "", False)
    return Secrets(recorded_as, tuple(values))


def recorded(cfg) -> dict:
    """A composed OmegaConf config as records keep it: resolved, plain values, Hydra's part left out, each secret as
    written (the interpolation) or hashed (what `Config.recorded` holds of a typed config)."""
    from omegaconf import OmegaConf

    plain = {str(key): OmegaConf.to_container(cfg[key], resolve=True) if OmegaConf.is_config(cfg[key]) else cfg[key]
             for key in cfg if key != "hydra"}
    return find_secrets(cfg).recorded(plain)
