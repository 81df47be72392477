"""Addressing and attachments through the real send path (publish -> send job -> sandbox over
HTTP), on SQLite and PostgreSQL: the demo receipt from billing@ with its Reply-To and PDF, a
route whose From, Cc and Bcc come from the payload, an attachment function that fails for one
order (that message alone dead-lettered, named), hostile address fields refused at publish, and
an adapter that cannot carry an envelope sender refused before anything is claimed.
"""

import base64
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import create_engine, insert, make_url, select

from email_platform.common.errors import ConfigurationError, HeaderInjectionError, PublishError
from email_platform.common.lanes import Lane
from email_platform.mail.addressing import Attachment, AttachmentLimits, Mailbox
from email_platform.mail.routes import Route, RouteTable, demo_routes
from email_platform.operating.admin import requeue_dead_letters
from email_platform.resources import EmailProviderResource, RoutingResource
from email_platform.sandbox.asgi import BackgroundServer
from email_platform.store import outbox
from tests.provider_stubs.mailgun import MailgunStub
from tests.provider_stubs.postmark import PostmarkStub
from tests.provider_stubs.resend import ResendStub
from tests.provider_stubs.sendgrid import SendGridStub
from tests.support import (
    dead_letters_of,
    event,
    messages_of,
    product,
    publish_one,
    run_send,
    sandbox_messages,
    users,
)

ROUTES = "tests.integration.test_addressing_send_path:routes"


#: Orders whose invoice service is down, while a test says so.
DOWN: set[str] = set()
#: Where ``_files`` records that it ran, when a test sets it (a product writing an audit row).
AUDIT: dict[str, str] = {}


def _files(payload: Mapping[str, Any]) -> list[Attachment]:
    if payload.get("order_id") == "boom" or payload.get("order_id") in DOWN:
        raise RuntimeError("the invoice service is down")
    if "url" in AUDIT:
        # A write of the product's, with a 1 s lock timeout: it would wait (and fail) if the
        # send path still held its transaction (SQLite's one write lock) while files are made.
        url = make_url(AUDIT["url"])
        audit = create_engine(
            url, connect_args={"timeout": 1} if url.drivername == "sqlite" else {}
        )
        try:
            with audit.begin() as connection:
                product.create_all(connection)
                connection.execute(
                    insert(users).values(id=f"audit-{payload['order_id']}", email="a@example.com")
                )
        finally:
            audit.dispose()
    count = int(payload.get("files", 1))
    return [
        Attachment(f"../invoice-{i}\r\n.txt", "text/plain", f"line {i}\n".encode())
        for i in range(count)
    ]


def routes() -> RouteTable:
    """A demo table plus a route addressed from the payload, with Cc, Bcc and files."""
    table = demo_routes()
    table.routes.append(
        Route(
            name="invoice",
            event_type="invoice.issued",
            event_version=1,
            template="receipt",
            lane=Lane.TRANSACTIONAL,
            header_fields=("first_name", "order_id"),
            sender=Mailbox(address_field="seller_email", name_field="seller_name", name="Shop"),
            reply_to=(Mailbox(address_field="seller_email"),),
            cc=(Mailbox(address_field="accountant"),),
            bcc=(Mailbox(address="archive@example.com"),),
            attachments=_files,
            attachment_limits=AttachmentLimits(max_count=2, max_total_bytes=1000),
        )
    )
    table.schemas[("invoice.issued", 1)] = {"type": "object"}
    return table


def _routing() -> RoutingResource:
    return RoutingResource(routes_factory=ROUTES)


def _invoice(engine, order_id: str, **payload: Any) -> str:  # type: ignore[no-untyped-def]
    values = {
        "email": f"{order_id}@example.com",
        "order_id": order_id,
        "first_name": "Ada",
        "items": [{"name": "Mug", "quantity": 1, "unit_price": 9.5}],
        "total": 9.5,
        "currency": "EUR",
        "seller_email": "sales@shop.example.com",
        "seller_name": "Zoë, Sales",
        "accountant": "books@example.org",
        **payload,
    }
    return publish_one(
        engine,
        event_type="invoice.issued",
        aggregate_id=order_id,
        payload=values,
        routes=routes(),
    )


def test_the_demo_receipt_goes_from_billing_with_reply_to_and_its_pdf(
    engine, database_url, sandbox
):
    event_id = publish_one(
        engine,
        event_type="order.paid",
        aggregate_id="O-1",
        payload={
            "email": "ada@example.com",
            "order_id": "O-1",
            "first_name": "Ada",
            "items": [{"name": "Mug", "quantity": 2, "unit_price": 9.5}],
            "total": 19.0,
            "currency": "EUR",
        },
        routes=demo_routes(),
    )
    result = run_send(database_url, sandbox.base_url, "transactional", [event_id])
    assert result.success
    (seen,) = sandbox_messages(sandbox.base_url, event_id)
    assert seen["from"] == "Shop billing <billing@example.com>"
    assert seen["reply_to"] == ["Shop support <support@example.com>"]
    (pdf,) = seen["attachments"]
    assert (pdf["filename"], pdf["content_type"]) == ("receipt-O-1.pdf", "application/pdf")
    content = base64.b64decode(pdf["content"])
    assert content.startswith(b"%PDF-1.4") and b"Receipt for order O-1" in content
    # Made at send time: the outbox keeps the payload, not the file.
    assert "attachments" not in event(engine, event_id).payload
    (message,) = messages_of(engine, event_id)
    assert message.status == "sent"


def test_addresses_from_the_payload_cc_bcc_and_files_reach_the_provider(
    engine, database_url, sandbox
):
    event_id = _invoice(engine, "I-1", files=2)
    result = run_send(
        database_url, sandbox.base_url, "transactional", [event_id], routing=_routing()
    )
    assert result.success
    (seen,) = sandbox_messages(sandbox.base_url, event_id)
    assert seen["from"] == '"Zoë, Sales" <sales@shop.example.com>'
    assert seen["to"] == "I-1@example.com"
    assert seen["reply_to"] == ["sales@shop.example.com"]
    assert seen["cc"] == ["books@example.org"]
    assert seen["bcc"] == ["archive@example.com"]
    assert "envelope_sender" not in seen
    # Path separators and line breaks in a name the route made are replaced, never sent.
    assert [a["filename"] for a in seen["attachments"]] == ["_invoice-0__.txt", "_invoice-1__.txt"]
    assert base64.b64decode(seen["attachments"][1]["content"]) == b"line 1\n"


def test_a_failing_attachment_or_a_breached_limit_dead_letters_that_message_alone(
    engine, database_url, sandbox
):
    boom = _invoice(engine, "boom")
    many = _invoice(engine, "I-2", files=3)
    good = _invoice(engine, "I-3")
    result = run_send(
        database_url, sandbox.base_url, "transactional", [boom, many, good], routing=_routing()
    )
    assert not result.success  # a run with dead letters fails, as documented
    (letter,) = dead_letters_of(engine, boom)
    assert letter.error_code == "attachment_failed"
    assert "RuntimeError: the invoice service is down" in letter.last_error
    (letter,) = dead_letters_of(engine, many)
    assert letter.error_code == "attachments_too_many"
    assert event(engine, good).status == outbox.DONE
    assert [m["metadata"]["event_id"] for m in sandbox_messages(sandbox.base_url)] == [good]
    (message,) = messages_of(engine, good)
    assert message.attempts == 1


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("seller_email", "not an address", PublishError),
        ("seller_email", "a@example.com\r\nBcc: x@evil.example", HeaderInjectionError),
        ("accountant", ["books@example.org"], PublishError),
        ("seller_name", "Eve\r\nBcc: x@evil.example", HeaderInjectionError),
        ("seller_name", "Eve <eve@evil.example>", PublishError),
        ("seller_name", "=?utf-8?q?Eve=0D=0ABcc:_x@evil.example?=", HeaderInjectionError),
        ("seller_name", 42, PublishError),
    ],
)
def test_hostile_address_fields_are_refused_at_publish_naming_the_field(
    engine, field, value, error
):
    with pytest.raises(error) as raised:
        _invoice(engine, "I-9", **{field: value})
    assert raised.value.field == f"payload.{field}"


def test_a_missing_payload_address_is_refused_at_publish(engine):
    with engine.begin() as connection:
        from email_platform import publish

        with pytest.raises(PublishError) as raised:
            publish(
                connection,
                event_type="invoice.issued",
                aggregate_id="I-8",
                payload={"email": "a@example.com", "order_id": "I-8", "accountant": "b@e.org"},
                routes=routes(),
            )
    assert raised.value.field == "payload.seller_email"


def envelope_routes() -> RouteTable:
    table = demo_routes()
    table.routes[2] = replace(table.routes[2], envelope_sender="bounces@example.com")
    return table


def test_an_adapter_that_cannot_carry_a_field_refuses_at_start_up(engine, database_url):
    event_id = publish_one(
        engine,
        event_type="order.paid",
        aggregate_id="O-2",
        payload={"email": "ada@example.com", "order_id": "O-2"},
        routes=envelope_routes(),
    )
    result = run_send(
        database_url,
        "http://127.0.0.1:9",
        "transactional",
        [event_id],
        routing=RoutingResource(
            routes_factory="tests.integration.test_addressing_send_path:envelope_routes"
        ),
        provider=EmailProviderResource(
            provider="postmark", base_url="http://127.0.0.1:9", api_key="k"
        ),
    )
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    text = str(failure.event_specific_data.error)
    assert ConfigurationError.__name__ in text
    assert "route receipt sets envelope_sender" in text and "postmark" in text
    # Refused before claiming: the event still waits, untouched.
    assert event(engine, event_id).status == outbox.PENDING
    assert messages_of(engine, event_id) == []


def test_the_demo_receipt_through_the_send_job_over_mailgun(engine, database_url):
    """Mailgun's request turns multipart once it carries a file, on the event-loop path too."""
    stub = MailgunStub("key-test", "mg.example.com")
    event_id = _invoice(engine, "I-5", files=1)
    with BackgroundServer(stub.app) as url:
        result = run_send(
            database_url,
            "unused",
            "transactional",
            [event_id],
            routing=_routing(),
            provider=EmailProviderResource(
                provider="mailgun",
                base_url=url,
                api_key="key-test",
                options_json='{"domain": "mg.example.com"}',
            ),
        )
    assert result.success
    (accepted,) = stub.accepted
    form = accepted["form"]
    assert form["from"] == '"Zoë, Sales" <sales@shop.example.com>'
    assert (form["cc"], form["bcc"]) == ("books@example.org", "archive@example.com")
    assert form["h:Reply-To"] == "sales@shop.example.com"
    assert form["v:event_id"] == event_id
    (attachment,) = form["attachment"]
    assert attachment == {
        "filename": "_invoice-0__.txt",
        "content_type": "text/plain",
        "content": b"line 0\n",
    }
    (message,) = messages_of(engine, event_id)
    assert message.status == "sent"


def test_files_are_made_after_the_send_path_commits_so_they_may_touch_the_database(
    engine, database_url, sandbox, monkeypatch
):
    monkeypatch.setitem(AUDIT, "url", database_url)
    event_id = _invoice(engine, "I-6")
    result = run_send(
        database_url, sandbox.base_url, "transactional", [event_id], routing=_routing()
    )
    assert result.success
    (seen,) = sandbox_messages(sandbox.base_url, event_id)
    assert [a["filename"] for a in seen["attachments"]] == ["_invoice-0__.txt"]
    with engine.connect() as connection:
        assert connection.execute(select(users.c.id).where(users.c.id == "audit-I-6")).all()


def _postmark_seen(stub: Any) -> dict[str, Any]:
    (body,) = stub.accepted
    return {
        "reply_to": body["ReplyTo"],
        "cc": body["Cc"],
        "bcc": body["Bcc"],
        "files": [(a["Name"], a["ContentType"], a["Content"]) for a in body["Attachments"]],
    }


def _sendgrid_seen(stub: Any) -> dict[str, Any]:
    body = stub.accepted[0]["body"]
    (personalization,) = body["personalizations"]
    return {
        "reply_to": body["reply_to"]["email"],
        "cc": personalization["cc"][0]["email"],
        "bcc": personalization["bcc"][0]["email"],
        "files": [(a["filename"], a["type"], a["content"]) for a in body["attachments"]],
    }


def _resend_seen(stub: Any) -> dict[str, Any]:
    (body,) = stub.accepted
    return {
        "reply_to": body["reply_to"][0],
        "cc": body["cc"][0],
        "bcc": body["bcc"][0],
        "files": [(a["filename"], a["content_type"], a["content"]) for a in body["attachments"]],
    }


STUBS = {
    "postmark": (lambda: PostmarkStub(server_token="pm-token"), "pm-token", _postmark_seen),
    "sendgrid": (lambda: SendGridStub(api_key="SG.key"), "SG.key", _sendgrid_seen),
    "resend": (lambda: ResendStub(api_key="re_key"), "re_key", _resend_seen),
}


@pytest.mark.parametrize("provider", sorted(STUBS))
def test_the_json_providers_get_reply_to_cc_bcc_and_files_through_the_send_job(
    engine, database_url, provider
):
    make, key, seen = STUBS[provider]
    stub = make()
    event_id = _invoice(engine, "I-7", files=1)
    with BackgroundServer(stub.app) as url:
        result = run_send(
            database_url,
            "unused",
            "transactional",
            [event_id],
            routing=_routing(),
            provider=EmailProviderResource(provider=provider, base_url=url, api_key=key),
        )
    assert result.success
    assert seen(stub) == {
        "reply_to": "sales@shop.example.com",
        "cc": "books@example.org",
        "bcc": "archive@example.com",
        "files": [("_invoice-0__.txt", "text/plain", base64.b64encode(b"line 0\n").decode())],
    }
    (message,) = messages_of(engine, event_id)
    assert message.status == "sent"


def test_a_message_dead_for_its_files_is_sent_once_when_replayed_after_the_fix(
    engine, database_url, sandbox
):
    DOWN.add("I-8")
    try:
        event_id = _invoice(engine, "I-8")
        first = run_send(
            database_url, sandbox.base_url, "transactional", [event_id], routing=_routing()
        )
        assert not first.success
        (letter,) = dead_letters_of(engine, event_id)
        assert letter.error_code == "attachment_failed"
    finally:
        DOWN.discard("I-8")  # the invoice service is back
    requeue_dead_letters(engine, [letter])
    again = run_send(
        database_url, sandbox.base_url, "transactional", [event_id], routing=_routing()
    )
    assert again.success
    assert dead_letters_of(engine, event_id)[0].status == "replayed"
    (message,) = messages_of(engine, event_id)
    assert message.status == "sent"
    (seen,) = sandbox_messages(sandbox.base_url, event_id)
    assert [a["filename"] for a in seen["attachments"]] == ["_invoice-0__.txt"]
