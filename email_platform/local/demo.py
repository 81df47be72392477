"""``email-platform demo``: the whole flow on the embedded default, end to end, for real.

SQLite application database, local Dagster storage and the sandbox provider (with faults) on a
free loopback port; a real ``dagster-daemon`` ticks the lane sensors and launches the runs.
"""

import base64
import os
import random
import shlex
import statistics
import sys
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import click
import httpx
from sqlalchemy import Column, Engine, MetaData, String, Table, insert, select

from email_platform import publish
from email_platform.common import config
from email_platform.common.timeutil import as_utc, utcnow
from email_platform.db.engine import make_engine, upgrade
from email_platform.db.schema import (
    dead_letters,
    email_attempts,
    email_events,
    email_messages,
    email_outbox,
    lane_workers,
)
from email_platform.db.schema import suppressions as suppression_table
from email_platform.local.dagster_home import DaemonProcess, wait_for
from email_platform.mail.routes import DEMO_ROUTES
from email_platform.mail.unsubscribe import Keys
from email_platform.sandbox.asgi import BackgroundServer
from email_platform.sandbox.emitter import WebhookPlan
from email_platform.sandbox.server import SandboxConfig, SandboxServer
from email_platform.store import outbox, suppressions
from email_platform.store.bulk import rows_for_events
from email_platform.webhooks.receiver import create_receiver_app

# The product's own business table: publish() writes next to it, in the same transaction.
_product = MetaData()
users = Table(
    "users",
    _product,
    Column("id", String(64), primary_key=True),
    Column("email", String(320), nullable=False),
)


def _address(rng: random.Random, user_id: str) -> str:
    roll = rng.random()
    if roll < 0.02:
        return f"{user_id}+reject@example.com"  # the provider refuses it: a dead letter
    if roll < 0.06:
        return f"{user_id}+429x1@example.com"  # rate-limited once, then accepted
    if roll < 0.08:
        return f"{user_id}+503x1@example.net"  # a 5xx once, then accepted
    return f"{user_id}@{rng.choice(['example.com', 'example.org', 'example.net'])}"


def publish_demo_events(
    engine: Engine, tag: str, signups: int, resets: int, receipts: int, digests: int, seed: int = 7
) -> list[str]:
    rng = random.Random(seed)
    event_ids: list[str] = []
    now = utcnow()
    with engine.begin() as connection:
        _product.create_all(connection)
    for i in range(signups):
        user_id = f"{tag}-u{i}"
        email = _address(rng, user_id)
        with engine.begin() as connection:  # one product transaction per signup
            connection.execute(insert(users).values(id=user_id, email=email))
            if i % 10 == 0:  # an older producer still emits v1
                event_ids.append(
                    publish(
                        connection,
                        event_type="user.signed_up",
                        event_version=1,
                        aggregate_id=user_id,
                        payload={"user_id": user_id, "email": email, "name": f"User {i}"},
                        producer="accounts-service",
                    )
                )
            else:
                event_ids.append(
                    publish(
                        connection,
                        event_type="user.signed_up",
                        aggregate_id=user_id,
                        payload={
                            "user_id": user_id,
                            "email": email,
                            "first_name": f"User{i}",
                            # Welcomes in two languages: pt_PT falls back to the pt templates.
                            **({"locale": ("pt-BR", "pt_PT")[i % 2]} if i % 3 == 1 else {}),
                        },
                        producer="accounts-service",
                    )
                )
    with engine.begin() as connection:
        # A retried signup handler: same user, second event -> one welcome mail, one duplicate.
        for i in range(min(5, signups)):
            user_id = f"{tag}-u{i}"
            email = connection.execute(
                select(users.c.email).where(users.c.id == user_id)
            ).scalar_one()
            event_ids.append(
                publish(
                    connection,
                    event_type="user.signed_up",
                    aggregate_id=user_id,
                    payload={"user_id": user_id, "email": email, "first_name": "Again"},
                )
            )
        # Addresses that bounced before: mail to them is suppressed, not sent.
        for i in range(signups, signups + 5):
            user_id = f"{tag}-u{i}"
            suppressions.add(
                connection, f"{user_id}@example.com", reason="hard_bounce", source="demo", now=now
            )
            connection.execute(insert(users).values(id=user_id, email=f"{user_id}@example.com"))
            event_ids.append(
                publish(
                    connection,
                    event_type="order.paid",
                    aggregate_id=f"{tag}-o-s{i}",
                    payload={
                        "order_id": f"S-{i}",
                        "email": f"{user_id}@example.com",
                        "first_name": "Bounced",
                        "items": [],
                        "total": 0,
                        "currency": "EUR",
                    },
                )
            )
    for i in range(resets):
        user_id = f"{tag}-u{rng.randrange(max(1, signups))}"
        with engine.begin() as connection:
            event_ids.append(
                publish(
                    connection,
                    event_type="user.password_reset_requested",
                    aggregate_id=user_id,
                    payload={"user_id": user_id, "reset_token": f"tok{i:04d}"},
                )
            )
    for i in range(receipts):
        user_id = f"{tag}-u{rng.randrange(max(1, signups))}"
        items = [
            {
                "name": rng.choice(["Mug", "Shirt", "Book"]),
                "quantity": rng.randint(1, 3),
                "unit_price": rng.choice([9.5, 19.0, 24.9]),
            }
            for _ in range(rng.randint(1, 3))
        ]
        with engine.begin() as connection:
            email = connection.execute(
                select(users.c.email).where(users.c.id == user_id)
            ).scalar_one()
            event_ids.append(
                publish(
                    connection,
                    event_type="order.paid",
                    aggregate_id=f"{tag}-o{i}",
                    payload={
                        "order_id": f"O-{i:05d}",
                        "email": email,
                        "first_name": "Jane",
                        "items": items,
                        "total": sum(x["quantity"] * x["unit_price"] for x in items),
                        "currency": "EUR",
                    },
                )
            )
    for i in range(min(receipts, 5)):  # on a provider-hosted template (docs/provider-templates.md)
        with engine.begin() as connection:
            event_ids.append(
                publish(
                    connection,
                    event_type="order.shipped",
                    aggregate_id=f"{tag}-o{i}",
                    payload={
                        "order_id": f"O-{i:05d}",
                        "email": f"{tag}-ship{i}@example.com",
                        "first_name": "Jane",
                        "carrier": rng.choice(["DHL", "UPS", "La Poste"]),
                        "tracking_url": f"https://track.example.com/O-{i:05d}",
                    },
                )
            )
    with engine.begin() as connection:
        for i in range(digests):
            user_id = f"{tag}-u{i % max(1, signups)}"
            # A few digests are only worth sending within seconds: they expire in the queue.
            # From their own publish: the signups before them may take longer than that.
            expires = utcnow() + timedelta(seconds=2) if i < 3 else None
            event_ids.append(
                publish(
                    connection,
                    event_type="digest.ready",
                    aggregate_id=user_id,
                    payload={
                        "email": f"{user_id}@example.com",
                        "first_name": "Jane",
                        "highlights": ["3 new followers", "1 comment"],
                    },
                    expires_at=expires,
                )
            )
        event_ids.append(
            publish(
                connection, event_type="cart.viewed", aggregate_id="c1", payload={"cart_id": "c1"}
            )
        )
    return event_ids


def _event_counts(engine: Engine, event_ids: list[str]) -> Counter:
    with engine.connect() as connection:
        return Counter(outbox.counts_for(connection, event_ids))


def summarize(engine: Engine, event_ids: list[str]) -> dict:
    with engine.connect() as connection:
        msgs = rows_for_events(connection, email_messages, event_ids)
        events = {e.event_id: e for e in rows_for_events(connection, email_outbox, event_ids)}
        tries = rows_for_events(connection, email_attempts, event_ids)
        letters = rows_for_events(connection, dead_letters, event_ids)
        provider_events = rows_for_events(connection, email_events, event_ids)
        new_suppressions = len(rows_for_events(connection, suppression_table, event_ids))
    status = Counter(m.status for m in msgs)
    retried = {a.message_id for a in tries if a.outcome == "transient"}
    latency: dict[str, list[float]] = {}
    for m in msgs:
        if m.status == "sent" and m.sent_at:
            published = as_utc(events[m.event_id].published_at)
            latency.setdefault(m.lane, []).append((as_utc(m.sent_at) - published).total_seconds())
    return {
        "events": len(set(event_ids)),
        "messages": len(msgs),
        "status": status,
        "ignored": sum(1 for e in events.values() if e.resolution == "ignored"),
        "retried": len(retried),
        "transient_attempts": sum(a.outcome == "transient" for a in tries),
        "dead_letters": Counter(d.reason for d in letters),
        "latency": {lane: _percentiles(values) for lane, values in sorted(latency.items())},
        "not_done": sum(1 for e in events.values() if e.status not in ("done", "dead")),
        # Whether the provider saw it at all, per kind (a message counts once per kind).
        "delivery": Counter(
            kind for _, kind in {(e.message_id, e.event_type) for e in provider_events}
        ),
        "opens": Counter(
            "machine" if e.machine_open else "human"
            for e in provider_events
            if e.event_type == "opened"
        ),
        "new_suppressions": new_suppressions,
        # The welcome in two languages: the locale each sent welcome was rendered in.
        "welcome_locales": Counter(
            m.locale or "default" for m in msgs if m.route == "welcome" and m.status == "sent"
        ),
    }


def _percentiles(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return statistics.median(ordered), p95


def _live_workers(engine: Engine, lane: str) -> int:
    """Worker runs of ``lane`` that have beaten and not ended (the shipped critical lane keeps
    one warm, so the demo's password resets wait for no run to start)."""
    with engine.connect() as connection:
        return len(
            connection.execute(
                select(lane_workers.c.run_id).where(
                    lane_workers.c.lane == lane, lane_workers.c.ended_at.is_(None)
                )
            ).all()
        )


def _inbox_backlog(engine: Engine) -> int:
    from email_platform.store import inbox

    with engine.connect() as connection:
        counts = inbox.counts_by_status(connection)
    return counts.get(inbox.PENDING, 0) + counts.get(inbox.IN_FLIGHT, 0)


def _webhooks_settled(sandbox_url: str, engine: Engine) -> bool:
    """The sandbox has posted everything it planned and the inbox has been ingested."""
    stats = httpx.get(f"{sandbox_url}/_sandbox/stats", timeout=5).json()
    posted = stats.get("webhooks_delivered", 0)
    planned = stats.get("webhooks_planned", 0) + stats.get("webhooks_duplicated", 0)
    return posted >= planned and _inbox_backlog(engine) == 0


def run_demo(
    *, signups: int, resets: int, receipts: int, digests: int, timeout_s: int, home: Path | None
) -> int:
    if home is not None:
        os.environ[config.PREFIX + "HOME"] = str(home)
    # The demo publishes the demo's events: it chooses their routes, for itself and for the
    # daemon and runs it starts (nothing else falls back to them).
    os.environ[config.ROUTES_SETTING] = DEMO_ROUTES
    home = config.home_dir()
    dagster_home = config.dagster_home()
    database_url = config.database_url()
    engine = make_engine(database_url)
    click.echo(f"email-platform demo: database {database_url}")
    upgrade(engine)
    tag = utcnow().strftime("d%H%M%S")
    secret = "whsec_" + base64.b64encode(os.urandom(24)).decode()
    unsubscribe_secret = base64.urlsafe_b64encode(os.urandom(24)).decode()
    receiver = BackgroundServer(
        # Plain uvicorn settings on loopback: with serving.uvicorn_options (the header
        # deadline protocol) the sandbox served from this same process stalled mid-demo.
        create_receiver_app(
            engine,
            settings={"sandbox_webhook_secret": secret},
            unsubscribe_keys=Keys((unsubscribe_secret,)),
        ),
    )
    receiver_url = receiver.start()
    click.echo(f"webhook receiver on {receiver_url}/webhooks/sandbox")
    sandbox_config = SandboxConfig(
        rate_429=0.02,
        rate_5xx=0.02,
        retry_after_s=1,
        seed=11,
        webhooks=WebhookPlan(webhook_url=f"{receiver_url}/webhooks/sandbox", secret=secret),
    )
    try:
        with SandboxServer(sandbox_config) as sandbox_url:
            click.echo(f"sandbox provider on {sandbox_url} (429/5xx faults, rejects, webhooks)")
            env = {
                config.PREFIX + "HOME": str(home),
                config.PREFIX + "DATABASE_URL": database_url,
                config.PREFIX + "PROVIDER": "sandbox",
                config.PREFIX + "SANDBOX_BASE_URL": sandbox_url,
                # Bulk digests carry one-click unsubscribe links to this receiver.
                config.PREFIX + "UNSUBSCRIBE_SECRET": unsubscribe_secret,
                config.PREFIX + "UNSUBSCRIBE_BASE_URL": receiver_url,
                # Short waits so retries show within the demo.
                config.PREFIX + "LANES": '{"critical": {"retry_delay_s": 0.5}, '
                '"transactional": {"retry_delay_s": 1.0}, "bulk": {"retry_delay_s": 1.0}}',
            }
            with DaemonProcess(dagster_home, env) as daemon:
                click.echo(f"dagster-daemon starting (DAGSTER_HOME={dagster_home}) ...")
                if not daemon.wait_until_ticking():
                    click.echo(f"dagster-daemon did not come up; see {daemon.log_path}", err=True)
                    return 1
                click.echo("sensors are ticking; waiting for the warm critical worker ...")
                if not wait_for(lambda: _live_workers(engine, "critical") > 0, 180, 0.5):
                    click.echo(f"no critical worker started; see {daemon.log_path}", err=True)
                    return 1
                click.echo("critical worker polling; publishing ...")
                event_ids = publish_demo_events(engine, tag, signups, resets, receipts, digests)
                click.echo(f"published {len(event_ids)} events through publish(); draining ...")
                started = time.monotonic()
                while time.monotonic() - started < timeout_s:
                    counts = _event_counts(engine, event_ids)
                    finished = counts["done"] + counts["dead"]
                    click.echo(
                        f"  {time.monotonic() - started:5.0f}s  pending={counts['pending']} "
                        f"in_flight={counts['in_flight']} done={counts['done']} "
                        f"dead={counts['dead']}  ({finished}/{len(event_ids)})  "
                        f"webhooks waiting={_inbox_backlog(engine)}"
                    )
                    if finished == len(event_ids) and _webhooks_settled(sandbox_url, engine):
                        break
                    if not daemon.alive():
                        click.echo("dagster-daemon exited; see " + str(daemon.log_path), err=True)
                        break
                    time.sleep(2)
                elapsed = time.monotonic() - started
            report = summarize(engine, event_ids)
            receipt = _receipt_as_sent(sandbox_url)
    finally:
        receiver.stop()
    _print_report(report, elapsed, dagster_home)
    if receipt:
        click.echo(receipt)
    _print_funnel(database_url, dagster_home, event_ids)
    if report["not_done"]:
        click.echo(
            f"FAILED: {report['not_done']} event(s) did not reach a terminal state", err=True
        )
        return 1
    return 0


def _print_funnel(database_url: str, dagster_home: Path, event_ids: list[str]) -> None:
    """Materialize the analytics assets (recorded in the demo's Dagster instance, so the UI
    shows them) and print the funnel of the events this demo sent."""
    from dagster import DagsterInstance, materialize

    from email_platform.assets import analytics_checks, analytics_warehouse
    from email_platform.resources import AppDatabase, Warehouse
    from email_platform.warehouse import funnel_report

    warehouse_path = config.warehouse_path()
    click.echo("")
    click.echo(f"materializing the analytics assets into {warehouse_path} ...")
    with DagsterInstance.from_config(str(dagster_home)) as instance:
        result = materialize(
            [analytics_warehouse, *analytics_checks],
            instance=instance,
            resources={
                "email_database": AppDatabase(url=database_url),
                "email_warehouse": Warehouse(path=warehouse_path),
            },
            # The run's events are in the Dagster UI; the terminal gets warnings and errors.
            run_config={"loggers": {"console": {"config": {"log_level": "WARNING"}}}},
            raise_on_error=False,
        )
    if not result.success:
        click.echo("analytics materialization failed; see the run in the Dagster UI", err=True)
        return
    click.echo(funnel_report(warehouse_path, event_ids=event_ids).to_text())
    for line in _query_hints(str(warehouse_path)):
        click.echo(line)


def _query_hints(warehouse_path: str) -> list[str]:
    """How to ask the warehouse more, with paths that exist wherever the package is (a checkout
    or an installed wheel, which has no ``analytics/`` folder)."""
    from email_platform.warehouse import analytics_dir

    sql = analytics_dir()
    question = sql / "questions" / "welcome_open_rate_last_7_days.sql"
    duckdb = f"{_command('duckdb')} -readonly {shlex.quote(warehouse_path)}"
    return [
        "Query it yourself (read-only; one SQL file per question):",
        f"  {duckdb} < {shlex.quote(str(question))}",
        f"  questions: {sql / 'questions'}",
        f"  tables, columns and rates: {sql / 'README.md'}",
        f"  or: {_command('email-platform')} analytics ask welcome_open_rate_last_7_days "
        f"--warehouse {shlex.quote(warehouse_path)}",
    ]


def _receipt_as_sent(sandbox_url: str) -> str | None:
    """One receipt as the provider got it: its From, Reply-To and PDF (docs/addressing.md)."""
    answer = httpx.get(f"{sandbox_url}/_sandbox/messages", timeout=10.0).json()
    for message in answer["messages"]:
        if message["metadata"].get("template") == "receipt" and message.get("attachments"):
            pdf = message["attachments"][0]
            size = len(base64.b64decode(pdf["content"]))
            return (
                f"A receipt as sent: From {message['from']}, Reply-To "
                f"{', '.join(message.get('reply_to') or [])}, attached {pdf['filename']} "
                f"({pdf['content_type']}, {size} bytes)"
            )
    return None


def _print_report(report: dict, elapsed: float, dagster_home: Path) -> None:
    status = report["status"]
    click.echo("")
    click.echo(f"{report['events']} events -> {report['messages']} messages in {elapsed:.0f}s")
    rows = [
        ("sent", status["sent"]),
        ("retried (then settled)", report["retried"]),
        ("dead-lettered", status["dead"]),
        ("suppressed", status["suppressed"]),
        ("duplicate (dedupe key)", status["duplicate"]),
        ("expired", status["expired"]),
        ("ignored (no route)", report["ignored"]),
        ("not finished", report["not_done"]),
        ("provider: delivered", report["delivery"]["delivered"]),
        ("provider: opened (human)", report["opens"]["human"]),
        ("provider: opened (machine)", report["opens"]["machine"]),
        ("provider: clicked", report["delivery"]["clicked"]),
        ("provider: bounced", report["delivery"]["bounced"]),
        ("provider: complained", report["delivery"]["complained"]),
        ("suppressed by webhooks", report["new_suppressions"]),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        click.echo(f"  {name:<{width}}  {value:>5}")
    if report["welcome_locales"]:
        click.echo(
            "  welcomes sent by locale: "
            + ", ".join(f"{k}={v}" for k, v in sorted(report["welcome_locales"].items()))
        )
    if report["dead_letters"]:
        click.echo(
            "  dead letters by reason: "
            + ", ".join(f"{k}={v}" for k, v in sorted(report["dead_letters"].items()))
        )
        # Said here, so the one red run in the UI is not taken for a bug in the demo.
        click.echo(
            "  Expected: the worker run that recorded them ends FAILED (red in the Dagster UI) "
            "on purpose, so it holds them for an operator: fix the cause, then re-execute it "
            "from failure or run `dlq replay`. No other run should fail."
        )
    click.echo("  publish -> provider accepted, per lane:")
    for lane, (p50, p95) in report["latency"].items():
        click.echo(f"    {lane:<13} p50 {p50:6.2f}s   p95 {p95:6.2f}s")
    click.echo("")
    click.echo("Open the same runs in the Dagster UI (these lines work from any directory):")
    env = _hint_env(dagster_home)
    click.echo(f"  {env} {_command('dagster')} dev -w {dagster_home / 'workspace.yaml'}")
    cli = _command("email-platform")
    click.echo("Inspect:")
    for command in ("status", "dlq list", "trace EVENT_ID"):
        click.echo(f"  {env} {cli} {command}")


def _hint_env(dagster_home: Path) -> str:
    """The settings the demo ran with, as a command prefix: a hint copied into another shell
    (or directory) must open the demo's database and instance, not the defaults there."""
    settings = {config.PREFIX + "HOME": str(config.home_dir()), "DAGSTER_HOME": str(dagster_home)}
    # The UI's re-execution and `dlq replay --inline` route with the demo's table, as it did.
    settings[config.ROUTES_SETTING] = DEMO_ROUTES
    if os.environ.get(config.PREFIX + "DATABASE_URL"):
        settings[config.PREFIX + "DATABASE_URL"] = config.database_url()
    return " ".join(f"{name}={shlex.quote(value)}" for name, value in settings.items())


def _command(name: str) -> str:
    """``name`` as the user can run it from any directory: the script installed beside this
    interpreter (README's install puts them in ``.venv/bin``, which need not be on PATH)."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else name
