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
from email.utils import parseaddr
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Connection, create_engine, inspect

from email_platform import publish, publish_many
from email_platform.common.errors import (
    HeaderInjectionError,
    InvalidIdempotencyKeyError,
    PublishError,
)
from email_platform.common.lanes import Lane
from email_platform.common.timeutil import utcnow
from email_platform.mail import addressing
from email_platform.mail.addressing import Mailbox
from email_platform.mail.routes import Route, RouteTable
from email_platform.providers.base import OutgoingEmail, header_problem
from email_platform.publishing.publisher import _event_row
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


def _addressed_routes() -> RouteTable:
    return RouteTable(
        routes=[
            Route(
                name="invoice",
                event_type="invoice.issued",
                event_version=1,
                template="t",
                lane=Lane.TRANSACTIONAL,
                sender=Mailbox(address_field="from_email", name_field="from_name"),
                reply_to=(Mailbox(address_field="from_email"),),
                cc=(Mailbox(address_field="cc_email", name_field="cc_name"),),
            )
        ]
    )


_HOSTILE = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40) | st.sampled_from(
    [
        "a@example.com\r\nBcc: x@evil.example",
        "=?utf-8?q?a=0D=0Ab?=",
        "Eve <eve@evil.example>",
        '"Eve" <eve@evil.example>',
        "eve@evil.example, other@example.com",
        "jane@example.com",
        "Zoë, Sales",
        "jane@bücher.example.com",
    ]
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    from_email=_HOSTILE,
    from_name=st.none() | _HOSTILE | st.integers(),
    cc_email=_HOSTILE | st.lists(_HOSTILE, max_size=2),
    cc_name=st.none() | _HOSTILE,
)
def test_payload_addresses_are_refused_naming_the_field_or_sendable(
    from_email: Any, from_name: Any, cc_email: Any, cc_name: Any
) -> None:
    """Whatever a producer puts in the fields a route's From, Reply-To and Cc read: a
    ``PublishError`` naming one of those fields, or addresses every adapter can write as the
    one mailbox each shows (no line break, no second address, no display name that hides one)."""
    routes = _addressed_routes()
    payload = {"email": "jane@example.com", "from_email": from_email, "cc_email": cc_email}
    payload.update({k: v for k, v in (("from_name", from_name), ("cc_name", cc_name)) if v})
    try:
        _event_row(
            routes,
            utcnow(),
            event_type="invoice.issued",
            aggregate_id="a1",
            payload=payload,
        )
    except PublishError as error:
        # The field, or an item of it (``payload.cc_email[0]``).
        assert error.field is not None, error
        assert error.field.split("[")[0] in {f"payload.{name}" for name in payload}, error
        return
    resolved = addressing.address(routes.routes[0], payload, "x@example.com")
    email = OutgoingEmail(
        message_id=1,
        event_id="01JDQ5Z3K8M9N0P1Q2R3S4T5V6",
        idempotency_key="k",
        sender=resolved.sender,
        to="jane@example.com",
        subject="s",
        text="t",
        html=None,
        template="t",
        lane="transactional",
        reply_to=resolved.reply_to,
        cc=resolved.cc,
    )
    assert header_problem(email) is None
    for shown, wanted in ((email.sender, from_email), (email.cc[0], cc_email)):
        assert parseaddr(shown)[1] == wanted  # the one address published, nothing else
