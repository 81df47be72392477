"""Webhook durability under faults (docs/design.md invariants 2 and 7): the receiver killed
while the provider is posting, and an ingestion worker killed mid-batch. Nothing lost, nothing
doubled.
"""

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from sqlalchemy import func, select

from email_platform.common.timeutil import utcnow
from email_platform.db.schema import email_events, webhook_inbox
from email_platform.sandbox.emitter import WebhookPlan
from email_platform.sandbox.server import SandboxConfig, SandboxServer
from email_platform.store import inbox
from email_platform.webhooks.ingest import WebhookIngestor
from tests.support import run_send, sandbox_stats, signup
from tests.webhook_support import SECRET, sandbox_event, signed


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_receiver(database_url: str, port: int) -> subprocess.Popen:
    cli = Path(sys.executable).with_name("email-platform")
    process = subprocess.Popen(
        [str(cli), "webhooks", "serve", "--port", str(port), "--url", database_url],
        env={**os.environ, "EMAIL_PLATFORM_SANDBOX_WEBHOOK_SECRET": SECRET},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    raise AssertionError("receiver did not start")


def _count(engine, table) -> int:  # type: ignore[no-untyped-def]
    with engine.connect() as connection:
        return connection.execute(select(func.count()).select_from(table)).scalar_one()


def _wait(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def test_receiver_killed_while_the_provider_posts_loses_and_doubles_nothing(engine, database_url):
    port = _free_port()
    receiver = _start_receiver(database_url, port)
    plan = WebhookPlan(
        webhook_url=f"http://127.0.0.1:{port}/webhooks/sandbox",
        secret=SECRET,
        bounce_rate=0.0,
        complaint_rate=0.0,
        unsubscribe_rate=0.0,
        delivered_rate=1.0,
        open_rate=1.0,
        click_rate=1.0,
        machine_open_rate=0.0,
        duplicate_rate=0.3,
        delay_s=0.0,
        max_attempts=10,
    )
    ids = [signup(engine, f"u{i}") for i in range(20)]
    try:
        with SandboxServer(SandboxConfig(webhooks=plan, seed=3)) as sandbox_url:
            assert run_send(database_url, sandbox_url, "transactional", ids).success
            # Kill the receiver as soon as the first webhooks are stored ...
            assert _wait(lambda: _count(engine, webhook_inbox) >= 5, 30)
            os.killpg(receiver.pid, signal.SIGKILL)
            receiver.wait()
            time.sleep(1.0)  # ... the provider keeps posting into a dead port, then retries ...
            receiver = _start_receiver(database_url, port)  # ... and a new receiver comes up.
            stats = {}

            def settled() -> bool:
                stats.update(sandbox_stats(sandbox_url))
                return stats["webhooks_delivered"] == (
                    stats["webhooks_planned"] + stats["webhooks_duplicated"]
                )

            assert _wait(settled, 60), stats
    finally:
        os.killpg(receiver.pid, signal.SIGKILL)
        receiver.wait()
    assert stats["webhook_failed_attempts"] > 0  # the outage was real
    planned = stats["webhooks_planned"]  # delivered + opened + clicked for each of 20
    assert planned == 60
    assert _count(engine, webhook_inbox) == planned  # duplicates not stored twice
    with engine.connect() as connection:
        pending = [r.inbox_id for r in connection.execute(select(webhook_inbox.c.inbox_id))]
    WebhookIngestor(engine).run(pending, run_id="after-outage")
    assert _count(engine, email_events) == planned  # every event applied, once


def _ingest_in_child(database_url: str, inbox_ids: list[int], die_at: int) -> None:
    """Ingest, and SIGKILL this process inside the transaction of the ``die_at``-th inbox row
    (its finish written, not committed): a crash at a known point instead of a race."""
    from email_platform.db.engine import make_engine
    from email_platform.store import inbox as inbox_store

    finish, finished = inbox_store.finish, 0

    def finish_then_die(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal finished
        finish(*args, **kwargs)
        finished += 1
        if finished == die_at:
            os.kill(os.getpid(), signal.SIGKILL)

    inbox_store.finish = finish_then_die
    WebhookIngestor(make_engine(database_url)).run(inbox_ids, run_id="doomed-run", lease_s=600)


def test_ingestion_worker_killed_mid_batch_resumes_without_doubles(engine, database_url):
    total = 600
    now = utcnow()
    with engine.begin() as connection:
        for i in range(total):
            body, headers = signed(
                sandbox_event("email.delivered", message_id=f"sbx_{i}", to=f"u{i}@example.com")
            )
            inbox.store(
                connection,
                provider="sandbox",
                delivery_id=headers["webhook-id"],
                headers=headers,
                body=body.decode(),
                now=now,
            )
        ids = [r.inbox_id for r in connection.execute(select(webhook_inbox.c.inbox_id))]
    die_at = 250
    child = multiprocessing.get_context("spawn").Process(
        target=_ingest_in_child, args=(database_url, ids, die_at)
    )
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL

    def processed() -> int:
        with engine.connect() as connection:
            return connection.execute(
                select(func.count())
                .select_from(webhook_inbox)
                .where(webhook_inbox.c.status == "processed")
            ).scalar_one()

    done_before = processed()
    assert done_before == die_at - 1  # the row it died in rolled back with its events
    # The run-failure sensor (or the lease) gives the rest back; a new run finishes the job.
    with engine.begin() as connection:
        assert inbox.release_run(connection, "doomed-run") == total - done_before
    outcome = WebhookIngestor(engine).run(ids, run_id="rescue-run")
    assert outcome.claimed == total - done_before
    assert processed() == total
    assert _count(engine, email_events) == total  # nothing lost, nothing applied twice
