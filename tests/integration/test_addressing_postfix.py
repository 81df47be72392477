"""From, Reply-To, Cc, Bcc, the envelope sender and attachments over SMTP, read back from a
real Postfix's Maildir (tests/servers/postfix.py): Cc in the headers and delivered, Bcc
delivered with no header naming it, ``MAIL FROM`` (Postfix's ``Return-Path``) the route's
bounce address, the files as ``multipart/mixed`` parts that decode to their bytes; and the demo
receipt through the send job on both databases, its PDF intact.
"""

import json
from collections.abc import Iterator
from typing import Any

import pytest

from email_platform.mail.addressing import Attachment
from email_platform.mail.receipt_pdf import pdf_bytes
from email_platform.mail.routes import demo_routes
from email_platform.resources import EmailProviderResource
from tests.integration.test_smtp_postfix import address, outgoing, raw_headers, smtp
from tests.servers.postfix import Postfix, start_postfix
from tests.support import messages_of, publish_one, run_send


@pytest.fixture(scope="module")
def postfix() -> Iterator[Postfix]:
    server = start_postfix()
    try:
        yield server
    finally:
        server.stop()


def test_cc_bcc_reply_to_envelope_sender_and_files_arrive_as_routed(postfix: Postfix) -> None:
    to, cc, bcc = address("jane"), address("books", "example.org"), address("archive")
    pdf = pdf_bytes(["Receipt for order O-7"])
    binary = bytes(range(256)) * 4
    email = outgoing(
        sender='"Zoë, Billing" <billing@example.com>',
        to=to,
        reply_to=("Shop support <support@example.com>", "help@example.com"),
        cc=(f"Books <{cc}>",),
        bcc=(bcc,),
        envelope_sender="bounces@example.com",
        attachments=(
            Attachment("receipt-O-7.pdf", "application/pdf", pdf),
            Attachment("Grüße.bin", "application/octet-stream", binary),
        ),
    )
    provider = smtp(postfix)
    try:
        provider.send(email)
    finally:
        provider.close()
    ((raw, message),) = postfix.wait_delivered(to)
    assert message["Return-Path"] == "<bounces@example.com>"
    assert message["From"].addresses[0].display_name == "Zoë, Billing"
    assert message["From"].addresses[0].addr_spec == "billing@example.com"
    assert [a.addr_spec for a in message["Reply-To"].addresses] == [
        "support@example.com",
        "help@example.com",
    ]
    assert message["Reply-To"].addresses[0].display_name == "Shop support"
    assert [a.addr_spec for a in message["Cc"].addresses] == [cc]
    assert "bcc" not in raw_headers(raw) and bcc.encode() not in raw
    assert message.get_content_type() == "multipart/mixed"
    body = message.get_body(preferencelist=("plain",))
    assert body is not None and body.get_content() == email.text
    files = {part.get_filename(): part for part in message.iter_attachments()}
    assert set(files) == {"receipt-O-7.pdf", "Grüße.bin"}
    assert files["receipt-O-7.pdf"].get_content_type() == "application/pdf"
    assert files["receipt-O-7.pdf"].get_content() == pdf
    assert files["Grüße.bin"].get_content() == binary
    # Cc and Bcc each get the same message (one transaction, three RCPTs).
    ((_, cc_copy),) = postfix.wait_delivered(cc)
    ((bcc_raw, bcc_copy),) = postfix.wait_delivered(bcc)
    assert cc_copy["Message-ID"] == bcc_copy["Message-ID"] == message["Message-ID"]
    assert "bcc" not in raw_headers(bcc_raw)


def test_without_an_envelope_sender_mail_from_is_the_from_address(postfix: Postfix) -> None:
    email = outgoing(sender="Billing <billing@example.com>", to=address("jane"))
    provider = smtp(postfix)
    try:
        provider.send(email)
    finally:
        provider.close()
    ((raw, message),) = postfix.wait_delivered(email.to)
    assert message["Return-Path"] == "<billing@example.com>"
    assert message.get_content_type() == "multipart/alternative"  # no files: as before
    assert "reply-to" not in raw_headers(raw) and "cc" not in raw_headers(raw)


def test_the_demo_receipt_through_the_send_job_over_smtp(
    engine: Any, database_url: str, postfix: Postfix
) -> None:
    to = address("ada")
    event_id = publish_one(
        engine,
        event_type="order.paid",
        aggregate_id="O-3",
        payload={
            "email": to,
            "order_id": "O-3",
            "first_name": "Ada",
            "items": [{"name": "Mug", "quantity": 2, "unit_price": 9.5}],
            "total": 19.0,
            "currency": "EUR",
        },
        routes=demo_routes(),
    )
    resource = EmailProviderResource(
        provider="smtp",
        base_url=f"smtp://127.0.0.1:{postfix.port('plain')}",
        timeout_s=10.0,
        options_json=json.dumps({"starttls": "false"}),
    )
    result = run_send(database_url, "unused", "transactional", [event_id], provider=resource)
    assert result.success
    ((_, message),) = postfix.wait_delivered(to)
    assert str(message["From"]) == "Shop billing <billing@example.com>"
    assert str(message["Reply-To"]) == "Shop support <support@example.com>"
    (pdf,) = message.iter_attachments()
    assert pdf.get_filename() == "receipt-O-3.pdf"
    content = pdf.get_content()
    assert content.startswith(b"%PDF-1.4") and b"(Receipt for order O-3)" in content
    (row,) = messages_of(engine, event_id)
    assert row.status == "sent"
