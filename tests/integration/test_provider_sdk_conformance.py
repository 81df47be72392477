"""Each HTTP adapter's request against the one the provider's official Python SDK builds for the
same message: ``postmark-python``, ``sendgrid``, ``mailgun`` and ``resend``, captured at each
SDK's own transport (``httpx.AsyncClient.send``, ``python_http_client``'s ``_make_request``,
``requests.Session.send``), so nothing reaches the network.

Compared, normalized: the method, the URL path, the headers that carry meaning (authentication,
content type, idempotency) and the body, parsed (JSON, or form fields as lists of values), member
by member. Every difference left is in ``ALLOWED``, with its reason; an allowed difference that
no longer occurs fails the test too, so the list stays true.

The message has what our adapters carry: from (with a display name), to, subject, text, html,
custom headers (``List-Unsubscribe``, ``List-Unsubscribe-Post``, ``X-Email-Event-Id``), the
template as tag or category, metadata (``event_id``, ``idempotency_key``, ``trace_id``,
``correlation_id``) and the idempotency key where the provider takes one (Resend). Reply-To is
not compared: ``OutgoingEmail`` carries none, so no adapter sends one.
"""

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock
from urllib.parse import parse_qs, urlsplit

import httpx
import postmark.sync
import pytest
import python_http_client.client
import requests
import resend
from mailgun.client import Client as MailgunClient
from sendgrid import SendGridAPIClient
from sendgrid.helpers.mail import Category, CustomArg, From, Header, Mail, To

from email_platform.common.tags import tag_value
from email_platform.providers.base import OutgoingEmail, trace_metadata
from email_platform.providers.http import HttpProvider
from email_platform.providers.mailgun import MailgunProvider
from email_platform.providers.postmark import PostmarkProvider
from email_platform.providers.resend import ResendProvider
from email_platform.providers.sendgrid import SendGridProvider

EVENT_ID = "01JDQ5Z3K8M9N0P1Q2R3S4T5V6"
KEY = "test-key-0123456789"
DOMAIN = "mg.example.com"
UNSUBSCRIBE = (
    "<https://mail.example.com/unsubscribe/01JDQ5Z3K8M9N0P1Q2R3S4T5V6?"
    "token=Zm9vYmFyYmF6cXV4Zm9vYmFyYmF6cXV4Zm9vYmFyYmF6cXV4Zm9vYmFyYmF6cXV4Zm9vYmFy>, "
    "<mailto:unsubscribe@example.com?subject=unsubscribe>"
)

MESSAGES = {
    "bulk with unsubscribe": OutgoingEmail(
        message_id=7,
        event_id=EVENT_ID,
        idempotency_key=f"{EVENT_ID}:newsletter",
        sender=f"Example Shop <no-reply@{DOMAIN}>",
        to="jane@example.com",
        subject="Your December picks",
        text="Hello Jane",
        html="<p>Hello Jane</p>",
        template="newsletter",
        lane="bulk",
        headers={
            "X-Email-Event-Id": EVENT_ID,
            "List-Unsubscribe": UNSUBSCRIBE,
            "List-Unsubscribe-Post": "List-Unsubscribe=One-Click",
        },
        trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
        correlation_id="req-42",
    ),
    "text only, unicode": OutgoingEmail(
        message_id=8,
        event_id=EVENT_ID,
        idempotency_key=f"{EVENT_ID}:welcome",
        sender=f"no-reply@{DOMAIN}",
        to="jane@example.com",
        subject="Willkommen, Jane \U0001f389 Grüße",
        text="Grüße aus Köln",
        html=None,
        template="welcome",
        lane="transactional",
        headers={"X-Email-Event-Id": EVENT_ID},
    ),
    "IDN recipient, non-ASCII display name": OutgoingEmail(
        message_id=9,
        event_id=EVENT_ID,
        idempotency_key=f"{EVENT_ID}:receipt",
        sender=f"Bücher Shöp <no-reply@{DOMAIN}>",
        to="jane@bücher.example.com",
        subject="Ihre Quittung",
        text="Danke",
        html="<p>Danke</p>",
        template="receipt",
        lane="critical",
        headers={"X-Email-Event-Id": EVENT_ID},
        correlation_id="c" * 81,  # over Postmark's 80-character metadata value: left out there
    ),
    "a long idempotency key": OutgoingEmail(
        message_id=10,
        event_id=EVENT_ID,
        idempotency_key="order-" + "7" * 120,
        sender=f"no-reply@{DOMAIN}",
        to="jane@example.com",
        subject="Order confirmed",
        text="Thanks",
        html=None,
        template="order_confirmation",
        lane="transactional",
        headers={"X-Email-Event-Id": EVENT_ID},
    ),
}


@dataclass(frozen=True)
class Wire:
    """One request, normalized: what the provider reads from it."""

    method: str
    path: str
    headers: dict[str, str]  # the significant ones, lower-case names
    body: Any  # parsed JSON, or {form field: [values]}


def _significant(headers: Any, names: tuple[str, ...]) -> dict[str, str]:
    lowered = {str(k).lower(): str(v) for k, v in dict(headers).items()}
    return {name: lowered[name] for name in names if name in lowered}


def _body(content_type: str, raw: bytes | str | None) -> Any:
    raw = raw.encode() if isinstance(raw, str) else (raw or b"")
    if content_type.startswith("application/x-www-form-urlencoded"):
        return parse_qs(raw.decode("ascii"), keep_blank_values=True, strict_parsing=True)
    return json.loads(raw)


def wire(method: str, url: str, headers: Any, raw: bytes | str | None, names: tuple) -> Wire:
    significant = _significant(headers, names)
    return Wire(
        method.upper(),
        urlsplit(url).path,
        significant,
        _body(significant.get("content-type", ""), raw),
    )


def ours(provider: Callable[[httpx.MockTransport], HttpProvider], email: OutgoingEmail, names):
    """What our adapter sends for ``email``."""
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(
            200, json={"id": "x", "MessageID": "x", "ErrorCode": 0}, headers={"X-Message-Id": "x"}
        )

    adapter = provider(httpx.MockTransport(answer))
    try:
        adapter.send(email)
    finally:
        adapter.close()
    (request,) = seen
    return wire(request.method, str(request.url), request.headers, request.content, names)


@pytest.fixture
def requests_sent() -> Iterator[list[requests.PreparedRequest]]:
    """Every request ``requests`` would put on the wire (Mailgun's and Resend's SDKs)."""
    sent: list[requests.PreparedRequest] = []

    def send(self: requests.Session, request: requests.PreparedRequest, **_: Any):  # type: ignore[no-untyped-def]
        sent.append(request)
        response = requests.Response()
        response.status_code = 200
        response._content = b'{"id": "<x@mg.example.com>", "message": "Queued"}'
        response.headers["Content-Type"] = "application/json"
        response.request, response.url = request, request.url
        return response

    with mock.patch.object(requests.Session, "send", autospec=True, side_effect=send):
        yield sent


# ---- the SDKs, each used the way its documentation shows ---------------------------------------


def metadata(email: OutgoingEmail) -> dict[str, str]:
    return {
        "event_id": email.event_id,
        "idempotency_key": email.idempotency_key,
        **trace_metadata(email),
    }


def postmark_sdk(email: OutgoingEmail, names: tuple) -> Wire:
    sent: list[httpx.Request] = []

    async def send(self: httpx.AsyncClient, request: httpx.Request, **_: Any) -> httpx.Response:
        sent.append(request)
        return httpx.Response(
            200,
            json={
                "To": email.to,
                "SubmittedAt": "2026-12-05T03:00:00Z",
                "MessageID": "b7bc2f4a-e38e-4336-af7d-e6c392c2f817",
                "ErrorCode": 0,
                "Message": "OK",
            },
            request=request,
        )

    message: dict[str, Any] = {
        "sender": email.sender,
        "to": email.to,
        "subject": email.subject,
        "text_body": email.text,
        "headers": [{"Name": k, "Value": v} for k, v in email.headers.items()],
        "tag": email.template,
        "metadata": metadata(email),
        "message_stream": "outbound",
    }
    if email.html is not None:
        message["html_body"] = email.html
    with (
        mock.patch.object(httpx.AsyncClient, "send", autospec=True, side_effect=send),
        postmark.sync.ServerClient(KEY) as client,
    ):
        client.outbound.send(message)
    (request,) = sent
    return wire(request.method, str(request.url), request.headers, request.content, names)


def sendgrid_sdk_wire(mail: Mail, email: OutgoingEmail, names: tuple) -> Wire:
    """What the SendGrid SDK sends for ``mail`` once it carries ``email``'s headers, metadata
    and category, as our adapter adds them (captured at ``python_http_client``'s transport)."""
    sent: list[Any] = []

    class Answer:
        def getcode(self) -> int:
            return 202

        def read(self) -> bytes:
            return b""

        def info(self) -> dict[str, str]:
            return {"X-Message-Id": "x"}

    def make_request(self: Any, opener: Any, request: Any, timeout: Any = None) -> Answer:
        sent.append(request)
        return Answer()

    for key, value in email.headers.items():
        mail.header = Header(key, value)
    for key, value in metadata(email).items():
        mail.custom_arg = CustomArg(key, value)
    mail.category = Category(email.template)
    with mock.patch.object(
        python_http_client.client.Client, "_make_request", autospec=True, side_effect=make_request
    ):
        SendGridAPIClient(KEY).send(mail)
    (request,) = sent
    return wire(request.get_method(), request.full_url, request.header_items(), request.data, names)


def sendgrid_sdk(email: OutgoingEmail, names: tuple) -> Wire:
    name, _, address = email.sender.rpartition(" <")
    mail = Mail(
        from_email=From(address.rstrip(">"), name) if name else From(email.sender),
        to_emails=To(email.to),
        subject=email.subject,
        plain_text_content=email.text,
        html_content=email.html,
    )
    return sendgrid_sdk_wire(mail, email, names)


def mailgun_sdk(email: OutgoingEmail, names: tuple, sent: list) -> Wire:
    data = {"from": email.sender, "to": email.to, "subject": email.subject, "text": email.text}
    if email.html is not None:
        data["html"] = email.html
    data["o:tag"] = email.template
    data.update({f"h:{k}": v for k, v in email.headers.items()})
    data.update({f"v:{k}": v for k, v in metadata(email).items()})
    MailgunClient(auth=("api", KEY)).messages.create(data=data, domain=DOMAIN)
    (request,) = sent
    return wire(request.method, request.url, request.headers, request.body, names)


def resend_params(email: OutgoingEmail) -> dict[str, Any]:
    """What the Resend SDK is given for ``email``: its documented ``Emails.send`` params."""
    params: dict[str, Any] = {
        "from": email.sender,
        "to": [email.to],
        "subject": email.subject,
        "text": email.text,
        "headers": dict(email.headers),
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
    if email.html is not None:
        params["html"] = email.html
    return params


def resend_sdk(email: OutgoingEmail, names: tuple, sent: list) -> Wire:
    params = resend_params(email)
    with mock.patch.object(resend, "api_key", KEY):
        resend.Emails.send(params, {"idempotency_key": email.idempotency_key})  # type: ignore[arg-type,typeddict-item]
    (request,) = sent
    return wire(request.method, request.url, request.headers, request.body, names)


# ---- the comparison ----------------------------------------------------------------------------


def _flat(value: Any, where: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flat(item, f"{where}.{key}" if where else str(key)))
        return out or {where: {}}
    if isinstance(value, list):
        out = {}
        for index, item in enumerate(value):
            out.update(_flat(item, f"{where}[{index}]"))
        return out or {where: []}
    return {where: value}


def differences(our: Wire, sdk: Wire) -> dict[str, tuple[Any, Any]]:
    """Where the two requests differ: ``{place: (ours, the SDK's)}``."""
    mine = {"method": our.method, "path": our.path}
    theirs = {"method": sdk.method, "path": sdk.path}
    mine.update({f"header {k}": v for k, v in our.headers.items()})
    theirs.update({f"header {k}": v for k, v in sdk.headers.items()})
    mine.update({f"body {k}": v for k, v in _flat(our.body).items()})
    theirs.update({f"body {k}": v for k, v in _flat(sdk.body).items()})
    return {
        place: (mine.get(place), theirs.get(place))
        for place in sorted(mine.keys() | theirs.keys())
        if mine.get(place) != theirs.get(place)
    }


#: Each difference that stays, by provider: (the place, why it is right, for which messages).
ALLOWED: dict[str, list[tuple[str, str, Callable[[OutgoingEmail], bool]]]] = {
    "postmark": [
        (
            "body Attachments",
            "the SDK's model always writes an empty Attachments list; Postmark reads a missing "
            "one as none, and we send no attachments",
            lambda email: True,
        ),
        (
            "body Metadata.idempotency_key",
            "the same 80-character cap, for a key over it (publish() accepts 200)",
            lambda email: len(email.idempotency_key) > 80,
        ),
        (
            "body Metadata.correlation_id",
            "Postmark caps a metadata value at 80 characters, and the SDK does not check it: we "
            "leave a longer correlation id out rather than have the message refused",
            lambda email: len(email.correlation_id or "") > 80,
        ),
    ],
    "sendgrid": [],
    "mailgun": [],
    "resend": [],
}

NAMES = {
    "postmark": ("content-type", "x-postmark-server-token", "accept"),
    "sendgrid": ("content-type", "authorization"),
    "mailgun": ("content-type", "authorization"),
    "resend": ("content-type", "authorization", "idempotency-key"),
}


def assert_conformant(provider: str, email: OutgoingEmail, our: Wire, sdk: Wire) -> None:
    found = differences(our, sdk)
    allowed = {place for place, _, applies in ALLOWED[provider] if applies(email)}
    unexplained = {place: seen for place, seen in found.items() if place not in allowed}
    assert unexplained == {}, f"{provider}: (ours, the SDK's) differ where nothing explains it"
    stale = allowed - set(found)
    assert not stale, f"{provider}: allowed differences that no longer occur: {stale}"


@pytest.mark.parametrize("email", MESSAGES.values(), ids=MESSAGES.keys())
def test_postmark_sends_what_postmark_python_sends(email):
    names = NAMES["postmark"]
    our = ours(lambda t: PostmarkProvider(server_token=KEY, transport=t), email, names)
    sdk = postmark_sdk(email, names)
    assert our.headers["x-postmark-server-token"] == KEY
    assert_conformant("postmark", email, our, sdk)


@pytest.mark.parametrize("email", MESSAGES.values(), ids=MESSAGES.keys())
def test_sendgrid_sends_what_the_sendgrid_sdk_sends(email):
    names = NAMES["sendgrid"]
    our = ours(lambda t: SendGridProvider(api_key=KEY, transport=t), email, names)
    sdk = sendgrid_sdk(email, names)
    assert our.headers["authorization"] == f"Bearer {KEY}"
    assert_conformant("sendgrid", email, our, sdk)


@pytest.mark.parametrize("email", MESSAGES.values(), ids=MESSAGES.keys())
def test_mailgun_sends_what_the_mailgun_sdk_sends(email, requests_sent):
    names = NAMES["mailgun"]
    our = ours(lambda t: MailgunProvider(api_key=KEY, domain=DOMAIN, transport=t), email, names)
    sdk = mailgun_sdk(email, names, requests_sent)
    assert our.headers["authorization"].startswith("Basic ")
    assert_conformant("mailgun", email, our, sdk)


@pytest.mark.parametrize("email", MESSAGES.values(), ids=MESSAGES.keys())
def test_resend_sends_what_the_resend_sdk_sends(email, requests_sent):
    names = NAMES["resend"]
    our = ours(lambda t: ResendProvider(api_key=KEY, transport=t), email, names)
    sdk = resend_sdk(email, names, requests_sent)
    assert our.headers["idempotency-key"] == email.idempotency_key
    assert_conformant("resend", email, our, sdk)
