"""Numbers read from a warehouse: totals, the funnel per template, its chart, the questions.

``funnel_totals`` is what each refresh reports (the assets' metadata); ``funnel_report`` and
``funnel_row`` are what the demo and ``email-platform trace`` print; ``funnel_chart_svg`` draws
the chart on ``email_funnel_daily``; ``run_question`` answers one analyst question
(``analytics/questions/<name>.sql``). All read the published snapshot; every rate comes from
``rates.template_rates``, as ``email_funnel_daily`` defines it.
"""

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import duckdb

from email_platform.warehouse.build import FUNNEL, FUNNEL_DAILY, sql_file
from email_platform.warehouse.files import connect_read_only
from email_platform.warehouse.rates import (
    HEADLINE_RATES,
    RATE_WINDOW_DAYS,
    RATES_BY_NAME,
    FunnelRates,
    template_rates,
)

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
    """Whole-warehouse counts, and latency percentiles over the newest ``latency_days`` days:
    what the UI plots over time (recent latencies move with the system; all-time ones would
    barely move, and cost a sort of every row on each refresh). No rates: those are
    ``template_rates``' (over a stated window), so the UI shows one open rate, not two.

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
            l.accepted[1], l.accepted[2], l.delivery, l.open[1], l.open[2]
        FROM t, latencies AS l
        """
    ).fetchone()
    names = (
        *counts,
        "event_to_accepted_p50_s",
        "event_to_accepted_p95_s",
        "delivery_delay_p50_s",
        "time_to_open_p50_s",
        "time_to_open_p95_s",
    )
    return dict(zip(names, row, strict=True))


@dataclass
class FunnelReport:
    """The funnel per template over a window, plus the welcome email's human open rate."""

    rows: list[dict[str, Any]]
    welcome_open_rate: float | None
    rates: FunnelRates

    def to_text(self) -> str:
        header = (
            f"{'template':<16}{'messages':>9}{'accepted':>9}{'delivered':>10}{'opened':>8}"
            f"{'clicked':>8}{'bounced':>8}{'open rate':>10}{'machine':>9}"
        )
        lines = [
            f"Funnel by template, {self.rates.window}",
            f"(open rate = {RATES_BY_NAME['open_rate'].definition}; machine opens apart)",
            header,
        ]
        for row in self.rows:
            lines.append(
                f"{row['template']:<16}{row['messages']:>9}{row['accepted']:>9}"
                f"{row['delivered']:>10}{row['human_opened']:>8}{row['clicked']:>8}"
                f"{row['bounced']:>8}{_pct(row['open_rate']):>10}{row['machine_opened']:>9}"
            )
        lines.append(
            f"Welcome email human open rate: {_pct(self.welcome_open_rate)} "
            f"({self.rates.scope}; welcome_open_rate_{self.rates.suffix} on email_funnel_daily)"
        )
        return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def funnel_report(
    warehouse_path: str | os.PathLike[str],
    *,
    event_ids: Sequence[str] | None = None,
    days: int | None = RATE_WINDOW_DAYS,
) -> FunnelReport:
    """The funnel per template from the published snapshot over the newest ``days`` days,
    optionally for some events only: ``template_rates``' numbers, as text for the demo."""
    rates = template_rates(warehouse_path, days=days, event_ids=event_ids)
    return FunnelReport(
        rows=rates.templates, welcome_open_rate=rates.rate("open_rate", "welcome"), rates=rates
    )


def funnel_table_md(rates: FunnelRates) -> str:
    """The counts and headline rates per template and overall, as a Markdown table headed by
    its window and the rates' definitions (under the chart on email_funnel_daily)."""
    counts = ("messages", "accepted", "delivered", "human_opened", "clicked", "machine_opened")
    header = ["template", *counts, *HEADLINE_RATES]
    lines = [
        f"{rates.window}. "
        + "; ".join(f"{name} = {RATES_BY_NAME[name].definition}" for name in HEADLINE_RATES)
        + ".",
        "",
        "| " + " | ".join(header) + " |",
        "|---|" + "---:|" * (len(header) - 1),
    ]
    for row in (*rates.templates, {**rates.overall, "template": "**all**"}):
        cells = [str(row["template"])]
        cells += [f"{row[name]:,}" for name in counts]
        cells += [_pct(row[name]) for name in HEADLINE_RATES]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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


# Each step: its label, its count and the rate the chart prints beside it (None: the base).
FUNNEL_STEPS = (
    ("event", "messages", None, "#5b6b7f"),
    ("accepted", "accepted", "acceptance_rate", "#3a7bd5"),
    ("delivered", "delivered", "delivery_rate", "#2a9d8f"),
    ("opened", "human_opened", "open_rate", "#e9a23b"),
    ("clicked", "clicked", "click_rate", "#d1495b"),
)


def funnel_chart_svg(rows: Sequence[dict[str, Any]], *, title: str) -> str:
    """A funnel chart (event -> accepted -> delivered -> opened -> clicked) per template, as SVG.

    ``rows`` are ``template_rates`` rows. Bars are drawn to scale of the template's messages
    (the funnel's shape); each step is labelled with its count and its rate as
    ``email_funnel_daily`` defines it, naming the denominator ("33.2% of delivered"), so the
    chart shows the numbers the metadata, the questions and the demo show.
    Plain SVG text: no plotting library, no network, and the Dagster UI shows it inline.
    """
    bar_x, bar_w, row_h, width = 110, 330, 17, 640
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
        for step, (label, key, rate, color) in enumerate(FUNNEL_STEPS):
            y = top + 22 + step * row_h
            value = row.get(key) or 0
            share = value / base if base else 0.0
            text = f"{value:,}"
            if rate is not None:
                text += f" ({_pct(row[rate])} of {RATES_BY_NAME[rate].denominator})"
            parts.append(f'<text x="20" y="{y + 11}" fill="#333">{label}</text>')
            parts.append(
                f'<rect x="{bar_x}" y="{y}" width="{bar_w}" height="{row_h - 4}" fill="#eef1f5"/>'
            )
            parts.append(
                f'<rect x="{bar_x}" y="{y}" width="{bar_w * share:.1f}" height="{row_h - 4}" '
                f'fill="{color}"/>'
            )
            parts.append(f'<text x="{bar_x + bar_w + 8}" y="{y + 11}" fill="#333">{text}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _xml(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
