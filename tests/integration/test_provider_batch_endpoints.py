"""The providers' batch endpoints (issue 40): Postmark's ``/email/batch`` and Resend's
``/emails/batch``, read through the answers their documentation prints, and end to end through
the real send path against the sandbox speaking Postmark: one refused message is one dead
letter, the rest are sent once, each with its own idempotency key and metadata.
"""

import dataclasses
import json
from pathlib import Path

import httpx
import pytest

from email_platform.common.config import ProviderSettings
from email_platform.common.errors import ConfigurationError, PermanentError, TransientError
from email_platform.common.lanes import DEFAULT_LANE_CONFIGS, Lane
from email_platform.common.tags import tag_value
from email_platform.mail.addressing import Attachment
from email_platform.mail.provider_templates import ProviderTemplateCall
from email_platform.providers.base import Accepted, OutgoingEmail
from email_platform.providers.postmark import PostmarkProvider
from email_platform.providers.registry import open_provider
from email_platform.providers.resend import ResendProvider, batch_key
from email_platform.sandbox.asgi import BackgroundServer
from email_platform.sandbox.server import SandboxConfig, SandboxServer
from email_platform.sending.dispatch import attempt_many
from email_platform.sending.worker import LaneWorker
from tests.provider_stubs.resend import ResendStub
from tests.support import batch_sender, dead_letters_of, event, signup

ANSWERS = Path(__file__).resolve().parents[1] / "fixtures" / "provider_answers"


def _email(n: int, **changes) -> OutgoingEmail:  # type: ignore[no-untyped-def]
    base = OutgoingEmail(
        message_id=n,
        event_id=f"01JDQ5Z3K8M9N0P1Q2R3S4T5V{n}",
        idempotency_key=f"01JDQ5Z3K8M9N0P1Q2R3S4T5V{n}:welcome",
        sender="Example <no-reply@example.com>",
        to=f"receiver{n}@example.com",
        subject="Welcome",
        text="Hello",
        html=None,
        template="welcome",
        lane="bulk",
    )
    return dataclasses.replace(base, **changes)


def _recording(answer: httpx.Response | None = None, by_path=None):  # type: ignore[no-untyped-def]
    seen: list[httpx.Request] = []

    def respond(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return by_path(request) if by_path else answer

    return seen, httpx.MockTransport(respond)


def test_postmark_reads_its_documented_batch_answer_in_order():
    answer = httpx.Response(200, content=(ANSWERS / "postmark_batch.json").read_bytes())
    seen, transport = _recording(answer)
    provider = PostmarkProvider(server_token="t", batch_max=2, transport=transport)
    results = provider.send_many([_email(1), _email(2)])
    assert results == [
        Accepted("b7bc2f4a-e38e-4336-af7d-e6c392c2f817", 200),
        Accepted("e2ecbbfc-fe12-463d-b933-9fe22915106d", 200),
    ]
    (request,) = seen
    assert request.url.path == "/email/batch"
    body = json.loads(request.content)
    # Each entry is the single send's body: its own metadata and key.
    assert [entry["Metadata"]["idempotency_key"] for entry in body] == [
        _email(1).idempotency_key,
        _email(2).idempotency_key,
    ]
    assert body[0] == provider.build_request(_email(1)).json


def test_postmark_fails_only_the_entry_it_refused():
    entries = json.loads((ANSWERS / "postmark_batch.json").read_text())
    entries[1] = {"ErrorCode": 406, "Message": "You tried to send to an inactive recipient."}
    entries.append({"ErrorCode": 429, "Message": "Rate limit exceeded."})
    _, transport = _recording(httpx.Response(200, json=entries))
    provider = PostmarkProvider(server_token="t", batch_max=3, transport=transport)
    ok, refused, throttled = provider.send_many([_email(1), _email(2), _email(3)])
    assert isinstance(ok, Accepted)
    assert isinstance(refused, PermanentError) and refused.code == "406"
    assert isinstance(throttled, TransientError) and throttled.status_code == 429


def test_postmark_template_messages_go_to_batch_with_templates_and_mixed_ones_alone():
    call = ProviderTemplateCall("welcome-1", None, {"name": "Jo"})
    templated = [_email(1, provider_template=call), _email(2, provider_template=call)]
    answer = [{"ErrorCode": 0, "MessageID": f"m{n}"} for n in (1, 2)]
    seen, transport = _recording(httpx.Response(200, json=answer))
    provider = PostmarkProvider(server_token="t", batch_max=2, transport=transport)
    assert [r.provider_message_id for r in provider.send_many(templated)] == ["m1", "m2"]  # type: ignore[union-attr]
    (request,) = seen
    assert request.url.path == "/email/batchWithTemplates"
    messages = json.loads(request.content)["Messages"]
    assert [m["TemplateAlias"] for m in messages] == ["welcome-1", "welcome-1"]
    assert messages[0] == provider.build_request(templated[0]).json
    # One plain and one template message: the two endpoints take different bodies.
    with pytest.raises(ValueError, match="not both"):
        provider.build_batch_request([templated[0], _email(3)])


def test_resend_reads_its_documented_permissive_answer_by_index():
    answer = httpx.Response(200, content=(ANSWERS / "resend_batch_permissive.json").read_bytes())
    seen, transport = _recording(answer)
    provider = ResendProvider(api_key="re_x", batch_max=3, transport=transport)
    emails = [_email(1), _email(2), _email(3)]
    first, second, third = provider.send_many(emails)
    assert first == Accepted("ae2014de-c168-4c61-8267-70d2662a1ce1", 200)
    assert second == Accepted("faccb7a5-8a28-4e9a-ac64-8da1cc3bc1cb", 200)
    assert isinstance(third, PermanentError) and "`to` field is missing" in str(third)
    (request,) = seen
    assert request.url.path == "/emails/batch"
    assert request.headers["x-batch-validation"] == "permissive"
    # One key per request, derived from its messages' keys: the same batch retried is the same.
    assert request.headers["idempotency-key"] == batch_key(emails) == batch_key(list(emails))
    assert batch_key(emails[:2]) != batch_key(emails)
    tags = [{t["name"]: t["value"] for t in entry["tags"]} for entry in json.loads(request.content)]
    assert [t["event_id"] for t in tags] == [e.event_id for e in emails]


def test_resend_sends_a_message_with_attachments_alone():
    attached = _email(2, attachments=(Attachment("a.txt", "text/plain", b"hi"),))

    def by_path(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/emails/batch":
            return httpx.Response(200, json={"data": [{"id": "b1"}, {"id": "b3"}]})
        return httpx.Response(200, json={"id": "single"})

    seen, transport = _recording(by_path=by_path)
    provider = ResendProvider(api_key="re_x", batch_max=3, transport=transport)
    results = provider.send_many([_email(1), attached, _email(3)])
    assert [r.provider_message_id for r in results] == ["b1", "single", "b3"]  # type: ignore[union-attr]
    batch, single = sorted(seen, key=lambda r: r.url.path, reverse=True)
    assert len(json.loads(batch.content)) == 2
    assert single.headers["idempotency-key"] == attached.idempotency_key
    assert "attachments" in json.loads(single.content)


def test_a_whole_batch_refused_is_sent_one_a_call_so_only_the_culprit_fails():
    """Resend's strict mode, or a body Postmark refuses whole: the dispatcher sends the
    messages one a call instead, and only the one at fault becomes a failure."""
    bad = _email(2, to="nobody@invalid")

    def by_path(request: httpx.Request) -> httpx.Response:
        entries = json.loads(request.content)
        if any(entry["To"] == bad.to for entry in entries):
            return httpx.Response(422, json={"ErrorCode": 300, "Message": "Invalid 'To'."})
        return httpx.Response(200, json=[{"ErrorCode": 0, "MessageID": "m"} for _ in entries])

    seen, transport = _recording(by_path=by_path)
    provider = PostmarkProvider(server_token="t", batch_max=3, transport=transport)
    results = attempt_many(provider, [_email(1), bad, _email(3)])
    assert [type(r).__name__ for r in results] == [
        "Accepted",
        "ProviderRejectedError",
        "Accepted",
    ]
    assert len(seen) == 4  # the batch, then each message alone


def _batch_answered(body):  # type: ignore[no-untyped-def]
    """Paths called; the batch call answered 200 with ``body``, any other call 200 OK."""

    def by_path(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("batch"):
            return httpx.Response(200, json=body)
        return httpx.Response(200, json={"MessageID": "x", "ErrorCode": 0, "id": "x"})

    return _recording(by_path=by_path)


@pytest.mark.parametrize(
    "cls,options,body",
    [
        (PostmarkProvider, {"server_token": "t"}, [None, None]),
        (PostmarkProvider, {"server_token": "t"}, ["ok", "ok"]),
        (PostmarkProvider, {"server_token": "t"}, {"ErrorCode": 0}),
        (ResendProvider, {"api_key": "k"}, [{"id": "a"}, {"id": "b"}]),
        (ResendProvider, {"api_key": "k"}, {"data": []}),
        (ResendProvider, {"api_key": "k"}, {"data": [{"id": "a"}], "errors": [{"index": 7}]}),
    ],
)
def test_a_200_batch_answer_that_cannot_be_read_sends_nothing_again(cls, options, body):  # type: ignore[no-untyped-def]
    """Invariant 3: answered 200, the batch's messages may be accepted; an answer we cannot
    read is each message's transient failure (retried under its key), never a second call."""
    seen, transport = _batch_answered(body)
    provider = cls(batch_max=2, transport=transport, **options)
    results = attempt_many(provider, [_email(1), _email(2)])
    assert len(seen) == 1, [r.url.path for r in seen]
    assert all(isinstance(r, TransientError) for r in results), results
    assert {r.code for r in results} == {"unreadable_response"}  # type: ignore[union-attr]


def test_one_unreadable_entry_leaves_the_entries_read_beside_it_accepted():
    """Invariant 3: entry 0 was accepted with its id; retrying it would send it twice (Postmark
    has no key). Only the entry without a MessageID is unreadable, as a single send's is."""
    body = [{"ErrorCode": 0, "MessageID": "a"}, {"ErrorCode": 0}, None]
    seen, transport = _batch_answered(body)
    provider = PostmarkProvider(server_token="t", batch_max=3, transport=transport)
    first, second, third = attempt_many(provider, [_email(1), _email(2), _email(3)])
    assert first == Accepted("a", 200)
    for unread in (second, third):
        assert isinstance(unread, TransientError) and unread.code == "unreadable_response"
    assert len(seen) == 1


def test_resend_an_attachment_call_that_raises_does_not_send_the_batch_again():
    """The batch call accepted messages 1 and 2; the attachment message's own call raising
    (any error, a database error of the shared limiter included) is that message's result."""
    attached = _email(3, attachments=(Attachment("a.txt", "text/plain", b"x"),))

    def by_path(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/emails/batch":
            count = len(json.loads(request.content))
            return httpx.Response(200, json={"data": [{"id": f"id{i}"} for i in range(count)]})
        raise ValueError("the adapter chokes on this one message")

    seen, transport = _recording(by_path=by_path)
    provider = ResendProvider(api_key="k", batch_max=3, transport=transport)
    results = attempt_many(provider, [_email(1), _email(2), attached])
    assert [r.url.path for r in seen] == ["/emails/batch", "/emails"]
    assert results[:2] == [Accepted("id0", 200), Accepted("id1", 200)]
    assert isinstance(results[2], PermanentError) and "ValueError" in str(results[2])


def test_batch_max_is_read_from_the_environment_and_checked():
    env = {"EMAIL_PLATFORM_POSTMARK_API_KEY": "t", "EMAIL_PLATFORM_POSTMARK_BATCH_MAX": "500"}
    provider = open_provider(ProviderSettings.from_env(env, provider="postmark"), max_connections=1)
    assert provider.batch_max == 500  # type: ignore[attr-defined]
    provider.close()
    # Off unless asked: one message a call.
    plain = open_provider(
        ProviderSettings.from_env({"EMAIL_PLATFORM_RESEND_API_KEY": "k"}, provider="resend"),
        max_connections=1,
    )
    assert plain.batch_max == 1  # type: ignore[attr-defined]
    plain.close()
    for name, value in (("POSTMARK", "501"), ("RESEND", "101"), ("RESEND", "many")):
        bad = {f"EMAIL_PLATFORM_{name}_API_KEY": "k", f"EMAIL_PLATFORM_{name}_BATCH_MAX": value}
        with pytest.raises(ConfigurationError, match=r"(?i)batch"):
            open_provider(ProviderSettings.from_env(bad, provider=name.lower()), max_connections=1)


def test_postmark_batches_through_the_send_path_one_refusal_one_dead_letter(engine):
    """A lane worker drains 30 signups through the Postmark adapter in batches of 10 against
    the sandbox speaking Postmark; one recipient is refused (ErrorCode 406)."""
    ids = [signup(engine, f"u{i}") for i in range(29)]
    refused = signup(engine, "bad", email="bad+reject@example.com")
    lane = dataclasses.replace(
        DEFAULT_LANE_CONFIGS[Lane.TRANSACTIONAL],
        batch_size=30,
        concurrency=2,
        worker_poll_s=0.02,
        worker_idle_s=0.3,
    )
    with SandboxServer(SandboxConfig()) as url:
        provider = PostmarkProvider(url, server_token="t", batch_max=10, timeout_s=5)
        sender = batch_sender(engine, provider, lane)
        LaneWorker(sender=sender, engine=engine, lane=lane, run_id="w-1").run()
        provider.close()
        stats = httpx.get(f"{url}/_sandbox/stats").json()
        accepted = httpx.get(f"{url}/_sandbox/messages").json()["messages"]
    assert stats["batch_requests"] >= 3 and stats["requests"] < 30
    # The rest sent once each, with its own key and event id in Postmark's Metadata.
    assert sorted(m["idempotency_key"] for m in accepted) == sorted(f"{i}:welcome" for i in ids)
    assert all(m["metadata"]["idempotency_key"] == m["idempotency_key"] for m in accepted)
    assert {m["metadata"]["event_id"] for m in accepted} == set(ids)
    assert all(event(engine, i).status == "done" for i in ids)
    (letter,) = dead_letters_of(engine, refused)
    assert letter.error_code == "406" and "inactive" in letter.last_error


def test_resend_batches_through_the_send_path_one_refusal_one_dead_letter(engine):
    """The same drain through the Resend adapter against a Resend stub that speaks
    ``/emails/batch`` (strict and permissive, attachments refused): the refused entry is one
    dead letter, the rest are sent once, each with its own key in its tags."""
    ids = [signup(engine, f"u{i}") for i in range(29)]
    refused = signup(engine, "bad", email="bad+invalid@example.com")
    lane = dataclasses.replace(
        DEFAULT_LANE_CONFIGS[Lane.TRANSACTIONAL],
        batch_size=30,
        concurrency=2,
        worker_poll_s=0.02,
        worker_idle_s=0.3,
    )
    stub = ResendStub(api_key="re_test")
    with BackgroundServer(stub.app) as url:
        provider = ResendProvider(url, api_key="re_test", batch_max=10, timeout_s=5)
        sender = batch_sender(engine, provider, lane)
        LaneWorker(sender=sender, engine=engine, lane=lane, run_id="w-1").run()
        provider.close()
    assert stub.batch_requests >= 3
    keys = [{t["name"]: t["value"] for t in m["tags"]}["idempotency_key"] for m in stub.accepted]
    assert sorted(keys) == sorted(tag_value(f"{i}:welcome") for i in ids)
    assert all(event(engine, i).status == "done" for i in ids)
    (letter,) = dead_letters_of(engine, refused)
    assert letter.error_code == "validation_error" and "Invalid `to`" in letter.last_error
