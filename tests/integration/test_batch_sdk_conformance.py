"""Our batch requests against the ones the providers' official SDKs build for the same
messages: ``postmark-python``'s ``outbound.send_batch`` and ``resend``'s ``Batch.send`` (with
the batch's idempotency key and permissive validation), captured at each SDK's transport as
``test_provider_sdk_conformance`` does for single sends, whose messages and allowed
differences (each with its reason) hold entry by entry here.
"""

import contextlib
from typing import Any
from unittest import mock

import httpx
import postmark.sync
import resend

from email_platform.providers.base import OutgoingEmail
from email_platform.providers.postmark import PostmarkProvider
from email_platform.providers.resend import ResendProvider, batch_key
from tests.integration.test_provider_sdk_conformance import (  # noqa: F401 (a fixture)
    KEY,
    MESSAGES,
    NAMES,
    Wire,
    assert_conformant,
    metadata,
    requests_sent,
    resend_params,
    wire,
)

EMAILS = list(MESSAGES.values())


def _ours(provider: Any) -> Wire:
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/emails/batch":
            return httpx.Response(200, json={"data": [{"id": "x"} for _ in EMAILS]})
        return httpx.Response(200, json=[{"ErrorCode": 0, "MessageID": "x"} for _ in EMAILS])

    adapter = provider(httpx.MockTransport(answer))
    try:
        adapter.send_many(EMAILS)
    finally:
        adapter.close()
    (request,) = seen
    names = NAMES["postmark"] if isinstance(adapter, PostmarkProvider) else RESEND_NAMES
    return wire(request.method, str(request.url), request.headers, request.content, names)


RESEND_NAMES = (*NAMES["resend"], "x-batch-validation")


def _postmark_message(email: OutgoingEmail) -> dict[str, Any]:
    message: dict[str, Any] = {
        "sender": email.sender,
        "to": email.to,
        "subject": email.subject,
        "text_body": email.text,
        "headers": [{"Name": k, "Value": v} for k, v in email.headers.items()],
        "tag": email.template,
        "metadata": metadata(email),
        "message_stream": "outbound",
    }
    if email.html is not None:
        message["html_body"] = email.html
    return message


def _postmark_sdk() -> Wire:
    sent: list[httpx.Request] = []

    async def send(self: httpx.AsyncClient, request: httpx.Request, **_: Any) -> httpx.Response:
        sent.append(request)
        answers = [
            {
                "To": e.to,
                "SubmittedAt": "2026-12-06T03:00:00Z",
                "MessageID": "m",
                "ErrorCode": 0,
                "Message": "OK",
            }
            for e in EMAILS
        ]
        return httpx.Response(200, json=answers, request=request)

    with (
        mock.patch.object(httpx.AsyncClient, "send", autospec=True, side_effect=send),
        postmark.sync.ServerClient(KEY) as client,
    ):
        client.outbound.send_batch([_postmark_message(e) for e in EMAILS])
    (request,) = sent
    return wire(
        request.method, str(request.url), request.headers, request.content, NAMES["postmark"]
    )


def _entries(whole: Wire) -> list[Wire]:
    return [Wire(whole.method, whole.path, whole.headers, body) for body in whole.body]


def test_a_postmark_batch_is_what_postmark_python_sends():
    our, sdk = (
        _ours(lambda t: PostmarkProvider(server_token=KEY, batch_max=10, transport=t)),
        (_postmark_sdk()),
    )
    assert (our.method, our.path, our.headers) == (sdk.method, sdk.path, sdk.headers)
    assert our.path == "/email/batch" and len(our.body) == len(sdk.body) == len(EMAILS)
    for email, mine, theirs in zip(EMAILS, _entries(our), _entries(sdk), strict=True):
        assert_conformant("postmark", email, mine, theirs)


def test_a_resend_batch_is_what_the_resend_sdk_sends(requests_sent):  # noqa: F811
    our = _ours(lambda t: ResendProvider(api_key=KEY, batch_max=10, transport=t))
    options = {"idempotency_key": batch_key(EMAILS), "batch_validation": "permissive"}
    # Only the request matters: the fixture's canned answer is a single send's.
    with mock.patch.object(resend, "api_key", KEY), contextlib.suppress(Exception):
        resend.Batch.send([resend_params(e) for e in EMAILS], options)  # type: ignore[arg-type,typeddict-item]
    (request,) = requests_sent
    sdk = wire(request.method, request.url, request.headers, request.body, RESEND_NAMES)
    assert (our.method, our.path, our.headers) == (sdk.method, sdk.path, sdk.headers)
    assert our.headers["x-batch-validation"] == "permissive"
    assert our.path == "/emails/batch" and len(our.body) == len(EMAILS)
    for email, mine, theirs in zip(EMAILS, _entries(our), _entries(sdk), strict=True):
        assert_conformant("resend", email, mine, theirs)
