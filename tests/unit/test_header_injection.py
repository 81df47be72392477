"""Header injection never reaches the wire, whichever adapter sends, and clean mail still does.

Every adapter promises to refuse, before it builds a request, a message whose sender, recipient,
subject, custom header names or custom header values hold a line separator, raw or hidden in an
RFC 2047 encoded word (``email_platform.mail.headers.unsafe_header_reason``): ``PermanentError``
with code ``header_injection``, and in a batch call the refused message's own result while the
others still go out. These tests check that promise where it matters, at the server:

* HTTP adapters (sandbox, Postmark, SendGrid, Mailgun, SES, Resend) send to a real loopback
  server (the sandbox server, or the provider stubs in ``tests/provider_stubs``) wrapped in an
  ASGI recorder that sees every request the socket delivers. For each payload (raw CRLF, bare
  LF, bare CR, NUL, U+2028, Q and B encoded words, an encoded word glued to text, one left
  unterminated, an encoded word inside an encoded word) in each field (subject, to, sender
  display name, header value, header name) the adapter refuses, the server receives no request
  at all, and a clean message sent right after is received with its non-ASCII subject intact.
* The sandbox batch endpoint: one poisoned message among nine good ones in one ``send_many`` is
  refused on its own; the one request that goes out carries exactly the nine, all accepted.
* SMTP against the real aiosmtpd server: nothing of a refused message is delivered (no
  connection, no RCPT, no DATA), a legitimate non-ASCII subject decodes back exactly and carries
  no ``Bcc``, and no message received during a test has a raw line starting with ``Bcc:``. A
  property test sends generated encoded-word values in the subject and in a header value: each
  is either refused before the server sees anything, or arrives with exactly the header lines
  of a clean message.
* ``unsafe_header_reason`` does not over-refuse: ordinary values (tabs, non-ASCII names, clean
  encoded words) pass, and the ordinary messages are accepted by every adapter.
"""

import base64
import email
import email.policy
import itertools
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from email.header import decode_header, make_header
from typing import Any
from urllib.parse import parse_qs

import httpx
import pytest
from botocore.credentials import Credentials
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from email_platform.common.errors import DeliveryError, PermanentError
from email_platform.mail.headers import unsafe_header_reason
from email_platform.providers.base import Accepted, OutgoingEmail, header_problem
from email_platform.providers.http import HttpProvider
from email_platform.providers.mailgun import MailgunProvider
from email_platform.providers.postmark import PostmarkProvider
from email_platform.providers.resend import ResendProvider
from email_platform.providers.sandbox import SandboxProvider
from email_platform.providers.sendgrid import SendGridProvider
from email_platform.providers.ses import SEND_EMAIL_PATH, SesProvider
from email_platform.providers.smtp import SmtpProvider
from email_platform.sandbox.asgi import BackgroundServer
from email_platform.sandbox.server import SandboxConfig, SandboxServer
from tests.provider_stubs.mailgun import MailgunStub
from tests.provider_stubs.postmark import PostmarkStub
from tests.provider_stubs.resend import ResendStub
from tests.provider_stubs.sendgrid import SendGridStub
from tests.provider_stubs.ses import ACCESS_KEY, SECRET_KEY, SesStub
from tests.provider_stubs.smtp import SmtpStub

# ---- payloads and where they go -----------------------------------------------------------------

_Q_WORD = "=?utf-8?q?Jane=0D=0ABcc:_evil@attacker.example?="
PAYLOADS: dict[str, str] = {
    "crlf": "Jane\r\nBcc: evil@attacker.example",
    "lf": "Jane\nBcc: evil@attacker.example",
    "cr": "Jane\rBcc: evil@attacker.example",
    "nul": "Jane\x00Bcc: evil@attacker.example",
    "u2028": "Jane\u2028Bcc: evil@attacker.example",
    "q-encoded": _Q_WORD,
    "b-encoded": "=?utf-8?b?SmFuZQ0KQmNjOiBldmlsQGF0dGFja2VyLmV4YW1wbGUNCg0KYm9keQ==?=",
    "glued-encoded": "Jane=?utf-8?q?=0D=0ABcc:x?=",
    # No closing ``?=``: the legacy decoder leaves it alone, the modern parser (the one the SMTP
    # adapter's mail library writes headers with) decodes it all the same where a word starts.
    "unterminated-encoded": "=?utf-8?q?=0D=0ABcc:_evil@attacker.example",
    # An encoded word whose decoded text is the Q-encoded word above: CR LF after two decodings.
    "doubly-encoded": f"=?utf-8?b?{base64.b64encode(_Q_WORD.encode()).decode()}?=",
}

#: How each field carries a payload: the ``OutgoingEmail`` fields it overrides.
FIELDS: dict[str, Callable[[str], dict[str, Any]]] = {
    "subject": lambda p: {"subject": f"Welcome, {p}"},
    "to": lambda p: {"to": f"{p} <jane@example.com>"},
    "sender-display-name": lambda p: {"sender": f"{p} <no-reply@example.com>"},
    "header-value": lambda p: {"headers": {"X-Campaign": p}},
    "header-name": lambda p: {"headers": {f"X-{p}": "1"}},
}

#: Every (field, payload) pair but one: an unterminated word glued to the ``X-`` of a header name
#: is decoded by no parser (no mail library decodes field names, and the modern parser decodes
#: an unterminated word only where a word starts), so nothing can inject through it.
CASES = [
    pytest.param(field_name, payload, id=f"{field_name}-{payload_id}")
    for field_name in FIELDS
    for payload_id, payload in PAYLOADS.items()
    if (field_name, payload_id) != ("header-name", "unterminated-encoded")
]

#: In the text body of every refused message: if any of its bytes reach a server, this shows.
POISON = "POISONED-BODY-MUST-NOT-REACH-THE-WIRE"
CLEAN_SUBJECT = "Jérôme's café ☕"
CLEAN_SENDER = "Jérôme Müller <no-reply@example.com>"

_serial = itertools.count(1)


def outgoing(**overrides: Any) -> OutgoingEmail:
    """A clean message with its own event id and idempotency key (stubs dedupe on keys)."""
    n = next(_serial)
    event_id = f"01JINJ{n:020d}"
    values: dict[str, Any] = {
        "message_id": n,
        "event_id": event_id,
        "idempotency_key": f"{event_id}:welcome",
        "sender": CLEAN_SENDER,
        "to": "jane@example.com",
        "subject": CLEAN_SUBJECT,
        "text": "Hello Jane, your order has shipped.",
        "html": "<p>Hello Jane, your order has shipped.</p>",
        "template": "welcome",
        "lane": "transactional",
        "headers": {"X-Campaign": "spring-sale"},
    }
    values.update(overrides)
    return OutgoingEmail(**values)


def poisoned(field_name: str, payload: str) -> OutgoingEmail:
    email_ = outgoing(text=POISON, html=f"<p>{POISON}</p>", **FIELDS[field_name](payload))
    assert header_problem(email_) is not None  # the test's premise: this message is refused
    return email_


def assert_refused(error: object) -> None:
    assert isinstance(error, PermanentError), repr(error)
    assert error.code == "header_injection", repr(error)


# ---- what reaches an HTTP server ----------------------------------------------------------------


@dataclass(frozen=True)
class WireRequest:
    method: str
    path: str
    body: bytes


class WireRecorder:
    """ASGI middleware: records every HTTP request as it arrives, before the app sees it.

    Only the sandbox's inspection endpoints (``/_sandbox/...``, which the tests themselves call)
    are left out.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.requests: list[WireRequest] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith("/_sandbox/"):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        with self.lock:
            self.requests.append(WireRequest(scope["method"], scope["path"], body))
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def count(self) -> int:
        with self.lock:
            return len(self.requests)

    def bodies(self) -> list[bytes]:
        with self.lock:
            return [request.body for request in self.requests]


@dataclass
class HttpHarness:
    """One adapter in front of its server, and what that server recorded."""

    name: str
    provider: HttpProvider
    wire: WireRecorder
    #: (idempotency key, subject) of every message the server accepted, in order.
    accepted: Callable[[], list[tuple[str, str]]]
    #: Send requests as the server itself counted them: the sandbox's ``/_sandbox/stats``
    #: counter, or the stub's own request log.
    server_requests: Callable[[], int]


def _serve(stack: ExitStack, app: ASGIApp) -> tuple[str, WireRecorder]:
    wire = WireRecorder(app)
    url = stack.enter_context(BackgroundServer(wire))
    return url, wire


def _sandbox(stack: ExitStack) -> HttpHarness:
    server = SandboxServer(SandboxConfig())
    wire = WireRecorder(server.app)
    server.app = wire  # served through the recorder: the app runs only once started
    url = stack.enter_context(server)
    provider = SandboxProvider(url, batch_max=1, timeout_s=5.0)
    stack.callback(provider.close)
    inspect = stack.enter_context(httpx.Client(base_url=url, timeout=5.0))

    def accepted() -> list[tuple[str, str]]:
        listed = inspect.get("/_sandbox/messages").json()["messages"]
        return [(m["idempotency_key"], m["subject"]) for m in listed]

    def server_requests() -> int:
        return inspect.get("/_sandbox/stats").json()["requests"]

    return HttpHarness("sandbox", provider, wire, accepted, server_requests)


def _postmark(stack: ExitStack) -> HttpHarness:
    stub = PostmarkStub(server_token="pm-token")
    url, wire = _serve(stack, stub.app)
    provider = PostmarkProvider(url, server_token="pm-token", timeout_s=5.0)
    stack.callback(provider.close)
    return HttpHarness(
        "postmark",
        provider,
        wire,
        lambda: [(b["Metadata"]["idempotency_key"], b["Subject"]) for b in stub.accepted],
        lambda: len(stub.requests),
    )


def _sendgrid(stack: ExitStack) -> HttpHarness:
    stub = SendGridStub("SG.key")
    url, wire = _serve(stack, stub.app)
    provider = SendGridProvider(url, api_key="SG.key", timeout_s=5.0)
    stack.callback(provider.close)
    return HttpHarness(
        "sendgrid",
        provider,
        wire,
        lambda: [
            (a["body"]["custom_args"]["idempotency_key"], a["body"]["subject"])
            for a in stub.accepted
        ],
        lambda: len(stub.requests),
    )


def _mailgun(stack: ExitStack) -> HttpHarness:
    stub = MailgunStub("key-mg", "mg.example.com")
    url, wire = _serve(stack, stub.app)
    provider = MailgunProvider(url, api_key="key-mg", domain="mg.example.com", timeout_s=5.0)
    stack.callback(provider.close)
    return HttpHarness(
        "mailgun",
        provider,
        wire,
        lambda: [(a["form"]["v:idempotency_key"], a["form"]["subject"]) for a in stub.accepted],
        lambda: len(stub.requests),
    )


def _ses(stack: ExitStack) -> HttpHarness:
    # SesStub serves its endpoint itself; the same endpoint is served here behind the recorder.
    stub = SesStub()
    app = Starlette(routes=[Route(SEND_EMAIL_PATH, stub._send, methods=["POST"])])
    url, wire = _serve(stack, app)
    provider = SesProvider(
        url, region=stub.region, credentials=Credentials(ACCESS_KEY, SECRET_KEY), timeout_s=5.0
    )
    stack.callback(provider.close)
    return HttpHarness(
        "ses",
        provider,
        wire,
        lambda: [(m["headers"]["X-Email-Idempotency-Key"], m["subject"]) for m in stub.messages],
        lambda: len(stub.answers),  # every request the endpoint answered, refused or not
    )


def _resend(stack: ExitStack) -> HttpHarness:
    stub = ResendStub(api_key="re_key")
    url, wire = _serve(stack, stub.app)
    provider = ResendProvider(url, api_key="re_key", timeout_s=5.0)
    stack.callback(provider.close)
    return HttpHarness(
        "resend",
        provider,
        wire,
        lambda: [(a["idempotency_key"], a["subject"]) for a in stub.accepted],
        lambda: len(stub.requests),
    )


HTTP_ADAPTERS: dict[str, Callable[[ExitStack], HttpHarness]] = {
    "sandbox": _sandbox,
    "postmark": _postmark,
    "sendgrid": _sendgrid,
    "mailgun": _mailgun,
    "ses": _ses,
    "resend": _resend,
}


@pytest.fixture(scope="module", params=list(HTTP_ADAPTERS))
def http(request: pytest.FixtureRequest) -> Iterator[HttpHarness]:
    with ExitStack() as stack:
        harness = HTTP_ADAPTERS[request.param](stack)
        yield harness
        # Whatever happened in the tests, no byte of a refused message was ever received.
        assert not [body for body in harness.wire.bodies() if POISON.encode() in body]


def _send_clean_and_check(harness: HttpHarness) -> None:
    """A clean message right after: exactly one request, received with its subject intact."""
    wire_before, accepted_before = harness.wire.count(), len(harness.accepted())
    clean = outgoing()
    result = harness.provider.send(clean)
    assert isinstance(result, Accepted) and result.provider_message_id
    assert harness.wire.count() == wire_before + 1
    # On the wire itself, as the adapter encoded it (JSON, or Mailgun's form)...
    assert CLEAN_SUBJECT in _wire_strings(harness.wire.requests[-1].body)
    # ... and as the server read and accepted it.
    accepted = harness.accepted()
    assert len(accepted) == accepted_before + 1
    assert accepted[-1] == (clean.idempotency_key, CLEAN_SUBJECT)


def _wire_strings(body: bytes) -> list[str]:
    """Every string value of a request body: a JSON document's, or a form's."""
    try:
        document = json.loads(body)
    except ValueError:
        return [v for values in parse_qs(body.decode()).values() for v in values]
    found: list[str] = []
    stack = [document]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


@pytest.mark.parametrize(("field_name", "payload"), CASES)
def test_http_adapter_refuses_injection_before_any_request(
    http: HttpHarness, field_name: str, payload: str
) -> None:
    wire_before = http.wire.count()
    server_before = http.server_requests()
    accepted_before = http.accepted()

    with pytest.raises(PermanentError) as caught:
        http.provider.send(poisoned(field_name, payload))

    assert_refused(caught.value)
    assert http.wire.count() == wire_before  # not one request reached the socket
    assert http.server_requests() == server_before
    assert http.accepted() == accepted_before
    _send_clean_and_check(http)


# ---- the sandbox batch endpoint -----------------------------------------------------------------


@dataclass
class SandboxBatch:
    provider: SandboxProvider
    wire: WireRecorder
    inspect: httpx.Client

    def stats(self) -> dict:
        return self.inspect.get("/_sandbox/stats").json()

    def keys(self) -> list[str]:
        listed = self.inspect.get("/_sandbox/messages").json()["messages"]
        return [m["idempotency_key"] for m in listed]


@pytest.fixture(scope="module")
def sandbox_batch() -> Iterator[SandboxBatch]:
    server = SandboxServer(SandboxConfig())
    wire = WireRecorder(server.app)
    server.app = wire
    with server as url, httpx.Client(base_url=url, timeout=5.0) as inspect:
        provider = SandboxProvider(url, batch_max=10, timeout_s=5.0)
        yield SandboxBatch(provider, wire, inspect)
        provider.close()
    assert not [body for body in wire.bodies() if POISON.encode() in body]


def _run_batch(
    sandbox: SandboxBatch, emails: list[OutgoingEmail], bad: set[int]
) -> list[Accepted | DeliveryError]:
    wire_before = sandbox.wire.count()
    stats_before = sandbox.stats()
    keys_before = sandbox.keys()

    results = sandbox.provider.send_many(emails)

    assert len(results) == len(emails)
    for index, result in enumerate(results):
        if index in bad:
            assert_refused(result)
        else:
            assert isinstance(result, Accepted) and result.status_code == 200, (index, result)
    good = [e for i, e in enumerate(emails) if i not in bad]
    calls = sandbox.wire.requests[wire_before:]
    stats = sandbox.stats()
    if not good:
        assert calls == []
        assert stats["requests"] == stats_before["requests"]
        assert sandbox.keys() == keys_before
        return results
    # One call, to the batch endpoint, carrying exactly the good messages in order.
    assert [(c.method, c.path) for c in calls] == [("POST", "/v1/send/batch")]
    sent = json.loads(calls[0].body)["messages"]
    assert [m["idempotency_key"] for m in sent] == [e.idempotency_key for e in good]
    assert stats["batch_requests"] == stats_before["batch_requests"] + 1
    assert stats["accepted"] == stats_before["accepted"] + len(good)
    assert sandbox.keys() == keys_before + [e.idempotency_key for e in good]
    ids = [r.provider_message_id for r in results if isinstance(r, Accepted)]
    assert len(set(ids)) == len(good)
    return results


@pytest.mark.parametrize(("field_name", "payload"), CASES)
def test_sandbox_batch_refuses_the_poisoned_message_and_sends_the_nine_others(
    sandbox_batch: SandboxBatch, field_name: str, payload: str
) -> None:
    emails = [outgoing(to=f"u{i}@example.com") for i in range(10)]
    emails[3] = poisoned(field_name, payload)
    _run_batch(sandbox_batch, emails, bad={3})


@pytest.mark.parametrize(
    "bad",
    [{0}, {9}, {0, 9}, {2, 3, 7}, set(range(10))],
    ids=["first", "last", "first-and-last", "three", "all"],
)
def test_sandbox_batch_keeps_each_result_in_place_wherever_the_poison_is(
    sandbox_batch: SandboxBatch, bad: set[int]
) -> None:
    emails = [
        poisoned("subject", "Jane\r\nBcc: evil@attacker.example")
        if i in bad
        else outgoing(to=f"u{i}@example.com")
        for i in range(10)
    ]
    _run_batch(sandbox_batch, emails, bad=bad)


# ---- SMTP ---------------------------------------------------------------------------------------


@dataclass
class SmtpHarness:
    stub: SmtpStub
    provider: SmtpProvider

    def rcpts(self) -> int:
        """Every RCPT TO the server answered (what the stub counts its faults by)."""
        return sum(self.stub._seen.values())


@pytest.fixture(scope="module")
def smtp() -> Iterator[SmtpHarness]:
    with SmtpStub() as stub:
        provider = SmtpProvider("127.0.0.1", stub.port, starttls="false", timeout_s=5.0)
        try:
            yield SmtpHarness(stub, provider)
        finally:
            provider.close()
        assert all(POISON.encode() not in r.raw for r in stub.received)


def _raw_header_lines(raw: bytes) -> list[bytes]:
    head = raw.replace(b"\r\n", b"\n").split(b"\n\n", 1)[0]
    return head.split(b"\n")


def _assert_no_bcc_line_anywhere(stub: SmtpStub) -> None:
    for received in stub.received:
        lines = received.raw.replace(b"\r\n", b"\n").split(b"\n")
        assert not [line for line in lines if line.lower().startswith(b"bcc:")], received.raw


def _decoded_subject(raw: bytes) -> str:
    """The Subject as the legacy decoder reads it off the raw header lines (unfolded)."""
    lines = _raw_header_lines(raw)
    start = next(i for i, line in enumerate(lines) if line.lower().startswith(b"subject:"))
    value = lines[start][len(b"subject:") :]
    for line in lines[start + 1 :]:
        if line[:1] not in (b" ", b"\t"):
            break
        value += line
    return str(make_header(decode_header(value.decode("ascii").strip())))


def _check_clean_smtp_message(received: Any, clean: OutgoingEmail) -> None:
    message = received.message
    assert message["X-Email-Idempotency-Key"] == clean.idempotency_key
    assert str(message["Subject"]) == CLEAN_SUBJECT  # the modern parser's reading
    assert _decoded_subject(received.raw) == CLEAN_SUBJECT  # the legacy decoder's reading
    assert message["From"].addresses[0].display_name == "Jérôme Müller"
    assert "Bcc" not in message
    assert received.rcpt_tos == [clean.to]
    assert received.raw.isascii()  # encoded for the wire, not sent as 8-bit


@pytest.mark.parametrize(("field_name", "payload"), CASES)
def test_smtp_refuses_injection_and_delivers_nothing(
    smtp: SmtpHarness, field_name: str, payload: str
) -> None:
    stub = smtp.stub
    connections, rcpts, received = stub.connections, smtp.rcpts(), len(stub.received)

    with pytest.raises(PermanentError) as caught:
        smtp.provider.send(poisoned(field_name, payload))

    assert_refused(caught.value)
    assert (stub.connections, smtp.rcpts(), len(stub.received)) == (connections, rcpts, received)

    clean = outgoing()
    smtp.provider.send(clean)
    assert smtp.rcpts() == rcpts + 1
    assert len(stub.received) == received + 1
    _check_clean_smtp_message(stub.received[-1], clean)
    _assert_no_bcc_line_anywhere(stub)


def test_smtp_non_ascii_subject_decodes_back_exactly_with_no_bcc() -> None:
    with SmtpStub() as stub:
        provider = SmtpProvider("127.0.0.1", stub.port, starttls="false", timeout_s=5.0)
        try:
            clean = outgoing()
            provider.send(clean)
        finally:
            provider.close()
    (received,) = stub.received
    _check_clean_smtp_message(received, clean)
    # Parsed again from the raw bytes with the wire's own line endings.
    reparsed = email.message_from_bytes(received.raw, policy=email.policy.default)
    assert str(reparsed["Subject"]) == CLEAN_SUBJECT
    assert reparsed.get_all("Bcc") is None
    _assert_no_bcc_line_anywhere(stub)


# Encoded-word fragments for the property test below: charsets, Q and B text, separators.
_FRAGMENTS = [
    "=?utf-8?q?",
    "=?UTF-8?Q?",
    "=?utf-8?b?",
    "=?iso-8859-1?q?",
    "=?utf-8*en?q?",
    "?=",
    "=0D",
    "=0A",
    "=0d=0a",
    "=85",
    "=C2=85",
    "=E2=80=A8",
    "=09",
    "=3A",
    "DQo",
    "DQpCY2M6IHg=",
    "Jane",
    "Bcc:",
    "_",
    " ",
    "\t",
    "é",
    '"',
    "\\",
]


def _header_names(raw: bytes) -> list[bytes]:
    return [
        line.split(b":", 1)[0].lower()
        for line in _raw_header_lines(raw)
        if line[:1] not in (b" ", b"\t")
    ]


@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    value=st.lists(st.sampled_from(_FRAGMENTS), min_size=1, max_size=12).map("".join),
    where=st.sampled_from(["subject", "header-value"]),
)
def test_smtp_wire_for_an_accepted_value_carries_no_extra_header_line(
    smtp: SmtpHarness, value: str, where: str
) -> None:
    """Refuse or be safe: whatever the check lets through arrives at the SMTP server with the
    same header lines as a clean message (the mail library decodes and re-encodes encoded words
    there), none of them a ``Bcc``; whatever it refuses never reaches the server.

    The sender's display name is not generated here: the adapter writes ``From`` from
    ``parseaddr(sender)``, which is not always the string the check read."""
    stub = smtp.stub
    message = outgoing(**FIELDS[where](value))
    rcpts, received = smtp.rcpts(), len(stub.received)
    refused = header_problem(message) is not None
    try:
        smtp.provider.send(message)
    except PermanentError as error:
        assert refused == (error.code == "header_injection"), (value, error)
        assert (smtp.rcpts(), len(stub.received)) == (rcpts, received)
        return
    except UnicodeEncodeError:
        # An encoded word with bytes invalid in its charset next to non-ASCII text: the mail
        # library cannot serialize the message and the adapter lets that error out as it is,
        # before it connects. Not an injection: nothing was sent.
        assert not refused
        assert (smtp.rcpts(), len(stub.received)) == (rcpts, received)
        return
    assert not refused, value
    assert len(stub.received) == received + 1
    raw = stub.received[-1].raw
    assert _header_names(raw) == _CLEAN_HEADER_NAMES, raw
    assert not [line for line in _raw_header_lines(raw) if line.lower().startswith(b"bcc")]


_CLEAN_HEADER_NAMES = _header_names(
    SmtpProvider().build_message(outgoing())[0].as_bytes(eight_bit=False)
)


# ---- no over-refusal ----------------------------------------------------------------------------

ORDINARY_VALUES = [
    pytest.param("Your order #1042 has shipped", id="plain-ascii"),
    pytest.param("Invoice\tMarch 2026", id="tab"),
    pytest.param(CLEAN_SUBJECT, id="non-ascii"),
    pytest.param("Jérôme Müller", id="non-ascii-display-name"),
    pytest.param("Zoë 日本語 Ñandú — 50% off!", id="mixed-scripts"),
    pytest.param("=?utf-8?q?J=C3=A9r=C3=B4me?=", id="q-encoded-word"),
    pytest.param("=?utf-8?b?SsOpcsO0bWUncyBjYWbDqSDimJU=?=", id="b-encoded-word"),
    pytest.param("=?iso-8859-1?q?caf=E9?= au lait", id="latin-1-encoded-word"),
    pytest.param("=?utf-8?q?tab=09inside?=", id="encoded-tab"),
    pytest.param("=?utf-8?q?non_breaking=C2=A0space?=", id="encoded-nbsp"),
    pytest.param("Re: =?utf-8?q?caf=C3=A9?= =?utf-8?b?4piV?=", id="two-encoded-words"),
    pytest.param("5 =? 3 and a?=b", id="encoded-word-lookalike"),
    pytest.param("=?x-unknown?q?abc?=", id="unknown-charset"),
    pytest.param("", id="empty"),
]


def test_a_display_name_hiding_another_address_is_refused() -> None:
    # parseaddr reads the first address, so adapters would send from jerome@, not no-reply@.
    problem = header_problem(outgoing(sender="Jérôme <jerome@example.com> <no-reply@example.com>"))
    assert problem is not None and problem.code == "ambiguous_address"


@pytest.mark.parametrize("value", ORDINARY_VALUES)
def test_ordinary_values_are_not_refused(value: str) -> None:
    assert unsafe_header_reason(value) is None
    for field_name in ("subject", "sender-display-name", "header-value"):
        assert header_problem(outgoing(**FIELDS[field_name](value))) is None


_REFUSED_CHARACTERS = [
    *(chr(c) for c in range(0x20) if c != 0x09),
    "\x7f",
    "\x85",
    "\u2028",
    "\u2029",
]


@pytest.mark.parametrize("character", _REFUSED_CHARACTERS, ids=lambda c: f"U+{ord(c):04X}")
def test_each_line_separator_is_refused_raw_and_encoded(character: str) -> None:
    """The other side of not over-refusing: the check is exactly the documented set."""
    utf8 = "".join(f"={b:02X}" for b in character.encode())
    for value in (
        f"Jane{character}Bcc: x",
        f"=?utf-8?q?Jane{utf8}Bcc:_x?=",
        f"=?utf-8?b?{base64.b64encode(f'Jane{character}'.encode()).decode()}?=",
    ):
        assert unsafe_header_reason(value) is not None, repr(value)


ORDINARY_MESSAGES = [
    {"subject": "Your order #1042 has shipped"},
    {"subject": "Invoice\tMarch 2026"},
    {"subject": "Zoë 日本語 Ñandú — 50% off!", "sender": "Zoë Ñandú <no-reply@example.com>"},
    {"headers": {"X-Campaign": "=?utf-8?q?J=C3=A9r=C3=B4me?="}},
]


def test_http_adapters_send_ordinary_messages(http: HttpHarness) -> None:
    for overrides in ORDINARY_MESSAGES:
        before = http.wire.count()
        message = outgoing(**overrides)
        assert isinstance(http.provider.send(message), Accepted)
        assert http.wire.count() == before + 1
        assert http.accepted()[-1] == (message.idempotency_key, message.subject)


def test_smtp_sends_ordinary_messages(smtp: SmtpHarness) -> None:
    for overrides in ORDINARY_MESSAGES:
        message = outgoing(**overrides)
        smtp.provider.send(message)
        received = smtp.stub.received[-1]
        assert received.message["X-Email-Idempotency-Key"] == message.idempotency_key
        assert str(received.message["Subject"]) == message.subject
    assert str(received.message["X-Campaign"]) == "Jérôme"  # decoded, re-encoded, intact
    _assert_no_bcc_line_anywhere(smtp.stub)


@pytest.mark.parametrize(
    "changes",
    [
        # parseaddr strips the quotes: the adapter would write the encoded line break as a name.
        {"sender": '"=?utf-8?q?=0D=0ABcc=3A_evil=40attacker=2Eexample" <no-reply@example.com>'},
        # parseaddr drops a group name, exposing the same.
        {"sender": "Team:=?utf-8?q?=0D=0ABcc=3A_evil=40attacker=2Eexample <no-reply@example.com>"},
        # SMTP and SES write these two as headers of their own.
        {"idempotency_key": "=?utf-8?q?k=0D=0ABcc:_evil@attacker.example?="},
        {"event_id": "01J\r\nBcc: evil@attacker.example"},
    ],
    ids=["quoted-display-name", "group-name", "idempotency-key", "event-id"],
)
def test_what_adapters_re_parse_or_write_as_headers_is_checked_too(changes) -> None:  # type: ignore[no-untyped-def]
    problem = header_problem(outgoing(**changes))
    assert problem is not None and problem.code == "header_injection", problem


_NEAR_ADDRESS = st.builds(
    lambda lead, name, addr, trail, bracketed: (
        f"{lead}{name} <{addr}>{trail}" if bracketed else f"{lead}{addr}{trail}"
    ),
    st.sampled_from(["", " ", "  ", "\t", "\x0c"]),
    st.text(alphabet=list("abé .'-_\"()0\t"), max_size=12),
    st.text(alphabet=list("ab.@-+_0'"), min_size=1, max_size=12),
    st.sampled_from(["", " ", "\t", "\n", "\x0c"]),
    st.booleans(),
)


@given(st.text(max_size=40) | _NEAR_ADDRESS)
@settings(max_examples=1500, deadline=None)
def test_the_address_fast_path_reads_what_parseaddr_reads(address: str) -> None:
    from email.utils import parseaddr

    from email_platform.providers.base import _address_parts

    assert _address_parts(address) == parseaddr(address)


_HEADER_TEXT = st.text(
    alphabet=st.sampled_from(list("ab =?QB_é\t\r\n\x00\x85\u2028\xa0")) | st.characters(),
    max_size=16,
)


@given(st.lists(_HEADER_TEXT, max_size=6))
@settings(max_examples=1500, deadline=None)
def test_one_scan_over_the_values_passes_exactly_what_each_check_passes(values: list[str]) -> None:
    """``header_problem`` checks a message's values in one scan (``all_safe``) before it names
    one: the scan must never pass what the value-by-value check refuses."""
    from email_platform.mail.headers import all_safe

    each = all(unsafe_header_reason(value) is None for value in values)
    assert not (all_safe(values) and not each)
    if "=?" not in " ".join(values):
        assert all_safe(values) == each


@given(_HEADER_TEXT, _HEADER_TEXT, _HEADER_TEXT)
@settings(max_examples=500, deadline=None)
def test_a_message_is_refused_for_injection_exactly_when_one_of_its_values_is_unsafe(
    subject: str, name: str, value: str
) -> None:
    from email_platform.providers.base import _address_parts

    to = f"{name} <a@example.com>"
    problem = header_problem(outgoing(subject=subject, headers={"X-Tag": value}, to=to))
    checked = [to, *_address_parts(to), subject, value]
    unsafe = any(unsafe_header_reason(text) is not None for text in checked)
    assert unsafe == (problem is not None and problem.code == "header_injection"), problem
