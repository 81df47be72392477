"""``email-platform schemas``: the event schemas of the configured route table.

``check`` says whether they hold (each compiles, each example matches, each upcaster turns its
version's examples into the next version's); ``export`` writes one JSON Schema file per event
type and version, for producers in other languages (docs/schemas.md).
"""

import json
from pathlib import Path

import click

from email_platform.common.errors import ConfigurationError
from email_platform.mail.routes import RouteTable, configured_routes, load_routes
from email_platform.publishing import schemas as event_schemas

_ROUTES_HELP = "Route table as 'package.module:NAME' (default: EMAIL_PLATFORM_ROUTES)."


def _table(routes: str | None) -> RouteTable:
    return load_routes(routes) if routes else configured_routes()


@click.group()
def schemas() -> None:
    """Declared event schemas: check them, export them."""


@schemas.command("check")
@click.option("--routes", help=_ROUTES_HELP)
def check(routes: str | None) -> None:
    """Check the table's schemas and upcasters; exit 1 listing what does not hold."""
    table = _table(routes)
    found = event_schemas.problems(table)
    if not table.declares_schemas:
        click.echo("the route table declares no schemas: publish() checks no payload's shape")
        return
    for problem in found:
        click.echo(f"problem: {problem}", err=True)
    if found:
        raise SystemExit(1)
    checked = len(table.upcasters)
    click.echo(
        f"{len(table.schemas)} schema(s) hold; {checked} upcaster(s) checked against the "
        "schemas they connect"
    )


@schemas.command("export")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write one <event_type>.v<N>.schema.json per type and version, and index.json, here "
    "(default: print them as one JSON object).",
)
@click.option("--routes", help=_ROUTES_HELP)
def export(out: Path | None, routes: str | None) -> None:
    """The JSON Schema of each event type and version, for producers in other languages."""
    table = _table(routes)
    if not table.declares_schemas:
        raise click.ClickException("the route table declares no schemas (docs/schemas.md)")
    try:
        if out is None:
            click.echo(json.dumps(event_schemas.export(table), indent=2, sort_keys=True))
            return
        written = event_schemas.write(table, out)
    except ConfigurationError as exc:
        raise click.ClickException(f"{exc} (see `email-platform schemas check`)") from None
    for path in written:
        click.echo(str(path))
