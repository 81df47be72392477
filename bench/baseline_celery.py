"""The baseline a user would pick instead: a Celery worker on Redis, fed from the same outbox.

Two processes, both started by ``bench.send``:

- the relay, ``python -m bench.baseline_celery relay``: claims due outbox events in batches
  (the same atomic claim the send op uses) and enqueues one Celery task per event;
- the worker, ``celery -A bench.baseline_celery worker --pool threads -c 32``: each task loads
  its event, routes and renders it with the shipped routes and templates, records the message
  with its idempotency key (one transaction), sends it with the same ``SandboxProvider`` adapter
  to the same sandbox, then records the attempt, marks the message sent and the event done
  (a second transaction). That is what a careful Celery user writes; it skips what the platform
  adds on top (dedupe keys, suppressions, dead letters, retries with backoff).

Configuration comes from the environment: ``BENCH_DATABASE_URL``, ``BENCH_SANDBOX_URL``,
``BENCH_REDIS_URL`` (default ``redis://127.0.0.1:6379/15``), ``BENCH_CONCURRENCY``,
``BENCH_BATCH_SIZE`` and ``BENCH_READY_FILE`` (touched when the worker is ready).
"""

import os
import signal
import sys
import threading
import time
from functools import cache
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import worker_ready
from sqlalchemy import select

from email_platform.db.engine import make_engine
from email_platform.db.schema import email_outbox as outbox_table
from email_platform.store import attempts, messages, outbox
from email_platform.timeutil import utcnow

REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/15")

app = Celery("bench_baseline", broker=REDIS_URL)
app.conf.update(
    task_ignore_result=True,
    worker_prefetch_multiplier=8,
    task_acks_late=True,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    # Critical tasks jump the queue, as a user would configure it on Redis.
    broker_transport_options={"queue_order_strategy": "priority", "priority_steps": [0, 9]},
)


@cache
def _engine() -> Any:
    concurrency = int(os.environ.get("BENCH_CONCURRENCY", "32"))
    return make_engine(os.environ["BENCH_DATABASE_URL"], pool_size=concurrency)


@cache
def _mailer() -> Any:
    from bench.ceiling import Mailer

    return Mailer(_engine())


@cache
def _provider() -> Any:
    from email_platform.providers.sandbox import SandboxProvider

    concurrency = int(os.environ.get("BENCH_CONCURRENCY", "32"))
    return SandboxProvider(
        os.environ["BENCH_SANDBOX_URL"], max_connections=concurrency, timeout_s=30
    )


@worker_ready.connect
def _ready(**_: Any) -> None:
    # Warm the shared objects once, then tell the harness.
    _engine(), _mailer(), _provider()
    ready = os.environ.get("BENCH_READY_FILE")
    if ready:
        Path(ready).touch()


@app.task(name="bench.send_event", acks_late=True)
def send_event(event_id: str) -> None:
    engine = _engine()
    with engine.connect() as connection:
        event = outbox.get_event(connection, event_id)
    for route, email in _mailer().emails_for(event):
        now = utcnow()
        with engine.begin() as connection:
            message = messages.create(
                connection,
                {
                    "event_id": event.event_id,
                    "route": route.name,
                    "template": route.template,
                    "template_version": 1,
                    "lane": event.lane,
                    "recipient": email.to,
                    "recipient_domain": email.to.rsplit("@", 1)[-1],
                    "idempotency_key": email.idempotency_key,
                    "status": messages.PENDING,
                    "created_at": now,
                    "updated_at": now,
                    "provider": "sandbox",
                },
            )
        started = utcnow()
        accepted = _provider().send(email)
        finished = utcnow()
        with engine.begin() as connection:
            attempts.add(
                connection,
                [
                    {
                        "message_id": message.message_id,
                        "event_id": event.event_id,
                        "run_id": "celery",
                        "attempt_no": 1,
                        "started_at": started,
                        "finished_at": finished,
                        "outcome": "accepted",
                        "http_status": accepted.status_code,
                        "provider_message_id": accepted.provider_message_id,
                    }
                ],
            )
            messages.record_attempt(
                connection,
                message.message_id,
                finished,
                accepted=True,
                provider="sandbox",
                provider_message_id=accepted.provider_message_id,
                error=None,
            )
    with engine.begin() as connection:
        outbox.finish(connection, [event_id], status=outbox.DONE, resolution="sent", now=utcnow())


def relay() -> None:
    """Claim due events and enqueue them, critical first, until SIGTERM."""
    engine = make_engine(os.environ["BENCH_DATABASE_URL"])
    batch_size = int(os.environ.get("BENCH_BATCH_SIZE", "2000"))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.is_set():
        now = utcnow()
        with engine.begin() as connection:
            ids = (
                connection.execute(
                    select(outbox_table.c.event_id)
                    .where(outbox_table.c.status == outbox.PENDING)
                    .order_by((outbox_table.c.lane != "critical"), outbox_table.c.published_at)
                    .limit(batch_size)
                )
                .scalars()
                .all()
            )
            claimed = (
                outbox.claim(connection, ids, run_id="celery-relay", lease_s=3600, now=now)
                if ids
                else []
            )
        if not claimed:
            time.sleep(0.05)
            continue
        with app.producer_or_acquire() as producer:
            for event in claimed:
                priority = 9 if event.lane == "critical" else 0
                send_event.apply_async((event.event_id,), producer=producer, priority=priority)


if __name__ == "__main__":
    if sys.argv[1:] == ["relay"]:
        relay()
    else:
        sys.exit("usage: python -m bench.baseline_celery relay")
