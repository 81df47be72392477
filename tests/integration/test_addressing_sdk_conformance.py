"""Reply-To, Cc, Bcc and attachments in each HTTP adapter's request against the one the
provider's official Python SDK builds for the same message (``postmark-python``, ``sendgrid``,
``mailgun``, ``resend``), each SDK used as its documentation shows; the comparison of
``test_provider_sdk_conformance.py``, member by member, with no difference left unexplained.
Mailgun's request is ``multipart/form-data`` once it carries a file: both are parsed into their
fields and files, the boundary (random) aside.
"""

import base64
import email.parser
import email.policy
from typing import Any
from unittest import mock

import httpx
import pytest
import resend
from mailgun.client import Client as MailgunClient
from sendgrid.helpers.mail import (
    Attachment as SgAttachment,
)
from sendgrid.helpers.mail import (
    Bcc,
    Cc,
    Disposition,
    FileContent,
    FileName,
    FileType,
    From,
    Mail,
    ReplyTo,
    To,
)

from email_platform.common.tags import tag_value
from email_platform.mail.addressing import Attachment
from email_platform.mail.receipt_pdf import pdf_bytes
from email_platform.providers.base import OutgoingEmail, trace_metadata
from email_platform.providers.mailgun import MailgunProvider
from email_platform.providers.postmark import PostmarkProvider
from email_platform.providers.resend import ResendProvider
from email_platform.providers.sendgrid import SendGridProvider
from tests.integration.test_provider_sdk_conformance import (
    DOMAIN,
    EVENT_ID,
    KEY,
    NAMES,
    Wire,
    differences,
    metadata,
    ours,
    postmark_sdk,
    sendgrid_sdk_wire,
    wire,
)
from tests.integration.test_provider_sdk_conformance import (
    requests_sent as requests_sent,
)

PDF = pdf_bytes(["Receipt for order O-1"])

MESSAGES = {
    "receipt with reply-to and a pdf": OutgoingEmail(
        message_id=1,
        event_id=EVENT_ID,
        idempotency_key=f"{EVENT_ID}:receipt",
        sender=f"Shop billing <billing@{DOMAIN}>",
        to="jane@example.com",
        subject="Your receipt for O-1",
        text="Thanks",
        html="<p>Thanks</p>",
        template="receipt",
        lane="transactional",
        headers={"X-Email-Event-Id": EVENT_ID},
        reply_to=(f"Shop support <support@{DOMAIN}>",),
        attachments=(Attachment("receipt-O-1.pdf", "application/pdf", PDF),),
    ),
    "cc, bcc and two files": OutgoingEmail(
        message_id=2,
        event_id=EVENT_ID,
        idempotency_key=f"{EVENT_ID}:invoice",
        sender=f"billing@{DOMAIN}",
        to="jane@example.com",
        subject="Invoice",
        text="Attached",
        html=None,
        template="invoice",
        lane="transactional",
        headers={"X-Email-Event-Id": EVENT_ID},
        reply_to=(f"support@{DOMAIN}",),
        cc=("Books <books@example.org>",),
        bcc=("archive@example.com",),
        attachments=(
            Attachment("invoice.pdf", "application/pdf", PDF),
            Attachment("lines.csv", "text/csv", b"sku,qty\nmug,2\n"),
        ),
    ),
}


def _pair(value: str) -> tuple[str, str]:
    name, _, address = value.rpartition(" <")
    return (address.rstrip(">"), name) if name else (value, "")


def _files(email: OutgoingEmail) -> list[dict[str, str]]:
    return [
        {"name": a.filename, "type": a.content_type, "b64": base64.b64encode(a.content).decode()}
        for a in email.attachments
    ]


# ---- the SDKs ----------------------------------------------------------------------------------


def _postmark(email: OutgoingEmail, names: tuple, extra: dict[str, Any]) -> Wire:
    import postmark.sync

    real = postmark.sync.ServerClient

    class Client(real):  # type: ignore[misc, valid-type]
        def __enter__(self):  # type: ignore[no-untyped-def]
            client = super().__enter__()
            send = client.outbound.send
            client.outbound.send = lambda message: send({**message, **extra})
            return client

    with mock.patch.object(postmark.sync, "ServerClient", Client):
        return postmark_sdk(email, names)


def sendgrid_with_addressing(email: OutgoingEmail, names: tuple) -> Wire:
    mail = Mail(
        from_email=From(*_pair(email.sender)),
        to_emails=To(email.to),
        subject=email.subject,
        plain_text_content=email.text,
        html_content=email.html,
    )
    for value in email.cc:
        mail.add_cc(Cc(*_pair(value)))
    for value in email.bcc:
        mail.add_bcc(Bcc(*_pair(value)))
    (reply_to,) = email.reply_to
    mail.reply_to = ReplyTo(*_pair(reply_to))
    # The SDK's setter puts each new attachment first: added last to first, they go in order.
    for f in reversed(_files(email)):
        mail.attachment = SgAttachment(
            FileContent(f["b64"]),
            FileName(f["name"]),
            FileType(f["type"]),
            Disposition("attachment"),
        )
    return sendgrid_sdk_wire(mail, email, names)


def _multipart(content_type: str, body: bytes) -> dict[str, list[Any]]:
    """A ``multipart/form-data`` body as ``{field: [value or (filename, type, bytes)]}``."""
    parsed = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        f"Content-Type: {content_type}\r\n\r\n".encode() + body
    )
    fields: dict[str, list[Any]] = {}
    for part in parsed.iter_parts():
        name = part.get_param("name", header="content-disposition")
        filename = part.get_filename()
        payload = part.get_payload(decode=True)
        value = (filename, part.get_content_type(), payload) if filename else payload.decode()
        fields.setdefault(name, []).append(value)
    return fields


def _mailgun_wire(method: str, url: str, headers: Any, body: bytes) -> Wire:
    content_type = str(dict(headers).get("Content-Type") or dict(headers).get("content-type"))
    assert content_type.startswith("multipart/form-data; boundary=")
    auth = str(dict(headers).get("Authorization") or dict(headers).get("authorization"))
    return Wire(
        method.upper(),
        httpx.URL(url).path,
        {"content-type": "multipart/form-data", "authorization": auth},
        _multipart(content_type, body),
    )


def mailgun_with_addressing(email: OutgoingEmail, sent: list) -> Wire:
    data: dict[str, Any] = {
        "from": email.sender,
        "to": email.to,
        "subject": email.subject,
        "text": email.text,
    }
    if email.html is not None:
        data["html"] = email.html
    if email.cc:
        data["cc"] = ", ".join(email.cc)
    if email.bcc:
        data["bcc"] = ", ".join(email.bcc)
    data["h:Reply-To"] = ", ".join(email.reply_to)
    data["o:tag"] = email.template
    data.update({f"h:{k}": v for k, v in email.headers.items()})
    data.update({f"v:{k}": v for k, v in metadata(email).items()})
    files = [("attachment", (a.filename, a.content, a.content_type)) for a in email.attachments]
    MailgunClient(auth=("api", KEY)).messages.create(data=data, files=files, domain=DOMAIN)
    (request,) = sent
    return _mailgun_wire(request.method, request.url, request.headers, request.body)


def resend_with_addressing(email: OutgoingEmail, names: tuple, sent: list) -> Wire:
    params: dict[str, Any] = {
        "from": email.sender,
        "to": [email.to],
        "subject": email.subject,
        "text": email.text,
        "reply_to": list(email.reply_to),
        "headers": dict(email.headers),
        "attachments": [
            {"filename": f["name"], "content": f["b64"], "content_type": f["type"]}
            for f in _files(email)
        ],
        "tags": [
            {"name": k, "value": tag_value(v)}
            for k, v in {
                "event_id": email.event_id,
                "idempotency_key": email.idempotency_key,
                "template": email.template,
                "lane": email.lane,
                **trace_metadata(email),
            }.items()
        ],
    }
    if email.cc:
        params["cc"] = list(email.cc)
    if email.bcc:
        params["bcc"] = list(email.bcc)
    if email.html is not None:
        params["html"] = email.html
    with mock.patch.object(resend, "api_key", KEY):
        resend.Emails.send(params, {"idempotency_key": email.idempotency_key})  # type: ignore[arg-type,typeddict-item]
    (request,) = sent
    return wire(request.method, request.url, request.headers, request.body, names)


# ---- the tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("email", MESSAGES.values(), ids=MESSAGES.keys())
def test_postmark_carries_what_postmark_python_carries(email):
    names = NAMES["postmark"]
    our = ours(lambda t: PostmarkProvider(server_token=KEY, transport=t), email, names)
    assert our.body["ReplyTo"] == ", ".join(email.reply_to)
    assert [a["Name"] for a in our.body["Attachments"]] == [a.filename for a in email.attachments]
    assert differences(our, _postmark(email, names, _postmark_extra(email))) == {}


def _postmark_extra(email: OutgoingEmail) -> dict[str, Any]:
    extra: dict[str, Any] = {"reply_to": ", ".join(email.reply_to)}
    if email.cc:
        extra["cc"] = ", ".join(email.cc)
    if email.bcc:
        extra["bcc"] = ", ".join(email.bcc)
    extra["attachments"] = [
        {"Name": f["name"], "Content": f["b64"], "ContentType": f["type"]} for f in _files(email)
    ]
    return extra


@pytest.mark.parametrize("email", MESSAGES.values(), ids=MESSAGES.keys())
def test_sendgrid_carries_what_the_sendgrid_sdk_carries(email):
    names = NAMES["sendgrid"]
    our = ours(lambda t: SendGridProvider(api_key=KEY, transport=t), email, names)
    assert our.body["attachments"][0]["content"] == base64.b64encode(PDF).decode()
    assert differences(our, sendgrid_with_addressing(email, names)) == {}


@pytest.mark.parametrize("email", MESSAGES.values(), ids=MESSAGES.keys())
def test_mailgun_carries_what_the_mailgun_sdk_carries(email, requests_sent):
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"id": "<x@mg.example.com>", "message": "Queued"})

    adapter = MailgunProvider(api_key=KEY, domain=DOMAIN, transport=httpx.MockTransport(answer))
    try:
        adapter.send(email)
    finally:
        adapter.close()
    (request,) = seen
    our = _mailgun_wire(request.method, str(request.url), request.headers, request.read())
    assert our.body["attachment"][0][2] == PDF
    assert differences(our, mailgun_with_addressing(email, requests_sent)) == {}


@pytest.mark.parametrize("email", MESSAGES.values(), ids=MESSAGES.keys())
def test_resend_carries_what_the_resend_sdk_carries(email, requests_sent):
    names = NAMES["resend"]
    our = ours(lambda t: ResendProvider(api_key=KEY, transport=t), email, names)
    assert our.body["reply_to"] == list(email.reply_to)
    assert differences(our, resend_with_addressing(email, names, requests_sent)) == {}
