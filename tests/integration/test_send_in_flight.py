"""Hundreds of provider calls in flight from one run, on the event-loop path of the HTTP adapters.

With a provider that answers in 100 ms and one message a call, the calls in flight set the
speed. The HTTP adapters send from an event loop (``providers.async_http``) with up to the lane's
``concurrency`` calls out at once. These tests hold that path to the send path's promises:
against the real sandbox at a latency, every message is sent once under its own key, the
concurrency asked for is what the provider sees, an interrupted batch records the answers it
has and gives back the rest, the rate limit still spaces calls, and the bytes on the wire are
the ones the blocking path sends (so the adapters' wire-format tests cover both).
"""

import asyncio
import dataclasses
import gzip
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import httpx
import pytest
from botocore.credentials import Credentials
from sqlalchemy import Engine

from email_platform.common.errors import ConfigurationError, TransientError
from email_platform.common.lanes import DEFAULT_LANE_CONFIGS, Lane, LaneConfig
from email_platform.providers.async_http import HANG_UP_CHECK_AFTER_S
from email_platform.providers.base import Accepted, OutgoingEmail
from email_platform.providers.http import ProviderRequest
from email_platform.providers.mailgun import MailgunProvider
from email_platform.providers.postmark import PostmarkProvider
from email_platform.providers.resend import ResendProvider
from email_platform.providers.sandbox import SandboxProvider
from email_platform.providers.sendgrid import SendGridProvider
from email_platform.providers.ses import SesProvider
from email_platform.resources import LanePolicy
from email_platform.sandbox.server import SandboxConfig, SandboxServer
from email_platform.sending.dispatch import SEND_THREADS_MAX
from email_platform.sending.worker import LaneWorker
from tests.support import (
    attempts_of,
    batch_sender,
    event,
    messages_of,
    sandbox_messages,
    sandbox_stats,
    signup,
)

FROZEN = datetime(2026, 12, 1, tzinfo=UTC)


def _lane(**changes) -> LaneConfig:  # type: ignore[no-untyped-def]
    base = dict(
        batch_size=500,
        concurrency=200,
        worker_poll_s=0.02,
        worker_idle_s=0.5,
        worker_lifetime_s=60,
        retry_delay_s=0.05,
        max_retry_delay_s=1.0,
        max_retries=3,
    )
    return dataclasses.replace(DEFAULT_LANE_CONFIGS[Lane.TRANSACTIONAL], **{**base, **changes})


@pytest.fixture
def slow_sandbox() -> Iterator[SandboxServer]:
    """The sandbox answering every send after 150 ms, as a real provider might."""
    server = SandboxServer(SandboxConfig(latency_ms=150, retry_after_s=0.2))
    server.start()
    yield server
    server.stop()


def _email(n: int) -> OutgoingEmail:
    return OutgoingEmail(
        message_id=n,
        event_id=f"01JWIRE{n:019d}",
        idempotency_key=f"01JWIRE{n:019d}:welcome",
        sender="Example <no-reply@example.com>",
        to=f"u{n}@example.com",
        subject="Welcome",
        text="Hi",
        html="<p>Hi</p>",
        template="welcome",
        lane="transactional",
    )


# ---- the send path against a slow provider --------------------------------------------------


def test_hundreds_of_calls_in_flight_send_every_message_once(engine: Engine, slow_sandbox):
    ids = [signup(engine, f"u{i}") for i in range(400)]
    provider = SandboxProvider(slow_sandbox.base_url, batch_max=1, max_connections=200)
    assert provider.async_ready
    outcome = batch_sender(engine, provider, _lane()).run(ids, run_id="run-1")
    provider.close()
    assert outcome.sent == 400 and not outcome.transient
    stats = sandbox_stats(slow_sandbox.base_url)
    assert stats["requests"] == 400 and stats["accepted"] == 400
    assert stats["repeated_keys"] == 0
    # The provider saw far more calls at once than a thread pool may make, and never more
    # than the lane's concurrency.
    assert SEND_THREADS_MAX < stats["peak_in_flight"] <= 200
    by_key = {m["idempotency_key"]: m["id"] for m in sandbox_messages(slow_sandbox.base_url)}
    for event_id in ids:
        (message,) = messages_of(engine, event_id)
        assert message.status == "sent"
        assert message.provider_message_id == by_key[message.idempotency_key]
        assert [a.outcome for a in attempts_of(engine, event_id)] == ["accepted"]


def test_failures_in_flight_stay_their_own_and_retries_keep_their_keys(
    engine: Engine, slow_sandbox
):
    plain = [signup(engine, f"u{i}") for i in range(150)]
    limited = signup(engine, "r1", email="r1+429x1@example.com")
    flaky = signup(engine, "f1", email="f1+503x2@example.com")
    rejected = signup(engine, "x1", email="x1+reject@example.com")
    provider = SandboxProvider(slow_sandbox.base_url, batch_max=1, max_connections=100)
    lane = _lane(concurrency=100)
    result = LaneWorker(
        sender=batch_sender(engine, provider, lane), engine=engine, lane=lane, run_id="w-1"
    ).run()
    provider.close()
    assert result.totals["sent"] == 152 and result.totals["dead_lettered"] == 1
    assert all(len(attempts_of(engine, event_id)) == 1 for event_id in plain)
    assert [a.outcome for a in attempts_of(engine, limited)] == ["transient", "accepted"]
    assert [a.outcome for a in attempts_of(engine, flaky)] == [
        "transient",
        "transient",
        "accepted",
    ]
    assert event(engine, rejected).status == "dead"
    stats = sandbox_stats(slow_sandbox.base_url)
    assert stats["accepted"] == 152 and stats["repeated_keys"] == 0


class _StopAtCall(SandboxProvider):
    """The run is told to stop as its ``stop_at``-th call starts (SIGTERM in the worker op)."""

    def __init__(self, base_url: str, cancel: threading.Event, stop_at: int) -> None:
        super().__init__(base_url, batch_max=1, max_connections=50, timeout_s=5)
        self.cancel = cancel
        self.stop_at = stop_at
        self.calls = 0

    async def send_async(self, email: OutgoingEmail) -> Accepted:
        self.calls += 1  # one event loop: no lock needed
        if self.calls == self.stop_at:
            self.cancel.set()
        return await super().send_async(email)


def test_a_worker_stopped_with_calls_in_flight_records_them_and_gives_back_the_rest(
    engine: Engine, slow_sandbox
):
    ids = [signup(engine, f"u{i}") for i in range(120)]
    lane = _lane(concurrency=50)
    placeholder = SandboxProvider(slow_sandbox.base_url)
    worker = LaneWorker(
        sender=batch_sender(engine, placeholder, lane), engine=engine, lane=lane, run_id="w-1"
    )
    provider = _StopAtCall(slow_sandbox.base_url, worker.sender.cancel, stop_at=30)
    worker.sender.provider = provider
    placeholder.close()
    result = worker.run()
    provider.close()
    assert result.reason == "canceled"
    accepted = {m["idempotency_key"] for m in sandbox_messages(slow_sandbox.base_url)}
    # The 30 calls out when the stop came were seen through and recorded; no other started.
    assert len(accepted) == 30 and provider.calls == 30
    # Whether the next batch was claimed before the stop came is a race (its 30th call starts
    # within milliseconds of the first): each claimed event has its message, sent only if
    # accepted, and every claimed event not sent was given back.
    claimed = result.totals["claimed"]
    assert 50 <= claimed <= 120
    prepared = [m for event_id in ids for m in messages_of(engine, event_id)]
    assert len(prepared) == claimed == len({m.event_id for m in prepared})
    assert {m.idempotency_key for m in prepared if m.status == "sent"} == accepted
    assert result.released == claimed - 30
    again = SandboxProvider(slow_sandbox.base_url, batch_max=1, max_connections=50)
    LaneWorker(
        sender=batch_sender(engine, again, lane), engine=engine, lane=lane, run_id="w-2"
    ).run()
    again.close()
    stats = sandbox_stats(slow_sandbox.base_url)
    assert stats["accepted"] == 120 and stats["repeated_keys"] == 0
    assert all(event(engine, i).status == "done" for i in ids)


def test_an_interrupted_batch_run_records_the_answers_in_hand(
    engine: Engine, slow_sandbox, monkeypatch
):
    ids = [signup(engine, f"u{i}") for i in range(200)]
    provider = SandboxProvider(slow_sandbox.base_url, batch_max=1, max_connections=20)
    sender = batch_sender(engine, provider, _lane(concurrency=20))
    record_group = sender.recorder.record_group

    def interrupted(*args, **kwargs):  # type: ignore[no-untyped-def]
        # What a terminated batch run raises in its step while answers come in.
        monkeypatch.setattr(sender.recorder, "record_group", record_group)
        raise KeyboardInterrupt

    monkeypatch.setattr(sender.recorder, "record_group", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sender.run(ids, run_id="run-1")
    provider.close()
    accepted = {m["idempotency_key"] for m in sandbox_messages(slow_sandbox.base_url)}
    assert 0 < len(accepted) < 200  # stopped early; what was in flight was seen through
    for event_id in ids:
        (message,) = messages_of(engine, event_id)
        assert (message.status == "sent") == (message.idempotency_key in accepted)


def test_the_rate_limit_spaces_calls_on_the_event_loop(engine: Engine, slow_sandbox):
    ids = [signup(engine, f"u{i}") for i in range(12)]
    provider = SandboxProvider(
        slow_sandbox.base_url, batch_max=1, max_connections=50, rate_limit_per_s=20
    )
    outcome = batch_sender(engine, provider, _lane(concurrency=50)).run(ids, run_id="run-1")
    provider.close()
    assert outcome.sent == 12
    # One call every 50 ms against answers that take 150 ms: a handful out at once, not 12.
    assert sandbox_stats(slow_sandbox.base_url)["peak_in_flight"] <= 6


# ---- which path, and the same bytes on both --------------------------------------------------


def test_a_mock_transport_or_a_blocking_override_keeps_the_blocking_path():
    handler = httpx.MockTransport(lambda request: httpx.Response(200, json={"id": "x"}))
    assert not SandboxProvider("http://127.0.0.1:9", transport=handler).async_ready

    class Logged(SandboxProvider):
        def send(self, email: OutgoingEmail) -> Accepted:
            return super().send(email)

    class LoggedBoth(Logged):
        async def send_async(self, email: OutgoingEmail) -> Accepted:
            return await super().send_async(email)

    assert not Logged("http://127.0.0.1:9").async_ready
    assert LoggedBoth("http://127.0.0.1:9").async_ready


def test_a_proxy_from_the_environment_keeps_the_blocking_path(monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.internal:3128")
    assert not PostmarkProvider(server_token="t").async_ready
    monkeypatch.setenv("NO_PROXY", "api.postmarkapp.com")
    assert PostmarkProvider(server_token="t").async_ready


class _Recorder:
    """A loopback HTTP/1.1 server that keeps each request's raw bytes and answers with
    ``answer`` (status line, headers and body as bytes), keeping connections alive."""

    def __init__(self, answer: bytes, hang_up_after_s: float | None = None) -> None:
        self.answer = answer
        #: Close each connection this long after its first answer (a server's keep-alive
        #: timeout), without saying so in the answer.
        self.hang_up_after_s = hang_up_after_s
        self.requests: list[bytes] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._talk, args=(conn,), daemon=True).start()

    def _talk(self, conn: socket.socket) -> None:
        buffer = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buffer:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buffer += chunk
                head, _, rest = buffer.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(rest) < length:
                    rest += conn.recv(65536)
                self.requests.append(head + b"\r\n\r\n" + rest[:length])
                buffer = rest[length:]
                conn.sendall(self.answer)
                if self.hang_up_after_s is not None:
                    time.sleep(self.hang_up_after_s)
                    return

    def close(self) -> None:
        self._sock.close()


def _answer(body: bytes, *, gzipped: bool = False, chunked: bool = False) -> bytes:
    headers = [b"HTTP/1.1 200 OK", b"Content-Type: application/json", b"X-Message-Id: sg-1"]
    if gzipped:
        body = gzip.compress(body)
        headers.append(b"Content-Encoding: gzip")
    if chunked:
        half = len(body) // 2
        payload = b"".join(
            b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:half], body[half:])
        )
        headers.append(b"Transfer-Encoding: chunked")
        return b"\r\n".join(headers) + b"\r\n\r\n" + payload + b"0\r\n\r\n"
    headers.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(headers) + b"\r\n\r\n" + body


@pytest.mark.parametrize(
    ("make", "answer"),
    [
        (
            lambda url: PostmarkProvider(url, server_token="server-token"),
            b'{"To":"u1@example.com","MessageID":"pm-1","ErrorCode":0,"Message":"OK"}',
        ),
        (
            lambda url: MailgunProvider(url, api_key="key-1", domain="mg.example.com"),
            b'{"id":"<mg-1@mg.example.com>","message":"Queued. Thank you."}',
        ),
        (
            lambda url: SesProvider(
                url,
                region="eu-west-1",
                credentials=Credentials("AKIDEXAMPLE", "secret"),
                clock=lambda: FROZEN,
            ),
            b'{"MessageId":"ses-1"}',
        ),
        (
            lambda url: SandboxProvider(url, api_key="sandbox-key", batch_max=1),
            b'{"id":"sbx_1","accepted_at":"2026-12-01T00:00:00Z"}',
        ),
        (
            lambda url: SendGridProvider(url, api_key="sg-key"),
            b"",  # 202 with X-Message-Id in a header, below
        ),
        (
            lambda url: ResendProvider(url, api_key="re-key"),
            b'{"id":"re-1"}',
        ),
    ],
    ids=["postmark", "mailgun", "ses", "sandbox", "sendgrid", "resend"],
)
@pytest.mark.parametrize(("gzipped", "chunked"), [(False, False), (True, True)])
def test_the_event_loop_path_sends_the_bytes_of_the_blocking_path(make, answer, gzipped, chunked):
    server = _Recorder(_answer(answer, gzipped=gzipped, chunked=chunked))
    try:
        provider = make(server.base_url)
        assert provider.async_ready
        blocking = provider.send(_email(1))
        awaited = asyncio.run(provider.send_async(_email(1)))
        provider.close()
    finally:
        server.close()
    assert blocking == awaited and isinstance(awaited, Accepted)
    sync_bytes, async_bytes = server.requests
    assert async_bytes == sync_bytes


def test_a_connection_the_server_closed_while_idle_is_not_reused():
    server = _Recorder(_answer(b'{"id":"sbx_1"}'), hang_up_after_s=0.05)

    async def two_sends(provider: SandboxProvider) -> list[Accepted]:
        first = await provider.send_async(_email(1))
        # The loop is kept busy while the server hangs up, as a starved process would be:
        # the hang-up is still unread when the next send takes the connection.
        time.sleep(HANG_UP_CHECK_AFTER_S + 0.2)
        return [first, await provider.send_async(_email(2))]

    try:
        provider = SandboxProvider(server.base_url, batch_max=1)
        answers = asyncio.run(two_sends(provider))
        provider.close()
    finally:
        server.close()
    assert [type(a) for a in answers] == [Accepted, Accepted]
    assert len(server.requests) == 2


def test_a_line_break_in_a_header_never_reaches_the_wire_on_either_path():
    class Broken(SandboxProvider):
        def build_request(self, email: OutgoingEmail) -> ProviderRequest:
            request = super().build_request(email)
            request.headers["Idempotency-Key"] = "k\r\nX-Injected: yes"
            return request

    server = _Recorder(_answer(b'{"id":"sbx_1"}'))
    try:
        provider = Broken(server.base_url, batch_max=1)
        assert provider.async_ready
        with pytest.raises(TransientError) as blocking:
            provider.send(_email(1))
        with pytest.raises(TransientError) as awaited:
            asyncio.run(provider.send_async(_email(1)))
        provider.close()
    finally:
        server.close()
    assert blocking.value.code == awaited.value.code == "network"
    assert server.requests == []


# ---- the bulk lane yields the CPU to the critical lane -----------------------------------------

_NICENESS_AFTER = (
    "import os; from email_platform.ops.lane_worker import lower_priority; "
    "before = os.nice(0); lower_priority({nice}); print(os.nice(0) - before)"
)


@pytest.mark.parametrize(("executor", "expected"), [("", 5), ("celery", 0)])
def test_a_lane_worker_step_process_is_made_nicer_unless_a_celery_worker_runs_it(
    executor, expected, monkeypatch
):
    # In a child process: niceness cannot be taken back.
    monkeypatch.setenv("EMAIL_PLATFORM_EXECUTOR", executor)
    done = subprocess.run(
        [sys.executable, "-c", _NICENESS_AFTER.format(nice=5)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(done.stdout) == expected


def test_the_bulk_lane_is_nicer_by_default_and_niceness_is_checked():
    assert LanePolicy().config_for("bulk").nice > 0
    assert LanePolicy().config_for("critical").nice == 0
    with pytest.raises(ConfigurationError, match="nice must be 0 to 19"):
        LanePolicy(overrides_json='{"bulk": {"nice": 25}}').config_for("bulk")


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_batches_in_flight_is_a_whole_number_from_one(value):
    assert LanePolicy().config_for("critical").batches_in_flight > 1
    assert LanePolicy().config_for("bulk").batches_in_flight == 1
    overrides = json.dumps({"critical": {"batches_in_flight": value}})
    with pytest.raises(ConfigurationError, match="batches_in_flight must be a whole number"):
        LanePolicy(overrides_json=overrides).config_for("critical")
