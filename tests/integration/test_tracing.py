"""OpenTelemetry: the product's request and the email it caused are one trace.

With the SDK's in-memory exporter as the tracer provider, a caller's span around ``publish()``
is the ancestor of every span the email makes: ``email_platform.publish`` (its child),
``email_platform.render`` and ``email_platform.send`` (children of the publish span, through
the context stored on the outbox row), and ``email_platform.webhook`` for each provider event
ingested; the batch's ``email_platform.claim`` links to it. Without a current span nothing is
stored; without a tracer provider nothing is recorded and only a current (propagated) context
is stored; without the package at all, publish and send work as before. On SQLite and
PostgreSQL.
"""

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags
from opentelemetry.util._once import Once
from sqlalchemy import select
from starlette.testclient import TestClient

from email_platform import publish_many
from email_platform.common.lanes import DEFAULT_LANE_CONFIGS, Lane
from email_platform.db.schema import webhook_inbox
from email_platform.observability import tracing
from email_platform.providers.sandbox import SandboxProvider
from email_platform.webhooks.ingest import WebhookIngestor
from email_platform.webhooks.receiver import create_receiver_app
from tests.support import batch_sender, event, messages_of, sandbox_messages, signup
from tests.webhook_support import SETTINGS, sandbox_event, signed


def _reset_global_provider() -> None:
    # The API lets a process set its provider once; tests need "none" back afterwards (what
    # opentelemetry-test-utils' reset_trace_globals does).
    trace._TRACER_PROVIDER = None
    trace._TRACER_PROVIDER_SET_ONCE = Once()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """An SDK tracer provider exporting to memory, as the process's global provider."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _reset_global_provider()
    trace.set_tracer_provider(provider)
    yield exporter
    provider.shutdown()
    _reset_global_provider()


def _by_name(exporter: InMemorySpanExporter) -> dict[str, list[ReadableSpan]]:
    found: dict[str, list[ReadableSpan]] = {}
    for span in exporter.get_finished_spans():
        found.setdefault(span.name, []).append(span)
    return found


def _ancestors(span: ReadableSpan, by_id: dict[int, ReadableSpan]) -> list[str]:
    names = []
    while span.parent is not None and span.parent.span_id in by_id:
        span = by_id[span.parent.span_id]
        names.append(span.name)
    return names


def _ingest_delivered(engine, sent: dict, event_id: str) -> None:  # type: ignore[no-untyped-def]
    client = TestClient(create_receiver_app(engine, settings=SETTINGS))
    for kind in ("email.delivered", "email.opened"):
        body, headers = signed(
            sandbox_event(kind, message_id=sent["id"], to=sent["to"], event_id=event_id)
        )
        assert client.post("/webhooks/sandbox", content=body, headers=headers).status_code == 200
    with engine.connect() as connection:
        ids = list(connection.execute(select(webhook_inbox.c.inbox_id)).scalars())
    outcome = WebhookIngestor(engine).run(ids, run_id="ingest-run")
    assert outcome.applied == 2 and outcome.unlinked == 0


def test_one_span_tree_from_the_callers_span_through_publish_send_and_webhook(
    engine, sandbox, spans
):
    tracer = trace.get_tracer("accounts-service")
    with tracer.start_as_current_span("POST /signup", kind=SpanKind.SERVER) as request:
        event_id = signup(engine, "u1", correlation_id="req-42", producer="accounts-service")
    request_trace = request.get_span_context().trace_id
    row = event(engine, event_id)
    assert row.trace_id == trace.format_trace_id(request_trace)
    assert row.trace_context["traceparent"].startswith(f"00-{row.trace_id}-")

    lane = DEFAULT_LANE_CONFIGS[Lane.TRANSACTIONAL]
    sender = batch_sender(engine, SandboxProvider(sandbox.base_url, timeout_s=5), lane)
    assert sender.run([event_id], run_id="send-run").sent == 1
    (sent,) = sandbox_messages(sandbox.base_url)
    _ingest_delivered(engine, sent, event_id)

    found = _by_name(spans)
    (caller,) = found["POST /signup"]
    (published,) = found["email_platform.publish"]
    (claim,) = found["email_platform.claim"]
    (render,) = found["email_platform.render"]
    (send,) = found["email_platform.send"]
    webhooks = found["email_platform.webhook"]
    assert len(webhooks) == 2
    # One trace throughout, parent ids linked: caller -> publish -> render, send, webhooks.
    for span in (published, render, send, *webhooks):
        assert span.context.trace_id == request_trace, span.name
        assert span.parent.span_id == (
            caller.context.span_id if span is published else published.context.span_id
        ), span.name
    by_id = {span.context.span_id: span for span in spans.get_finished_spans()}
    for span in (render, send, *webhooks):
        assert _ancestors(span, by_id) == ["email_platform.publish", "POST /signup"]
    # The stored context is the publish span's; the batch's claim span links to it.
    assert row.trace_context["traceparent"].startswith(
        f"00-{row.trace_id}-{trace.format_span_id(published.context.span_id)}-"
    )
    assert [link.context.span_id for link in claim.links] == [published.context.span_id]
    assert claim.attributes["email.claimed"] == 1
    (message,) = messages_of(engine, event_id)
    assert published.kind == SpanKind.PRODUCER and send.kind == SpanKind.CLIENT
    assert webhooks[0].kind == SpanKind.CONSUMER
    assert published.attributes["email.event_id"] == event_id
    assert published.attributes["email.correlation_id"] == "req-42"
    assert render.attributes["email.message_id"] == message.message_id
    assert send.attributes["email.provider_message_id"] == sent["id"]
    assert send.attributes["email.outcome"] == "accepted"
    assert {w.attributes["email.webhook_event_type"] for w in webhooks} == {"delivered", "opened"}
    # Ids only: no address reaches a span.
    for span in spans.get_finished_spans():
        assert "u1@example.com" not in json.dumps(dict(span.attributes or {}), default=str)


def test_a_failed_send_ends_its_span_with_an_error_and_no_address(engine, sandbox, spans):
    tracer = trace.get_tracer("accounts-service")
    with tracer.start_as_current_span("POST /signup"):
        event_id = signup(engine, "u1", email="u1+reject@example.com")
    lane = DEFAULT_LANE_CONFIGS[Lane.TRANSACTIONAL]
    batch_sender(engine, SandboxProvider(sandbox.base_url, timeout_s=5), lane).run(
        [event_id], run_id="send-run"
    )
    (send,) = _by_name(spans)["email_platform.send"]
    assert not send.status.is_ok and send.attributes["email.outcome"] == "permanent"
    assert "@" not in (send.status.description or "")


def test_publish_many_gives_each_event_a_publish_span_of_its_own(engine, spans):
    tracer = trace.get_tracer("digest-service")
    with (
        tracer.start_as_current_span("nightly digest") as job,
        engine.begin() as connection,
    ):
        ids = publish_many(
            connection,
            [
                {
                    "event_type": "user.signed_up",
                    "aggregate_id": f"u{i}",
                    "payload": {"user_id": f"u{i}", "email": f"u{i}@example.com"},
                    "correlation_id": "digest-2026-12-02",
                }
                for i in range(3)
            ],
        )
    rows = [event(engine, event_id) for event_id in ids]
    made = _by_name(spans)["email_platform.publish"]
    published = {span.attributes["email.event_id"]: span for span in made}
    assert set(published) == set(ids)
    assert len({row.trace_context["traceparent"] for row in rows}) == 3
    for row in rows:
        span = published[row.event_id]
        assert span.parent.span_id == job.get_span_context().span_id
        assert row.trace_id == trace.format_trace_id(job.get_span_context().trace_id)
        assert row.correlation_id == "digest-2026-12-02"


def test_without_a_current_span_nothing_is_stored(engine, sandbox, spans):
    event_id = signup(engine, "u1")
    given = signup(engine, "u2", trace_id="1-5759e988-bd862e3fe1be46a994272793")
    row, row_given = event(engine, event_id), event(engine, given)
    assert (row.trace_id, row.trace_context) == (None, None)
    assert (row_given.trace_id, row_given.trace_context) == (
        "1-5759e988-bd862e3fe1be46a994272793",
        None,
    )
    assert "email_platform.publish" not in _by_name(spans)
    # The email's own spans still form one trace: the send continues the render's.
    lane = DEFAULT_LANE_CONFIGS[Lane.TRANSACTIONAL]
    batch_sender(engine, SandboxProvider(sandbox.base_url, timeout_s=5), lane).run(
        [event_id], run_id="send-run"
    )
    found = _by_name(spans)
    (claim,), (render,), (send,) = (
        found["email_platform.claim"],
        found["email_platform.render"],
        found["email_platform.send"],
    )
    assert claim.links == ()
    assert render.parent.span_id == claim.context.span_id
    assert send.parent.span_id == render.context.span_id
    assert send.context.trace_id == claim.context.trace_id


def test_without_a_tracer_provider_nothing_is_recorded(engine, sandbox):
    assert not tracing.active()
    tracer = trace.get_tracer("accounts-service")
    # The API's default tracer makes spans with no valid context: nothing to store.
    with tracer.start_as_current_span("POST /signup"):
        untraced = signup(engine, "u1")
    assert (event(engine, untraced).trace_id, event(engine, untraced).trace_context) == (None, None)
    # A context propagated from elsewhere (an instrumented framework, a remote caller) is
    # current without any provider: it is stored, and its trace id.
    remote = SpanContext(
        trace_id=0x4BF92F3577B34DA6A3CE929D0E0E4736,
        span_id=0x00F067AA0BA902B7,
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )
    with trace.use_span(NonRecordingSpan(remote)):
        propagated = signup(engine, "u2")
    row = event(engine, propagated)
    assert row.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert row.trace_context == {
        "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    }
    lane = DEFAULT_LANE_CONFIGS[Lane.TRANSACTIONAL]
    outcome = batch_sender(engine, SandboxProvider(sandbox.base_url, timeout_s=5), lane).run(
        [untraced, propagated], run_id="send-run"
    )
    assert outcome.sent == 2
    seen = sandbox_messages(sandbox.base_url)
    metadata = {m["metadata"]["event_id"]: m["metadata"] for m in seen}
    assert "trace_id" not in metadata[untraced]
    assert metadata[propagated]["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"


_WITHOUT_OPENTELEMETRY = """
import sys
sys.modules["opentelemetry"] = None  # as if the package were not installed
from email_platform import publish
from email_platform.observability import tracing
from email_platform.db.engine import make_engine
from email_platform.common.lanes import DEFAULT_LANE_CONFIGS, Lane
from email_platform.providers.sandbox import SandboxProvider
from email_platform.sending.batch import build_sender
from sqlalchemy import select
from email_platform.db.schema import email_outbox

assert not tracing.active() and tracing._otel is None
engine = make_engine(sys.argv[1])
with engine.begin() as connection:
    event_id = publish(
        connection,
        event_type="user.signed_up",
        aggregate_id="u1",
        payload={"user_id": "u1", "email": "u1@example.com", "first_name": "U"},
        trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
    )
sender = build_sender(
    engine=engine,
    provider=SandboxProvider(sys.argv[2], timeout_s=5),
    lane=DEFAULT_LANE_CONFIGS[Lane.TRANSACTIONAL],
    sender_address="no-reply@example.com",
)
assert sender.run([event_id], run_id="r1").sent == 1
with engine.connect() as connection:
    row = connection.execute(select(email_outbox).where(email_outbox.c.event_id == event_id)).one()
assert row.trace_context is None and row.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
print("ok")
"""


def test_without_opentelemetry_installed_publish_and_send_work_as_before(database_url, sandbox):
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_OPENTELEMETRY, database_url, sandbox.base_url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
