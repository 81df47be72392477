"""Erasure's parts, on SQLite and PostgreSQL where they touch storage: an event a worker holds is
cancelled and never sent, the suppression survives only as a keyed hash that every check still
finds, and how addresses are found in and taken out of free text."""

import dataclasses
import hashlib
import hmac

from sqlalchemy import insert, select

from email_platform.common.lanes import DEFAULT_LANE_CONFIGS, Lane
from email_platform.common.timeutil import utcnow
from email_platform.db.schema import suppressions as suppression_table
from email_platform.observability.redaction import loggable, mentions, scrub
from email_platform.operating import admin
from email_platform.operating.erasure import erase
from email_platform.providers.sandbox import SandboxProvider
from email_platform.store import outbox, privacy_keys, suppressions
from tests.support import (
    batch_sender,
    event,
    messages_of,
    publish_one,
    run_send,
    sandbox_messages,
    signup,
)


def test_an_event_a_worker_holds_is_cancelled_and_never_sent(engine, sandbox):
    held = signup(engine, "u1", email="held.person@example.com")
    other = signup(engine, "u2")
    provider = SandboxProvider(sandbox.base_url, max_connections=2)
    lane = dataclasses.replace(DEFAULT_LANE_CONFIGS[Lane.TRANSACTIONAL], retry_delay_s=0.01)
    sender = batch_sender(engine, provider, lane)
    try:
        # Claimed and prepared (keys committed), about to go to the provider: then erased.
        batch = sender.claim([held, other], run_id="run-1")
        assert len(batch.work) == 2
        report = erase(engine, email="held.person@example.com")
        assert (report.cancelled_events, report.cancelled_in_flight) == (1, 1)
        assert report.cancelled_messages == 1
        outcome = sender.deliver(batch, run_id="run-1")
        assert outcome.sent == 1
        assert [m["metadata"]["event_id"] for m in sandbox_messages(sandbox.base_url)] == [other]
        assert event(engine, held).status == "cancelled"
        (message,) = messages_of(engine, held)
        assert (message.status, message.recipient) == ("cancelled", None)
        # Nothing takes it up again: another run, the release of a dead run, a replay.
        assert sender.run([held], run_id="run-2").claimed == []
        with engine.begin() as connection:
            assert outbox.release_run(connection, "run-1") == []
            assert outbox.requeue(connection, [held]) == 0
        assert event(engine, held).status == "cancelled"
    finally:
        provider.close()
    counts = admin.status(engine)
    assert counts["events"]["cancelled"] == 1 and counts["messages"]["cancelled"] == 1
    assert counts["lanes"]["transactional"]["depth"] == 0


def test_an_erased_suppression_is_a_keyed_hash_every_check_finds(engine):
    now = utcnow()
    with engine.begin() as connection:
        suppressions.add(
            connection, "Hash.Me@example.com", reason="unsubscribe", source="webhook:x", now=now
        )
    report = erase(engine, email="hash.me@example.com")
    assert (report.suppressions_hashed, report.suppressions_added) == (1, 0)
    with engine.begin() as connection:
        (row,) = connection.execute(select(suppression_table)).all()
        key = privacy_keys.get(connection, privacy_keys.SUPPRESSION)
        assert key is not None and len(key) == 32
        digest = hmac.new(key, b"hash.me@example.com", hashlib.sha256).hexdigest()
        assert row.address == f"hmac:{digest}"
        # Keyed: not the plain digest anyone could compute from a list of addresses.
        assert row.address != "hmac:" + hashlib.sha256(b"hash.me@example.com").hexdigest()
        assert (row.reason, row.source) == ("erased", "erasure; was unsubscribe from webhook:x")
        assert suppressions.reasons_for(
            connection, ["HASH.ME@example.com", "other@example.com"]
        ) == {"hash.me@example.com": "erased"}
        # A late bounce of an erased person's mail does not write the address back.
        assert not suppressions.add(
            connection, "hash.me@example.com", reason="complaint", source="webhook:x", now=now
        )
        assert connection.execute(select(suppression_table.c.address)).scalars().all() == [
            row.address
        ]
        # A plain row written beside the hash some other way is folded into it.
        connection.execute(
            insert(suppression_table).values(
                address="hash.me@example.com", reason="manual", source="ops", created_at=now
            )
        )
        assert suppressions.erase(connection, "hash.me@example.com", now) == (1, 0)
        assert suppressions.erase(connection, "hash.me@example.com", now) == (0, 0)
        assert connection.execute(select(suppression_table.c.address)).scalars().all() == [
            row.address
        ]


def test_an_address_never_seen_is_suppressed_by_its_hash(engine, database_url, sandbox):
    report = erase(engine, email="never.seen@example.com")
    assert report.total == 1 and report.suppressions_added == 1
    assert erase(engine, email="never.seen@example.com").total == 0
    later = signup(engine, "u1", email="never.seen@example.com")
    assert run_send(database_url, sandbox.base_url, "transactional", [later]).success
    assert messages_of(engine, later)[0].status == "suppressed"
    assert sandbox_messages(sandbox.base_url) == []


def test_a_password_reset_to_an_erased_address_is_suppressed(engine, database_url, sandbox):
    signup(engine, "u1", email="reset.person@example.com")  # the product still has the user
    erase(engine, email="reset.person@example.com")
    reset = publish_one(
        engine,
        event_type="user.password_reset_requested",
        aggregate_id="u1",
        payload={"user_id": "u1", "reset_token": "t1"},
    )
    run_send(database_url, sandbox.base_url, "critical", [reset])
    assert messages_of(engine, reset)[0].status == "suppressed"


def test_mentions_finds_the_address_alone_in_any_case_or_percent_encoded() -> None:
    address = "zelda.quux+tag@example.org"
    assert mentions("Zelda <ZELDA.QUUX+TAG@Example.org>.", address)
    assert mentions("https://x.example/u?e=zelda.quux%2Btag%40example.org", address)
    assert not mentions("xzelda.quux+tag@example.org", address)  # someone else
    assert not mentions("zelda.quux+tag@example.org.uk", address)
    assert not mentions("zelda.quux@example.org", address)


def test_scrub_takes_out_the_address_and_its_local_parts() -> None:
    text = "550 <Zelda.Quux+tag@example.org>: user zelda.quux+tag (zelda.quux) unknown"
    assert scrub(text, ["zelda.quux+tag@example.org"]) == (
        "550 <[erased]>: user [erased] ([erased]) unknown"
    )
    assert scrub("HTTP 503: provider error", ["ab@example.org"]) == "HTTP 503: provider error"
    assert scrub(None, ["ab@example.org"]) is None


def test_log_lines_carry_no_address() -> None:
    refusal = "HTTP 422: Invalid 'To' address: 'someone.else@example.com'."
    assert loggable(refusal) == "HTTP 422: Invalid 'To' address: '[address]'."
    assert loggable("mailbox zelda.quux unknown", "zelda.quux@example.org") == (
        "mailbox [erased] unknown"
    )
