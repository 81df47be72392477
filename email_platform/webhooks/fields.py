"""Small readers every normalizer shares: provider payloads are untrusted JSON."""

import hashlib
import json
from collections.abc import Mapping
from typing import Any


def stable_event_id(event: Mapping[str, Any]) -> str:
    """An id for a provider event that has none: the same event hashes the same on redelivery."""
    canonical = json.dumps(event, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def as_object(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def stripped_text(value: object) -> str | None:
    """Any scalar as trimmed text; empty or missing is None."""
    if value is None:
        return None
    text = str(value).strip()
    return text or None


def fitting_id(value: object, max_length: int) -> str | None:
    """A string id that fits its column; anything else is not one of ours and is not trusted."""
    return value if isinstance(value, str) and 0 < len(value) <= max_length else None
