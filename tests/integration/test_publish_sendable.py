"""Whatever publish() accepts, every adapter sends it or fails with a named cause.

A property over publish()'s public inputs - event types of the shipped routes, recipients with
plain, internationalized (IDN) and non-ASCII local parts, first names of any text, idempotency
keys and correlation ids of any text - published on SQLite. Each event publish() accepts is
made into the messages the send path would build (upcast, one per route, the template rendered,
the ``{key}:{route}`` idempotency key) and handed to each adapter: the sandbox, Postmark,
SendGrid, Mailgun, Resend and SES through a recording ``httpx.MockTransport`` answering as the
provider does, SMTP to a local aiosmtpd server. Each must accept it (the key carried exactly
where the provider takes one) or raise a ``DeliveryError`` with a code; nothing may become an
``unexpected`` dead letter (``classify.classify_exception`` of an unclassified exception).
publish() refusing is an answer too, as long as it is a ``PublishError`` naming a field.

IDN domains are exercised by their own cases for every adapter (SMTP sends A-labels or uses
SMTPUTF8, SES sends Punycode as AWS's SES v2 model asks); an adapter in ``IDN_PENDING`` would
have them as strict xfails and draw ASCII domains in the property.
"""

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from botocore.credentials import Credentials
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, select

from email_platform import publish
from email_platform.common.classify import classify_exception
from email_platform.common.errors import DeliveryError, PublishError, TemplateRenderError
from email_platform.db.engine import make_engine, upgrade
from email_platform.db.schema import email_outbox
from email_platform.mail import locales
from email_platform.mail.rendering import TemplateRenderer
from email_platform.mail.routes import default_routes
from email_platform.providers.base import Accepted, EmailProvider, OutgoingEmail
from email_platform.providers.mailgun import MailgunProvider
from email_platform.providers.postmark import PostmarkProvider
from email_platform.providers.resend import ResendProvider
from email_platform.providers.sandbox import SandboxProvider
from email_platform.providers.sendgrid import SendGridProvider
from email_platform.providers.ses import SesProvider
from email_platform.providers.smtp import SmtpProvider
from tests.provider_stubs.smtp import SmtpStub

ROUTES = default_routes()
RENDERER = TemplateRenderer()
SENDER = "Example <no-reply@example.com>"
ADAPTERS = ("sandbox", "postmark", "sendgrid", "mailgun", "resend", "ses", "smtp")
#: Adapters whose IDN handling is being fixed on another branch (none now: every adapter
#: sends an internationalized domain; kept for the next one).
IDN_PENDING: frozenset[str] = frozenset()

ASCII_DOMAINS = ["example.com", "mail.example.org", "xn--bcher-kva.de", "a-b.co.uk"]
IDN_DOMAINS = ["bücher.de", "例え.jp", "münchen.de", "παράδειγμα.gr"]


# ---- the adapters, each on a recording transport that answers as its provider -----------------


@dataclass
class Recording:
    """What an HTTP adapter put on the wire."""

    requests: list[httpx.Request] = field(default_factory=list)
    #: Requests the provider's own rules would refuse, with why (SES: AWS's model).
    violations: list[str] = field(default_factory=list)


def _answer(name: str, recording: Recording) -> Callable[[httpx.Request], httpx.Response]:
    def handler(request: httpx.Request) -> httpx.Response:
        recording.requests.append(request)
        if name == "sendgrid":
            return httpx.Response(202, headers={"X-Message-Id": "sg1"})
        if name == "postmark":
            return httpx.Response(200, json={"ErrorCode": 0, "Message": "OK", "MessageID": "pm1"})
        if name == "mailgun":
            return httpx.Response(200, json={"id": "<mg1@mg.example.com>", "message": "Queued"})
        if name == "ses":
            body = json.loads(request.content)
            for address in body["Destination"]["ToAddresses"]:
                if not address.isascii():  # the model: IDN domains in Punycode
                    recording.violations.append(f"SES destination not ASCII: {address!r}")
            return httpx.Response(200, json={"MessageId": "ses1"})
        return httpx.Response(200, json={"id": f"{name}1"})

    return handler


def _http_adapter(name: str, recording: Recording) -> EmailProvider:
    transport = httpx.MockTransport(_answer(name, recording))
    if name == "sandbox":
        return SandboxProvider("http://sandbox.test", transport=transport)
    if name == "postmark":
        return PostmarkProvider(server_token="pm-token", transport=transport)
    if name == "sendgrid":
        return SendGridProvider(api_key="SG.key", transport=transport)
    if name == "mailgun":
        return MailgunProvider(api_key="key", domain="mg.example.com", transport=transport)
    if name == "resend":
        return ResendProvider(api_key="re_key", transport=transport)
    return SesProvider(credentials=Credentials("AKIDEXAMPLE", "secret"), transport=transport)


@pytest.fixture(scope="module")
def smtp_server() -> Iterator[SmtpStub]:
    with SmtpStub() as stub:
        yield stub


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    path: Path = tmp_path_factory.mktemp("sendable") / "outbox.sqlite3"
    made = make_engine(f"sqlite:///{path}")
    upgrade(made)
    yield made
    made.dispose()


@dataclass
class Harness:
    name: str
    provider: EmailProvider
    recording: Recording
    smtp: SmtpStub | None = None

    def received(self) -> int:
        return len(self.smtp.received) if self.smtp else len(self.recording.requests)


@pytest.fixture(params=ADAPTERS)
def adapter(request: pytest.FixtureRequest, smtp_server: SmtpStub) -> Iterator[Harness]:
    name: str = request.param
    recording = Recording()
    if name == "smtp":
        harness = Harness(
            name, SmtpProvider("127.0.0.1", smtp_server.port, timeout_s=5.0), recording, smtp_server
        )
    else:
        harness = Harness(name, _http_adapter(name, recording), recording)
    yield harness
    harness.provider.close()


# ---- from publish() to the adapter -------------------------------------------------------------


def _published(engine: Engine, kwargs: dict[str, Any]) -> list[OutgoingEmail] | None:
    """The messages the send path builds from the event, or None when publish() refused it
    (with a ``PublishError`` naming a field: any other exception fails the test)."""
    with engine.connect() as connection:
        transaction = connection.begin()
        try:
            try:
                event_id = publish(connection, **kwargs)
            except PublishError as refused:
                assert refused.field, "a refusal names its field"
                return None
            row = connection.execute(
                select(email_outbox).where(email_outbox.c.event_id == event_id)
            ).one()
        finally:
            transaction.rollback()
    version, payload = ROUTES.upcast(row.event_type, row.event_version, dict(row.payload))
    emails = []
    for route in ROUTES.for_event(row.event_type, version):
        try:
            version = RENDERER.latest_version(route.template)
            locale = locales.used_for(RENDERER, route, payload, version)
            rendered = RENDERER.render(route.template, version, payload, locale)
        except TemplateRenderError:
            continue  # dead-lettered as template_error: a named cause, not the adapter's
        emails.append(
            OutgoingEmail(
                message_id=1,
                event_id=row.event_id,
                idempotency_key=f"{row.idempotency_key or row.event_id}:{route.name}",
                sender=SENDER,
                to=payload[route.recipient_field or "email"],
                subject=rendered.subject,
                text=rendered.text,
                html=rendered.html,
                template=route.template,
                lane=row.lane,
                headers={"X-Email-Event-Id": row.event_id},
                trace_id=row.trace_id,
                correlation_id=row.correlation_id,
            )
        )
    return emails


def _sends_or_names_the_cause(harness: Harness, email: OutgoingEmail) -> Accepted | DeliveryError:
    before = harness.received()
    try:
        result: Accepted | DeliveryError = harness.provider.send(email)
    except Exception as exc:  # what the send path would classify and dead-letter
        error = classify_exception(exc)
        assert error.code != "unexpected", f"{harness.name}: {error} for {email.to!r}"
        return error
    assert harness.received() == before + 1, "sent exactly once"
    assert not harness.recording.violations, harness.recording.violations
    if harness.name in ("sandbox", "resend"):  # the providers that honour the key
        assert harness.recording.requests[-1].headers["Idempotency-Key"] == email.idempotency_key
    return result


# ---- the strategies: publish()'s public inputs ---------------------------------------------------

_any_text = st.text(max_size=40)
_VISIBLE = "".join(chr(code) for code in range(0x21, 0x7F))
#: Ids as callers make them: mostly visible ASCII, with the characters that broke adapters mixed
#: in (non-ASCII, a space, a tab, an encoded-word start), and the limits.
_ids = st.one_of(
    st.text(st.sampled_from(_VISIBLE), min_size=1, max_size=200),
    st.text(st.sampled_from(_VISIBLE + "éü漢 \t"), min_size=1, max_size=210),
    st.sampled_from(["clé", "order 7781", "=?utf-8?q?k?=", "k" * 200, "k" * 201]),
    _any_text,
)
_local = st.one_of(
    st.from_regex(r"[a-z][a-z0-9._+-]{0,15}", fullmatch=True),
    st.text(st.sampled_from("aäöüéñß漢字ж"), min_size=1, max_size=8),  # non-ASCII local parts
)


#: The welcome route's payload locale: tags in any case and separator, and what is not one.
_locale_values = st.one_of(
    st.sampled_from(["pt-BR", "pt_br", "PT", "pt-PT", "zh-Hant-TW", "en", "", None]),
    st.sampled_from(["pt-BR\r\nBcc: x@example.com", "pt/../../etc", "ptèBR", "p" * 40, 7]),
    _any_text,
)


def _inputs(domains: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    recipient = st.builds(
        lambda local, domain: f"{local}@{domain}", _local, st.sampled_from(domains)
    )
    payload = st.fixed_dictionaries(
        {
            "email": recipient,
            "first_name": st.one_of(st.sampled_from(["Jane", "Zoë", "李雷", "Ōkubo"]), _any_text),
            "user_id": st.from_regex(r"u[0-9]{1,6}", fullmatch=True),
            "order_id": st.one_of(st.just("A-1001"), _any_text),
            "currency": st.just("EUR"),
            "total": st.just(12.5),
            "items": st.just([{"name": "Tea", "quantity": 1, "unit_price": 12.5}]),
            "highlights": st.lists(_any_text, max_size=2),
        },
        optional={"locale": _locale_values},
    )
    return st.fixed_dictionaries(
        {
            "event_type": st.sampled_from(["user.signed_up", "order.paid", "digest.ready"]),
            "aggregate_id": st.from_regex(r"agg_[a-z0-9]{1,8}", fullmatch=True),
            "payload": payload,
        },
        optional={
            "idempotency_key": _ids,
            "correlation_id": _ids,
            "trace_id": st.just("4bf92f3577b34da6a3ce929d0e0e4736"),
        },
    )


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_whatever_publish_accepts_each_adapter_sends_or_names_the_cause(
    engine: Engine, adapter: Harness, data: st.DataObject
) -> None:
    domains = ASCII_DOMAINS if adapter.name in IDN_PENDING else ASCII_DOMAINS + IDN_DOMAINS
    emails = _published(engine, data.draw(_inputs(domains)))
    for email in emails or []:
        _sends_or_names_the_cause(adapter, email)


# ---- internationalized domains: sent by every adapter -------------------------------------------


def _idn_case(name: str) -> Any:
    marks = []
    if name in IDN_PENDING:
        marks.append(pytest.mark.xfail(strict=True, reason="IDN pending elsewhere"))
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", [_idn_case(name) for name in ADAPTERS])
@pytest.mark.parametrize("domain", ["bücher.de", "例え.jp"])
def test_an_internationalized_domain_publish_accepts_is_sent(
    engine: Engine, smtp_server: SmtpStub, name: str, domain: str
) -> None:
    recording = Recording()
    if name == "smtp":
        provider: EmailProvider = SmtpProvider("127.0.0.1", smtp_server.port, timeout_s=5.0)
        harness = Harness(name, provider, recording, smtp_server)
    else:
        harness = Harness(name, _http_adapter(name, recording), recording)
    payload = {"email": f"jane@{domain}", "first_name": "Jane", "user_id": "u1"}
    (email,) = _published(
        engine, {"event_type": "user.signed_up", "aggregate_id": "u1", "payload": payload}
    ) or [None]
    assert email is not None, "publish() accepts an internationalized domain"
    try:
        assert isinstance(_sends_or_names_the_cause(harness, email), Accepted)
    finally:
        harness.provider.close()


# ---- Postmark's metadata limit ------------------------------------------------------------


def test_postmark_metadata_stays_within_postmark_limits(engine: Engine) -> None:
    recording = Recording()
    provider = _http_adapter("postmark", recording)
    payload = {"email": "jane@example.com", "first_name": "Jane", "user_id": "u1"}
    (email,) = _published(
        engine,
        {
            "event_type": "user.signed_up",
            "aggregate_id": "u1",
            "payload": payload,
            "idempotency_key": "k" * 200,  # publish() accepts it: its column holds 200
        },
    ) or [None]
    assert email is not None
    provider.send(email)
    provider.close()
    metadata = json.loads(recording.requests[-1].content)["Metadata"]
    assert all(len(str(value)) <= 80 for value in metadata.values())
