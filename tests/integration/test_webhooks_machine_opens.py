"""Gmail opens count as people's in the open rate; Apple MPP and prefetchers do not.

Through the real path on both databases: the providers' own open samples (Postmark's, whose
``Client`` is Gmail; SendGrid's and Mailgun's, with their machine flags), signed as each
provider signs, posted to the receiver, ingested, and - for the rate - loaded into the
warehouse. Before, Gmail's proxy agent was on the prefetcher list: every Gmail open was a
machine's and a Gmail reader's open rate read as zero.
"""

import dataclasses
import json
from typing import Any

from click.testing import CliRunner
from dagster import materialize
from sqlalchemy import Engine

from email_platform import warehouse
from email_platform.assets import analytics_warehouse
from email_platform.cli import main
from email_platform.resources import AppDatabase, Warehouse
from email_platform.webhooks import registry
from email_platform.webhooks.ingest import WebhookIngestor
from tests.paths import WEBHOOK_FIXTURES
from tests.webhook_signers import MAILGUN, POSTMARK, SENDGRID
from tests.webhook_support import (
    Signer,
    event_rows,
    inbox_rows,
    ingest,
    post,
    receiver,
    seed_sent_message,
)

SAMPLES = WEBHOOK_FIXTURES.parent / "provider_samples"
GMAIL = "Mozilla/5.0 (Windows NT 5.1; rv:11.0) Gecko Firefox/11.0 (via ggpht.com GoogleImageProxy)"


def _sample(provider: str, name: str) -> Any:
    return json.loads((SAMPLES / provider / f"{name}.json").read_text())


def _deliver(engine: Engine, signer: Signer, *payloads: Any) -> None:
    client = receiver(engine, signer)
    for payload in payloads:
        assert post(client, signer, signer.sign(json.dumps(payload).encode())).status_code < 300
    outcome = ingest(engine, signer)
    assert (outcome.malformed, outcome.failed) == (0, 0)


def _opens(engine: Engine) -> dict[str, bool | None]:
    return {r.recipient: r.machine_open for r in event_rows(engine) if r.event_type == "opened"}


def _postmark(kind: str, recipient: str, message: str, **changes: Any) -> Any:
    payload = {**_sample("postmark", kind), "Recipient": recipient, "MessageID": message}
    return {**payload, **changes}


def test_provider_open_samples_are_stored_human_or_machine_by_the_rule(engine: Engine) -> None:
    _deliver(
        engine,
        POSTMARK,
        _postmark("open", "gmail@example.com", "pm-1", UserAgent=GMAIL),
        _postmark(
            "open", "apple@example.com", "pm-2", UserAgent="Mozilla/5.0", Geo={"IP": "17.58.63.11"}
        ),
        _postmark("open", "yahoo@example.com", "pm-3", UserAgent="YahooMailProxy; https://x"),
    )
    sendgrid = _sample("sendgrid", "open")[0]
    _deliver(
        engine,
        SENDGRID,
        [
            {
                **sendgrid,
                "email": "sg-gmail@example.com",
                "useragent": GMAIL,
                "sg_event_id": "gmail-open",
            }
        ],
        # SendGrid's own flag (it marks Apple MPP opens) outranks any agent.
        [
            {
                **sendgrid,
                "email": "sg-flagged@example.com",
                "useragent": GMAIL,
                "sg_machine_open": True,
                "sg_event_id": "flagged-open",
            }
        ],
    )
    mailgun = _sample("mailgun", "opened")["event-data"]
    gmail_client = {**mailgun["client-info"], "user-agent": GMAIL}
    _deliver(
        engine,
        MAILGUN,
        {
            "event-data": {
                **mailgun,
                "id": "mg-human",
                "recipient": "mg-gmail@example.com",
                "client-info": gmail_client,
            }
        },
        # Mailgun names Gmail's bot when it judged the fetch automatic: the provider says so.
        {
            "event-data": {
                **mailgun,
                "id": "mg-bot",
                "recipient": "mg-bot@example.com",
                "client-info": {**gmail_client, "bot": "gmail"},
            }
        },
    )
    assert _opens(engine) == {
        "gmail@example.com": False,
        "apple@example.com": True,
        "yahoo@example.com": True,
        "sg-gmail@example.com": False,
        "sg-flagged@example.com": True,
        "mg-gmail@example.com": False,
        "mg-bot@example.com": True,
    }


def test_a_gmail_open_counts_in_the_open_rate(engine: Engine, database_url: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Three delivered welcomes, opened through Gmail's proxy, Apple MPP and Yahoo's proxy:
    one human open of three (it was none of three)."""
    people = {"gmail": "pm-g", "apple": "pm-a", "yahoo": "pm-y"}
    for n, (who, message) in enumerate(people.items()):
        seed_sent_message(
            engine,
            provider="postmark",
            event_id=f"01KDVDNA0097KG8C0MA99JE5Z{n}",
            recipient=f"{who}@example.com",
            provider_message_id=message,
        )
    agents = {
        "gmail": {"UserAgent": GMAIL},
        "apple": {"UserAgent": "Mozilla/5.0", "Geo": {"IP": "17.58.63.11"}},
        "yahoo": {"UserAgent": "YahooMailProxy; https://help.yahoo.com"},
    }
    _deliver(
        engine,
        POSTMARK,
        *[_postmark("delivery", f"{w}@example.com", m) for w, m in people.items()],
        *[_postmark("open", f"{w}@example.com", m, **agents[w]) for w, m in people.items()],
    )
    path = tmp_path / "warehouse.duckdb"
    resources = {
        "email_database": AppDatabase(url=database_url),
        "email_warehouse": Warehouse(path=str(path)),
    }
    assert materialize([analytics_warehouse], resources=resources).success
    rates = warehouse.template_rates(path)
    assert rates.rate("open_rate", "welcome") == 1 / 3
    assert rates.rate("machine_open_rate", "welcome") == 2 / 3


def test_reprocess_rejudges_gmail_opens_stored_under_the_old_rule(
    engine: Engine, database_url: str
) -> None:
    """Opens ingested when Gmail's proxy counted as a machine become people's opens after
    ``webhooks reprocess --since`` and the next ingestion."""
    current = registry.get("postmark")

    def old_rule(body: bytes) -> list[Any]:
        return [
            dataclasses.replace(e, machine_open=True) if e.event_type == "opened" else e
            for e in current.normalize(body)
        ]

    old = {"postmark": dataclasses.replace(current, normalize=old_rule)}
    client = receiver(engine, POSTMARK)
    payload = _postmark("open", "gmail@example.com", "pm-1", UserAgent=GMAIL)
    assert post(client, POSTMARK, POSTMARK.sign(json.dumps(payload).encode())).status_code < 300
    ids = [row.inbox_id for row in inbox_rows(engine)]
    WebhookIngestor(engine, providers=old).run(ids, run_id="old-rule")
    assert _opens(engine) == {"gmail@example.com": True}

    result = CliRunner().invoke(
        main,
        ["webhooks", "reprocess", "--since", "2020-01-01"],
        env={"EMAIL_PLATFORM_DATABASE_URL": database_url},
    )
    assert result.exit_code == 0, result.output
    assert _opens(engine) == {}  # dropped; the inbox sensor's next run rebuilds them
    ingest(engine, POSTMARK)
    assert _opens(engine) == {"gmail@example.com": False}
