"""Amazon SES over Amazon SNS beyond the shared contract (test_webhooks_contract.py, which
covers its fixtures end to end): what is particular to SES events and to SNS, with signatures
(versions 1 and 2) made with an RSA key whose self-signed certificate a fake Amazon serves
(tests/webhook_signers/ses.py), on SQLite and PostgreSQL (docs/design.md invariant 7).

* Events: the same SES event in another SNS message keeps its id; machine opens; one event per
  recipient; complaint and subscription variants; setup messages carry no events; what the send
  adapter sends as tags and headers is read back.
* SNS: only Amazon's SNS hosts are trusted; the string to sign follows the documentation; the
  topic allowlist is required; the freshness window; the default fetcher refuses redirects. A
  tampered, off-host, off-topic, wrongly versioned or incomplete delivery is refused with
  nothing stored; both signature versions go through and the certificate is fetched once; the
  same event published to a second topic is applied once; subscriptions are confirmed only when
  authentic; Amazon unreachable answers 503.
"""

import json
import uuid
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from botocore.credentials import Credentials
from starlette.testclient import TestClient

from email_platform.common.errors import ConfigurationError
from email_platform.providers.ses import SesProvider
from email_platform.webhooks import ses
from email_platform.webhooks.errors import WebhookMalformed, WebhookRejected
from email_platform.webhooks.receiver import create_receiver_app
from tests.webhook_signers.ses import (
    CERT_URL,
    ENVELOPES,
    EVENT_ID,
    EXPIRED_CERT_URL,
    FIXTURES,
    FORGER_KEY,
    OTHER_TOPIC,
    RECIPIENT,
    SES_MESSAGE_ID,
    SETTINGS,
    SIGNER,
    TABLE,
    TOPIC,
    FakeAmazon,
    confirmation,
    documented_string_to_sign,
    fixture_event,
    iso,
    notification,
    provider,
    sign,
    sns_headers,
)
from tests.webhook_support import inbox_rows, ingest, outgoing_email, seed_sent_message


@pytest.fixture
def amazon() -> FakeAmazon:
    return FakeAmazon()


def _client(engine, amazon: FakeAmazon, settings=SETTINGS) -> TestClient:  # type: ignore[no-untyped-def]
    return TestClient(
        create_receiver_app(engine, settings=settings, providers={"ses": provider(amazon)})
    )


def post(client: TestClient, message: dict, headers: dict | None = None, body: bytes | None = None):  # type: ignore[no-untyped-def]
    content = json.dumps(message).encode() if body is None else body
    return client.post(
        "/webhooks/ses",
        content=content,
        headers=sns_headers(message) if headers is None else headers,
    )


def _sent_message(engine) -> int:  # type: ignore[no-untyped-def]
    """The message every fixture is about, as the send job leaves it."""
    return seed_sent_message(
        engine,
        provider="ses",
        event_id=EVENT_ID,
        recipient=RECIPIENT,
        provider_message_id=SES_MESSAGE_ID,
    )


# ---- normalization (no database) -------------------------------------------------------------


def _unsigned(event: dict | str) -> bytes:
    return json.dumps(
        {
            "Type": "Notification",
            "MessageId": "m-1",
            "Message": (event if isinstance(event, str) else json.dumps(event)),
            "Timestamp": "2026-11-29T14:22:30.000Z",
            "TopicArn": TOPIC,
        }
    ).encode()


def test_the_same_ses_event_in_another_sns_message_has_the_same_id():
    first = ses.normalize(_unsigned(fixture_event("open")))[0]
    again = json.loads(_unsigned(fixture_event("open")))
    again.update(MessageId="m-2", Timestamp="2026-11-29T15:00:00.000Z", TopicArn=OTHER_TOPIC)
    second = ses.normalize(json.dumps(again).encode())[0]
    assert first.provider_event_id == second.provider_event_id


def test_machine_opens_and_per_recipient_fan_out():
    apple = fixture_event("open")
    apple["open"].update(ipAddress="17.58.101.4", userAgent="Mozilla/5.0")
    assert ses.normalize(_unsigned(apple))[0].machine_open is True
    scanner = fixture_event("open")
    scanner["open"]["timestamp"] = "2026-11-29T14:22:21.000Z"  # 3 s after sending
    scanner["open"]["userAgent"] = ""
    assert ses.normalize(_unsigned(scanner))[0].machine_open is True

    bounce = fixture_event("bounce_permanent")
    bounce["bounce"]["bouncedRecipients"].append(
        {"emailAddress": "john@example.com", "diagnosticCode": "smtp; 550 5.1.10 no such user"}
    )
    jane, john = ses.normalize(_unsigned(bounce))
    assert (jane.recipient, john.recipient) == (RECIPIENT, "john@example.com")
    assert john.reject_reason == "smtp; 550 5.1.10 no such user"
    ids = {jane.provider_event_id, john.provider_event_id}
    assert len(ids) == 2 and bounce["bounce"]["feedbackId"] not in ids
    assert ids == {e.provider_event_id for e in ses.normalize(_unsigned(bounce))}  # stable


def test_complaint_and_subscription_variants():
    not_spam = fixture_event("complaint")
    not_spam["complaint"]["complaintFeedbackType"] = "not-spam"
    (event,) = ses.normalize(_unsigned(not_spam))
    assert event.event_type == "unknown" and event.suppression_reason is None

    def subscription(new: dict, old: dict) -> str:
        raw = fixture_event("subscription")
        raw["subscription"].update(newTopicPreferences=new, oldTopicPreferences=old)
        return ses.normalize(_unsigned(raw))[0].event_type

    def topic(status: str) -> dict:
        return {"topicName": "news", "subscriptionStatus": status}

    opted_in = {"unsubscribeAll": False, "topicSubscriptionStatus": [topic("OptIn")]}
    opted_out = {"unsubscribeAll": False, "topicSubscriptionStatus": [topic("OptOut")]}
    assert subscription(opted_out, opted_in) == "unsubscribed"
    assert subscription(opted_in, opted_out) == "subscribed"
    assert subscription({"unsubscribeAll": True}, opted_in) == "unsubscribed"


def test_setup_messages_carry_no_events_and_unreadable_envelopes_are_malformed():
    """Unreadable SES events inside an authentic notification are in the contract."""
    assert (
        ses.normalize(
            _unsigned("Successfully validated SNS topic for Amazon SES event publishing.")
        )
        == []
    )
    succeeded = {"notificationType": "AmazonSnsSubscriptionSucceeded", "message": "ok"}
    assert ses.normalize(_unsigned(succeeded)) == []
    for name in ENVELOPES:
        assert ses.normalize((FIXTURES / f"{name}.json").read_bytes()) == []
    for body in (
        b"{not json",
        b"[]",
        b'{"Type": "Nonsense"}',
        _unsigned({"eventType": "Send", "mail": {"messageId": "x"}, "send": {}}).replace(
            b"2026-11-29T14:22:30.000Z", b"yesterday"
        ),  # no readable time anywhere
    ):
        with pytest.raises(WebhookMalformed):
            ses.normalize(body)


def test_what_the_send_adapter_sends_is_what_the_normalizer_reads_back():
    email = outgoing_email(
        event_id=EVENT_ID,
        idempotency_key=f"{EVENT_ID}:welcome/v2",
        to=RECIPIENT,
        template="welcome",
    )
    adapter = SesProvider(
        "https://email.us-east-1.amazonaws.com",
        region="us-east-1",
        credentials=Credentials("AKIDEXAMPLE", "secret"),
    )
    try:
        request = adapter.body(email)
        accepted = adapter.accepted(httpx.Response(200, json={"MessageId": SES_MESSAGE_ID}))
    finally:
        adapter.close()
    raw = fixture_event("delivery")
    # SES copies message tags into mail.tags (name -> [values]) and headers into mail.headers.
    raw["mail"]["tags"] = {t["Name"]: [t["Value"]] for t in request["EmailTags"]}
    raw["mail"]["headers"] = [
        {"name": h["Name"], "value": h["Value"]} for h in request["Content"]["Simple"]["Headers"]
    ]
    raw["mail"]["messageId"] = accepted.provider_message_id
    (event,) = ses.normalize(_unsigned(raw))
    assert (event.event_id, event.idempotency_key) == (email.event_id, email.idempotency_key)
    assert event.provider_message_id == accepted.provider_message_id
    # Without the header only the sanitized tag is left: not trusted as our key.
    raw["mail"]["headers"] = []
    (bare,) = ses.normalize(_unsigned(raw))
    assert (bare.event_id, bare.idempotency_key) == (EVENT_ID, None)


# ---- the verifier (no database) --------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("https://sns.us-east-1.amazonaws.com/SimpleNotificationService-abc.pem", True),
        ("https://sns.us-gov-west-1.amazonaws.com/SimpleNotificationService-abc.pem", True),
        ("https://sns.cn-north-1.amazonaws.com.cn/SimpleNotificationService-abc.pem", True),
        ("http://sns.us-east-1.amazonaws.com/SimpleNotificationService-abc.pem", False),
        ("https://sns.us-east-1.amazonaws.com.evil.example/x.pem", False),
        ("https://evil.example/sns.us-east-1.amazonaws.com/x.pem", False),
        ("https://sns.us-east-1.amazonaws.com@evil.example/x.pem", False),
        ("https://user@sns.us-east-1.amazonaws.com/x.pem", False),
        ("https://sns.us-east-1.amazonaws.com:8443/x.pem", False),
        ("https://evil.sns.us-east-1.amazonaws.com/x.pem", False),
        ("https://sqs.us-east-1.amazonaws.com/x.pem", False),
        ("https://sns.amazonaws.com/x.pem", False),
        ("https://SNS.us-east-1.amazonaws.com/x.pem", False),
        ("https://sns.us-east-1.amazonaws.com:x/x.pem", False),
        (None, False),
    ],
)
def test_only_amazon_sns_hosts_are_trusted(url, ok):
    assert ses.is_sns_url(url) is ok


def test_string_to_sign_follows_the_documentation():
    plain = notification(fixture_event("send"))
    titled = notification(fixture_event("send"), subject="Amazon SES Email Event Notification")
    confirm = confirmation()
    for message in (plain, titled, confirm):
        assert ses.string_to_sign(message) == documented_string_to_sign(message)
    assert b"Subject\n" not in ses.string_to_sign(plain)
    assert b"Token\n" in ses.string_to_sign(confirm)


def test_topic_allowlist_is_required_and_checked():
    for settings in ({}, {"ses_webhook_topic_arns": " , "}):
        with pytest.raises(ConfigurationError, match="TOPIC_ARNS"):
            ses.build_verifier(settings)
    with pytest.raises(ConfigurationError, match="not an SNS topic ARN"):
        ses.build_verifier({"ses_webhook_topic_arns": "email-platform-ses-events"})
    assert ses.build_verifier(SETTINGS).topic_arns == {TOPIC, OTHER_TOPIC}


def test_the_freshness_window(amazon):
    verifier = ses.build_verifier(SETTINGS, fetcher=amazon.fetch, confirmer=amazon.confirm)
    now = datetime.now(UTC)
    cases = [
        (now - timedelta(seconds=ses.MAX_AGE_S - 5), True),
        (now + timedelta(seconds=ses.MAX_SKEW_S - 5), True),
        (now - timedelta(seconds=ses.MAX_AGE_S + 5), False),
        (now + timedelta(seconds=ses.MAX_SKEW_S + 5), False),
    ]
    assert ses.MAX_AGE_S >= 3600  # SNS may retry an HTTP/S delivery for up to an hour
    for at, ok in cases:
        message = notification(fixture_event("send"), at=at)
        headers = {k.lower(): v for k, v in sns_headers(message).items()}
        body = json.dumps(message).encode()
        if ok:
            assert verifier.verify(headers, body, now) == message["MessageId"]
        else:
            with pytest.raises(WebhookRejected, match="Timestamp"):
                verifier.verify(headers, body, now)


def test_default_fetcher_refuses_redirects_and_sorts_failures(monkeypatch):
    calls: list[dict] = []

    def answer(status: int, content: bytes = b"pem"):  # type: ignore[no-untyped-def]
        def get(url: str, **kwargs):  # type: ignore[no-untyped-def]
            calls.append({"url": url, **kwargs})
            return httpx.Response(status, content=content)

        return get

    monkeypatch.setattr(ses.httpx, "get", answer(200))
    assert ses.fetch_certificate(CERT_URL) == b"pem"
    assert calls[-1]["follow_redirects"] is False and calls[-1]["timeout"] > 0
    monkeypatch.setattr(ses.httpx, "get", answer(404))
    with pytest.raises(WebhookRejected):
        ses.fetch_certificate(CERT_URL)
    for status in (301, 503):
        monkeypatch.setattr(ses.httpx, "get", answer(status))
        with pytest.raises(ses.SnsUnavailable):
            ses.confirm_subscription(CERT_URL)
    monkeypatch.setattr(ses.httpx, "get", answer(200, b"x" * (ses.MAX_CERTIFICATE_BYTES + 1)))
    with pytest.raises(WebhookRejected):
        ses.fetch_certificate(CERT_URL)

    def unreachable(url: str, **kwargs):  # type: ignore[no-untyped-def]
        raise httpx.ConnectError("no route to host")

    monkeypatch.setattr(ses.httpx, "get", unreachable)
    with pytest.raises(ses.SnsUnavailable):
        ses.fetch_certificate(CERT_URL)


# ---- through the receiver and the ingestor (SQLite and PostgreSQL) ---------------------------


def test_forged_stale_future_incomplete_and_off_host_deliveries_are_refused_unstored(
    engine, amazon
):
    _sent_message(engine)
    client = _client(engine, amazon)
    event = fixture_event("bounce_permanent")
    now = datetime.now(UTC)
    good = notification(event)

    def without(header: str) -> dict[str, str]:
        return {k: v for k, v in sns_headers(good).items() if k != header}

    tampered = {**good, "Message": good["Message"].replace("Permanent", "Transient")}
    v1_as_sha256 = sign({**good, "SignatureVersion": "2"})
    v1_as_sha256["SignatureVersion"] = "1"
    raw_delivery = json.dumps(event).encode()  # SNS raw message delivery: no envelope at all
    fetching_cases = {
        "forged key": notification(event, key=FORGER_KEY),
        "tampered message": tampered,
        "subject added": {**good, "Subject": "hello"},
        "version mismatch": v1_as_sha256,
        "expired certificate": notification(event, cert_url=EXPIRED_CERT_URL),
        "certificate missing at Amazon": notification(
            event, cert_url=CERT_URL.replace("9c6465fa", "00000000")
        ),
    }
    silent_cases = {
        "stale": notification(event, at=now - timedelta(seconds=ses.MAX_AGE_S + 60)),
        "future": notification(event, at=now + timedelta(seconds=ses.MAX_SKEW_S + 60)),
        "version 3": {**good, "SignatureVersion": "3"},
        "no signature": {k: v for k, v in good.items() if k != "Signature"},
        "signature not base64": {**good, "Signature": "%%%"},
        "topic not allowed": notification(
            event, topic="arn:aws:sns:us-east-1:999999999999:attacker"
        ),
        "no timestamp": {k: v for k, v in good.items() if k != "Timestamp"},
    }
    for bad_url in (
        "http://sns.us-east-1.amazonaws.com/SimpleNotificationService-a.pem",
        "https://sns.us-east-1.amazonaws.com.evil.example/SimpleNotificationService-a.pem",
        "https://evil.example/sns.us-east-1.amazonaws.com/SimpleNotificationService-a.pem",
        "https://sns.us-east-1.amazonaws.com@evil.example/SimpleNotificationService-a.pem",
        "https://sns.us-east-1.amazonaws.com/SimpleNotificationService-a.txt",
    ):
        silent_cases[bad_url] = notification(event, cert_url=bad_url)
    for case, message in {**fetching_cases, **silent_cases}.items():
        response = post(client, message)
        assert response.status_code == 401, (case, response.text)
    header_cases = {
        "no type header": without("x-amz-sns-message-type"),
        "no id header": without("x-amz-sns-message-id"),
        "no topic header": without("x-amz-sns-topic-arn"),
        "type header differs": {**sns_headers(good), "x-amz-sns-message-type": "Notification2"},
        "id header differs": {**sns_headers(good), "x-amz-sns-message-id": str(uuid.uuid4())},
    }
    for case, headers in header_cases.items():
        response = post(client, good, headers=headers)
        assert response.status_code == 401, (case, response.text)
    response = post(client, good, headers=sns_headers(good), body=raw_delivery)
    assert response.status_code == 401
    assert inbox_rows(engine) == []
    # Nothing but the two Amazon URLs was ever fetched, and each only once (cached).
    assert sorted(amazon.fetched) == sorted(
        [CERT_URL, EXPIRED_CERT_URL, CERT_URL.replace("9c6465fa", "00000000")]
    )
    # The untouched original still goes through: the refusals were about the changes.
    assert post(client, good).status_code == 200


def test_both_signature_versions_go_through_and_the_certificate_is_fetched_once(engine, amazon):
    client = _client(engine, amazon)
    for name in TABLE:  # legacy notifications as SignatureVersion 1 (SHA-1), the rest as 2
        message = notification(fixture_event(name), version="1" if "legacy" in name else "2")
        response = post(client, message)
        assert response.status_code == 200 and response.json()["status"] == "stored", name
    rows = inbox_rows(engine)
    assert len(rows) == len(TABLE)
    assert all(row.delivery_id == json.loads(row.body)["MessageId"] for row in rows)
    assert amazon.fetched == [CERT_URL]  # fetched once, then cached on the verifier


def test_the_same_event_published_to_a_second_topic_is_applied_once(engine, amazon):
    _sent_message(engine)
    client = _client(engine, amazon)
    for topic in (TOPIC, OTHER_TOPIC):  # both allowed: another SNS message, the same SES event
        response = post(client, notification(fixture_event("complaint"), topic=topic))
        assert response.status_code == 200 and response.json()["status"] == "stored"
    assert {row.headers["x-amz-sns-topic-arn"] for row in inbox_rows(engine)} == {
        TOPIC,
        OTHER_TOPIC,
    }
    outcome = ingest(engine, SIGNER)
    assert (outcome.claimed, outcome.applied, outcome.duplicates, outcome.suppressed) == (
        2,
        1,
        1,
        1,
    )


def test_subscription_is_confirmed_only_when_authentic(engine, amazon):
    client = _client(engine, amazon)
    good = confirmation()
    refused = {
        "forged": sign({**good}, key=FORGER_KEY),
        "subscribe url off Amazon": sign(
            {**good, "SubscribeURL": "https://evil.example/?Action=ConfirmSubscription"}
        ),
        "topic not allowed": sign({**good, "TopicArn": "arn:aws:sns:us-east-1:999999999999:x"}),
        "stale": sign(
            {**good, "Timestamp": iso(datetime.now(UTC) - timedelta(seconds=ses.MAX_AGE_S + 60))}
        ),
        "token changed": {**good, "Token": "0" * 64},
    }
    for case, message in refused.items():
        assert post(client, message).status_code == 401, case
    assert amazon.confirmed == [] and inbox_rows(engine) == []

    amazon.confirm_error = httpx.ConnectError("no route to host")
    assert post(client, good).status_code == 503  # SNS retries; nothing stored meanwhile
    assert inbox_rows(engine) == []
    amazon.confirm_error = None
    response = post(client, good)
    assert response.status_code == 200 and response.json()["status"] == "stored"
    assert post(client, good).json()["status"] == "duplicate"
    assert amazon.confirmed == [good["SubscribeURL"]] * 2  # the failed try, then the one
    outcome = ingest(engine, SIGNER)
    assert (outcome.claimed, outcome.applied, outcome.malformed) == (1, 0, 0)


def test_unsubscribe_confirmation_is_stored_without_confirming(engine, amazon):
    client = _client(engine, amazon)
    message = confirmation("sns_unsubscribe_confirmation")
    response = post(client, message)
    assert response.status_code == 200 and response.json()["status"] == "stored"
    assert amazon.confirmed == []
    assert ingest(engine, SIGNER).applied == 0


def test_amazon_unreachable_answers_503_so_sns_retries(engine, amazon):
    client = _client(engine, amazon)
    amazon.fetch_error = httpx.ConnectError("no route to host")
    message = notification(fixture_event("delivery"))
    assert post(client, message).status_code == 503
    assert inbox_rows(engine) == []
    amazon.fetch_error = None
    assert post(client, message).status_code == 200  # the retry goes through


def test_authentic_but_unreadable_is_stored_malformed_and_setup_notices_are_kept(engine, amazon):
    client = _client(engine, amazon)
    response = post(client, notification("this is not an SES event"))
    assert response.status_code == 400
    setup = notification("Successfully validated SNS topic for Amazon SES event publishing.")
    assert post(client, setup).status_code == 200
    malformed, kept = inbox_rows(engine)
    assert malformed.status == "malformed" and "SES event" in malformed.error
    assert kept.status == "pending"
    outcome = ingest(engine, SIGNER)
    assert (outcome.claimed, outcome.applied) == (1, 0)


def test_without_a_topic_allowlist_the_receiver_answers_503_and_stores_nothing(engine, amazon):
    response = post(_client(engine, amazon, settings={}), notification(fixture_event("send")))
    assert response.status_code == 503
    assert inbox_rows(engine) == [] and amazon.fetched == []
