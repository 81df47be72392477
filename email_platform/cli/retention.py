"""``email-platform retention``: purge what is older than the retention settings.

The same purge as the daily ``retention_job`` (docs/retention.md), minus Dagster's run history,
which only the job (with the Dagster instance at hand) deletes.
"""

import json

import click

from email_platform.cli.support import migrated_engine as _engine
from email_platform.common import config
from email_platform.common.errors import ConfigurationError


@click.group()
def retention() -> None:
    """Purge operational history past its retention."""


@retention.command("purge")
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--url", help="SQLAlchemy URL of the application database.")
def purge(dry_run: bool, as_json: bool, url: str | None) -> None:
    """Close dead letters past their expiry, then delete what is past its retention.

    Resolved dead letters, finished events with their messages, attempts and provider events,
    processed raw webhooks: in batches, one transaction each, oldest first. Never anything
    pending, in flight or open, nor suppressions. Safe to stop and run again.
    """
    from email_platform.operating.retention import purge as run_purge

    try:
        settings = config.retention_settings()
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from None
    report = run_purge(_engine(url), settings, dry_run=dry_run)
    if as_json:
        body = {"dry_run": dry_run, "counts": report.as_dict(), "transactions": report.batches}
        click.echo(json.dumps(body, indent=2, sort_keys=True))
        return
    click.echo(
        f"retention: events {settings.events_days} d, dead letters {settings.dead_letters_days} "
        f"d, raw webhooks {settings.webhook_inbox_days} d; batches of {settings.batch_size}"
    )
    verb = "would expire" if dry_run else "expired"
    click.echo(f"{'dead letters ' + verb:<24} {report.expired_dead_letters:>10}")
    for table, count in report.counts.items():
        click.echo(f"{table:<24} {count:>10}")
    if dry_run:
        click.echo(f"dry run: nothing changed ({report.total} row(s) would be deleted)")
    else:
        click.echo(f"deleted {report.total} row(s) in {report.batches} transaction(s)")
