"""``email-platform``: the operator's command line."""

import sys
import textwrap
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
    """Per lane: due work (depth, oldest due age), scheduled work (send_after ahead), in
    flight, live workers and pauses; whether a daemon ticks the sensors; message outcomes,
    open dead letters, and publish-to-accepted latency p50/p95/p99 per lane over the last
    minutes. Times are in seconds."""
    from email_platform.cli.instance import describe_daemon, sensor_daemon
    from email_platform.operating.admin import status as read_status

    report = read_status(_engine(url), latency_minutes=latency_minutes)
    report["daemon"] = sensor_daemon()
    if as_json:
        _print_json(report)
        return
    events, msgs = report["events"], report["messages"]
    click.echo("events   " + "  ".join(f"{k}={v}" for k, v in events.items()))
    click.echo("messages " + "  ".join(f"{k}={v}" for k, v in msgs.items()))
    click.echo(describe_daemon(report["daemon"]))
    click.echo(_describe_workers(report["lanes"]))
    for lane, info in report["lanes"].items():
        paused = info["paused"]
        click.echo(
            f"lane {lane:<13} due={info['depth']:<6} "
            f"oldest_due_age={_seconds(info['oldest_age_s'])}"
            f"  scheduled={info['scheduled']}  in_flight={info['in_flight']}"
            f"  workers_alive={info['workers_alive']}"
            + (f"  PAUSED by {paused['by']} since {paused['since']}" if paused else "")
        )
    dl = report["dead_letters"]
    click.echo(
        f"dead letters open={dl['open']} "
        + " ".join(f"{k}={v}" for k, v in sorted(dl["by_reason"].items()))
    )
    window = report["latency"]["window_minutes"]
    for lane, info in report["latency"]["lanes"].items():
        shown = "  ".join(f"{p}={_seconds(info[f'{p}_s'], 2)}" for p in ("p50", "p95", "p99"))
        click.echo(
            f"latency {lane:<13} accepted={info['accepted']:<6} {shown} "
            f"(publish to accepted, last {window} min)"
        )
    for provider, states in sorted(report["circuits"].items()):
        held = " ".join(f"{state}={n}" for state, n in sorted(states.items()))
        click.echo(f"circuit {provider:<13} {held} (sending processes turned away)")


def _seconds(value: float | None, digits: int = 1) -> str:
    """A duration with its unit, ``-`` for none."""
    return "-" if value is None else f"{value:.{digits}f}s"


def _describe_workers(lanes: dict[str, dict[str, Any]]) -> str:
    from email_platform.store.metrics_queries import WORKER_STALE_S

    alive = {lane: info["workers_alive"] for lane, info in lanes.items() if info["workers_alive"]}
    if not alive:
        return (
            f"workers  none alive (no lane-worker run beat in the last {WORKER_STALE_S:.0f}s; "
            "a lane with workers: 0 sends in batch runs instead)"
        )
    shown = " ".join(f"{lane}={n}" for lane, n in alive.items())
    return (
        f"workers  {shown} lane-worker run(s) alive (heartbeat in the last {WORKER_STALE_S:.0f}s)"
    )


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
    _echo_trace(chain)


def _echo_trace(chain: dict[str, Any]) -> None:
    """The chain as text: the event, each message with its attempts (when, how long) and the
    provider's events for it (delivered, opened, clicked, ...), dead letters, the funnel row."""
    event = chain["event"]
    click.echo(
        f"event {event['event_id']} {event['event_type']} v{event['event_version']} "
        f"lane={event['lane']} status={event['status']} ({event['resolution']})"
    )
    click.echo(
        f"  published {event['published_at']}  done {event.get('done_at') or '-'}  "
        f"claimed_by run {event['claimed_by']}"
    )
    request = _request_fields(event)
    if request:
        click.echo(f"  {request}")
    provider_events = chain["provider_events"]
    for message in chain["messages"]:
        accepted = [a for a in message["attempts"] if a["outcome"] == "accepted"]
        # The message row keeps the accepted id; a replayed or older row may only have it on
        # its accepted attempt.
        provider_id = message["provider_message_id"] or next(
            (a["provider_message_id"] for a in accepted if a["provider_message_id"]), None
        )
        click.echo(
            f"  message {message['message_id']} {message['route']} -> {message['status']} "
            f"delivery={message.get('delivery_status') or '-'} "
            f"provider={message.get('provider') or '-'} provider_id={provider_id or '-'} "
            f"sent {message.get('sent_at') or '-'} key={message['idempotency_key']}"
            + (f" locale={message['locale']}" if message.get("locale") else "")
            + (" TEST SEND (not in the funnel)" if message.get("is_test") else "")
        )
        for attempt in message["attempts"]:
            # A failover attempt's error names the provider that took it ("via ... (failover)").
            said = [attempt["provider_message_id"], attempt["error"]]
            via = f" provider={attempt['provider']}" if attempt.get("provider") else ""
            click.echo(
                f"    attempt {attempt['attempt_no']} at {attempt['started_at']} "
                f"took {_took(attempt['started_at'], attempt['finished_at'])} "
                f"run {attempt['run_id']} {attempt['outcome']}{via} http={attempt['http_status']} "
                + " ".join(str(part) for part in said if part)
            )
        for seen in provider_events:
            if seen["message_id"] == message["message_id"]:
                click.echo(f"    {_provider_event(seen)}")
    known = {m["message_id"] for m in chain["messages"]}
    for seen in provider_events:
        if seen["message_id"] not in known:
            click.echo(f"  {_provider_event(seen)}")
    if not provider_events:
        click.echo("  no provider events yet (delivered, opened, clicked arrive by webhook)")
    for letter in chain["dead_letters"]:
        click.echo(
            f"  dead letter {letter['dead_letter_id']} {letter['reason']} "
            f"{letter['status']}: {letter['last_error']}"
        )
    _echo_funnel(chain["funnel"])


def _took(started: str | None, finished: str | None) -> str:
    from datetime import datetime

    if not started or not finished:
        return "-"
    seconds = (datetime.fromisoformat(finished) - datetime.fromisoformat(started)).total_seconds()
    return f"{seconds:.3f}s"


def _provider_event(seen: dict[str, Any]) -> str:
    """``delivered at ... (sandbox)``, with what the kind of event carries."""
    line = f"{seen['event_type']} at {seen['occurred_at']} ({seen['provider']})"
    if seen.get("bounce_type"):
        line += f" bounce={seen['bounce_type']}"
    if seen.get("reject_reason"):
        line += f" reason={seen['reject_reason']}"
    if seen["event_type"] == "opened" and seen.get("machine_open") is not None:
        line += " machine open" if seen["machine_open"] else " human open"
    if seen.get("click_url"):
        url = seen["click_url"]
        line += f" url={url if len(url) <= 80 else url[:77] + '...'}"
    return line


def _echo_funnel(funnel: list[dict[str, Any]] | None) -> None:
    if funnel is None:
        click.echo(
            f"  funnel: no warehouse at {config.warehouse_path()} yet "
            "(built by the analytics refresh)"
        )
        return
    if not funnel:
        click.echo("  funnel: no row for this event as of the warehouse's last refresh")
    for row in funnel:
        shown = " ".join(
            f"{k}={v}" for k, v in row.items() if v is not None and k not in ("event_id",)
        )
        click.echo("  funnel (as of the warehouse's last refresh; _s fields in seconds):")
        click.echo(textwrap.fill(shown, 100, initial_indent="    ", subsequent_indent="    "))


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
    from email_platform.cli.templates import templates

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
        templates,
        webhooks,
        workers,
    ):
        main.add_command(command)
    from email_platform.cli.analytics import analytics  # the analyst's group: its own module

    main.add_command(analytics)
    from email_platform.cli.cancel import cancel  # the producer's cancel(), for operators

    main.add_command(cancel)


_add_command_groups()
