"""Critical mail is not held up by a bulk backlog: a real daemon on a PostgreSQL Dagster
instance and a PostgreSQL application database drains thousands of bulk emails while password
resets are published one by one, and every reset is accepted within the critical lane's target.
"""

import json
import statistics
import time
from datetime import timedelta

import pytest
from sqlalchemy import insert, select

from email_platform import publish
from email_platform.common.lanes import DEFAULT_LANE_CONFIGS, Lane
from email_platform.db.engine import make_engine
from email_platform.db.schema import email_messages, email_outbox, lane_workers
from email_platform.local.dagster_home import (
    DaemonProcess,
    wait_for,
)
from email_platform.sandbox.server import SandboxConfig, SandboxServer
from tests.support import outbox_statuses, publish_across_lanes, users

BULK_EVENTS = 4000
CRITICAL_EVENTS = 30
LANES = {
    "critical": {"warm_workers": 1},
    "bulk": {"workers": 2, "batch_size": 100, "concurrency": 4},
}


def _live_workers(engine, lane: str) -> int:  # type: ignore[no-untyped-def]
    with engine.connect() as connection:
        rows = connection.execute(
            select(lane_workers.c.run_id).where(
                lane_workers.c.lane == lane, lane_workers.c.ended_at.is_(None)
            )
        ).all()
    return len(rows)


def _publish_reset(engine, i: int) -> str:  # type: ignore[no-untyped-def]
    with engine.begin() as connection:
        connection.execute(insert(users).values(id=f"late{i}", email=f"late{i}@example.com"))
        return publish(
            connection,
            event_type="user.password_reset_requested",
            aggregate_id=f"late{i}",
            payload={"user_id": f"late{i}", "reset_token": f"t{i}"},
        )


def _latencies_s(engine, ids: list[str]) -> list[float]:  # type: ignore[no-untyped-def]
    with engine.connect() as connection:
        rows = connection.execute(
            select(email_outbox.c.published_at, email_messages.c.sent_at)
            .join(email_messages, email_messages.c.event_id == email_outbox.c.event_id)
            .where(email_outbox.c.event_id.in_(ids))
        ).all()
    assert all(row.sent_at is not None for row in rows)
    return [(row.sent_at - row.published_at) / timedelta(seconds=1) for row in rows]


@pytest.mark.timeout(600)
def test_critical_mail_meets_its_target_while_a_bulk_backlog_drains(
    pg_app_url, pg_dagster_home, tmp_path
):
    sandbox = SandboxServer(SandboxConfig(latency_ms=50))
    sandbox.start()
    env = {
        "EMAIL_PLATFORM_DATABASE_URL": pg_app_url,
        "EMAIL_PLATFORM_PROVIDER": "sandbox",
        "EMAIL_PLATFORM_SANDBOX_BASE_URL": sandbox.base_url,
        # One message a call, as the real adapters send: the backlog lasts.
        "EMAIL_PLATFORM_SANDBOX_BATCH_MAX": "1",
        "EMAIL_PLATFORM_LANES": json.dumps(LANES),
    }
    engine = make_engine(pg_app_url)
    daemon = DaemonProcess(pg_dagster_home, env)
    try:
        daemon.start()
        assert daemon.wait_until_ticking(), daemon.log_path.read_text()[-3000:]
        # The warm critical worker is up before any critical mail exists.
        assert wait_for(lambda: _live_workers(engine, "critical") == 1, 120, 0.5), (
            daemon.log_path.read_text()[-3000:]
        )
        bulk = publish_across_lanes(
            engine, {"critical": 0, "transactional": 0, "bulk": BULK_EVENTS}
        )
        assert wait_for(lambda: outbox_statuses(engine, bulk)["done"] >= 100, 180, 0.5)
        critical: list[str] = []
        for i in range(CRITICAL_EVENTS):
            critical.append(_publish_reset(engine, i))
            time.sleep(0.3)
        backlog_left = BULK_EVENTS - outbox_statuses(engine, bulk)["done"]
        assert wait_for(lambda: outbox_statuses(engine, critical)["done"] == CRITICAL_EVENTS, 120)
        latencies = sorted(_latencies_s(engine, critical))
        assert wait_for(lambda: outbox_statuses(engine, bulk)["done"] == BULK_EVENTS, 300, 1.0)
    finally:
        daemon.stop(drain_s=20.0)
        sandbox.stop()
        engine.dispose()

    # The resets were published while the backlog was draining, not after it.
    assert backlog_left > 0, "the bulk backlog drained before the last reset: nothing tested"
    p50 = statistics.median(latencies)
    p99 = latencies[-1]  # 30 samples: the 99th percentile is the worst one
    print(f"critical publish->accepted p50 {p50:.2f} s, p99 {p99:.2f} s; bulk left {backlog_left}")
    assert len(latencies) == CRITICAL_EVENTS
    assert p99 < DEFAULT_LANE_CONFIGS[Lane.CRITICAL].target_s
