"""publish() refuses, with a typed error naming the field, what an adapter could not carry.

The rule for an idempotency key (``validation.check_idempotency_key``): visible ASCII (``!`` to
``~``), at most 200 characters, no ``=?``. It travels as HTTP's ``Idempotency-Key`` (sandbox,
Resend), as the ``X-Email-Idempotency-Key`` mail header (SMTP, SES) and inside the Message-ID.
Before, a non-ASCII key was accepted here and dead-lettered at send time as ``unexpected``
(``UnicodeEncodeError`` in the sandbox and Resend adapters). A correlation id (the
``X-Email-Correlation-Id`` header) may not hold ``=?`` either. No database is needed: the
connection has no tables, so a refusal that touched one would fail differently.
"""

import string
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Connection, create_engine, inspect

from email_platform import publish, publish_many
from email_platform.common.errors import (
    HeaderInjectionError,
    InvalidIdempotencyKeyError,
    PublishError,
)
from email_platform.publishing.validation import check_correlation_id, check_idempotency_key


@pytest.fixture
def tableless() -> Iterator[Connection]:
    engine = create_engine("sqlite://")
    with engine.begin() as connection:
        yield connection
    engine.dispose()


def _signed_up(**changes: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "event_type": "user.signed_up",
        "aggregate_id": "user_1",
        "payload": {"email": "jane@example.com", "first_name": "Jane", "user_id": "u1"},
    }
    return {**fields, **changes}


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("clé-de-commande", "non-ASCII: latin-1 in an HTTP header at best, refused by SES"),
        ("订单-7781", "non-ASCII outside latin-1: httpx cannot encode it at all"),
        ("order 7781", "a space: folded away or split by header parsers"),
        ("order\t7781", "a tab"),
        ("=?utf-8?q?order?=", "an RFC 2047 encoded word: mail readers decode it"),
        ("order-=?7781", "an encoded word may start anywhere"),
        ("k" * 201, "longer than its column (200)"),
        ("", "empty"),
        (7781, "not a string"),
    ],
)
def test_an_idempotency_key_no_header_can_hold_is_refused_naming_the_field(
    tableless: Connection, key: Any, why: str
) -> None:
    with pytest.raises(InvalidIdempotencyKeyError) as info:
        publish(tableless, **_signed_up(idempotency_key=key))
    assert isinstance(info.value, PublishError) and isinstance(info.value, ValueError)
    assert info.value.field == "idempotency_key"
    assert str(info.value).startswith("idempotency_key: ")
    assert inspect(tableless).get_table_names() == []  # refused before any write


@pytest.mark.parametrize("key", ["key\r\nBcc: x@example.com", "key\n", "key\x00", "key\x7f"])
def test_a_key_that_could_break_a_header_is_still_header_injection(
    tableless: Connection, key: str
) -> None:
    with pytest.raises(HeaderInjectionError) as info:
        publish(tableless, **_signed_up(idempotency_key=key))
    assert info.value.field == "idempotency_key"


@pytest.mark.parametrize(
    "key",
    [
        "order-7781:receipt",
        "01JDQ7YV6M8X3N2K4P5R6S7T8V",
        "k" * 200,
        string.punctuation.replace("=", ""),  # every visible ASCII mark; '=' alone is fine too
        "a=b?c",
    ],
)
def test_a_key_of_visible_ascii_is_kept_exactly(key: str) -> None:
    assert check_idempotency_key(key) == key


def test_publish_many_names_the_event_and_keeps_the_type(tableless: Connection) -> None:
    events = [_signed_up(idempotency_key="fine-1"), _signed_up(idempotency_key="pas-trés-bien")]
    with pytest.raises(InvalidIdempotencyKeyError) as info:
        publish_many(tableless, events)
    assert info.value.field == "events[1].idempotency_key"


@pytest.mark.parametrize("value", ["=?utf-8?b?SGk=?=", "req-=?x"])
def test_a_correlation_id_with_an_encoded_word_start_is_refused(value: str) -> None:
    with pytest.raises(PublishError) as info:
        check_correlation_id(value)
    assert info.value.field == "correlation_id"


def test_a_correlation_id_of_visible_ascii_is_kept() -> None:
    assert check_correlation_id("req-7f3a9c:checkout/42") == "req-7f3a9c:checkout/42"
