"""Whatever a message holds, every HTTP adapter either sends it or refuses it with a permanent
error that names its cause: never an exception nobody classified (which the send path
dead-letters as ``unexpected``). Unicode subjects and bodies, internationalized domains,
non-ASCII local parts and display names, any idempotency key or trace id, long unsubscribe links.
"""

import string
from collections.abc import Callable

import httpx
from botocore.credentials import Credentials
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from email_platform.common.errors import PermanentError, PublishError
from email_platform.common.lanes import Lane
from email_platform.mail import addressing
from email_platform.mail.addressing import Attachment, Mailbox
from email_platform.mail.routes import Route
from email_platform.providers.base import OutgoingEmail
from email_platform.providers.http import HttpProvider
from email_platform.providers.mailgun import MailgunProvider
from email_platform.providers.postmark import PostmarkProvider
from email_platform.providers.resend import ResendProvider
from email_platform.providers.sandbox import SandboxProvider
from email_platform.providers.sendgrid import SendGridProvider
from email_platform.providers.ses import SesProvider
from email_platform.providers.smtp import SmtpProvider

ADAPTERS: dict[str, Callable[[httpx.MockTransport], HttpProvider]] = {
    "postmark": lambda t: PostmarkProvider(server_token="t", transport=t),
    "sendgrid": lambda t: SendGridProvider(api_key="k", transport=t),
    "mailgun": lambda t: MailgunProvider(api_key="k", domain="mg.example.com", transport=t),
    "resend": lambda t: ResendProvider(api_key="k", transport=t),
    "ses": lambda t: SesProvider(credentials=Credentials("AKID", "secret"), transport=t),
    "sandbox": lambda t: SandboxProvider("http://sandbox.invalid", transport=t),
}


def _accept(request: httpx.Request) -> httpx.Response:
    # One answer every adapter reads as accepted.
    return httpx.Response(
        200,
        json={"id": "x", "MessageID": "x", "MessageId": "x", "ErrorCode": 0},
        headers={"X-Message-Id": "x"},
    )


_VISIBLE = st.characters(blacklist_categories=("Cs", "Cc", "Zl", "Zp"))
_TEXT = st.text(_VISIBLE, min_size=1, max_size=60)
_LOCAL = st.text(string.ascii_lowercase + string.digits + "._+-", min_size=1, max_size=16).filter(
    lambda s: not s.startswith(".") and not s.endswith(".") and ".." not in s
) | st.sampled_from(["jäne", "josé", "用户"])
_DOMAIN = st.sampled_from(["example.com", "bücher.example.com", "例え.jp", "xn--bcher-kva.de"])
_NAME = st.sampled_from(["", "Example", "Bücher Shöp", "O'Brien & Co"])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    subject=_TEXT,
    text=_TEXT,
    html=st.none() | _TEXT,
    key=_TEXT,
    trace=st.none() | _TEXT,
    local=_LOCAL,
    domain=_DOMAIN,
    name=_NAME,
    unsubscribe=st.booleans(),
)
def test_every_adapter_sends_or_refuses_with_a_named_permanent_cause(
    subject, text, html, key, trace, local, domain, name, unsubscribe
):
    headers = {"X-Email-Event-Id": "01JDQ5Z3K8M9N0P1Q2R3S4T5V6"}
    if unsubscribe:
        headers["List-Unsubscribe"] = "<https://mail.example.com/u/" + "x" * 140 + ">"
        headers["List-Unsubscribe-Post"] = "List-Unsubscribe=One-Click"
    email = OutgoingEmail(
        message_id=1,
        event_id="01JDQ5Z3K8M9N0P1Q2R3S4T5V6",
        idempotency_key=key,
        sender=f"{name} <no-reply@{domain}>" if name else f"no-reply@{domain}",
        to=f"{local}@{domain}",
        subject=subject,
        text=text,
        html=html,
        template="welcome",
        lane="bulk",
        headers=headers,
        trace_id=trace,
    )
    for provider, make in ADAPTERS.items():
        adapter = make(httpx.MockTransport(_accept))
        try:
            adapter.send(email)
        except PermanentError as error:
            assert error.code and error.code != "unexpected", (provider, error)
        finally:
            adapter.close()


_FILENAME = st.text(st.characters(blacklist_categories=("Cs",)), max_size=200) | st.sampled_from(
    ["../../etc/passwd", "a\r\nContent-Type: text/html", "ré\u202esu\u202cmé.pdf", "", "."]
)
_CONTENT_TYPE = st.sampled_from(["application/pdf", "text/plain", "image/png", "text/csv"])
_MAILBOX_NAME = st.sampled_from(["", "Books", "Zoë, Sales", 'Sa"les', "José (billing)"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    local=_LOCAL,
    domain=_DOMAIN,
    names=st.lists(_MAILBOX_NAME, min_size=3, max_size=3),
    filenames=st.lists(_FILENAME, max_size=3),
    content_type=_CONTENT_TYPE,
    content=st.binary(max_size=300),
)
def test_reply_to_cc_bcc_and_files_are_sent_or_refused_with_a_named_cause(
    local, domain, names, filenames, content_type, content
):
    """What a route may produce (addresses ``publish()`` accepted, files its function made,
    checked by the send path) goes out through every adapter, SMTP's writer included, or is
    refused with a named permanent cause."""
    route = Route(
        name="r",
        event_type="a.b",
        event_version=1,
        template="t",
        lane=Lane.TRANSACTIONAL,
        reply_to=(Mailbox(address_field="a", name_field="an"),),
        cc=(Mailbox(address_field="b", name_field="bn"),),
        bcc=(Mailbox(address_field="c", name_field="cn"),),
        attachments=lambda payload: [Attachment(f, content_type, content) for f in filenames],
    )
    address = f"{local}@{domain}"
    payload = {"a": address, "b": address, "c": address}
    payload.update({k: n for k, n in zip(("an", "bn", "cn"), names, strict=True) if n})
    try:
        addressing.check_payload(route, payload)  # what publish() runs
    except PublishError:
        return
    resolved = addressing.address(route, payload, "Shop <no-reply@example.com>")
    email = OutgoingEmail(
        message_id=1,
        event_id="01JDQ5Z3K8M9N0P1Q2R3S4T5V6",
        idempotency_key="k-1",
        sender=resolved.sender,
        to="jane@example.com",
        subject="s",
        text="t",
        html=None,
        template="t",
        lane="transactional",
        reply_to=resolved.reply_to,
        cc=resolved.cc,
        bcc=resolved.bcc,
        envelope_sender="bounces@example.com",
        attachments=addressing.attachments_for(route, payload),
    )
    for a in email.attachments:
        assert "/" not in a.filename and "\r" not in a.filename and "\n" not in a.filename
    for provider, make in ADAPTERS.items():
        adapter = make(httpx.MockTransport(_accept))
        try:
            adapter.send(email)
        except PermanentError as error:
            assert error.code and error.code != "unexpected", (provider, error)
        finally:
            adapter.close()
    smtp = SmtpProvider("127.0.0.1", 2525)
    try:
        message, _ = smtp.build_message(email)
        raw = message.as_bytes(eight_bit=False)
        assert b"\nBcc:" not in raw
    except PermanentError as error:
        assert error.code and error.code != "unexpected", ("smtp", error)
