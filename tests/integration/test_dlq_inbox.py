"""Dead letters as an inbox: ``dlq list`` says what failed, how often and what the mail was,
never an address; letters past their message's expiry are closed as ``expired`` by a sweep
that ends them exactly as a replay through the send path does, and a replay refuses them."""

import json
import re
from datetime import timedelta
from types import SimpleNamespace

from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import insert, select, update

from email_platform.cli import main
from email_platform.common.timeutil import utcnow
from email_platform.db.schema import dead_letters as letters_table
from email_platform.db.schema import email_messages, email_outbox
from email_platform.operating.admin import requeue_dead_letters
from email_platform.operating.retention import expire_dead_letters
from email_platform.publishing import publisher
from email_platform.store import dead_letters
from tests.hostile_support import hostile_settings
from tests.support import (
    dead_letters_of,
    event,
    messages_of,
    publish_one,
    routes_ahead,
    run_send,
    signup,
)

RAW = ("jane+reject@example.com", "bob@example.net", "zed.q@example.org")


def _dlq(*args: str) -> str:
    result = CliRunner().invoke(main, ["dlq", *args])
    assert result.exit_code == 0, result.output
    return result.output


def _digest(engine, address: str, **kwargs) -> str:  # type: ignore[no-untyped-def]
    return publish_one(
        engine,
        event_type="digest.ready",
        aggregate_id=address,
        payload={"email": address, "first_name": "Jo", "highlights": ["a"]},
        **kwargs,
    )


def test_list_shows_error_attempts_and_a_masked_summary(engine, database_url, sandbox):
    rejected = signup(engine, "u1", email=RAW[0])
    with engine.begin() as connection:  # a version nobody routes: dead before any message
        newer = publisher.publish(
            connection,
            event_type="user.signed_up",
            event_version=3,
            aggregate_id="u2",
            payload={"user_id": "u2", "email": RAW[1], "first_name": "Bo"},
            routes=routes_ahead("user.signed_up", 3),  # a producer ahead of the worker
        )
    assert not run_send(database_url, sandbox.base_url, "transactional", [rejected, newer]).success
    with engine.begin() as connection:  # a provider error that quotes the address it refused
        connection.execute(
            insert(letters_table).values(
                event_id=newer,
                lane="transactional",
                reason="provider_rejected",
                last_error=f"550 5.1.1 <{RAW[2]}>: user unknown\r\nX-Injected: yes",
                attempts=3,
                created_at=utcnow(),
            )
        )

    text = _dlq("list", "--url", database_url)
    blocks: list[str] = []  # one per letter: its line, then its indented detail lines
    for line in text.splitlines():
        if line.startswith("        ") and blocks:
            blocks[-1] += "\n" + line
        else:
            blocks.append(line)
    assert len([line for line in text.splitlines() if " open " in line]) == 3
    (welcome,) = [b for b in blocks if "welcome for user.signed_up v2" in b]
    assert "to j***@example.com" in welcome and "attempts=1" in welcome
    assert "provider_rejected" in welcome and "error: HTTP 422" in welcome
    assert "expires 20" in welcome  # the welcome route's three days to live
    (unrouted,) = [b for b in blocks if "unknown_event_version" in b]
    assert "(no message) for user.signed_up v3 to b***@example.net" in unrouted
    assert "attempts=0" in unrouted and "newer than the routed v2" in unrouted
    quoted = [line for line in text.splitlines() if "550 5.1.1" in line]
    assert quoted == ["        error: 550 5.1.1 <[address]>: user unknown  X-Injected: yes"]

    listed = json.loads(_dlq("list", "--json", "--url", database_url))
    shown = sorted((d["recipient"].split(" #")[0], d["attempts"]) for d in listed)
    assert shown == [("b***@example.net", 0), ("b***@example.net", 3), ("j***@example.com", 1)]
    # Both letters of bob's event carry his address: one tag, not jane's.
    tags = {d["attempts"]: d["recipient"].split(" #")[1] for d in listed}
    assert tags[0] == tags[3] != tags[1]
    for output in (text, json.dumps(listed)):
        for address in RAW:
            assert address not in output
            assert address.split("@")[0] not in output

    assert "no dead letters" in _dlq("list", "--status", "expired", "--url", database_url)
    assert _dlq("list", "--lane", "bulk", "--url", database_url).strip() == "no dead letters"


def _letter(address: str, error: str) -> SimpleNamespace:
    return SimpleNamespace(
        dead_letter_id=1,
        status="open",
        lane="bulk",
        reason="provider_rejected",
        error_code="invalid_recipient",
        last_error=error,
        attempts=2,
        event_id="01EVENT",
        message_id=5,
        run_id="r",
        created_at=utcnow(),
        resolved_at=None,
        template="weekly_digest",
        recipient=address,
        event_type="digest.ready",
        event_version=1,
        payload={"email": address},
        expires_at=None,
    )


@given(
    # A local part of only '*' reads the same as its own mask ("*@x" is inside "****@x").
    address=st.emails().filter(lambda a: a.rpartition("@")[0].strip("*")),
    before=st.text(max_size=40),
    after=st.text(max_size=40),
    shape=st.sampled_from(["plain", "angle", "upper", "mailto"]),
)
@hostile_settings(200)
def test_no_summary_field_holds_the_address_or_a_line_break(address, before, after, shape):
    mention = {
        "plain": address,
        "angle": f"<{address}>",
        "upper": address.upper(),
        "mailto": f"mailto:{address}",
    }[shape]
    row = _letter(address, f"{before}{mention}{after}")
    shown = dead_letters.summary(row, utcnow())
    for key, value in shown.items():
        if isinstance(value, str):
            assert address.lower() not in value.lower(), key
            assert all(c.isprintable() for c in value), key
    domain = address.rpartition("@")[2]
    first, rest = shown["recipient"].split("@", 1)
    assert len(first) == 4 and first.endswith("***") and rest == domain.lower()


@given(value=st.one_of(st.none(), st.integers(), st.text(max_size=60)))
@hostile_settings(200)
def test_a_mask_is_one_short_printable_line_or_nothing(value):
    masked = dead_letters.mask_address(value)
    if not isinstance(value, str) or not value.strip():
        assert masked is None
        return
    assert masked == "***" or masked.split("@")[0][1:] == "***"
    assert all(c.isprintable() for c in masked) and len(masked) <= 260


def _state(engine, event_id: str) -> tuple:  # type: ignore[no-untyped-def]
    (letter,) = dead_letters_of(engine, event_id)
    (message,) = messages_of(engine, event_id) or [None]
    row = event(engine, event_id)
    return (
        letter.status,
        letter.resolved_at is not None,
        message.status if message else None,
        (message.last_error or "").startswith("expired at ") if message else None,
        row.status,
        row.resolution,
    )


def test_the_sweep_expires_only_letters_past_their_time_to_live(engine, database_url, sandbox):
    now = utcnow()
    route_ttl = _digest(engine, "a+reject@example.org")  # the digest route: two days
    hour = _digest(engine, "b+reject@example.org", expires_at=now + timedelta(hours=1))
    with engine.begin() as connection:  # fails before any message; its event lives a day
        unrouted = publisher.publish(
            connection,
            event_type="digest.ready",
            event_version=9,
            aggregate_id="c",
            payload={"email": "c@example.org"},
            expires_at=now + timedelta(days=1),
            routes=routes_ahead("digest.ready", 9),
        )
        forever = publisher.publish(
            connection,
            event_type="digest.ready",
            event_version=9,
            aggregate_id="d",
            payload={"email": "d@example.org"},
            routes=routes_ahead("digest.ready", 9),
        )
    ids = [route_ttl, hour, unrouted, forever]
    assert not run_send(database_url, sandbox.base_url, "bulk", ids).success

    assert expire_dead_letters(engine, now=now + timedelta(minutes=30)) == 0
    assert expire_dead_letters(engine, now=now + timedelta(hours=2)) == 1
    assert _state(engine, hour) == ("expired", True, "expired", True, "done", "expired")
    assert _state(engine, route_ttl)[0] == "open" and event(engine, route_ttl).status == "dead"
    assert expire_dead_letters(engine, now=now + timedelta(days=3)) == 2
    assert _state(engine, route_ttl) == ("expired", True, "expired", True, "done", "expired")
    assert _state(engine, unrouted) == ("expired", True, None, None, "done", "expired")
    # An event without an expiry never expires.
    assert expire_dead_letters(engine, now=now + timedelta(days=3650)) == 0
    assert _state(engine, forever)[0] == "open"


def _past_expiry(engine, event_ids: list[str]) -> None:  # type: ignore[no-untyped-def]
    """Time passes: the messages' time to live ran out a second ago."""
    with engine.begin() as connection:
        connection.execute(
            update(email_messages)
            .where(email_messages.c.event_id.in_(event_ids))
            .values(expires_at=utcnow() - timedelta(seconds=1))
        )


def test_the_sweep_ends_a_letter_as_a_replay_through_the_send_path_does(
    engine, database_url, sandbox
):
    replayed = _digest(engine, "p+reject@example.org")
    swept = _digest(engine, "q+reject@example.org")
    assert not run_send(database_url, sandbox.base_url, "bulk", [replayed, swept]).success
    _past_expiry(engine, [replayed, swept])

    requeue_dead_letters(engine, dead_letters_of(engine, replayed))
    assert run_send(database_url, sandbox.base_url, "bulk", [replayed]).success
    (letter,) = dead_letters_of(engine, swept)
    assert expire_dead_letters(engine, dead_letter_ids=[letter.dead_letter_id]) == 1

    assert _state(engine, swept) == _state(engine, replayed)
    assert _state(engine, swept) == ("expired", True, "expired", True, "done", "expired")
    # Closed: a replay of it finds nothing open, and nothing is requeued.
    output = _dlq("replay", str(letter.dead_letter_id), "--url", database_url)
    assert "no open dead letters matched" in output
    assert event(engine, swept).status == "done"


def test_replay_closes_expired_letters_instead_of_requeueing_them(engine, database_url, sandbox):
    stale = _digest(engine, "s+reject@example.org")
    fresh = _digest(engine, "f+reject@example.org")
    assert not run_send(database_url, sandbox.base_url, "bulk", [stale, fresh]).success
    _past_expiry(engine, [stale])

    output = _dlq("replay", "--all", "--url", database_url)
    assert "1 dead letter(s) past their expiry marked expired, not replayed" in output
    assert "requeued 1 event(s) for 1 dead letter(s)" in output
    assert _state(engine, stale) == ("expired", True, "expired", True, "done", "expired")
    assert event(engine, fresh).status == "pending"
    assert dead_letters_of(engine, fresh)[0].status == "open"  # closed once it is sent

    listed = json.loads(_dlq("list", "--status", "any", "--json", "--url", database_url))
    assert {(d["event_id"], d["status"], d["past_expiry"]) for d in listed} == {
        (stale, "expired", False),
        (fresh, "open", False),
    }
    with engine.connect() as connection:
        assert (
            connection.execute(
                select(email_outbox.c.status).where(email_outbox.c.event_id == stale)
            ).scalar_one()
            == "done"
        )


def test_list_marks_an_open_letter_past_its_expiry(engine, database_url, sandbox):
    stale = _digest(engine, "t+reject@example.org")
    assert not run_send(database_url, sandbox.base_url, "bulk", [stale]).success
    _past_expiry(engine, [stale])
    assert "(past expiry)" in _dlq("list", "--url", database_url)
    (shown,) = json.loads(_dlq("list", "--json", "--url", database_url))
    assert shown["past_expiry"] is True and shown["template"] == "weekly_digest"
    assert shown["recipient"].split(" #")[0] == "t***@example.org"


@given(
    first=st.emails().filter(lambda a: a.rpartition("@")[0].strip("*")),
    second=st.emails(),
    key=st.binary(min_size=32, max_size=32),
)
@hostile_settings(200)
def test_a_tagged_mask_tells_addresses_apart_without_holding_one(first, second, key):
    tagged = dead_letters.mask_address(first, key)
    assert first.lower() not in tagged.lower() and all(c.isprintable() for c in tagged)
    masked, tag = tagged.split(" #")
    assert masked == dead_letters.mask_address(first) and re.fullmatch(r"[0-9a-f]{6}", tag)
    # The same address (any case, any surrounding blanks) reads the same; another reads apart
    # (six hex digits: a clash is one in 16.7 million, below what 200 examples can hit).
    assert dead_letters.mask_address(f" {first.upper()} ", key).split(" #")[1] == tag
    if first.strip().lower() != second.strip().lower():
        assert dead_letters.mask_address(second, key).split(" #")[1] != tag
    # Another database's key gives another tag: a tag checks no guess without the key.
    assert dead_letters.mask_address(first, bytes(32)).split(" #")[1] != tag or key == bytes(32)
