"""``email-platform``: the operator's command line."""

import sys
from pathlib import Path
from typing import Any

import click

from email_platform.cli.support import migrated_engine as _engine
from email_platform.cli.support import print_json as _print_json
from email_platform.common import config
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
    from email_platform.operating.admin import status as read_status

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
    from email_platform.operating.admin import trace as read_trace

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
    from email_platform.operating.admin import trace_request

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
    from email_platform.cli.dlq import dlq
    from email_platform.cli.erase import erase
    from email_platform.cli.lanes import lanes
    from email_platform.cli.metrics import metrics
    from email_platform.cli.retention import retention
    from email_platform.cli.schemas import schemas
    from email_platform.cli.services import celery, sandbox, webhooks, workers
    from email_platform.cli.stack import stack

    for command in (
        celery,
        dlq,
        erase,
        lanes,
        metrics,
        retention,
        sandbox,
        schemas,
        stack,
        webhooks,
        workers,
    ):
        main.add_command(command)


_add_command_groups()
