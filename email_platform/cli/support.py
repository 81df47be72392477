"""What every command group shares: the migrated application database and JSON output."""

import json
from typing import Any

import click
from sqlalchemy import Engine

from email_platform.common import config
from email_platform.db.engine import current_revision, make_engine


def migrated_engine(url: str | None) -> Engine:
    """The application database, refusing early (and saying why) if it is unreachable or was
    never migrated."""
    engine = make_engine(url or config.database_url())
    try:
        revision = current_revision(engine)
    except Exception as exc:  # unreachable server, bad credentials: say which database
        raise click.ClickException(
            f"cannot open {engine.url.render_as_string()}: {exc.__class__.__name__}: {exc}"
        ) from None
    if revision is None:
        raise click.ClickException(
            f"{engine.url.render_as_string()} has no email_platform schema; "
            "run `email-platform db upgrade` first"
        )
    return engine


def print_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=True, default=str))
