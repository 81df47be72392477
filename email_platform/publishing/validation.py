"""Synchronous checks ``publish()`` runs on what the producer can fix.

Everything the database or a provider would refuse later is refused here, with a
``PublishError`` naming the field: a string longer than its column, text with NUL or with
characters UTF-8 cannot encode (lone surrogates), an integer beyond its column's range, a
payload nested too deep to encode, an address mail systems refuse, a value bound for a mail
header that holds a line break (raw or RFC 2047 encoded). Column limits are read from the
schema, so they cannot drift from it.
"""

import json
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from email_validator import EmailNotValidError, validate_email

from email_platform.common.errors import (
    HeaderInjectionError,
    InvalidAddressError,
    InvalidIdempotencyKeyError,
    InvalidPayloadError,
    PublishError,
    UnknownPriorityError,
)
from email_platform.common.lanes import LANES, Lane
from email_platform.common.text import text_problem
from email_platform.db.schema import email_messages, email_outbox
from email_platform.mail.headers import unsafe_header_reason

MAX_PAYLOAD_BYTES = 64 * 1024
#: Deeper JSON than this is refused (Python's encoder recurses, and no template needs it).
MAX_PAYLOAD_DEPTH = 32
#: The ``Integer`` columns' range on PostgreSQL (SQLite takes more; both must agree).
MAX_INT32 = 2**31 - 1
#: A recipient's address: RFC 5321's limit on a path (the column holds 320).
MAX_ADDRESS_LENGTH = 254

AGGREGATE_ID_LENGTH = email_outbox.c.aggregate_id.type.length
EVENT_TYPE_LENGTH = email_outbox.c.event_type.type.length
IDEMPOTENCY_KEY_LENGTH = email_outbox.c.idempotency_key.type.length
MESSAGE_KEY_LENGTH = email_messages.c.idempotency_key.type.length
DEDUPE_KEY_LENGTH = email_messages.c.dedupe_key.type.length
DOMAIN_LENGTH = email_messages.c.recipient_domain.type.length
TRACE_ID_LENGTH = email_outbox.c.trace_id.type.length
CORRELATION_ID_LENGTH = email_outbox.c.correlation_id.type.length
PRODUCER_LENGTH = email_outbox.c.producer.type.length
_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_PLAIN_ADDRESS = re.compile(
    rf"(?P<local>{_ATEXT}(?:\.{_ATEXT})*)@(?P<domain>(?:{_LABEL}\.)+(?P<tld>[A-Za-z]{{2,63}}))"
)
#: Top-level names ``email-validator`` refuses (RFC 6761 special use).
_SPECIAL_USE = frozenset({"arpa", "invalid", "local", "localhost", "onion", "test"})
_EARLIEST = datetime(2, 1, 1, tzinfo=UTC)
_LATEST = datetime(9998, 12, 31, tzinfo=UTC)
_EVENT_TYPE = re.compile(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+")
_W3C_TRACE_ID = re.compile(r"[0-9a-fA-F]{32}")
#: Other tracers' ids: B3 (16 hex), X-Ray (``1-5759e988-bd862e3f...``), Datadog (decimal).
_OPAQUE_TRACE_ID = re.compile(r"[A-Za-z0-9._:-]+")
#: Visible ASCII: it goes into provider metadata, tags and SMTP headers as it is.
_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")


def check_text(field: str, value: Any, max_length: int | None, *, header: bool = False) -> str:
    """A non-empty string that fits its column (and a mail header, if ``header``)."""
    if not isinstance(value, str) or not value:
        raise PublishError(field, "must be a non-empty string")
    if max_length is not None and len(value) > max_length:
        raise PublishError(field, f"is {len(value)} characters; at most {max_length} fit")
    problem = text_problem(value)
    if problem is not None:
        raise PublishError(field, problem)
    if header:
        check_no_line_breaks(field, value)
    return value


def check_address(field: str, value: Any) -> str:
    """An address as mail systems take it (``email-validator``, no deliverability lookup).

    Internationalized domains are accepted; a non-ASCII local part (which needs SMTPUTF8),
    quoted local parts and IP-literal domains are not.
    """
    if isinstance(value, str):
        check_no_line_breaks(field, value)
    if not isinstance(value, str) or len(value) > MAX_ADDRESS_LENGTH:
        raise InvalidAddressError(field, f"{_shown(value)} is not a valid email address")
    if _plainly_valid(value):
        return value
    try:
        checked = validate_email(
            value,
            check_deliverability=False,
            allow_smtputf8=False,
            allow_quoted_local=False,
            allow_domain_literal=False,
            # RFC 5321's 64-character local part, which providers enforce.
            strict=True,
        )
    except EmailNotValidError as exc:
        raise InvalidAddressError(
            field, f"{_shown(value)} is not a valid email address: {exc}"
        ) from None
    if len(checked.domain) > DOMAIN_LENGTH:
        raise InvalidAddressError(field, f"its domain is longer than {DOMAIN_LENGTH} characters")
    return value


def _plainly_valid(address: str) -> bool:
    """The common case without the library's cost (~0.2 ms an address): plain ASCII that
    every rule ``email-validator`` applies accepts. Anything else goes to the library;
    ``tests/integration/test_hostile_publish.py`` checks that this never accepts what it refuses."""
    match = _PLAIN_ADDRESS.fullmatch(address)
    return (
        match is not None
        and len(match.group("local")) <= 64
        and match.group("tld").lower() not in _SPECIAL_USE
        and "--" not in match.group("domain")
    )


def check_no_line_breaks(field: str, value: Any) -> None:
    """A value bound for a mail header: no line break, raw or RFC 2047 encoded."""
    if isinstance(value, str):
        reason = unsafe_header_reason(value)
        if reason is not None:
            raise HeaderInjectionError(field, reason)


def check_event_type(value: Any) -> str:
    if (
        not isinstance(value, str)
        or len(value) > EVENT_TYPE_LENGTH
        or not _EVENT_TYPE.fullmatch(value)
    ):
        raise PublishError("event_type", f"{_shown(value)} is not like 'user.signed_up'")
    return value


def check_aggregate_id(value: Any) -> str:
    return check_text("aggregate_id", value, AGGREGATE_ID_LENGTH, header=True)


def check_event_version(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_INT32:
        raise PublishError("event_version", f"must be an integer from 1 to {MAX_INT32}")
    return value


def check_payload(value: Any, field: str = "payload") -> dict[str, Any]:
    """A JSON object of storable text, at most ``MAX_PAYLOAD_DEPTH`` deep and 64 KiB."""
    if not isinstance(value, Mapping):
        raise InvalidPayloadError(field, f"must be a JSON object, got {type(value).__name__}")
    _check_json_tree(field, value)
    try:
        encoded = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidPayloadError(field, f"is not JSON-serializable: {exc}") from None
    size = len(encoded.encode())
    if size > MAX_PAYLOAD_BYTES:
        raise InvalidPayloadError(field, f"is {size} bytes; the limit is {MAX_PAYLOAD_BYTES}")
    return json.loads(encoded)


def _check_json_tree(field: str, root: Mapping[str, Any]) -> None:
    """Depth and text of every key and string, without recursion (a hostile tree is deep)."""
    stack: list[tuple[str, Any, int]] = [(field, root, 1)]
    while stack:
        path, node, depth = stack.pop()
        if isinstance(node, str):
            problem = text_problem(node)
            if problem is not None:
                raise InvalidPayloadError(path, problem)
        elif isinstance(node, Mapping | list | tuple):
            if depth > MAX_PAYLOAD_DEPTH:
                raise InvalidPayloadError(path, f"nests deeper than {MAX_PAYLOAD_DEPTH} levels")
            if isinstance(node, Mapping):
                for key, item in node.items():
                    if isinstance(key, str):
                        problem = text_problem(key)
                        if problem is not None:
                            raise InvalidPayloadError(f"{path} key {_shown(key)}", problem)
                    stack.append((f"{path}.{_key_text(key)}", item, depth + 1))
            else:
                stack.extend((f"{path}[{i}]", item, depth + 1) for i, item in enumerate(node))


def check_metadata(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidPayloadError("metadata", "must be a JSON object")
    for key, item in value.items():
        check_no_line_breaks(f"metadata.{_key_text(key)}", item)
    return check_payload(value, "metadata") if value else {}


def check_priority(value: Any) -> Lane | None:
    if value is None:
        return None
    if isinstance(value, Lane):
        return value
    try:
        if not isinstance(value, str):
            raise TypeError(value)
        return Lane(value)
    except (ValueError, TypeError):
        raise UnknownPriorityError(
            "priority",
            f"{_shown(value)} is not one of {', '.join(lane.value for lane in LANES)}",
        ) from None


def check_aware(field: str, value: Any) -> datetime | None:
    """A timezone-aware datetime, as UTC (SQLite would otherwise drop the offset)."""
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise PublishError(field, "must be a datetime")
    try:
        offset = value.utcoffset()
    except Exception as exc:  # a tzinfo of the caller's that fails
        raise PublishError(field, f"has a timezone that cannot be read: {exc}") from None
    if offset is None:
        raise PublishError(field, "must be timezone-aware (naive datetimes are ambiguous)")
    try:
        instant = value.astimezone(UTC)
    except (OverflowError, ValueError) as exc:
        raise PublishError(
            field, f"is outside the range of representable instants: {exc}"
        ) from None
    # A reader in another time zone must be able to read it back (year 1 and 9999 are not).
    if not _EARLIEST <= instant <= _LATEST:
        raise PublishError(field, "must be between the years 2 and 9998")
    return instant


def check_idempotency_key(value: Any) -> str | None:
    """A key every adapter carries byte for byte: visible ASCII (``!`` to ``~``: no space, no
    control character, nothing outside ASCII), at most ``IDEMPOTENCY_KEY_LENGTH`` (200), and no
    ``=?`` (the start of an RFC 2047 encoded word, which a mail reader would decode).

    Why: the key (``{key}:{route}``, at most 255) goes out as HTTP's ``Idempotency-Key``
    (sandbox, Resend: latin-1 at most, Resend takes 256 characters), as the SMTP and SES header
    ``X-Email-Idempotency-Key`` (SES takes printable ASCII only) and in the Message-ID, and as
    provider metadata. Anything else was accepted here and dead-lettered at send time.
    """
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidIdempotencyKeyError("idempotency_key", "must be a non-empty string")
    check_no_line_breaks("idempotency_key", value)  # the more precise answer: injection
    if len(value) > IDEMPOTENCY_KEY_LENGTH:
        raise InvalidIdempotencyKeyError(
            "idempotency_key",
            f"is {len(value)} characters; at most {IDEMPOTENCY_KEY_LENGTH} fit",
        )
    if not _VISIBLE_ASCII.fullmatch(value):
        raise InvalidIdempotencyKeyError(
            "idempotency_key",
            f"{_shown(value)} must be visible ASCII characters (! to ~), without spaces: "
            "it travels in HTTP and mail headers",
        )
    if "=?" in value:
        raise InvalidIdempotencyKeyError(
            "idempotency_key",
            f"{_shown(value)} holds '=?', which mail readers decode as an RFC 2047 encoded word",
        )
    return value


def check_trace_id(value: Any) -> str | None:
    """A W3C trace id (32 hex digits, stored lowercase as OpenTelemetry writes it), or another
    tracer's opaque id: letters, digits and ``. _ : -``, at most 64 characters."""
    if value is None:
        return None
    check_text("trace_id", value, TRACE_ID_LENGTH)
    if _W3C_TRACE_ID.fullmatch(value):
        if not value.strip("0"):
            raise PublishError("trace_id", "is all zeros, which W3C Trace Context calls invalid")
        return value.lower()
    if not _OPAQUE_TRACE_ID.fullmatch(value):
        raise PublishError(
            "trace_id",
            f"{_shown(value)} is neither a W3C trace id (32 hex digits) nor an id of letters, "
            "digits and . _ : -",
        )
    return value


def check_correlation_id(value: Any) -> str | None:
    """An opaque id of the caller's request: visible ASCII (no spaces) without ``=?``, at most
    200 (it travels as the ``X-Email-Correlation-Id`` header and as provider metadata)."""
    if value is None:
        return None
    check_text("correlation_id", value, CORRELATION_ID_LENGTH, header=True)
    if not _VISIBLE_ASCII.fullmatch(value):
        raise PublishError(
            "correlation_id",
            f"{_shown(value)} must be visible ASCII characters, without spaces",
        )
    if "=?" in value:  # X-Email-Correlation-Id over SMTP: a reader would decode it
        raise PublishError(
            "correlation_id",
            f"{_shown(value)} holds '=?', which mail readers decode as an RFC 2047 encoded word",
        )
    return value


def check_producer(value: Any) -> str | None:
    """The publishing service's name: printable text on one line, at most 200 characters."""
    if value is None:
        return None
    value = check_text("producer", value, PRODUCER_LENGTH, header=True)
    if not value.isprintable():
        raise PublishError("producer", f"{_shown(value)} must be printable text")
    return value


def check_message_key(field: str, base_key: str, route_name: str) -> None:
    """The message's provider key ``{base}:{route}`` must fit its column."""
    length = len(base_key) + 1 + len(route_name)
    if length > MESSAGE_KEY_LENGTH:
        raise PublishError(
            field,
            f"makes the key of route {route_name} {length} characters; at most "
            f"{MESSAGE_KEY_LENGTH} fit",
        )


def check_dedupe_key(field: str, key: str) -> None:
    if len(key) > DEDUPE_KEY_LENGTH:
        raise InvalidPayloadError(
            field, f"makes a dedupe key of {len(key)} characters; at most {DEDUPE_KEY_LENGTH} fit"
        )
    problem = text_problem(key)
    if problem is not None:
        raise InvalidPayloadError(field, f"makes a dedupe key that {problem}")


def _key_text(key: Any) -> str:
    return key if isinstance(key, str) and text_problem(key) is None else repr(key)


def _shown(value: Any) -> str:
    """``value`` for an error message: short, and printable whatever it holds."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
