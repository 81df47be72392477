"""The Amazon SES v2 adapter: the exact signed ``SendEmail`` request, the classification of every
documented error, and the send job end to end against a stub that verifies SigV4 signatures.
"""

import json
import re
from datetime import UTC, datetime
from email.header import decode_header, make_header
from email.utils import parseaddr
from unittest import mock

import httpx
import pytest
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from email_platform.common.config import ProviderSettings
from email_platform.common.errors import (
    ConfigurationError,
    PermanentError,
    ProviderRejectedError,
    TransientError,
)
from email_platform.providers.registry import open_provider
from email_platform.providers.ses import (
    PERMANENT_CODES,
    THROTTLING_CODES,
    SesProvider,
    _ClockedSigV4Auth,
    error_code_of,
    tag_value,
)
from email_platform.resources import EmailProviderResource
from tests.provider_stubs.ses import ACCESS_KEY, SECRET_KEY, SesStub
from tests.ses_model import EVENT_ID, outgoing
from tests.support import attempts_of, dead_letters_of, messages_of, run_send, signup, step_events

AKID = "AKIDEXAMPLE"
SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"
FROZEN = datetime(2026, 11, 29, 14, 22, 18, tzinfo=UTC)
URL = "https://email.us-east-1.amazonaws.com/v2/email/outbound-emails"


class Recorder:
    """A MockTransport handler that keeps the requests and answers with a fixed response."""

    def __init__(self, response: httpx.Response | Exception | None = None) -> None:
        self.requests: list[httpx.Request] = []
        self.response = response

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if isinstance(self.response, Exception):
            raise self.response
        return self.response or httpx.Response(
            200, json={"MessageId": "010001234567890a-abcdef01-2345-6789-abcd-ef0123456789-000000"}
        )


def provider(recorder: Recorder, **kwargs) -> SesProvider:  # type: ignore[no-untyped-def]
    kwargs.setdefault("credentials", Credentials(AKID, SECRET))
    return SesProvider(clock=lambda: FROZEN, transport=httpx.MockTransport(recorder), **kwargs)


def botocore_authorization(url: str, body: bytes, credentials: Credentials, region: str) -> str:
    """What botocore's own ``SigV4Auth.add_auth`` signs for this request at ``FROZEN``."""
    host = httpx.URL(url).host
    request = AWSRequest(
        method="POST",
        url=url,
        data=body,
        headers={"Content-Type": "application/json", "Host": host},
    )
    with mock.patch(
        "botocore.auth.get_current_datetime",
        autospec=True,
        return_value=FROZEN.replace(tzinfo=None),
    ):
        SigV4Auth(credentials, "ses", region).add_auth(request)
    return request.headers["Authorization"]


EXPECTED_BODY = {
    "FromEmailAddress": "Example <no-reply@example.com>",
    "Destination": {"ToAddresses": ["jane@example.com"]},
    "Content": {
        "Simple": {
            "Subject": {"Data": "Welcome, Jane", "Charset": "UTF-8"},
            "Body": {
                "Text": {"Data": "Hello Jane", "Charset": "UTF-8"},
                "Html": {"Data": "<p>Hello Jane</p>", "Charset": "UTF-8"},
            },
            "Headers": [
                {"Name": "X-Email-Event-Id", "Value": EVENT_ID},
                {"Name": "X-Email-Idempotency-Key", "Value": f"{EVENT_ID}:welcome"},
            ],
        }
    },
    "EmailTags": [
        {"Name": "event_id", "Value": EVENT_ID},
        {"Name": "idempotency_key", "Value": f"{EVENT_ID}_welcome"},
        {"Name": "template", "Value": "welcome"},
        {"Name": "lane", "Value": "transactional"},
    ],
    "ConfigurationSetName": "email-platform-events",
}


# ---- the wire format --------------------------------------------------------------------------


def test_send_email_request_is_the_documented_one_signed_with_sigv4():
    recorder = Recorder()
    accepted = provider(recorder, configuration_set="email-platform-events").send(outgoing())

    (request,) = recorder.requests
    assert request.method == "POST"
    assert str(request.url) == URL
    body = json.dumps(EXPECTED_BODY, separators=(",", ":")).encode()
    assert request.content == body
    assert json.loads(request.content) == EXPECTED_BODY
    assert request.headers["Content-Type"] == "application/json"
    assert request.headers["Host"] == "email.us-east-1.amazonaws.com"
    assert request.headers["X-Amz-Date"] == "20261129T142218Z"
    assert "X-Amz-Security-Token" not in request.headers
    assert "Idempotency-Key" not in request.headers  # SES SendEmail has none
    authorization = request.headers["Authorization"]
    assert re.fullmatch(
        r"AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20261129/us-east-1/ses/aws4_request, "
        r"SignedHeaders=content-type;host;x-amz-date, Signature=[0-9a-f]{64}",
        authorization,
    )
    # The signature is the one botocore computes for the same request at the same time.
    assert authorization == botocore_authorization(
        URL, body, Credentials(AKID, SECRET), "us-east-1"
    )
    assert accepted.provider_message_id == (
        "010001234567890a-abcdef01-2345-6789-abcd-ef0123456789-000000"
    )
    assert accepted.status_code == 200


def test_temporary_credentials_send_and_sign_the_session_token():
    recorder = Recorder()
    credentials = Credentials(AKID, SECRET, "FwoGZXIvYXdzEXAMPLETOKEN")
    provider(recorder, credentials=credentials).send(outgoing())
    (request,) = recorder.requests
    assert request.headers["X-Amz-Security-Token"] == "FwoGZXIvYXdzEXAMPLETOKEN"
    assert (
        "SignedHeaders=content-type;host;x-amz-date;x-amz-security-token,"
        in (request.headers["Authorization"])
    )
    aws = AWSRequest(
        method="POST",
        url=URL,
        data=request.content,
        headers={"Content-Type": "application/json", "Host": "email.us-east-1.amazonaws.com"},
    )
    with mock.patch(
        "botocore.auth.get_current_datetime",
        autospec=True,
        return_value=FROZEN.replace(tzinfo=None),
    ):
        SigV4Auth(credentials, "ses", "us-east-1").add_auth(aws)
    assert request.headers["Authorization"] == aws.headers["Authorization"]


@pytest.mark.parametrize(
    ("url", "headers", "service", "secret", "when", "signature"),
    [
        # AWS Signature V4 test suite, "get-vanilla".
        (
            "https://example.amazonaws.com/",
            {},
            "service",
            "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
            datetime(2015, 8, 30, 12, 36, tzinfo=UTC),
            "5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31",
        ),
        # Amazon S3 API reference, "Example: GET Object" with a header-based signature.
        (
            "https://examplebucket.s3.amazonaws.com/test.txt",
            {
                "Range": "bytes=0-9",
                "x-amz-content-sha256": (
                    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
                ),
            },
            "s3",
            "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
            datetime(2013, 5, 24, tzinfo=UTC),
            "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41",
        ),
    ],
)
def test_signer_reproduces_aws_published_signatures(url, headers, service, secret, when, signature):
    request = AWSRequest(method="GET", url=url, headers=headers)
    _ClockedSigV4Auth(Credentials("AKID", secret), service, "us-east-1", lambda: when).add_auth(
        request
    )
    assert request.headers["Authorization"].endswith(f"Signature={signature}")
    assert request.headers["X-Amz-Date"] == when.strftime("%Y%m%dT%H%M%SZ")


def test_region_sets_the_default_endpoint_and_the_credential_scope():
    recorder = Recorder()
    provider(recorder, region="eu-west-1").send(outgoing())
    (request,) = recorder.requests
    assert str(request.url) == "https://email.eu-west-1.amazonaws.com/v2/email/outbound-emails"
    assert "/20261129/eu-west-1/ses/aws4_request," in request.headers["Authorization"]
    assert "ConfigurationSetName" not in json.loads(request.content)


def test_from_settings_reads_region_credentials_configuration_set_and_limits():
    settings = ProviderSettings(
        name="ses",
        base_url=None,
        api_key=None,
        sender="Example <no-reply@example.com>",
        timeout_s=3.5,
        rate_limit_per_s=14.0,
        options={
            "region": "ap-southeast-2",
            "access_key_id": AKID,
            "secret_access_key": SECRET,
            "configuration_set": "events",
        },
    )
    ses = open_provider(settings, max_connections=4)
    assert isinstance(ses, SesProvider)
    assert ses.base_url == "https://email.ap-southeast-2.amazonaws.com"
    assert ses.region == "ap-southeast-2" and ses.configuration_set == "events"
    assert ses.client.timeout == httpx.Timeout(3.5)
    assert ses.limiter.per_second == 14.0
    override = SesProvider.from_settings(
        ProviderSettings(**{**settings.__dict__, "base_url": "http://127.0.0.1:9/"}),
        max_connections=1,
    )
    assert override.base_url == "http://127.0.0.1:9"
    assert override.region == "ap-southeast-2"  # still signs for the configured region


def test_missing_or_half_credentials_are_a_configuration_error(monkeypatch, tmp_path):
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    base = ProviderSettings("ses", None, None, "a@example.com", 1.0, 0.0, {})
    with pytest.raises(ConfigurationError, match="no AWS credentials"):
        SesProvider.from_settings(base, max_connections=1)
    half = ProviderSettings("ses", None, None, "a@example.com", 1.0, 0.0, {"access_key_id": AKID})
    with pytest.raises(ConfigurationError, match="must be set together"):
        SesProvider.from_settings(half, max_connections=1)
    # The standard AWS chain is the fallback (roles, profiles, AWS_* variables).
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDFROMENV")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-from-env")
    chained = SesProvider.from_settings(base, max_connections=1)
    assert chained.client.auth.credentials.get_frozen_credentials().access_key == "AKIDFROMENV"


def test_tag_values_keep_to_ses_characters_and_the_exact_key_rides_in_a_header():
    assert tag_value("01JDQ:welcome") == "01JDQ_welcome"
    assert tag_value("order 42/refund.é@x") == "order_42_refund___x"
    assert tag_value("k" * 300) == "k" * 256
    assert tag_value("") == "_"
    recorder = Recorder()
    provider(recorder).send(outgoing(idempotency_key="shop.order-42:v2/receipt"))
    body = json.loads(recorder.requests[0].content)
    tags = {t["Name"]: t["Value"] for t in body["EmailTags"]}
    assert tags["idempotency_key"] == "shop_order-42_v2_receipt"
    assert all(
        re.fullmatch(r"[A-Za-z0-9_-]{1,256}", v) for t in body["EmailTags"] for v in t.values()
    )
    headers = {h["Name"]: h["Value"] for h in body["Content"]["Simple"]["Headers"]}
    assert headers["X-Email-Idempotency-Key"] == "shop.order-42:v2/receipt"
    # A key SES cannot carry in a header is left to the (sanitized) tag.
    provider(recorder).send(outgoing(idempotency_key="clé:welcome"))
    body = json.loads(recorder.requests[1].content)
    assert [h["Name"] for h in body["Content"]["Simple"]["Headers"]] == ["X-Email-Event-Id"]
    assert {t["Name"]: t["Value"] for t in body["EmailTags"]}["idempotency_key"] == "cl__welcome"


def test_text_only_message_and_non_ascii_display_name():
    recorder = Recorder()
    provider(recorder).send(outgoing(html=None, sender="Zoë Café <no-reply@example.com>"))
    body = json.loads(recorder.requests[0].content)
    assert body["Content"]["Simple"]["Body"] == {"Text": {"Data": "Hello Jane", "Charset": "UTF-8"}}
    assert body["FromEmailAddress"].isascii()  # MIME-encoded, as SES requires
    name, address = parseaddr(body["FromEmailAddress"])
    assert str(make_header(decode_header(name))) == "Zoë Café"
    assert address == "no-reply@example.com"


@pytest.mark.parametrize(
    "overrides",
    [
        {"subject": "Hi\r\nBcc: victim@example.com"},
        {"sender": "Evil\nBcc: victim@example.com <no-reply@example.com>"},
        {"headers": {"X-Custom": "a\r\nBcc: victim@example.com"}},
    ],
)
def test_line_breaks_in_header_values_are_refused_before_any_request(overrides):
    recorder = Recorder()
    with pytest.raises(PermanentError) as caught:
        provider(recorder).send(outgoing(**overrides))
    assert caught.value.code == "header_injection"
    assert recorder.requests == []


# ---- classification of every documented answer -----------------------------------------------


def aws_error(status: int, code: str, message: str = "boom", **headers: str) -> httpx.Response:
    return httpx.Response(
        status,
        json={"message": message},
        headers={
            "x-amzn-ErrorType": f"{code}:http://internal.amazon.com/coral/com.amazonaws.sesv2/",
            **headers,
        },
    )


@pytest.mark.parametrize(
    ("status", "code", "transient"),
    [
        # SendEmail's documented errors (SES API v2 reference; botocore's sesv2 model).
        (429, "TooManyRequestsException", True),
        (400, "LimitExceededException", True),
        (400, "AccountSuspendedException", False),
        (400, "SendingPausedException", False),
        (400, "MessageRejected", False),
        (400, "MailFromDomainNotVerifiedException", False),
        (404, "NotFoundException", False),
        (400, "BadRequestException", False),
        # Errors common to all AWS APIs.
        (400, "ThrottlingException", True),
        (500, "InternalFailure", True),
        (500, "InternalServiceErrorException", True),
        (503, "ServiceUnavailable", True),
        (403, "AccessDeniedException", False),
        (403, "InvalidSignatureException", False),
        (403, "UnrecognizedClientException", False),
        (400, "ValidationException", False),
    ],
)
def test_every_documented_error_is_classified_with_its_code_and_message(status, code, transient):
    message = f"{code} happened"
    with pytest.raises((TransientError, PermanentError)) as caught:
        provider(Recorder(aws_error(status, code, message))).send(outgoing())
    error = caught.value
    assert isinstance(error, TransientError) is transient
    if not transient:
        assert isinstance(error, ProviderRejectedError)
        assert error.reason == "provider_rejected"
    assert error.code == code
    assert error.status_code == status
    assert message in str(error)


def test_every_error_botocore_documents_for_send_email_has_a_decided_class():
    from botocore.loaders import Loader

    model = Loader().load_service_model("sesv2", "service-2")
    documented = {error["shape"] for error in model["operations"]["SendEmail"]["errors"]}
    assert documented <= THROTTLING_CODES | PERMANENT_CODES
    assert not THROTTLING_CODES & PERMANENT_CODES


def test_retry_after_is_honoured_when_ses_sends_one():
    response = aws_error(429, "TooManyRequestsException", **{"Retry-After": "7"})
    with pytest.raises(TransientError) as caught:
        provider(Recorder(response)).send(outgoing())
    assert caught.value.retry_after_s == 7.0


@pytest.mark.parametrize(
    ("headers", "body", "code", "message"),
    [
        (
            {"x-amzn-ErrorType": "MessageRejected:http://internal.amazon.com/"},
            {"message": "m"},
            "MessageRejected",
            "m",
        ),
        (
            {},
            {"__type": "com.amazonaws.sesv2#ThrottlingException", "Message": "slow"},
            "ThrottlingException",
            "slow",
        ),
        ({}, {"code": "BadRequestException", "message": "bad"}, "BadRequestException", "bad"),
        ({}, None, None, "<html>gateway</html>"),
    ],
)
def test_error_code_is_read_from_header_or_body(headers, body, code, message):
    if body is None:
        response = httpx.Response(502, text="<html>gateway</html>", headers=headers)
    else:
        response = httpx.Response(400, json=body, headers=headers)
    assert error_code_of(response) == (code, message)


def test_throttling_sent_as_400_in_the_body_only_is_still_transient():
    response = httpx.Response(
        400, json={"__type": "ThrottlingException", "message": "Rate exceeded"}
    )
    with pytest.raises(TransientError) as caught:
        provider(Recorder(response)).send(outgoing())
    assert caught.value.code == "ThrottlingException"


@pytest.mark.parametrize(
    "exc",
    [
        httpx.ConnectTimeout("connect timed out"),
        httpx.ReadTimeout("read timed out"),
        httpx.ConnectError("connection refused"),
        httpx.RemoteProtocolError("server disconnected"),
    ],
)
def test_network_failures_and_timeouts_are_transient(exc):
    with pytest.raises(TransientError):
        provider(Recorder(exc)).send(outgoing())


def test_unreadable_success_is_transient_not_lost():
    with pytest.raises(TransientError) as caught:
        provider(Recorder(httpx.Response(200, text="not json"))).send(outgoing())
    assert caught.value.code == "unreadable_response"


# ---- against the verifying stub over HTTP ------------------------------------------------------


def stub_provider(stub: SesStub, *, secret: str = SECRET_KEY, region: str = "us-east-1"):  # type: ignore[no-untyped-def]
    return SesProvider(
        stub.base_url, region=region, credentials=Credentials(ACCESS_KEY, secret), timeout_s=5.0
    )


def test_stub_accepts_a_valid_signature_and_refuses_a_forged_or_misscoped_one():
    with SesStub() as stub:
        good = stub_provider(stub)
        try:
            first = good.send(outgoing())
            second = good.send(outgoing(to="john@example.com"))
        finally:
            good.close()
        assert [m["MessageId"] for m in stub.messages] == [
            first.provider_message_id,
            second.provider_message_id,
        ]
        assert stub.messages[0]["tags"]["event_id"] == EVENT_ID
        for bad in (stub_provider(stub, secret="wrong"), stub_provider(stub, region="eu-west-1")):
            with pytest.raises(ProviderRejectedError) as caught:
                bad.send(outgoing())
            bad.close()
            assert caught.value.code == "InvalidSignatureException"
            assert caught.value.status_code == 403
        assert len(stub.messages) == 2


# ---- end to end through the send job -----------------------------------------------------------


def test_send_job_through_ses_retries_throttling_and_dead_letters_a_rejection(engine, database_url):
    ids = {
        "plain": signup(engine, "u1"),
        "throttled": signup(engine, "u2", email="u2+throttlex1@example.com"),
        "throttled_400": signup(engine, "u3", email="u3+throttling400x1@example.com"),
        "rejected": signup(engine, "u4", email="u4+reject@example.com"),
    }
    with SesStub() as stub:
        resource = EmailProviderResource(
            provider="ses",
            base_url=stub.base_url,
            timeout_s=5.0,
            options_json=json.dumps(
                {
                    "region": "us-east-1",
                    "access_key_id": ACCESS_KEY,
                    "secret_access_key": SECRET_KEY,
                    "configuration_set": "email-platform-events",
                }
            ),
        )
        result = run_send(
            database_url, "unused", "transactional", list(ids.values()), provider=resource
        )
    assert not result.success  # a permanent failure fails the run after recording everything
    assert len(step_events(result, "STEP_UP_FOR_RETRY")) == 1

    # Nothing doubled: each deliverable event was accepted once, under its own metadata.
    accepted = {m["tags"]["event_id"]: m for m in stub.messages}
    assert sorted(accepted) == sorted(ids[k] for k in ("plain", "throttled", "throttled_400"))
    assert len(stub.messages) == 3
    for name in ("plain", "throttled", "throttled_400"):
        event_id = ids[name]
        (message,) = messages_of(engine, event_id)
        seen = accepted[event_id]
        assert message.status == "sent"
        assert message.provider == "ses"
        assert message.provider_message_id == seen["MessageId"]
        assert seen["tags"]["idempotency_key"] == message.idempotency_key.replace(":", "_")
        assert seen["headers"]["X-Email-Idempotency-Key"] == message.idempotency_key
        assert seen["headers"]["X-Email-Event-Id"] == event_id
        assert seen["configuration_set"] == "email-platform-events"
    assert [a.outcome for a in attempts_of(engine, ids["plain"])] == ["accepted"]
    throttled = attempts_of(engine, ids["throttled"])
    assert [(a.outcome, a.http_status) for a in throttled] == [
        ("transient", 429),
        ("accepted", 200),
    ]
    assert "TooManyRequestsException" in throttled[0].error
    throttled_400 = attempts_of(engine, ids["throttled_400"])
    # A 400 that SES means as throttling is retried, not dead-lettered.
    assert [(a.outcome, a.http_status) for a in throttled_400] == [
        ("transient", 400),
        ("accepted", 200),
    ]

    # The rejection went straight to the dead letters, with SES's code and message kept.
    assert [(a.outcome, a.http_status) for a in attempts_of(engine, ids["rejected"])] == [
        ("permanent", 400)
    ]
    (letter,) = dead_letters_of(engine, ids["rejected"])
    assert (letter.reason, letter.error_code, letter.status) == (
        "provider_rejected",
        "MessageRejected",
        "open",
    )
    assert "Email address is not verified" in letter.last_error
    assert messages_of(engine, ids["rejected"])[0].status == "dead"
    assert stub.codes().count("MessageRejected") == 1  # never retried
    assert "InvalidSignatureException" not in stub.codes()
