"""The Postmark adapter speaks Postmark's documented Email API and maps each answer correctly.

* Wire format (``httpx.MockTransport``): the exact request of a representative message, the
  shape of Postmark's documented ``POST /email`` example (headers, PascalCase body, Metadata
  carrying ``event_id`` and ``idempotency_key``, Tag, MessageStream), and no idempotency
  header, because Postmark has none.
* Classification of every documented error answer: 401/413/422 (ErrorCodes 10, 300, 406, ...)
  are permanent with the ErrorCode kept; 429, 5xx and ErrorCode 100 are transient, honouring
  ``Retry-After``; timeouts and connection errors are transient.
* ``from_settings`` reads base URL, token and stream options and refuses a missing token.
* End to end through the real send job, on SQLite and PostgreSQL, against a local stub of
  the Postmark API: one message sent, one retried after a 429, one dead-lettered with
  ErrorCode 300, nothing accepted twice.
"""

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine

from email_platform.common.config import ProviderSettings
from email_platform.common.errors import ConfigurationError, ProviderRejectedError, TransientError
from email_platform.providers.base import Accepted, OutgoingEmail
from email_platform.providers.postmark import DEFAULT_BASE_URL, PostmarkProvider
from email_platform.providers.registry import open_provider
from email_platform.resources import EmailProviderResource
from email_platform.sandbox.asgi import BackgroundServer
from tests.provider_stubs.postmark import PostmarkStub
from tests.support import (
    attempts_of,
    dead_letters_of,
    event,
    messages_of,
    run_send,
    signup,
    step_events,
)

TOKEN = "f3a1c2d4-0000-4b5e-9c8d-postmark-test"
EVENT_ID = "01JDQ7YV6M8X3N2K4P5R6S7T8V"
EMAIL = OutgoingEmail(
    message_id=7,
    event_id=EVENT_ID,
    idempotency_key=f"{EVENT_ID}:welcome",
    sender="Example <no-reply@example.com>",
    to="jane@example.com",
    subject="Welcome, Jane",
    text="Hello Jane, welcome aboard.",
    html="<p>Hello Jane, welcome aboard.</p>",
    template="welcome",
    lane="transactional",
    headers={"X-Email-Event-Id": EVENT_ID},
)
# Postmark's documented answer to POST /email.
DOCUMENTED_OK = {
    "To": "jane@example.com",
    "SubmittedAt": "2014-02-17T07:25:01.4178645-05:00",
    "MessageID": "0a129aee-e1cd-480d-b08d-4f48548ff48d",
    "ErrorCode": 0,
    "Message": "OK",
}
# Set by httpx itself on every request; everything else is the adapter's doing.
Handler = Callable[[httpx.Request], httpx.Response]
TRANSPORT_HEADERS = {"host", "accept-encoding", "connection", "user-agent", "content-length"}


def _provider(
    handler: Handler, base_url: str = DEFAULT_BASE_URL, **kwargs: Any
) -> PostmarkProvider:
    return PostmarkProvider(
        base_url, server_token=TOKEN, transport=httpx.MockTransport(handler), **kwargs
    )


def _capture(answer: httpx.Response | None = None) -> tuple[list[httpx.Request], Handler]:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answer if answer is not None else httpx.Response(200, json=DOCUMENTED_OK)

    return seen, handler


def _own_headers(request: httpx.Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k not in TRANSPORT_HEADERS}


# --- wire format -------------------------------------------------------------------------------


def test_request_is_postmarks_documented_email_call() -> None:
    seen, handler = _capture()
    result = _provider(handler).send(EMAIL)
    assert result == Accepted("0a129aee-e1cd-480d-b08d-4f48548ff48d", 200)
    (request,) = seen
    assert request.method == "POST"
    assert str(request.url) == "https://api.postmarkapp.com/email"
    assert _own_headers(request) == {
        "accept": "application/json",
        "content-type": "application/json",
        "x-postmark-server-token": TOKEN,
    }
    assert json.loads(request.content) == {
        "From": "Example <no-reply@example.com>",
        "To": "jane@example.com",
        "Subject": "Welcome, Jane",
        "TextBody": "Hello Jane, welcome aboard.",
        "HtmlBody": "<p>Hello Jane, welcome aboard.</p>",
        "Headers": [{"Name": "X-Email-Event-Id", "Value": EVENT_ID}],
        "Tag": "welcome",
        "Metadata": {"event_id": EVENT_ID, "idempotency_key": f"{EVENT_ID}:welcome"},
        "MessageStream": "outbound",
    }


def test_no_idempotency_header_because_postmark_has_none() -> None:
    seen, handler = _capture()
    _provider(handler).send(EMAIL)
    assert not any("idempotency" in name for name in seen[0].headers)


def test_metadata_values_stay_within_postmarks_80_characters() -> None:
    seen, handler = _capture()
    long_key, long_id = "k" * 81, "c" * 200  # publish() accepts keys up to 200 characters
    email = OutgoingEmail(**{**EMAIL.__dict__, "idempotency_key": long_key})
    _provider(handler).send(OutgoingEmail(**{**email.__dict__, "correlation_id": long_id}))
    # Left out, not cut: a cut key would name another message. event_id still joins.
    assert json.loads(seen[0].content)["Metadata"] == {"event_id": EVENT_ID}
    seen, handler = _capture()
    _provider(handler).send(OutgoingEmail(**{**EMAIL.__dict__, "idempotency_key": "k" * 80}))
    assert json.loads(seen[0].content)["Metadata"]["idempotency_key"] == "k" * 80


def test_text_only_message_has_no_html_body() -> None:
    seen, handler = _capture()
    _provider(handler).send(OutgoingEmail(**{**EMAIL.__dict__, "html": None, "headers": {}}))
    body = json.loads(seen[0].content)
    assert "HtmlBody" not in body
    assert body["TextBody"] == "Hello Jane, welcome aboard."
    assert body["Headers"] == []


@pytest.mark.parametrize(
    ("lane", "bulk_stream", "expected"),
    [
        ("bulk", "broadcast", "broadcast"),
        ("bulk", None, "tx-stream"),
        ("transactional", "broadcast", "tx-stream"),
        ("critical", "broadcast", "tx-stream"),
    ],
)
def test_message_stream_per_lane(lane: str, bulk_stream: str | None, expected: str) -> None:
    seen, handler = _capture()
    provider = _provider(handler, message_stream="tx-stream", bulk_message_stream=bulk_stream)
    provider.send(OutgoingEmail(**{**EMAIL.__dict__, "lane": lane}))
    assert json.loads(seen[0].content)["MessageStream"] == expected


def test_base_url_with_a_path_prefix_is_kept() -> None:
    seen, handler = _capture()
    _provider(handler, base_url="http://egress.internal/postmark/").send(EMAIL)
    assert str(seen[0].url) == "http://egress.internal/postmark/email"


# --- classification ----------------------------------------------------------------------------


def _answer(status: int, body: dict | str | None, headers: dict | None = None) -> httpx.Response:
    if isinstance(body, dict):
        return httpx.Response(status, json=body, headers=headers)
    return httpx.Response(status, text=body or "", headers=headers)


@pytest.mark.parametrize(
    ("status", "error_code", "message"),
    [
        (401, 10, "Request does not contain a valid Server token."),
        (422, 300, "Error parsing 'To': Illegal email address 'jane@'."),
        (422, 406, "You tried to send to recipient(s) that have been marked as inactive."),
        (422, 400, "The 'From' address you supplied is not a Sender Signature on your account."),
        (422, 401, "Sender signature not confirmed."),
        (422, 402, "Received invalid JSON input."),
        (422, 405, "Not allowed to send: you have run out of credits."),
        (422, 412, "Your account is pending approval."),
    ],
)
def test_documented_4xx_errors_are_permanent_with_the_error_code(
    status: int, error_code: int, message: str
) -> None:
    answer = _answer(status, {"ErrorCode": error_code, "Message": message})
    with pytest.raises(ProviderRejectedError) as caught:
        _provider(_capture(answer)[1]).send(EMAIL)
    error = caught.value
    assert (error.reason, error.status_code, error.code) == (
        "provider_rejected",
        status,
        str(error_code),
    )
    assert message in str(error)


def test_payload_too_large_is_permanent() -> None:
    with pytest.raises(ProviderRejectedError) as caught:
        _provider(_capture(_answer(413, "Payload Too Large"))[1]).send(EMAIL)
    assert caught.value.status_code == 413 and caught.value.code is None


@pytest.mark.parametrize(
    ("status", "body", "headers", "code", "retry_after_s"),
    [
        (429, {"ErrorCode": 429, "Message": "Rate limit exceeded."}, None, "429", None),
        (
            429,
            {"ErrorCode": 429, "Message": "Rate limit exceeded."},
            {"Retry-After": "7"},
            "429",
            7.0,
        ),
        (429, "", None, None, None),
        (500, "Internal Server Error", None, None, None),
        (503, "Service Unavailable", {"Retry-After": "30"}, None, 30.0),
        (503, {"ErrorCode": 100, "Message": "Maintenance"}, None, "100", None),
        # Retry-After is capped: one answer cannot park a run for a day.
        (503, "Service Unavailable", {"Retry-After": "86400"}, None, 300.0),
    ],
)
def test_rate_limit_and_server_errors_are_transient(
    status: int,
    body: dict | str,
    headers: dict | None,
    code: str | None,
    retry_after_s: float | None,
) -> None:
    with pytest.raises(TransientError) as caught:
        _provider(_capture(_answer(status, body, headers))[1]).send(EMAIL)
    error = caught.value
    assert (error.status_code, error.code, error.retry_after_s) == (status, code, retry_after_s)


def test_maintenance_error_code_is_transient_whatever_the_status() -> None:
    answer = _answer(422, {"ErrorCode": 100, "Message": "Maintenance"})
    with pytest.raises(TransientError) as caught:
        _provider(_capture(answer)[1]).send(EMAIL)
    assert caught.value.code == "100"


def test_ok_status_with_a_nonzero_error_code_is_not_accepted() -> None:
    answer = _answer(200, {"ErrorCode": 300, "Message": "Invalid email request"})
    with pytest.raises(ProviderRejectedError) as caught:
        _provider(_capture(answer)[1]).send(EMAIL)
    assert caught.value.code == "300"


@pytest.mark.parametrize(
    "answer",
    [
        httpx.Response(200, text="<html>ok</html>"),
        httpx.Response(200, json=[DOCUMENTED_OK]),
        httpx.Response(200, json={"ErrorCode": 0, "Message": "OK"}),
    ],
)
def test_unreadable_ok_answer_is_transient_so_the_retry_decides(answer: httpx.Response) -> None:
    with pytest.raises(TransientError) as caught:
        _provider(_capture(answer)[1]).send(EMAIL)
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


def test_from_settings_reads_base_url_token_and_options_from_the_environment() -> None:
    settings = ProviderSettings.from_env(
        {
            "EMAIL_PLATFORM_PROVIDER": "postmark",
            "EMAIL_PLATFORM_POSTMARK_API_KEY": TOKEN,
            "EMAIL_PLATFORM_POSTMARK_BASE_URL": "http://127.0.0.1:9/pm",
            "EMAIL_PLATFORM_POSTMARK_MESSAGE_STREAM": "transactional-stream",
            "EMAIL_PLATFORM_POSTMARK_BULK_MESSAGE_STREAM": "broadcast",
            "EMAIL_PLATFORM_PROVIDER_TIMEOUT_S": "3.5",
            "EMAIL_PLATFORM_PROVIDER_RATE_LIMIT_PER_S": "10",
        }
    )
    provider = open_provider(settings, max_connections=4)
    try:
        assert isinstance(provider, PostmarkProvider)
        assert provider.base_url == "http://127.0.0.1:9/pm"
        assert provider.client.headers["X-Postmark-Server-Token"] == TOKEN
        assert provider.message_stream == "transactional-stream"
        assert provider.bulk_message_stream == "broadcast"
        assert provider.client.timeout == httpx.Timeout(3.5)
        assert provider.limiter.per_second == 10.0
    finally:
        provider.close()


def test_from_settings_defaults_to_postmarks_public_endpoint_and_outbound_stream() -> None:
    settings = ProviderSettings.from_env(
        {"EMAIL_PLATFORM_PROVIDER": "postmark", "EMAIL_PLATFORM_POSTMARK_API_KEY": TOKEN}
    )
    provider = PostmarkProvider.from_settings(settings, max_connections=1)
    try:
        assert provider.base_url == "https://api.postmarkapp.com"
        assert (provider.message_stream, provider.bulk_message_stream) == ("outbound", None)
    finally:
        provider.close()


def test_missing_server_token_is_a_configuration_error() -> None:
    settings = ProviderSettings.from_env({"EMAIL_PLATFORM_PROVIDER": "postmark"})
    with pytest.raises(ConfigurationError, match="POSTMARK_API_KEY"):
        open_provider(settings, max_connections=1)


# --- end to end through the send job -----------------------------------------------------------


@pytest.fixture
def postmark() -> Iterator[tuple[PostmarkStub, str]]:
    stub = PostmarkStub(server_token=TOKEN)
    with BackgroundServer(stub.app) as url:
        yield stub, url


def test_send_job_against_postmark_stub(
    engine: Engine, database_url: str, postmark: tuple[PostmarkStub, str]
) -> None:
    stub, url = postmark
    good = signup(engine, "u1", email="u1@example.com")
    retried = signup(engine, "u2", email="u2+fail429x1@example.com")
    invalid = signup(engine, "u3", email="u3+invalid@example.com")
    result = run_send(
        database_url,
        "unused",
        "transactional",
        [good, retried, invalid],
        provider=EmailProviderResource(
            provider="postmark",
            base_url=url,
            api_key=TOKEN,
            options_json=json.dumps({"message_stream": "outbound"}),
        ),
        lanes={"transactional": {"retry_delay_s": 0.01, "max_retries": 3}},
    )
    assert not result.success  # a dead letter fails the run, for the operator to see
    assert len(step_events(result, "STEP_UP_FOR_RETRY")) == 1

    accepted = {m["To"]: m for m in stub.accepted}
    assert sorted(accepted) == ["u1@example.com", "u2+fail429x1@example.com"]  # once each
    for event_id, address in ((good, "u1@example.com"), (retried, "u2+fail429x1@example.com")):
        (message,) = messages_of(engine, event_id)
        seen = accepted[address]
        assert (message.status, message.provider) == ("sent", "postmark")
        assert message.provider_message_id == seen["MessageID"]
        assert seen["Metadata"] == {
            "event_id": event_id,
            "idempotency_key": message.idempotency_key,
        }
        assert (seen["Tag"], seen["MessageStream"]) == (message.template, "outbound")
        assert event(engine, event_id).status == "done"
    assert [a.outcome for a in attempts_of(engine, good)] == ["accepted"]
    tries = attempts_of(engine, retried)
    assert [(a.outcome, a.http_status) for a in tries] == [("transient", 429), ("accepted", 200)]
    assert tries[1].provider_message_id == accepted["u2+fail429x1@example.com"]["MessageID"]

    (message,) = messages_of(engine, invalid)
    assert message.status == "dead"
    assert [(a.outcome, a.http_status) for a in attempts_of(engine, invalid)] == [
        ("permanent", 422)
    ]
    (letter,) = dead_letters_of(engine, invalid)
    assert (letter.reason, letter.error_code, letter.status) == ("provider_rejected", "300", "open")
    assert "Illegal email address" in letter.last_error
    # Good once, retried twice, invalid once and never again.
    assert len(stub.requests) == 4
