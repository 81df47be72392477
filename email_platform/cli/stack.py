"""``email-platform stack``: the production stack on one machine."""

import sys
from pathlib import Path
from typing import Any

import click


@click.group()
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
