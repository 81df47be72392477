"""The SMTP adapter against a real MTA: a private Postfix (tests/servers/postfix.py) delivering
to a Maildir, read back with the standard library's ``mailbox`` and ``email`` parsers.

Every message arrives once with its Message-ID; the headers RFCs fix (``List-Unsubscribe``,
``List-Unsubscribe-Post``, ``Message-ID``, our ``X-Email-*``) arrive byte for byte, never as
encoded words; a long non-ASCII subject decodes to its exact text; 8BITMIME is used when
offered and quoted-printable otherwise; SMTPUTF8 when an address needs it, a named permanent
error when the server lacks it; IDNA domains as A-labels; a failed transaction never costs the
next message on the pooled connection; STARTTLS and implicit TLS with AUTH, untrusted
certificates refused, credentials never sent in clear. No Postfix, no pass: the session fixture
fails, it does not skip.
"""

import itertools
import json
import smtplib
from collections.abc import Iterator
from datetime import UTC, datetime
from email import message_from_bytes
from email import policy as email_policy
from email.header import decode_header, make_header
from typing import Any

import pytest

from email_platform.common.errors import PermanentError, ProviderRejectedError
from email_platform.providers.base import OutgoingEmail
from email_platform.providers.smtp import SmtpProvider, message_id_for
from email_platform.resources import EmailProviderResource
from tests.servers.postfix import PASSWORD, USER, Postfix, start_postfix
from tests.support import dead_letters_of, messages_of, run_send, signup

FROZEN = datetime(2026, 12, 5, 4, 0, 0, tzinfo=UTC)
_serial = itertools.count()
#: A real unsubscribe header: an https link of ~160 characters and a mailto.
UNSUBSCRIBE_URL = (
    "https://mail.example.com/unsubscribe/v1/"
    "eyJldmVudCI6IjAxSkRRNVozSzhNOU4wUDFRMlIzUzRUNVY2Iiwicm91dGUiOiJuZXdzbGV0dGVyIn0."
    "Zm9vYmFyYmF6cXV4MTIzNDU2Nzg5MA?l=bulk"
)
LIST_UNSUBSCRIBE = f"<{UNSUBSCRIBE_URL}>, <mailto:unsubscribe@example.com?subject=unsubscribe>"


@pytest.fixture(scope="session")
def postfix() -> Iterator[Postfix]:
    """One private Postfix per test process (each xdist worker has its own dirs and ports)."""
    server = start_postfix()
    try:
        yield server
    finally:
        server.stop()


def address(name: str, domain: str = "example.com") -> str:
    """A recipient no other test uses (they share one Maildir)."""
    return f"{name}-{next(_serial)}@{domain}"


def outgoing(**overrides: Any) -> OutgoingEmail:
    n = next(_serial)
    event_id = f"01JPFX{n:020d}"
    values: dict[str, Any] = {
        "message_id": n,
        "event_id": event_id,
        "idempotency_key": f"{event_id}:welcome",
        "sender": "Example Team <no-reply@example.com>",
        "to": address("jane"),
        "subject": "Welcome, Jane",
        "text": "Hello Jane,\nwelcome aboard.\n",
        "html": "<p>Hello Jane, welcome aboard.</p>",
        "template": "welcome",
        "lane": "transactional",
        "headers": {},
    }
    values.update(overrides)
    return OutgoingEmail(**values)


def smtp(postfix: Postfix, listener: str = "plain", **kwargs: Any) -> SmtpProvider:
    kwargs.setdefault("timeout_s", 10.0)
    if listener in ("plain", "legacy", "cleartext_auth"):
        kwargs.setdefault("starttls", "false")
    return SmtpProvider("127.0.0.1", postfix.port(listener), clock=lambda: FROZEN, **kwargs)


def raw_headers(raw: bytes) -> dict[str, bytes]:
    """Each header's raw value, unfolded (a line break before whitespace removed, nothing
    else): the bytes as sent. The first of a repeated name wins."""
    head = raw.replace(b"\r\n", b"\n").split(b"\n\n", 1)[0]
    unfolded = head.replace(b"\n ", b" ").replace(b"\n\t", b"\t")
    found: dict[str, bytes] = {}
    for line in unfolded.split(b"\n"):
        name, _, value = line.partition(b":")
        found.setdefault(name.decode().lower(), value[1:] if value[:1] == b" " else value)
    return found


@pytest.fixture
def mail_options(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The ESMTP options of every MAIL FROM the adapter sends (a spy: the real call goes on)."""
    seen: list[list[str]] = []
    real = smtplib.SMTP.mail

    def mail(self: smtplib.SMTP, sender: str, options: Any = ()) -> tuple[int, bytes]:
        seen.append(list(options))
        return real(self, sender, options)

    monkeypatch.setattr(smtplib.SMTP, "mail", mail)
    return seen


# ---- once, with its Message-ID, headers byte for byte ------------------------------------------


def test_every_message_is_delivered_once_with_its_message_id(postfix: Postfix) -> None:
    provider = smtp(postfix)
    emails = [outgoing() for _ in range(3)]
    try:
        accepted = [provider.send(email) for email in emails]
    finally:
        provider.close()
    for email, result in zip(emails, accepted, strict=True):
        ((raw, message),) = postfix.wait_delivered(email.to)
        expected = message_id_for(email.idempotency_key, "example.com")
        assert raw_headers(raw)["message-id"] == expected.encode()
        assert result.provider_message_id == expected
        assert message["X-Email-Event-Id"] == email.event_id
        assert message["Return-Path"] == "<no-reply@example.com>"


def test_rfc_fixed_headers_arrive_byte_for_byte_never_encoded(postfix: Postfix) -> None:
    key = "newsletter:" + "k" * 95 + ":2026-12-05"
    assert len(key) == 117
    email = outgoing(
        idempotency_key=key,
        trace_id="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        correlation_id="req-42",
        headers={
            "List-Unsubscribe": LIST_UNSUBSCRIBE,
            "List-Unsubscribe-Post": "List-Unsubscribe=One-Click",
            "X-Campaign": "spring-sale",
        },
    )
    assert len(UNSUBSCRIBE_URL) > 150
    provider = smtp(postfix)
    try:
        provider.send(email)
    finally:
        provider.close()
    ((raw, message),) = postfix.wait_delivered(email.to)
    headers = raw_headers(raw)
    expected = {
        "list-unsubscribe": LIST_UNSUBSCRIBE,
        "list-unsubscribe-post": "List-Unsubscribe=One-Click",
        "message-id": message_id_for(key, "example.com"),
        "x-email-event-id": email.event_id,
        "x-email-idempotency-key": key,
        "x-email-trace-id": email.trace_id,
        "x-email-correlation-id": "req-42",
        "x-campaign": "spring-sale",
    }
    for name, value in expected.items():
        assert headers[name] == value.encode(), name
        assert b"=?" not in headers[name]
    # Folded, if at all, only at whitespace: every line of the head is within 998 octets and
    # the unsubscribe link and the key each sit whole on one line.
    lines = raw.split(b"\n\n", 1)[0].split(b"\n")
    assert max(len(line) for line in lines) <= 998
    assert any(f"<{UNSUBSCRIBE_URL}>,".encode() in line for line in lines)
    assert f"X-Email-Idempotency-Key: {key}".encode() in lines
    assert message["List-Unsubscribe"] == LIST_UNSUBSCRIBE


@pytest.mark.parametrize(
    "subject",
    [
        "Ihre Bestellung über 3 Artikel wurde versandt - Grüße, Lieferung voraussichtlich am "
        "Dienstag, den 8. Dezember, zwischen 10 und 14 Uhr; Sendungsnummer folgt",
        "日本語の件名 とても長い件名です、スペースを含みます 確認してください " * 3,
        # Two subjects Python 3.11's own folder writes with a space lost ("ZoëZoë",
        # "übernaïve"): the space fell between two encoded words.
        "Zoë naïve a café the résumé ☕ Zoë naïve Zoë a the résumé a résumé café Zoë Zoë ☕ ☕ "
        "résumé the ☕ café naïve 日本 über Zoë ☕ über order Zoë shipped café",
        "a ☕ naïve the order 日本 a shipped Zoë the café résumé ☕ a shipped café über naïve "
        "résumé ☕ über résumé a naïve shipped 日本 order a Zoë résumé 日本",
        "Zoë  two spaces,  a tab\there, café ☕ " + "x" * 90 + " end",
    ],
    ids=["german", "japanese", "lost-space-1", "lost-space-2", "spaces-and-long-word"],
)
def test_a_long_non_ascii_subject_decodes_to_its_exact_text(postfix: Postfix, subject: str) -> None:
    email = outgoing(subject=subject)
    provider = smtp(postfix)
    try:
        provider.send(email)
    finally:
        provider.close()
    ((raw, _),) = postfix.wait_delivered(email.to)
    head = raw.split(b"\n\n", 1)[0]
    assert head.isascii()
    assert max(len(line) for line in head.split(b"\n")) <= 78 + 1  # "Subject: " + a word
    value = raw_headers(raw)["subject"].decode("ascii")
    # The legacy decoder and the modern parser both read back the exact text.
    assert str(make_header(decode_header(value))) == subject
    modern = message_from_bytes(raw, policy=email_policy.default)
    assert str(modern["Subject"]) == subject


# ---- 8BITMIME and SMTPUTF8 -------------------------------------------------------------------


def test_8bit_parts_go_as_8bit_with_body_8bitmime_when_offered(
    postfix: Postfix, mail_options: list[list[str]]
) -> None:
    email = outgoing(text="Grüße aus Köln, Zoë ☕\n", html="<p>Grüße aus Köln ☕</p>")
    provider = smtp(postfix)
    try:
        provider.send(email)
    finally:
        provider.close()
    ((raw, _),) = postfix.wait_delivered(email.to)
    assert "BODY=8BITMIME" in mail_options[-1]
    parsed = message_from_bytes(raw, policy=email_policy.default)
    parts = list(parsed.iter_parts())
    assert [p["Content-Transfer-Encoding"] for p in parts] == ["8bit", "8bit"]
    assert "Grüße aus Köln, Zoë ☕".encode() in raw
    assert [p.get_content() for p in parts] == [
        "Grüße aus Köln, Zoë ☕\n",
        "<p>Grüße aus Köln ☕</p>\n",
    ]


def test_without_8bitmime_the_body_goes_quoted_printable_and_7bit_clean(
    postfix: Postfix, mail_options: list[list[str]]
) -> None:
    email = outgoing(text="Grüße aus Köln, Zoë ☕\n" + "ä" * 600 + "\n", html=None)
    provider = smtp(postfix, "legacy")
    try:
        provider.send(email)
        ascii_only = outgoing()
        provider.send(ascii_only)
    finally:
        provider.close()
    ((raw, parsed),) = postfix.wait_delivered(email.to)
    assert all("BODY=8BITMIME" not in options for options in mail_options)
    assert raw.split(b"\nReceived:", 1)[1].isascii()  # nothing 8-bit reached the server
    assert parsed["Content-Transfer-Encoding"] == "quoted-printable"
    modern = message_from_bytes(raw, policy=email_policy.default)
    assert modern.get_content() == email.text
    ((_, plain),) = postfix.wait_delivered(ascii_only.to)
    assert [p["Content-Transfer-Encoding"] for p in plain.get_payload()] == ["7bit", "7bit"]


def test_a_non_ascii_local_part_goes_with_smtputf8_when_offered(
    postfix: Postfix, mail_options: list[list[str]]
) -> None:
    to = address("jösé")
    provider = smtp(postfix)
    try:
        provider.send(outgoing(to=to))
    finally:
        provider.close()
    ((raw, message),) = postfix.wait_delivered(to)
    assert "SMTPUTF8" in mail_options[-1]
    assert raw_headers(raw)["to"] == to.encode("utf-8")  # RFC 6532: UTF-8 as itself
    assert message["Delivered-To"] == to


def test_a_non_ascii_local_part_without_smtputf8_is_a_named_permanent_error(
    postfix: Postfix,
) -> None:
    to = address("jösé")
    provider = smtp(postfix, "legacy")
    try:
        with pytest.raises(PermanentError) as refused:
            provider.send(outgoing(to=to))
        after = outgoing()
        provider.send(after)  # the connection carries the next message as usual
    finally:
        provider.close()
    assert refused.value.code == "smtp_smtputf8_unavailable"
    assert to in str(refused.value) and "SMTPUTF8" in str(refused.value)
    assert "non-ASCII local part" in str(refused.value)
    postfix.wait_delivered(after.to)
    assert postfix.messages(to) == []


def test_a_non_ascii_idempotency_key_goes_as_utf8_never_as_an_encoded_word(
    postfix: Postfix, mail_options: list[list[str]]
) -> None:
    email = outgoing(idempotency_key="commande-été:welcome")
    provider, legacy = smtp(postfix), smtp(postfix, "legacy")
    try:
        provider.send(email)
        with pytest.raises(PermanentError) as refused:
            legacy.send(outgoing(idempotency_key="commande-été:welcome"))
    finally:
        provider.close()
        legacy.close()
    ((raw, _),) = postfix.wait_delivered(email.to)
    assert "SMTPUTF8" in mail_options[0]
    headers = raw_headers(raw)
    assert headers["x-email-idempotency-key"] == "commande-été:welcome".encode()
    assert headers["message-id"] == b"<commande-=C3=A9t=C3=A9=3Awelcome@example.com>"
    assert refused.value.code == "smtp_smtputf8_unavailable"
    assert "X-Email-Idempotency-Key" in str(refused.value)


def test_an_idna_domain_goes_as_a_labels_in_envelope_and_headers(postfix: Postfix) -> None:
    local = address("jane", "bücher.example.com").split("@")[0]
    # No SMTPUTF8 needed: the legacy listener takes it.
    provider = smtp(postfix, "legacy")
    try:
        accepted = provider.send(
            outgoing(to=f"{local}@bücher.example.com", sender="Zoë <news@straße.example>")
        )
    finally:
        provider.close()
    ((raw, message),) = postfix.wait_delivered(f"{local}@xn--bcher-kva.example.com")
    headers = raw_headers(raw)
    assert headers["to"] == f"{local}@xn--bcher-kva.example.com".encode()
    assert headers["from"].endswith(b" <news@xn--strae-oqa.example>")
    assert message["Return-Path"] == "<news@xn--strae-oqa.example>"
    assert accepted.provider_message_id.endswith("@xn--strae-oqa.example>")


# ---- one failure stays one failure ---------------------------------------------------------


def test_a_refused_recipient_then_a_good_one_on_the_same_pooled_connection(
    postfix: Postfix,
) -> None:
    provider = smtp(postfix)
    bad, good = outgoing(to=address("unknown")), outgoing()
    try:
        with pytest.raises(ProviderRejectedError) as refused:
            provider.send(bad)
        (connection,) = provider._idle  # the refusal left it pooled, RSET done
        provider.send(good)
        assert provider._idle == [connection]
    finally:
        provider.close()
    assert refused.value.code == "smtp_550"
    assert bad.to in str(refused.value) and "User unknown" in str(refused.value)
    postfix.wait_delivered(good.to)
    assert postfix.messages(bad.to) == []


def test_an_exception_mid_transaction_costs_only_its_own_message(
    postfix: Postfix, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After MAIL FROM was accepted: at RCPT (RSET, the connection kept) and in the middle of
    DATA (the connection dropped); the next message goes normally, once."""
    real_rcpt, real_data = smtplib.SMTP.rcpt, smtplib.SMTP.data
    faults = {"rcpt": 1, "data": 1}

    def rcpt(self: smtplib.SMTP, recip: str, options: Any = ()) -> tuple[int, bytes]:
        if faults["rcpt"]:
            faults["rcpt"] -= 1
            raise UnicodeEncodeError("ascii", recip, 0, 1, "injected at RCPT")
        return real_rcpt(self, recip, options)

    def data(self: smtplib.SMTP, msg: Any) -> tuple[int, bytes]:
        if faults["data"]:
            faults["data"] -= 1
            self.putcmd("data")
            assert self.getreply()[0] == 354
            self.send(b"Subject: half a message\r\n")
            raise RuntimeError("injected mid-DATA")
        return real_data(self, msg)

    monkeypatch.setattr(smtplib.SMTP, "rcpt", rcpt)
    monkeypatch.setattr(smtplib.SMTP, "data", data)
    provider = smtp(postfix)
    first, second, third, fourth = (outgoing() for _ in range(4))
    try:
        with pytest.raises(PermanentError) as at_rcpt:
            provider.send(first)
        assert len(provider._idle) == 1  # RSET: still pooled
        with pytest.raises(PermanentError) as mid_data:
            provider.send(second)  # on the kept connection: MAIL FROM is not refused as nested
        assert provider._idle == []  # dropped: its state is unknown
        provider.send(third)
        provider.send(fourth)
    finally:
        provider.close()
    assert "injected at RCPT" in str(at_rcpt.value)
    assert "injected mid-DATA" in str(mid_data.value)
    for delivered in (third, fourth):
        postfix.wait_delivered(delivered.to)
    assert postfix.messages(first.to) == [] and postfix.messages(second.to) == []


def test_send_job_dead_letters_the_refused_recipient_and_delivers_the_others_once(
    engine: Any, database_url: str, postfix: Postfix
) -> None:
    refused_to, good_to = address("unknown"), address("jane")
    idn_to = address("jane", "bücher.example.com")
    refused = signup(engine, f"pf-{next(_serial)}", email=refused_to)
    good = signup(engine, f"pf-{next(_serial)}", email=good_to)
    idn = signup(engine, f"pf-{next(_serial)}", email=idn_to)
    resource = EmailProviderResource(
        provider="smtp",
        base_url=f"smtp://127.0.0.1:{postfix.port('plain')}",
        timeout_s=10.0,
        options_json=json.dumps({"starttls": "false"}),
    )
    result = run_send(
        database_url, "unused", "transactional", [refused, good, idn], provider=resource
    )
    assert not result.success  # the 550 fails the run once every outcome is recorded
    ((raw, _),) = postfix.wait_delivered(good_to)
    (message,) = messages_of(engine, good)
    assert message.status == "sent"
    assert raw_headers(raw)["message-id"] == message.provider_message_id.encode()
    (letter,) = dead_letters_of(engine, refused)
    assert (letter.reason, letter.error_code) == ("provider_rejected", "smtp_550")
    assert "User unknown" in letter.last_error and refused_to in letter.last_error
    assert postfix.messages(refused_to) == []
    # publish() takes an internationalized domain: it is delivered (A-labels), not dead-lettered.
    postfix.wait_delivered(idn_to.replace("bücher", "xn--bcher-kva"))
    assert messages_of(engine, idn)[0].status == "sent"


# ---- TLS and AUTH ------------------------------------------------------------------------------


def test_starttls_then_auth(postfix: Postfix) -> None:
    email = outgoing()
    provider = smtp(
        postfix, "submission", username=USER, password=PASSWORD, ca_file=str(postfix.certificate)
    )
    try:
        provider.send(email)
    finally:
        provider.close()
    ((_, message),) = postfix.wait_delivered(email.to)
    received = str(message["Received"])
    assert "using TLS" in received and f"Authenticated sender: {USER}@" in received


def test_implicit_tls_with_auth(postfix: Postfix) -> None:
    email = outgoing()
    provider = smtp(
        postfix,
        "smtps",
        use_ssl=True,
        username=USER,
        password=PASSWORD,
        ca_file=str(postfix.certificate),
    )
    try:
        provider.send(email)
    finally:
        provider.close()
    ((_, message),) = postfix.wait_delivered(email.to)
    received = str(message["Received"])
    assert "using TLS" in received and f"Authenticated sender: {USER}@" in received


def test_an_untrusted_certificate_and_a_wrong_password_are_refused(postfix: Postfix) -> None:
    email = outgoing()
    for listener, kwargs, code in (
        ("submission", {}, "smtp_tls_verify_failed"),  # self-signed, not in the trust store
        ("smtps", {"use_ssl": True}, "smtp_tls_verify_failed"),
        ("submission", {"ca_file": str(postfix.certificate), "password": "wrong"}, "smtp_535"),
    ):
        kwargs = {"username": USER, "password": PASSWORD, **kwargs}
        provider = smtp(postfix, listener, **kwargs)
        try:
            with pytest.raises(PermanentError) as refused:
                provider.send(email)
        finally:
            provider.close()
        assert refused.value.code == code, listener
    assert postfix.queue_empty() and postfix.messages(email.to) == []


def test_credentials_are_never_sent_in_clear(postfix: Postfix) -> None:
    email = outgoing()
    cases = (
        # A server offering AUTH without TLS: the adapter will not use it.
        ("cleartext_auth", {}, "smtp_plaintext_auth_refused"),
        # STARTTLS turned off on our side: the same refusal, before any AUTH.
        ("submission", {"starttls": "false"}, "smtp_plaintext_auth_refused"),
        # Allowed on our side: Postfix does not even offer AUTH before TLS.
        ("submission", {"starttls": "false", "allow_plaintext_auth": True}, "smtp_unsupported"),
    )
    for listener, kwargs, code in cases:
        provider = smtp(postfix, listener, username=USER, password=PASSWORD, **kwargs)
        try:
            with pytest.raises(PermanentError) as refused:
                provider.send(email)
        finally:
            provider.close()
        assert refused.value.code == code, (listener, kwargs)
    assert postfix.messages(email.to) == []
