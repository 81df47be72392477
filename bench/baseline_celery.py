"""The baseline a user would pick instead: Celery on Redis, fed from the same outbox, tuned.

Two kinds of process, both started by ``bench.send``:

- the relay, ``python -m bench.baseline_celery relay``: claims due outbox events in batches
  (the same atomic claim the send op uses) and enqueues one task per event, or one per
  ``BENCH_PROVIDER_BATCH`` events when the provider takes batch calls, critical first (Redis
  priority queue). The event's fields travel in the task message, so a task reads nothing back;
- one or more workers, ``celery -A bench.baseline_celery worker`` with the pool of a
  ``CeleryConfig`` (``prefork-4``, ``gevent-300``, ``gevent-2x150``): each task routes and renders
  its events with the shipped routes and templates, records the messages with their idempotency
  keys (one transaction), sends them with the same ``SandboxProvider`` adapter to the same
  sandbox (one call per message, or one batch call), then records the attempts, marks the
  messages sent and the events done (a second transaction). Transient provider errors retry the
  task with backoff; a retry reuses the recorded messages and their keys.

That is what a careful Celery user writes; it skips what the platform adds on top (dedupe keys,
suppressions, dead letters, quiet hours). How each pool is tuned, and why, is in
``CeleryConfig``.

Configuration comes from the environment: ``BENCH_DATABASE_URL``, ``BENCH_SANDBOX_URL``,
``BENCH_REDIS_URL`` (default ``redis://127.0.0.1:6379/15``), ``BENCH_CELERY_BROKER`` (``redis``
or ``rabbitmq``, at ``BENCH_AMQP_URL``, default ``amqp://guest:guest@127.0.0.1:5672//``, queue
``BENCH_CELERY_QUEUE``), ``BENCH_CELERY_POOL``,
``BENCH_CONCURRENCY`` (per worker process), ``BENCH_PROVIDER_BATCH``, ``BENCH_BATCH_SIZE`` (the
relay's claim) and ``BENCH_READY_FILE`` (touched when the worker is ready).
"""

import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from celery import Celery
from celery.signals import worker_process_init, worker_ready
from kombu import Exchange, Queue
from sqlalchemy import select
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from email_platform.common.errors import DeliveryError
from email_platform.common.timeutil import utcnow
from email_platform.db.engine import make_engine
from email_platform.db.schema import email_outbox as outbox_table
from email_platform.providers.base import Accepted
from email_platform.store import attempts, messages, outbox

REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/15")
AMQP_URL = os.environ.get("BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")


#: Bounds of a configuration the bench will start (see ``CeleryConfig.parse``): prefork
#: children and greenlets or threads over all worker processes, and worker processes.
PREFORK_MAX = 64
POOL_MAX = 2000
PROCESSES_MAX = 16


@dataclass(frozen=True)
class CeleryConfig:
    """One tuned Celery deployment: ``processes`` workers, each a ``pool`` of ``concurrency``.

    Spelled ``prefork-4`` (one worker, four child processes), ``gevent-300`` (one worker, 300
    greenlets) or ``gevent-2x150`` (two workers of 150 greenlets, one per core: one gevent
    process runs Python on one core at a time). ``threads-32`` is the old baseline.
    """

    pool: str
    concurrency: int
    processes: int = 1
    #: ``redis`` or ``rabbitmq`` (spelled ``prefork-4@rabbitmq``): the broker the tasks go
    #: through. Celery's docs present RabbitMQ as the complete broker; with Redis, a late
    #: acknowledgement is a pipelined transaction on the broker's bookkeeping of unacked tasks.
    broker: str = "redis"

    @classmethod
    def parse(cls, spec: str) -> "CeleryConfig":
        match = re.fullmatch(
            r"(prefork|gevent|threads)-(?:(\d+)x)?(\d+)(?:@(redis|rabbitmq))?", spec.strip()
        )
        if not match:
            raise ValueError(
                f"celery config {spec!r}: say prefork-4, gevent-300, gevent-2x150 or "
                "prefork-4@rabbitmq"
            )
        pool, processes, concurrency, broker = match.groups()
        config = cls(pool, int(concurrency), int(processes or 1), broker or "redis")
        # A prefork child is a process and a greenlet a connection's worth of memory: past
        # these, a typo would take the machine, not measure Celery.
        most = PREFORK_MAX if pool == "prefork" else POOL_MAX
        if (
            config.concurrency < 1
            or not 1 <= config.processes <= PROCESSES_MAX
            or config.in_flight > most
        ):
            raise ValueError(
                f"celery config {spec!r}: worker processes must be 1 to {PROCESSES_MAX}, each "
                f"of concurrency 1 or more, and {most} in all at most"
            )
        return config

    @property
    def name(self) -> str:
        size = f"{self.processes}x{self.concurrency}" if self.processes > 1 else self.concurrency
        return f"{self.pool}-{size}" + (f"@{self.broker}" if self.broker != "redis" else "")

    @property
    def in_flight(self) -> int:
        """Tasks running at once across every worker process."""
        return self.processes * self.concurrency

    def prefetch_multiplier(self, provider_batch: int) -> int:
        """Tasks each pool slot reserves ahead, as Celery's Optimizing guide ("Prefetch limits")
        advises for the task's shape.

        Prefork, one email a task (a few milliseconds of CPU): many short tasks, so a large
        multiplier, every child always holding its next task. Prefork, a batch a task: long
        tasks, so 1. Gevent: Celery's default, 4. Measured here (gevent-20, 20 ms sandbox, one
        email a task): multiplier 1 sent 10 emails/s, 4 sent 110/s; with Redis, the gevent pool's
        consumer refills its reservations only every so often, and 1 leaves greenlets idle.
        """
        if self.pool == "prefork":
            return 64 if provider_batch == 1 else 1
        return 4

    def db_pool_size(self) -> int:
        """Database connections per worker process.

        A prefork child runs one task at a time. Greenlets and threads hold a connection only
        for a transaction of a few milliseconds, never across the provider call, so 16 serve
        hundreds of them (and keep the whole bench under PostgreSQL's 100 connections).
        """
        return 1 if self.pool == "prefork" else min(self.concurrency, 16)


def _env_config() -> CeleryConfig:
    return CeleryConfig(
        os.environ.get("BENCH_CELERY_POOL", "prefork"),
        int(os.environ.get("BENCH_CONCURRENCY", 4)),
        broker=os.environ.get("BENCH_CELERY_BROKER", "redis"),
    )


def _provider_batch() -> int:
    return int(os.environ.get("BENCH_PROVIDER_BATCH", "1"))


def _broker_settings(config: CeleryConfig) -> tuple[str, dict[str, Any]]:
    """The broker's URL and the settings that go with it."""
    if config.broker == "rabbitmq":
        # A queue of its own per run (``BENCH_CELERY_QUEUE``), with priorities, that RabbitMQ
        # deletes ten minutes after its last consumer left: no task of an earlier run is left.
        name = os.environ.get("BENCH_CELERY_QUEUE", "bench")
        queue = Queue(
            name,
            Exchange(name, auto_delete=True),  # goes with its queue's binding
            routing_key=name,
            queue_arguments={"x-max-priority": 9, "x-expires": 600_000},
        )
        return AMQP_URL, {
            "task_queues": [queue],
            "task_default_queue": name,
            "task_default_exchange": name,
            "task_default_routing_key": name,
        }
    return REDIS_URL, {
        "broker_transport_options": {
            # Critical tasks jump the queue, as a user would configure it on Redis (where
            # kombu reads the lists in ``priority_steps`` order: 0 first; see ``priority_of``).
            "queue_order_strategy": "priority",
            "priority_steps": [0, 9],
            # Each greenlet acks its own task on a Redis connection: kombu's default of 10 made
            # gevent-300 fail acks with "Too many connections" (and a task unacked stays queued).
            "max_connections": config.concurrency + 10,
        },
    }


_BROKER_URL, _BROKER_SETTINGS = _broker_settings(_env_config())
app = Celery("bench_baseline", broker=_BROKER_URL)
app.conf.update(
    task_ignore_result=True,
    # A task's email is acknowledged only once it is recorded: a worker that dies mid-task has
    # it redelivered (Celery's docs: acks_late for idempotent tasks; the key makes it so).
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=int(
        os.environ.get("BENCH_PREFETCH_MULTIPLIER")
        or _env_config().prefetch_multiplier(_provider_batch())
    ),
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    **_BROKER_SETTINGS,
)


@cache
def _engine() -> Any:
    return make_engine(os.environ["BENCH_DATABASE_URL"], pool_size=_env_config().db_pool_size())


@cache
def _mailer() -> Any:
    from bench.ceiling import Mailer

    return Mailer(_engine())


@cache
def _provider() -> Any:
    from bench.providers import open_bench_provider

    return open_bench_provider(
        os.environ.get("BENCH_PROVIDER", "sandbox"),
        os.environ["BENCH_SANDBOX_URL"],
        max_connections=max(1, _env_config().concurrency),
        batch_max=_provider_batch(),
    )


def _warm() -> None:
    _engine(), _mailer(), _provider()


@worker_process_init.connect
def _warm_child(**_: Any) -> None:
    # Each prefork child builds its own engine and HTTP clients: sockets must not cross a fork.
    _warm()


@worker_ready.connect
def _ready(**_: Any) -> None:
    if _env_config().pool != "prefork":
        _warm()  # the pool lives in this process
    ready = os.environ.get("BENCH_READY_FILE")
    if ready:
        Path(ready).touch()


def _event(fields: dict[str, Any]) -> SimpleNamespace:
    return SimpleNamespace(**fields)


@app.task(
    name="bench.send_events",
    bind=True,
    # A database hiccup retries too: gevent-300 on a loaded host once waited past the pool's
    # 30 s for a connection, and the task, failed and acked, left its event in flight for good.
    autoretry_for=(DeliveryError, OperationalError, PoolTimeoutError),
    retry_backoff=1,
    retry_jitter=True,
    max_retries=5,
)
def send_events(self: Any, events: list[dict[str, Any]]) -> None:
    """Route, render, record, send and record the outcome of ``events`` (one or a batch)."""
    engine = _engine()
    work = [
        (event, route, email)
        for event in map(_event, events)
        for route, email in _mailer().emails_for(event)
    ]
    now = utcnow()
    with engine.begin() as connection:
        known = {}
        if self.request.retries:
            # A retry: the messages and their keys were recorded by the first try.
            ids = [event.event_id for event in map(_event, events)]
            known = {row.idempotency_key: row for row in messages.for_events(connection, ids)}
        fresh = [
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
            }
            for event, route, email in work
            if email.idempotency_key not in known
        ]
        if len(fresh) == 1:
            created = [messages.create(connection, fresh[0])]
        else:
            created = messages.create_many(connection, fresh)
        known.update((row.idempotency_key, row) for row in created)
    rows = [known[email.idempotency_key] for _, _, email in work]
    to_send = [
        (row, email)
        for row, (_, _, email) in zip(rows, work, strict=True)
        if row.status != messages.SENT
    ]
    started = utcnow()
    if len(to_send) == 1:
        try:
            results: list[Accepted | DeliveryError] = [_provider().send(to_send[0][1])]
        except DeliveryError as error:
            results = [error]
    elif to_send:
        results = _provider().send_many([email for _, email in to_send])
    else:
        results = []
    finished = utcnow()
    accepted = [
        (row, result)
        for (row, _), result in zip(to_send, results, strict=True)
        if isinstance(result, Accepted)
    ]
    with engine.begin() as connection:
        attempts.add(
            connection,
            [
                {
                    "message_id": row.message_id,
                    "event_id": row.event_id,
                    "run_id": "celery",
                    "attempt_no": row.attempts + 1,
                    "started_at": started,
                    "finished_at": finished,
                    "outcome": "accepted" if isinstance(result, Accepted) else "failed",
                    "http_status": getattr(result, "status_code", None),
                    "provider_message_id": getattr(result, "provider_message_id", None),
                }
                for (row, _), result in zip(to_send, results, strict=True)
            ],
        )
        if len(accepted) == 1:
            row, result = accepted[0]
            messages.record_attempt(
                connection,
                row.message_id,
                finished,
                accepted=True,
                provider="sandbox",
                provider_message_id=result.provider_message_id,
                error=None,
            )
        else:
            messages.record_accepted_many(
                connection,
                [(row.message_id, result.provider_message_id) for row, result in accepted],
                finished,
                "sandbox",
            )
        failed = [result for result in results if not isinstance(result, Accepted)]
        if not failed:
            outbox.finish(
                connection,
                [event["event_id"] for event in events],
                status=outbox.DONE,
                resolution="sent",
                now=finished,
            )
    if failed:
        raise failed[0]  # autoretry: the retry sends only what is still unsent


_EVENT_FIELDS = ("event_id", "event_type", "event_version", "payload", "lane", "idempotency_key")


def priority_of(lane: str, broker: str) -> int:
    """A task's priority: critical mail first. The scales run opposite ways: RabbitMQ delivers
    9 first, kombu's Redis transport 0 (it reads its per-priority lists in ``priority_steps``
    order). Until 2026-12-04 the relay gave critical tasks 9 on Redis too: the lowest there."""
    first, last = (9, 0) if broker == "rabbitmq" else (0, 9)
    return first if lane == "critical" else last


def relay() -> None:
    """Claim due events and enqueue them, critical first, until SIGTERM."""
    config = _env_config()
    engine = make_engine(os.environ["BENCH_DATABASE_URL"])
    batch_size = int(os.environ.get("BENCH_BATCH_SIZE", "2000"))
    per_task = _provider_batch()
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
            for lane in ("critical", "transactional", "bulk"):
                events = [
                    {name: getattr(event, name) for name in _EVENT_FIELDS}
                    for event in claimed
                    if event.lane == lane
                ]
                for start in range(0, len(events), per_task):
                    send_events.apply_async(
                        (events[start : start + per_task],),
                        producer=producer,
                        priority=priority_of(lane, config.broker),
                    )


if __name__ == "__main__":
    if sys.argv[1:] == ["relay"]:
        relay()
    else:
        sys.exit("usage: python -m bench.baseline_celery relay")
