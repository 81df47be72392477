"""Prometheus metrics and the status latency, read from real tables on both backends.

Events go through the real send job against the sandbox (a 5xx retried, a permanent
rejection), then the endpoint is scraped over HTTP and parsed with prometheus_client's parser.
"""

import json
import math
import socket
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from hypothesis import example, given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, delete, insert, select, update
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from email_platform.cli import main
from email_platform.common.ids import new_ulid
from email_platform.common.timeutil import utcnow
from email_platform.db.engine import make_engine
from email_platform.db.schema import email_attempts, email_messages, email_outbox
from email_platform.observability.metrics import LATENCY_BUCKETS, metrics_endpoint, retry_reason
from email_platform.operating.admin import status
from email_platform.store import lane_workers
from tests.hostile_support import hostile_settings
from tests.support import publish_across_lanes, run_send, signup

VENV_BIN = Path(sys.executable).parent


def _families(text: str) -> dict[str, dict[tuple, float]]:
    """Sample name -> {sorted label pairs: value}."""
    found: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def _by(samples: dict[tuple, float], *names: str) -> dict[tuple, float]:
    """The samples keyed by the values of ``names`` only (e.g. lane)."""
    return {tuple(dict(k)[n] for n in names): v for k, v in samples.items()}


def _scrape(engine: Engine, **options) -> dict[str, dict[tuple, float]]:
    """Mounted the way the webhook receiver mounts it: a Route in a Starlette app of its own."""
    app = Starlette(routes=[Route("/metrics", metrics_endpoint(engine, **options))])
    with TestClient(app) as client:
        response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return _families(response.text)


def _traffic(engine: Engine, database_url: str, sandbox_url: str) -> dict[str, list[str]]:
    """Sent, retried once (503) then sent, rejected; two critical sends; one due and one
    scheduled event left pending."""
    ok = signup(engine, "u1")
    retried = signup(engine, "u2", email="u2+503x1@example.com")
    rejected = signup(engine, "u3", email="u3+reject@example.com")
    critical = publish_across_lanes(engine, {"critical": 2, "transactional": 0, "bulk": 0})
    result = run_send(database_url, sandbox_url, "transactional", [ok, retried, rejected])
    assert not result.success  # the dead letter fails the run, after recording everything
    assert run_send(database_url, sandbox_url, "critical", critical).success
    due = signup(engine, "u4")
    later = signup(engine, "u5", send_after=utcnow() + timedelta(hours=1))
    return {"sent": [ok, retried, *critical], "pending": [due, later]}


def test_a_scrape_reports_exact_queue_latency_attempt_and_dead_letter_values(
    engine, database_url, sandbox
):
    _traffic(engine, database_url, sandbox.base_url)
    now = utcnow()
    with engine.begin() as connection:
        lane_workers.beat(connection, "alive", "bulk", now)
        lane_workers.beat(connection, "stale", "bulk", now - timedelta(minutes=5))
        lane_workers.beat(connection, "ended", "critical", now)
        lane_workers.end(connection, "ended", "idle", now)
    metrics = _scrape(engine)

    assert metrics["email_platform_database_up"] == {(): 1.0}
    # The future send_after is scheduled, not backlog.
    depth = _by(metrics["email_platform_queue_depth"], "lane")
    assert depth == {("critical",): 0, ("transactional",): 1, ("bulk",): 0}
    assert _by(metrics["email_platform_queue_scheduled"], "lane")[("transactional",)] == 1
    assert set(_by(metrics["email_platform_queue_in_flight"], "lane").values()) == {0}
    ages = _by(metrics["email_platform_queue_oldest_due_age_seconds"], "lane")
    assert 0 < ages[("transactional",)] < 120 and ages[("bulk",)] == 0

    # The histogram counts every message accepted per lane, in cumulative buckets.
    buckets = metrics["email_platform_publish_to_accepted_seconds_bucket"]
    for lane, accepted in {"transactional": 2, "critical": 2, "bulk": 0}.items():
        counts = [buckets[(("lane", lane), ("le", le))] for le in [*map(str, LATENCY_BUCKETS)]]
        total = buckets[(("lane", lane), ("le", "+Inf"))]
        assert total == accepted and counts == sorted(counts) and counts[-1] <= total
        gcount = metrics["email_platform_publish_to_accepted_seconds_gcount"]
        assert gcount[(("lane", lane),)] == accepted
    assert metrics["email_platform_publish_to_accepted_seconds_gsum"][(("lane", "bulk"),)] == 0

    attempts = _by(metrics["email_platform_attempts_total"], "lane", "outcome", "reason")
    assert attempts == {
        ("transactional", "accepted", "none"): 2,
        ("transactional", "transient", "server_error"): 1,
        ("transactional", "permanent", "rejected"): 1,
        ("critical", "accepted", "none"): 2,
    }
    sends = _by(metrics["email_platform_sends_total"], "lane", "provider")
    assert sends == {("transactional", "sandbox"): 2, ("critical", "sandbox"): 2}
    dead = {("transactional", "provider_rejected"): 1}
    assert _by(metrics["email_platform_dead_letters_total"], "lane", "reason") == dead
    assert _by(metrics["email_platform_dead_letters_open"], "lane", "reason") == dead
    alive = _by(metrics["email_platform_lane_workers_alive"], "lane")
    assert alive == {("critical",): 0, ("transactional",): 0, ("bulk",): 1}


def test_counters_are_read_incrementally_and_never_go_down(engine, database_url, sandbox):
    clock = {"now": utcnow()}
    app = Starlette(
        routes=[Route("/metrics", metrics_endpoint(engine, clock=lambda: clock["now"]))]
    )
    first = signup(engine, "u1", email="u1+500x1@example.com")
    run_send(database_url, sandbox.base_url, "transactional", [first])

    def attempts(client: TestClient) -> dict[tuple, float]:
        text = client.get("/metrics").text
        return _by(_families(text)["email_platform_attempts_total"], "outcome", "reason")

    with TestClient(app) as client:
        assert attempts(client) == {("accepted", "none"): 1, ("transient", "server_error"): 1}
        # Later: the first rows are settled and kept; new ones are counted from the tail.
        clock["now"] += timedelta(hours=1)
        assert attempts(client) == {("accepted", "none"): 1, ("transient", "server_error"): 1}
        second = signup(engine, "u2", email="u2+429x1@example.com")
        run_send(database_url, sandbox.base_url, "transactional", [second])
        expected = {
            ("accepted", "none"): 2,
            ("transient", "server_error"): 1,
            ("transient", "rate_limited"): 1,
        }
        assert attempts(client) == expected
        # Pruning old rows (retention) does not make a counter go down in this process.
        with engine.begin() as connection:
            connection.execute(delete(email_attempts).where(email_attempts.c.event_id == first))
        clock["now"] += timedelta(hours=1)
        assert attempts(client) == expected


def test_status_reports_latency_percentiles_per_lane(engine, database_url, sandbox):
    sent = _traffic(engine, database_url, sandbox.base_url)["sent"]
    code_result = CliRunner().invoke(
        main, ["status", "--json"], env={"EMAIL_PLATFORM_DATABASE_URL": database_url}
    )
    assert code_result.exit_code == 0, code_result.output
    latency = json.loads(code_result.output)["latency"]
    assert latency["window_minutes"] == 15
    assert latency["lanes"]["bulk"] == {"accepted": 0, "p50_s": None, "p95_s": None, "p99_s": None}
    with engine.connect() as connection:
        rows = connection.execute(
            select(email_messages.c.lane, email_messages.c.sent_at, email_outbox.c.published_at)
            .join(email_outbox, email_outbox.c.event_id == email_messages.c.event_id)
            .where(email_messages.c.event_id.in_(sent))
        ).all()
    for lane in ("transactional", "critical"):
        taken = sorted(_seconds(r.sent_at, r.published_at) for r in rows if r.lane == lane)
        report = latency["lanes"][lane]
        assert report["accepted"] == len(taken) == 2
        # Nearest rank over two values: p50 is the first, p95 and p99 the second.
        assert report["p50_s"] == pytest.approx(taken[0], abs=2e-3)
        assert report["p95_s"] == report["p99_s"] == pytest.approx(taken[1], abs=2e-3)
    # Outside the window nothing counts.
    later = status(engine, utcnow() + timedelta(minutes=20), latency_minutes=15)
    assert {lane["accepted"] for lane in later["latency"]["lanes"].values()} == {0}


def _seconds(end: datetime, start: datetime) -> float:
    return (end.replace(tzinfo=None) - start.replace(tzinfo=None)).total_seconds()


def _near_a_bound(value: float) -> bool:
    return any(abs(value - bound) < 0.01 for bound in LATENCY_BUCKETS)


latencies = st.lists(
    st.tuples(
        st.floats(0, 4000, allow_nan=False).filter(lambda v: not _near_a_bound(v)),
        st.sampled_from(["critical", "transactional", "bulk"]),
        st.booleans(),  # published with a send_after 10 minutes ahead of it
    ),
    max_size=25,
)


@hostile_settings(max_examples=15)
@given(samples=latencies)
# Eleven values: p95 is rank ceil(10.45) = 11, where rounding to nearest would give 10.
@example(samples=[(i + 0.4, "transactional", i % 2 == 0) for i in range(1, 12)])
@example(samples=[(0.3, "critical", False)])
def test_histogram_and_percentiles_match_a_reference(engine: Engine, samples) -> None:
    """Any mix of latencies: the SQL buckets and nearest-rank percentiles equal Python's.

    A delayed event's latency runs from its send_after, not its publish."""
    with engine.begin() as connection:
        connection.execute(delete(email_messages))
        connection.execute(delete(email_outbox))
    now = utcnow()
    for i, (seconds, lane, delayed) in enumerate(samples):
        sent_at = now - timedelta(minutes=1)
        due = sent_at - timedelta(seconds=seconds)
        published = due - timedelta(minutes=10) if delayed else due
        _insert_sent(engine, i, lane, published, due, sent_at)
    metrics = _scrape(engine, clock=lambda: now, latency_window_s=3600)
    report = status(engine, now, latency_minutes=60)["latency"]["lanes"]
    buckets = metrics["email_platform_publish_to_accepted_seconds_bucket"]
    for lane in ("critical", "transactional", "bulk"):
        values = sorted(s for s, name, _ in samples if name == lane)
        for bound in LATENCY_BUCKETS:
            expected = sum(v <= bound for v in values)
            assert buckets[(("lane", lane), ("le", str(bound)))] == expected
        assert buckets[(("lane", lane), ("le", "+Inf"))] == len(values)
        assert report[lane]["accepted"] == len(values)
        for p in (50, 95, 99):
            got = report[lane][f"p{p}_s"]
            if not values:
                assert got is None
                continue
            assert got == pytest.approx(values[math.ceil(p * len(values) / 100) - 1], abs=2e-3)


def _insert_sent(
    engine: Engine, i: int, lane: str, published: datetime, due: datetime, sent_at: datetime
) -> None:
    event_id = new_ulid()
    with engine.begin() as connection:
        connection.execute(
            insert(email_outbox).values(
                event_id=event_id,
                event_type="user.signed_up",
                event_version=2,
                aggregate_id=f"a{i}",
                occurred_at=published,
                published_at=published,
                payload={},
                event_metadata={},
                lane=lane,
                available_at=due,
                status="done",
            )
        )
        connection.execute(
            insert(email_messages).values(
                event_id=event_id,
                route="r",
                template="t",
                template_version=1,
                lane=lane,
                idempotency_key=f"k-{event_id}",
                status="sent",
                provider="sandbox",
                created_at=published,
                updated_at=sent_at,
                sent_at=sent_at,
            )
        )


@hostile_settings(max_examples=60)
@given(accept=st.text(max_size=200).filter(lambda v: "\n" not in v and "\r" not in v))
def test_any_accept_header_gets_a_readable_answer(engine: Engine, accept: str) -> None:
    app = Starlette(routes=[Route("/metrics", metrics_endpoint(engine))])
    with TestClient(app) as client:
        try:
            response = client.get("/metrics", headers={"accept": accept})
        except (UnicodeEncodeError, ValueError):
            return  # not sendable as a header at all
    assert response.status_code == 200
    assert "email_platform_database_up" in response.text


def test_an_unreachable_database_is_reported_not_a_500() -> None:
    dead = make_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")
    try:
        metrics = _scrape(dead)
    finally:
        dead.dispose()
    assert metrics["email_platform_database_up"] == {(): 0.0}
    assert "email_platform_queue_depth" not in metrics


def test_retry_reasons_are_a_bounded_set() -> None:
    assert retry_reason("accepted", 200) == "none"
    assert retry_reason("transient", None) == "no_response"
    assert retry_reason("transient", 429) == "rate_limited"
    assert retry_reason("transient", 503) == "server_error"
    assert retry_reason("transient", 408) == "timeout"
    assert retry_reason("transient", 425) == "too_early"
    assert retry_reason("permanent", 422) == "rejected"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_serve_answers_a_scrape_over_http(engine, database_url, sandbox):
    _traffic(engine, database_url, sandbox.base_url)
    with engine.begin() as connection:  # the scheduled event comes due: backlog now
        connection.execute(
            update(email_outbox)
            .values(available_at=utcnow())
            .where(email_outbox.c.status == "pending")
        )
    port = _free_port()
    command = [str(VENV_BIN / "email-platform"), "metrics", "serve", "--port", str(port)]
    server = subprocess.Popen([*command, "--url", database_url], stderr=subprocess.PIPE)
    try:
        response = _get_when_up(f"http://127.0.0.1:{port}/metrics", server)
        metrics = _families(response.text)
        assert _by(metrics["email_platform_queue_depth"], "lane")[("transactional",)] == 2
        sends = _by(metrics["email_platform_sends_total"], "lane")
        assert sends == {("transactional",): 2, ("critical",): 2}
        assert httpx.get(f"http://127.0.0.1:{port}/other").status_code == 404
        assert httpx.post(f"http://127.0.0.1:{port}/metrics").status_code == 405
    finally:
        server.terminate()
        server.wait(timeout=30)


def _get_when_up(url: str, server: subprocess.Popen) -> httpx.Response:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"metrics serve exited: {server.stderr.read().decode()}")
        try:
            return httpx.get(url, timeout=10)
        except httpx.TransportError:
            time.sleep(0.2)
    raise AssertionError("metrics serve did not come up")


def test_metrics_serve_refuses_an_unmigrated_database(tmp_path):
    result = CliRunner().invoke(
        main, ["metrics", "serve", "--url", f"sqlite:///{tmp_path / 'empty.sqlite3'}"]
    )
    assert result.exit_code != 0 and "db upgrade" in result.output


def test_the_webhook_receiver_serves_the_same_metrics(engine):
    from email_platform.webhooks.receiver import create_receiver_app

    signup(engine, "u1")
    signup(engine, "u2")
    with TestClient(create_receiver_app(engine, settings={})) as client:
        response = client.get("/metrics")
    assert response.status_code == 200
    metrics = _families(response.text)
    assert _by(metrics["email_platform_queue_depth"], "lane")[("transactional",)] == 2
