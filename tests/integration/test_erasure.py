"""Erasure (GDPR Art. 17) end to end, on SQLite and PostgreSQL: one person's mail through every
hop (publish, a transient failure and its retry, a provider refusal that becomes a dead letter,
signed webhooks with a complaint, one left unprocessed, the warehouse built by its Dagster
assets), then ``erase``. Afterwards no table of the application database, no table or byte of
the warehouse files, and nothing in the Dagster instance (event log, run tags, its storage
files) holds the address, its local part or the person's name; a later event to the address is
still suppressed, and a second erasure erases nothing.
"""

import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from unittest import mock
from urllib.parse import quote, unquote

import duckdb
import pytest
from click.testing import CliRunner
from dagster import DagsterInstance, materialize
from sqlalchemy import Engine, select
from sqlalchemy.engine import make_url
from starlette.testclient import TestClient

from email_platform import publish
from email_platform.assets import analytics_checks, analytics_warehouse
from email_platform.cli import main
from email_platform.common.errors import ProviderRejectedError
from email_platform.common.lanes import Lane
from email_platform.common.timeutil import utcnow
from email_platform.db import schema
from email_platform.jobs import ingest_run_config
from email_platform.mail.addressing import Mailbox
from email_platform.mail.routes import Route, RouteTable, demo_routes
from email_platform.operating.erasure import TABLES, erase
from email_platform.providers.sandbox import SandboxProvider
from email_platform.resources import AppDatabase, Warehouse
from email_platform.store import suppressions
from email_platform.webhooks.receiver import create_receiver_app
from tests.support import (
    dead_letters_of,
    event,
    messages_of,
    publish_one,
    run_send,
    sandbox_messages,
    send_job_defs,
    signup,
)
from tests.webhook_support import SETTINGS, sandbox_event, signed

#: Also a sandbox directive: its first attempt gets a 503, the retry is accepted.
ADDRESS = "Zelda.Quux+503x1@example.org"
LOCAL = "zelda.quux"
NAME = "Quuxabella"
NEEDLES = (ADDRESS.lower(), LOCAL, NAME.lower())


class _QuotesTheAddressItRefuses(SandboxProvider):
    """Refuses receipts the way real providers do, quoting the address in the error."""

    def send(self, email):  # type: ignore[no-untyped-def]
        if email.template == "receipt":
            raise _refusal(email.to)
        return super().send(email)

    def send_many(self, emails):  # type: ignore[no-untyped-def]
        results = iter(super().send_many([e for e in emails if e.template != "receipt"]))
        return [_refusal(e.to) if e.template == "receipt" else next(results) for e in emails]


def _refusal(to: str) -> ProviderRejectedError:
    return ProviderRejectedError(
        f"HTTP 422: Invalid 'To' address: '{to}'.", status_code=422, code="to_invalid"
    )


def _publish_the_person(engine: Engine) -> tuple[str, str, str]:
    """A signup (sent after one 503), a receipt (refused: a dead letter), a digest not due."""
    with engine.begin() as connection:
        welcome = publish(
            connection,
            event_type="user.signed_up",
            aggregate_id="user-zq",
            payload={"user_id": "user-zq", "email": ADDRESS, "first_name": NAME},
            metadata={"note": f"signup of {ADDRESS}"},
        )
        receipt = publish(
            connection,
            event_type="order.paid",
            aggregate_id="order-zq-1",
            payload={
                "order_id": "ZQ-1",
                "email": ADDRESS,
                "first_name": NAME,
                "items": [{"name": "Lamp", "quantity": 1, "unit_price": 10.0}],
                "total": 10.0,
                "currency": "EUR",
            },
        )
        later = publish(
            connection,
            event_type="digest.ready",
            aggregate_id="user-zq",
            payload={"email": ADDRESS, "first_name": NAME, "highlights": []},
            send_after=utcnow() + timedelta(days=365),
        )
    return welcome, receipt, later


def _webhooks(engine: Engine, instance: DagsterInstance, database_url: str, sandbox_url: str):  # type: ignore[no-untyped-def]
    """Signed sandbox webhooks about the welcome, ingested by a Dagster run; one stays pending."""
    (sent,) = sandbox_messages(sandbox_url)
    about = {
        "message_id": sent["id"],
        "to": sent["to"],
        "event_id": sent["metadata"]["event_id"],
        "idempotency_key": sent["idempotency_key"],
    }
    url = f"https://app.example.com/account/{sent['to']}?e={quote(sent['to'])}"
    events = [
        sandbox_event("email.delivered", **about),
        sandbox_event("email.opened", **about, user_agent=f"Mail ({NAME})", ip="203.0.113.9"),
        sandbox_event("email.clicked", **about, click={"url": url}),
        sandbox_event("email.complained", **about),
        # Unlinked: a message id we never sent, to the same person.
        sandbox_event(
            "email.bounced",
            message_id="sbx_other",
            to=sent["to"],
            bounce={"type": "soft", "reason": f"452 <{sent['to']}>: mailbox full"},
        ),
    ]
    client = TestClient(create_receiver_app(engine, settings=SETTINGS))
    for kind in events:
        body, headers = signed(kind)
        assert client.post("/webhooks/sandbox", content=body, headers=headers).status_code == 200
    with engine.connect() as connection:
        ids = [r.inbox_id for r in connection.execute(select(schema.webhook_inbox))]
    ingest = send_job_defs(database_url, sandbox_url).get_job_def("ingest_webhooks_job")
    assert ingest.execute_in_process(run_config=ingest_run_config(ids), instance=instance).success
    body, headers = signed(sandbox_event("email.opened", **about))  # arrives, not normalized yet
    assert client.post("/webhooks/sandbox", content=body, headers=headers).status_code == 200


def _database_hits(engine: Engine) -> list[str]:
    """Every table.column of the application schema whose value holds a needle (any case)."""
    hits = []
    with engine.connect() as connection:
        for table in schema.metadata.sorted_tables:
            for row in connection.execute(select(table)):
                for column, value in row._mapping.items():
                    text = json.dumps(value) if isinstance(value, dict | list) else str(value)
                    text = f"{text} {unquote(text)}"
                    if any(needle in text.lower() for needle in NEEDLES):
                        hits.append(f"{table.name}.{column}")
    return sorted(set(hits))


def _file_hits(database_url: str) -> list[str]:
    """SQLite: the database file and its write-ahead log, byte by byte (old row versions)."""
    url = make_url(database_url)
    if url.get_backend_name() != "sqlite":
        return []
    files = Path(url.database).parent.glob(f"{Path(url.database).name}*")
    return sorted(
        f"file {file.name}"
        for file in files
        if any(n.encode() in file.read_bytes().lower() for n in NEEDLES)
    )


def _warehouse_hits(path: Path) -> list[str]:
    """Every table.column of the warehouse snapshot holding a needle, and every file of it
    (snapshot, writer file, leftovers) whose bytes do."""
    hits = []
    connection = duckdb.connect(str(path), read_only=True)
    try:
        tables = connection.execute(
            "SELECT table_name, column_name FROM information_schema.columns"
            " WHERE table_schema = 'main'"
        ).fetchall()
        for table, column in tables:
            rows = connection.execute(f'SELECT DISTINCT CAST("{column}" AS VARCHAR) FROM "{table}"')
            for (value,) in rows.fetchall():
                if value and any(n in unquote(value).lower() for n in NEEDLES):
                    hits.append(f"{table}.{column}")
    finally:
        connection.close()
    for file in path.parent.iterdir():
        if file.name.startswith((path.name, f".{path.name}")):
            data = file.read_bytes().lower()
            hits.extend(f"file {file.name}" for n in NEEDLES if n.encode() in data)
    return sorted(set(hits))


def _dagster_hits(instance: DagsterInstance, home: Path) -> list[str]:
    """Needles in any run's event log (messages, metadata, errors), tags or config, and in the
    bytes of the instance's storage files."""
    hits = []
    for run in instance.get_runs():
        texts = [json.dumps(run.tags), json.dumps(run.run_config, default=str)]
        texts += [repr(entry) for entry in instance.all_logs(run.run_id)]
        hits.extend(f"run {run.job_name}" for t in texts if any(n in t.lower() for n in NEEDLES))
    for file in home.rglob("*"):
        if file.is_file() and any(n.encode() in file.read_bytes().lower() for n in NEEDLES):
            hits.append(f"file {file.relative_to(home)}")
    return sorted(set(hits))


@pytest.fixture
def dagster_home(tmp_path: Path) -> Iterator[tuple[DagsterInstance, Path]]:
    home = tmp_path / "dagster"
    home.mkdir()
    with DagsterInstance.local_temp(str(home)) as instance:
        yield instance, home


def test_an_erased_person_is_nowhere_and_stays_suppressed(
    engine, database_url, sandbox, tmp_path, dagster_home
):
    instance, home = dagster_home
    welcome, receipt, later = _publish_the_person(engine)
    # A fresh adapter per attempt (the op closes its own after each).
    refusing = lambda settings, max_connections: _QuotesTheAddressItRefuses(  # noqa: E731
        sandbox.base_url, max_connections=max_connections
    )
    with mock.patch("email_platform.resources.provider.open_provider", refusing):
        result = run_send(
            database_url, sandbox.base_url, "transactional", [welcome, receipt], instance=instance
        )
    assert not result.success  # the receipt's dead letter fails the run, as designed
    assert [m.status for m in messages_of(engine, welcome)] == ["sent"]
    assert [a.outcome for a in _attempts(engine, welcome)] == ["transient", "accepted"]
    (letter,) = dead_letters_of(engine, receipt)
    assert letter.reason == "provider_rejected" and ADDRESS in letter.last_error
    _webhooks(engine, instance, database_url, sandbox.base_url)
    with engine.connect() as connection:
        assert suppressions.reasons_for(connection, [ADDRESS]) == {ADDRESS.lower(): "complaint"}
    path = tmp_path / "warehouse.duckdb"
    resources = {
        "email_database": AppDatabase(url=database_url),
        "email_warehouse": Warehouse(path=str(path)),
    }
    assert materialize(
        [analytics_warehouse, *analytics_checks], resources=resources, instance=instance
    ).success
    # The searches find what is there: every hop holds the person now.
    found = _database_hits(engine)
    for column in (
        "email_outbox.payload",
        "email_outbox.event_metadata",
        "email_messages.recipient",
        "dead_letters.last_error",
        "email_events.recipient",
        "email_events.click_url",
        "email_events.user_agent",
        "email_events.reject_reason",
        "email_events.raw",
        "webhook_inbox.body",
        "suppressions.address",
    ):
        assert column in found, found
    assert "raw_email_events.click_url" in _warehouse_hits(path)
    if make_url(database_url).get_backend_name() == "sqlite":
        assert _file_hits(database_url)
    # The refusal quoted the address; the run's log line does not (nor anything else there).
    assert _dagster_hits(instance, home) == []
    assert any(welcome in repr(e) for e in instance.all_logs(result.run_id))

    report = erase(engine, email=ADDRESS, warehouse_path=str(path))

    assert _database_hits(engine) == []
    assert _file_hits(database_url) == []
    assert _warehouse_hits(path) == []
    assert _dagster_hits(instance, home) == []
    assert report.warehouse == "rebuilt"
    assert (report.cancelled_events, report.cancelled_messages) == (1, 0)
    assert (report.suppressions_hashed, report.suppressions_added) == (1, 0)
    assert report.tables["email_outbox"] == 3 and report.tables["email_messages"] == 2
    assert report.tables["dead_letters"] == 1 and report.tables["email_events"] == 5
    assert report.tables["email_attempts"] == 1  # the refusal's text; the 503's held no one
    assert report.tables["webhook_inbox"] == 6 and report.tables["suppressions"] == 1
    # Counts stay: every row is still there with its status.
    assert (
        event(engine, later).status == "cancelled" and event(engine, later).resolution == "erased"
    )
    assert event(engine, welcome).status == "done" and event(engine, receipt).status == "dead"
    assert [m.status for m in messages_of(engine, welcome)] == ["sent"]
    (letter,) = dead_letters_of(engine, receipt)
    assert letter.status == "discarded" and "[erased]" in letter.last_error
    with engine.connect() as connection:
        kinds = connection.execute(select(schema.email_events.c.event_type)).scalars().all()
        pending = connection.execute(
            select(schema.webhook_inbox).where(schema.webhook_inbox.c.status == "pending")
        ).all()
    assert sorted(kinds) == ["bounced", "clicked", "complained", "delivered", "opened"]
    assert pending == []
    rows = duckdb.connect(str(path), read_only=True).execute(
        "SELECT count(*), count(first_click_at), count(complained_at) FROM email_funnel"
    )
    assert rows.fetchone() == (2, 1, 1)

    again = erase(engine, email=ADDRESS.upper(), warehouse_path=str(path))
    assert again.total == 0 and again.tables == dict.fromkeys(TABLES, 0)
    assert (again.cancelled_events, again.suppressions_added) == (0, 0)

    # The person signs up again: the address is still suppressed, and nothing is sent.
    sent_before = len(sandbox_messages(sandbox.base_url))
    comeback = signup(engine, "user-zq-2", email=ADDRESS)
    assert run_send(database_url, sandbox.base_url, "transactional", [comeback]).success
    (message,) = messages_of(engine, comeback)
    assert message.status == "suppressed" and message.last_error == "address suppressed: erased"
    assert len(sandbox_messages(sandbox.base_url)) == sent_before


def _attempts(engine: Engine, event_id: str) -> list:
    with engine.connect() as connection:
        return list(
            connection.execute(
                select(schema.email_attempts)
                .where(schema.email_attempts.c.event_id == event_id)
                .order_by(schema.email_attempts.c.attempt_id)
            )
        )


def test_erasing_an_aggregate_erases_the_addresses_it_was_mailed_to(engine, database_url, sandbox):
    mine = signup(engine, "user-ab", email="ab.person@example.com")
    other = signup(engine, "user-cd", email="cd.person@example.com")
    assert run_send(database_url, sandbox.base_url, "transactional", [mine, other]).success
    # Another event holding the address, under another aggregate (an order of that person).
    with engine.begin() as connection:
        order = publish(
            connection,
            event_type="order.paid",
            aggregate_id="order-ab-1",
            payload={
                "order_id": "AB-1",
                "email": "ab.person@example.com",
                "first_name": "A",
                "items": [],
                "total": 0.0,
                "currency": "EUR",
            },
        )
    report = erase(engine, aggregate_id="user-ab")
    assert report.addresses == 1 and report.suppressions_added == 1
    assert report.tables["email_outbox"] == 2 and report.cancelled_events == 1  # the order
    assert event(engine, order).status == "cancelled"
    assert event(engine, mine).aggregate_id == "erased" and event(engine, mine).payload == {
        "erased": True
    }
    assert messages_of(engine, mine)[0].recipient is None
    # Nobody else is touched.
    assert event(engine, other).payload["email"] == "cd.person@example.com"
    assert messages_of(engine, other)[0].recipient == "cd.person@example.com"
    with engine.connect() as connection:
        assert suppressions.reasons_for(
            connection, ["ab.person@example.com", "cd.person@example.com"]
        ) == {"ab.person@example.com": "erased"}
    assert erase(engine, aggregate_id="user-ab").total == 0


def _invoice_routes() -> RouteTable:
    """The demo routes plus one addressed wholly from the payload: From, Reply-To, Cc, Bcc."""
    table = demo_routes()
    table.routes.append(
        Route(
            name="invoice",
            event_type="invoice.issued",
            event_version=1,
            template="receipt",
            lane=Lane.TRANSACTIONAL,
            header_fields=("first_name", "order_id"),
            sender=Mailbox(address_field="seller_email"),
            reply_to=(Mailbox(address_field="contact"),),
            cc=(Mailbox(address_field="accountant"),),
            bcc=(Mailbox(address_field="auditor"),),
        )
    )
    table.schemas[("invoice.issued", 1)] = {"type": "object"}
    return table


def test_erasing_an_aggregate_leaves_the_third_parties_its_mail_copied(engine):
    """An aggregate's events are the person's; the From, Reply-To, Cc and Bcc addresses its
    mail carried may be anyone's (the shop, its accountant): they leave with the events'
    payloads, but are not erased or suppressed elsewhere, where they are other people's mail."""
    routes = _invoice_routes()
    copied = {
        "seller_email": "sales.ef@shop.example.com",
        "contact": "help.ef@shop.example.com",
        "accountant": "books.ef@example.com",
        "auditor": "audit.ef@example.com",
    }

    def invoice(aggregate_id: str, email: str) -> str:
        payload = {"email": email, "order_id": aggregate_id, "first_name": "E", "items": [],
                   "total": 0.0, "currency": "EUR", **copied}  # fmt: skip
        return publish_one(
            engine,
            event_type="invoice.issued",
            aggregate_id=aggregate_id,
            payload=payload,
            routes=routes,
        )

    mine = invoice("user-ef", "ef.person@example.com")
    theirs = invoice("user-gh", "gh.person@example.com")
    report = erase(engine, aggregate_id="user-ef", routes=routes)
    assert report.addresses == 1 and report.suppressions_added == 1
    assert event(engine, mine).status == "cancelled"
    assert event(engine, mine).payload == {"erased": True}
    assert event(engine, theirs).status == "pending"
    assert event(engine, theirs).payload["accountant"] == "books.ef@example.com"
    with engine.connect() as connection:
        everyone = [*copied.values(), "ef.person@example.com", "gh.person@example.com"]
        assert suppressions.reasons_for(connection, everyone) == {"ef.person@example.com": "erased"}


def _cli(database_url: str, tmp_path: Path, *args: str) -> tuple[int, str]:
    env = {
        "EMAIL_PLATFORM_DATABASE_URL": database_url,
        "EMAIL_PLATFORM_WAREHOUSE": str(tmp_path / "warehouse.duckdb"),
    }
    result = CliRunner().invoke(main, list(args), env=env)
    return result.exit_code, result.output


def test_the_erase_command_prints_per_table_counts_and_what_is_kept(
    engine, database_url, sandbox, tmp_path
):
    event_id = signup(engine, "u1", email="cli.person@example.com")
    assert run_send(database_url, sandbox.base_url, "transactional", [event_id]).success
    code, output = _cli(database_url, tmp_path, "erase", "--email", "cli.person@example.com")
    assert code == 0, output
    assert "erased address cli.person@example.com: 3 row(s), 1 address(es)" in output
    counts = dict(line.split() for line in output.splitlines() if line.startswith("  email_"))
    assert counts == {
        "email_outbox": "1",
        "email_messages": "1",
        "email_attempts": "0",
        "email_events": "0",
    }
    assert "suppressions: 0 replaced by their hash, 1 hashed one(s) added" in output
    assert "no file, nothing to rebuild" in output and "kept:" in output
    code, output = _cli(
        database_url, tmp_path, "erase", "--email", "cli.person@example.com", "--json"
    )
    assert code == 0, output
    report = json.loads(output)
    assert report["total"] == 0 and report["tables"] == dict.fromkeys(TABLES, 0)
    assert report["warehouse"] == "no warehouse file" and report["kept"]
    code, output = _cli(database_url, tmp_path, "erase", "--aggregate-id", "u1", "--json")
    assert code == 0 and json.loads(output)["total"] == 0  # its rows are anonymized already


def test_the_erase_command_refuses_a_bad_address_or_no_one(database_url, tmp_path):
    code, output = _cli(database_url, tmp_path, "erase", "--email", "not-an-address")
    assert code == 2 and "Invalid value for --email" in output
    assert "is not a valid email address" in output
    code, output = _cli(database_url, tmp_path, "erase")
    assert code == 2 and "say whom to erase" in output
