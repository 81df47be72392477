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
from pathlib import Path
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


def analytics_dir() -> Path:
    """Where the SQL files are, as a real path that works in both layouts: ``analytics/`` in a
    checkout (the package's ``sql`` symlink resolved), the installed package's copies
    (``email_platform/warehouse/sql``) otherwise. Its ``questions/`` holds one file each."""
    return Path(os.path.realpath(str(sql_file())))


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
                f"{row['bounced']:>8}{percent(row['open_rate']):>10}{row['machine_opened']:>9}"
            )
        label = plot_label("open_rate", "welcome", self.rates.suffix)
        lines.append(
            f"Welcome email human open rate: {percent(self.welcome_open_rate)} "
            f'({self.rates.scope}; plotted as "{label}" on email_funnel_daily)'
        )
        return "\n".join(lines)


def percent(value: float | None) -> str:
    """A rate as a percentage for people: one decimal, two below 1 % (a 0.3 % complaint limit
    must not read as "0.0%"); "-" when the rate has no denominator."""
    if value is None:
        return "-"
    return f"{value:.2%}" if 0 < value < 0.01 else f"{value:.1%}"


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
        cells += [percent(row[name]) for name in HEADLINE_RATES]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# The Dagster UI renders a Markdown entry inline only below this many characters (ui-core's
# MetadataEntry: ``mdStr.length < 1000``); longer ones hide behind "[Show Markdown]".
INLINE_MARKDOWN_LIMIT = 1000
_BAR_CELLS = 16
_EIGHTHS = " ▏▎▍▌▋▊▉"


def _bar(share: float) -> str:
    """A text bar ``share`` of ``_BAR_CELLS`` wide (eighths of a cell), so the funnel's shape
    shows in Markdown, with no image (an image's data URI alone is past the inline limit)."""
    eighths = round(max(0.0, min(1.0, share)) * _BAR_CELLS * 8)
    return "█" * (eighths // 8) + _EIGHTHS[eighths % 8].strip()


def funnel_md(rates: FunnelRates, *, limit: int = INLINE_MARKDOWN_LIMIT) -> str:
    """The funnel over the window as short Markdown the Dagster UI shows inline: every message's
    steps as bars with their rates, then each template's key rates, largest first, as many as
    fit under ``limit`` characters (the rest are named in the last line)."""
    overall = rates.overall
    base = overall["messages"] or 0
    lines = [f"**Funnel, {rates.window}**", "", "| step | count | | rate |", "|---|---:|---|---|"]
    for label, key, rate, _ in FUNNEL_STEPS:
        value = overall.get(key) or 0
        text = (
            "" if rate is None else f"{percent(overall[rate])} of {RATES_BY_NAME[rate].denominator}"
        )
        lines.append(f"| {label} | {value:,} | {_bar(value / base if base else 0.0)} | {text} |")
    lines += [
        "",
        "| template | messages | open rate | click rate | bounce rate |",
        "|---|---:|---:|---:|---:|",
    ]
    by_size = sorted(
        rates.templates, key=lambda row: (-(row["messages"] or 0), str(row["template"]))
    )
    shown = 0
    for row in by_size:
        line = (
            f"| {row['template']} | {row['messages']:,} | {percent(row['open_rate'])} | "
            f"{percent(row['click_rate'])} | {percent(row['bounce_rate'])} |"
        )
        rest = len(by_size) - shown - 1
        tail = f"\n\n{rest} more templates in funnel_chart." if rest else ""
        if len("\n".join([*lines, line])) + len(tail) >= limit:
            break
        lines.append(line)
        shown += 1
    if shown < len(by_size):
        lines += ["", f"{len(by_size) - shown} more templates in funnel_chart."]
    return "\n".join(lines)


# What is plotted, in groups the UI shows in this order: the open rate of every message, each
# template's open rate, the other rates of every message, each template's click rate.
_PLOT_GROUPS: tuple[tuple[bool, tuple[str, ...]], ...] = (
    (False, ("open_rate",)),
    (True, ("open_rate",)),
    (False, ("bounce_rate", "click_rate", "complaint_rate", "delivery_rate", "machine_open_rate")),
    (True, ("click_rate",)),
)
# Templates plotted, largest first: Dagster plots the first 100 numeric labels and no more.
_MAX_PLOTTED_TEMPLATES = 10


def plot_label(name: str, template: str | None, suffix: str) -> str:
    """The label ``plotted_rates`` gives one rate (``template=None``: every message's)."""
    per_template = template is not None
    group = next(
        index
        for index, (of_template, names) in enumerate(_PLOT_GROUPS, start=1)
        if of_template == per_template and name in names
    )
    return f"{group} {name.replace('_', ' ')}, {template or 'all'}, {suffix} (%)"


def plotted_rates(rates: FunnelRates) -> dict[str, float]:
    """The rates to plot over materializations, in percent (two decimals), labelled
    ``<group> <rate>, <template or all>, <window> (%)``, e.g. ``2 open rate, welcome, 7d (%)``.

    The Dagster UI sorts plot labels as strings (ui-core's AssetMaterializationGraphs), so the
    group's digit leads the label: the open rates come first, and a label never changes with
    the data (a plot is the history of one label). A rate without a denominator is left out.
    """
    templates = sorted(
        rates.templates, key=lambda row: (-(row["messages"] or 0), str(row["template"]))
    )[:_MAX_PLOTTED_TEMPLATES]
    entries: list[tuple[str, float]] = []
    for per_template, names in _PLOT_GROUPS:
        rows = templates if per_template else [rates.overall]
        for name in names:
            for row in rows:
                if row[name] is not None:
                    template = str(row["template"]) if per_template else None
                    label = plot_label(name, template, rates.suffix)
                    entries.append((label, round(100 * row[name], 2)))
    return dict(sorted(entries))


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
                text += f" ({percent(row[rate])} of {RATES_BY_NAME[rate].denominator})"
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
