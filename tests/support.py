"""Helpers shared by the storage tests: publish events, run the real send job, read state."""

import contextlib
import json
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
from dagster import (
    DagsterEventType,
    DagsterInstance,
    ExecuteInProcessResult,
    ReexecutionOptions,
    execute_job,
)
from sqlalchemy import Column, Engine, MetaData, String, Table, create_engine, insert, select, text
from sqlalchemy.engine import URL

from email_platform import publish
from email_platform.common.lanes import LaneConfig
from email_platform.db.schema import dead_letters, email_attempts, email_messages, email_outbox
from email_platform.definitions import build_definitions
from email_platform.mail.routes import RouteTable, default_routes
from email_platform.providers.base import EmailProvider
from email_platform.resources import AppDatabase, EmailProviderResource, LanePolicy, RoutingResource
from email_platform.sending.batch import BatchSender, build_sender

FAST_LANES = {
    lane: {"retry_delay_s": 0.05, "max_retry_delay_s": 2.0, "max_retries": 3}
    for lane in ("critical", "transactional", "bulk")
}

# The lanes as one launched run per batch (no resident workers): for tests of that mode.
BATCH_LANES_JSON = json.dumps({lane: {"workers": 0} for lane in FAST_LANES})


def batch_sender(engine: Engine, provider: EmailProvider, lane: LaneConfig) -> BatchSender:
    """The send path with the shipped routes and templates, as the send op builds it."""
    return build_sender(
        engine=engine, provider=provider, lane=lane, sender_address="Example <no-reply@example.com>"
    )


@contextlib.contextmanager
def fresh_pg_database(admin_url: URL, prefix: str, template: str | None = None) -> Iterator[URL]:
    """A new PostgreSQL database (a copy of ``template`` if given), dropped afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    copy = f' TEMPLATE "{template}"' if template else ""
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"{copy}'))
    try:
        yield admin_url.set(database=name)
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


product = MetaData()
users = Table(
    "users",
    product,
    Column("id", String(64), primary_key=True),
    Column("email", String(320), nullable=False),
)


def signup(engine: Engine, user_id: str, email: str | None = None, **kwargs: Any) -> str:
    """The product's signup transaction: the users row and its event, committed together."""
    email = email or f"{user_id}@example.com"
    with engine.begin() as connection:
        product.create_all(connection)
        connection.execute(insert(users).values(id=user_id, email=email))
        return publish(
            connection,
            event_type="user.signed_up",
            aggregate_id=user_id,
            payload={"user_id": user_id, "email": email, "first_name": "Jane"},
            **kwargs,
        )


def publish_one(engine: Engine, **kwargs: Any) -> str:
    with engine.begin() as connection:
        return publish(connection, **kwargs)


def publish_across_lanes(engine: Engine, lane_counts: dict[str, int]) -> list[str]:
    """Password resets (critical), signups (transactional) and digests (bulk); their ids."""
    ids: list[str] = []
    with engine.begin() as connection:
        product.create_all(connection)
        for i in range(lane_counts["critical"]):
            connection.execute(insert(users).values(id=f"c{i}", email=f"c{i}@example.com"))
            ids.append(
                publish(
                    connection,
                    event_type="user.password_reset_requested",
                    aggregate_id=f"c{i}",
                    payload={"user_id": f"c{i}", "reset_token": f"t{i}"},
                )
            )
        for i in range(lane_counts["transactional"]):
            ids.append(
                publish(
                    connection,
                    event_type="user.signed_up",
                    aggregate_id=f"t{i}",
                    payload={"user_id": f"t{i}", "email": f"t{i}@example.com", "first_name": "Al"},
                )
            )
        for i in range(lane_counts["bulk"]):
            ids.append(
                publish(
                    connection,
                    event_type="digest.ready",
                    aggregate_id=f"b{i}",
                    payload={"email": f"b{i}@example.org", "first_name": "Jo", "highlights": ["a"]},
                )
            )
    return ids


def outbox_statuses(engine: Engine, ids: list[str]) -> Counter:
    with engine.connect() as connection:
        rows = connection.execute(
            select(email_outbox.c.status).where(email_outbox.c.event_id.in_(ids))
        ).all()
    return Counter(row.status for row in rows)


def celery_workers_by_lane(home: Path) -> dict[str, set[str]]:
    """Lane -> the Celery workers that executed its steps, from the runs' own event logs."""
    hosts: dict[str, set[str]] = {}
    with DagsterInstance.from_config(str(home)) as instance:
        for run in instance.get_runs():
            for entry in instance.all_logs(run.run_id, of_type=DagsterEventType.ENGINE_EVENT):
                data = entry.dagster_event.engine_event_data if entry.dagster_event else None
                if data is not None and "Celery worker" in data.metadata:
                    worker = str(data.metadata["Celery worker"].value).split("@")[0]
                    hosts.setdefault(run.tags["email/lane"], set()).add(worker)
    return hosts


def send_job_defs(
    database_url: str,
    sandbox_url: str,
    *,
    lanes: dict | None = None,
    routing: RoutingResource | None = None,
    timeout_s: float = 5.0,
    provider: EmailProviderResource | None = None,
):  # type: ignore[no-untyped-def]
    return build_definitions(
        email_database=AppDatabase(url=database_url),
        email_provider=provider
        or EmailProviderResource(provider="sandbox", base_url=sandbox_url, timeout_s=timeout_s),
        email_lanes=LanePolicy(overrides_json=json.dumps(lanes or FAST_LANES)),
        email_routing=routing or RoutingResource(),
    )


def run_send(
    database_url: str,
    sandbox_url: str,
    lane: str,
    event_ids: Sequence[str],
    *,
    instance: DagsterInstance | None = None,
    lanes: dict | None = None,
    routing: RoutingResource | None = None,
    timeout_s: float = 5.0,
    provider: EmailProviderResource | None = None,
) -> ExecuteInProcessResult:
    """Run the real send job in process; ``provider`` replaces the sandbox (adapter tests)."""
    job = send_job_defs(
        database_url,
        sandbox_url,
        lanes=lanes,
        routing=routing,
        timeout_s=timeout_s,
        provider=provider,
    ).get_job_def("send_email_job")
    return job.execute_in_process(
        run_config={
            "ops": {"send_email_batch": {"config": {"lane": lane, "event_ids": list(event_ids)}}}
        },
        instance=instance or DagsterInstance.ephemeral(),
        tags={"email/lane": lane},
        raise_on_error=False,
    )


def event(engine: Engine, event_id: str):  # type: ignore[no-untyped-def]
    with engine.connect() as connection:
        return connection.execute(
            select(email_outbox).where(email_outbox.c.event_id == event_id)
        ).one()


def messages_of(engine: Engine, event_id: str) -> list:
    with engine.connect() as connection:
        return list(
            connection.execute(
                select(email_messages).where(email_messages.c.event_id == event_id)
            ).all()
        )


def attempts_of(engine: Engine, event_id: str) -> list:
    with engine.connect() as connection:
        return list(
            connection.execute(
                select(email_attempts)
                .where(email_attempts.c.event_id == event_id)
                .order_by(email_attempts.c.attempt_id)
            ).all()
        )


def dead_letters_of(engine: Engine, event_id: str) -> list:
    with engine.connect() as connection:
        return list(
            connection.execute(
                select(dead_letters).where(dead_letters.c.event_id == event_id)
            ).all()
        )


def sandbox_messages(base_url: str, event_id: str | None = None) -> list[dict]:
    params = {"event_id": event_id} if event_id else {}
    return httpx.get(f"{base_url}/_sandbox/messages", params=params).json()["messages"]


def sandbox_stats(base_url: str) -> dict:
    return httpx.get(f"{base_url}/_sandbox/stats").json()


def step_events(result: ExecuteInProcessResult, kind: str) -> list:
    return [e for e in result.all_events if e.event_type_value == kind]


def routes_with_signup_v3():
    """Shipped routes plus an upcaster from a newer producer's v3 (for replay-after-fix tests)."""

    table = default_routes()
    # Pretend v3 is the current version and v2 upcasts to it unchanged.
    table.routes = [
        (r if r.event_type != "user.signed_up" else type(r)(**{**r.__dict__, "event_version": 3}))
        for r in table.routes
    ]
    table.upcasters[("user.signed_up", 2)] = lambda payload: payload
    table.schemas[("user.signed_up", 3)] = table.schemas[("user.signed_up", 2)]
    return table


def routes_ahead(event_type: str, version: int) -> RouteTable:
    """The demo's table as a producer ahead of the worker has it: it declares ``version`` of
    ``event_type`` (the routed version's schema), which the worker's table does not route."""
    table = default_routes()
    current = table.current_version(event_type)
    assert current is not None, event_type
    table.schemas[(event_type, version)] = table.schemas[(event_type, current)]
    return table


def report_failed_and_release(instance: DagsterInstance, run, database_url: str) -> None:  # type: ignore[no-untyped-def]
    """Mark ``run`` failed (as run monitoring or a lane sensor does for a dead worker), then
    evaluate ``email_run_failure_sensor`` on that failure, which gives back the run's claims."""
    from dagster import DagsterEventType, EventRecordsFilter, build_run_status_sensor_context

    from email_platform.sensors.run_failure import email_run_failure_sensor

    instance.report_run_failed(run)
    failure = instance.get_event_records(EventRecordsFilter(DagsterEventType.RUN_FAILURE), limit=1)[
        0
    ].event_log_entry.dagster_event
    with build_run_status_sensor_context(
        sensor_name="email_run_failure_sensor",
        dagster_event=failure,
        dagster_instance=instance,
        dagster_run=instance.get_run_by_id(run.run_id),
        resources={"email_database": AppDatabase(url=database_url)},
    ) as context:
        email_run_failure_sensor(context)


def as_loaded(table: str) -> str:
    """A table's rows, sorted, with the columns a full load stores once on the message
    (``Source.as_message``: NULL where equal to the message's) put back, as the stg_* views
    do: an incremental load stores them as they come."""
    from email_platform.warehouse import SOURCES

    source = next((s for s in SOURCES if s.raw_table == table), None)
    if source is None or not source.as_message:
        return f"SELECT * FROM {table} ORDER BY ALL"
    resolved = ", ".join(f"coalesce(r.{c}, m.{c}) AS {c}" for c in source.as_message)
    return (
        f"SELECT r.* REPLACE ({resolved}) FROM {table} AS r "
        "LEFT JOIN raw_email_messages AS m ON m.message_id = r.message_id ORDER BY ALL"
    )


@contextlib.contextmanager
def reexecuted(job: Any, instance: DagsterInstance, run_id: str) -> Iterator[Any]:
    """The failed run ``run_id`` re-executed from its failure (how an operator replays its dead
    letters), as ``execute_job`` yields it."""
    with execute_job(
        job,
        instance=instance,
        reexecution_options=ReexecutionOptions.from_failure(run_id, instance),
    ) as result:
        yield result
