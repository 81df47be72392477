"""``email-platform erase``: one person's personal data, everywhere the platform keeps it."""

import click

from email_platform.cli.support import migrated_engine as _engine
from email_platform.cli.support import print_json as _print_json
from email_platform.common import config


@click.command()
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
    from email_platform.common.errors import PublishError
    from email_platform.operating.erasure import KEPT, rebuild_warehouse
    from email_platform.operating.erasure import erase as erase_person

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
