"""The SES adapter against moto's SES server (software nobody here wrote), with moto's IAM checks
on: every request's SigV4 signature is recomputed from the IAM or STS secret, the access key must
exist, the session token must match its assumed role, and the caller's policies must allow
``ses:SendEmail``. Identities are verified the AWS way (``sesv2 CreateEmailIdentity`` through
boto3); a message sent is read back from moto's SES backend (``/moto-api/data.json``). Every
request body the adapter sent is checked against AWS's SES v2 model (``tests/ses_model.py``).

The server runs in the test process, on a port the OS picks, so test processes never collide;
a server that does not start fails the tests.
"""

import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import boto3
import httpx
import pytest
from botocore.credentials import Credentials
from moto.server import ThreadedMotoServer

from email_platform.common.errors import PermanentError, ProviderRejectedError
from email_platform.providers.base import OutgoingEmail
from email_platform.providers.ses import SesProvider
from email_platform.resources import EmailProviderResource
from tests.ses_model import send_email_problems
from tests.support import attempts_of, dead_letters_of, messages_of, run_send, signup

REGION = "us-east-1"
VERIFIED_DOMAIN = "example.com"
VERIFIED_SENDER = f"Example <no-reply@{VERIFIED_DOMAIN}>"
UNVERIFIED_SENDER = "Other <no-reply@unverified.example.org>"
EVENT_ID = "01JDQ5Z3K8M9N0P1Q2R3S4T5V6"
SEND_POLICY = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Action": "ses:SendEmail", "Resource": "*"}],
}


@dataclass
class Moto:
    url: str
    sender: Credentials  # an IAM user allowed ses:SendEmail
    temporary: Credentials  # an assumed role's, with its session token
    denied: Credentials  # an IAM user without ses:SendEmail

    def messages(self) -> list[dict[str, Any]]:
        """What moto's SES backend holds as sent."""
        with urllib.request.urlopen(f"{self.url}/moto-api/data.json", timeout=10) as answer:
            return json.load(answer)["ses"]["Message"]


class RecordingTransport(httpx.HTTPTransport):
    """Sends for real and keeps each request body, for the model check."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[dict[str, Any]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(request.read()))
        return super().handle_request(request)


def _post(url: str, data: bytes) -> None:
    # text/plain: moto reads the raw body, which a form content type would hide.
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "text/plain"})
    with urllib.request.urlopen(request, timeout=10):
        pass


@pytest.fixture(scope="module")
def moto() -> Iterator[Moto]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    _post(f"{url}/moto-api/reset", b"")
    setup = {
        "endpoint_url": url,
        "region_name": REGION,
        "aws_access_key_id": "AKIASETUPSETUPSETUP0",
        "aws_secret_access_key": "setup",
    }
    iam = boto3.client("iam", **setup)
    keys = {}
    for user, policy in (("sender", SEND_POLICY), ("denied", None)):
        iam.create_user(UserName=user)
        if policy:
            iam.put_user_policy(UserName=user, PolicyName="send", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=user)["AccessKey"]
        keys[user] = Credentials(key["AccessKeyId"], key["SecretAccessKey"])
    trust = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "sts:AssumeRole"}],
    }
    iam.create_role(RoleName="ses-sender", AssumeRolePolicyDocument=json.dumps(trust))
    iam.put_role_policy(
        RoleName="ses-sender", PolicyName="send", PolicyDocument=json.dumps(SEND_POLICY)
    )
    assumed = boto3.client("sts", **setup).assume_role(
        RoleArn="arn:aws:iam::123456789012:role/ses-sender", RoleSessionName="email-platform"
    )["Credentials"]
    # Verified the AWS way: sesv2 CreateEmailIdentity (moto verifies a domain at once).
    sesv2 = boto3.client("sesv2", **setup)
    sesv2.create_email_identity(EmailIdentity=VERIFIED_DOMAIN)
    assert [i["IdentityName"] for i in sesv2.list_email_identities()["EmailIdentities"]] == [
        VERIFIED_DOMAIN
    ]
    # From here on every request is authenticated and authorized (0 unchecked requests left).
    _post(f"{url}/moto-api/reset-auth", b"0")
    try:
        yield Moto(
            url=url,
            sender=keys["sender"],
            temporary=Credentials(
                assumed["AccessKeyId"], assumed["SecretAccessKey"], assumed["SessionToken"]
            ),
            denied=keys["denied"],
        )
    finally:
        _post(f"{url}/moto-api/reset-auth", b"inf")
        server.stop()


def outgoing(**overrides: Any) -> OutgoingEmail:
    values: dict[str, Any] = {
        "message_id": 7,
        "event_id": EVENT_ID,
        "idempotency_key": f"{EVENT_ID}:welcome",
        "sender": VERIFIED_SENDER,
        "to": "jane@example.net",
        "subject": "Welcome, Jane",
        "text": "Hello Jane",
        "html": "<p>Hello Jane</p>",
        "template": "welcome",
        "lane": "transactional",
        "headers": {"X-Email-Event-Id": EVENT_ID},
    }
    values.update(overrides)
    return OutgoingEmail(**values)


def send(moto: Moto, email: OutgoingEmail, credentials: Credentials) -> tuple[Any, list[dict]]:
    """One send through the adapter; what it returned (or raised) and the bodies it sent."""
    transport = RecordingTransport()
    ses = SesProvider(
        moto.url, region=REGION, credentials=credentials, transport=transport, timeout_s=10.0
    )
    try:
        try:
            return ses.send(email), transport.bodies
        except PermanentError as error:
            return error, transport.bodies
    finally:
        ses.close()


def sent_ids(moto: Moto) -> list[str]:
    return [message["id"] for message in moto.messages()]


def test_a_verified_sender_is_sent_once_signed_by_an_iam_user(moto):
    before = len(moto.messages())
    email = outgoing(
        to="jane@bücher.example.com",
        subject="Willkommen, Jane \U0001f389",
        lane="bulk",
        headers={
            "X-Email-Event-Id": EVENT_ID,
            "List-Unsubscribe": "<https://mail.example.com/u/" + "x" * 130 + ">",
            "List-Unsubscribe-Post": "List-Unsubscribe=One-Click",
        },
    )
    accepted, bodies = send(moto, email, moto.sender)
    messages = moto.messages()[before:]
    assert [m["id"] for m in messages] == [accepted.provider_message_id]
    (message,) = messages
    # The IDN domain arrived in Punycode, as AWS's model asks.
    assert message["destinations"] == {"ToAddresses": ["jane@xn--bcher-kva.example.com"]}
    assert message["source"] == VERIFIED_SENDER
    assert message["subject"] == "Willkommen, Jane \U0001f389"
    assert len(bodies) == 1 and send_email_problems(bodies[0]) == []


def test_temporary_credentials_sign_with_their_session_token(moto):
    accepted, bodies = send(moto, outgoing(), moto.temporary)
    assert accepted.provider_message_id in sent_ids(moto)
    assert send_email_problems(bodies[0]) == []
    # The token is checked: the same keys with another token are refused, nothing sent.
    forged = Credentials(moto.temporary.access_key, moto.temporary.secret_key, "forged-token")
    before = sent_ids(moto)
    error, _ = send(moto, outgoing(), forged)
    assert isinstance(error, ProviderRejectedError)
    assert (error.status_code, error.code) == (403, "InvalidClientTokenId")
    assert sent_ids(moto) == before


@pytest.mark.parametrize(
    ("who", "code"),
    [
        ("wrong secret", "SignatureDoesNotMatch"),
        ("unknown key", "InvalidClientTokenId"),
        ("no ses:SendEmail", "AccessDenied"),
    ],
)
def test_moto_checks_signatures_keys_and_permissions(moto, who, code):
    credentials = {
        "wrong secret": Credentials(moto.sender.access_key, "not-the-secret"),
        "unknown key": Credentials("AKIAUNKNOWNUNKNOWN00", "secret"),
        "no ses:SendEmail": moto.denied,
    }[who]
    before = sent_ids(moto)
    error, bodies = send(moto, outgoing(), credentials)
    assert isinstance(error, ProviderRejectedError)  # permanent: no retry fixes credentials
    assert error.code == code and error.status_code == 403
    assert len(bodies) == 1
    assert sent_ids(moto) == before


def test_an_unverified_sender_is_refused_permanently_as_message_rejected(moto):
    before = sent_ids(moto)
    error, bodies = send(moto, outgoing(sender=UNVERIFIED_SENDER), moto.sender)
    assert isinstance(error, ProviderRejectedError)
    assert (error.status_code, error.code) == (400, "MessageRejected")
    assert "not verified" in str(error)
    assert len(bodies) == 1 and send_email_problems(bodies[0]) == []
    assert sent_ids(moto) == before


def provider_resource(moto: Moto, sender: str) -> EmailProviderResource:
    return EmailProviderResource(
        provider="ses",
        base_url=moto.url,
        sender=sender,
        timeout_s=10.0,
        options_json=json.dumps(
            {
                "region": REGION,
                "access_key_id": moto.sender.access_key,
                "secret_access_key": moto.sender.secret_key,
            }
        ),
    )


def test_send_job_sends_once_through_moto_and_dead_letters_an_unverified_sender_at_once(
    moto, engine, database_url
):
    bodies: list[dict] = []
    build = SesProvider.build_request

    def recording(self: SesProvider, email: OutgoingEmail):  # type: ignore[no-untyped-def]
        request = build(self, email)
        bodies.append(json.loads(request.content))
        return request

    sent = signup(engine, "u1", email="jane@bücher.example.com")
    refused = signup(engine, "u2")
    before = len(moto.messages())
    with mock.patch.object(SesProvider, "build_request", autospec=True, side_effect=recording):
        good = run_send(
            database_url,
            "unused",
            "transactional",
            [sent],
            provider=provider_resource(moto, VERIFIED_SENDER),
        )
        bad = run_send(
            database_url,
            "unused",
            "transactional",
            [refused],
            provider=provider_resource(moto, UNVERIFIED_SENDER),
        )
    assert good.success and not bad.success

    (message,) = messages_of(engine, sent)
    assert message.status == "sent"
    new = moto.messages()[before:]
    assert [m["id"] for m in new] == [message.provider_message_id]  # once
    assert new[0]["destinations"] == {"ToAddresses": ["jane@xn--bcher-kva.example.com"]}
    assert [a.outcome for a in attempts_of(engine, sent)] == ["accepted"]

    # One attempt, then a dead letter that names SES's cause.
    assert [(a.outcome, a.http_status) for a in attempts_of(engine, refused)] == [
        ("permanent", 400)
    ]
    (letter,) = dead_letters_of(engine, refused)
    assert (letter.reason, letter.error_code) == ("provider_rejected", "MessageRejected")
    assert messages_of(engine, refused)[0].status == "dead"

    assert len(bodies) == 2
    assert [send_email_problems(body) for body in bodies] == [[], []]
