"""One definition of each rate: email_funnel_daily's, and every SQL file, the asset metadata,
the chart, the questions and the demo's report give the same number over the same window.

Uses the hand-checked fixture of ``test_analytics`` (every message on 2026-03-02).
"""

import inspect
import json
import math
import re
import shlex
import subprocess
from datetime import date
from pathlib import Path

import duckdb
import pytest
from click.testing import CliRunner
from dagster import FloatMetadataValue, IntMetadataValue, MarkdownMetadataValue

from email_platform import warehouse
from email_platform.assets import analytics
from email_platform.cli.app import main
from email_platform.local import demo
from email_platform.warehouse import checks, refreshing, report
from tests.integration.test_analytics import loaded  # noqa: F401 (the fixture, by name)

# A rate as the SQL files write it: a count (or a sum of one) over a count, null on zero.
RATE_SQL = re.compile(
    r"^\s*(?:sum\((?P<sum_n>\w+)\)|(?P<n>\w+)) / nullif\((?:sum\((?P<sum_d>\w+)\)|(?P<d>\w+)), 0\)"
    r" AS (?P<name>\w+_rate),?$"
)


def sql_files() -> dict[str, str]:
    files = {f"{name}.sql": warehouse.model_sql(name) for name in warehouse.MODEL_NAMES}
    files |= {f"questions/{n}.sql": warehouse.question_sql(n) for n in warehouse.question_names()}
    assert len(files) > len(warehouse.MODEL_NAMES)
    return files


def defined_rates(sql: str) -> dict[str, tuple[str, str]]:
    """Every ``... AS <name>_rate`` of a SQL file, as (numerator, denominator); a rate written
    any other way fails."""
    rates = {}
    for line in sql.splitlines():
        line = line.split("--")[0]  # comments may show how, they define nothing
        if not re.search(r"\bAS \w+_rate\b", line):
            continue
        match = RATE_SQL.match(line)
        assert match, f"a rate not written as a count over a count: {line.strip()}"
        rates[match["name"]] = (match["n"] or match["sum_n"], match["d"] or match["sum_d"])
    return rates


def test_every_rate_any_sql_file_computes_is_the_daily_models_definition():
    daily = defined_rates(warehouse.model_sql(warehouse.FUNNEL_DAILY))
    # The model defines every rate the Python readers compute, and only those.
    assert daily == {rate.name: (rate.numerator, rate.denominator) for rate in warehouse.RATES}
    assert daily["open_rate"] == ("human_opened", "delivered")
    assert daily["complaint_rate"] == ("complained", "delivered")
    seen = set()
    for name, sql in sql_files().items():
        for rate, terms in defined_rates(sql).items():
            assert terms == daily[rate], (name, rate)  # the same name never means another rate
            seen.add(name)
    assert "questions/rates_by_template_last_7_days.sql" in seen
    assert "questions/welcome_open_rate_weekly.sql" in seen
    assert "questions/welcome_open_rate_last_7_days.sql" in seen
    assert {"questions/funnel_by_template.sql", "questions/bounce_rate_by_domain.sql"} <= seen
    # Python computes no rate of its own: no division outside the one list of rates.
    for module in (report, checks, refreshing, analytics):
        assert "nullif" not in inspect.getsource(module), module.__name__


def test_daily_rates_are_their_counts_over_their_counts(loaded):  # noqa: F811
    _, path, _ = loaded
    connection = warehouse.connect_read_only(path)
    try:
        cursor = connection.execute("SELECT * FROM email_funnel_daily")
        names = [d[0] for d in cursor.description]
        rows = [dict(zip(names, r, strict=True)) for r in cursor.fetchall()]
    finally:
        connection.close()
    assert len(rows) == 5
    for row in rows:
        for rate in warehouse.RATES:
            denominator = row[rate.denominator]
            expected = row[rate.numerator] / denominator if denominator else None
            assert row[rate.name] == expected, (row["template"], rate.name)


def test_template_rates_over_the_window_agree_with_the_question_and_the_report(loaded):  # noqa: F811
    """Two more welcome days: 2026-02-24 (the seventh day back, inside the window) and
    2026-02-23 (outside). The metadata entries, the question file and the demo's report give
    the same numbers; the day outside counts only for days=None."""
    _, path, _ = loaded
    writer = duckdb.connect(str(path))  # a doctored copy; no refresh runs here
    try:
        writer.execute(
            "INSERT INTO email_funnel_daily BY NAME "
            "SELECT day, 'welcome' AS template, 'transactional' AS lane, 'sandbox' AS provider, "
            "messages, messages AS accepted, delivered, human_opened, 0 AS machine_opened, "
            "0 AS clicked, 0 AS bounced, 0 AS hard_bounced, 0 AS complained, "
            "0 AS unsubscribed FROM (VALUES (DATE '2026-02-24', 10, 9, 3), "
            "(DATE '2026-02-23', 100, 100, 0)) AS t(day, messages, delivered, human_opened)"
        )
    finally:
        writer.close()
    rates = warehouse.template_rates(path)
    assert (rates.days, rates.first_day, rates.last_day) == (7, date(2026, 2, 24), date(2026, 3, 2))
    assert rates.window == (
        "last 7 days, 2026-02-24 to 2026-03-02 (UTC, by the day each message was created)"
    )
    assert [row["template"] for row in rates.templates] == [
        "password_reset",
        "receipt",
        "weekly_digest",
        "welcome",
    ]
    welcome = rates.templates[3]
    assert (welcome["messages"], welcome["delivered"], welcome["human_opened"]) == (12, 10, 4)
    assert rates.rate("open_rate", "welcome") == 0.4
    assert rates.rate("open_rate") == 5 / 12  # 1 + 3 + 1 human opens of 1 + 9 + 1 + 1 delivered
    assert rates.rate("open_rate", "nobody") is None
    with pytest.raises(ValueError, match="not a rate"):
        rates.rate("opens")
    every_day = warehouse.template_rates(path, days=None)
    assert every_day.rate("open_rate", "welcome") == 4 / 110
    assert every_day.first_day == date(2026, 2, 23) and every_day.suffix == "all"
    assert warehouse.template_rates(path, days=1).rate("open_rate", "welcome") == 1.0

    entries = rates.metadata_entries()
    assert entries["welcome_open_rate_7d"] == 0.4 and entries["open_rate_7d"] == 5 / 12
    assert entries["receipt_bounce_rate_7d"] == 1.0
    assert entries["weekly_digest_complaint_rate_7d"] == 1.0
    assert "password_reset_open_rate_7d" not in entries  # nothing delivered, no rate
    assert set(entries) <= {
        f"{prefix}{name}_7d"
        for prefix in ("", "password_reset_", "receipt_", "welcome_", "weekly_digest_")
        for name in warehouse.HEADLINE_RATES
    }

    answer = warehouse.run_question(path, "rates_by_template_last_7_days")
    for row, expected in zip(
        answer.to_dict("records"), [rates.overall, *rates.templates], strict=True
    ):
        for name in ("messages", "delivered", "human_opened", *warehouse.HEADLINE_RATES):
            value = None if isinstance(row[name], float) and math.isnan(row[name]) else row[name]
            assert value == expected[name], (expected["template"], name)

    (welcome_answer,) = warehouse.run_question(path, "welcome_open_rate_last_7_days").to_dict(
        "records"
    )
    assert (welcome_answer["first_day"].date(), welcome_answer["last_day"].date()) == (
        rates.first_day,
        rates.last_day,
    )
    assert welcome_answer["open_rate"] == entries["welcome_open_rate_7d"] == 0.4
    assert welcome_answer["machine_open_rate"] == entries["welcome_machine_open_rate_7d"] == 0.1

    # What the UI plots: the same rates, in percent.
    plotted = warehouse.plotted_rates(rates)
    assert plotted["2 open rate, welcome, 7d (%)"] == 100 * welcome_answer["open_rate"] == 40.0
    assert plotted["1 open rate, all, 7d (%)"] == round(100 * 5 / 12, 2) == 41.67

    report = warehouse.funnel_report(path)
    assert report.welcome_open_rate == 0.4 and report.rows == rates.templates
    assert "Welcome email human open rate: 40.0% (last 7 days;" in report.to_text()
    assert '"2 open rate, welcome, 7d (%)" on email_funnel_daily' in report.to_text()


def test_the_report_of_some_events_counts_them_as_the_daily_model_does(loaded):  # noqa: F811
    _, path, _ = loaded
    every = warehouse.template_rates(path)
    all_events = warehouse.template_rates(path, event_ids=["E1", "E2", "E3", "E4", "E5"])
    assert all_events == every  # only the demo's events: the same numbers as the metadata
    some = warehouse.template_rates(path, event_ids=["E1", "E4"])
    assert [row["template"] for row in some.templates] == ["weekly_digest", "welcome"]
    assert (some.overall["messages"], some.overall["delivered"], some.overall["complained"]) == (
        2,
        2,
        1,
    )
    assert some.rate("open_rate") == 1.0 and some.rate("complaint_rate") == 0.5
    assert warehouse.template_rates(path, event_ids=[]).overall["messages"] == 0
    # Nothing of the temp tables the subset was counted in stays behind on a connection.
    connection = warehouse.connect_read_only(path)
    try:
        warehouse.rates.rates_of(connection, event_ids=["E1"])
        temps = connection.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_catalog = 'temp'"
        ).fetchall()
        assert temps == []
        assert connection.execute("SELECT count(*) FROM email_funnel").fetchone()[0] == 5
    finally:
        connection.close()


def test_the_chart_labels_each_step_with_its_rate(loaded):  # noqa: F811
    _, path, _ = loaded
    rates = warehouse.template_rates(path)
    svg = warehouse.funnel_chart_svg(rates.templates, title="t")
    # receipt: 1 message, accepted, delivered, not opened.
    assert "0 (0.0% of delivered)" in svg and "1 (100.0% of accepted)" in svg
    # password_reset: dead, never accepted: no delivery rate.
    assert "0 (- of accepted)" in svg
    table = warehouse.funnel_table_md(rates)
    assert table.splitlines()[0].startswith("last 7 days, 2026-02-24 to 2026-03-02")
    assert "open_rate = human_opened / delivered" in table.splitlines()[0]
    assert table.splitlines()[-1] == (
        "| **all** | 5 | 3 | 3 | 2 | 1 | 1 | 100.0% | 66.7% | 33.3% | 33.3% | 33.3% | 33.3% |"
    )


# What the Dagster UI (ui-core 1.13) does with asset metadata: lists the entries in the order
# they were given, renders Markdown inline only under this many characters (else behind
# "[Show Markdown]"), and plots numeric entries sorted by label as strings.
UI_INLINE_MARKDOWN = 1000


def test_the_funnel_and_the_open_rates_are_the_first_things_on_email_funnel_daily(loaded):  # noqa: F811
    _, _, summary = loaded
    metadata = analytics._metadata(warehouse.FUNNEL_DAILY, summary)
    (first, *_) = metadata
    assert first == "funnel" and isinstance(metadata["funnel"], MarkdownMetadataValue)
    funnel = metadata["funnel"].value
    assert len(funnel) < UI_INLINE_MARKDOWN  # shown inline, not behind "[Show Markdown]"
    # Every message's steps with their rates in percent, then each template's, largest first.
    assert "| opened | 2 | ██████▍ | 66.7% of delivered |" in funnel
    assert "| clicked | 1 | ███▎ | 33.3% of delivered |" in funnel
    lines = funnel.splitlines()
    assert lines[lines.index("|---|---:|---:|---:|---:|") + 1] == (
        "| welcome | 2 | 100.0% | 100.0% | 0.0% |"
    )
    # The rates right after it, and first in the plots; each in percent, not as a fraction.
    numbers = (FloatMetadataValue, IntMetadataValue)
    numeric = [key for key, value in metadata.items() if isinstance(value, numbers)]
    assert list(metadata)[1] == "1 open rate, all, 7d (%)"
    assert sorted(numeric)[:4] == [
        "1 open rate, all, 7d (%)",
        "2 open rate, receipt, 7d (%)",
        "2 open rate, weekly_digest, 7d (%)",
        "2 open rate, welcome, 7d (%)",
    ]
    assert metadata["2 open rate, welcome, 7d (%)"].value == 100.0
    assert metadata["1 open rate, all, 7d (%)"].value == 66.67
    assert metadata["3 complaint rate, all, 7d (%)"].value == 33.33
    # Fewer entries than a plot per template x rate: open and click per template.
    assert len(numeric) == 1 + 3 + 5 + 3 + 3  # + row count, days rebuilt and refresh_s
    # The refresh's own numbers come last.
    assert list(metadata)[-3:] == ["refresh_s", "full_build", "warehouse"]


def test_the_funnel_stays_inline_however_many_templates():
    rows = [
        {
            "template": f"a_rather_long_template_name_{i:02d}",
            "messages": 1000 - i,
            "open_rate": 0.3,
            "click_rate": 0.05,
            "bounce_rate": 0.001,
        }
        for i in range(40)
    ]
    overall = {
        "messages": 40_000,
        "accepted": 39_000,
        "delivered": 38_000,
        "human_opened": 12_000,
        "clicked": 2_000,
        "acceptance_rate": 0.975,
        "delivery_rate": 38 / 39,
        "open_rate": 12 / 38,
        "click_rate": 2 / 38,
    }
    rates = warehouse.FunnelRates(7, date(2026, 2, 24), date(2026, 3, 2), overall, rows)
    funnel = warehouse.funnel_md(rates)
    assert len(funnel) < UI_INLINE_MARKDOWN
    shown = [line for line in funnel.splitlines() if "a_rather_long" in line]
    assert shown and shown[0].startswith("| a_rather_long_template_name_00 |")  # largest first
    assert funnel.endswith(f"{40 - len(shown)} more templates in funnel_chart.")
    assert "| 0.10% |" in shown[0]  # a bounce rate under 1 % keeps two decimals


def test_rates_print_as_percentages():
    assert warehouse.percent(1 / 3) == "33.3%"
    assert warehouse.percent(0.0005) == "0.05%"  # not "0.0%" beside a 0.3 % complaint limit
    assert warehouse.percent(0.0) == "0.0%" and warehouse.percent(1.0) == "100.0%"
    assert warehouse.percent(None) == "-"


def test_the_demo_prints_a_command_that_answers_the_welcome_question(loaded):  # noqa: F811
    _, path, _ = loaded
    hints = demo._query_hints(str(path))
    (command,) = [line.strip() for line in hints if " < " in line]
    # As printed, plus -csv: off a terminal duckdb's boxes elide the columns past 80 characters.
    done = subprocess.run(f"{command} -csv", shell=True, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    header, answer = done.stdout.splitlines()
    assert dict(zip(header.split(","), answer.split(","), strict=True))["open_rate"] == "1.0"
    pointers = [line for line in hints if line.startswith(("  questions", "  tables"))]
    paths = [line.split(": ", 1)[1] for line in pointers]
    assert len(paths) == 2 and all(Path(path).exists() for path in paths), hints
    # The other way it prints: the command line's own question runner, rates in percent.
    (other,) = [line for line in hints if line.startswith("  or: ")]
    args = shlex.split(other.removeprefix("  or: "))[1:]
    printed = CliRunner().invoke(main, args)
    assert printed.exit_code == 0, printed.output
    header, row = printed.output.splitlines()
    assert dict(zip(header.split(), row.split(), strict=True))["open_rate"] == "100.0%"


def test_the_cli_lists_the_questions_and_answers_them_with_rates_in_percent(loaded):  # noqa: F811
    _, path, _ = loaded
    listed = CliRunner().invoke(main, ["analytics", "questions"])
    assert listed.exit_code == 0, listed.output
    for name in warehouse.question_names():
        assert f"  {name} " in listed.output
    folder = listed.output.splitlines()[0].split(" in ", 1)[1].split(" (", 1)[0]
    assert sorted(p.stem for p in Path(folder).glob("*.sql")) == warehouse.question_names()

    asked = CliRunner().invoke(
        main, ["analytics", "ask", "rates_by_template_last_7_days", "--warehouse", str(path)]
    )
    assert asked.exit_code == 0, asked.output
    header, *rows = asked.output.splitlines()
    overall = dict(zip(header.split(), rows[0].split(), strict=True))
    assert overall["open_rate"] == "66.7%" and overall["delivery_rate"] == "100.0%"
    assert "0.666" not in asked.output  # no raw doubles
    as_json = CliRunner().invoke(
        main,
        ["analytics", "ask", "rates_by_template_last_7_days", "--warehouse", str(path), "--json"],
    )
    assert json.loads(as_json.output)[0]["open_rate"] == pytest.approx(2 / 3)  # raw for scripts
    unknown = CliRunner().invoke(main, ["analytics", "ask", "nope", "--warehouse", str(path)])
    assert unknown.exit_code == 2 and "welcome_open_rate_weekly" in unknown.output


def test_every_raw_table_and_warehouse_state_column_is_documented(loaded):  # noqa: F811
    """The README's section on what lies under the models names every raw_* table, each of its
    columns and every column of warehouse_state, as a loaded warehouse file has them."""
    _, path, _ = loaded
    readme = (warehouse.analytics_dir() / "README.md").read_text()
    section = readme.split("## Underneath the models:", 1)[1].split("\n## ", 1)[0]
    rows = {
        line.split("|")[1].strip().strip("`"): line
        for line in section.splitlines()
        if line.startswith("| `")
    }
    connection = warehouse.connect_read_only(path)
    try:
        tables = [
            row[0]
            for row in connection.execute("SHOW TABLES").fetchall()
            if row[0].startswith("raw_") or row[0] == "warehouse_state"
        ]
        columns = {
            table: [row[0] for row in connection.execute(f"DESCRIBE {table}").fetchall()]
            for table in tables
        }
    finally:
        connection.close()
    assert len(tables) == 6
    for table in tables:
        if table == "warehouse_state":
            for column in columns[table]:
                assert f"| `{column}` |" in section, column
            continue
        assert table in rows, table
        for column in columns[table]:
            assert f"`{column}`" in rows[table], (table, column)
