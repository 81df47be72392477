"""Synchronous checks ``publish()`` runs on what the producer can fix."""

import json
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from email_platform.errors import (
    HeaderInjectionError,
    InvalidAddressError,
    InvalidPayloadError,
    PublishError,
    UnknownPriorityError,
)
from email_platform.lanes import LANES, Lane

MAX_PAYLOAD_BYTES = 64 * 1024
_ADDRESS = re.compile(r"^[A-Za-z0-9.!#$%&'*+/=?^_`{|}~-]{1,64}@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+$")
_EVENT_TYPE = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$")


def check_address(field: str, value: Any) -> str:
    if not isinstance(value, str) or len(value) > 320 or not _ADDRESS.fullmatch(value):
        if isinstance(value, str) and ("\r" in value or "\n" in value):
            raise HeaderInjectionError(field, "contains CR or LF")
        raise InvalidAddressError(field, f"{value!r} is not a valid email address")
    return value


def check_no_line_breaks(field: str, value: Any) -> None:
    if isinstance(value, str) and ("\r" in value or "\n" in value):
        raise HeaderInjectionError(field, "contains CR or LF, which would inject mail headers")


def check_event_type(value: Any) -> str:
    if not isinstance(value, str) or not _EVENT_TYPE.fullmatch(value) or len(value) > 200:
        raise PublishError("event_type", f"{value!r} is not like 'user.signed_up'")
    return value


def check_aggregate_id(value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > 200:
        raise PublishError("aggregate_id", "must be a non-empty string of at most 200 characters")
    check_no_line_breaks("aggregate_id", value)
    return value


def check_payload(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidPayloadError("payload", f"must be a JSON object, got {type(value).__name__}")
    try:
        encoded = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidPayloadError("payload", f"is not JSON-serializable: {exc}") from None
    if len(encoded.encode()) > MAX_PAYLOAD_BYTES:
        raise InvalidPayloadError(
            "payload", f"is {len(encoded.encode())} bytes; the limit is {MAX_PAYLOAD_BYTES}"
        )
    return json.loads(encoded)


def check_metadata(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidPayloadError("metadata", "must be a JSON object")
    for key, item in value.items():
        check_no_line_breaks(f"metadata.{key}", item)
    return check_payload(value) if value else {}


def check_priority(value: Any) -> Lane | None:
    if value is None:
        return None
    try:
        return Lane(value)
    except ValueError:
        raise UnknownPriorityError(
            "priority", f"{value!r} is not one of {', '.join(lane.value for lane in LANES)}"
        ) from None


def check_aware(field: str, value: Any) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise PublishError(field, "must be a datetime")
    if value.tzinfo is None:
        raise PublishError(field, "must be timezone-aware (naive datetimes are ambiguous)")
    return value


def check_idempotency_key(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > 200:
        raise PublishError("idempotency_key", "must be a non-empty string of at most 200 chars")
    check_no_line_breaks("idempotency_key", value)
    return value
