"""The Mailgun adapter speaks the Messages API exactly as documented, and classifies each
documented answer: the request is pinned (URL with the domain, basic auth ``api:<key>``, every
form field including ``o:tag``, ``h:`` headers and ``v:`` variables) with MockTransport, each
error response maps to transient (with ``Retry-After``) or permanent (with Mailgun's message),
configuration refuses a missing key or domain, and the real send job runs end to end against a
local Mailgun stand-in on SQLite and PostgreSQL: good mail sent, a 429 and a 503 retried once,
an invalid recipient dead-lettered, ``v:event_id`` / ``v:idempotency_key`` received, nothing
doubled.
"""

import base64
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl

import httpx
import pytest

from email_platform.common.config import ProviderSettings
from email_platform.common.errors import ConfigurationError, ProviderRejectedError, TransientError
from email_platform.providers.base import Accepted, OutgoingEmail
from email_platform.providers.mailgun import MailgunProvider
from email_platform.providers.registry import open_provider
from email_platform.resources import EmailProviderResource
from email_platform.sandbox.asgi import BackgroundServer
from tests.provider_stubs.mailgun import INVALID_TO, MailgunStub
from tests.support import (
    attempts_of,
    dead_letters_of,
    event,
    messages_of,
    run_send,
    signup,
    step_events,
)

API_KEY = "key-test"
DOMAIN = "mg.example.com"
EVENT_ID = "01JDQ8Z5Y2K3M4N5P6Q7R8S9T0"
KEY = f"{EVENT_ID}:welcome"
EMAIL = OutgoingEmail(
    message_id=7,
    event_id=EVENT_ID,
    idempotency_key=KEY,
    sender="Example <no-reply@mg.example.com>",
    to="jane@example.com",
    subject="Welcome, Jane",
    text="Hi Jane",
    html="<p>Hi Jane</p>",
    template="welcome",
    lane="transactional",
    headers={"X-Email-Event-Id": EVENT_ID},
)
QUEUED = {"id": "<20260101120000.1.5A7C3E@mg.example.com>", "message": "Queued. Thank you."}


def provider_answering(
    handler: Callable[[httpx.Request], httpx.Response],
    base_url: str = "https://api.mailgun.net",
    **kwargs: Any,
) -> MailgunProvider:
    return MailgunProvider(
        base_url,
        api_key=API_KEY,
        domain=DOMAIN,
        transport=httpx.MockTransport(handler),
        **kwargs,
    )


def answer(status: int, body: object = None, headers: dict | None = None):  # type: ignore[no-untyped-def]
    """A MockTransport handler that records requests and answers one fixed response."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if isinstance(body, dict):
            return httpx.Response(status, json=body, headers=headers)
        return httpx.Response(status, content=(body or "").encode(), headers=headers)

    handler.seen = seen  # type: ignore[attr-defined]
    return handler


# ---- the request, as documented ----------------------------------------------------------------


def test_request_is_the_documented_messages_call():
    handler = answer(200, QUEUED)
    result = provider_answering(handler).send(EMAIL)
    # Stored without angle brackets: the form Mailgun's webhooks report.
    assert result == Accepted("20260101120000.1.5A7C3E@mg.example.com", 200)
    (request,) = handler.seen
    assert request.method == "POST"
    assert str(request.url) == "https://api.mailgun.net/v3/mg.example.com/messages"
    credentials = base64.b64encode(b"api:key-test").decode()
    assert request.headers["authorization"] == f"Basic {credentials}"
    assert request.headers["content-type"] == "application/x-www-form-urlencoded"
    assert parse_qsl(request.content.decode(), keep_blank_values=True) == [
        ("from", "Example <no-reply@mg.example.com>"),
        ("to", "jane@example.com"),
        ("subject", "Welcome, Jane"),
        ("text", "Hi Jane"),
        ("html", "<p>Hi Jane</p>"),
        ("o:tag", "welcome"),
        ("h:X-Email-Event-Id", EVENT_ID),
        ("v:event_id", EVENT_ID),
        ("v:idempotency_key", KEY),
    ]
    # Mailgun documents no idempotency header for sends: none is invented.
    assert not [h for h in request.headers if "idempotency" in h.lower()]


def test_text_only_mail_has_no_html_field():
    handler = answer(200, QUEUED)
    provider_answering(handler).send(OutgoingEmail(**{**EMAIL.__dict__, "html": None}))
    fields = dict(parse_qsl(handler.seen[0].content.decode()))
    assert "html" not in fields and fields["text"] == "Hi Jane"


@pytest.mark.parametrize(
    "base_url",
    ["https://api.eu.mailgun.net", "https://api.eu.mailgun.net/", "https://api.eu.mailgun.net/v3"],
)
def test_eu_base_url_with_or_without_version(base_url):
    handler = answer(200, QUEUED)
    provider_answering(handler, base_url=base_url).send(EMAIL)
    assert str(handler.seen[0].url) == "https://api.eu.mailgun.net/v3/mg.example.com/messages"


# ---- every documented answer, classified ------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "body", "code", "message"),
    [
        (400, {"message": INVALID_TO}, "bad_request", INVALID_TO),
        (
            400,
            {"message": "'from' parameter is missing"},
            "bad_request",
            "'from' parameter is missing",
        ),
        (401, "Forbidden", "unauthorized", "Forbidden"),
        (403, {"message": "Invalid private key"}, "forbidden", "Invalid private key"),
        (
            404,
            {"message": "Domain not found: mg.example.com"},
            "not_found",
            "Domain not found: mg.example.com",
        ),
    ],
)
def test_documented_4xx_are_permanent_with_mailguns_message(status, body, code, message):
    with pytest.raises(ProviderRejectedError) as raised:
        provider_answering(answer(status, body)).send(EMAIL)
    error = raised.value
    assert (error.status_code, error.code, error.reason) == (status, code, "provider_rejected")
    assert str(error) == f"HTTP {status}: {message}"


def test_429_honours_retry_after():
    with pytest.raises(TransientError) as raised:
        provider_answering(
            answer(429, {"message": "Too many requests"}, {"Retry-After": "12"})
        ).send(EMAIL)
    error = raised.value
    assert (error.status_code, error.code, error.retry_after_s) == (429, "too_many_requests", 12.0)
    assert "Too many requests" in str(error)


def test_429_without_retry_after_leaves_the_wait_to_backoff():
    with pytest.raises(TransientError) as raised:
        provider_answering(answer(429, {"message": "Too many requests"})).send(EMAIL)
    assert raised.value.retry_after_s is None


@pytest.mark.parametrize(
    ("status", "body"),
    [(500, {"message": "Internal Server Error"}), (502, "<html>Bad Gateway</html>"), (503, "")],
)
def test_5xx_is_transient(status, body):
    with pytest.raises(TransientError) as raised:
        provider_answering(answer(status, body)).send(EMAIL)
    assert raised.value.status_code == status


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (httpx.ReadTimeout("timed out"), "timeout"),
        (httpx.ConnectError("connection refused"), "network"),
    ],
)
def test_timeouts_and_connection_errors_are_transient(exc, code):
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    with pytest.raises(TransientError) as raised:
        provider_answering(handler).send(EMAIL)
    assert raised.value.code == code


@pytest.mark.parametrize("body", ["<html>welcome to the proxy</html>", {"message": "ok"}])
def test_200_without_an_id_is_not_mailgun_and_is_retried(body):
    with pytest.raises(TransientError) as raised:
        provider_answering(answer(200, body)).send(EMAIL)
    assert raised.value.code == "unreadable_response"


# ---- configuration ---------------------------------------------------------------------------

ENV = {"EMAIL_PLATFORM_MAILGUN_API_KEY": "key-env", "EMAIL_PLATFORM_MAILGUN_DOMAIN": DOMAIN}


def open_mailgun(env: dict) -> MailgunProvider:
    provider = open_provider(ProviderSettings.from_env(env, provider="mailgun"), max_connections=2)
    assert isinstance(provider, MailgunProvider)
    return provider


def test_from_settings_reads_key_domain_and_defaults_to_the_us_endpoint():
    provider = open_mailgun(
        {
            **ENV,
            "EMAIL_PLATFORM_PROVIDER_TIMEOUT_S": "4",
            "EMAIL_PLATFORM_PROVIDER_RATE_LIMIT_PER_S": "25",
        }
    )
    assert provider.base_url == "https://api.mailgun.net"
    assert provider.path == "/v3/mg.example.com/messages"
    assert provider.client.auth is not None
    assert provider.client.timeout.read == 4.0
    assert provider.limiter.per_second == 25.0
    provider.close()


@pytest.mark.parametrize(
    ("extra", "base_url"),
    [
        (
            {"EMAIL_PLATFORM_MAILGUN_BASE_URL": "https://api.eu.mailgun.net"},
            "https://api.eu.mailgun.net",
        ),
        ({"EMAIL_PLATFORM_MAILGUN_REGION": "EU"}, "https://api.eu.mailgun.net"),
        ({"EMAIL_PLATFORM_MAILGUN_REGION": "us"}, "https://api.mailgun.net"),
        (
            {
                "EMAIL_PLATFORM_MAILGUN_REGION": "eu",
                "EMAIL_PLATFORM_MAILGUN_BASE_URL": "http://127.0.0.1:9",
            },
            "http://127.0.0.1:9",
        ),
    ],
)
def test_eu_host_by_base_url_or_region(extra, base_url):
    provider = open_mailgun({**ENV, **extra})
    assert provider.base_url == base_url
    provider.close()


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"EMAIL_PLATFORM_MAILGUN_DOMAIN": DOMAIN}, "EMAIL_PLATFORM_MAILGUN_API_KEY"),
        ({"EMAIL_PLATFORM_MAILGUN_API_KEY": "key-env"}, "EMAIL_PLATFORM_MAILGUN_DOMAIN"),
        ({**ENV, "EMAIL_PLATFORM_MAILGUN_DOMAIN": "  "}, "EMAIL_PLATFORM_MAILGUN_DOMAIN"),
        ({**ENV, "EMAIL_PLATFORM_MAILGUN_DOMAIN": "mg.example.com/x"}, "not a domain name"),
        ({**ENV, "EMAIL_PLATFORM_MAILGUN_REGION": "asia"}, "EMAIL_PLATFORM_MAILGUN_REGION"),
    ],
)
def test_missing_key_or_domain_is_a_configuration_error(env, names):
    with pytest.raises(ConfigurationError, match=names):
        open_mailgun(env)


def test_rate_limit_spaces_the_calls():
    handler = answer(200, QUEUED)
    provider = provider_answering(handler, rate_limit_per_s=20)
    started = time.monotonic()
    for _ in range(5):
        provider.send(EMAIL)
    assert time.monotonic() - started >= 0.19  # 5 calls at 20/s: 4 gaps of 50 ms
    assert len(handler.seen) == 5


# ---- end to end through the send job -----------------------------------------------------------

LANES = {"transactional": {"retry_delay_s": 0.01, "max_retries": 3}}


@pytest.fixture
def mailgun():  # type: ignore[no-untyped-def]
    stub = MailgunStub(API_KEY, DOMAIN, retry_after="1")
    with BackgroundServer(stub.app) as url:
        yield stub, url


def test_send_job_through_mailgun(engine, database_url, mailgun):
    stub, url = mailgun
    good = signup(engine, "u1")
    limited = signup(engine, "u2", email="u2+fail429x1@example.com")
    flaky = signup(engine, "u3", email="u3+fail503x1@example.com")
    invalid = signup(engine, "u4", email="u4+invalid@example.com")
    provider = EmailProviderResource(
        provider="mailgun",
        base_url=url,
        api_key=API_KEY,
        sender="Example <no-reply@mg.example.com>",
        options_json=f'{{"domain": "{DOMAIN}"}}',
    )
    result = run_send(
        database_url,
        "unused",
        "transactional",
        [good, limited, flaky, invalid],
        provider=provider,
        lanes=LANES,
    )
    assert not result.success  # the dead letter fails the run, for an operator to see
    assert len(step_events(result, "STEP_UP_FOR_RETRY")) == 1

    # Accepted exactly once each, with the user variables Mailgun's webhooks will echo back.
    by_event = {a["form"]["v:event_id"]: a for a in stub.accepted}
    assert len(stub.accepted) == 3 and set(by_event) == {good, limited, flaky}
    for event_id in (good, limited, flaky):
        (message,) = messages_of(engine, event_id)
        seen = by_event[event_id]
        assert message.status == "sent"
        assert message.provider_message_id == seen["id"]
        assert seen["form"]["v:idempotency_key"] == message.idempotency_key
        assert seen["form"]["h:X-Email-Event-Id"] == event_id
        assert seen["form"]["o:tag"] == "welcome"
        assert event(engine, event_id).status == "done"
    assert [a.outcome for a in attempts_of(engine, good)] == ["accepted"]

    limited_tries = attempts_of(engine, limited)
    assert [(a.outcome, a.http_status) for a in limited_tries] == [
        ("transient", 429),
        ("accepted", 200),
    ]
    assert limited_tries[0].retry_after_s == 1.0  # Mailgun's Retry-After
    gap = (limited_tries[1].started_at - limited_tries[0].finished_at).total_seconds()
    assert gap >= 0.95
    assert [(a.outcome, a.http_status) for a in attempts_of(engine, flaky)] == [
        ("transient", 503),
        ("accepted", 200),
    ]

    (message,) = messages_of(engine, invalid)
    assert message.status == "dead"
    assert [a.outcome for a in attempts_of(engine, invalid)] == ["permanent"]
    (letter,) = dead_letters_of(engine, invalid)
    assert (letter.reason, letter.error_code) == ("provider_rejected", "bad_request")
    assert INVALID_TO in letter.last_error

    # Every request carried its key; only the two transient failures were sent twice.
    sent = [r["form"]["v:event_id"] for r in stub.requests]
    assert sorted(sent) == sorted([good, limited, limited, flaky, flaky, invalid])
    assert all(
        r["form"]["v:idempotency_key"] == f"{r['form']['v:event_id']}:welcome"
        for r in stub.requests
    )
