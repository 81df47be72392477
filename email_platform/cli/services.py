"""The long-running processes beside Dagster: the webhook receiver, the sandbox provider,
Celery workers, and the stop signal for resident lane workers."""

import click

from email_platform.cli.support import migrated_engine as _engine
from email_platform.common import config


@click.group()
def workers() -> None:
    """Resident lane-worker runs."""


@workers.command("stop")
@click.option("--lane", help="Only this lane's workers (default: every lane).")
def workers_stop(lane: str | None) -> None:
    """Ask lane workers to end cleanly (before a shutdown or deploy): each finishes its batch in
    flight, gives back what it holds and ends as a successful run. The lane sensors start new
    workers when mail is due; stop a lane's sensor to pause it instead."""
    from dagster import DagsterInstance

    from email_platform.common.lanes import parse_lane
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


@click.group()
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

    from email_platform.common.errors import ConfigurationError
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


@click.group()
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

    from email_platform.observability import logs
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
    """Normalize stored webhooks again (after a mapping fix): their suppressions become what
    the current mapping implies, and they are queued for ingestion."""
    from datetime import UTC

    from email_platform.webhooks.reprocess import reprocess

    outcome = reprocess(_engine(url), since=since.replace(tzinfo=UTC) if since else None)
    click.echo(
        f"{outcome.queued} stored webhook(s) queued for the webhook inbox sensor; suppressions: "
        f"{outcome.withdrawn} withdrawn, {outcome.changed} changed, {outcome.added} added"
    )


@click.group()
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
