"""Cached judge data authenticated by a key that lives only in this judge process's memory.

Where candidate processes cannot be confined (no Landlock), a candidate could rewrite the judge's
cache on disk. A record this process wrote carries an HMAC tag under a key made at import and never
written anywhere, so a record without a valid tag (another process's, or a rewritten one) is not
trusted: the caller measures again. Where confinement is applied the tag is not needed, and records
stay shared between judge processes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets

_KEY = secrets.token_bytes(32)


def needed() -> bool:
    """True where candidate processes are not confined by Landlock (checked per call: tests switch it)."""
    from sandbox.confinement.filesystem import shared_caches_trusted

    return not shared_caches_trusted()


def _tag(data: dict) -> str:
    body = json.dumps({k: v for k, v in data.items() if k != "tag"}, sort_keys=True, default=str).encode()
    return hmac.new(_KEY, body, hashlib.sha256).hexdigest()


def seal(data: dict) -> dict:
    return {**data, "tag": _tag(data)} if needed() else data


def opened(data: object) -> dict | None:
    """The record if it may be trusted, else None."""
    if not isinstance(data, dict):
        return None
    if needed() and not hmac.compare_digest(str(data.get("tag", "")), _tag(data)):
        return None
    return data
