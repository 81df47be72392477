"""End to end on Dagster's Celery executor: a real daemon on a PostgreSQL Dagster instance, the
application database on PostgreSQL, Redis as the broker, two ``dagster-celery`` worker
processes, the sandbox over HTTP. One worker is killed mid-drain, as a host that dies would be.
"""

import json
import time
from collections import Counter

import pytest
import redis

from email_platform.db.engine import make_engine
from email_platform.local.celery_worker import CeleryWorkerProcess
from email_platform.local.dagster_home import (
    DaemonProcess,
    wait_for,
)
from email_platform.sandbox.server import SandboxConfig, SandboxServer
from tests.support import (
    celery_workers_by_lane,
    outbox_statuses,
    publish_across_lanes,
    sandbox_messages,
)

BROKER = "redis://127.0.0.1:6379/11"
#: Short-lived workers, so the survivor's slots free up for the runs that replace the dead ones.
LANES = {
    "critical": {"concurrency": 2, "worker_idle_s": 5, "worker_lifetime_s": 60},
    "transactional": {"concurrency": 2, "batch_size": 10, "worker_idle_s": 5},
    "bulk": {"concurrency": 2, "batch_size": 10, "workers": 2, "worker_idle_s": 5},
}


@pytest.mark.timeout(720)
def test_every_lane_drains_on_two_celery_workers_and_a_killed_one_loses_nothing(
    pg_app_url, pg_dagster_home, tmp_path
):
    redis.Redis.from_url(BROKER).flushdb()
    sandbox = SandboxServer(SandboxConfig(latency_ms=40))
    sandbox.start()
    env = {
        "DAGSTER_HOME": str(pg_dagster_home),
        "EMAIL_PLATFORM_DATABASE_URL": pg_app_url,
        "EMAIL_PLATFORM_PROVIDER": "sandbox",
        "EMAIL_PLATFORM_SANDBOX_BASE_URL": sandbox.base_url,
        "EMAIL_PLATFORM_LANES": json.dumps(LANES),
        "EMAIL_PLATFORM_EXECUTOR": "celery",
        "EMAIL_PLATFORM_CELERY_BROKER": BROKER,
        "EMAIL_PLATFORM_CELERY_LANE_QUEUES": "critical=critical",
    }
    engine = make_engine(pg_app_url)
    # w1 alone serves the critical queue, and has a slot for every lane worker the run queue
    # lets run at once (critical 1, transactional 1, bulk 2): once w2 is gone, no run waits in
    # Celery's queue for a slot until the lane sensor gives it up for never starting.
    w1 = CeleryWorkerProcess(
        "w1", env, tmp_path / "w1.log", queues=["critical", "dagster"], concurrency=4
    )
    w2 = CeleryWorkerProcess("w2", env, tmp_path / "w2.log", queues=["dagster"], concurrency=2)
    daemon = DaemonProcess(pg_dagster_home, env)

    def logs() -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
            for p in (tmp_path / "w1.log", tmp_path / "w2.log", daemon.log_path)
            if p.exists()
        )

    try:
        w1.start()
        w2.start()
        daemon.start()
        ids = publish_across_lanes(engine, {"critical": 20, "transactional": 60, "bulk": 400})

        # Kill w2 (and its step processes) once it is sending, well before the drain ends.
        assert wait_for(
            lambda: "w2" in set().union(*celery_workers_by_lane(pg_dagster_home).values()), 120, 1.0
        ), logs()
        assert wait_for(lambda: outbox_statuses(engine, ids)["done"] >= 60, 120, 0.5), logs()
        assert outbox_statuses(engine, ids)["pending"] > 0, (
            "drained before the kill: nothing tested"
        )
        w2.kill()
        killed_at = time.monotonic()

        def drained_() -> bool:
            counts = outbox_statuses(engine, ids)
            print(f"{time.monotonic() - killed_at:5.0f} s after the kill: {dict(counts)}")
            return counts == Counter(done=480)

        drained = wait_for(drained_, 420, 5.0)
        assert drained, (outbox_statuses(engine, ids), logs())
        recovered_s = time.monotonic() - killed_at
        # Everything stopped before counting: nothing still running may send again.
        daemon.stop(drain_s=30.0)
        w1.stop()
        accepted = sandbox_messages(sandbox.base_url)
    finally:
        daemon.stop(drain_s=30.0)
        w1.stop()
        w2.stop()
        sandbox.stop()
        engine.dispose()

    # Every event accepted once: what w2 had in flight was sent again with its own key (a new
    # key would be a second message for the same event).
    per_event = Counter(m["metadata"]["event_id"] for m in accepted)
    assert set(per_event) == set(ids) and set(per_event.values()) == {1}, per_event.most_common(3)
    assert len({m["idempotency_key"] for m in accepted}) == 480

    hosts = celery_workers_by_lane(pg_dagster_home)
    assert hosts["critical"] == {"w1"}, hosts  # its own queue, served by w1 only
    assert set().union(*hosts.values()) == {"w1", "w2"}, hosts  # both workers took part
    assert "w1" in hosts["bulk"], hosts  # the survivor took over the dead one's lane
    print(f"recovered {recovered_s:.0f} s after the kill; steps by worker: {hosts}")
