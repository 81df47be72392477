"""``email-platform analytics``: the analyst's questions, found and answered from any install.

The question files are ``analytics/questions`` in a checkout and
``email_platform/warehouse/sql/questions`` in an installed package; these commands find them in
either, so nobody needs to know which.
"""

import json
from typing import Any

import click

from email_platform.common import config


@click.group()
def analytics() -> None:
    """The analyst's questions about the email funnel (DuckDB warehouse, read-only)."""


@analytics.command("questions")
def questions() -> None:
    """List the questions, each with the file that answers it."""
    from email_platform.warehouse import analytics_dir, question_names, question_sql

    folder = analytics_dir() / "questions"
    click.echo(f"questions in {folder} (ask one: email-platform analytics ask NAME):")
    for name in question_names():
        click.echo(f"  {name:<34} {_first_comment(question_sql(name))}")
    click.echo(f"tables, columns and rates: {analytics_dir() / 'README.md'}")


@analytics.command("ask")
@click.argument("name")
@click.option(
    "--warehouse",
    "warehouse_path",
    help="The DuckDB warehouse (default: EMAIL_PLATFORM_WAREHOUSE).",
)
@click.option("--json", "as_json", is_flag=True, help="Rows as JSON, rates as fractions.")
def ask(name: str, warehouse_path: str | None, as_json: bool) -> None:
    """Answer question NAME (see `questions`) from the warehouse; rates print as percentages."""
    from email_platform.warehouse import connect_read_only, question_names, question_sql

    if name not in question_names():
        raise click.BadParameter(
            f"no question {name!r}; one of: {', '.join(question_names())}", param_hint="NAME"
        )
    connection = connect_read_only(warehouse_path or config.warehouse_path())
    try:
        cursor = connection.execute(question_sql(name))
        columns = [d[0] for d in cursor.description]
        rows = cursor.fetchall()
    finally:
        connection.close()
    if as_json:
        records = [dict(zip(columns, row, strict=True)) for row in rows]
        click.echo(json.dumps(records, default=str, indent=2))
        return
    click.echo(_table(columns, rows))


def _first_comment(sql: str) -> str:
    for line in sql.splitlines():
        if line.startswith("--"):
            return line.removeprefix("--").strip()
    return ""


def _cell(column: str, value: Any) -> str:
    """A value as people read it: a rate (a ``*_rate`` column) as a percentage."""
    from email_platform.warehouse import percent

    if value is None:
        return "-"
    if column.endswith("_rate") and isinstance(value, float):
        return percent(value)
    if isinstance(value, float):
        return f"{value:,.2f}"
    return str(value)


def _table(columns: list[str], rows: list[tuple[Any, ...]]) -> str:
    cells = [[_cell(c, v) for c, v in zip(columns, row, strict=True)] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines) if rows else lines[0] + "\n(no rows)"
