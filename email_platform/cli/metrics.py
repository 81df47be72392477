"""``email-platform metrics``: the Prometheus endpoint as a command of its own.

Served by uvicorn and Starlette, not prometheus_client's own HTTP server: the same endpoint
function is what the webhook receiver mounts, and uvicorn here gets the receiver's bounds on
header size, header count and read time (``webhooks.serving``), which the library's
``http.server`` has none of.
"""

import click

from email_platform.cli.support import migrated_engine as _migrated_engine


@click.group()
def metrics() -> None:
    """Prometheus metrics from the operational tables."""


@metrics.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=9108, show_default=True, type=click.IntRange(1, 65535))
@click.option(
    "--latency-window-minutes",
    default=15,
    show_default=True,
    type=click.IntRange(1, 24 * 60),
    help="Messages accepted this recently make up the latency histogram.",
)
@click.option("--url", help="SQLAlchemy URL of the application database.")
def serve(host: str, port: int, latency_window_minutes: int, url: str | None) -> None:
    """Serve GET /metrics (Prometheus text format, or OpenMetrics if asked) until stopped."""
    import uvicorn

    from email_platform.observability import logs
    from email_platform.observability.metrics import create_metrics_app
    from email_platform.webhooks.serving import uvicorn_options

    engine = _migrated_engine(url)  # refuse an unmigrated database before binding the port
    app = create_metrics_app(engine, latency_window_s=latency_window_minutes * 60.0)
    logs.configure("INFO").info(
        f"metrics on http://{host}:{port}/metrics", **logs.fields(port=port)
    )
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="warning",
        log_config=logs.uvicorn_log_config("warning"),
        access_log=False,
        **uvicorn_options(),
    )
