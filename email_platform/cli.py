"""``email-platform``: the operator's command line."""

import sys
from pathlib import Path
from typing import Any

import click

from email_platform import config
from email_platform.cli_support import migrated_engine as _engine
from email_platform.cli_support import print_json as _print_json
from email_platform.db.engine import make_engine, upgrade


@click.group()
@click.version_option(package_name="email_platform")
def main() -> None:
    """Event-driven transactional email on Dagster."""


@main.group()
def db() -> None:
    """Application database schema."""


@db.command("upgrade")
@click.option("--url", help="SQLAlchemy URL (default: EMAIL_PLATFORM_DATABASE_URL or SQLite).")
@click.option("--revision", default="head", show_default=True)
def db_upgrade(url: str | None, revision: str) -> None:
    """Apply migrations up to REVISION."""
    from email_platform.db.engine import current_revision

    engine = make_engine(url or config.database_url())
    upgrade(engine, revision)
    click.echo(f"database at revision {current_revision(engine)} ({engine.url.render_as_string()})")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--url", help="SQLAlchemy URL of the application database.")
@click.option(
    "--latency-minutes",
    default=15,
    show_default=True,
    type=click.IntRange(1, 24 * 60),
    help="Window of the publish-to-accepted percentiles.",
)
def status(as_json: bool, url: str | None, latency_minutes: int) -> None:
    """Queue depth and oldest age per lane, message outcomes, open dead letters, and
    publish-to-accepted latency p50/p95/p99 per lane over the last minutes."""
    from email_platform.admin import status as read_status

    report = read_status(_engine(url), latency_minutes=latency_minutes)
    if as_json:
        _print_json(report)
        return
    events, msgs = report["events"], report["messages"]
    click.echo("events   " + "  ".join(f"{k}={v}" for k, v in events.items()))
    click.echo("messages " + "  ".join(f"{k}={v}" for k, v in msgs.items()))
    for lane, info in report["lanes"].items():
        age = info["oldest_age_s"]
        paused = info["paused"]
        click.echo(
            f"lane {lane:<13} depth={info['depth']:<6} oldest_age_s="
            f"{'-' if age is None else f'{age:.1f}'}"
            + (f"  PAUSED by {paused['by']} since {paused['since']}" if paused else "")
        )
    dl = report["dead_letters"]
    click.echo(
        f"dead letters open={dl['open']} "
        + " ".join(f"{k}={v}" for k, v in sorted(dl["by_reason"].items()))
    )
    window = report["latency"]["window_minutes"]
    for lane, info in report["latency"]["lanes"].items():
        shown = "  ".join(
            f"{p}={'-' if info[f'{p}_s'] is None else format(info[f'{p}_s'], '.2f')}"
            for p in ("p50", "p95", "p99")
        )
        click.echo(f"latency {lane:<13} accepted={info['accepted']:<6} {shown} (last {window} min)")
    for provider, states in sorted(report["circuits"].items()):
        held = " ".join(f"{state}={n}" for state, n in sorted(states.items()))
        click.echo(f"circuit {provider:<13} {held} (sending processes turned away)")


@main.command()
@click.argument("event_id", required=False)
@click.option("--trace-id", help="List the events of this request's trace id instead.")
@click.option("--correlation-id", help="List the events of this correlation id instead.")
@click.option("--limit", default=100, show_default=True, help="Most events listed by a search.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--url", help="SQLAlchemy URL of the application database.")
def trace(
    event_id: str | None,
    trace_id: str | None,
    correlation_id: str | None,
    limit: int,
    as_json: bool,
    url: str | None,
) -> None:
    """The whole chain of one event: outbox row, messages, attempts, dead letters.

    With --trace-id or --correlation-id (or both), the events one request published instead,
    each with its messages.
    """
    if event_id is not None and (trace_id or correlation_id):
        raise click.UsageError("give an EVENT_ID or --trace-id / --correlation-id, not both")
    if trace_id or correlation_id:
        _trace_request(_engine(url), trace_id, correlation_id, limit, as_json)
        return
    if event_id is None:
        raise click.UsageError("give an EVENT_ID, --trace-id or --correlation-id")
    from email_platform.admin import trace as read_trace

    chain = read_trace(_engine(url), event_id, warehouse_path=config.warehouse_path())
    if chain is None:
        raise click.ClickException(f"no event {event_id} in the outbox")
    if as_json:
        _print_json(chain)
        return
    event = chain["event"]
    click.echo(
        f"event {event['event_id']} {event['event_type']} v{event['event_version']} "
        f"lane={event['lane']} status={event['status']} ({event['resolution']})"
    )
    click.echo(f"  published {event['published_at']}  claimed_by run {event['claimed_by']}")
    request = _request_fields(event)
    if request:
        click.echo(f"  {request}")
    for message in chain["messages"]:
        click.echo(
            f"  message {message['message_id']} {message['route']} -> "
            f"{message['status']} key={message['idempotency_key']} "
            f"provider={message.get('provider')} provider_id={message['provider_message_id']}"
        )
        for attempt in message["attempts"]:
            # A failover attempt's error names the provider that took it ("via ... (failover)").
            said = [attempt["provider_message_id"], attempt["error"]]
            via = f" provider={attempt['provider']}" if attempt.get("provider") else ""
            click.echo(
                f"    attempt {attempt['attempt_no']} run {attempt['run_id']} "
                f"{attempt['outcome']}{via} http={attempt['http_status']} "
                + " ".join(str(part) for part in said if part)
            )
    for letter in chain["dead_letters"]:
        click.echo(
            f"  dead letter {letter['dead_letter_id']} {letter['reason']} "
            f"{letter['status']}: {letter['last_error']}"
        )


def _trace_request(
    engine: Any, trace_id: str | None, correlation_id: str | None, limit: int, as_json: bool
) -> None:
    from email_platform.admin import trace_request

    events = trace_request(engine, trace_id=trace_id, correlation_id=correlation_id, limit=limit)
    if as_json:
        _print_json({"trace_id": trace_id, "correlation_id": correlation_id, "events": events})
        return
    searched = " ".join(
        f"{name}={value}"
        for name, value in (("trace_id", trace_id), ("correlation_id", correlation_id))
        if value
    )
    if not events:
        raise click.ClickException(f"no events with {searched} in the outbox")
    click.echo(f"{searched}: {len(events)} event(s)")
    for event in events:
        click.echo(
            f"event {event['event_id']} {event['event_type']} v{event['event_version']} "
            f"lane={event['lane']} status={event['status']} ({event['resolution']}) "
            f"published {event['published_at']}"
        )
        request = _request_fields(event)
        if request:
            click.echo(f"  {request}")
        for message in event["messages"]:
            click.echo(
                f"  message {message['message_id']} {message['route']} -> {message['status']} "
                f"delivery={message['delivery_status']} "
                f"provider_id={message['provider_message_id']}"
            )


def _request_fields(event: dict[str, Any]) -> str:
    """``trace_id=... correlation_id=... producer=...``, those the event has."""
    return " ".join(
        f"{name}={event[name]}"
        for name in ("trace_id", "correlation_id", "producer")
        if event.get(name)
    )


@main.group()
def workers() -> None:
    """Resident lane-worker runs."""


@workers.command("stop")
@click.option("--lane", help="Only this lane's workers (default: every lane).")
def workers_stop(lane: str | None) -> None:
    """Ask lane workers to end cleanly (before a shutdown or deploy): each finishes its batch in
    flight, gives back what it holds and ends as a successful run. The lane sensors start new
    workers when mail is due; stop a lane's sensor to pause it instead."""
    from dagster import DagsterInstance

    from email_platform.lanes import parse_lane
    from email_platform.sensors.runs import stop_lane_workers

    if lane is not None:
        try:
            lane = parse_lane(lane).value
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--lane") from None
    home = config.dagster_home()
    if not (home / "dagster.yaml").exists():
        raise click.ClickException(f"no Dagster instance at {home}: set DAGSTER_HOME")
    with DagsterInstance.from_config(str(home)) as instance:
        count = stop_lane_workers(instance, lane)
    click.echo(f"asked {count} unfinished lane-worker run(s) to stop")


@main.group()
def celery() -> None:
    """Send steps on Dagster's Celery executor (EMAIL_PLATFORM_EXECUTOR=celery)."""


@celery.command("worker")
@click.option("--name", "-n", default="email", show_default=True, help="Worker name (@host added).")
@click.option(
    "--queue",
    "-q",
    multiple=True,
    help="A queue to serve, repeatable (default: every queue EMAIL_PLATFORM_CELERY_* names).",
)
@click.option(
    "--concurrency",
    "-c",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Steps run at once, each in a process of its own (a lane worker holds one for minutes).",
)
@click.option("--loglevel", "-l", default="INFO", show_default=True)
def celery_worker(name: str, queue: tuple[str, ...], concurrency: int, loglevel: str) -> None:
    """Start a dagster-celery worker for the send steps, with the broker, backend and queues the
    run workers submit to. Run one or more per host; each needs DAGSTER_HOME (the shared
    PostgreSQL instance) and the EMAIL_PLATFORM_* settings of the code location."""
    import os

    from email_platform.errors import ConfigurationError
    from email_platform.local.celery_worker import worker_command, worker_path, write_worker_config

    try:
        settings = config.executor_settings()
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from None
    home = config.dagster_home()
    if not (home / "dagster.yaml").exists():
        raise click.ClickException(f"no Dagster instance at {home}: set DAGSTER_HOME")
    path = write_worker_config(settings, home / "celery")
    try:
        command = worker_command(
            settings, path, name=name, queues=queue, concurrency=concurrency, loglevel=loglevel
        )
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    env["PATH"] = worker_path(env)
    click.echo(f"celery worker {name} on {', '.join(queue or settings.queues())}", err=True)
    os.execvpe(command[0], command, env)


@main.group()
def dlq() -> None:
    """Dead letters: list, replay, discard."""


def _selection(
    ids: tuple[int, ...],
    reason: str | None,
    lane: str | None,
    event: str | None,
    everything: bool,
    url: str | None,
):  # type: ignore[no-untyped-def]
    from email_platform.admin import select_dead_letters

    engine = _engine(url)
    with engine.connect() as connection:
        try:
            letters = select_dead_letters(
                connection, ids=ids, reason=reason, lane=lane, event_id=event, everything=everything
            )
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
    return engine, letters


_selectors = [
    click.argument("ids", nargs=-1, type=int),
    click.option("--reason", help="Only dead letters with this reason."),
    click.option("--lane", help="Only this lane."),
    click.option("--event", help="Only this event id."),
    click.option("--all", "everything", is_flag=True, help="Every open dead letter."),
    click.option("--url", help="SQLAlchemy URL of the application database."),
]


def _with_selectors(function):  # type: ignore[no-untyped-def]
    for decorator in reversed(_selectors):
        function = decorator(function)
    return function


@dlq.command("list")
@click.option(
    "--status",
    "status_",
    default="open",
    show_default=True,
    help="open, replayed, discarded, expired, suppressed or 'any'.",
)
@click.option("--reason", help="Only dead letters with this reason.")
@click.option("--lane", help="Only this lane.")
@click.option("--limit", type=int, default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON array.")
@click.option("--url", help="SQLAlchemy URL of the application database.")
def dlq_list(
    status_: str, reason: str | None, lane: str | None, limit: int, as_json: bool, url: str | None
) -> None:
    """List dead letters, oldest first: the error, the attempts, and what the mail was.

    Each shows its template (or event type), lane and recipient masked (j***@example.com):
    addresses never appear, in the error text neither. 'past expiry' marks an open letter
    whose message can no longer be sent; `retention purge` or `dlq replay` closes it.
    """
    from email_platform.store import dead_letters
    from email_platform.timeutil import utcnow

    with _engine(url).connect() as connection:
        rows = dead_letters.inbox(
            connection,
            status=None if status_ == "any" else status_,
            reason=reason,
            lane=lane,
            limit=limit,
        )
    now = utcnow()
    letters = [dead_letters.summary(row, now) for row in rows]
    if as_json:
        _print_json(letters)
        return
    if not letters:
        click.echo("no dead letters")
    for d in letters:
        what = d["template"] or "(no message)"
        if d["event_type"]:
            what += f" for {d['event_type']}"
        expiry = f"  expires {d['expires_at']}" if d["expires_at"] else ""
        if d["past_expiry"]:
            expiry += " (past expiry)"
        click.echo(
            f"{d['dead_letter_id']:>6}  {d['status']:<9} {d['lane']:<13} {d['reason']:<20} "
            f"attempts={d['attempts']} event={d['event_id']} message={d['message_id']} "
            f"run={d['run_id']}\n"
            f"        {what} to {d['recipient'] or '-'}{expiry}\n"
            f"        error: {d['error'] or '-'}"
        )


@dlq.command("replay")
@_with_selectors
@click.option(
    "--inline",
    is_flag=True,
    help="Send now in this process (recorded in the Dagster instance) instead of "
    "leaving it to the lane sensors of a running daemon.",
)
def dlq_replay(
    ids: tuple[int, ...],
    reason: str | None,
    lane: str | None,
    event: str | None,
    everything: bool,
    url: str | None,
    inline: bool,
) -> None:
    """Send dead letters again with their original idempotency keys.

    Nothing already accepted by the provider is sent twice; anything past its expiry becomes
    'expired'. The dead letter is marked replayed when its message is sent.
    """
    from email_platform.admin import requeue_dead_letters
    from email_platform.retention import expire_dead_letters
    from email_platform.store import dead_letters

    engine, letters = _selection(ids, reason, lane, event, everything, url)
    if not letters:
        click.echo("no open dead letters matched")
        return
    # Past its expiry a message is never sent: close those letters now, as the send path
    # would, instead of requeueing mail that can only expire.
    expired = expire_dead_letters(engine, dead_letter_ids=[d.dead_letter_id for d in letters])
    if expired:
        click.echo(f"{expired} dead letter(s) past their expiry marked expired, not replayed")
        with engine.connect() as connection:
            letters = [
                d
                for d in dead_letters.for_ids(connection, [d.dead_letter_id for d in letters])
                if d.status == dead_letters.OPEN
            ]
        if not letters:
            return
    event_ids = requeue_dead_letters(engine, letters)
    click.echo(f"requeued {len(event_ids)} event(s) for {len(letters)} dead letter(s)")
    if inline:
        from email_platform.local.replay import send_inline

        results = send_inline(event_ids, database_url=url)
        for run_id, success in results:
            click.echo(f"  run {run_id}: {'success' if success else 'failed'}")
        if not all(success for _, success in results):
            sys.exit(1)
    else:
        click.echo("the lane sensors will send them on their next tick (daemon must be running)")


@dlq.command("discard")
@_with_selectors
def dlq_discard(
    ids: tuple[int, ...],
    reason: str | None,
    lane: str | None,
    event: str | None,
    everything: bool,
    url: str | None,
) -> None:
    """Close dead letters without sending (the message stays dead)."""
    from email_platform.admin import discard_dead_letters

    engine, letters = _selection(ids, reason, lane, event, everything, url)
    count = discard_dead_letters(engine, [d.dead_letter_id for d in letters])
    click.echo(f"discarded {count} dead letter(s)")


@main.command()
@click.option("--email", help="The person's address.")
@click.option("--aggregate-id", help="The person's aggregate id (the product's user id).")
@click.option("--url", help="SQLAlchemy URL of the application database.")
@click.option(
    "--warehouse",
    "warehouse_path",
    help="The DuckDB warehouse to rebuild (default: EMAIL_PLATFORM_WAREHOUSE).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def erase(
    email: str | None,
    aggregate_id: str | None,
    url: str | None,
    warehouse_path: str | None,
    as_json: bool,
) -> None:
    """Erase one person's personal data everywhere the platform keeps it (GDPR Art. 17).

    Cancels their events not sent yet, anonymizes their rows (counts stay), blanks their raw
    webhooks, keeps their suppression only as a keyed hash (so they stay unmailable), then
    rebuilds the warehouse. Safe to run again: it then erases nothing more.
    """
    from email_platform.erasure import KEPT, rebuild_warehouse
    from email_platform.erasure import erase as erase_person
    from email_platform.errors import PublishError

    if not email and not aggregate_id:
        raise click.UsageError("say whom to erase: --email ADDRESS and/or --aggregate-id ID")
    engine = _engine(url)
    try:
        report = erase_person(engine, email=email, aggregate_id=aggregate_id)
    except PublishError as exc:  # the address check names what is wrong with it
        raise click.BadParameter(exc.message, param_hint="--email") from None
    path = warehouse_path or config.warehouse_path()
    try:
        rebuild_warehouse(engine, path, report)
    except Exception as exc:  # the database is erased already; say what is left to do
        raise click.ClickException(
            f"the application database is erased, but rebuilding the warehouse {path} failed "
            f"({type(exc).__name__}: {exc}); it still holds copies until it is rebuilt: run "
            "this command again"
        ) from None
    if as_json:
        _print_json(report.as_dict())
        return
    who = " and ".join(
        part
        for part in (email and f"address {email}", aggregate_id and f"aggregate {aggregate_id}")
        if part
    )
    click.echo(f"erased {who}: {report.total} row(s), {report.addresses} address(es)")
    for table, count in report.tables.items():
        click.echo(f"  {table:<15} {count}")
    click.echo(
        f"cancelled {report.cancelled_events} event(s) and {report.cancelled_messages} "
        "message(s) not sent yet (status 'cancelled')"
    )
    click.echo(
        f"suppressions: {report.suppressions_hashed} replaced by their hash, "
        f"{report.suppressions_added} hashed one(s) added"
    )
    if report.cancelled_in_flight:
        click.echo(
            f"{report.cancelled_in_flight} of those events were in flight in a worker, which "
            "sends none of them; run this again in a minute to catch anything it was writing"
        )
    if report.warehouse == "rebuilt":
        click.echo(f"warehouse {report.warehouse_path}: rebuilt from scratch, now")
    else:
        click.echo(f"warehouse {report.warehouse_path}: no file, nothing to rebuild")
    click.echo(f"on disk: {report.storage}")
    click.echo("kept:")
    for line in KEPT:
        click.echo(f"  - {line}")


@main.group()
def webhooks() -> None:
    """The provider webhook receiver and its inbox."""


@webhooks.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8026, show_default=True, type=int)
@click.option(
    "--workers",
    default=1,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Receiver processes sharing the port (uvicorn workers).",
)
@click.option("--url", help="SQLAlchemy URL of the application database.")
def webhooks_serve(host: str, port: int, workers: int, url: str | None) -> None:
    """Receive provider webhooks on POST /webhooks/{provider} (verify, store, then 2xx)."""
    import os

    import uvicorn

    from email_platform import logs
    from email_platform.webhooks.serving import uvicorn_options

    engine = _engine(url)  # refuse an unmigrated database before binding the port
    engine.dispose()
    # Each worker process builds its own app from the environment: pass the URL on.
    os.environ[config.PREFIX + "DATABASE_URL"] = engine.url.render_as_string(hide_password=False)
    logs.configure("INFO").info(
        f"webhook receiver on http://{host}:{port}/webhooks/{{provider}} ({workers} process(es))",
        **logs.fields(port=port, workers=workers),
    )
    uvicorn.run(
        "email_platform.webhooks.receiver:receiver_app_from_environment",
        factory=True,
        workers=workers,
        host=host,
        port=port,
        log_level="info",
        # Every line of the receiver (uvicorn's and ours) as one JSON object on stderr.
        log_config=logs.uvicorn_log_config("info"),
        access_log=False,
        **uvicorn_options(),
    )


@webhooks.command("reprocess")
@click.option("--since", type=click.DateTime(), help="Only webhooks received since (UTC).")
@click.option("--url", help="SQLAlchemy URL of the application database.")
def webhooks_reprocess(since, url: str | None) -> None:  # type: ignore[no-untyped-def]
    """Normalize stored webhooks again (after a mapping fix); applying stays idempotent."""
    from datetime import UTC

    from email_platform.store import email_events, inbox

    with _engine(url).begin() as connection:
        ids = inbox.reprocessable_ids(
            connection, since=since.replace(tzinfo=UTC) if since is not None else None
        )
        # The events they produced are rebuilt from the raw bodies by the next ingestion.
        email_events.delete_for_inbox_rows(connection, ids)
        count = inbox.requeue(connection, ids)
    click.echo(f"{count} stored webhook(s) queued for the webhook inbox sensor")


@main.group()
def stack() -> None:
    """The production stack on this machine (PostgreSQL, daemon, webserver, receivers, Celery)."""


_STACK_DIR = click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path(".email_platform_stack"),
    show_default=True,
    help="Where the stack keeps its state, settings, logs and Dagster home.",
)


@stack.command("up")
@_STACK_DIR
@click.option(
    "--postgres",
    default="postgresql://postgres@127.0.0.1:5432/postgres",
    show_default=True,
    help="Any database on the PostgreSQL server; the stack creates its own two there.",
)
@click.option("--name", default="email_platform", show_default=True, help="Database name.")
@click.option("--broker", default="redis://127.0.0.1:6379/0", show_default=True)
@click.option("--receivers", default=2, show_default=True, type=click.IntRange(1, 64))
@click.option("--celery-workers", default=2, show_default=True, type=click.IntRange(1, 64))
@click.option("--concurrency", default=2, show_default=True, type=click.IntRange(1, 256))
@click.option("--receiver-port", default=8026, show_default=True, type=int)
@click.option("--webserver-port", default=3000, show_default=True, type=int)
@click.option("--sandbox-port", default=8025, show_default=True, type=int)
@click.option("--sandbox-latency-ms", default=0.0, show_default=True, type=float)
def stack_up(directory: Path, **options: Any) -> None:
    """Bring the stack up in the background; `stack down` stops it."""
    from email_platform.local.stack import StackError, StackSettings, up

    try:
        state = up(
            StackSettings(
                directory,
                postgres_url=options["postgres"],
                name=options["name"],
                broker=options["broker"],
                receivers=options["receivers"],
                celery_workers=options["celery_workers"],
                celery_concurrency=options["concurrency"],
                receiver_port=options["receiver_port"],
                webserver_port=options["webserver_port"],
                sandbox_port=options["sandbox_port"],
                sandbox_latency_ms=options["sandbox_latency_ms"],
            ),
            echo=lambda line: click.echo(line, err=True),
        )
    except StackError as exc:
        raise click.ClickException(str(exc)) from None
    for name, url in state["urls"].items():
        click.echo(f"{name}: {url}")
    click.echo(f"settings: source {directory / 'stack.env'}")


@stack.command("down")
@_STACK_DIR
@click.option("--drain-s", default=30.0, show_default=True, type=float)
@click.option("--drop-databases", is_flag=True, help="Also drop the stack's two databases.")
def stack_down(directory: Path, drain_s: float, drop_databases: bool) -> None:
    """Stop every process of the stack (lane workers hand back what they hold first)."""
    from email_platform.local.stack import StackError, down

    try:
        down(directory, drain_s=drain_s, drop=drop_databases, echo=click.echo)
    except StackError as exc:
        raise click.ClickException(str(exc)) from None


@stack.command("status")
@_STACK_DIR
def stack_status(directory: Path) -> None:
    """Each process of the stack: up or down."""
    from email_platform.local.stack import status

    groups = status(directory)
    if not groups:
        raise click.ClickException(f"no stack in {directory}")
    for name, alive in groups.items():
        click.echo(f"{name:20} {'up' if alive else 'down'}")
    sys.exit(0 if all(groups.values()) else 1)


@main.group()
def sandbox() -> None:
    """The local sandbox provider."""


@sandbox.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8025, show_default=True, type=int)
@click.option("--api-key", envvar="EMAIL_PLATFORM_SANDBOX_API_KEY")
@click.option("--rate-429", type=float, default=0.0, show_default=True)
@click.option("--rate-5xx", type=float, default=0.0, show_default=True)
@click.option("--rate-timeout", type=float, default=0.0, show_default=True)
@click.option("--rate-4xx", type=float, default=0.0, show_default=True)
@click.option("--latency-ms", type=float, default=0.0, show_default=True)
@click.option("--seed", type=int)
@click.option("--webhook-url", help="Post signed webhooks here, e.g. .../webhooks/sandbox.")
@click.option(
    "--webhook-secret",
    envvar="EMAIL_PLATFORM_SANDBOX_WEBHOOK_SECRET",
    help="whsec_... secret shared with the receiver.",
)
@click.option("--webhook-bounce-rate", type=float, default=0.02, show_default=True)
@click.option("--webhook-complaint-rate", type=float, default=0.003, show_default=True)
@click.option("--webhook-open-rate", type=float, default=0.45, show_default=True)
@click.option("--webhook-click-rate", type=float, default=0.3, show_default=True)
def sandbox_serve(
    host: str,
    port: int,
    api_key: str | None,
    rate_429: float,
    rate_5xx: float,
    rate_timeout: float,
    rate_4xx: float,
    latency_ms: float,
    seed: int | None,
    webhook_url: str | None,
    webhook_secret: str | None,
    webhook_bounce_rate: float,
    webhook_complaint_rate: float,
    webhook_open_rate: float,
    webhook_click_rate: float,
) -> None:
    """Run the sandbox provider (POST /v1/send, GET /_sandbox/messages, /_sandbox/stats)."""
    from email_platform.sandbox.emitter import WebhookPlan
    from email_platform.sandbox.server import SandboxConfig, serve

    plan = None
    if webhook_url:
        if not webhook_secret:
            raise click.UsageError("--webhook-url needs --webhook-secret (whsec_...)")
        plan = WebhookPlan(
            webhook_url=webhook_url,
            secret=webhook_secret,
            bounce_rate=webhook_bounce_rate,
            complaint_rate=webhook_complaint_rate,
            open_rate=webhook_open_rate,
            click_rate=webhook_click_rate,
        )
    serve(
        SandboxConfig(
            api_key=api_key,
            rate_429=rate_429,
            rate_5xx=rate_5xx,
            rate_timeout=rate_timeout,
            rate_4xx=rate_4xx,
            latency_ms=latency_ms,
            seed=seed,
            webhooks=plan,
        ),
        host,
        port,
    )


@main.command()
@click.option("--signups", default=200, show_default=True)
@click.option("--resets", default=60, show_default=True)
@click.option("--receipts", default=100, show_default=True)
@click.option("--digests", default=60, show_default=True)
@click.option("--timeout-s", default=300, show_default=True)
@click.option(
    "--home",
    type=click.Path(path_type=Path),
    help="Where the demo keeps its files (default ./.email_platform).",
)
def demo(
    signups: int, resets: int, receipts: int, digests: int, timeout_s: int, home: Path | None
) -> None:
    """Run the whole flow on the embedded default and print what happened."""
    from email_platform.local.demo import run_demo

    sys.exit(
        run_demo(
            signups=signups,
            resets=resets,
            receipts=receipts,
            digests=digests,
            timeout_s=timeout_s,
            home=home,
        )
    )


def _add_command_groups() -> None:
    from email_platform.cli_lanes import lanes
    from email_platform.cli_metrics import metrics
    from email_platform.cli_retention import retention

    for group in (lanes, metrics, retention):
        main.add_command(group)


_add_command_groups()


if __name__ == "__main__":
    main()
