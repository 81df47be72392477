"""SES's Reply-To, Cc, Bcc and attachments against moto's SES server (IAM checks on) and AWS's
SES v2 model (``tests/ses_model.py``): without files the ``Simple`` content with ``Destination``
Cc/Bcc and ``ReplyToAddresses``; with files a raw MIME message whose parts decode to their
bytes, Bcc only in ``Destination``; and the demo receipt through the send job on both databases.
"""

import base64
import email as email_lib
import email.policy
import json
import urllib.request
from typing import Any

from email_platform.mail.addressing import Attachment
from email_platform.mail.receipt_pdf import pdf_bytes
from email_platform.mail.routes import demo_routes
from email_platform.resources import EmailProviderResource
from tests.integration.test_ses_moto import REGION, Moto, outgoing, send
from tests.integration.test_ses_moto import moto as moto
from tests.ses_model import send_email_problems
from tests.support import messages_of, publish_one, run_send


def raw_messages(moto: Moto) -> list[dict[str, Any]]:
    """What moto's SES backend holds as sent raw (its ``RawMessage`` model)."""
    with urllib.request.urlopen(f"{moto.url}/moto-api/data.json", timeout=10) as answer:
        return json.load(answer)["ses"].get("RawMessage", [])


def test_reply_to_cc_and_bcc_go_in_the_simple_request(moto: Moto) -> None:
    before = len(moto.messages())
    mail = outgoing(
        reply_to=("Support <support@example.com>",),
        cc=("Books <books@example.org>",),
        bcc=("archive@bücher.example.com",),
    )
    accepted, bodies = send(moto, mail, moto.sender)
    (body,) = bodies
    assert send_email_problems(body) == []
    assert body["Destination"] == {
        "ToAddresses": ["jane@example.net"],
        "CcAddresses": ["Books <books@example.org>"],
        "BccAddresses": ["archive@xn--bcher-kva.example.com"],
    }
    assert body["ReplyToAddresses"] == ["Support <support@example.com>"]
    assert "Simple" in body["Content"]
    (message,) = moto.messages()[before:]
    assert message["id"] == accepted.provider_message_id
    assert message["destinations"]["BccAddresses"] == ["archive@xn--bcher-kva.example.com"]


def test_attachments_go_as_raw_mime_that_decodes_to_their_bytes(moto: Moto) -> None:
    before = len(raw_messages(moto))
    pdf = pdf_bytes(["Receipt for order O-9"])
    mail = outgoing(
        sender="Shöp billing <billing@example.com>",
        subject="Ihre Quittung à O-9",
        reply_to=("Support <support@example.com>",),
        cc=("books@example.org",),
        bcc=("archive@example.com",),
        attachments=(Attachment("receipt-O-9.pdf", "application/pdf", pdf),),
    )
    accepted, bodies = send(moto, mail, moto.sender)
    (body,) = bodies
    assert send_email_problems(body) == []
    assert set(body["Content"]) == {"Raw"} and "ReplyToAddresses" not in body
    assert body["Destination"]["BccAddresses"] == ["archive@example.com"]
    raw = base64.b64decode(body["Content"]["Raw"]["Data"])
    assert raw.isascii()  # SES takes no SMTPUTF8: 7-bit MIME
    parsed = email_lib.message_from_bytes(raw, policy=email.policy.default)
    assert parsed["From"].addresses[0].display_name == "Shöp billing"
    assert str(parsed["Subject"]) == "Ihre Quittung à O-9"
    assert str(parsed["Reply-To"]) == "Support <support@example.com>"
    assert str(parsed["Cc"]) == "books@example.org"
    assert "Bcc" not in parsed
    assert parsed["X-Email-Event-Id"] == mail.event_id
    (part,) = parsed.iter_attachments()
    assert (part.get_filename(), part.get_content()) == ("receipt-O-9.pdf", pdf)
    (stored,) = raw_messages(moto)[before:]
    assert stored["id"] == accepted.provider_message_id
    assert "archive@example.com" in stored["destinations"]
    assert base64.b64decode(body["Content"]["Raw"]["Data"]).decode() == stored["raw_data"]


def test_the_demo_receipt_through_the_send_job_over_ses(
    engine: Any, database_url: str, moto: Moto
) -> None:
    before = len(raw_messages(moto))
    event_id = publish_one(
        engine,
        event_type="order.paid",
        aggregate_id="O-4",
        payload={
            "email": "ada@example.net",
            "order_id": "O-4",
            "first_name": "Ada",
            "items": [{"name": "Mug", "quantity": 1, "unit_price": 9.5}],
            "total": 9.5,
            "currency": "EUR",
        },
        routes=demo_routes(),
    )
    resource = EmailProviderResource(
        provider="ses",
        base_url=moto.url,
        timeout_s=10.0,
        options_json=json.dumps(
            {
                "region": REGION,
                "access_key_id": moto.sender.access_key,
                "secret_access_key": moto.sender.secret_key,
            }
        ),
    )
    result = run_send(database_url, "unused", "transactional", [event_id], provider=resource)
    assert result.success
    (row,) = messages_of(engine, event_id)
    assert row.status == "sent"
    (stored,) = raw_messages(moto)[before:]
    assert stored["id"] == row.provider_message_id
    parsed = email_lib.message_from_string(stored["raw_data"], policy=email.policy.default)
    assert str(parsed["From"]) == "Shop billing <billing@example.com>"
    (part,) = parsed.iter_attachments()
    assert part.get_filename() == "receipt-O-4.pdf"
    assert part.get_content().startswith(b"%PDF-1.4")
