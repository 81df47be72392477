"""The Resend adapter speaks Resend's documented send-email API and maps each answer correctly.

* Wire format (``httpx.MockTransport``): the exact request of a representative message, the
  shape of Resend's documented ``POST /emails`` example (Bearer auth, ``Idempotency-Key``
  carrying the exact key, lower-case body with ``to`` as a list, ``tags`` carrying
  ``event_id`` and the idempotency key sanitized to Resend's tag alphabet).
* Classification of every documented error name: validation, auth, not-found, idempotency
  misuse and quota errors are permanent with the name kept; ``rate_limit_exceeded`` (honouring
  ``retry-after``, else ``ratelimit-reset``), ``concurrent_idempotent_requests`` and 5xx are
  transient; timeouts and connection errors are transient.
* ``from_settings`` reads base URL and key and refuses a missing key.
* Over HTTP against a local stub of the API: a repeated key gets the first answer and creates
  nothing (the accepted window is closed), a changed payload under the same key is rejected.
* End to end through the real send job, on SQLite and PostgreSQL: one message sent, one
  retried after a 429 honouring ``retry-after``, one dead-lettered with ``validation_error``,
  one dead-lettered at once on ``daily_quota_exceeded``, nothing accepted twice.
"""

import json
from collections.abc import Callable, Iterator

import httpx
import pytest
from sqlalchemy import Engine

from email_platform.common.config import ProviderSettings
from email_platform.common.errors import ConfigurationError, ProviderRejectedError, TransientError
from email_platform.common.tags import tag_value
from email_platform.providers.base import Accepted, OutgoingEmail
from email_platform.providers.registry import open_provider
from email_platform.providers.resend import DEFAULT_BASE_URL, ResendProvider
from email_platform.resources import EmailProviderResource
from email_platform.sandbox.asgi import BackgroundServer
from tests.provider_stubs.resend import ResendStub
from tests.support import (
    attempts_of,
    dead_letters_of,
    event,
    messages_of,
    run_send,
    signup,
    step_events,
)

API_KEY = "re_123456789_test"
EVENT_ID = "01JDQ7YV6M8X3N2K4P5R6S7T8V"
KEY = f"{EVENT_ID}:welcome"
EMAIL = OutgoingEmail(
    message_id=7,
    event_id=EVENT_ID,
    idempotency_key=KEY,
    sender="Acme <onboarding@resend.dev>",
    to="delivered@resend.dev",
    subject="hello world",
    text="it works!",
    html="<p>it works!</p>",
    template="welcome",
    lane="transactional",
    headers={"X-Email-Event-Id": EVENT_ID},
)
# Resend's documented answer to POST /emails.
DOCUMENTED_OK = {"id": "49a3999c-0ce1-4ea6-ab68-afcd6dc2e794"}
# Set by httpx itself on every request; everything else is the adapter's doing.
Handler = Callable[[httpx.Request], httpx.Response]
TRANSPORT_HEADERS = {"host", "accept-encoding", "connection", "user-agent", "content-length"}


def _provider(handler: Handler, base_url: str = DEFAULT_BASE_URL) -> ResendProvider:
    return ResendProvider(base_url, api_key=API_KEY, transport=httpx.MockTransport(handler))


def _capture(answer: httpx.Response | None = None) -> tuple[list[httpx.Request], Handler]:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answer if answer is not None else httpx.Response(200, json=DOCUMENTED_OK)

    return seen, handler


# --- wire format -------------------------------------------------------------------------------


def test_request_is_resends_documented_send_email_call() -> None:
    seen, handler = _capture()
    result = _provider(handler).send(EMAIL)
    assert result == Accepted("49a3999c-0ce1-4ea6-ab68-afcd6dc2e794", 200)
    (request,) = seen
    assert request.method == "POST"
    assert str(request.url) == "https://api.resend.com/emails"
    assert {k: v for k, v in request.headers.items() if k not in TRANSPORT_HEADERS} == {
        "accept": "*/*",
        "authorization": f"Bearer {API_KEY}",
        "content-type": "application/json",
        "idempotency-key": KEY,  # exactly the recorded key, colon and all
    }
    assert json.loads(request.content) == {
        "from": "Acme <onboarding@resend.dev>",
        "to": ["delivered@resend.dev"],
        "subject": "hello world",
        "text": "it works!",
        "html": "<p>it works!</p>",
        "headers": {"X-Email-Event-Id": EVENT_ID},
        "tags": [
            {"name": "event_id", "value": EVENT_ID},
            {"name": "idempotency_key", "value": f"{EVENT_ID}_welcome"},
            {"name": "template", "value": "welcome"},
            {"name": "lane", "value": "transactional"},
        ],
    }


def test_text_only_message_without_headers() -> None:
    seen, handler = _capture()
    _provider(handler).send(OutgoingEmail(**{**EMAIL.__dict__, "html": None, "headers": {}}))
    body = json.loads(seen[0].content)
    assert "html" not in body and "headers" not in body
    assert body["text"] == "it works!"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (EVENT_ID, EVENT_ID),  # ULIDs pass unchanged
        ("01J:welcome", "01J_welcome"),
        ("password_reset-v2", "password_reset-v2"),
        ("a b/c.d@é", "a_b_c_d__"),
        ("", "_"),
        ("x" * 300, "x" * 256),
    ],
)
def test_tag_values_keep_only_resends_alphabet(raw: str, expected: str) -> None:
    assert tag_value(raw) == expected


def test_tags_are_sanitized_but_the_idempotency_header_is_exact() -> None:
    seen, handler = _capture()
    odd = OutgoingEmail(
        **{**EMAIL.__dict__, "idempotency_key": "evt:tpl/v2 #1", "template": "digest.weekly"}
    )
    _provider(handler).send(odd)
    (request,) = seen
    assert request.headers["idempotency-key"] == "evt:tpl/v2 #1"
    tags = {t["name"]: t["value"] for t in json.loads(request.content)["tags"]}
    assert tags["idempotency_key"] == "evt_tpl_v2__1"
    assert tags["template"] == "digest_weekly"


# --- classification ----------------------------------------------------------------------------


def _error(
    status: int, name: str, message: str = "", headers: dict | None = None
) -> httpx.Response:
    body = {"statusCode": status, "name": name, "message": message or f"{name} happened"}
    return httpx.Response(status, json=body, headers=headers)


@pytest.mark.parametrize(
    ("status", "name"),
    [
        (400, "validation_error"),
        (400, "invalid_idempotency_key"),
        (401, "missing_api_key"),
        (401, "restricted_api_key"),
        (401, "validation_error"),
        (403, "invalid_api_key"),
        (403, "validation_error"),
        (404, "not_found"),
        (405, "method_not_allowed"),
        (409, "invalid_idempotent_request"),
        (422, "validation_error"),
        (422, "missing_required_field"),
        (422, "invalid_from_address"),
        (422, "invalid_attachment"),
        (451, "security_error"),
        # Quotas reset with the day / month: dead-letter now, replay after (module docstring).
        (429, "daily_quota_exceeded"),
        (429, "monthly_quota_exceeded"),
    ],
)
def test_documented_permanent_errors_keep_the_error_name(status: int, name: str) -> None:
    answer = _error(status, name, "The detail an operator needs.")
    with pytest.raises(ProviderRejectedError) as caught:
        _provider(_capture(answer)[1]).send(EMAIL)
    error = caught.value
    assert (error.reason, error.status_code, error.code) == ("provider_rejected", status, name)
    assert "The detail an operator needs." in str(error)


@pytest.mark.parametrize(
    ("status", "name", "headers", "retry_after_s"),
    [
        (429, "rate_limit_exceeded", {"retry-after": "2", "ratelimit-reset": "2"}, 2.0),
        (429, "rate_limit_exceeded", {"ratelimit-reset": "3", "ratelimit-remaining": "0"}, 3.0),
        (429, "rate_limit_exceeded", {"retry-after": "1", "ratelimit-reset": "5"}, 1.0),
        (429, "rate_limit_exceeded", None, None),
        (429, "rate_limit_exceeded", {"retry-after": "86400"}, 300.0),  # capped
        (409, "concurrent_idempotent_requests", None, None),
        (500, "application_error", None, None),
        (500, "internal_server_error", None, None),
        (503, "internal_server_error", {"retry-after": "4"}, 4.0),
    ],
)
def test_documented_transient_errors_honour_retry_after_or_ratelimit_reset(
    status: int, name: str, headers: dict | None, retry_after_s: float | None
) -> None:
    with pytest.raises(TransientError) as caught:
        _provider(_capture(_error(status, name, headers=headers))[1]).send(EMAIL)
    error = caught.value
    assert (error.status_code, error.code, error.retry_after_s) == (status, name, retry_after_s)


def test_gateway_error_without_a_json_body_is_transient() -> None:
    answer = httpx.Response(502, text="<html>Bad Gateway</html>")
    with pytest.raises(TransientError) as caught:
        _provider(_capture(answer)[1]).send(EMAIL)
    assert (caught.value.status_code, caught.value.code) == (502, None)


def test_ok_answer_without_an_id_is_transient_so_the_keyed_retry_decides() -> None:
    with pytest.raises(TransientError) as caught:
        _provider(_capture(httpx.Response(200, json={}))[1]).send(EMAIL)
    assert caught.value.code == "unreadable_response"


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (httpx.ReadTimeout("read timed out"), "timeout"),
        (httpx.ConnectTimeout("connect timed out"), "timeout"),
        (httpx.ConnectError("connection refused"), "network"),
        (httpx.RemoteProtocolError("server disconnected"), "network"),
    ],
)
def test_timeouts_and_connection_errors_are_transient(exc: Exception, code: str) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    with pytest.raises(TransientError) as caught:
        _provider(handler).send(EMAIL)
    assert caught.value.code == code


# --- configuration -----------------------------------------------------------------------------


def test_from_settings_reads_base_url_and_key_from_the_environment() -> None:
    settings = ProviderSettings.from_env(
        {
            "EMAIL_PLATFORM_PROVIDER": "resend",
            "EMAIL_PLATFORM_RESEND_API_KEY": API_KEY,
            "EMAIL_PLATFORM_RESEND_BASE_URL": "http://127.0.0.1:9/resend",
            "EMAIL_PLATFORM_PROVIDER_TIMEOUT_S": "2.5",
            "EMAIL_PLATFORM_PROVIDER_RATE_LIMIT_PER_S": "5",
        }
    )
    provider = open_provider(settings, max_connections=4)
    try:
        assert isinstance(provider, ResendProvider)
        assert provider.base_url == "http://127.0.0.1:9/resend"
        assert provider.client.headers["Authorization"] == f"Bearer {API_KEY}"
        assert provider.client.timeout == httpx.Timeout(2.5)
        assert provider.limiter.per_second == 5.0
    finally:
        provider.close()


def test_from_settings_defaults_to_resends_public_endpoint() -> None:
    settings = ProviderSettings.from_env(
        {"EMAIL_PLATFORM_PROVIDER": "resend", "EMAIL_PLATFORM_RESEND_API_KEY": API_KEY}
    )
    provider = ResendProvider.from_settings(settings, max_connections=1)
    try:
        assert provider.base_url == "https://api.resend.com"
    finally:
        provider.close()


def test_missing_api_key_is_a_configuration_error() -> None:
    settings = ProviderSettings.from_env({"EMAIL_PLATFORM_PROVIDER": "resend"})
    with pytest.raises(ConfigurationError, match="RESEND_API_KEY"):
        open_provider(settings, max_connections=1)


# --- over HTTP against the stub ----------------------------------------------------------------


@pytest.fixture
def resend() -> Iterator[tuple[ResendStub, str]]:
    stub = ResendStub(api_key=API_KEY, retry_after_s=0.1)
    with BackgroundServer(stub.app) as url:
        yield stub, url


def test_repeated_key_gets_the_first_answer_and_sends_nothing(
    resend: tuple[ResendStub, str],
) -> None:
    stub, url = resend
    provider = ResendProvider(url, api_key=API_KEY, timeout_s=5)
    try:
        first = provider.send(EMAIL)
        # The answer was lost (the process died before its commit); the retry reuses the key.
        again = provider.send(EMAIL)
        assert again.provider_message_id == first.provider_message_id
        assert len(stub.accepted) == 1 and stub.replayed == 1
        # The same key with another payload is Resend's invalid_idempotent_request: permanent.
        with pytest.raises(ProviderRejectedError) as caught:
            provider.send(OutgoingEmail(**{**EMAIL.__dict__, "subject": "changed"}))
        assert (caught.value.status_code, caught.value.code) == (409, "invalid_idempotent_request")
    finally:
        provider.close()


def test_wrong_key_is_rejected_by_the_stub_as_resend_does(
    resend: tuple[ResendStub, str],
) -> None:
    stub, url = resend
    provider = ResendProvider(url, api_key="re_wrong", timeout_s=5)
    try:
        with pytest.raises(ProviderRejectedError) as caught:
            provider.send(EMAIL)
        assert (caught.value.status_code, caught.value.code) == (403, "invalid_api_key")
        assert stub.accepted == []
    finally:
        provider.close()


# --- end to end through the send job -----------------------------------------------------------


def test_send_job_against_resend_stub(
    engine: Engine, database_url: str, resend: tuple[ResendStub, str]
) -> None:
    stub, url = resend
    good = signup(engine, "u1", email="u1@example.com")
    retried = signup(engine, "u2", email="u2+fail429x1@example.com")
    invalid = signup(engine, "u3", email="u3+invalid@example.com")
    over_quota = signup(engine, "u4", email="u4+quota@example.com")
    result = run_send(
        database_url,
        "unused",
        "transactional",
        [good, retried, invalid, over_quota],
        provider=EmailProviderResource(provider="resend", base_url=url, api_key=API_KEY),
        lanes={"transactional": {"retry_delay_s": 0.01, "max_retries": 3}},
    )
    assert not result.success  # dead letters fail the run, for the operator to see
    assert len(step_events(result, "STEP_UP_FOR_RETRY")) == 1

    accepted = {m["to"][0]: m for m in stub.accepted}
    assert sorted(accepted) == ["u1@example.com", "u2+fail429x1@example.com"]  # once each
    for event_id, address in ((good, "u1@example.com"), (retried, "u2+fail429x1@example.com")):
        (message,) = messages_of(engine, event_id)
        seen = accepted[address]
        assert (message.status, message.provider) == ("sent", "resend")
        assert message.provider_message_id == seen["id"]
        assert seen["idempotency_key"] == message.idempotency_key  # the header, exact
        tags = {t["name"]: t["value"] for t in seen["tags"]}
        assert tags["event_id"] == event_id
        assert tags["idempotency_key"] == tag_value(message.idempotency_key)
        assert event(engine, event_id).status == "done"
    assert [a.outcome for a in attempts_of(engine, good)] == ["accepted"]
    tries = attempts_of(engine, retried)
    assert [(a.outcome, a.http_status) for a in tries] == [("transient", 429), ("accepted", 200)]
    assert tries[0].retry_after_s == 0.1
    assert (tries[1].started_at - tries[0].finished_at).total_seconds() >= 0.1  # honoured
    # Both attempts of the retried message carried the same key.
    retried_requests = [r for r in stub.requests if b"u2+fail429x1@example.com" in r["raw"]]
    assert [r["headers"]["idempotency-key"] for r in retried_requests] == [
        messages_of(engine, retried)[0].idempotency_key
    ] * 2

    for event_id, status, code in (
        (invalid, 422, "validation_error"),
        (over_quota, 429, "daily_quota_exceeded"),
    ):
        (message,) = messages_of(engine, event_id)
        assert message.status == "dead"
        assert [(a.outcome, a.http_status) for a in attempts_of(engine, event_id)] == [
            ("permanent", status)
        ]
        (letter,) = dead_letters_of(engine, event_id)
        assert (letter.reason, letter.error_code, letter.status) == (
            "provider_rejected",
            code,
            "open",
        )
    # Good once, retried twice, invalid and over-quota once each and never again.
    assert len(stub.requests) == 5 and stub.replayed == 0
