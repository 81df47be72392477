"""Failover to a secondary provider while the primary's circuit is open, end to end on SQLite
and PostgreSQL, against real servers on loopback.

* Primary on a closed port (connection refused): the circuit opens after 3 refusals, the
  secondary (a second sandbox, or the Postmark stub) sends every message exactly once under its
  original idempotency key; ``email_messages.provider`` and the attempt rows name it; the trace
  shows it; the secondary's provider message id finds the message (how webhooks match).
* Primary read timeout (the slow sandbox accepted it): that message is never moved to the
  secondary, it is retried on the primary under its key and sent once; a fresh message in the
  same run does fail over.
* Recovery: after the cool-down the probe succeeds, the circuit closes and the primary sends
  again (through the real resource and send path, one process).
"""

import dataclasses
import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy import Engine

from email_platform.common.errors import ConfigurationError
from email_platform.common.lanes import DEFAULT_LANE_CONFIGS, Lane
from email_platform.operating.admin import trace
from email_platform.providers.base import Accepted, OutgoingEmail
from email_platform.providers.circuit import CLOSED, OPEN, CircuitBreaker
from email_platform.providers.failover import FailoverProvider, FailoverState
from email_platform.providers.sandbox import SandboxProvider
from email_platform.resources import EmailProviderResource
from email_platform.sandbox.asgi import BackgroundServer
from email_platform.sandbox.server import SandboxConfig, SandboxServer
from email_platform.store import messages as message_store
from tests.provider_stubs.postmark import PostmarkStub
from tests.support import (
    FAST_LANES,
    attempts_of,
    batch_sender,
    event,
    messages_of,
    run_send,
    sandbox_messages,
    signup,
)

TOKEN = "postmark-failover-token"
#: One send at a time, so which messages meet a closed or an open circuit is deterministic.
ONE_AT_A_TIME = {lane: {**cfg, "concurrency": 1} for lane, cfg in FAST_LANES.items()}
ONE_PER_CALL = json.dumps({"batch_max": "1"})


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def second_sandbox() -> Iterator[SandboxServer]:
    server = SandboxServer(SandboxConfig())
    server.start()
    yield server
    server.stop()


@pytest.fixture(params=["sandbox", "postmark"])
def secondary(request: pytest.FixtureRequest) -> Iterator[tuple[str, str, object]]:
    """(provider name, base URL, a reader of what it accepted: key -> provider message ids)."""
    if request.param == "sandbox":
        server = request.getfixturevalue("second_sandbox")

        def sandbox_keys() -> dict[str, list[str]]:
            seen: dict[str, list[str]] = {}
            for m in sandbox_messages(server.base_url):
                seen.setdefault(m["metadata"]["idempotency_key"], []).append(m["id"])
            return seen

        yield "sandbox", server.base_url, sandbox_keys
        return
    stub = PostmarkStub(server_token=TOKEN)

    def postmark_keys() -> dict[str, list[str]]:
        seen: dict[str, list[str]] = {}
        for body in stub.accepted:
            seen.setdefault(body["Metadata"]["idempotency_key"], []).append(body["MessageID"])
        return seen

    with BackgroundServer(stub.app) as url:
        yield "postmark", url, postmark_keys


def test_a_refused_primary_fails_over_and_each_message_is_sent_once(
    engine: Engine, database_url: str, secondary
) -> None:
    name, url, accepted_keys = secondary
    ids = [signup(engine, f"u{i}") for i in range(6)]
    provider = EmailProviderResource(
        provider="sandbox",
        base_url=f"http://127.0.0.1:{_closed_port()}",
        options_json=ONE_PER_CALL,
        timeout_s=2.0,
        failover_provider=name,
        failover_base_url=url,
        failover_api_key=TOKEN if name == "postmark" else None,
        circuit_failures=3,
        circuit_cooldown_s=60.0,
    )
    result = run_send(
        database_url, "unused", "transactional", ids, provider=provider, lanes=ONE_AT_A_TIME
    )
    assert result.success

    seen = accepted_keys()
    refused_first = 0
    for event_id in ids:
        assert event(engine, event_id).status == "done"
        (message,) = messages_of(engine, event_id)
        assert (message.status, message.provider) == ("sent", name)
        # Exactly once at the secondary, under the key committed before the first call.
        assert seen[message.idempotency_key] == [message.provider_message_id]
        tries = attempts_of(engine, event_id)
        assert tries[-1].outcome == "accepted"
        assert tries[-1].error == f"via {name} (failover)"
        assert tries[-1].provider_message_id == message.provider_message_id
        earlier = tries[:-1]
        assert all(t.outcome == "transient" and "ConnectError" in t.error for t in earlier)
        refused_first += bool(earlier)
        # A webhook from the secondary finds the message by its provider message id.
        with engine.connect() as connection:
            found = message_store.find_for_provider_event(
                connection,
                idempotency_key=None,
                event_id=None,
                provider_message_id=message.provider_message_id,
            )
        assert found is not None and found.message_id == message.message_id
    # Three refusals opened the circuit; the three after it never called the primary.
    assert refused_first == 3
    assert sum(len(v) for v in seen.values()) == 6

    chain = trace(engine, ids[0])
    assert chain is not None
    (traced,) = chain["messages"]
    assert traced["provider"] == name
    assert traced["attempts"][-1]["error"] == f"via {name} (failover)"
    # The operator's text trace says it too.
    from click.testing import CliRunner

    from email_platform.cli import main

    shown = CliRunner().invoke(main, ["trace", ids[0], "--url", database_url]).output
    assert f"provider={name} provider_id={traced['provider_message_id']}" in shown
    assert f"{traced['provider_message_id']} via {name} (failover)" in shown


def test_a_read_timeout_at_the_primary_is_never_sent_by_the_secondary(
    engine: Engine, database_url: str, second_sandbox: SandboxServer
) -> None:
    slow = SandboxServer(SandboxConfig(timeout_delay_s=1.0))
    slow.start()
    try:
        accepted_late = signup(engine, "slow", email="slow+accepttimeoutx1@example.com")
        fresh = signup(engine, "fresh")
        provider = EmailProviderResource(
            provider="sandbox",
            base_url=slow.base_url,
            options_json=ONE_PER_CALL,
            timeout_s=0.4,
            failover_provider="sandbox",
            failover_base_url=second_sandbox.base_url,
            circuit_failures=1,
            circuit_cooldown_s=0.3,
        )
        result = run_send(
            database_url,
            "unused",
            "transactional",
            [accepted_late, fresh],
            provider=provider,
            lanes=ONE_AT_A_TIME,
        )
        assert result.success
        on_primary = [m["metadata"]["event_id"] for m in sandbox_messages(slow.base_url)]
    finally:
        slow.stop()
    on_secondary = [m["metadata"]["event_id"] for m in sandbox_messages(second_sandbox.base_url)]
    # The primary had accepted it before the client gave up: it stays there, sent once.
    assert on_primary == [accepted_late]
    assert on_secondary == [fresh]
    (message,) = messages_of(engine, accepted_late)
    tries = attempts_of(engine, accepted_late)
    assert tries[0].outcome == "transient" and "timeout" in tries[0].error
    assert tries[-1].outcome == "accepted" and tries[-1].error is None
    assert not any("failover" in (t.error or "") for t in tries)
    assert message.status == "sent"
    (moved,) = messages_of(engine, fresh)
    assert attempts_of(engine, fresh)[-1].error == "via sandbox (failover)"
    assert moved.status == "sent"


def test_after_the_cool_down_the_probe_closes_the_circuit_and_the_primary_sends_again(
    engine: Engine, sandbox: SandboxServer, second_sandbox: SandboxServer
) -> None:
    httpx.post(
        f"{sandbox.base_url}/_sandbox/faults", json={"rules": [{"kind": "503", "times": 2}]}
    ).raise_for_status()
    resource = EmailProviderResource(
        provider="sandbox",
        base_url=sandbox.base_url,
        options_json=ONE_PER_CALL,
        timeout_s=2.0,
        failover_provider="sandbox",
        failover_base_url=second_sandbox.base_url,
        circuit_failures=2,
        # Long enough that the rest of the first batch meets the open circuit even on a loaded
        # machine (0.3 s once let a slow CI run probe and close it before the batch ended).
        circuit_cooldown_s=2.0,
    )
    lane = dataclasses.replace(DEFAULT_LANE_CONFIGS[Lane.TRANSACTIONAL], concurrency=1)
    first = [signup(engine, f"a{i}") for i in range(4)]

    provider = resource.open(concurrency=1)
    assert isinstance(provider, FailoverProvider)
    try:
        outcome = batch_sender(engine, provider, lane).run(first, run_id="r1")
        assert provider.state.breaker.state == OPEN
        assert outcome.sent == 2 and len(outcome.transient) == 2  # two 503s, then failover
    finally:
        provider.close()
    time.sleep(2.05)  # the cool-down passes

    # A later open of the same resource (the next attempt in this process) shares the breaker.
    provider = resource.open(concurrency=1)
    try:
        retried = [e for e in first if messages_of(engine, e)[0].status == "pending"]
        outcome = batch_sender(engine, provider, lane).run(retried, run_id="r1")
        assert outcome.sent == 2
        assert provider.state.breaker.state == CLOSED
        later = signup(engine, "later")
        assert batch_sender(engine, provider, lane).run([later], run_id="r2").sent == 1
    finally:
        provider.close()

    on_primary = sorted(m["metadata"]["event_id"] for m in sandbox_messages(sandbox.base_url))
    on_secondary = sorted(
        m["metadata"]["event_id"] for m in sandbox_messages(second_sandbox.base_url)
    )
    assert on_primary == sorted([*retried, later])
    assert on_secondary == sorted(set(first) - set(retried))
    for event_id in [*first, later]:
        (message,) = messages_of(engine, event_id)
        assert message.status == "sent"


class _KeyRevokedAfter:
    """A primary whose credentials stop working after ``good`` accepted sends (a
    ``ConfigurationError``: the batch stops, the rest of it is never sent)."""

    name = "sandbox"

    def __init__(self, good: int) -> None:
        self.good = good
        self.calls = 0

    def send(self, email: OutgoingEmail) -> Accepted:
        self.calls += 1
        if self.calls > self.good:
            raise ConfigurationError("EMAIL_PLATFORM_SANDBOX_API_KEY was revoked")
        return Accepted(f"id-{self.calls}", 200)

    def close(self) -> None:
        pass


def test_a_stopped_batch_leaves_no_history_behind(
    engine: Engine, second_sandbox: SandboxServer
) -> None:
    """A lane worker lives for hours: the histories of messages a stopped batch never sent must
    not pile up in its failover provider."""
    primary = _KeyRevokedAfter(good=2)
    provider = FailoverProvider(
        primary, SandboxProvider(second_sandbox.base_url), FailoverState(CircuitBreaker())
    )
    lane = dataclasses.replace(DEFAULT_LANE_CONFIGS[Lane.TRANSACTIONAL], concurrency=1)
    ids = [signup(engine, f"k{i}") for i in range(6)]
    try:
        with pytest.raises(ConfigurationError, match="revoked"):
            batch_sender(engine, provider, lane).run(ids, run_id="r1")
        assert primary.calls == 3  # the batch stopped at the refusal
        assert provider.histories_waiting == 0
    finally:
        provider.close()
    statuses = [messages_of(engine, e)[0].status for e in ids]
    assert statuses == ["sent", "sent", "pending", "pending", "pending", "pending"]
    assert sandbox_messages(second_sandbox.base_url) == []
