"""``mail/addressing.py`` on its own: mailbox specs and how they are written, attachment checks
and limits with their named codes, file names made safe, the start-up refusal of an adapter
that cannot carry a route's field (a failover's two adapters both), and the demo's PDF."""

import re
from collections.abc import Mapping
from email.utils import parseaddr
from typing import Any

import pytest

from email_platform.common.errors import ConfigurationError, PermanentError
from email_platform.common.lanes import Lane
from email_platform.mail import addressing
from email_platform.mail.addressing import Attachment, AttachmentLimits, Mailbox
from email_platform.mail.receipt_pdf import pdf_bytes, receipt_attachments
from email_platform.mail.routes import Route, demo_routes
from email_platform.providers.base import OutgoingEmail, header_problem
from email_platform.providers.postmark import PostmarkProvider
from email_platform.providers.sandbox import SandboxProvider
from email_platform.providers.smtp import SmtpProvider


def _route(**changes: Any) -> Route:
    values: dict[str, Any] = {
        "name": "r",
        "event_type": "a.b",
        "event_version": 1,
        "template": "t",
        "lane": Lane.TRANSACTIONAL,
    }
    return Route(**{**values, **changes})


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({}, "exactly one of address and address_field"),
        ({"address": "a@example.com", "address_field": "x"}, "exactly one"),
        ({"address": "not-an-address"}, "not a valid email address"),
        ({"address": "a@example.com", "name": "Eve <e@x.com>"}, "without < >"),
        ({"address": "a@example.com", "name": "Eve\r\nBcc: x@y.com"}, "would inject"),
    ],
)
def test_a_wrong_mailbox_is_a_configuration_error(kwargs: dict, problem: str) -> None:
    with pytest.raises(ConfigurationError, match=problem):
        Mailbox(**kwargs)


@pytest.mark.parametrize(
    ("name", "written"),
    [
        (None, "a@example.com"),
        ("Shop billing", "Shop billing <a@example.com>"),
        ("Zoë", "Zoë <a@example.com>"),
        ("Doe, Jane", '"Doe, Jane" <a@example.com>'),
        ('Jane "JJ" Doe', '"Jane \\"JJ\\" Doe" <a@example.com>'),
        ("J. Doe", '"J. Doe" <a@example.com>'),
    ],
)
def test_a_mailbox_is_written_so_parseaddr_reads_it_back(name: str | None, written: str) -> None:
    assert Mailbox(address="a@example.com", name=name).resolve({}, "sender") == written
    assert parseaddr(written) == (name or "", "a@example.com")


def test_a_payload_name_wins_over_the_fixed_one_and_falls_back_to_it() -> None:
    box = Mailbox(address_field="seller", name_field="seller_name", name="Shop")
    assert box.resolve({"seller": "s@example.com", "seller_name": "Ada"}, "sender") == (
        "Ada <s@example.com>"
    )
    assert box.resolve({"seller": "s@example.com"}, "sender") == "Shop <s@example.com>"


def test_a_payload_address_that_went_bad_is_a_named_permanent_error_at_send_time() -> None:
    # A payload published before the route read it (or an upcaster's output).
    route = _route(cc=(Mailbox(address_field="cc"),))
    with pytest.raises(PermanentError) as raised:
        addressing.address(route, {"cc": "nope"}, "x@example.com")
    assert raised.value.code == "invalid_address" and "payload.cc" in str(raised.value)


def _maker(items: list[Any]):  # type: ignore[no-untyped-def]
    return lambda payload: items


@pytest.mark.parametrize(
    ("attachments", "limits", "code"),
    [
        (
            _maker([Attachment("a", "text/plain", b"x")] * 3),
            AttachmentLimits(2, 100),
            "attachments_too_many",
        ),
        (
            _maker([Attachment("a", "text/plain", b"x" * 60)] * 2),
            AttachmentLimits(5, 100),
            "attachments_too_large",
        ),
        (_maker(["not an attachment"]), AttachmentLimits(), "attachment_failed"),
        (
            _maker([Attachment("a", "text/plain", "str, not bytes")]),
            AttachmentLimits(),
            "attachment_invalid",
        ),
        (
            _maker([Attachment("a", "text/plain\r\nX: y", b"x")]),
            AttachmentLimits(),
            "attachment_invalid",
        ),
        (_maker([Attachment("a", "pdf", b"x")]), AttachmentLimits(), "attachment_invalid"),
        (lambda payload: payload["missing"], AttachmentLimits(), "attachment_failed"),
        (lambda payload: None, AttachmentLimits(), "attachment_failed"),
    ],
)
def test_attachment_failures_are_permanent_with_a_code_naming_the_cause(
    attachments: Any, limits: AttachmentLimits, code: str
) -> None:
    route = _route(attachments=attachments, attachment_limits=limits)
    with pytest.raises(PermanentError) as raised:
        addressing.attachments_for(route, {})
    assert raised.value.code == code
    assert "route r" in str(raised.value)


def test_attachments_within_the_limits_come_back_checked() -> None:
    route = _route(
        attachments=_maker([Attachment("a.txt", "Text/Plain", bytearray(b"x" * 50))] * 2),
        attachment_limits=AttachmentLimits(2, 100),
    )
    assert (
        addressing.attachments_for(route, {}) == (Attachment("a.txt", "text/plain", b"x" * 50),) * 2
    )
    assert addressing.attachments_for(_route(), {}) == ()


@pytest.mark.parametrize(
    ("name", "safe"),
    [
        ("receipt.pdf", "receipt.pdf"),
        ("../../etc/passwd", "_.._etc_passwd"),
        ("C:\\Users\\x.pdf", "C:_Users_x.pdf"),
        ("a\r\nContent-Type: text/html.pdf", "a__Content-Type: text_html.pdf"),
        ("invoice\u202efdp.exe", "invoice_fdp.exe"),
        ('say "hi".txt', "say _hi_.txt"),
        ("", "attachment"),
        ("...", "attachment"),
        (None, "attachment"),
        ("x" * 300 + ".pdf", "x" * 146 + ".pdf"),
    ],
)
def test_file_names_lose_path_separators_line_breaks_and_controls(name: Any, safe: str) -> None:
    assert addressing.safe_filename(name) == safe


def _email(**changes: Any) -> OutgoingEmail:
    values: dict[str, Any] = {
        "message_id": 1,
        "event_id": "e",
        "idempotency_key": "k",
        "sender": "a@example.com",
        "to": "b@example.com",
        "subject": "s",
        "text": "t",
        "html": None,
        "template": "t",
        "lane": "transactional",
    }
    return OutgoingEmail(**{**values, **changes})


@pytest.mark.parametrize(
    "changes",
    [
        {"cc": ("x@example.com\r\nBcc: y@evil.example",)},
        {"bcc": ("=?utf-8?q?x=0D=0A?= <x@example.com>",)},
        {"reply_to": ("Eve\n <x@example.com>",)},
        {"envelope_sender": "x@example.com\r\n"},
        {"attachments": (Attachment("a\r\nb", "text/plain", b""),)},
    ],
)
def test_every_adapter_refuses_a_line_break_in_the_new_fields(changes: dict) -> None:
    problem = header_problem(_email(**changes))
    assert problem is not None and problem.code == "header_injection"


def test_a_bracketed_address_that_parses_as_another_is_refused() -> None:
    problem = header_problem(_email(cc=("Eve <eve@evil.example> <books@example.org>",)))
    assert problem is not None and problem.code == "ambiguous_address"


class _Failover:
    name = "postmark"

    def __init__(self, primary: Any, secondary: Any) -> None:
        self.primary, self.secondary = primary, secondary


def test_an_adapter_that_cannot_carry_a_routed_field_is_refused_at_start_up() -> None:
    routes = [_route(envelope_sender="bounces@example.com")]
    smtp = SmtpProvider("127.0.0.1", 2525)
    sandbox = SandboxProvider("http://sandbox.invalid")
    postmark = PostmarkProvider(server_token="t")
    try:
        addressing.refuse_uncarried(smtp, routes)
        addressing.refuse_uncarried(sandbox, routes)
        with pytest.raises(ConfigurationError, match=r"route r sets envelope_sender.*postmark"):
            addressing.refuse_uncarried(postmark, routes)
        # A failover carries only what both of its adapters can.
        with pytest.raises(ConfigurationError, match="envelope_sender"):
            addressing.refuse_uncarried(_Failover(smtp, postmark), routes)
        addressing.refuse_uncarried(postmark, demo_routes().routes)  # Reply-To, files: fine
    finally:
        sandbox.close()
        postmark.close()


def test_a_route_with_too_many_extra_addresses_is_refused() -> None:
    many = tuple(Mailbox(address=f"a{i}@example.com") for i in range(51))
    with pytest.raises(ConfigurationError, match="route r: more than 50"):
        addressing.check_route(_route(bcc=many))
    with pytest.raises(ConfigurationError, match="tuple of Mailbox"):
        addressing.check_route(_route(cc=Mailbox(address="a@example.com")))  # type: ignore[arg-type]


def _objects(pdf: bytes) -> Mapping[int, int]:
    return {int(m.group(1)): m.start() for m in re.finditer(rb"(\d+) 0 obj\n", pdf)}


def test_the_demo_receipt_pdf_is_well_formed() -> None:
    """The cross-reference table points at each object, startxref at the table, the stream's
    length is its length: what a PDF reader checks first."""
    (attachment,) = receipt_attachments(
        {
            "order_id": "O-(1)",
            "items": [{"name": "Tasse ☕", "quantity": 2, "unit_price": 9.5}],
            "total": 19,
            "currency": "EUR",
        }
    )
    assert (attachment.filename, attachment.content_type) == (
        "receipt-O-(1).pdf",
        "application/pdf",
    )
    pdf = attachment.content
    assert pdf.startswith(b"%PDF-1.4\n") and pdf.endswith(b"%%EOF\n")
    xref = int(pdf.rsplit(b"startxref\n", 1)[1].split(b"\n")[0])
    assert pdf[xref:].startswith(b"xref\n0 6\n")
    entries = pdf[xref:].split(b"\n")[3:8]
    assert [int(e[:10]) for e in entries] == [_objects(pdf)[n] for n in range(1, 6)]
    length = int(re.search(rb"/Length (\d+)", pdf).group(1))  # type: ignore[union-attr]
    stream = pdf.split(b"stream\n", 1)[1].split(b"\nendstream", 1)[0]
    assert len(stream) == length
    assert b"(Receipt for order O-\\(1\\)) '" in stream and b"Tasse ?" in stream
    assert pdf_bytes(["a"]) != pdf_bytes(["b"])


def test_ses_raw_content_names_text_it_cannot_serialize() -> None:
    from botocore.credentials import Credentials

    from email_platform.providers.ses import SesProvider

    ses = SesProvider(credentials=Credentials("AKID", "secret"))
    try:
        email = _email(text="broken \ud800", attachments=(Attachment("a.txt", "text/plain", b"x"),))
        with pytest.raises(PermanentError) as raised:
            ses.body(email)
        assert raised.value.code == "unencodable_text"
        assert set(ses.body(_email(attachments=email.attachments))["Content"]) == {"Raw"}
    finally:
        ses.close()
