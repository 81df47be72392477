"""Numbers read from a warehouse: totals, the funnel per template, its chart, the questions.

``funnel_totals`` is what each refresh reports (the assets' metadata); ``funnel_report`` and
``funnel_row`` are what the demo and ``email-platform trace`` print; ``funnel_by_template`` and
``funnel_chart_svg`` make the chart on ``email_funnel_daily``; ``run_question`` answers one
analyst question (``analytics/questions/<name>.sql``). All read the published snapshot.
"""

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import duckdb

from email_platform.warehouse.build import FUNNEL, FUNNEL_DAILY, sql_file
from email_platform.warehouse.files import connect_read_only

if TYPE_CHECKING:  # pandas costs 0.2 s to import, and every launched run imports this module
    import pandas as pd


def question_names() -> list[str]:
    return sorted(
        entry.name.removesuffix(".sql")
        for entry in sql_file("questions").iterdir()
        if entry.name.endswith(".sql")
    )


def question_sql(name: str) -> str:
    return sql_file("questions", f"{name}.sql").read_text()


def run_question(warehouse_path: str | os.PathLike[str], name: str) -> "pd.DataFrame":
    """Answer one analyst question (``analytics/questions/<name>.sql``) as a DataFrame."""
    connection = connect_read_only(warehouse_path)
    try:
        return connection.execute(question_sql(name)).df()
    finally:
        connection.close()


def funnel_totals(
    connection: duckdb.DuckDBPyConnection, *, latency_days: int = 7
) -> dict[str, float | int | None]:
    """Whole-warehouse counts and rates, and latency percentiles over the newest
    ``latency_days`` days: what the UI plots over time (recent latencies move with the system;
    all-time ones would barely move, and cost a sort of every row on each refresh).

    The counts are sums of ``email_funnel_daily``, which counts every funnel row exactly once:
    a few hundred rows instead of a scan of every message (0.03-0.06 s at 1M, on each refresh).
    """
    counts = (
        "messages",
        "accepted",
        "delivered",
        "human_opened",
        "machine_opened",
        "clicked",
        "bounced",
        "complained",
        "unsubscribed",
        "dead",
    )
    sums = ", ".join(f"coalesce(sum({name}), 0)::BIGINT AS {name}" for name in counts)
    row = connection.execute(
        f"""
        WITH recent AS (
            SELECT event_to_accepted_s, delivery_delay_s, time_to_open_s FROM {FUNNEL}
            WHERE day > (SELECT max(day) FROM {FUNNEL}) - {int(latency_days)}
        ),
        latencies AS (
            SELECT
                quantile_cont(event_to_accepted_s, [0.5, 0.95]) AS accepted,
                quantile_cont(delivery_delay_s, 0.5) AS delivery,
                quantile_cont(time_to_open_s, [0.5, 0.95]) AS open
            FROM recent
        ),
        t AS (SELECT {sums} FROM {FUNNEL_DAILY})
        SELECT
            {", ".join(f"t.{name}" for name in counts)},
            t.delivered / nullif(t.accepted, 0),
            t.human_opened / nullif(t.delivered, 0),
            t.machine_opened / nullif(t.delivered, 0),
            t.clicked / nullif(t.delivered, 0),
            t.bounced / nullif(t.accepted, 0),
            t.complained / nullif(t.delivered, 0),
            l.accepted[1], l.accepted[2], l.delivery, l.open[1], l.open[2]
        FROM t, latencies AS l
        """
    ).fetchone()
    names = (
        *counts,
        "delivery_rate",
        "open_rate",
        "machine_open_rate",
        "click_rate",
        "bounce_rate",
        "complaint_rate",
        "event_to_accepted_p50_s",
        "event_to_accepted_p95_s",
        "delivery_delay_p50_s",
        "time_to_open_p50_s",
        "time_to_open_p95_s",
    )
    return dict(zip(names, row, strict=True))


@dataclass
class FunnelReport:
    """The funnel per template, plus the welcome email's human open rate."""

    rows: list[dict[str, Any]]
    welcome_open_rate: float | None

    def to_text(self) -> str:
        header = (
            f"{'template':<16}{'messages':>9}{'accepted':>9}{'delivered':>10}{'opened':>8}"
            f"{'clicked':>8}{'bounced':>8}{'open rate':>10}{'machine':>9}"
        )
        lines = ["Funnel by template (opens are human opens; machine opens apart)", header]
        for row in self.rows:
            lines.append(
                f"{row['template']:<16}{row['messages']:>9}{row['accepted']:>9}"
                f"{row['delivered']:>10}{row['human_opened']:>8}{row['clicked']:>8}"
                f"{row['bounced']:>8}{_pct(row['open_rate']):>10}{row['machine_opened']:>9}"
            )
        lines.append(f"Welcome email human open rate: {_pct(self.welcome_open_rate)}")
        return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def funnel_report(
    warehouse_path: str | os.PathLike[str], *, event_ids: Sequence[str] | None = None
) -> FunnelReport:
    """The funnel per template from the published snapshot, optionally for some events only."""
    connection = connect_read_only(warehouse_path)
    try:
        where, params = ("", [])
        if event_ids is not None:
            where, params = ("WHERE event_id IN (SELECT unnest(?::VARCHAR[]))", [list(event_ids)])
        cursor = connection.execute(
            f"""
            SELECT template, count(*) AS messages, count(accepted_at) AS accepted,
                count(delivered_at) AS delivered, count(first_open_at) AS human_opened,
                count(first_machine_open_at) AS machine_opened, count(first_click_at) AS clicked,
                count(bounced_at) AS bounced,
                count(first_open_at) / nullif(count(delivered_at), 0) AS open_rate
            FROM {FUNNEL} {where}
            GROUP BY template ORDER BY template
            """,
            params,
        )
        names = [d[0] for d in cursor.description]
        rows = [dict(zip(names, r, strict=True)) for r in cursor.fetchall()]
    finally:
        connection.close()
    welcome = next((r["open_rate"] for r in rows if r["template"] == "welcome"), None)
    return FunnelReport(rows=rows, welcome_open_rate=welcome)


def funnel_row(warehouse_path: str | os.PathLike[str], event_id: str) -> list[dict[str, Any]]:
    """The funnel rows of one event (one per message), for ``email-platform trace``."""
    connection = connect_read_only(warehouse_path)
    try:
        cursor = connection.execute(
            f"SELECT * FROM {FUNNEL} WHERE event_id = ? ORDER BY message_id", [event_id]
        )
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, r, strict=True)) for r in cursor.fetchall()]
    finally:
        connection.close()


FUNNEL_STEPS = (
    ("event", "messages", "#5b6b7f"),
    ("accepted", "accepted", "#3a7bd5"),
    ("delivered", "delivered", "#2a9d8f"),
    ("opened", "human_opened", "#e9a23b"),
    ("clicked", "clicked", "#d1495b"),
)


def funnel_by_template(
    connection: duckdb.DuckDBPyConnection, *, days: int = 7
) -> list[dict[str, Any]]:
    """Per template over the newest ``days`` days of ``email_funnel_daily``: the funnel steps."""
    cursor = connection.execute(
        f"""
        SELECT template, sum(messages) AS messages, sum(accepted) AS accepted,
            sum(delivered) AS delivered, sum(human_opened) AS human_opened,
            sum(machine_opened) AS machine_opened, sum(clicked) AS clicked
        FROM {FUNNEL_DAILY}
        WHERE day > (SELECT max(day) FROM {FUNNEL_DAILY}) - ?::INTEGER
        GROUP BY template ORDER BY messages DESC, template
        """,
        [days],
    )
    names = [d[0] for d in cursor.description]
    return [
        {k: (int(v) if isinstance(v, int | float) else v) for k, v in zip(names, r, strict=True)}
        for r in cursor.fetchall()
    ]


def funnel_chart_svg(rows: Sequence[dict[str, Any]], *, title: str) -> str:
    """A funnel chart (event -> accepted -> delivered -> opened -> clicked) per template, as SVG.

    Plain SVG text: no plotting library, no network, and the Dagster UI shows it inline.
    """
    bar_x, bar_w, row_h, width = 110, 330, 17, 600
    block_h = 24 + row_h * len(FUNNEL_STEPS) + 10
    height = 34 + block_h * max(len(rows), 1)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="Helvetica, Arial, sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="10" y="20" font-size="14" font-weight="bold">{_xml(title)}</text>',
    ]
    if not rows:
        parts.append('<text x="10" y="50" fill="#777">No messages yet.</text>')
    for index, row in enumerate(rows):
        top = 34 + index * block_h
        parts.append(
            f'<text x="10" y="{top + 14}" font-weight="bold">{_xml(str(row["template"]))}</text>'
        )
        base = row["messages"] or 0
        for step, (label, key, color) in enumerate(FUNNEL_STEPS):
            y = top + 22 + step * row_h
            value = row.get(key) or 0
            share = value / base if base else 0.0
            parts.append(f'<text x="20" y="{y + 11}" fill="#333">{label}</text>')
            parts.append(
                f'<rect x="{bar_x}" y="{y}" width="{bar_w}" height="{row_h - 4}" fill="#eef1f5"/>'
            )
            parts.append(
                f'<rect x="{bar_x}" y="{y}" width="{bar_w * share:.1f}" height="{row_h - 4}" '
                f'fill="{color}"/>'
            )
            parts.append(
                f'<text x="{bar_x + bar_w + 8}" y="{y + 11}" fill="#333">'
                f"{value:,} ({share:.1%})</text>"
            )
    parts.append("</svg>")
    return "\n".join(parts)


def _xml(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
