"""The SendGrid adapter speaks Mail Send v3 exactly as documented, and classifies each documented
answer: the request is pinned field by field against SendGrid's documented shape (MockTransport),
each error response maps to transient (with the ``X-RateLimit-Reset`` wait) or permanent (with
SendGrid's field and message), and the real send job runs end to end against a local SendGrid
stand-in on SQLite and PostgreSQL: good mail sent, a 429 and a 503 retried once, an invalid
recipient dead-lettered, ``event_id`` / ``idempotency_key`` in ``custom_args``, nothing doubled.
"""

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from email_platform.common.config import ProviderSettings
from email_platform.common.errors import (
    ConfigurationError,
    PermanentError,
    ProviderRejectedError,
    TransientError,
)
from email_platform.providers.base import Accepted, OutgoingEmail
from email_platform.providers.registry import open_provider
from email_platform.providers.sendgrid import (
    DEFAULT_BASE_URL,
    SendGridProvider,
    retry_after_from_reset,
)
from email_platform.resources import EmailProviderResource
from email_platform.sandbox.asgi import BackgroundServer
from tests.provider_stubs.sendgrid import INVALID_TO, SendGridStub
from tests.support import (
    attempts_of,
    dead_letters_of,
    event,
    messages_of,
    run_send,
    signup,
    step_events,
)

API_KEY = "SG.test-key"
EVENT_ID = "01JDQ8Z5Y2K3M4N5P6Q7R8S9T0"
KEY = f"{EVENT_ID}:welcome"
EMAIL = OutgoingEmail(
    message_id=7,
    event_id=EVENT_ID,
    idempotency_key=KEY,
    sender="Example <no-reply@example.com>",
    to="jane@example.com",
    subject="Welcome, Jane",
    text="Hi Jane",
    html="<p>Hi Jane</p>",
    template="welcome",
    lane="transactional",
    headers={"X-Email-Event-Id": EVENT_ID},
)


def provider_answering(
    handler: Callable[[httpx.Request], httpx.Response],
    base_url: str = DEFAULT_BASE_URL,
    **kwargs: Any,
) -> SendGridProvider:
    return SendGridProvider(
        base_url,
        api_key=API_KEY,
        transport=httpx.MockTransport(handler),
        **kwargs,
    )


def answer(status: int, body: object = None, headers: dict | None = None):  # type: ignore[no-untyped-def]
    """A MockTransport handler that records requests and answers one fixed response."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if isinstance(body, (dict, list)):
            return httpx.Response(status, json=body, headers=headers)
        return httpx.Response(status, content=(body or "").encode(), headers=headers)

    handler.seen = seen  # type: ignore[attr-defined]
    return handler


ACCEPTED_202 = {"X-Message-Id": "W86EgYT6SQKk0lRflfLRsA"}

# ---- the request, as documented ----------------------------------------------------------------


def test_request_is_the_documented_mail_send_call():
    handler = answer(202, headers=ACCEPTED_202)
    result = provider_answering(handler).send(EMAIL)
    assert result == Accepted("W86EgYT6SQKk0lRflfLRsA", 202)
    (request,) = handler.seen
    assert request.method == "POST"
    assert str(request.url) == "https://api.sendgrid.com/v3/mail/send"
    assert request.headers["authorization"] == "Bearer SG.test-key"
    assert request.headers["content-type"] == "application/json"
    metadata = {"event_id": EVENT_ID, "idempotency_key": KEY}
    assert json.loads(request.content) == {
        # Once, at the message level, as SendGrid's SDK sends them (test_provider_sdk_conformance).
        "personalizations": [{"to": [{"email": "jane@example.com"}]}],
        "from": {"email": "no-reply@example.com", "name": "Example"},
        "subject": "Welcome, Jane",
        "content": [
            {"type": "text/plain", "value": "Hi Jane"},
            {"type": "text/html", "value": "<p>Hi Jane</p>"},
        ],
        "headers": {"X-Email-Event-Id": EVENT_ID},
        "categories": ["welcome"],
        "custom_args": metadata,
    }
    # SendGrid documents no idempotency header: none is invented.
    assert not [h for h in request.headers if "idempotency" in h.lower()]


def test_text_only_mail_from_a_bare_address():
    handler = answer(202, headers=ACCEPTED_202)
    email = OutgoingEmail(
        **{**EMAIL.__dict__, "sender": "no-reply@example.com", "html": None, "headers": {}}
    )
    provider_answering(handler).send(email)
    body = json.loads(handler.seen[0].content)
    assert body["from"] == {"email": "no-reply@example.com"}
    assert body["content"] == [{"type": "text/plain", "value": "Hi Jane"}]
    assert "headers" not in body


@pytest.mark.parametrize(
    "base_url", ["http://127.0.0.1:9", "http://127.0.0.1:9/", "http://127.0.0.1:9/v3"]
)
def test_base_url_override_with_or_without_version(base_url):
    handler = answer(202, headers=ACCEPTED_202)
    provider_answering(handler, base_url=base_url).send(EMAIL)
    assert str(handler.seen[0].url) == "http://127.0.0.1:9/v3/mail/send"


def test_custom_args_over_10000_bytes_fail_permanently_without_a_request():
    handler = answer(202, headers=ACCEPTED_202)
    email = OutgoingEmail(**{**EMAIL.__dict__, "idempotency_key": "k" * 10_000})
    with pytest.raises(PermanentError) as raised:
        provider_answering(handler).send(email)
    assert raised.value.code == "custom_args_too_large"
    assert handler.seen == []


# ---- every documented answer, classified ------------------------------------------------------


def errors(*items: tuple[str | None, str]) -> dict:
    return {"errors": [{"message": m, "field": f, "help": None} for f, m in items]}


@pytest.mark.parametrize(
    ("status", "body", "code", "message"),
    [
        (400, errors(("personalizations.0.to", INVALID_TO)), "personalizations.0.to", INVALID_TO),
        (
            400,
            errors(
                ("from.email", "The from email does not contain a valid address."),
                ("subject", "The subject is required."),
            ),
            "from.email",
            "The from email does not contain a valid address.; The subject is required.",
        ),
        (
            401,
            errors((None, "The provided authorization grant is invalid, expired, or revoked")),
            "unauthorized",
            "The provided authorization grant is invalid, expired, or revoked",
        ),
        (403, errors((None, "access forbidden")), "forbidden", "access forbidden"),
        (
            413,
            errors((None, "The JSON payload you have included in your request is too large.")),
            "request_entity_too_large",
            "The JSON payload you have included in your request is too large.",
        ),
    ],
)
def test_documented_4xx_are_permanent_with_field_and_message(status, body, code, message):
    with pytest.raises(ProviderRejectedError) as raised:
        provider_answering(answer(status, body)).send(EMAIL)
    error = raised.value
    assert (error.status_code, error.code, error.reason) == (status, code, "provider_rejected")
    assert str(error) == f"HTTP {status}: {message}"


def test_429_waits_until_x_ratelimit_reset():
    reset = str(int(time.time()) + 30)
    headers = {"X-RateLimit-Limit": "600", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": reset}
    with pytest.raises(TransientError) as raised:
        provider_answering(answer(429, errors((None, "too many requests")), headers)).send(EMAIL)
    error = raised.value
    assert error.status_code == 429 and error.code == "too_many_requests"
    assert "too many requests" in str(error)
    assert 28.0 <= error.retry_after_s <= 30.0


def test_retry_after_wins_over_the_reset_header():
    headers = {"Retry-After": "7", "X-RateLimit-Reset": str(int(time.time()) + 60)}
    with pytest.raises(TransientError) as raised:
        provider_answering(answer(429, errors((None, "too many requests")), headers)).send(EMAIL)
    assert raised.value.retry_after_s == 7.0


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (500, errors((None, "internal server error"))),
        (503, "<html><body>503 Service Unavailable</body></html>"),
    ],
)
def test_5xx_is_transient_without_a_wait(status, body):
    with pytest.raises(TransientError) as raised:
        provider_answering(answer(status, body)).send(EMAIL)
    assert raised.value.status_code == status
    assert raised.value.retry_after_s is None


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (httpx.ReadTimeout("timed out"), "timeout"),
        (httpx.ConnectTimeout("timed out"), "timeout"),
        (httpx.ConnectError("connection refused"), "network"),
        (httpx.RemoteProtocolError("server disconnected"), "network"),
    ],
)
def test_timeouts_and_connection_errors_are_transient(exc, code):
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    with pytest.raises(TransientError) as raised:
        provider_answering(handler).send(EMAIL)
    assert raised.value.code == code


def test_202_without_message_id_is_still_accepted_never_resent():
    assert provider_answering(answer(202)).send(EMAIL) == Accepted("", 202)


def test_200_without_message_id_is_not_sendgrid_and_is_retried():
    with pytest.raises(TransientError) as raised:
        provider_answering(answer(200, "<html>captive portal</html>")).send(EMAIL)
    assert raised.value.code == "unreadable_response"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1392815263", 37.0),  # SendGrid's documented epoch-seconds form
        ("1392815200", 0.0),  # already past
        ("1392999999", 300.0),  # capped
        ("12", 12.0),  # a delta, not an epoch
        ("soon", None),
        (None, None),
        ("", None),
    ],
)
def test_x_ratelimit_reset_is_read_as_epoch_seconds(value, expected):
    assert retry_after_from_reset(value, now=1392815226.0, cap_s=300.0) == expected


# ---- configuration ---------------------------------------------------------------------------


def test_from_settings_reads_environment_and_defaults_to_the_public_endpoint():
    env = {
        "EMAIL_PLATFORM_SENDGRID_API_KEY": "SG.env-key",
        "EMAIL_PLATFORM_PROVIDER_TIMEOUT_S": "3.5",
        "EMAIL_PLATFORM_PROVIDER_RATE_LIMIT_PER_S": "40",
    }
    provider = open_provider(ProviderSettings.from_env(env, provider="sendgrid"), max_connections=4)
    assert isinstance(provider, SendGridProvider)
    assert provider.base_url == "https://api.sendgrid.com"
    assert provider.client.headers["authorization"] == "Bearer SG.env-key"
    assert provider.client.timeout.read == 3.5
    assert provider.limiter.per_second == 40.0
    provider.close()

    eu = {**env, "EMAIL_PLATFORM_SENDGRID_BASE_URL": "https://api.eu.sendgrid.com/"}
    provider = open_provider(ProviderSettings.from_env(eu, provider="sendgrid"), max_connections=1)
    assert provider.base_url == "https://api.eu.sendgrid.com"
    provider.close()


def test_missing_api_key_is_a_configuration_error():
    with pytest.raises(ConfigurationError, match="EMAIL_PLATFORM_SENDGRID_API_KEY"):
        open_provider(ProviderSettings.from_env({}, provider="sendgrid"), max_connections=1)


def test_rate_limit_spaces_the_calls():
    handler = answer(202, headers=ACCEPTED_202)
    provider = provider_answering(handler, rate_limit_per_s=20)
    started = time.monotonic()
    for _ in range(5):
        provider.send(EMAIL)
    assert time.monotonic() - started >= 0.19  # 5 calls at 20/s: 4 gaps of 50 ms
    assert len(handler.seen) == 5


# ---- end to end through the send job -----------------------------------------------------------

LANES = {"transactional": {"retry_delay_s": 0.01, "max_retries": 3}}


@pytest.fixture
def sendgrid():  # type: ignore[no-untyped-def]
    stub = SendGridStub(API_KEY, reset_in_s=0.5)
    with BackgroundServer(stub.app) as url:
        yield stub, url


def test_send_job_through_sendgrid(engine, database_url, sendgrid):
    stub, url = sendgrid
    good = signup(engine, "u1")
    limited = signup(engine, "u2", email="u2+fail429x1@example.com")
    flaky = signup(engine, "u3", email="u3+fail503x1@example.com")
    invalid = signup(engine, "u4", email="u4+invalid@example.com")
    provider = EmailProviderResource(
        provider="sendgrid", base_url=url, api_key=API_KEY, sender="Example <no-reply@example.com>"
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

    # Accepted exactly once each, with the metadata SendGrid's webhooks will echo back.
    by_event = {a["body"]["custom_args"]["event_id"]: a for a in stub.accepted}
    assert len(stub.accepted) == 3 and set(by_event) == {good, limited, flaky}
    for event_id in (good, limited, flaky):
        (message,) = messages_of(engine, event_id)
        seen = by_event[event_id]
        assert message.status == "sent"
        assert message.provider_message_id == seen["message_id"]
        metadata = {"event_id": event_id, "idempotency_key": message.idempotency_key}
        assert "custom_args" not in seen["body"]["personalizations"][0]
        assert seen["body"]["custom_args"] == metadata
        assert seen["body"]["from"] == {"email": "no-reply@example.com", "name": "Example"}
        assert event(engine, event_id).status == "done"
    assert [a.outcome for a in attempts_of(engine, good)] == ["accepted"]

    limited_tries = attempts_of(engine, limited)
    assert [(a.outcome, a.http_status) for a in limited_tries] == [
        ("transient", 429),
        ("accepted", 202),
    ]
    wait = limited_tries[0].retry_after_s
    assert 0.0 < wait <= 1.5  # read from X-RateLimit-Reset
    gap = (limited_tries[1].started_at - limited_tries[0].finished_at).total_seconds()
    assert gap >= wait - 0.05
    assert [(a.outcome, a.http_status) for a in attempts_of(engine, flaky)] == [
        ("transient", 503),
        ("accepted", 202),
    ]

    (message,) = messages_of(engine, invalid)
    assert message.status == "dead"
    assert [a.outcome for a in attempts_of(engine, invalid)] == ["permanent"]
    (letter,) = dead_letters_of(engine, invalid)
    assert (letter.reason, letter.error_code) == ("provider_rejected", "personalizations.0.to")
    assert INVALID_TO in letter.last_error

    # Every request carried its key; only the two transient failures were sent twice.
    sent = [r["body"]["custom_args"]["event_id"] for r in stub.requests]
    assert sorted(sent) == sorted([good, limited, limited, flaky, flaky, invalid])
    assert all(r["headers"]["authorization"] == f"Bearer {API_KEY}" for r in stub.requests)
