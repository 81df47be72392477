"""A provider's circuit breaker is seen outside the process it lives in: each transition is
written to ``provider_circuits`` by the run that holds the breaker, so ``status``, the metrics
and the alerts sensor see an open circuit (raised once, resolved when the probe closes it),
and every attempt names the provider it went to.

On SQLite and PostgreSQL, against real sandboxes on loopback.
"""

import dataclasses
import json
import logging
import socket
import time
from datetime import timedelta

import httpx
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, insert
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from email_platform.common.lanes import DEFAULT_LANE_CONFIGS, Lane
from email_platform.common.timeutil import utcnow
from email_platform.db.schema import lane_workers
from email_platform.observability.metrics import metrics_endpoint
from email_platform.operating.admin import status
from email_platform.operating.alerts import conditions
from email_platform.providers.circuit import CLOSED, OPEN
from email_platform.resources import EmailProviderResource
from email_platform.sandbox.asgi import BackgroundServer
from email_platform.sandbox.server import SandboxServer
from email_platform.store import alerts as alert_rows
from email_platform.store import circuits
from tests.provider_stubs.postmark import PostmarkStub
from tests.support import FAST_LANES, attempts_of, batch_sender, run_send, signup

ONE_PER_CALL = json.dumps({"batch_max": "1"})
ONE_AT_A_TIME = {lane: {**cfg, "concurrency": 1} for lane, cfg in FAST_LANES.items()}
LOG = logging.getLogger("tests.circuits")
TOKEN = "postmark-circuit-token"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _circuit_samples(engine: Engine) -> dict[tuple, float]:
    app = Starlette(routes=[Route("/metrics", metrics_endpoint(engine))])
    with TestClient(app) as client:
        text = client.get("/metrics").text
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "email_platform_provider_circuit_not_closed":
                found[(sample.labels["provider"], sample.labels["state"])] = sample.value
    return found


def _alert_round(engine: Engine) -> list[tuple[str, str]]:
    now = utcnow()
    with engine.begin() as connection:
        found = conditions.circuit_conditions(connection, now)
        moved = alert_rows.reconcile(connection, found, {conditions.CIRCUIT_OPEN}, now)
    return [(t.key, t.state) for t in moved]


def test_a_row_is_one_upsert_that_keeps_the_first_opening_until_it_closes(engine: Engine):
    first = utcnow() - timedelta(seconds=30)
    later = utcnow()
    with engine.begin() as connection:
        for state, now in [(OPEN, first), ("half_open", later), (OPEN, later)]:
            circuits.record(
                connection, provider="resend", holder="r1", lane="bulk", state=state, now=now
            )
        (view,) = circuits.not_closed(connection, later)
        assert (view.state, view.changed_at, view.opened_at) == (OPEN, later, first)
        circuits.record(
            connection, provider="resend", holder="r1", lane="bulk", state=CLOSED, now=later
        )
        assert circuits.not_closed(connection, later) == []
        circuits.record(
            connection, provider="resend", holder="r1", lane="bulk", state=OPEN, now=later
        )
        (view,) = circuits.not_closed(connection, later)
        assert view.opened_at == later  # a new opening after it closed


def test_rows_of_live_processes_count_and_stale_or_forgotten_ones_do_not(engine: Engine):
    now = utcnow()
    with engine.begin() as connection:
        circuits.record(
            connection, provider="postmark", holder="batch-1", lane="bulk", state=OPEN, now=now
        )
        old = now - timedelta(seconds=circuits.STALE_S + 60)
        for holder in ("killed-batch", "live-worker", "ended-worker"):
            circuits.record(
                connection, provider="postmark", holder=holder, lane="bulk", state=OPEN, now=old
            )
        connection.execute(
            insert(lane_workers),
            [
                {
                    "run_id": "live-worker",
                    "lane": "bulk",
                    "started_at": old,
                    "heartbeat_at": now,
                    "ended_at": None,
                },
                {
                    "run_id": "ended-worker",
                    "lane": "bulk",
                    "started_at": old,
                    "heartbeat_at": now,
                    "ended_at": now,
                },
            ],
        )
        circuits.record(
            connection, provider="sendgrid", holder="batch-2", lane="bulk", state=CLOSED, now=now
        )
        seen = circuits.not_closed(connection, now)
        assert sorted(v.holder for v in seen) == ["batch-1", "live-worker"]
        assert circuits.by_provider(seen) == {"postmark": {"open": 2}}
        assert circuits.forget(connection, "batch-1") == 1
        circuits.record(
            connection,
            provider="postmark",
            holder="live-worker",
            lane="bulk",
            state=CLOSED,
            now=now,
        )
        assert circuits.not_closed(connection, now) == []


def test_an_open_circuit_is_in_status_metrics_and_one_alert_until_the_probe_closes_it(
    engine: Engine, sandbox: SandboxServer
):
    httpx.post(
        f"{sandbox.base_url}/_sandbox/faults", json={"rules": [{"kind": "503", "times": 2}]}
    ).raise_for_status()
    resource = EmailProviderResource(
        provider="sandbox",
        base_url=sandbox.base_url,
        options_json=ONE_PER_CALL,
        timeout_s=2.0,
        circuit_breaker=True,
        circuit_failures=2,
        circuit_cooldown_s=0.5,
    )
    lane = dataclasses.replace(DEFAULT_LANE_CONFIGS[Lane.TRANSACTIONAL], concurrency=1)
    ids = [signup(engine, f"u{i}") for i in range(3)]

    mirror = circuits.CircuitMirror(engine, holder="run-1", lane="transactional", log=LOG)
    provider = resource.open(concurrency=1, on_circuit_change=mirror)
    try:
        outcome = batch_sender(engine, provider, lane).run(ids, run_id="run-1")
    finally:
        provider.close()
        mirror.close(forget_rows=False)  # a retry follows: the row stays
    # Two 503s open it; the third message is turned away by the open circuit itself.
    assert outcome.sent == 0 and len(outcome.transient) == 3
    assert status(engine)["circuits"] == {"sandbox": {"open": 1}}
    assert _circuit_samples(engine) == {("sandbox", "open"): 1.0}
    assert _alert_round(engine) == [("circuit_open:sandbox", "raised")]
    assert _alert_round(engine) == []  # still open: raised once

    time.sleep(0.6)  # the cool-down passes; the probe (the sandbox answers again) closes it
    mirror = circuits.CircuitMirror(engine, holder="run-1", lane="transactional", log=LOG)
    provider = resource.open(concurrency=1, on_circuit_change=mirror)
    try:
        assert batch_sender(engine, provider, lane).run(ids, run_id="run-1").sent == 3
    finally:
        provider.close()
        mirror.close(forget_rows=False)
    assert status(engine)["circuits"] == {}
    assert _circuit_samples(engine) == {}
    assert _alert_round(engine) == [("circuit_open:sandbox", "resolved")]


def test_a_send_run_records_its_circuit_and_forgets_it_when_it_ends(
    engine: Engine, database_url: str, monkeypatch
):
    ids = [signup(engine, f"u{i}") for i in range(4)]
    stub = PostmarkStub(server_token=TOKEN)
    seen_open: list[list] = []
    original = circuits.record

    def spying_record(connection, **row):  # type: ignore[no-untyped-def]
        original(connection, **row)
        seen_open.append([v.holder for v in circuits.not_closed(connection, utcnow())])

    monkeypatch.setattr(circuits, "record", spying_record)
    with BackgroundServer(stub.app) as url:
        provider = EmailProviderResource(
            provider="sandbox",
            base_url=f"http://127.0.0.1:{_closed_port()}",
            options_json=ONE_PER_CALL,
            timeout_s=2.0,
            failover_provider="postmark",
            failover_base_url=url,
            failover_api_key=TOKEN,
            circuit_failures=2,
            circuit_cooldown_s=60.0,
        )
        result = run_send(
            database_url, "unused", "transactional", ids, provider=provider, lanes=ONE_AT_A_TIME
        )
    assert result.success
    # The run wrote its row when the circuit opened (and again when a retry found it still
    # open), and deleted it when it ended.
    assert seen_open and all(holders == [result.run_id] for holders in seen_open)
    assert status(engine)["circuits"] == {}
    # Each attempt names the provider it went to: refusals at the primary, acceptances at the
    # secondary.
    tried = [(a.outcome, a.provider) for event_id in ids for a in attempts_of(engine, event_id)]
    assert {p for o, p in tried if o == "accepted"} == {"postmark"}
    assert sum(1 for o, _ in tried if o == "accepted") == 4
    assert {p for o, p in tried if o != "accepted"} == {"sandbox"}


def test_a_batch_runs_circuit_row_outlives_its_retries_and_goes_when_the_run_ends(
    engine: Engine, database_url: str, monkeypatch
):
    """The breaker lives for the whole batch run (the resource keeps it across attempts), so
    its row is not cleared between retries: the alert does not flap while the provider is down."""
    event_id = signup(engine, "u1")
    forgotten: list[str] = []
    original = circuits.forget

    def spying_forget(connection, holder):  # type: ignore[no-untyped-def]
        forgotten.append(holder)
        return original(connection, holder)

    monkeypatch.setattr(circuits, "forget", spying_forget)
    provider = EmailProviderResource(
        provider="sandbox",
        base_url=f"http://127.0.0.1:{_closed_port()}",
        options_json=ONE_PER_CALL,
        timeout_s=2.0,
        circuit_breaker=True,
        circuit_failures=1,
        circuit_cooldown_s=60.0,
    )
    lanes = {
        lane: {**cfg, "max_retries": 2, "max_retry_delay_s": 0.2}
        for lane, cfg in FAST_LANES.items()
    }
    result = run_send(
        database_url, "unused", "transactional", [event_id], provider=provider, lanes=lanes
    )
    assert not result.success  # retries exhausted: a dead letter
    assert forgotten == [result.run_id]  # once, at the run's end, not after each attempt
    assert status(engine)["circuits"] == {}
