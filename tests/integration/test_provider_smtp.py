"""The SMTP adapter against a real SMTP server on loopback (aiosmtpd): the message and its
headers as received, STARTTLS, implicit TLS and AUTH, 4xx/5xx replies classified, header
injection refused, connections reused and replaced, and the send job end to end.
"""

import json
import smtplib
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

import pytest

from email_platform.common.config import ProviderSettings
from email_platform.common.errors import (
    ConfigurationError,
    PermanentError,
    ProviderRejectedError,
    TransientError,
)
from email_platform.providers.base import OutgoingEmail
from email_platform.providers.registry import open_provider
from email_platform.providers.smtp import SmtpProvider, classify_smtp_error, message_id_for
from email_platform.resources import EmailProviderResource
from tests.provider_stubs.smtp import SmtpStub, self_signed_certificate
from tests.support import attempts_of, dead_letters_of, messages_of, run_send, signup, step_events

EVENT_ID = "01JDQ5Z3K8M9N0P1Q2R3S4T5V6"
FROZEN = datetime(2026, 11, 29, 14, 22, 18, tzinfo=UTC)


def outgoing(**overrides) -> OutgoingEmail:  # type: ignore[no-untyped-def]
    values = {
        "message_id": 7,
        "event_id": EVENT_ID,
        "idempotency_key": f"{EVENT_ID}:welcome",
        "sender": "Example Team <no-reply@example.com>",
        "to": "jane@example.com",
        "subject": "Welcome, Jane",
        "text": "Hello Jane,\nwelcome aboard.\n",
        "html": "<p>Hello Jane, welcome aboard.</p>",
        "template": "welcome",
        "lane": "transactional",
        "headers": {"X-Email-Event-Id": EVENT_ID, "X-Campaign": "onboarding"},
    }
    values.update(overrides)
    return OutgoingEmail(**values)


def smtp(stub: SmtpStub, **kwargs) -> SmtpProvider:  # type: ignore[no-untyped-def]
    kwargs.setdefault("timeout_s", 5.0)
    return SmtpProvider("127.0.0.1", stub.port, clock=lambda: FROZEN, **kwargs)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):  # type: ignore[no-untyped-def]
    made = self_signed_certificate(tmp_path_factory.mktemp("tls"))
    if made is None:
        pytest.skip("openssl is not installed: no certificate for the TLS tests")
    return made


# ---- the message as received -------------------------------------------------------------------


def test_message_arrives_with_its_headers_and_both_parts():
    with SmtpStub() as stub:
        provider = smtp(stub)
        try:
            accepted = provider.send(outgoing())
        finally:
            provider.close()
    (received,) = stub.received
    assert received.mail_from == "no-reply@example.com"
    assert received.rcpt_tos == ["jane@example.com"]
    message = received.message
    assert message["From"] == "Example Team <no-reply@example.com>"
    assert message["To"] == "jane@example.com"
    assert message["Subject"] == "Welcome, Jane"
    assert message["Message-ID"] == f"<{EVENT_ID}=3Awelcome@example.com>"
    assert accepted.provider_message_id == message["Message-ID"]
    assert parsedate_to_datetime(message["Date"]) == FROZEN
    assert message["X-Email-Event-Id"] == EVENT_ID
    assert message["X-Email-Idempotency-Key"] == f"{EVENT_ID}:welcome"
    assert message["X-Campaign"] == "onboarding"
    assert len(message.get_all("X-Email-Event-Id")) == 1
    assert message.get_content_type() == "multipart/alternative"
    parts = [(p.get_content_type(), p.get_content()) for p in message.iter_parts()]
    assert parts == [
        ("text/plain", "Hello Jane,\nwelcome aboard.\n"),
        ("text/html", "<p>Hello Jane, welcome aboard.</p>\n"),
    ]
    assert not received.tls and received.login is None


def test_non_ascii_subject_and_display_name_are_mime_encoded():
    with SmtpStub() as stub:
        provider = smtp(stub)
        provider.send(outgoing(subject="Bienvenue, Zoë ✓", sender="Zoë Café <z@example.com>"))
        provider.send(outgoing(html=None, to="john@example.com"))
        provider.close()
    first, text_only = stub.received
    head = first.raw.split(b"\r\n\r\n", 1)[0]
    assert head.isascii()
    assert first.message["Subject"] == "Bienvenue, Zoë ✓"
    assert first.message["From"].addresses[0].display_name == "Zoë Café"
    assert text_only.message.get_content_type() == "text/plain"
    assert text_only.message.get_content() == "Hello Jane,\nwelcome aboard.\n"


def test_message_id_is_deterministic_per_key_and_never_shared_by_two_keys():
    assert message_id_for("01J:welcome", "Example.COM") == "<01J=3Awelcome@example.com>"
    # "a:b" and "a_b" would collide under a lossy mapping; here they cannot.
    assert message_id_for("a:b", "x.io") != message_id_for("a_b", "x.io")
    assert message_id_for("clé", "x.io") == "<cl=C3=A9@x.io>"
    long_key = "k:" * 150
    long_id = message_id_for(long_key, "x.io")
    assert len(long_id) < 250 and long_id == message_id_for(long_key, "x.io")
    assert long_id != message_id_for("k:" * 149 + "k_", "x.io")


@pytest.mark.parametrize(
    "overrides",
    [
        {"subject": "Hello\r\nBcc: victim@example.net"},
        {"subject": "Hello\nX-Injected: 1"},
        {"sender": "Example\r\nBcc: victim@example.net <no-reply@example.com>"},
        {"sender": "Example\n <no-reply@example.com>"},
        {"headers": {"X-Campaign": "a\r\nBcc: victim@example.net"}},
        {"headers": {"X-Campaign\r\nBcc": "victim@example.net"}},
    ],
)
def test_cr_lf_injection_in_subject_display_name_or_header_is_impossible(overrides):
    with SmtpStub() as stub:
        provider = smtp(stub)
        with pytest.raises(PermanentError) as caught:
            provider.send(outgoing(**overrides))
        provider.close()
        assert caught.value.code == "header_injection"
        assert stub.received == [] and stub.connections == 0  # refused before connecting


@pytest.mark.parametrize("name", ["Bcc", "To", "message-id", "Content-Type", "Bad Name"])
def test_routes_cannot_override_envelope_or_structure_headers(name):
    with pytest.raises(PermanentError) as caught:
        SmtpProvider().build_message(outgoing(headers={name: "victim@example.net"}))
    assert caught.value.code == "invalid_header"


# ---- TLS and authentication --------------------------------------------------------------------


def test_starttls_then_auth_over_the_encrypted_channel(certificate):
    with SmtpStub(certificate=certificate, tls="starttls", users={"mailer": "s3cret"}) as stub:
        provider = smtp(stub, username="mailer", password="s3cret", ca_file=str(certificate[0]))
        provider.send(outgoing())
        provider.close()
    (received,) = stub.received
    assert received.tls is True
    assert received.login == "mailer"


def test_implicit_tls_with_auth(certificate):
    with SmtpStub(certificate=certificate, tls="implicit", users={"mailer": "s3cret"}) as stub:
        provider = smtp(
            stub, use_ssl=True, username="mailer", password="s3cret", ca_file=str(certificate[0])
        )
        provider.send(outgoing())
        provider.close()
    assert [(r.tls, r.login) for r in stub.received] == [(True, "mailer")]


def test_wrong_password_is_a_permanent_535(certificate):
    with SmtpStub(certificate=certificate, tls="starttls", users={"mailer": "s3cret"}) as stub:
        provider = smtp(stub, username="mailer", password="wrong", ca_file=str(certificate[0]))
        with pytest.raises(ProviderRejectedError) as caught:
            provider.send(outgoing())
        provider.close()
    assert caught.value.code == "smtp_535"
    assert "authentication failed" in str(caught.value)
    assert stub.received == []


def test_untrusted_certificate_is_refused_permanently(certificate):
    with SmtpStub(certificate=certificate, tls="starttls") as stub:
        provider = smtp(stub)  # no ca_file: the self-signed certificate is not trusted
        with pytest.raises(PermanentError) as caught:
            provider.send(outgoing())
        provider.close()
    assert caught.value.code == "smtp_tls_verify_failed"
    assert stub.received == []


def test_credentials_are_never_sent_in_clear_unless_allowed():
    with SmtpStub(users={"mailer": "s3cret"}, auth_require_tls=False) as stub:
        refusing = smtp(stub, username="mailer", password="s3cret")
        with pytest.raises(PermanentError) as caught:
            refusing.send(outgoing())
        refusing.close()
        assert caught.value.code == "smtp_plaintext_auth_refused"
        assert stub.received == []
        allowing = smtp(stub, username="mailer", password="s3cret", allow_plaintext_auth=True)
        allowing.send(outgoing())
        allowing.close()
    assert [(r.tls, r.login) for r in stub.received] == [(False, "mailer")]


def test_starttls_required_refuses_a_server_that_does_not_offer_it():
    with SmtpStub() as stub:
        provider = smtp(stub, starttls="required")
        with pytest.raises(PermanentError) as caught:
            provider.send(outgoing())
        provider.close()
        # The default ("true") upgrades when offered and goes on in clear when not.
        smtp(stub).send(outgoing())
    assert caught.value.code == "smtp_starttls_unavailable"
    assert len(stub.received) == 1


# ---- replies classified ------------------------------------------------------------------------


def test_4xx_reply_is_transient_and_5xx_permanent_over_one_reused_connection():
    with SmtpStub() as stub:
        provider = smtp(stub)
        with pytest.raises(TransientError) as busy:
            provider.send(outgoing(to="jane+fail451x1@example.com"))
        provider.send(outgoing(to="jane+fail451x1@example.com"))  # the retry goes through
        with pytest.raises(ProviderRejectedError) as unknown:
            provider.send(outgoing(to="nobody+invalid@example.com"))
        with pytest.raises(ProviderRejectedError) as content:
            provider.send(outgoing(to="jane+datafail554@example.com"))
        provider.send(outgoing(to="john@example.com"))
        provider.close()
        assert stub.connections == 1  # refusals reset the transaction, not the connection
    assert busy.value.code == "smtp_451"
    assert unknown.value.code == "smtp_550" and "5.1.1" in str(unknown.value)
    assert "nobody+invalid@example.com" in str(unknown.value)
    assert content.value.code == "smtp_554" and "DATA refused" in str(content.value)
    assert [r.rcpt_tos for r in stub.received] == [
        ["jane+fail451x1@example.com"],
        ["john@example.com"],
    ]


@pytest.mark.parametrize(
    ("exc", "kind", "code"),
    [
        (
            smtplib.SMTPRecipientsRefused({"a@x.io": (550, b"5.1.1 unknown")}),
            ProviderRejectedError,
            "smtp_550",
        ),
        (
            smtplib.SMTPRecipientsRefused(
                {"a@x.io": (550, b"5.1.1 unknown"), "b@x.io": (452, b"4.2.2 mailbox full")}
            ),
            TransientError,
            "smtp_452",
        ),
        (smtplib.SMTPSenderRefused(421, b"4.7.0 closing", "f@x.io"), TransientError, "smtp_421"),
        (
            smtplib.SMTPSenderRefused(553, b"5.7.1 not owner", "f@x.io"),
            ProviderRejectedError,
            "smtp_553",
        ),
        (smtplib.SMTPDataError(552, b"5.3.4 too big"), ProviderRejectedError, "smtp_552"),
        (smtplib.SMTPDataError(451, b"4.3.0 local error"), TransientError, "smtp_451"),
        (
            smtplib.SMTPAuthenticationError(535, b"5.7.8 bad credentials"),
            ProviderRejectedError,
            "smtp_535",
        ),
        (smtplib.SMTPAuthenticationError(454, b"4.7.0 try later"), TransientError, "smtp_454"),
        (smtplib.SMTPConnectError(554, b"no service"), ProviderRejectedError, "smtp_554"),
        (smtplib.SMTPHeloError(421, b"busy"), TransientError, "smtp_421"),
        (
            smtplib.SMTPServerDisconnected("Connection unexpectedly closed"),
            TransientError,
            "smtp_disconnected",
        ),
        (ConnectionRefusedError(111, "Connection refused"), TransientError, "network"),
        (TimeoutError("timed out"), TransientError, "timeout"),
        (
            smtplib.SMTPNotSupportedError("SMTP AUTH extension not supported"),
            PermanentError,
            "smtp_unsupported",
        ),
    ],
)
def test_every_smtp_failure_is_classified(exc, kind, code):
    error = classify_smtp_error(exc)
    assert type(error) is kind
    assert error.code == code


def test_connection_refused_and_silent_server_are_transient():
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    with pytest.raises(TransientError) as refused:
        SmtpProvider("127.0.0.1", port, timeout_s=1.0).send(outgoing())
    assert refused.value.code == "network"
    with socket.socket() as silent:  # accepts connections, never says hello
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        provider = SmtpProvider("127.0.0.1", silent.getsockname()[1], timeout_s=0.3)
        started = time.monotonic()
        with pytest.raises(TransientError) as hung:
            provider.send(outgoing())
    assert hung.value.code == "timeout"
    assert time.monotonic() - started < 3.0


# ---- connections -------------------------------------------------------------------------------


def test_one_connection_carries_many_messages():
    with SmtpStub() as stub:
        provider = smtp(stub)
        for n in range(5):
            provider.send(outgoing(to=f"user{n}@example.com"))
        provider.close()
        assert stub.connections == 1
    assert len(stub.received) == 5


def test_concurrent_sends_use_at_most_one_connection_per_thread():
    with SmtpStub() as stub:
        provider = smtp(stub, max_connections=4)
        with ThreadPoolExecutor(4) as pool:
            results = list(
                pool.map(
                    lambda n: provider.send(outgoing(to=f"user{n}@example.com")),
                    range(40),
                )
            )
        provider.close()
        assert 1 <= stub.connections <= 4
    assert len(results) == 40 and len(stub.received) == 40
    assert sorted(r.rcpt_tos[0] for r in stub.received) == sorted(
        f"user{n}@example.com" for n in range(40)
    )


def test_a_connection_the_server_dropped_while_idle_is_replaced_once():
    with SmtpStub(idle_timeout_s=0.3) as stub:
        provider = smtp(stub)
        provider.send(outgoing(to="first@example.com"))
        time.sleep(0.6)  # the server hangs up on the idle connection
        provider.send(outgoing(to="second@example.com"))
        provider.close()
        assert stub.connections == 2
    assert [r.rcpt_tos for r in stub.received] == [["first@example.com"], ["second@example.com"]]


def test_rate_limit_spaces_the_sends():
    with SmtpStub() as stub:
        provider = smtp(stub, rate_limit_per_s=20)
        started = time.monotonic()
        for n in range(5):
            provider.send(outgoing(to=f"user{n}@example.com"))
        elapsed = time.monotonic() - started
        provider.close()
    assert elapsed >= 0.19  # four gaps of 1/20 s
    assert len(stub.received) == 5


# ---- settings ----------------------------------------------------------------------------------


def settings(**options: str) -> ProviderSettings:
    return ProviderSettings("smtp", None, None, "a@example.com", 2.5, 3.0, dict(options))


def test_from_settings_reads_the_smtp_options():
    provider = open_provider(
        settings(
            host="smtp.example.com",
            username="mailer",
            password="pw",
            starttls="required",
            ca_file="/etc/ca.pem",
        ),
        max_connections=6,
    )
    assert isinstance(provider, SmtpProvider)
    assert (provider.host, provider.port, provider.starttls) == (
        "smtp.example.com",
        587,
        "required",
    )
    assert (provider.username, provider.password, provider.ca_file) == (
        "mailer",
        "pw",
        "/etc/ca.pem",
    )
    assert provider.timeout_s == 2.5 and provider.limiter.per_second == 3.0
    assert provider.max_connections == 6 and not provider.use_ssl
    defaults = SmtpProvider.from_settings(settings(), max_connections=1)
    assert (defaults.host, defaults.port, defaults.starttls) == ("localhost", 587, "true")
    implicit = SmtpProvider.from_settings(settings(ssl="true", starttls="no"), max_connections=1)
    assert (implicit.port, implicit.use_ssl, implicit.starttls) == (465, True, "false")
    assert SmtpProvider.from_settings(settings(port="2525"), max_connections=1).port == 2525
    for bad in ({"ssl": "maybe"}, {"port": "smtp"}, {"starttls": "sometimes"}):
        with pytest.raises(ConfigurationError):
            SmtpProvider.from_settings(settings(**bad), max_connections=1)


def test_base_url_gives_host_port_and_implicit_tls():
    def from_url(url: str, **options: str) -> SmtpProvider:
        return SmtpProvider.from_settings(
            ProviderSettings(**{**settings(**options).__dict__, "base_url": url}),
            max_connections=1,
        )

    plain = from_url("smtp://127.0.0.1:2525")
    assert (plain.host, plain.port, plain.use_ssl) == ("127.0.0.1", 2525, False)
    implicit = from_url("smtps://mail.example.com")
    assert (implicit.host, implicit.port, implicit.use_ssl) == ("mail.example.com", 465, True)
    overridden = from_url("smtp://mail.example.com:2525", host="relay.internal", port="25")
    assert (overridden.host, overridden.port) == ("relay.internal", 25)
    with pytest.raises(ConfigurationError):
        from_url("https://mail.example.com")


# ---- end to end through the send job -----------------------------------------------------------


def test_send_job_through_smtp_retries_a_451_and_dead_letters_a_550(engine, database_url):
    ids = {
        "plain": signup(engine, "u1"),
        "deferred": signup(engine, "u2", email="u2+fail451x1@example.com"),
        "unknown": signup(engine, "u3", email="u3+invalid@example.com"),
    }
    with SmtpStub() as stub:
        resource = EmailProviderResource(
            provider="smtp",
            base_url=f"smtp://127.0.0.1:{stub.port}",
            timeout_s=5.0,
            options_json=json.dumps({"starttls": "true"}),
        )
        result = run_send(
            database_url, "unused", "transactional", list(ids.values()), provider=resource
        )
    assert not result.success  # the 550 fails the run once every outcome is recorded
    assert len(step_events(result, "STEP_UP_FOR_RETRY")) == 1

    by_event = {r.message["X-Email-Event-Id"]: r for r in stub.received}
    assert sorted(by_event) == sorted([ids["plain"], ids["deferred"]])
    assert len(stub.received) == 2  # nothing doubled
    for name in ("plain", "deferred"):
        (message,) = messages_of(engine, ids[name])
        received = by_event[ids[name]]
        assert message.status == "sent" and message.provider == "smtp"
        assert received.message["X-Email-Idempotency-Key"] == message.idempotency_key
        assert received.message["Message-ID"] == message.provider_message_id
        assert received.rcpt_tos == [message.recipient]
    assert [a.outcome for a in attempts_of(engine, ids["plain"])] == ["accepted"]
    deferred = attempts_of(engine, ids["deferred"])
    assert [a.outcome for a in deferred] == ["transient", "accepted"]
    assert "451" in deferred[0].error
    # Both attempts carried the same Message-ID, so a receiver could dedupe a repeat.
    assert deferred[1].provider_message_id == by_event[ids["deferred"]].message["Message-ID"]

    assert [a.outcome for a in attempts_of(engine, ids["unknown"])] == ["permanent"]
    (letter,) = dead_letters_of(engine, ids["unknown"])
    assert (letter.reason, letter.error_code, letter.status) == (
        "provider_rejected",
        "smtp_550",
        "open",
    )
    assert "5.1.1" in letter.last_error
    assert messages_of(engine, ids["unknown"])[0].status == "dead"
